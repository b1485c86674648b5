"""The Wan conditioning variants: Wan 2.1 image-to-video (`wan_i2v`), Wan 2.2 TI2V-5B (`wan22_ti2v`: clean first
frame, per-token timesteps) and Wan 2.2 A14B's two experts (`wan22`).

What the family-generic tests (test_families, test_tiny_models, test_cp_models, test_real_models, test_families_e2e)
do not cover:
(1) the data encoders' cache tensors equal WanImageToVideoPipeline's own computation for the same pixels,
(2) TI2V's per-token timestep under CP is split exactly like the tokens (uneven splits, frame 0's tokens at 0),
(3) each A14B expert's sigmas fall in the range the pipeline routes to it (the shipped boundary_ratio, the real shift),
(4) every variant's tiny recipe trains under CP 3 on 3 processes through the real entry point with the loss and
    grad_norm of the 1-process run (<= 1e-5 relative), and its LoRA export loads into the family's diffusers pipeline
    (A14B: into transformer_2) and changes that transformer's weights by exactly ``scale * B @ A``; the A14B run starts
    from the tiny pipeline's transformer_2 through the sharded start (model.subfolder).
"""

from __future__ import annotations

import functools
from pathlib import Path

import diffusers
import pytest
import torch
from safetensors.torch import load_file

from tests.distributed import run_distributed
from tests.test_finetune import launch, metrics
from train import objective
from train.config import load_recipe
from train.cp.layout import split_sizes
from train.errors import UserError
from train.models import build_tiny_pipeline, expert_sigma_range, get_encoder, get_family, pipeline_boundary_ratio

REPO = Path(__file__).resolve().parents[1]
REL_TOL = 1e-5
A14B = "Wan-AI/Wan2.2-T2V-A14B-Diffusers"


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("wan_variants")
    return functools.cache(lambda name: build_tiny_pipeline(name, root / name))


