"""HunyuanVideo 1.5 (no diffusers CP plan: cp_plans/hunyuan_video15.yaml): the cache is what HunyuanVideo15Pipeline
computes (its own `encode_prompt`: Qwen2.5-VL states after the template crop, ByT5 states of the quoted glyph text; the
VAE's scaling), and the key-mask processor the plan installs under CP gives the stock processor's output and every
gradient. Elsewhere: model-level parity at every CP layout in tests/test_cp_models.py; the forward kwargs vs one
pipeline step in tests/test_families.py; the tiny pipeline's cache trained under CP 2 with the serial oracle's first
step, and its LoRA export loaded into HunyuanVideo15Pipeline's transformer, in tests/test_families_e2e.py."""

from __future__ import annotations

import torch

from train.models import get_encoder, tiny_config
from train.models.hunyuan_video15.attention import HunyuanVideo15KeyMaskAttnProcessor, install
from train.tools.tiny_models import build_model, family_case, family_loss, output_tensors

NAME = "hunyuan_video15"
CAPTIONS = ("a red square", 'a sign that reads "OPEN" in a blue circle')  # the second quotes glyph text for ByT5


@torch.no_grad()
def test_cache_is_the_pipelines(tiny_pipeline) -> None:
    from diffusers import HunyuanVideo15Pipeline

    pipeline_path = tiny_pipeline(NAME)
    pipe = HunyuanVideo15Pipeline.from_pretrained(pipeline_path)
    encoder = get_encoder(NAME)
    encoder.load(str(pipeline_path))
    assert encoder.text_tokens(None) == pipe.tokenizer_max_length  # prepare's default: the pipeline's 1000
    for caption in CAPTIONS:
        ours = encoder.encode_text(caption, pipe.tokenizer_max_length)
        embeds, mask, embeds_2, mask_2 = pipe.encode_prompt(prompt=caption, device="cpu")
        torch.testing.assert_close(ours["prompt_embeds"], embeds[0], rtol=0, atol=0)
        torch.testing.assert_close(ours["byt5_embeds"], embeds_2[0], rtol=0, atol=0)
        assert torch.equal(ours["prompt_mask"], mask[0].bool()) and torch.equal(ours["byt5_mask"], mask_2[0].bool())
        assert not ours["prompt_mask"].all()  # right-padded to the pipeline's length
        quoted = '"' in caption
        assert bool(ours["byt5_mask"].any()) == quoted and bool(ours["byt5_embeds"].abs().sum() > 0) == quoted

    # Latents: the VAE posterior's mean times scaling_factor, what the pipeline's decode divides back out.
    clip = torch.rand(3, 9, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = encoder.encode_media(clip, None, "mode", 24.0)["latents"]
    expected = pipe.vae.encode(clip[None]).latent_dist.mode()[0] * pipe.vae.config.scaling_factor
    assert pipe.vae.config.scaling_factor != 1.0
    torch.testing.assert_close(latents, expected, rtol=0, atol=0)
    assert latents.shape == (tiny_config(NAME)["out_channels"], 3, 2, 3)  # 4k + 1 frames -> k + 1, x16 spatial


def test_key_mask_processor_is_exact() -> None:
    """The key mask (B, 1, 1, S) gives the stock (B, 1, S, S) processor's output and every gradient, in fp64, for a
    batch of two whose Qwen and ByT5 masks are padded (the stock mask's extra rows only touch padded tokens)."""
    case = family_case(NAME, seed=1, dtype=torch.float64)
    assert not bool(case.kwargs["encoder_attention_mask"].all())
    results = []
    for swap in (False, True):
        model = build_model(NAME, seed=0, dtype=torch.float64)
        if swap:
            assert (
                install(model) == tiny_config(NAME)["num_layers"]
            )  # one per dual-stream block, the refiner keeps its own
            assert all(type(b.attn.processor) is HunyuanVideo15KeyMaskAttnProcessor for b in model.transformer_blocks)
        out = output_tensors(NAME, model(**case.kwargs, return_dict=False))
        family_loss(case, out, model.config).backward()
        results.append((out[0], {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (ref, ref_grads), (got, grads) = results
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-14)
    assert set(grads) == set(ref_grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-12, atol=1e-14, msg=lambda m, n=name: f"{n}: {m}")
