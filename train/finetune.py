"""Fine-tune a diffusers transformer under context parallelism + FSDP2.

    accelerate launch --config_file configs/accelerate/cpu.yaml --num_processes 2 train/finetune.py \
        --recipe recipes/tiny/wan.yaml
    accelerate launch --config_file configs/accelerate/gpu_8.yaml train/finetune.py \
        --recipe recipes/wan/1.3b_lora.yaml --set parallel.cp=4 --set train.max_steps=2000

Reads top to bottom: recipe → processes and mesh → model (LoRA/full, CP, FSDP) → optimizer → data → resume → loop →
export. Everything per model family comes from its spec (train/models/<family>/) and CP plan (cp_plans/).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # `accelerate launch train/finetune.py` runs this file as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from train.checkpoint import AppState, latest_checkpoint, load_checkpoint, save_checkpoint
from train.config import (
    Recipe,
    RecipeError,
    TrainConfig,
    add_recipe_args,
    recipe_from_args,
    recipe_to_dict,
    save_recipe,
)
from train.data.batches import Batches, build_dataset, check_text_lengths, make_batches
from train.estimate import startup_check
from train.export import export_full, export_lora
from train.metrics import MetricsLogger, peak_memory_bytes
from train.modeling import build_model, describe_start, family_spec
from train.models.spec import FamilySpec
from train.objective import (
    add_noise,
    flow_matching_target,
    loss_weight,
    sample_noise,
    sample_stream_sigmas,
    stream_losses,
)
from train.parallel import Mesh, ParallelDims, Parallelized


def init_processes(recipe: Recipe):
    """Accelerate sets up processes and devices. Without a GPU, `Accelerator(cpu=True)` gives MULTI_CPU + gloo."""
    from accelerate import Accelerator

    use_gpu = torch.cuda.is_available()
    wandb = recipe.logging.wandb_mode != "disabled"
    accelerator = Accelerator(cpu=not use_gpu, log_with="wandb" if wandb else None)
    if not dist.is_initialized():  # a single process: still one code path, on a 1-rank group
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl" if use_gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)  # fmt: skip
    return accelerator


def autocast_dtype(mixed_precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype the recipe asks for on this device: `bf16` autocasts on any device (torch autocasts on CPU
    too), `auto` means bf16 on GPU and full fp32 on CPU, `no` is fp32 everywhere. Weights train in fp32 (masters)."""
    if mixed_precision == "bf16" or (mixed_precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def step_generator(seed: int, step: int, micro: int, dp_rank: int) -> torch.Generator:
    """Noise, timesteps and caption dropout for one micro-batch. Seeded by the DATA-PARALLEL rank, so every rank of
    a CP group draws the same values (they share one sample) and DP groups differ. Stateless: exact on resume."""
    return torch.Generator().manual_seed(hash((seed, step, micro, dp_rank)) & 0x7FFF_FFFF_FFFF_FFFF)


@dataclass
class Trainer:
    """What one optimizer step touches."""

    train: TrainConfig
    spec: FamilySpec
    model: torch.nn.Module
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    parallel: Parallelized  # .reduction (SUM over CP, MEAN over DP) and .cp (the CP state, None at cp 1)
    batches: Batches
    mesh: Mesh
    device: torch.device
    amp: torch.dtype | None


def compute_loss(tr: Trainer, batch: dict, gen: torch.Generator) -> torch.Tensor:
    """One micro-batch of the flow-matching objective: noise the latents, predict the velocity, weighted MSE."""
    t, spec, device = tr.train, tr.spec, tr.device
    x0 = {s: batch[s] for s in spec.streams}
    B = x0["latents"].shape[0]
    sigmas = sample_stream_sigmas(B, spec, scheme=t.timestep_sampling, logit_mean=t.logit_mean, logit_std=t.logit_std,
                                  mode_scale=t.mode_scale, image_seq_len=spec.image_seq_len(x0["latents"].shape[1:]),
                                  generator=gen)  # fmt: skip
    noise = {s: sample_noise(x.shape, generator=gen, dtype=x.dtype, device=device) for s, x in x0.items()}
    noisy = {s: add_noise(x0[s], noise[s], sigmas[s].to(device)) for s in x0}
    kwargs = spec.forward_kwargs(batch, noisy, {s: v.to(device) for s, v in sigmas.items()},
                                 model_config=tr.model.config, cp=tr.mesh.dims.cp > 1)  # fmt: skip
    with torch.autocast(device.type, dtype=tr.amp) if tr.amp is not None else nullcontext():
        out = tr.model(**kwargs, return_dict=False)
    preds = spec.predictions(out, {s: x.shape for s, x in x0.items()}, model_config=tr.model.config)
    targets = {s: flow_matching_target(x0[s], noise[s]) for s in x0}
    weights = {s: loss_weight(sigmas[s], t.loss_weighting) for s in x0}
    return sum(stream_losses(preds, targets, weights).values())


def train_step(tr: Trainer, step: int) -> dict[str, float]:
    """One optimizer step over `grad_accum` micro-batches; returns its metrics line."""
    t, reduction = tr.train, tr.parallel.reduction
    t0, loss_sum, tokens = time.perf_counter(), torch.zeros((), device=tr.device), 0
    for micro in range(t.grad_accum):
        if reduction.mode == "fsdp2":  # reduce-scatter once per optimizer step, on the last micro-batch
            tr.model.set_requires_gradient_sync(micro == t.grad_accum - 1)
        batch = next(tr.batches)
        gen = step_generator(t.seed, step, micro, tr.mesh.dp_rank)
        batch = tr.batches.caption_dropout(batch, t.caption_dropout, gen)
        loss = compute_loss(tr, batch, gen) / t.grad_accum
        loss.backward()
        loss_sum += loss.detach()
        shapes = {s: batch[s].shape[1:] for s in tr.spec.streams}  # e.g. 2 clips × 35 video tokens = 70 tokens
        tokens += batch["latents"].shape[0] * tr.spec.tokens_per_sample(shapes, tr.model.config)
    if reduction.mode == "allreduce":
        reduction.reduce_gradients(tr.params)  # SUM over CP, MEAN over DP
    grad_norm = torch.nn.utils.clip_grad_norm_(tr.params, t.max_grad_norm or math.inf)  # the true global norm
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    tr.optimizer.step()
    tr.scheduler.step()
    tr.optimizer.zero_grad(set_to_none=True)
    dims = tr.mesh.dims
    if dims.dp > 1:  # loss logged as the mean over data-parallel groups (CP peers already agree)
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG, group=tr.mesh.dp.get_group())
    dt = time.perf_counter() - t0
    # Throughput of the whole job in transformer tokens (noised streams after patching; text not counted): each DP
    # group processes its own micro-batches, the CP ranks of a group share them.
    return {"step": step + 1, "loss": loss_sum.item(), "grad_norm": grad_norm.item(),
            "lr": tr.scheduler.get_last_lr()[0], "transformer_tokens_per_s": tokens * dims.dp / dt,
            "step_time_s": dt, "peak_mem_bytes": peak_memory_bytes(tr.device)}  # fmt: skip


