"""Peak resident memory per rank of a Wan 2.2 A14B-style run training both experts (`model.both_experts`) vs one.

    python -m bench.experts_memory [--layers 8] [--nproc 2] [--method lora]

Two experts of Wan2.1-1.3B's width (bench/startup_memory.py's mid-size transformer, random bf16 weights, `--layers`
blocks each; `transformer_2/` the same files as `transformer/`) in one local pipeline folder; `train/finetune.py`
runs through `python -m train.launch` on `--nproc` CPU processes (cp 2 x the rest dp_shard), 2 steps at a short
sequence (so the weights dominate), once training `transformer_2` alone and once both. Measured: the largest
descendant's peak RSS minus the tiny launch's (as startup_memory), and the estimate's components for the same runs
(train.estimate at that world size, device type cpu).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.startup_memory import SHORT_SHAPES, build_mid_folder, launch_peak, mid_overrides

GIB = 2**30


def measure(work: Path, layers: int, nproc: int, method: str) -> dict:
    folder = work / "mid"
    model_bytes = build_mid_folder(folder, layers)
    (folder / "transformer_2").symlink_to(folder / "transformer")
    base = launch_peak(work / "base", nproc, "recipes/tiny/wan.yaml", "parallel.cp=2", "train.max_steps=1",
                       "checkpoint.export=none")  # fmt: skip
    common = [
        *mid_overrides(folder, method, True, shapes=SHORT_SHAPES),
        "train.max_steps=2",
        "model.boundary_ratio=0.875",
    ]
    runs = {"one": ["model.subfolder=transformer_2"], "both": ["model.both_experts=true"]}
    out = {"model_bytes": model_bytes, "baseline": base}
    for name, extra in runs.items():
        out[name] = launch_peak(work / name, nproc, "recipes/tiny/wan22.yaml", *common, *extra) - base
        out[f"estimate_{name}"] = _estimate(common + extra, nproc)
    return out


def _estimate(overrides: list[str], nproc: int) -> float:
    from train.config import load_recipe
    from train.estimate import estimate

    recipe = load_recipe(Path(__file__).resolve().parents[1] / "recipes/tiny/wan22.yaml", overrides)
    e = estimate(recipe, nproc, device_type="cpu")
    return e.components["parameters"] + e.components["optimizer state (AdamW)"] + e.components["gradients"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--method", choices=["lora", "full"], default="lora")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        r = measure(Path(tmp), args.layers, args.nproc, args.method)
    print(f"two experts of Wan 1.3B width, {args.layers} blocks each (bf16 {r['model_bytes'] / GIB:.2f} GiB per "
          f"expert), {args.nproc} ranks cp 2, {args.method}, 2 steps")  # fmt: skip
    print("| run | peak RSS of the largest rank − baseline | estimate: weights + gradients + optimizer state |")
    print("|---|---|---|")
    for name in ("one", "both"):
        label = "both experts" if name == "both" else "one expert"
        print(f"| {label} | {r[name] / GIB:.2f} GiB | {r[f'estimate_{name}'] / GIB:.2f} GiB |")
    print(f"both / one: measured {r['both'] / r['one']:.2f}, estimated {r['estimate_both'] / r['estimate_one']:.2f}")


if __name__ == "__main__":
    main()
