"""The optimizer levers (`train.optimizer`, `train.master_weights`; train/optim.py): state bytes per rank, bytes per
trained parameter, loss drift against fp32 AdamW, and exact resume, measured in one run.

    python -m bench.optimizers [--steps 20]

Full fine-tuning of the mid-size random-init Wan of bench/levers.py (4 blocks of 12 heads × 64, ffn 3072: 43 M
parameters) on 2 CPU processes (cp 2: FSDP2 shards every tensor over both), 32 video + 16 text tokens per sample,
bf16 autocast in every case, through the trainer's own pieces (`build_model`, `build_optimizer`, `train_step`) and
its checkpoint (`save_state` then `restore`: DCP shards, manifest, and trainer.json with the scheduler as JSON). Per
lever: the optimizer state this rank holds (the storage of every state tensor: torchao's codes, scales and tables
included) against train.estimate's term for the same recipe; weight + gradient + state per parameter; the largest
per-step relative loss difference from fp32 AdamW; and whether a run restored from the checkpoint of the middle step
continues bit-identically. tests/test_optim.py runs the same function on a 128-wide model (`small`).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from bench.levers import MID

REPO = Path(__file__).resolve().parents[1]
LEVERS = {
    "adamw": [],
    "adamw_8bit": ["train.optimizer=adamw_8bit"],
    "adamw_4bit": ["train.optimizer=adamw_4bit"],
    "bf16 masters": ["train.master_weights=bf16"],
    "bf16 masters + adamw_8bit": ["train.master_weights=bf16", "train.optimizer=adamw_8bit"],
    # FSDP2's CPUOffloadPolicy: on a GPU the shards, gradients and AdamW state move to host memory; on this CPU-only
    # machine they are there already, so its figures must equal adamw's exactly (the GPU script measures the move)
    "cpu offload": ["parallel.cpu_offload=true"],
}
# The test's model: 128 wide (4 heads × 32) with text, ffn and timestep widths 128 too, 2 blocks, 0.50 M parameters:
# its linears' shards hold ≥ 4096 values, so torchao quantizes their moments, and it has 9 distinct parameter shapes
# (torchao compiles its step once per shape: 15 shapes at ffn 512 cost the test ~25 s more of compilation).
SMALL = {"num_attention_heads": 4, "attention_head_dim": 32, "text_dim": 128, "ffn_dim": 128, "freq_dim": 128,
         "num_layers": 2}  # fmt: skip


def recipe_for(init_config: dict, steps: int, shapes: str, sets: list[str], output_dir: Path):
    from train.config import load_recipe

    tiny = load_recipe(REPO / "recipes/tiny/wan.yaml").model.init_config
    config = json.dumps({**tiny, **init_config})
    return load_recipe(REPO / "recipes/tiny/wan.yaml", ["finetune.method=full", "parallel.cp=2", "train.lr=1e-3",
                       "train.mixed_precision=bf16", f"train.max_steps={steps}", f"model.init_config={config}",
                       f"data.synthetic.shapes={shapes}", f"output_dir={output_dir}", *sets])  # fmt: skip


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The storage this rank holds for the optimizer's state: local shards, torchao's codes, scales and tables."""

    def nbytes(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        if hasattr(t, "__tensor_flatten__"):  # a tensor subclass: its inner tensors
            names, _ = t.__tensor_flatten__()
            return sum(nbytes(getattr(t, n)) for n in names)
        return t.untyped_storage().nbytes()

    return sum(nbytes(v) for s in optimizer.state.values() for k, v in s.items() if k != "step")


def _rank_fn(rank: int, world: int, init_config: dict, steps: int, save_at: int, shapes: str) -> dict:
    import torch.distributed as dist

    from train.checkpoint import AppState, restore
    from train.data.batches import build_dataset, make_batches
    from train.estimate import estimate
    from train.finetune import Trainer, autocast_dtype, build_optimizer, save_state, train_step
    from train.modeling import build_model, family_spec
    from train.models import cache_reads
    from train.parallel import ParallelDims
    from train.step import Objective

    cpu, mesh = torch.device("cpu"), ParallelDims(1, 1, world).build("cpu")
    box = [tempfile.mkdtemp(prefix="ctxtrain-optim-") if rank == 0 else None]
    dist.broadcast_object_list(box)
    out = {}
    for name, sets in LEVERS.items():
        recipe = recipe_for(init_config, steps, shapes, sets, Path(box[0]) / name.replace(" ", "_"))
        spec = family_spec(recipe.model)

        def trainer(recipe=recipe, spec=spec) -> Trainer:
            batches = make_batches(build_dataset(recipe, spec, cache_reads(spec.name)), recipe, mesh.dp_rank,
                                   mesh.dims.dp, cpu)  # fmt: skip
            model, parallel = build_model(recipe, spec, mesh, cpu)
            params = [p for p in model.parameters() if p.requires_grad]
            optimizer, scheduler = build_optimizer(params, recipe.train)
            return Trainer(recipe.train, spec, model, params, optimizer, scheduler, parallel, batches, mesh, cpu,
                           autocast_dtype(recipe.train.mixed_precision, cpu), Objective.of(recipe, spec))  # fmt: skip

        tr = trainer()
        lines = [train_step(tr, s) for s in range(save_at)]
        app = AppState(tr.model, tr.optimizer, trainable_only=False)
        assert save_state(recipe, spec, {"run": {"id": name}}, app, tr.scheduler, tr.batches, mesh, save_at) is not None
        lines += [train_step(tr, s) for s in range(save_at, steps)]
        case = {"loss": [x["loss"] for x in lines], "grad_norm": [x["grad_norm"] for x in lines],
                "state": state_bytes(tr.optimizer), "params": sum(p.numel() for p in tr.params),
                "weights": sum(p.to_local().untyped_storage().nbytes() for p in tr.params),
                "estimate": estimate(recipe, world, "cpu").components["optimizer state (AdamW)"],
                "dtypes": sorted({str(p.dtype) for p in tr.params})}  # fmt: skip
        resumed = trainer()  # the trainer's resume: the newest checkpoint verified and loaded, its JSON state applied
        _, state = restore(recipe.output_dir, AppState(resumed.model, resumed.optimizer, trainable_only=False))
        resumed.scheduler.load_state_dict(state["scheduler"])
        resumed.batches.load_state_dict(state["data"])
        again = [train_step(resumed, s) for s in range(save_at, steps)]
        case["resumed"] = {"loss": [x["loss"] for x in again], "grad_norm": [x["grad_norm"] for x in again]}
        out[name] = case
    return out


SMALL_SHAPES = "{latents: [4, 4, 4, 8], prompt_embeds: [7, 128]}"


def small(rank: int, world: int) -> dict:
    """tests/test_optim.py's case: the 128-wide model, 6 steps, the checkpoint of step 3."""
    return _rank_fn(rank, world, SMALL, 6, 3, SMALL_SHAPES)


def drift(case: dict, ref: dict) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(case["loss"], ref["loss"], strict=True))