def build_optimizer(params: list[torch.nn.Parameter], t: TrainConfig):
    from diffusers.optimization import get_scheduler

    optimizer = torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), eps=t.eps, weight_decay=t.weight_decay)
    scheduler = get_scheduler(t.lr_schedule, optimizer, num_warmup_steps=t.warmup_steps, num_training_steps=t.max_steps)
    return optimizer, scheduler


def checkpoint_state(recipe: Recipe, step: int, scheduler, batches: Batches, mesh: Mesh) -> dict:
    """What a checkpoint holds besides the DCP shards: plain data (JSON), read back without running any code: the
    step, scheduler and data position, and the recipe and layout it was trained with (checked at resume)."""
    dims = mesh.dims
    return {"step": step, "scheduler": scheduler.state_dict(), "data": batches.state_dict(),
            "recipe": recipe_to_dict(recipe), "layout": {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard,
            "cp": dims.cp, "world_size": dims.world_size}}  # fmt: skip


def resume(out_dir: Path, app: AppState, scheduler, batches: Batches, metrics: MetricsLogger, wanted: bool) -> int:
    """The step to start from: the latest complete checkpoint's when resuming (state restored), else 0."""
    ckpt = latest_checkpoint(out_dir) if wanted else None
    if ckpt is None:
        metrics.truncate_after(0)  # a fresh run in a used output_dir starts a fresh metrics.jsonl
        return 0
    state = load_checkpoint(ckpt, app)
    scheduler.load_state_dict(state["scheduler"])
    batches.load_state_dict(state["data"])
    metrics.truncate_after(state["step"])
    if dist.get_rank() == 0:
        print(f"resumed from {ckpt} at step {state['step']}")
    return state["step"]


def print_layout(
    recipe: Recipe, mesh: Mesh, parallel: Parallelized, amp: torch.dtype | None, n_trainable: int, out_dir: Path
):
    reduction = parallel.reduction
    layout = {
        "mesh": mesh.describe(),
        "cp_plan": str(parallel.cp.plan.path) if parallel.cp is not None else "none (cp = 1)",
        "gradient_reduction": f"{reduction.mode}: SUM over cp={reduction.cp}, MEAN over dp={reduction.dp} "
        "(startup self-check passed)",
        "weights": describe_start(recipe),
        "mixed_precision": f"{recipe.train.mixed_precision}: "
        + ("bf16 autocast, fp32 master weights" if amp is not None else "fp32"),
        "trainable_parameters": n_trainable,
    }
    if dist.get_rank() == 0:
        print("recipe:", json.dumps(recipe_to_dict(recipe), indent=1))
        print("parallel layout:", json.dumps(layout, indent=1))
        save_recipe(recipe, out_dir / "recipe.yaml")
        (out_dir / "layout.json").write_text(json.dumps(layout, indent=1))