def _clip(frames: int, height: int, width: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.rand(3, frames, height, width, generator=gen) * 2 - 1


# (1) Cache tensors = the pipeline's own computation ------------------------------------------------------------------


@torch.no_grad()
def test_wan_i2v_cache_is_the_pipelines_condition(pipelines) -> None:
    from PIL import Image

    path = pipelines("wan_i2v")
    encoder = get_encoder("wan_i2v")
    encoder.load(str(path))
    clip = _clip(9, 32, 48)
    pixels = ((clip[:, 0].permute(1, 2, 0) + 1) * 127.5).round().byte()
    clip[:, 0] = pixels.permute(2, 0, 1) / 127.5 - 1  # an 8-bit frame 0: the image the pipeline is given
    cached = encoder.encode_media(clip, None, "mode", None)
    pipe = diffusers.WanImageToVideoPipeline.from_pretrained(path)
    # the pipeline's path from that image: video_processor.preprocess, prepare_latents, encode_image
    image = Image.fromarray(pixels.numpy())
    pre = pipe.video_processor.preprocess(image, height=32, width=48).float()
    _, condition = pipe.prepare_latents(pre, 1, pipe.vae.config.z_dim, 32, 48, 9, torch.float32, "cpu", None,
                                        torch.zeros(1, *cached["latents"].shape))  # fmt: skip
    torch.testing.assert_close(cached["condition_latents"], condition[0, 4:], rtol=1e-5, atol=1e-5)
    assert torch.equal(condition[0, :4, 0], torch.ones_like(condition[0, :4, 0]))  # the mask the spec rebuilds
    assert not condition[0, :4, 1:].any()
    torch.testing.assert_close(cached["image_embeds"], pipe.encode_image(image, "cpu")[0])
    assert cached["image_embeds"].shape == (17, 12)  # CLIP hidden_states[-2]: 16 patches + class token


@torch.no_grad()
def test_wan22_ti2v_first_latent_frame_is_the_pipelines_condition(pipelines) -> None:
    from diffusers.pipelines.wan.pipeline_wan_i2v import retrieve_latents

    path = pipelines("wan22_ti2v")
    encoder = get_encoder("wan22_ti2v")
    encoder.load(str(path))
    clip = _clip(9, 32, 64)
    cached = encoder.encode_media(clip, None, "mode", None)["latents"]
    pipe = diffusers.WanImageToVideoPipeline.from_pretrained(path)  # a WanPipeline folder with expand_timesteps
    assert pipe.config.expand_timesteps and pipe.vae_scale_factor_spatial == 16
    assert cached.shape == (4, 3, 2, 4)  # 9 frames -> 3 latent frames, x16 spatial
    vae, cfg = pipe.vae, pipe.vae.config
    mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1)
    image = retrieve_latents(vae.encode(clip[:, :1][None]), sample_mode="argmax")  # the first frame alone
    video = retrieve_latents(vae.encode(clip[None]), sample_mode="argmax")
    torch.testing.assert_close(cached[:, :1], ((image - mean) / std)[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cached[:, 1:], ((video - mean) / std)[0, :, 1:], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="expand_timesteps"):  # a Wan 2.1 folder is no TI2V pipeline
        get_encoder("wan22_ti2v").load(str(pipelines("wan")))


# (2) TI2V: the per-token timestep, and its CP split ------------------------------------------------------------------


def test_ti2v_token_timesteps_are_the_pipelines() -> None:
    spec = get_family("wan22_ti2v")
    latents = torch.zeros(2, 4, 3, 4, 6)
    sigmas = torch.tensor([0.3, 0.8])
    mask = spec.conditioning({}, latents)
    element = objective.condition_sigmas(sigmas, mask)
    kwargs = spec.forward_kwargs({"prompt_embeds": torch.zeros(2, 5, 16)}, latents, element,
                                 model_config={"patch_size": (1, 2, 2)})  # fmt: skip
    # WanImageToVideoPipeline: first_frame_mask (0 on frame 0) [:, ::2, ::2] * t, flattened, per sample
    ffm = torch.ones(1, 1, 3, 4, 6)
    ffm[:, :, 0] = 0
    expected = torch.stack([(ffm[0][0][:, ::2, ::2] * (s * 1000)).flatten() for s in sigmas])
    torch.testing.assert_close(kwargs["timestep"], expected)
    assert kwargs["timestep"].shape == (2, 3 * 2 * 3)
    with pytest.raises(ValueError, match="per-element"):
        spec.forward_kwargs(
            {"prompt_embeds": torch.zeros(2, 5, 16)}, latents, sigmas, model_config={"patch_size": (1, 2, 2)}
        )


def _ti2v_split(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from tests.tiny_models import build_model, family_case
    from train.cp import enable_context_parallel

    case = family_case("wan22_ti2v", seed=1)
    model = build_model("wan22_ti2v").eval()
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("ring", "ulysses"))
    enable_context_parallel(model, mesh=mesh)
    seen: dict[str, torch.Tensor] = {}

    def record(key: str):
        def hook(_, args) -> None:  # a pre-hook returning nothing leaves the inputs as they are
            seen.setdefault(key, args[0].clone())

        return hook

    # CP's splits are diffusers hooks that wrap forward: hook modules the wrapped forwards call, which see the
    # rank-local tensors (the time embedder gets the flattened (B * S_local,) timestep, norm1 the local tokens)
    model.condition_embedder.timesteps_proj.register_forward_pre_hook(record("timestep"))
    model.blocks[0].norm1.register_forward_pre_hook(record("tokens"))
    with torch.no_grad():
        model(**case.kwargs, return_dict=False)
    full = case.kwargs["timestep"]
    return {"timestep": seen["timestep"].view(full.shape[0], -1), "tokens": seen["tokens"].shape[1], "full": full}


@pytest.mark.parametrize("world", [3])
def test_ti2v_timestep_splits_like_the_tokens(world: int) -> None:
    """Uneven CP 3 (35 tokens: 12, 12, 11): each rank's per-token timestep is its own tokens' slice of the whole."""
    results = run_distributed(_ti2v_split, world)
    full = results[0]["full"]
    sizes = split_sizes(full.shape[1], world)
    assert len(set(sizes)) > 1, sizes  # uneven
    start = 0
    for rank, (res, size) in enumerate(zip(results, sizes, strict=True)):
        assert res["tokens"] == size and res["timestep"].shape == (full.shape[0], size), (rank, res, sizes)
        assert torch.equal(res["timestep"], full[:, start : start + size]), rank
        start += size
    assert not full[:, :7].any() and full[:, 7:].all()  # frame 0's 1 x 7 tokens at 0, the others at sigma * 1000


# (3) A14B experts: sigmas in the range the pipeline routes to each --------------------------------------------------


def test_a14b_expert_sigmas_fall_in_their_range() -> None:
    spec = get_family("wan22")
    assert spec.experts == ("transformer", "transformer_2") and spec.shift.shift == 3.0
    assert pipeline_boundary_ratio("wan22", A14B) == 0.875  # the shipped model_index.json
    model = load_recipe(REPO / "recipes/wan22/a14b_low_noise_lora.yaml").model
    boundary = 0.875 * 1000  # WanPipeline: transformer while t >= boundary_ratio * num_train_timesteps
    for subfolder, high in (("transformer", True), ("transformer_2", False)):
        cfg = model.model_copy(update={"subfolder": subfolder})
        lo, hi = expert_sigma_range(spec, cfg)
        assert (lo, hi) == ((0.875, 1.0) if high else (0.0, 0.875))
        for scheme in ("logit_normal", "uniform"):
            s = objective.sample_stream_sigmas(4096, spec, scheme=scheme, sigma_range=(lo, hi),
                                               generator=torch.Generator().manual_seed(0))["latents"]  # fmt: skip
            t = s.double() * 1000  # the timestep the pipeline compares with the boundary
            assert bool(((t >= boundary) if high else (t < boundary)).all()), (subfolder, s.min(), s.max())
            # the draws fill the range (the density keeps its shape inside it)
            assert s.min() < lo + 0.05 * (hi - lo) and s.max() > hi - 0.05 * (hi - lo)
    with pytest.raises(UserError, match="model.subfolder"):
        expert_sigma_range(spec, model.model_copy(update={"subfolder": "transformer_3"}))
    with pytest.raises(UserError, match="model.boundary_ratio"):
        expert_sigma_range(spec, model.model_copy(update={"pretrained_path": "Wan-AI/Other"}))
    assert expert_sigma_range(get_family("wan"), model) is None


# (4) Tiny recipes through the real entry point: CP 3 == 1 process; the LoRA export loads ----------------------------

RUNS = {
    "wan_i2v": ("recipes/tiny/wan_i2v.yaml", ()),
    "wan22_ti2v": ("recipes/tiny/wan22_ti2v.yaml", ()),
    # from the tiny pipeline's low-noise expert (sharded start reads model.subfolder), its model_index boundary_ratio
    "wan22": ("recipes/tiny/wan22.yaml", ("model.init_config=null", "model.boundary_ratio=null")),
}


def _assert_lora_loaded(pipe, transformer: torch.nn.Module, lora_dir: Path, alpha_over_rank: float) -> None:
    exported = load_file(lora_dir / "pytorch_lora_weights.safetensors")
    loaded = {n: p for n, p in transformer.named_parameters() if ".lora_" in n}
    assert exported and loaded
    matched = set()
    for name, value in exported.items():  # transformer.blocks.0.attn1.to_q.lora_A.weight -> ...lora_A.<adapter>.weight
        module, kind = name.removeprefix("transformer.").rsplit(".lora_", 1)
        hits = [n for n in loaded if n.startswith(f"{module}.lora_{kind.split('.')[0]}.")]
        assert len(hits) == 1 and torch.equal(loaded[hits[0]], value), name
        matched.add(hits[0])
    # WanLoraLoaderMixin pads an I2V transformer's image K/V projections with zero adapters: nothing else is loaded
    assert all(not loaded[n].any() for n in set(loaded) - matched), sorted(set(loaded) - matched)
    # and the adapted layer computes W x + (alpha / r) B A x: the trained change of the transformer's weights
    layer = transformer.blocks[0].attn1.to_q
    a = exported["transformer.blocks.0.attn1.to_q.lora_A.weight"]
    b = exported["transformer.blocks.0.attn1.to_q.lora_B.weight"]
    assert b.abs().max() > 0  # trained away from peft's B = 0
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(layer(x), layer.base_layer(x) + alpha_over_rank * (x @ a.T @ b.T))


@pytest.mark.parametrize("family", list(RUNS))
def test_tiny_recipe_cp3_matches_serial_and_lora_loads(family: str, tmp_path: Path, pipelines) -> None:
    recipe, extra = RUNS[family]
    common = ["train.max_steps=2", "logging.wandb_mode=disabled", *extra]
    if family == "wan22":
        common.append(f"model.pretrained_path={pipelines('wan22')}")
    serial_out, cp_out = tmp_path / "cp1", tmp_path / "cp3"
    # the serial run exports the full transformer (LoRA merged): its un-adapted weights are the ones it started from
    launch(serial_out, 1, recipe, *common, "parallel.cp=1", "checkpoint.export=full")
    launch(cp_out, 3, recipe, *common, "parallel.cp=3", "checkpoint.export=lora")
    serial, cp3 = metrics(serial_out), metrics(cp_out)
    assert [m["step"] for m in cp3] == [m["step"] for m in serial] == [1, 2]
    for a, b in zip(cp3, serial, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= REL_TOL * abs(b[key]), f"{family} step {a['step']} {key}: {a} vs {b}"

    spec = get_family(family)
    pipe = getattr(diffusers, spec.pipeline_class).from_pretrained(pipelines(family))
    if family == "wan22":
        # the run started from transformer_2 (not transformer): weights LoRA does not touch are exported as loaded
        full = load_file(next((serial_out / "transformer").glob("*.safetensors")))
        for key in ("patch_embedding.weight", "blocks.0.ffn.net.0.proj.weight", "blocks.1.ffn.net.2.weight"):
            assert torch.equal(full[key], pipe.transformer_2.state_dict()[key]), key
            assert not torch.equal(full[key], pipe.transformer.state_dict()[key]), key
        pipe.load_lora_weights(cp_out / "lora", load_into_transformer_2=True)
        assert not any(".lora_" in n for n, _ in pipe.transformer.named_parameters())  # the high-noise expert as is
        target = pipe.transformer_2
    else:
        pipe.load_lora_weights(cp_out / "lora")
        target = pipe.transformer
    _assert_lora_loaded(pipe, target, cp_out / "lora", 8.0 / 4)  # lora_alpha / rank of the tiny recipes
