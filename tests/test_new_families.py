"""Issue 22's families, what the family-generic tests do not cover (those pick every family up: the pipeline-step
driver in test_families.py, model-level CP parity at every layout in test_cp_models.py, prepare + trainer CP run +
LoRA reload in test_families_e2e.py, the real configs and recipes in test_real_models.py).

Chroma (`chroma`): (1) the pipeline's float joint mask is live (the output depends on it, so the CP parity runs test
a mask that matters), and its plan's `joint_key_mask` is what makes it exact: without it the first CP forward is
refused on every rank with one line naming the plan key.
Wan 2.2 I2V A14B (`wan22_i2v`): (2) the cache's condition latents are WanImageToVideoPipeline's own for the same
image, with no image embeddings; (3) each expert's sigmas fall on its side of the shipped boundary_ratio 0.9.
Cosmos Predict 2.5 (`cosmos`): (4) the cache's clean conditioning frames, condition-mask channel and per-frame
timestep are what Cosmos2_5_PredictBasePipeline passes for the same clip as a video2world input; CP is exact with
the plan's attn1 processor swap and wrong without it.
Wan VACE (`wan_vace`): (5) the cache's control latents are what WanVACEPipeline hands its transformer for a partial
mask and two reference images (the test_families.py driver covers the data path's control video with no mask), and
its R + F latent frames are the frames the pipeline denoises; (6) the control stream is live: the output and the
control blocks' gradients depend on it.
Z-Image (`zimage`): (7) the cache's caption features, read back as the trainer's `cap_feats`, are
ZImagePipeline._encode_prompt's per-prompt tensors (chat template, hidden_states[-2], padding dropped) for prompts of
different lengths; (8) 30 heads (the real model's count) split unevenly over 4 and 7 Ulysses ranks equal the serial
pipeline-form step.
HunyuanImage 2.1 (`hunyuanimage`): (9) the cache's Qwen and ByT5 text is HunyuanImagePipeline.encode_prompt's for
prompts of different lengths, one quoting glyph text, and the tiny tokenizer drops exactly the template; the distilled
checkpoint's config is refused.
Kandinsky 5 T2V (`kandinsky5`): (10) the cache's unpadded Qwen2.5-VL rows and pooled CLIP embedding are
Kandinsky5T2VPipeline.encode_prompt's for prompts of different lengths, the template crop keeping exactly the caption;
(11) the family's float32-RoPE processor is the stock one less its bfloat16 rounding (bit-identical under bf16), and
it is what makes CP exact: with the stock processor CP 2 is off by bfloat16 steps.
Qwen-Image 2.1 (`qwenimage21`): (12) each caption's cache is QwenImage21Pipeline.encode_prompt's rows of it in a batch
of prompts of different lengths (the template's system turn dropped, the user turn kept), and the trainer's forward
kwargs of the collated cache, padded further as a cache pads it, are the batch's encode_prompt output exactly.
Wan Animate (`wan_animate`): (13) train.prepare's cache of media folder items (clip, reference image, pose and face
videos, a renamed column) is what WanAnimatePipeline hands its transformer for the same files in its first segment, the
latents' first frame the reference image's; items without a pose video, or with an unreadable face video, are bad
(the test_families.py driver runs the encoder's conditioning through one pipeline step).
Kandinsky 5 I2V (`kandinsky5_i2v`): (14) the cache's latent frame 0 is Kandinsky5I2VPipeline.prepare_latents' image
latents of the clip's first frame (encoded alone, posterior sampled as the pipeline samples it), not the clip's own
latent frame 0; training keeps it clean and out of the loss; the I2V text is the T2V pipeline's (the test_families.py
driver checks the condition channels, the shared timestep and the frames-1.. step against the pipeline).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import diffusers
import torch

from tests.harness import rank_job
from train import objective
from train.config import load_recipe
from train.models import expert_sigma_range, get_encoder, get_family, pipeline_boundary_ratio
from train.tools.tiny_models import build_model, family_case

REPO = Path(__file__).resolve().parents[1]
I2V_A14B = "Wan-AI/Wan2.2-I2V-A14B-Diffusers"


# (1) Chroma's mask ----------------------------------------------------------------------------------------------------


@torch.no_grad()
def test_chroma_mask_is_live() -> None:
    case = family_case("chroma", seed=1, batch_size=2)
    mask = case.kwargs["attention_mask"]
    text = case.kwargs["encoder_hidden_states"].shape[1]
    assert mask.dtype == torch.float32 and mask.shape == (2, text + case.kwargs["hidden_states"].shape[1])
    assert not mask[:, :text].all() and mask[:, text:].all()  # padded text, then the image's ones
    model = build_model("chroma").eval()
    masked = model(**case.kwargs, return_dict=False)[0]
    unmasked = model(**{**case.kwargs, "attention_mask": None}, return_dict=False)[0]
    assert (masked - unmasked).abs().max() > 1e-3


@rank_job(2)
def _chroma_without_joint_mask(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    from train.cp import enable_context_parallel
    from train.cp.masks import MaskPlacementError
    from train.cp.plans import plan_for
    from train.tools.oracle import run_step

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("ring", "ulysses"))
    plan = dataclasses.replace(plan_for("ChromaTransformer2DModel"), joint_key_mask=())
    model = build_model("chroma")
    enable_context_parallel(model, mesh=mesh, plan=plan)
    try:
        run_step(model, family_case("chroma", seed=1, batch_size=2))
    except MaskPlacementError as e:
        return str(e)
    return ""


def test_chroma_joint_mask_without_its_declaration_is_refused(group) -> None:
    for rank, said in enumerate(group(_chroma_without_joint_mask, 2)):
        assert "joint_key_mask" in said and "would mask the wrong keys" in said, (rank, said)
        assert "\n" not in said


# (2) Wan 2.2 I2V A14B: the cache is the pipeline's condition ----------------------------------------------------------


@torch.no_grad()
def test_wan22_i2v_cache_is_the_pipelines_condition(tiny_pipeline) -> None:
    from PIL import Image

    path = tiny_pipeline("wan22_i2v")
    encoder = get_encoder("wan22_i2v")
    encoder.load(str(path))
    clip = torch.rand(3, 9, 32, 48, generator=torch.Generator().manual_seed(7)) * 2 - 1
    pixels = ((clip[:, 0].permute(1, 2, 0) + 1) * 127.5).round().byte()
    clip[:, 0] = pixels.permute(2, 0, 1) / 127.5 - 1  # an 8-bit frame 0: the image the pipeline is given
    cached = encoder.encode_media(clip, None, "mode", None)
    assert set(cached) == {"latents", "condition_latents"}  # no image encoder, no image embeddings
    pipe = diffusers.WanImageToVideoPipeline.from_pretrained(path)
    assert pipe.image_encoder is None and pipe.transformer.config.image_dim is None
    pre = pipe.video_processor.preprocess(Image.fromarray(pixels.numpy()), height=32, width=48).float()
    _, condition = pipe.prepare_latents(pre, 1, pipe.vae.config.z_dim, 32, 48, 9, torch.float32, "cpu", None,
                                        torch.zeros(1, *cached["latents"].shape))  # fmt: skip
    torch.testing.assert_close(cached["condition_latents"], condition[0, 4:], rtol=1e-5, atol=1e-5)
    assert encoder.text_tokens(None) == 512 and encoder.text_tokens(16) == 16  # no image context: any text length


# (3) Wan 2.2 I2V A14B: each expert's sigmas --------------------------------------------------------------------------


def test_wan22_i2v_expert_sigmas_fall_in_their_range() -> None:
    spec = get_family("wan22_i2v")
    assert spec.experts == ("transformer", "transformer_2") and spec.shift.shift == 5.0
    assert pipeline_boundary_ratio("wan22_i2v", I2V_A14B) == 0.9  # the shipped model_index.json
    model = load_recipe(REPO / "recipes/wan22_i2v/a14b_high_noise_lora.yaml").model
    for subfolder, high in (("transformer", True), ("transformer_2", False)):
        lo, hi = expert_sigma_range(spec, model.model_copy(update={"subfolder": subfolder}))
        assert (lo, hi) == ((0.9, 1.0) if high else (0.0, 0.9))
        s = objective.sample_stream_sigmas(4096, spec, sigma_range=(lo, hi),
                                           generator=torch.Generator().manual_seed(0))["latents"]  # fmt: skip
        t = s.double() * 1000  # WanImageToVideoPipeline: transformer while t >= boundary_ratio * 1000
        assert bool(((t >= 900) if high else (t < 900)).all()), (subfolder, s.min(), s.max())


# (4) Cosmos Predict 2.5: the cache is the pipeline's video2world condition; the attn1 processor makes CP exact -------


@torch.no_grad()
def test_cosmos_cache_is_the_pipelines_video2world_condition(tiny_pipeline, monkeypatch) -> None:
    """The encoder's cache of a clip whose first 2 latent frames it made clean equals, through the spec, what
    Cosmos2_5_PredictBasePipeline passes its transformer when given the clip's first 5 frames as its conditioning
    video (num_latent_conditional_frames=2): clean frames (the VAE mode of the padded video), the condition-mask
    channel, the per-frame timestep (1e-4 on the clean frames)."""
    from train.models.cosmos.encoder import condition_frames

    path = tiny_pipeline("cosmos")
    encoder = get_encoder("cosmos")
    encoder.load(str(path))
    frames, height, width = 9, 32, 48  # 3 latent frames
    clips = (
        torch.rand(3, frames, height, width, generator=torch.Generator().manual_seed(s)) * 2 - 1 for s in range(64)
    )
    clip = next(c for c in clips if condition_frames(None, c, 3) == 2)  # a clip the encoder makes video2world
    cached = encoder.encode_media(clip, None, "mode", None)
    assert cached["condition_mask"].tolist() == [True, True, False]
    batch = {"latents": cached["latents"][None], "condition_mask": cached["condition_mask"][None],
             "prompt_embeds": encoder.encode_text("a red square", 512)["prompt_embeds"][None]}  # fmt: skip
    pipe = diffusers.Cosmos2_5_PredictBasePipeline.from_pretrained(path, **encoder.pipeline_components(str(path), None))
    seen = []
    original = pipe.transformer.forward
    monkeypatch.setattr(pipe.transformer, "forward", lambda **kw: seen.append(kw) or original(**kw))
    noise = torch.randn(1, *cached["latents"].shape, generator=torch.Generator().manual_seed(0))
    pipe(video=clip[None, :, :5], prompt_embeds=batch["prompt_embeds"], latents=noise, height=height, width=width,
         num_frames=frames, num_latent_conditional_frames=2, guidance_scale=1.0, num_inference_steps=1,
         output_type="latent")  # fmt: skip
    spec, sigma = get_family("cosmos"), pipe.scheduler.sigmas[:1]
    cond = spec.conditioning(batch, noise)
    noisy = cond * batch["latents"] + (1 - cond) * noise  # the pipeline's latents, clean on the cached frames
    ours = spec.forward_kwargs(
        batch, noisy, objective.condition_sigmas(sigma, cond), model_config=pipe.transformer.config
    )
    for key in ("hidden_states", "condition_mask", "timestep", "encoder_hidden_states"):
        torch.testing.assert_close(ours[key], seen[0][key], rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
    timestep = seen[0]["timestep"].flatten()
    assert torch.equal(timestep[:2], torch.full((2,), 1e-4)) and float(timestep[2]) > 0.5  # clean, clean, noised


@rank_job(2)
def _cosmos_cp_without_the_processor_swap(rank: int, world: int) -> tuple[float, float]:
    from torch.distributed.device_mesh import init_device_mesh

    from train.cp import GradReduction, enable_context_parallel
    from train.cp.plans import plan_for
    from train.tools.oracle import compare, run_step

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("ring", "ulysses"))
    case = family_case("cosmos", seed=1, batch_size=2)
    serial = run_step(build_model("cosmos"), case)
    errors = []
    for swap in (True, False):
        plan = plan_for("CosmosTransformer3DModel")
        model = build_model("cosmos")
        state = enable_context_parallel(
            model, mesh=mesh, plan=plan if swap else dataclasses.replace(plan, cp_processors=None)
        )
        reduce = GradReduction("allreduce", cp_group=state.cp_group).reduce_gradients
        errors.append(compare(run_step(model, case, reduce=reduce), serial).grad)
    return errors[0], errors[1]


def test_cosmos_cp_is_exact_only_with_the_attn1_processor(group) -> None:
    for with_swap, without in group(_cosmos_cp_without_the_processor_swap, 2):
        print(f"\ncosmos CP 2 gradient error: {with_swap:.1e} with the attn1 processor, {without:.1e} without")
        assert with_swap < 1e-5 and without > 1e-2, (with_swap, without)


# (5) Wan VACE: the cache is the pipeline's control stream -----------------------------------------------------------


@torch.no_grad()
def test_wan_vace_cache_is_the_pipelines_control(tiny_pipeline, monkeypatch) -> None:
    from PIL import Image

    path = tiny_pipeline("wan_vace")
    encoder = get_encoder("wan_vace")
    encoder.load(str(path))
    gen = torch.Generator().manual_seed(5)
    video = torch.randint(0, 256, (9, 3, 32, 48), generator=gen, dtype=torch.uint8)
    mask = torch.zeros(9, 3, 32, 48, dtype=torch.uint8)
    mask[:, :, 8:24, 5:37] = 255  # white = generate: a box, edges off the 8x8 cells
    mask[6:] = 0  # the last frames kept whole
    refs = [
        Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=gen, dtype=torch.uint8).numpy())
        for h, w in ((20, 40), (40, 24))
    ]  # fmt: skip  (letterboxed onto white canvases by the pipeline)
    cached = encoder.control_latents(video, mask, refs)
    assert cached.shape == (72, 2 + 3, 4, 6)  # [inactive | reactive | 64 mask cells], 2 reference + 3 video frames

    pipe = diffusers.WanVACEPipeline.from_pretrained(path)
    seen = []
    original = pipe.transformer.forward
    monkeypatch.setattr(pipe.transformer, "forward", lambda **kw: seen.append(kw) or original(**kw))
    frames = lambda x: [Image.fromarray(f.permute(1, 2, 0).numpy()) for f in x]  # noqa: E731
    pipe(video=frames(video), mask=frames(mask), reference_images=refs, prompt_embeds=torch.zeros(1, 7, 16),
         height=32, width=48, num_frames=9, guidance_scale=1.0, num_inference_steps=1,
         output_type="latent")  # fmt: skip
    (kwargs,) = seen
    torch.testing.assert_close(kwargs["control_hidden_states"], cached[None], rtol=0, atol=0)
    assert kwargs["hidden_states"].shape[2] == cached.shape[1]  # the pipeline denoises R + F latent frames
    assert torch.equal(kwargs["control_hidden_states_scale"], torch.ones(2))
    mask_cells = cached[8:]
    assert not mask_cells[:, :2].any() and mask_cells[:, 2:].any() and not mask_cells[:, 2:].all()


# (6) Wan VACE: the control stream is live -----------------------------------------------------------------------------


def test_wan_vace_control_stream_is_live() -> None:
    case = family_case("wan_vace", seed=1, batch_size=2)
    model = build_model("wan_vace").eval()
    out = model(**case.kwargs, return_dict=False)[0]
    with torch.no_grad():
        other = {**case.kwargs, "control_hidden_states": torch.zeros_like(case.kwargs["control_hidden_states"])}
        assert (model(**other, return_dict=False)[0] - out).abs().max() > 1e-3
        half = {**case.kwargs, "control_hidden_states_scale": torch.full((2,), 0.5)}
        assert (model(**half, return_dict=False)[0] - out).abs().max() > 1e-3
    out.square().mean().backward()
    grads = [p.grad for n, p in model.named_parameters() if n.startswith("vace_")]
    assert grads and all(g is not None and g.abs().max() > 0 for g in grads)


# (7) Z-Image: the cache is the pipeline's caption features ------------------------------------------------------------


@torch.no_grad()
def test_zimage_cache_is_the_pipelines_encode_prompt(tiny_pipeline) -> None:
    from train.data.dataset import collate

    path = tiny_pipeline("zimage")
    captions = ["a red square", "a blue circle moving up on a white background, then left"]
    encoder = get_encoder("zimage")
    encoder.load(str(path))
    tokens = encoder.text_tokens(None)
    cached = collate([encoder.encode_text(c, tokens) for c in captions])
    pipe = diffusers.ZImagePipeline.from_pretrained(path)
    theirs = pipe._encode_prompt(list(captions), device="cpu", max_sequence_length=tokens)  # one padded batch
    assert tokens == 512 and len({len(t) for t in theirs}) == 2  # the pipeline's default; two lengths kept
    latents = torch.zeros(2, 4, 4, 4)
    spec = get_family("zimage")
    ours = spec.forward_kwargs(cached, latents, torch.full([2], 0.5), model_config={})["cap_feats"]
    assert [tuple(t.shape) for t in ours] == [tuple(t.shape) for t in theirs]
    for mine, pipeline in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, pipeline, rtol=1e-5, atol=1e-6)


# (8) Z-Image: 30 heads over 4 and 7 Ulysses ranks ---------------------------------------------------------------------

ZIMAGE_30_HEADS = {"dim": 240, "n_heads": 30, "n_kv_heads": 30, "n_layers": 1}  # head dim 8, the real head count


@rank_job(4, 7)
def _zimage_30_heads(rank: int, world: int) -> tuple[float, float, float, str]:
    from torch.distributed.device_mesh import init_device_mesh

    from train.cp import GradReduction, enable_context_parallel
    from train.models import tiny_config
    from train.tools.oracle import compare, run_step
    from train.tools.probe import init_weights

    config = tiny_config("zimage") | ZIMAGE_30_HEADS

    def build() -> torch.nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return init_weights(diffusers.ZImageTransformer2DModel(**config), 0).train()

    inputs = family_case("zimage", seed=1, batch_size=2, model_config=config)
    serial = run_step(build(), inputs)
    model = build()
    state = enable_context_parallel(model, mesh=init_device_mesh("cpu", (1, world), mesh_dim_names=("ring", "ulysses")))
    cp = run_step(model, inputs, reduce=GradReduction("allreduce", cp_group=state.cp_group).reduce_gradients)
    errors = compare(cp, serial)
    return errors.out, errors.loss, errors.grad, errors.worst


def test_zimage_30_heads_on_4_and_7_ranks(group) -> None:
    assert 30 % 4 and 30 % 7  # uneven heads per rank
    for world in (4, 7):
        ranks = group(_zimage_30_heads, world)
        print(f"\nZ-Image 30 heads over {world} Ulysses ranks: max grad rel {max(r[2] for r in ranks):.2e}")
        for rank, (out, loss, grad, worst) in enumerate(ranks):
            assert out <= 1e-5 and loss <= 2e-5 and grad <= 2e-5, (world, rank, out, loss, grad, worst)


# (9) HunyuanImage 2.1: the cache is the pipeline's encode_prompt ----------------------------------------------------


@torch.no_grad()
def test_hunyuanimage_cache_is_the_pipelines_encode_prompt(tiny_pipeline) -> None:
    """Prompts of different lengths, one quoting glyph text, the empty one (caption dropout's): the family encoder's
    cache, collated, is HunyuanImagePipeline.encode_prompt of the batch (Qwen states after the template's dropped
    tokens, ByT5 states of the quoted text, zeros where nothing is quoted)."""
    from train.data.dataset import collate

    path = tiny_pipeline("hunyuanimage")
    encoder = get_encoder("hunyuanimage")
    encoder.load(str(path))
    prompts = ("a red square", 'a blue shop sign that reads "OPEN 24h" above a brick wall at night', "")
    cached = collate([encoder.encode_text(p, encoder.text_tokens(None)) for p in prompts])
    pipe = diffusers.HunyuanImagePipeline.from_pretrained(path)
    template = pipe.prompt_template_encode
    # the tiny tokenizer spells the template's prefix in the pipeline's 34 tokens: the drop removes it, and only it
    assert len(pipe.tokenizer(template[: template.index("{}")])["input_ids"]) == pipe.prompt_template_encode_start_idx
    embeds, mask, embeds_2, mask_2 = pipe.encode_prompt(prompt=list(prompts), device="cpu", batch_size=len(prompts))
    assert embeds.shape[1] == 1000 and embeds_2.shape[1] == 128  # tokenizer_max_length, tokenizer_2_max_length
    assert torch.equal(cached["prompt_mask"], mask.bool()) and torch.equal(cached["byt5_mask"], mask_2.bool())
    torch.testing.assert_close(cached["prompt_embeds"], embeds, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cached["byt5_embeds"], embeds_2, rtol=1e-5, atol=1e-6)
    assert len(set(mask.sum(1).tolist())) == 3  # three text lengths
    glyph = cached["byt5_mask"].any(1)
    assert glyph.tolist() == [False, True, False] and not cached["byt5_embeds"][~glyph].any()


def test_hunyuanimage_refuses_the_distilled_checkpoint() -> None:
    import pytest

    from train.models import tiny_config

    distilled = {**tiny_config("hunyuanimage"), "guidance_embeds": True, "use_meanflow": True}
    with pytest.raises(ValueError, match="distilled"):
        family_case("hunyuanimage", model_config=distilled)


# (10) Kandinsky 5: the cache is the pipeline's encode_prompt ----------------------------------------------------------


@torch.no_grad()
def test_kandinsky5_cache_is_the_pipelines_encode_prompt(tiny_pipeline) -> None:
    """Each caption's cache (unpadded Qwen2.5-VL rows, an all-true mask, CLIP's pooled output) equals
    Kandinsky5T2VPipeline.encode_prompt of the captions as one batch, which pads them to the longest: each sample's
    first cu_seqlens rows. The crop drops exactly the template's system part (the rows are the caption's tokens
    between the user header and <|im_end|>), the empty caption included."""
    path = tiny_pipeline("kandinsky5")
    encoder = get_encoder("kandinsky5")
    encoder.load(str(path))
    captions = ["a red square", "a blue circle moving up on a white background", ""]
    cached = [encoder.encode_text(c, encoder.text_tokens(None)) for c in captions]
    pipe = diffusers.Kandinsky5T2VPipeline.from_pretrained(path, **encoder.pipeline_components(str(path), None))
    qwen, pooled, cu_seqlens = pipe.encode_prompt(captions, max_sequence_length=512, device="cpu")
    lengths = cu_seqlens.diff().tolist()
    assert len(set(lengths)) == 3 and qwen.shape[1] == max(lengths)  # three lengths: the batch is padded
    for i, item in enumerate(cached):
        assert item["prompt_embeds"].shape[0] == lengths[i] and item["prompt_mask"].all()
        torch.testing.assert_close(item["prompt_embeds"], qwen[i, : lengths[i]], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(item["pooled_embeds"], pooled[i], rtol=1e-5, atol=1e-5)
    tokenizer, start = pipe.tokenizer.tokenizer, pipe.prompt_template_encode_start_idx
    for caption, n in zip(captions, lengths):
        kept = tokenizer(pipe.prompt_template.format(caption))["input_ids"][start:]
        assert len(kept) == n and tokenizer.decode(kept) == f"<|im_start|>user\n{caption}<|im_end|>"


# (11) Kandinsky 5: the float32-RoPE processor is the stock one without its bfloat16 rounding -------------------------


def _stock(model: torch.nn.Module) -> torch.nn.Module:
    from diffusers.models.transformers.transformer_kandinsky import Kandinsky5Attention, Kandinsky5AttnProcessor

    for module in model.modules():
        if isinstance(module, Kandinsky5Attention):
            module.set_processor(Kandinsky5AttnProcessor())
    return model


@torch.no_grad()
def test_kandinsky5_float32_rope_is_the_stock_processor_without_bfloat16_rounding(monkeypatch) -> None:
    """The family's processor (every model built for training has it) against diffusers' own: bit-identical under
    bf16 autocast (the queries are bf16 there: the stock rounding is a no-op); in fp32 they differ by the stock
    bfloat16 rounding of the rotated queries and keys, and only by it (rounding ours there gives the stock output)."""
    from train.models.kandinsky5 import attention

    case = family_case("kandinsky5", seed=1, batch_size=2)
    ours, stock = build_model("kandinsky5").eval(), _stock(build_model("kandinsky5")).eval()
    assert {type(m.processor) for m in ours.modules() if hasattr(m, "processor")} == {attention.Float32RopeProcessor}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(ours(**case.kwargs, return_dict=False), stock(**case.kwargs, return_dict=False))
    a, b = ours(**case.kwargs, return_dict=False), stock(**case.kwargs, return_dict=False)
    assert 0 < (a - b).abs().max() < 1e-2 * b.abs().max()  # bf16 rounding (2^-8 relative) of q and k, nothing more
    rotate = attention.rotate
    monkeypatch.setattr(attention, "rotate", lambda x, rope: rotate(x, rope).to(torch.bfloat16).to(x.dtype))
    assert torch.equal(ours(**case.kwargs, return_dict=False), b)


@rank_job(2)
def _kandinsky5_cp_with_the_stock_processor(rank: int, world: int) -> tuple[float, float]:
    from torch.distributed.device_mesh import init_device_mesh

    from train.cp import GradReduction, enable_context_parallel
    from train.tools.oracle import compare, run_step

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("ring", "ulysses"))
    case = family_case("kandinsky5", seed=1, batch_size=2)
    errors = []
    for prepare in (lambda m: m, _stock):  # the family's processor, then diffusers' own, serial and CP alike
        serial = run_step(prepare(build_model("kandinsky5")), case)
        model = prepare(build_model("kandinsky5"))
        reduce = GradReduction("allreduce", cp_group=enable_context_parallel(model, mesh=mesh).cp_group)
        errors.append(compare(run_step(model, case, reduce=reduce.reduce_gradients), serial).grad)
    return errors[0], errors[1]


def test_kandinsky5_cp_is_exact_only_with_the_float32_rope(group) -> None:
    for ours, stock in group(_kandinsky5_cp_with_the_stock_processor, 2):
        print(f"\nkandinsky5 CP 2 gradient error: {ours:.1e} with the float32-RoPE processor, {stock:.1e} stock")
        assert ours <= 2e-5 < 1e-4 < stock, (ours, stock)  # tests/test_cp_models.py's fp32 tolerance: 2e-5


# (12) Qwen-Image 2.1: the cache is the pipeline's encode_prompt -------------------------------------------------------


@torch.no_grad()
def test_qwenimage21_cache_is_the_pipelines_encode_prompt(tiny_pipeline) -> None:
    """Each caption's cache (its own Qwen3-VL rows, an all-true mask) equals QwenImage21Pipeline.encode_prompt of the
    captions as one batch, which pads them to the longest: each sample's first rows, which its mask marks; the rows
    are the user turn (the pipeline drops the system turn), the empty caption (caption dropout's) included. Collated
    and padded beyond the longest (a cache whose longest caption is longer), the spec's forward kwargs carry the
    batch's encode_prompt text and int64 mask exactly."""
    from train.data.dataset import collate, pad_text
    from train.models import tiny_config

    path = tiny_pipeline("qwenimage21")
    encoder = get_encoder("qwenimage21")
    encoder.load(str(path))
    captions = ["a red square", "a blue circle moving up on a white background", ""]
    cached = [encoder.encode_text(c, encoder.text_tokens(None)) for c in captions]
    pipe = diffusers.QwenImage21Pipeline.from_pretrained(path, **encoder.pipeline_components(str(path), None))
    embeds, mask, image_pad_mask = pipe.encode_prompt(captions, device="cpu")
    lengths = mask.sum(1).tolist()
    assert len(set(lengths)) == 3 and embeds.shape[1] == max(lengths) and not image_pad_mask.any()
    for i, item in enumerate(cached):
        assert item["prompt_embeds"].shape[0] == lengths[i] and item["prompt_mask"].all()
        torch.testing.assert_close(item["prompt_embeds"], embeds[i, : lengths[i]], rtol=1e-5, atol=1e-5)
    tokenizer = pipe.processor.tokenizer
    for caption, n in zip(captions, lengths):
        kept = tokenizer(pipe.prompt_template_t2i.format(caption or " "))["input_ids"][pipe._drop_idx :]
        assert len(kept) == n
        assert tokenizer.decode(kept) == f"<|im_start|>user\n{caption or ' '}<|im_end|>\n<|im_start|>assistant\n"
    batch = collate([pad_text(item, max(lengths) + 5) for item in cached])
    noisy = torch.zeros(3, 4, 1, 2, 4)
    kwargs = get_family("qwenimage21").forward_kwargs(batch, {"latents": noisy}, torch.full((3,), 0.5),
                                                      model_config=tiny_config("qwenimage21"))  # fmt: skip
    torch.testing.assert_close(kwargs["encoder_hidden_states"], embeds, rtol=1e-5, atol=1e-5)
    assert torch.equal(kwargs["encoder_hidden_states_mask"], mask)


# (13) Wan Animate: the prepared cache is the pipeline's first segment -------------------------------------------------


def _frames(video: Path) -> list:
    """A video file's frames as PIL images, decoded by PyAV: what a user hands the pipeline."""
    import av

    with av.open(str(video)) as container:
        return [frame.to_image() for frame in container.decode(video=0)]


@torch.no_grad()
def test_wan_animate_cache_is_the_pipelines_first_segment(tiny_pipeline, tmp_path: Path, monkeypatch) -> None:
    import json

    import pytest
    from PIL import Image
    from safetensors.torch import load_file

    from train.config import recipe_from_dict
    from train.data.dataset import sample_path
    from train.data.synthetic_media import make_media_set
    from train.prepare import PrepareError, prepare

    path, media = tiny_pipeline("wan_animate"), tmp_path / "media"
    rows = make_media_set(media, num_videos=4, frames=9, height=32, width=48, references=True,
                          conditions=("pose_video", "face_video"))  # fmt: skip
    for row in rows:
        row["pose"] = row.pop("pose_video")  # read through data.condition_columns
    del rows[2]["pose"]
    (media / rows[3]["face_video"]).write_bytes(b"not a video")
    (media / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = {
        "model": {"family": "wan_animate", "pretrained_path": str(path), "dtype": "float32"},
        "data": {"source": str(media), "cache_dir": str(tmp_path / "cache"), "height": 32, "width": 48,
                 "num_frames": 9, "condition_columns": {"pose_video": "pose"}, "max_bad_fraction": 0.5},
    }  # fmt: skip
    with pytest.raises(PrepareError, match="reads no"):  # a name the family does not read
        prepare(recipe_from_dict({**recipe, "data": {**recipe["data"], "condition_columns": {"pose": "pose"}}}))
    manifest = prepare(recipe_from_dict(recipe), log=lambda _: None)
    assert manifest["counts"]["ok"] == 2
    assert manifest["counts"]["bad_by_reason"] == {"no_condition": 1, "bad_condition": 1}

    cached = load_file(sample_path(tmp_path / "cache", 0))
    pipe = diffusers.WanAnimatePipeline.from_pretrained(path)
    seen = []
    original = pipe.transformer.forward
    monkeypatch.setattr(pipe.transformer, "forward", lambda **kw: seen.append(kw) or original(**kw))
    pipe(image=Image.open(media / rows[0]["reference"]).convert("RGB"), pose_video=_frames(media / rows[0]["pose"]),
         face_video=_frames(media / rows[0]["face_video"]), prompt_embeds=cached["prompt_embeds"][None], height=32,
         width=48, segment_frame_length=9, guidance_scale=1.0, num_inference_steps=1, output_type="latent")  # fmt: skip
    (kwargs,) = seen
    c = cached["latents"].shape[0]
    # 9 frames: 3 latent frames after the reference frame, of 32 x 48 pixels / 8
    assert cached["latents"].shape == (c, 4, 4, 6) and kwargs["hidden_states"].shape == (1, 2 * c + 4, 4, 4, 6)
    theirs = {"reference_latents": kwargs["hidden_states"][0, c:], "pose_latents": kwargs["pose_hidden_states"][0],
              "face_pixels": kwargs["face_pixel_values"][0], "image_embeds": kwargs["encoder_hidden_states_image"][0],
              "reference frame": kwargs["hidden_states"][0, c + 4 :, :1]}  # fmt: skip
    ours = {**{k: cached[k] for k in theirs if k in cached}, "reference frame": cached["latents"][:, :1]}
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key], value, rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}")