def export(recipe: Recipe, spec: FamilySpec, model: torch.nn.Module, out_dir: Path) -> None:
    kind = recipe.finetune.method if recipe.checkpoint.export == "auto" else recipe.checkpoint.export
    if kind == "lora":
        path = export_lora(model, spec.pipeline_class, out_dir)
    elif kind == "full":
        full = export_full(model, out_dir)
        path = full.path
        if dist.get_rank() == 0:  # streamed: rank 0 never holds more than one shard + one tensor
            print(f"export: {full.shards} shard(s), {full.total_bytes / 2**20:.1f} MiB; rank 0 peak buffered "
                  f"{full.peak_buffered_bytes / 2**20:.1f} MiB")  # fmt: skip
    if dist.get_rank() == 0:
        print(f"metrics: {out_dir / 'metrics.jsonl'}")
        if kind != "none":
            print(f"exported {kind} weights: {path}")
        if recipe.logging.wandb_mode == "offline":
            print(f"wandb offline run under {out_dir / 'wandb'} (upload later with `wandb sync`)")


def parse_args(argv: list[str] | None) -> tuple[Recipe, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_recipe_args(parser)
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of configuration errors")
    args = parser.parse_args(argv)
    return recipe_from_args(args), args


def main(argv: list[str] | None = None) -> None:
    recipe, args = parse_args(argv)
    t = recipe.train

    # --- processes, devices, mesh ---------------------------------------------------------------------------------
    accelerator = init_processes(recipe)
    device = accelerator.device
    dims = ParallelDims(*recipe.parallel.resolve(dist.get_world_size()))
    mesh = dims.build(device.type)
    spec = family_spec(recipe.model)  # the family's spec, with the recipe's flow_shift
    amp = autocast_dtype(t.mixed_precision, device)
    out_dir = Path(recipe.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    # --- will it fit? train.estimate's prediction for this layout; refused (one line) when clearly over the device --
    memory = startup_check(recipe, dist.get_world_size(), device)
    if dist.get_rank() == 0:
        print(f"memory: {memory}")

    # --- model: meta build → LoRA/full → CP hooks → activation levers → compile → FSDP2 → each rank's shard -------
    model, parallel = build_model(recipe, spec, mesh, device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = build_optimizer(params, t)

    # --- data: every rank of a CP group reads the same batches; DP groups read different ones ----------------------
    dataset = build_dataset(recipe, spec)
    check_text_lengths(dataset, spec, recipe)
    batches = make_batches(dataset, recipe, dp_rank=mesh.dp_rank, dp_size=dims.dp, device=device)

    # --- resume ---------------------------------------------------------------------------------------------------
    app = AppState(model, optimizer, trainable_only=recipe.finetune.method == "lora")
    metrics = MetricsLogger(accelerator, out_dir, recipe_to_dict(recipe), recipe.logging, recipe.name or "run")
    start = resume(out_dir, app, scheduler, batches, metrics, wanted=args.resume or recipe.checkpoint.resume)
    print_layout(recipe, mesh, parallel, amp, sum(p.numel() for p in params), out_dir)
    batches.check_contract(mesh)  # a cheap cross-rank hash of the next batch: CP peers equal, DP groups differ

    # --- loop -----------------------------------------------------------------------------------------------------
    trainer = Trainer(t, spec, model, params, optimizer, scheduler, parallel, batches, mesh, device, amp)
    steps = range(start, t.max_steps)
    if dist.get_rank() == 0 and recipe.logging.progress_bar:
        from tqdm.auto import tqdm

        steps = tqdm(steps, initial=start, total=t.max_steps, desc="train")
    for step in steps:
        line = train_step(trainer, step)
        if (step + 1) % recipe.logging.every_n_steps == 0 or step + 1 == t.max_steps:
            metrics.log(line)
        every = recipe.checkpoint.every_n_steps
        if every and (step + 1) % every == 0:
            state = checkpoint_state(recipe, step + 1, scheduler, batches, mesh)
            save_checkpoint(out_dir, step + 1, app, state, recipe.checkpoint.keep_last)

    # --- export ---------------------------------------------------------------------------------------------------
    export(recipe, spec, model, out_dir)
    dist.barrier()
    metrics.close()  # ends accelerate's trackers (which may tear the process group down): after the last collective
    if dist.is_initialized():
        dist.destroy_process_group()


def run_cli() -> int:
    """main() with user errors reported as one line (printed once for recipe errors), exit code 2; `--debug` raises."""
    try:
        main()
    except ValueError as e:
        if "--debug" in sys.argv:
            raise
        rank = int(os.environ.get("RANK", "0"))
        if rank == 0 or not isinstance(e, RecipeError):  # a recipe is the same on every rank: say it once
            prefix = "error" if isinstance(e, RecipeError) else f"error (rank {rank})"
            print(f"{prefix}: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # diffusers transformers return reshaped views; FSDP2 warns on every forward. The trainer never modifies the
    # output in place (family specs map it out of place), which is the case that warning is about.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    code = run_cli()
    # Everything is written and the process group is destroyed. Skip the interpreter's teardown: gloo's background
    # threads were seen to abort a finished process there ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