def main() -> None:
    from train.tools.spawn import run_distributed

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    shapes = "{latents: [16, 2, 8, 8], prompt_embeds: [16, 256]}"  # 32 video tokens, 16 text tokens
    ranks = run_distributed(_rank_fn, 2, MID, args.steps, args.steps // 2, shapes)
    r0, ref = ranks[0], ranks[0]["adamw"]
    print(f"mid-size Wan (43 M parameters), full fine-tuning, cp 2 (FSDP2 over 2 ranks), {args.steps} steps; rank 0\n")
    print("| lever | optimizer state (MiB) | × adamw | estimate (MiB) | bytes / parameter (weight + grad + state) | "
          "max loss difference vs adamw | resume exact |\n|---|---|---|---|---|---|---|")  # fmt: skip
    for name, c in r0.items():
        per_param = (2 * c["weights"] + c["state"]) / (c["params"] / 2)
        exact = all(r[name]["resumed"]["loss"] == r[name]["loss"][args.steps // 2 :] for r in ranks)
        print(f"| {name} | {c['state'] / 2**20:.1f} | {c['state'] / ref['state']:.3f} | {c['estimate'] / 2**20:.1f} "
              f"| {per_param:.2f} | {drift(c, ref):.1e} | {'yes' if exact else 'NO'} |")  # fmt: skip


if __name__ == "__main__":
    main()
