"""Fine-tune a diffusers transformer under context parallelism + FSDP2.

    accelerate launch --config_file configs/accelerate/cpu.yaml --num_processes 2 train/finetune.py \
        --recipe recipes/tiny/wan.yaml
    accelerate launch --config_file configs/accelerate/gpu_8.yaml train/finetune.py \
        --recipe recipes/wan/1.3b_lora.yaml --set parallel.cp=4 --set train.max_steps=2000

Reads top to bottom: recipe → processes and mesh → data → memory estimate → model (LoRA/full, CP, FSDP) → optimizer →
resume → validation → loop → export. One micro-batch's objective is train/step.py's; everything per model family
comes from its spec (train/models/<family>/) and CP plan (cp_plans/).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

if __package__ in (None, ""):  # `accelerate launch train/finetune.py` runs this file as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if __name__ == "__main__":  # recipe, degree and path errors within a second, before the seconds of imports below
    from train import hostmem
    from train.config import preflight
    from train.errors import quiet_interrupt

    hostmem.tune()  # before torch allocates: freed model-size buffers go back to the OS (train/hostmem.py)
    quiet_interrupt()  # Ctrl-C during the imports and startup: exit 130, no traceback
    preflight(sys.argv[1:])

import torch
import torch.distributed as dist

from train import hostmem, optim, rundir, runtime
from train.checkpoint import (
    AppState,
    CheckpointFailed,
    complete_checkpoints,
    latest_checkpoint,
    parameters_finite,
    read_trainer_state,
    restore,
    rotate_checkpoints,
    save_checkpoint,
)
from train.checkpoint import kept as checkpoint_kept
from train.config import (
    Recipe,
    TrainConfig,
    add_recipe_args,
    check_inputs,
    recipe_from_args,
    recipe_to_dict,
    save_recipe,
)
from train.data.batches import Batches, bucket_tokens, build_dataset, check_masks, check_text_lengths, make_batches
from train.ema import EMA
from train.errors import EXIT_CODE, UserError, peer_reported, quiet_interrupt, report
from train.estimate import startup_check
from train.experts import Experts, build_experts, expert_suffix, experts_of
from train.export import ExportFailed, export_full, export_lora
from train.heldout import HeldOutLoss
from train.metrics import MetricsLogger, device_memory, peak_memory_bytes
from train.modeling import build_model, check_model, describe_start, family_spec
from train.models import cache_reads, transformer_config
from train.models.spec import FamilySpec
from train.original_full import export_original_full
from train.parallel import Mesh, ParallelDims, Parallelized
from train.report import record_memory, report_at_end
from train.resume import plan_resume
from train.step import Objective, check_preservation
from train.step import micro_batch_loss as step_loss
from train.validation import Validation, check_validation


def init_processes(recipe: Recipe):
    """Accelerate sets up processes and devices. Without a GPU, `Accelerator(cpu=True)` gives MULTI_CPU + gloo.

    The process group is created here first, with `parallel.timeout_s` (+ the watchdog's grace), and accelerate
    adopts it: its `InitProcessGroupKwargs(timeout=...)` drops a timeout equal to its own default (600 s), which then
    falls back to torch's (30 min for gloo). Launchers without env:// rendezvous (mpirun) still get the timeout
    through that handler; a single process gets a 1-rank group."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    use_gpu = torch.cuda.is_available()
    backend = "nccl" if use_gpu else "gloo"
    if use_gpu and recipe.parallel.cpu_offload:  # FSDP2's offloaded gradients are clipped (reduced) on the CPU
        backend = "cuda:nccl,cpu:gloo"
    if runtime.launcher_env():
        runtime.init_process_group(backend, recipe.parallel.timeout_s)
    wandb = recipe.logging.wandb_mode != "disabled"
    timeout = InitProcessGroupKwargs(timeout=runtime.process_group_timeout(recipe.parallel.timeout_s))
    accelerator = Accelerator(cpu=not use_gpu, log_with="wandb" if wandb else None, kwargs_handlers=[timeout])
    if not dist.is_initialized():  # a single process: still one code path, on a 1-rank group
        runtime.init_process_group(backend, recipe.parallel.timeout_s)
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


def micro_batches(batches: Batches, t: TrainConfig, step: int, dp_rank: int):
    """The micro-batches of optimizer step `step`: (index, batch with caption dropout applied, sample ids, the
    generator its noise and timesteps come from)."""
    for micro in range(t.grad_accum):
        gen = step_generator(t.seed, step, micro, dp_rank)
        batch, ids = batches.take(gen)  # caption dropout drawn from gen first: each dataset's rate (make_batches)
        yield micro, batch, ids, gen


def token_budget(recipe: Recipe, spec: FamilySpec, dataset) -> Callable[[str], int] | None:
    """With train.batch_tokens, `tokens_of(bucket)` for make_batches (train/data/batches.py `bucket_tokens`): the
    data's shapes through the family's tokens_per_sample with the transformer's config, read before the model is
    built (init_config, the pretrained folder's, or the shipped config of a hub id); else None."""
    if recipe.train.batch_tokens is None:
        return None
    m = recipe.model
    try:
        config = transformer_config(m.family, init_config=m.init_config, pretrained_path=m.pretrained_path,
                                    subfolder=m.subfolder)  # fmt: skip
    except ValueError as e:
        raise UserError(f"train.batch_tokens needs the transformer's config before its weights load: {e}") from None
    return bucket_tokens(dataset, spec, config)


class BadStep(NamedTuple):
    """A step skipped for a non-finite loss or gradient norm, as one rank saw it."""

    step: int
    loss: float  # the mean over data-parallel groups, as logged
    grad_norm: float
    samples: list[str]  # this rank's sample ids (Batches.sample_ids)
    own_loss_bad: bool  # this rank's own loss, before the mean, was non-finite


@dataclass
class BadSteps:
    """Skipped steps: how many in this process so far, and the current run of consecutive ones."""

    total: int = 0
    streak: list[BadStep] = field(default_factory=list)


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
    objective: Objective  # sigma sampling, loss weighting, an expert's sigma range
    ema: EMA | None = None  # the recipe's `ema`: updated after each applied step
    bad: BadSteps = field(default_factory=BadSteps)


class StopRequest:
    """SIGINT/SIGTERM (Ctrl-C, `kill`, SLURM preemption; torchrun forwards what its launcher gets to every rank) ask
    the loop to stop after the current step. The handler only records the signal; `agreed()` takes the MAX over all
    ranks once per step, so every rank stops after the same step even when the signal reached them at different times
    or reached only one of them."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.signum, self.agreed_signal = device, 0, None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._record)

    def _record(self, signum: int, frame) -> None:
        self.signum = signum

    def agreed(self) -> str | None:
        """The signal's name once any rank has received one (the same on every rank), else None. A collective."""
        flag = torch.tensor(self.signum, device=self.device)  # int64: gloo's float MAX skips NaN, ints are exact
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.agreed_signal = signal.Signals(int(flag)).name if flag else None
        return self.agreed_signal


def train_step(tr: Trainer, step: int) -> dict[str, float]:
    """One optimizer step over `grad_accum` micro-batches; returns its metrics line. A step whose loss or gradient norm
    is not finite (one bad micro-batch is enough) is skipped: no optimizer or scheduler step, its gradients dropped,
    counted in `tr.bad` (the loop stops the run after `train.max_bad_steps` in a row)."""
    t, reduction = tr.train, tr.parallel.reduction
    t0, loss_sum, tokens, samples = time.perf_counter(), torch.zeros((), device=tr.device), 0, []
    kept = torch.zeros((), device=tr.device)  # train.preservation: its term (unweighted), as loss_sum
    # model.both_experts: this step's expert and its sigma range (train/experts.py); else the recipe's objective
    objective = tr.model.route(step) if isinstance(tr.model, Experts) else tr.objective
    for micro, batch, ids, gen in micro_batches(tr.batches, t, step, tr.mesh.dp_rank):
        if reduction.mode == "fsdp2":  # reduce-scatter once per optimizer step, on the last micro-batch
            tr.model.set_requires_gradient_sync(micro == t.grad_accum - 1)
        samples += ids
        parts: dict[str, torch.Tensor] = {}
        loss = step_loss(tr.model, tr.spec, batch, objective, gen, tr.amp, parts) / t.grad_accum  # train/step.py
        loss.backward()
        loss_sum += loss.detach()
        kept += parts.get("preservation_loss", 0.0) / t.grad_accum
        shapes = {s: batch[s].shape[1:] for s in tr.spec.streams}  # e.g. 2 clips × 35 video tokens = 70 tokens
        tokens += batch["latents"].shape[0] * tr.spec.tokens_per_sample(shapes, tr.model.config)
    if reduction.mode == "allreduce":
        reduction.reduce_gradients(tr.params)  # SUM over CP, MEAN over DP
    grad_norm = torch.nn.utils.clip_grad_norm_(tr.params, t.max_grad_norm or math.inf)  # the true global norm
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    own_loss_bad = not loss_sum.isfinite()  # before the mean: tells which data-parallel group's samples went bad
    dims = tr.mesh.dims
    # Logged as the mean over data-parallel groups (CP peers hold the same loss), taken over all ranks so that each
    # decides on the same value (NaN anywhere → NaN everywhere).
    if dims.world_size > 1:
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
        if objective.preservation > 0:
            dist.all_reduce(kept, op=dist.ReduceOp.AVG)
    finite = bool(loss_sum.isfinite() and grad_norm.isfinite())  # the norm is global already: equal on every rank
    lr = float(tr.scheduler.get_last_lr()[0])  # this step's rate (the scheduler then moves on to the next step's)
    if finite:
        optim.step(tr.optimizer, t.seed, step, tr.device)  # (seeded stochastic rounding with bf16 master weights)
        tr.scheduler.step()
        if tr.ema is not None:
            tr.ema.update(step + 1)
        tr.bad.streak.clear()
    else:
        tr.bad.total += 1
        tr.bad.streak.append(BadStep(step + 1, loss_sum.item(), grad_norm.item(), samples, own_loss_bad))
    tr.optimizer.zero_grad(set_to_none=True)
    dt = time.perf_counter() - t0
    # Throughput of the whole job in transformer tokens (noised streams after patching; text not counted): each DP
    # group processes its own micro-batches, the CP ranks of a group share them. A mixture adds samples/<dataset>:
    # the samples of each dataset the whole job has trained on so far.
    return {"step": step + 1, "loss": loss_sum.item(), "grad_norm": grad_norm.item(),
            "lr": lr, "transformer_tokens_per_s": tokens * dims.dp / dt,
            "step_time_s": dt, "peak_mem_bytes": peak_memory_bytes(tr.device), **device_memory(tr.device),
            "skipped": not finite, "bad_steps": tr.bad.total,
            **({"preservation_loss": kept.item()} if objective.preservation > 0 else {}),
            **tr.batches.contributions()}  # fmt: skip


def bad_steps_error(streak: list[BadStep], ended: bool = False) -> UserError:
    """The error that stops a run after `train.max_bad_steps` non-finite steps in a row (`ended`: a run whose last
    steps were non-finite and skipped, after its export of the last applied step). It names each step's samples:
    those of the data-parallel groups whose own loss was non-finite, else (a diverging run: the loss finite and the
    gradient norm not, or every group's loss bad) all of them. A collective: every rank took the same decisions."""
    streaks = [None] * dist.get_world_size()
    dist.all_gather_object(streaks, streak)
    steps = []
    for i, bad in enumerate(streak):
        seen = [s[i] for s in streaks]
        culprits = [b for b in seen if b.own_loss_bad] or seen
        ids = dict.fromkeys(x for b in culprits for x in b.samples)  # CP peers share their samples: each once
        steps.append(f"step {bad.step} (loss {bad.loss:.3g}, grad norm {bad.grad_norm:.3g}): {', '.join(ids)}")
    n, last, were = len(streak), streak[0].step - 1, "were" if len(streak) > 1 else "was"
    what = (f"the run's last {n} step{'s' * (n > 1)} had a non-finite loss or gradient norm and {were} skipped (the "
            f"export holds step {last}'s weights, the last applied)" if ended else f"stopped at step "
            f"{streak[-1].step}: {n} step{'s' * (n > 1)} in a row had a non-finite loss or gradient norm "
            "(train.max_bad_steps), none applied")  # fmt: skip
    return UserError(f"{what}; samples: {'; '.join(steps)}. Check those samples for NaN/Inf or huge values, or lower "
                     "train.lr / set train.max_grad_norm")  # fmt: skip


def build_optimizer(params: list[torch.nn.Parameter], t: TrainConfig, partial_steps: bool = False):
    """AdamW (`train.optimizer`, `train.master_weights`: train/optim.py) and its learning-rate schedule.
    `partial_steps`: some parameters sit out steps (model.both_experts: one expert a step), so every parameter's
    state is created now, as its first step would find it (optim.neutral_state)."""
    optimizer = optim.build(params, t.optimizer, t.master_weights, lr=t.lr, betas=tuple(t.betas), eps=t.eps,
                            weight_decay=t.weight_decay)  # fmt: skip
    if partial_steps:
        optim.neutral_state(optimizer)
    return optimizer, lr_schedule(optimizer, t, t.max_steps)


def lr_schedule(optimizer: torch.optim.Optimizer, t: TrainConfig, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """`train.lr_schedule` after `train.warmup_steps` of linear warmup from 0, over `steps` optimizer steps.
    diffusers' "constant" ignores warmup; its "constant_with_warmup" is the same schedule with it."""
    from diffusers.optimization import get_scheduler

    name = "constant_with_warmup" if t.lr_schedule == "constant" else t.lr_schedule
    return get_scheduler(name, optimizer, num_warmup_steps=t.warmup_steps, num_training_steps=steps)


def job_identity(recipe: Recipe, args: argparse.Namespace) -> dict:
    """What every rank of one job must share (`runtime.check_ranks_agree`): the resolved recipe (not the file's
    path: nodes may hold copies elsewhere), the flags that change the run, and the code version."""
    flags = {"resume": args.resume, "reset_lr_schedule": args.reset_lr_schedule,
             "archive_previous": args.archive_previous}  # fmt: skip
    return {"recipe": recipe_to_dict(recipe), "flags": flags, "code": runtime.code_digest()}


def save_state(recipe: Recipe, spec: FamilySpec, run: dict, app: AppState, scheduler, batches: Batches, mesh: Mesh,
               step: int):  # fmt: skip
    """Checkpoint `step` (collective): its path, or None from non-finite weights (train/checkpoint.py). With
    `checkpoint.export_every_checkpoint` the checkpoint also holds the weights in the export format; a failed write of
    those is a warning (the checkpoint itself is complete: resume and the final export are unaffected)."""
    state = checkpoint_state(recipe, run, step, scheduler, batches, mesh)
    path = save_checkpoint(recipe.output_dir, step, app, state, keep_last=None)  # rotated below, once whole
    if path is None:
        return None
    if recipe.checkpoint.export_every_checkpoint:
        try:
            export_weights(recipe, spec, app.model, path, app.ema)
        except ExportFailed as e:  # the older checkpoints (and their exports) stay: nothing is rotated away
            if dist.get_rank() == 0:
                print(f"warning: step {step}: the checkpoint's export {e.final} failed ({e.cause}); the checkpoint "
                      "itself is complete, and the older checkpoints with their exports are kept", file=sys.stderr,
                      flush=True)  # fmt: skip
            return path
    if dist.get_rank() == 0:
        rotate_checkpoints(recipe.output_dir, recipe.checkpoint.keep_last, path)
    return path


def checkpoint_state(recipe: Recipe, run: dict, step: int, scheduler, batches: Batches, mesh: Mesh) -> dict:
    """What a checkpoint holds besides the DCP shards: plain data (JSON), read back without running any code: the
    run's id (train/rundir.py), the step, scheduler and data position, and the recipe and layout it was trained with
    (checked at resume)."""
    d = mesh.dims
    layout = {"dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "cp": d.cp, "world_size": d.world_size}
    return {"run_id": run["run"]["id"], "step": step, "scheduler": optim.scheduler_state(scheduler),
            "data": batches.state_dict(), "recipe": recipe_to_dict(recipe), "layout": layout}  # fmt: skip


def resume(recipe: Recipe, run: dict, args: argparse.Namespace, app: AppState, scheduler, batches: Batches,
           metrics: MetricsLogger, mesh: Mesh):  # fmt: skip
    """(the step to start from, the scheduler): when `run` resumes (train/rundir.py `claim`: the folder's checkpoints
    are this run's), the latest complete checkpoint's, its recipe compared with this one field by field
    (train/resume.py: what cannot apply exactly is refused, the rest applied), else 0."""
    out_dir, t = Path(recipe.output_dir), recipe.train
    found = complete_checkpoints(out_dir) if run["resume"] else []
    if not found:
        metrics.truncate_after(0)  # a fresh run: claim() left no logged step here (an empty or torn file only)
        return 0, scheduler
    # The recipe check first, from the newest checkpoint's trainer.json (a run's checkpoints share its recipe), before
    # any weights are read; then the newest checkpoint that verifies (sizes, checksums), older ones as fallback.
    dims = mesh.dims
    layout = {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "cp": dims.cp}
    saved = None
    for path in reversed(found):  # a damaged newest trainer.json: restore() below falls back and says why
        try:
            saved = read_trainer_state(path)
            break
        except UserError:
            continue
    if saved is None:
        read_trainer_state(found[-1])  # none readable: its one-line error
    plan = plan_resume(saved["recipe"], recipe_to_dict(recipe), reset_lr_schedule=args.reset_lr_schedule,
                       saved_layout=saved["layout"], layout=layout, checkpoint=str(path))  # fmt: skip
    data_notes = batches.resume_notes(saved["data"], saved["step"])  # a cache of another size: refused here
    ckpt, state = restore(out_dir, app)
    start = state["step"]
    for group in app.optimizer.param_groups:  # DCP restored the old hyper-parameters: the recipe's apply from here
        group.update(betas=tuple(t.betas), eps=t.eps, weight_decay=t.weight_decay)
    if plan.reset_schedule:  # the new schedule (warmup included) over the remaining steps, from the new lr
        optim.set_lr(app.optimizer, t.lr)
        scheduler = lr_schedule(app.optimizer, t, max(t.max_steps - start, 1))
    else:
        scheduler.load_state_dict(state["scheduler"])
    batches.load_state_dict(state["data"])
    metrics.truncate_after(start)
    if dist.get_rank() == 0:
        print(f"resumed from {ckpt} at step {start}")
        for line in plan.applied + plan.notes + data_notes:
            print(f"resume: {line}")
        if start >= t.max_steps:
            print(f"resume: step {start} is already train.max_steps ({t.max_steps}): nothing to train; the export "
                  f"of step {start}'s weights follows (raise train.max_steps to train on)")  # fmt: skip
    return start, scheduler


def claim_output_dir(recipe: Recipe, args: argparse.Namespace, out_dir: Path) -> dict:
    """One run per output_dir: rank 0 holds out_dir/.lock until exit and decides under it whether this run resumes
    the run recorded there, starts fresh, or is refused (another run's state is never overwritten: train/rundir.py).
    Collective; the same outcome on every rank."""
    out_dir.mkdir(parents=True, exist_ok=True)
    mode = "required" if args.resume else "auto" if recipe.checkpoint.resume else "no"
    run = runtime.lock_output_dir(out_dir, lambda: rundir.claim(out_dir, mode, args.archive_previous, recipe.name))
    if run["note"] and dist.get_rank() == 0:
        print(run["note"])
    return run


def finish(out_dir: Path, step: int, metrics: MetricsLogger, watchdog: runtime.Watchdog, stop: StopRequest,
           bad_streak: list[BadStep]) -> None:  # fmt: skip
    """After the export: every rank done, the run report, the trackers closed, the process group destroyed. A
    SIGINT/SIGTERM that came after the loop (during the export) waited for it: the run is complete, said so, and
    marked for the launcher (exit 0). A run whose last steps were skipped as non-finite (`bad_streak`: its export
    holds the last applied step's weights) then fails, naming them; a run stopped by a signal has not ended (it
    resumes from its checkpoint), whatever its last steps were."""
    in_loop = stop.agreed_signal  # the same on every rank
    ended_bad = bad_steps_error(bad_streak, ended=True) if bad_streak and not in_loop else None  # a collective
    late = stop.agreed()  # a collective: also every rank's arrival
    watchdog.idle()
    if dist.get_rank() == 0:  # plots + report.md from the files written; never fails the run (train/report.py)
        metrics.log_images(report_at_end(out_dir))
        if late and not in_loop:
            print(f"{late} arrived after the last step: the export finished first; the run is complete", flush=True)
            mark_stopped(out_dir, step, late, completed=True)
    metrics.close()  # ends accelerate's trackers (which may tear the process group down): after the last collective
    if dist.is_initialized():
        dist.destroy_process_group()
    if ended_bad is not None:
        raise ended_bad


def announce_stop(out_dir: Path, step: int, signal_name: str, ckpt: Path | None) -> None:
    """Rank 0, after a SIGINT/SIGTERM stop: the line naming the checkpoint to resume from, and `stopped.json`, which
    tells `python -m train.launch` the stop was clean (exit 0 rather than 128 + the signal)."""
    if dist.get_rank() != 0:
        return
    where = ckpt or latest_checkpoint(out_dir)  # save_checkpoint writes nothing from non-finite weights: the last good
    print(f"stopped by {signal_name} after step {step}; checkpoint: {where}; resume with --resume", flush=True)
    mark_stopped(out_dir, step, signal_name, checkpoint=str(where))


def mark_stopped(out_dir: Path, step: int, signal_name: str, **more: Any) -> None:
    """`stopped.json`: the job ended by a signal the trainer handled (a checkpointed stop, or a run completed
    despite it); `python -m train.launch` exits 0 for it, not 128 + the signal."""
    marker = {"step": step, "signal": signal_name, "time": time.time(), **more}
    (out_dir / "stopped.json").write_text(json.dumps(marker))


def print_layout(
    recipe: Recipe, mesh: Mesh, parallel: Parallelized, amp: torch.dtype | None, n_trainable: int, out_dir: Path,
    data: dict[str, Any],
):  # fmt: skip
    reduction = parallel.reduction
    layout = {
        "mesh": mesh.describe(),
        "cp_plan": str(parallel.cp.plan.path) if parallel.cp is not None else "none (cp = 1)",
        "gradient_reduction": f"{reduction.mode}: SUM over cp={reduction.cp}, MEAN over dp={reduction.dp} "
        "(startup self-check passed)",
        "weights": describe_start(recipe),
        "mixed_precision": f"{recipe.train.mixed_precision}: "
        + (f"bf16 autocast, {recipe.train.master_weights} master weights" if amp is not None else "fp32"),
        "optimizer": optim.describe(recipe.train.optimizer, recipe.train.master_weights),
        "trainable_parameters": n_trainable,
        "data": data,  # batch size per bucket, a mixture's datasets (Batches.describe): the report's Data section
    }
    if dist.get_rank() == 0:
        print("recipe:", json.dumps(recipe_to_dict(recipe), indent=1))
        print("parallel layout:", json.dumps(layout, indent=1))
        save_recipe(recipe, out_dir / "recipe.yaml")
        (out_dir / "layout.json").write_text(json.dumps(layout, indent=1))


def final_checkpoint(out_dir: Path, step: int, save: Callable[[int], Path | None]) -> Path | None:
    """The checkpoint of the run's last step: the one saved there already, else one written now (None when it cannot
    be: non-finite weights)."""
    latest = latest_checkpoint(out_dir)
    return latest if latest is not None and latest.name == f"step_{step:06d}" else save(step)


def export_weights(recipe: Recipe, spec: FamilySpec, model: torch.nn.Module, out_dir: Path,
                   ema: EMA | None) -> list[Path]:  # fmt: skip
    """The trained weights in the export format into `out_dir` (`lora/` or `transformer/`), and the EMA's beside them
    (`lora_ema/`, `transformer_ema/`): the final export, and each checkpoint's (`checkpoint.export_every_checkpoint`).
    Collective; raises ExportFailed on every rank when a write fails."""
    kind = recipe.exported
    written = []
    for suffix, weights in (("", nullcontext), *([("_ema", ema.swapped)] if ema is not None else [])):
        # model.both_experts: each expert beside the other, as the pipeline's folders (lora/ + lora_2/, ...)
        for expert, transformer in experts_of(model).items():
            with weights():
                written += _export_one(recipe, spec, transformer, out_dir, kind, expert_suffix(expert) + suffix)
    return written


def _export_one(recipe: Recipe, spec: FamilySpec, model: torch.nn.Module, out_dir: Path, kind: str,
                suffix: str) -> list[Path]:  # fmt: skip
    """One transformer's weights: `lora<suffix>/` (and `_original`, checkpoint.export_format) or
    `transformer<suffix>/`."""
    if kind == "lora":
        keys = recipe.checkpoint.export_format  # diffusers, original (the family's, train/lora_format.py), both
        return export_lora(model, spec.pipeline_class, out_dir, name=f"lora{suffix}",
                           original=spec.lora_format if keys != "diffusers" else None,
                           diffusers_keys=keys != "original")  # fmt: skip
    if kind != "full":
        return []
    written, keys = [], recipe.checkpoint.export_format
    if keys != "original":
        full = export_full(model, out_dir, name=f"transformer{suffix}")
        if dist.get_rank() == 0:  # streamed: rank 0 never holds more than one shard + one tensor
            print(f"export: {full.path.name}: {full.shards} shard(s), {full.total_bytes / 2**20:.1f} MiB; "
                  f"rank 0 peak buffered {full.peak_buffered_bytes / 2**20:.1f} MiB")  # fmt: skip
        written.append(full.path)
    if keys != "diffusers":  # the authors' single file (train/original_full.py), streamed the same way
        written.append(export_original_full(model, spec.lora_format, out_dir, name=f"transformer{suffix}"))
    return written


def export(recipe: Recipe, spec: FamilySpec, model: torch.nn.Module, out_dir: Path, ema: EMA | None,
           checkpoint: Callable[[], Path | None]) -> None:  # fmt: skip
    """The final weights (train/export.py: written aside, renamed into place when complete). Refused from non-finite
    weights; when a write fails, the trained state is checkpointed (`checkpoint()`) and the error says where."""
    kind = recipe.exported
    if kind != "none" and not parameters_finite(model):
        raise UserError(f"the trained weights are not finite (NaN/Inf): nothing exported (the latest checkpoint: "
                        f"{latest_checkpoint(out_dir) or 'none'}); lower train.lr or set train.max_grad_norm, and "
                        "check the pretrained weights and the data for NaN/Inf")  # fmt: skip
    try:
        paths = export_weights(recipe, spec, model, out_dir, ema)
    except ExportFailed as e:
        try:
            ckpt = checkpoint()
            kept = f"the trained state is in checkpoint {ckpt}: fix the cause, then rerun with --resume to export it"
        except CheckpointFailed as again:  # (its partial folder removed): where the run's state is, or that it is lost
            kept = f"the checkpoint written in its place failed too ({again.cause}); {checkpoint_kept(again.latest)}"
        raise UserError(f"export of the {kind} weights to {e.final} failed ({e.cause}); {kept}") from None
    if dist.get_rank() == 0:
        print(f"metrics: {out_dir / 'metrics.jsonl'}")
        for path in paths:
            print(f"exported {kind} weights: {path}")
        if recipe.logging.wandb_mode == "offline":
            print(f"wandb offline run under {out_dir / 'wandb'} (upload later with `wandb sync`)")


def parse_args(argv: list[str] | None) -> tuple[Recipe, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_recipe_args(parser)
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
    parser.add_argument(
        "--reset-lr-schedule",
        action="store_true",
        help="on resume, restart the lr schedule (lr, lr_schedule, warmup_steps) at the resume step",
    )
    parser.add_argument(
        "--archive-previous",
        action="store_true",
        help="a fresh run into an output_dir holding another run's state moves that run into output_dir/archive/ first",
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of a user error")
    args = parser.parse_args(argv)
    recipe = recipe_from_args(args)
    # User errors, before any process group exists (each a UserError, the same on every rank): degrees and paths
    # (also checked by `preflight` before the imports), the model's config keys and the CP degree against the tokens.
    check_inputs(recipe, int(os.environ.get("WORLD_SIZE", "1")))
    check_model(recipe, family_spec(recipe.model))
    check_validation(recipe, family_spec(recipe.model))  # prompts, images, pipeline: before the model is built
    MetricsLogger.check_tracking(recipe)  # online wandb: a login and the server (train/tracking.py)
    return recipe, args


def progress(recipe: Recipe, start: int):
    """The loop's steps, with a tqdm bar on rank 0 when the recipe asks for one."""
    steps = range(start, recipe.train.max_steps)
    if dist.get_rank() != 0 or not recipe.logging.progress_bar:
        return steps
    from tqdm.auto import tqdm

    return tqdm(steps, initial=start, total=recipe.train.max_steps, desc="train")


def main(argv: list[str] | None = None) -> None:
    recipe, args = parse_args(argv)
    t = recipe.train

    # --- processes, devices, mesh ---------------------------------------------------------------------------------
    accelerator = init_processes(recipe)
    runtime.check_ranks_agree(job_identity(recipe, args))  # first collective: every rank the same recipe, flags, code
    device = accelerator.device
    dims = ParallelDims(*recipe.parallel.resolve(dist.get_world_size()), ring=recipe.parallel.cp_ring)
    mesh = dims.build(device.type)
    spec = family_spec(recipe.model)  # the family's spec, with the recipe's flow_shift
    amp = autocast_dtype(t.mixed_precision, device)
    out_dir = Path(recipe.output_dir)
    run = claim_output_dir(recipe, args, out_dir)  # this run's identity; whether it resumes the one recorded there
    watchdog = runtime.Watchdog.start(recipe.parallel.timeout_s)  # a phase stuck past timeout_s: one line, exit

    # --- data: every rank of a CP group reads the same batches; DP groups read different ones. First: a cache that
    # cannot be trained on (missing or truncated files, another family's) is said within seconds, before the model
    dataset = build_dataset(recipe, spec, cache_reads(spec.name))
    heldout = HeldOutLoss.of(recipe, spec, dataset, cache_reads(spec.name), mesh, device, amp)  # its split: not trained
    batches = make_batches(dataset, recipe, dp_rank=mesh.dp_rank, dp_size=dims.dp, device=device,
                           exclude=heldout.excluded if heldout else frozenset(),
                           tokens_of=token_budget(recipe, spec, dataset))  # fmt: skip
    check_text_lengths(dataset, spec, recipe, batches.sampler.batch_sizes)  # per bucket (train.batch_tokens)
    check_masks(dataset, dist.get_rank())  # loss masks that leave nothing to train: refused
    check_preservation(dataset, recipe, spec)  # train.preservation: every cache holds the preservation prompts

    # --- will it fit? train.estimate's prediction for this layout; refused (one line) when clearly over the device --
    memory = startup_check(recipe, dist.get_world_size(), device)
    if dist.get_rank() == 0:
        print(f"memory: {memory}")
        record_memory(out_dir, recipe, dist.get_world_size(), device.type, memory)  # for the run report

    # --- model: meta build → LoRA/full → CP hooks → activation levers → compile → FSDP2 → each rank's shard -------
    model, parallel = (build_experts if recipe.model.both_experts else build_model)(recipe, spec, mesh, device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = build_optimizer(params, t, partial_steps=isinstance(model, Experts))
    ema = EMA.of(recipe.ema, model)  # None without `ema`: each rank averages its own shards

    # --- resume ---------------------------------------------------------------------------------------------------
    app = AppState(model, optimizer, trainable_only=recipe.finetune.method == "lora", ema=ema)
    metrics = MetricsLogger(accelerator, out_dir, recipe_to_dict(recipe), recipe.logging, recipe.name or "run",
                            run_id=run["run"]["id"])  # fmt: skip
    start, scheduler = resume(recipe, run, args, app, scheduler, batches, metrics, mesh)
    print_layout(recipe, mesh, parallel, amp, sum(p.numel() for p in params), out_dir, batches.describe())
    batches.check_contract(mesh)  # a cheap cross-rank hash of the next batch: CP peers equal, DP groups differ

    # --- loop -----------------------------------------------------------------------------------------------------
    trainer = Trainer(t, spec, model, params, optimizer, scheduler, parallel, batches, mesh, device, amp,
                      Objective.of(recipe, spec), ema)  # fmt: skip
    # samples from the training transformer as it is (CP + FSDP in place, every rank), state untouched: validation.py
    validation = Validation(recipe, spec, model, device, amp, metrics, watchdog, start=start, ema=ema)
    validation.at_step(start)  # validation.at_start: a baseline before the first step
    if heldout and start == 0 and (value := heldout.at_step(model, 0, watchdog)) is not None:  # its at_start
        metrics.log({"step": 0, "val_loss": value})
    steps = progress(recipe, start)
    stop = StopRequest(device)  # from here on SIGINT/SIGTERM finish the step, write a checkpoint and exit 0
    save = functools.partial(save_state, recipe, spec, run, app, scheduler, batches, mesh)  # save(step): checkpoint
    for step in steps:
        watchdog.phase("train_step", step + 1)
        line = train_step(trainer, step)
        if heldout and (value := heldout.at_step(model, step + 1, watchdog)) is not None:
            line["val_loss"] = value
        if (step + 1) % recipe.logging.every_n_steps == 0 or step + 1 == t.max_steps or "val_loss" in line:
            metrics.log(line)
        if len(trainer.bad.streak) >= t.max_bad_steps:  # no checkpoint: nothing was applied since the last good step
            raise bad_steps_error(trainer.bad.streak)
        validation.at_step(step + 1)  # when due: samples of this step's weights
        stopped_by = stop.agreed()
        every = recipe.checkpoint.every_n_steps
        if stopped_by or (every and (step + 1) % every == 0):
            watchdog.phase("checkpoint", step + 1)
            ckpt = save(step + 1)
        if stopped_by:
            announce_stop(out_dir, step + 1, stopped_by, ckpt)
            break

    # --- export: atomic, never from non-finite weights; a failed one checkpoints first (resume exports it) ----------
    watchdog.phase("export", t.max_steps)
    if not stop.agreed_signal:  # a stopped run resumes from its checkpoint and exports at its end
        export(recipe, spec, model, out_dir, ema, lambda: final_checkpoint(out_dir, t.max_steps, save))
    finish(out_dir, t.max_steps, metrics, watchdog, stop, trainer.bad.streak)


def run_cli() -> int:
    """main() with a user error reported as one line (train/errors.py: once, exit code 2); `--debug` raises it."""
    try:
        main()
    except UserError as e:
        if "--debug" in sys.argv:
            raise
        return report(e)
    except Exception:
        if peer_reported() and "--debug" not in sys.argv:  # another rank's user error left this one in a collective
            return EXIT_CODE  # its one line is the job's; the launcher names the rank
        raise
    return 0


def run_rank() -> None:
    """What every rank a launcher starts runs after the preflight (`accelerate launch train/finetune.py ...`, and the
    test harness's warm ranks): tied to its launcher, main() with one-line user errors, no interpreter teardown."""
    runtime.die_with_launcher()  # SIGKILL of `accelerate launch` takes its ranks along: no orphans
    hostmem.tune()  # (again: the harness's warm ranks start here) host RSS tracks live memory, train/hostmem.py
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # diffusers transformers return reshaped views; FSDP2 warns on every forward. The trainer never modifies the
    # output in place (family specs map it out of place), which is the case that warning is about.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    quiet_interrupt()  # (again: the harness's warm ranks start here)
    code = run_cli()
    # Everything is written and the process group is destroyed. Skip the interpreter's teardown: gloo's background
    # threads were seen to abort a finished process there ("terminate called without an active exception").
    runtime.exit(code)  # after the exit hooks (the output_dir lock's release) and a flush


if __name__ == "__main__":
    run_rank()
