"""LTX variants: LTX-Video image-to-video (`ltx_i2v`) and LTX-2 (audio + video, not a family).

- ltx_i2v's per-token (B, S) timestep (0 on the clean frame 0) packed like the tokens; its cache: latent frame 0
  equals what LTXImageToVideoPipeline.prepare_latents conditions on, for the same image.
- LTX-2 with both padded text masks under CP 2, 3 and 4: outputs and every gradient equal the serial run's, and each
  rank really holds a partial gradient (the audio stream too is split).
Elsewhere: model-level parity of LTX (its padded per-head text mask) and ltx_i2v at every CP layout in
tests/test_cp_models.py (the op-level per-head mask cases in tests/test_cp_attention.py); both tiny pipelines'
caches trained through the launcher (ltx_i2v under CP 3) with the serial oracle's first step, and their LoRA exports
reloaded into their pipelines, in tests/test_families_e2e.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import rank_job
from train.models import get_encoder
from train.tools import tiny_models as tm


def test_ltx_i2v_per_token_timestep() -> None:
    """(B, S) timesteps packed like the tokens: 0 on frame 0's tokens, sigma * 1000 on the others, per sample."""
    case = tm.family_case("ltx_i2v")
    _, _, frames, height, width = case.batch["latents"].shape
    timestep, hidden = case.kwargs["timestep"], case.kwargs["hidden_states"]
    assert timestep.shape == hidden.shape[:2] == (case.batch["latents"].shape[0], frames * height * width)
    per_frame = timestep.view(-1, frames, height * width)
    assert (per_frame[:, 0] == 0).all()
    expected = (case.sigmas["latents"] * 1000).view(-1, 1, 1).expand_as(per_frame[:, 1:])
    torch.testing.assert_close(per_frame[:, 1:], expected, rtol=0, atol=0)
    # frame 0's tokens are the clean latents (in the pipeline's packing), the others noised
    from diffusers import LTXImageToVideoPipeline

    clean, first = LTXImageToVideoPipeline._pack_latents(case.batch["latents"]), height * width
    assert torch.equal(hidden[:, :first], clean[:, :first]) and not torch.equal(hidden[:, first:], clean[:, first:])


def test_ltx_i2v_cache_is_the_pipelines_condition(tiny_pipeline) -> None:
    """Frame 0 of the cached latents equals prepare_latents' conditioned frame for the same image (a PIL image through
    the pipeline's own preprocessing and VAE sample, same generator seed); the other frames are LTX's video latents."""
    from diffusers import LTXImageToVideoPipeline
    from PIL import Image

    path = tiny_pipeline("ltx_i2v")
    pipe = LTXImageToVideoPipeline.from_pretrained(path)
    h, w, frames = 32, 64, 9
    image = torch.randint(0, 256, (3, h, w), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    clip = torch.rand(3, frames, h, w, generator=torch.Generator().manual_seed(2)) * 2 - 1
    clip[:, 0] = image / 127.5 - 1
    encoder = get_encoder("ltx_i2v")
    encoder.load(str(path))
    ours = encoder.encode_media(clip, torch.Generator().manual_seed(5), "sample", 24.0)["latents"]
    pil = Image.fromarray(image.permute(1, 2, 0).numpy())
    processed = pipe.video_processor.preprocess(pil, height=h, width=w)
    packed, mask = pipe.prepare_latents(processed, 1, ours.shape[0], h, w, frames, torch.float32, "cpu",
                                        torch.Generator().manual_seed(5))  # fmt: skip
    f, lh, lw = ours.shape[1:]
    theirs = pipe._unpack_latents(packed, f, lh, lw)[0]
    assert mask.shape == (1, f * lh * lw) and (mask.view(f, -1)[0] == 1).all() and (mask.view(f, -1)[1:] == 0).all()
    torch.testing.assert_close(ours[:, 0], theirs[:, 0], rtol=1e-5, atol=1e-5)
    ltx = get_encoder("ltx")
    ltx.load(str(path))
    video = ltx.encode_media(clip, None, "mode", 24.0)["latents"]
    torch.testing.assert_close(encoder.encode_media(clip, None, "mode", 24.0)["latents"][:, 1:], video[:, 1:])


# Relative gradient error per parameter, max|g_cp - g_serial| / max|g_serial| (as tests/test_cp_models.py).
GRAD_TOL = {torch.float32: 2e-5, torch.float64: 1e-10}


@rank_job(2, 3, 4)
def _ltx2_ranks(rank: int, world: int) -> dict:
    """LTX-2 (audio + video: the ltx2 family's tiny model and inputs) with both padded text masks, under CP vs
    serial: outputs and every gradient after the SUM over CP, in fp32 and fp64; and the MEAN, which must be wrong for
    every parameter (each rank really holds a partial gradient: the audio stream too is split, not replicated)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from train.cp import enable_context_parallel
    from train.cp.reduce import GradReduction

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("ring", "ulysses"))
    group = mesh["ulysses"].get_group()
    reduction = GradReduction("allreduce", cp_group=group)
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()  # noqa: E731
    res = {}
    for dtype in (torch.float32, torch.float64):
        inputs = tm.build_inputs("ltx2", dtype=dtype, with_text_mask=True)
        serial = tm.build_model("ltx2", dtype=dtype)
        ref = tm.output_tensors("ltx2", serial(**inputs, return_dict=False))
        tm.make_loss("ltx2", ref).backward()
        model = tm.build_model("ltx2", dtype=dtype)
        enable_context_parallel(model, mesh=mesh)
        out = tm.output_tensors("ltx2", model(**tm.build_inputs("ltx2", dtype=dtype, with_text_mask=True),
                                              return_dict=False))  # fmt: skip
        tm.make_loss("ltx2", out).backward()
        mean = {n: p.grad.clone() for n, p in model.named_parameters()}
        for g in mean.values():
            dist.all_reduce(g, op=dist.ReduceOp.AVG, group=group)
        reduction.reduce_gradients(model.parameters())
        grads = dict(serial.named_parameters())
        res[dtype] = {
            "out": max((o - r).abs().max().item() for o, r in zip(out, ref)),
            "sum": {n: rel(p.grad, grads[n].grad) for n, p in model.named_parameters()},
            "mean": min(rel(g, grads[n].grad) for n, g in mean.items()),
        }
    return res


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ltx2_with_text_masks_matches_serial(group, world: int) -> None:
    res = group(_ltx2_ranks, world)[0]
    for dtype, r in res.items():
        worst = max(r["sum"], key=r["sum"].get)
        print(f"ltx2 CP {world} {dtype}: out {r['out']:.2e}, max rel grad {r['sum'][worst]:.2e} ({worst})")
        assert len(r["sum"]) == len(list(tm.build_model("ltx2").parameters()))  # every parameter compared
        assert r["out"] <= {torch.float32: 1e-5, torch.float64: 1e-10}[dtype], r["out"]
        assert r["sum"][worst] <= GRAD_TOL[dtype], (worst, r["sum"][worst])
        assert r["mean"] >= 0.5 * (1 - 1 / world), r["mean"]
