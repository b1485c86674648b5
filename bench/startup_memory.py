"""Peak resident memory per rank of a real training launch, as a fraction of the bf16 model: sharded start vs every
rank loading the whole model.

    python -m bench.startup_memory [--layers 30] [--method lora] [--nproc 4] [--short] [--sharded-only] [--fp8]
                                   [--json F]

A pretrained Wan2.1-T2V-1.3B transformer (its real config: 30 blocks of 12 heads × 128, ffn 8960, text_dim 4096;
random weights; `--layers` changes the block count) is written once as a local bf16 folder; `train/finetune.py`
then runs through `python -m train.launch` on 4 CPU processes (cp 2 × dp_shard 2) for one step at a short sequence (so
the weights dominate), once per loading path; `--fp8` adds the sharded start with the LoRA base in float8
(`finetune.fp8_base`: each rank reads its bf16 slices block by block and keeps their codes).
Measured: the largest descendant's peak RSS (`getrusage(RUSAGE_CHILDREN)` of a fresh parent process), minus the
same launch of the tiny recipe (imports, process group, allocator: ~0.4-0.5 GiB per rank). Nothing is set in the
environment: the launches run as a user's do (the trainer tunes glibc's malloc itself, train/hostmem.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Wan2.1-T2V-1.3B's transformer config (30 blocks: one block is 1/31 of the weights).
WAN_1_3B = {
    "patch_size": [1, 2, 2], "num_attention_heads": 12, "attention_head_dim": 128, "in_channels": 16,
    "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 8960, "num_layers": 30, "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 1024,
}  # fmt: skip
POOL = 1 << 22  # normal draws the random weights are tiled from
# The measured step's synthetic sample: 32 video tokens (2 × 4 × 4 after the 1×2×2 patch, 16 per rank at cp 2) and
# 16 text tokens. SHORT: 2 video tokens (1 per rank) and 2 text tokens, for tests/test_scale.py (see `measure`).
SHAPES = "{latents: [16, 2, 8, 8], prompt_embeds: [16, 4096]}"
SHORT_SHAPES = "{latents: [16, 1, 2, 4], prompt_embeds: [2, 4096]}"


def build_mid_folder(path: Path, layers: int) -> int:
    """Write the mid-size transformer (random bf16 weights, N(0, 0.02)) as a pipeline folder's `transformer/`;
    returns its parameter bytes. Built on the meta device in bf16 and filled in place (no fp32 copy of the model): each
    parameter is tiled from a seeded pool of 4M normal draws at random offsets, ~5x faster than drawing 1.4 G values
    (the weights' values do not change what a rank holds)."""
    import diffusers
    import torch

    target = path / "transformer"
    if (target / "config.json").exists():
        config = {k: v for k, v in json.loads((target / "config.json").read_text()).items() if not k.startswith("_")}
    else:
        config = {**WAN_1_3B, "num_layers": layers}
    with torch.device("meta"):
        model = diffusers.WanTransformer3DModel.from_config(config).to(torch.bfloat16)
    if not (target / "config.json").exists():
        model = model.to_empty(device="cpu")
        gen = torch.Generator().manual_seed(0)
        pool = torch.randn(2 * POOL, generator=gen).mul_(0.02).to(torch.bfloat16)
        with torch.no_grad():
            for p in model.parameters():
                flat = p.view(-1)
                for i in range(0, flat.numel(), POOL):
                    start, n = int(torch.randint(POOL, (), generator=gen)), min(POOL, flat.numel() - i)
                    flat[i : i + n].copy_(pool[start : start + n])
        model.save_pretrained(target, max_shard_size="400MB")
    return sum(p.numel() * 2 for p in model.parameters())


_MEASURE = """
import resource, subprocess, sys
proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)
if proc.returncode != 0:
    sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-5000:])
    sys.exit(proc.returncode)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
"""


def launch_peak(out_dir: Path, nproc: int, recipe: str, *overrides: str) -> int:
    """Peak RSS (bytes) of the largest process of one launch of the trainer (`python -m train.launch`)."""
    cmd = [sys.executable, "-m", "train.launch", "--config_file", "configs/accelerate/cpu.yaml",
           "--num_processes", str(nproc), "train/finetune.py", "--recipe", recipe, "--set", f"output_dir={out_dir}",
           "--set", "logging.progress_bar=false", "--set", "logging.wandb_mode=disabled",
           *[a for o in overrides for a in ("--set", o)]]  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", _MEASURE, *cmd], cwd=REPO, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"launch failed: {' '.join(cmd)}\n{proc.stderr[-6000:]}")
    return int(proc.stdout.strip().splitlines()[-1])


# Loading paths: the result's key -> (model.sharded_load, finetune.fp8_base)
PATHS = {"sharded": (True, False), "whole": (False, False), "sharded_fp8": (True, True)}


def mid_overrides(
    folder: Path, method: str, sharded: bool, cp: int = 2, shapes: str = SHAPES, fp8: bool = False
) -> list[str]:
    """The tiny Wan recipe pointed at the mid-size folder: one step of one sample of `shapes`."""
    return [f"model.pretrained_path={folder}", "model.init_config=null", "model.dtype=bfloat16",
            f"model.sharded_load={str(sharded).lower()}", f"parallel.cp={cp}", "train.max_steps=1",
            "train.batch_size=1", "train.mixed_precision=bf16", f"finetune.method={method}", "checkpoint.export=none",
            f"data.synthetic.shapes={shapes}", f"finetune.fp8_base={str(fp8).lower()}"]  # fmt: skip


def measure(
    work: Path, layers: int, method: str, nproc: int, paths: tuple[str, ...] = ("sharded", "whole"),
    shapes: str = SHAPES,
) -> dict:  # fmt: skip
    """Peak RSS per rank − the tiny launch's, as a fraction of the bf16 model, for each loading path in `paths`
    (keys of PATHS).

    `shapes`: the measured step's sample. On a CPU without bf16 matmul instructions (AVX2), the backward through the
    frozen bf16 linears (grad_input = grad @ W) runs a scalar gemm ~20-30x slower than the forward and linear in the
    tokens: at SHAPES the step takes ~3 min at 30 blocks, at SHORT_SHAPES well under 1 min. The activations at
    SHAPES are ~1-2% of the model, so the fraction is weights and FSDP's working set either way."""
    folder = work / "mid"
    # The tiny launch runs while the folder is written (its own processes: their peaks are theirs alone).
    with ThreadPoolExecutor(1) as pool:
        baseline = pool.submit(launch_peak, work / "base", nproc, "recipes/tiny/wan.yaml", "parallel.cp=2",
                               "train.max_steps=1", "checkpoint.export=none")  # fmt: skip
        model_bytes = build_mid_folder(folder, layers)
        base = baseline.result()
    result = {"model_bytes": model_bytes, "baseline_bytes": base, "layers": layers, "method": method, "nproc": nproc}
    for path in paths:
        sharded, fp8 = PATHS[path]
        peak = launch_peak(work / f"run_{path}", nproc, "recipes/tiny/wan.yaml",
                           *mid_overrides(folder, method, sharded, shapes=shapes, fp8=fp8))  # fmt: skip
        result[path] = (peak - base) / model_bytes
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--method", choices=["lora", "full"], default="lora")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--short", action="store_true", help="the 2-token step (SHORT_SHAPES: ~2 min less on AVX2)")
    parser.add_argument("--sharded-only", action="store_true", help="measure the sharded start only")
    parser.add_argument("--fp8", action="store_true", help="also the sharded start with finetune.fp8_base (LoRA)")
    parser.add_argument("--json", type=Path, help="also write the result to this file")
    args = parser.parse_args()
    paths = ("sharded",) + ("whole",) * (not args.sharded_only) + ("sharded_fp8",) * args.fp8
    shapes = SHORT_SHAPES if args.short else SHAPES
    with tempfile.TemporaryDirectory() as tmp:
        r = measure(Path(tmp), args.layers, args.method, args.nproc, paths=paths, shapes=shapes)
    if args.json:
        args.json.write_text(json.dumps(r))
    gib = 2**30
    print(f"Wan 1.3B ({args.layers} blocks): bf16 model {r['model_bytes'] / gib:.2f} GiB; "
          f"baseline (tiny launch) {r['baseline_bytes'] / gib:.2f} GiB per rank; {args.nproc} ranks cp 2, "
          f"{args.method}, one step")  # fmt: skip
    print("| loading | peak RSS of the largest rank − baseline, × bf16 model |\n|---|---|")
    print(f"| sharded start (model.sharded_load: true) | {r['sharded']:.2f} |")
    if "whole" in r:
        print(f"| whole model on every rank (model.sharded_load: false) | {r['whole']:.2f} |")
    if "sharded_fp8" in r:
        print(f"| sharded start, frozen base in float8 (finetune.fp8_base: true) | {r['sharded_fp8']:.2f} |")


if __name__ == "__main__":
    main()