# (14) Kandinsky 5 I2V: the cache's frame 0 is the pipeline's image latents; the text is T2V's -------------------------


@torch.no_grad()
def test_kandinsky5_i2v_cache_is_the_pipelines_image_condition(tiny_pipeline) -> None:
    """The cache's latent frame 0 is what Kandinsky5I2VPipeline.prepare_latents writes there for the clip's first frame
    given as the 8-bit image a user passes (its posterior sampled with the generator in the state the pipeline samples
    it in: after its noise draw), and not the clip's own latent frame 0 (the VAE's GroupNorms pool over time: the T2V
    encoding's frame 0 depends on the later frames); frames 1.. are the T2V encoding of the clip. Training leaves that
    frame clean and out of the loss. The I2V pipeline's text is the T2V pipeline's for the same components."""
    from PIL import Image

    from train.models.kandinsky5.encoder import Kandinsky5Encoder
    from train.step import Objective, prepare

    path = tiny_pipeline("kandinsky5_i2v")
    encoder = get_encoder("kandinsky5_i2v")
    encoder.load(str(path))
    frames, height, width = 9, 32, 48  # 3 latent frames of 4 x 6
    clip = torch.rand(3, frames, height, width, generator=torch.Generator().manual_seed(7)) * 2 - 1
    pixels = ((clip[:, 0].permute(1, 2, 0) + 1) * 127.5).round().byte()
    clip[:, 0] = pixels.permute(2, 0, 1) / 127.5 - 1  # an 8-bit frame 0: the image the pipeline is given
    pipe = diffusers.Kandinsky5I2VPipeline.from_pretrained(path, **encoder.pipeline_components(str(path), None))
    c = pipe.transformer.config.in_visual_dim
    prepared = pipe.prepare_latents(Image.fromarray(pixels.numpy()), 1, c, height, width, frames, torch.float32, "cpu",
                                    torch.Generator().manual_seed(0))  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    torch.randn(prepared[..., :c].shape, generator=generator)  # the pipeline's noise draw comes first
    cached = encoder.encode_media(clip, generator, "sample", None)["latents"]
    image = prepared[0, 0, ..., :c].permute(2, 0, 1)  # (C, H, W) of the channels-last frame 0
    torch.testing.assert_close(cached[:, 0], image, rtol=1e-5, atol=1e-5)
    own = Kandinsky5Encoder.encode_media(encoder, clip, None, "mode", None)["latents"]  # the T2V encoding
    torch.testing.assert_close(encoder.encode_media(clip, None, "mode", None)["latents"][:, 1:], own[:, 1:])
    assert (own[:, 0] - cached[:, 0]).abs().max() > 0.05 * image.abs().max()  # frame 0 alone is another latent
    # training: frame 0 stays the cached image latents, no loss there
    caption = encoder.encode_text("a red square", encoder.text_tokens(None))
    batch = {"latents": cached[None], **{k: v[None] for k, v in caption.items()}}
    step = prepare(get_family("kandinsky5_i2v"), batch, Objective(), torch.Generator().manual_seed(1),
                   model_config=pipe.transformer.config)  # fmt: skip
    assert torch.equal(step.noisy["latents"][:, :, 0], batch["latents"][:, :, 0])
    assert step.condition.flatten().tolist() == [1.0, 0.0, 0.0]
    assert not torch.equal(step.noisy["latents"][:, :, 1:], batch["latents"][:, :, 1:])
    # the text: the T2V pipeline's encode_prompt on the same components (one template, one crop)
    t2v = diffusers.Kandinsky5T2VPipeline(**pipe.components)
    assert t2v.prompt_template == pipe.prompt_template
    assert t2v.prompt_template_encode_start_idx == pipe.prompt_template_encode_start_idx
    qwen, pooled, _ = t2v.encode_prompt(["a red square"], max_sequence_length=512, device="cpu")
    torch.testing.assert_close(caption["prompt_embeds"], qwen[0], rtol=0, atol=0)
    torch.testing.assert_close(caption["pooled_embeds"], pooled[0], rtol=0, atol=0)
