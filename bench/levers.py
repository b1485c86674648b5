"""Activation memory levers, the CP attention kernel and torch.compile: peak memory and step time of each, measured
in one run.

    python -m bench.levers [--nproc 2] [--steps 3]

The trainer itself (`accelerate launch train/finetune.py`) on a mid-size random-init Wan transformer (4 blocks of
12 heads × 64, ffn 3072; 2048 video + 64 text tokens per sample, LoRA, CP over `--nproc` CPU processes), once per
setting. Reported per setting: rank 0's peak RSS (the run's `peak_mem_bytes`, minus the same launch with one step
of a 4-token sample: imports + weights, so what is left is the step's activations and working set) and the median
step time of the steps after the first (the first one compiles when compile is on). On CPU, offloading to "host"
memory moves nothing (device and host memory are the same): it shows the lever's cost, not its saving, which only
a GPU can show.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MID = {"patch_size": [1, 2, 2], "num_attention_heads": 12, "attention_head_dim": 64, "in_channels": 16,
       "out_channels": 16, "text_dim": 256, "freq_dim": 256, "ffn_dim": 3072, "num_layers": 4,
       "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 1024}  # fmt: skip
SETTINGS: dict[str, tuple[str, ...]] = {
    "none": (),
    "checkpoint every block": ("train.gradient_checkpointing=true",),
    "checkpoint every 2nd block": ("train.gradient_checkpointing=true", "train.checkpoint_every=2"),
    "checkpoint every block, keep attention": (
        "train.gradient_checkpointing=true",
        "train.checkpoint_policy=keep_attention",
    ),
    "checkpoint every block, keep attention + matmuls": (
        "train.gradient_checkpointing=true",
        "train.checkpoint_policy=keep_attention_matmul",
    ),
    "offload saved activations": ("train.offload_activations=true",),
    "compile": ("train.compile=true",),
    "compile + checkpoint every block": ("train.compile=true", "train.gradient_checkpointing=true"),
    "compile + checkpoint every block, keep attention": (
        "train.compile=true",
        "train.gradient_checkpointing=true",
        "train.checkpoint_policy=keep_attention",
    ),
    # The CP attention through diffusers' native op pair (saves Q/K/V only, re-runs the attention in backward)
    # instead of the default kernel (auto: torch's CPU flash kernel, output and LSE saved).
    "attention kernel: backend (native op pair)": ("parallel.attention_kernel=backend",),
}


def launch(out_dir: Path, nproc: int, steps: int, latents: list[int], *sets: str) -> list[dict]:
    overrides = [f"output_dir={out_dir}", "logging.progress_bar=false", "logging.wandb_mode=disabled",
                 f"model.init_config={json.dumps(MID)}", f"parallel.cp={nproc}", f"train.max_steps={steps}",
                 "train.batch_size=1", "checkpoint.export=none",
                 f"data.synthetic.shapes={{latents: {latents}, prompt_embeds: [64, 256]}}", *sets]  # fmt: skip
    cmd = [sys.executable, "-m", "train.launch", "--config_file", "configs/accelerate/cpu.yaml",
           "--num_processes", str(nproc), "train/finetune.py", "--recipe", "recipes/tiny/wan.yaml",
           *[a for o in overrides for a in ("--set", o)]]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // nproc))}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"launch failed: {' '.join(sets)}\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def measure(nproc: int, steps: int, only: list[str] | None = None) -> dict[str, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        base = launch(Path(tmp) / "base", nproc, 1, [16, 1, 4, 4])[-1]["peak_mem_bytes"]
        rows = {}
        for name, sets in SETTINGS.items():
            if only and name != "none" and not any(o in name for o in only):
                continue
            lines = launch(Path(tmp) / name.replace(" ", "_"), nproc, steps, [16, 8, 32, 32], *sets)
            rows[name] = {"memory": max(m["peak_mem_bytes"] for m in lines) - base,
                          "step_s": statistics.median(m["step_time_s"] for m in lines[1:]),
                          "loss": [m["loss"] for m in lines]}  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", nargs="*", help="settings whose name contains one of these (and none)")
    args = parser.parse_args()
    rows = measure(args.nproc, args.steps, args.only)
    ref = rows["none"]
    print(f"mid-size Wan, 4 blocks, 2048 video tokens, LoRA, CP {args.nproc} on CPU; rank 0; ratios vs none\n")
    print("| setting | step memory (MiB) | × none | step time (s) | × none | loss equal to none |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        same = max(abs(a - b) / abs(b) for a, b in zip(r["loss"], ref["loss"])) <= 1e-5
        print(f"| {name} | {r['memory'] / 2**20:.0f} | {r['memory'] / ref['memory']:.2f} | {r['step_s']:.2f} | "
              f"{r['step_s'] / ref['step_s']:.2f} | {'yes' if same else 'NO'} |")  # fmt: skip


if __name__ == "__main__":
    main()
