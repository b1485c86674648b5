"""LTX variants: LTX trains with its text mask under CP, and LTX-Video image-to-video (`ltx_i2v`).

- The LTX family feeds its padded text mask under CP (its processors expand it per head; train/cp/ulysses.py shards
  it by head) and the image-to-video family its per-token (B, S) timestep, which the LTX plan splits like the tokens.
  Model-level parity of both at CP 2/3/4 (every gradient) runs in tests/test_cp_models.py with every family; the
  op-level per-head mask cases are in tests/test_cp_attention.py.
- ltx_i2v's cache: latent frame 0 equals what LTXImageToVideoPipeline.prepare_latents conditions on, for the same image.
- Both tiny recipes through the real entry point (accelerate launch, train/finetune.py) at CP 3 on 3 processes equal
  the 1-process run (loss, grad-norm within 1e-5 relative); ltx_i2v's LoRA export loads in LTXImageToVideoPipeline.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import tiny_models as tm
from train.models import build_tiny_pipeline, get_encoder, get_family

REPO = Path(__file__).resolve().parents[1]
REL_TOL = 1e-5


def test_ltx_feeds_its_text_mask_under_cp() -> None:
    case = tm.family_case("ltx", cp=True)
    mask = case.kwargs["encoder_attention_mask"]
    assert mask is not None and not mask.all()  # sample 0 pads its last 2 tokens
    assert torch.equal(case.kwargs["encoder_hidden_states"], case.batch["prompt_embeds"])  # text not cut


def test_ltx_i2v_per_token_timestep() -> None:
    """(B, S) timesteps packed like the tokens: 0 on frame 0's tokens, sigma * 1000 on the others, per sample."""
    case = tm.family_case("ltx_i2v", cp=True)
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


def test_ltx_i2v_cache_is_the_pipelines_condition(tmp_path: Path) -> None:
    """Frame 0 of the cached latents equals prepare_latents' conditioned frame for the same image (a PIL image through
    the pipeline's own preprocessing and VAE sample, same generator seed); the other frames are LTX's video latents."""
    from diffusers import LTXImageToVideoPipeline
    from PIL import Image

    path = build_tiny_pipeline("ltx_i2v", tmp_path / "pipe")
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


def _ltx2_ranks(rank: int, world: int) -> dict:
    """LTX-2 (audio + video, not a family) with both padded text masks, under CP vs serial: outputs and every
    gradient after the SUM over CP, in fp32 and fp64; and the MEAN, which must be wrong for every parameter (each
    rank really holds a partial gradient: the audio stream too is split, not replicated)."""
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
def test_ltx2_with_text_masks_matches_serial(world: int) -> None:
    from tests.distributed import run_distributed

    res = run_distributed(_ltx2_ranks, world)[0]
    for dtype, r in res.items():
        worst = max(r["sum"], key=r["sum"].get)
        print(f"ltx2 CP {world} {dtype}: out {r['out']:.2e}, max rel grad {r['sum'][worst]:.2e} ({worst})")
        assert len(r["sum"]) == len(list(tm.build_model("ltx2").parameters()))  # every parameter compared
        assert r["out"] <= {torch.float32: 1e-5, torch.float64: 1e-10}[dtype], r["out"]
        assert r["sum"][worst] <= GRAD_TOL[dtype], (worst, r["sum"][worst])
        assert r["mean"] >= 0.5 * (1 - 1 / world), r["mean"]


def _train(family: str, out: Path, nproc: int) -> list[dict]:
    import json

    with socket.socket() as sock:  # a free rendezvous port: other launches may hold accelerate's default
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/cpu.yaml",
           "--num_processes", str(nproc), "--main_process_port", str(port), "train/finetune.py",
           "--recipe", f"recipes/tiny/{family}.yaml",
           f"--set=output_dir={out}", f"--set=parallel.cp={nproc}", "--set=train.max_steps=2",
           "--set=logging.wandb_mode=disabled", "--set=logging.progress_bar=false"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}"
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("family", ["ltx", "ltx_i2v"])
def test_tiny_recipe_trains_under_cp3(family: str, tmp_path: Path) -> None:
    serial, cp3 = _train(family, tmp_path / "cp1", 1), _train(family, tmp_path / "cp3", 3)
    assert [m["step"] for m in cp3] == [1, 2]
    for a, b in zip(cp3, serial):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= REL_TOL * abs(b[key]), f"{family} step {a['step']} {key}: {a} vs {b}"
    if family != "ltx_i2v":
        return
    # The LoRA export loads into LTXImageToVideoPipeline with the trained values.
    from diffusers import LTXImageToVideoPipeline
    from safetensors.torch import load_file

    assert get_family(family).pipeline_class == "LTXImageToVideoPipeline"
    pipe = LTXImageToVideoPipeline.from_pretrained(build_tiny_pipeline(family, tmp_path / "pipe"))
    pipe.load_lora_weights(tmp_path / "cp3" / "lora")
    exported = load_file(tmp_path / "cp3" / "lora" / "pytorch_lora_weights.safetensors")
    loaded = {n: p for n, p in pipe.transformer.named_parameters() if "lora_" in n}
    assert len(loaded) == len(exported) > 0
    for name, value in exported.items():
        module, kind = name.removeprefix("transformer.").rsplit(".lora_", 1)
        match = [p for n, p in loaded.items() if n.startswith(module + ".lora_" + kind.split(".")[0] + ".")]
        assert len(match) == 1 and torch.equal(match[0], value), name
    lora_layer = pipe.transformer.transformer_blocks[0].attn1.to_q
    assert lora_layer.scaling[next(iter(lora_layer.scaling))] == 8.0 / 4  # lora_alpha / rank of the tiny recipe
