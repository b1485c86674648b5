"""Fine-tune a diffusers transformer under context parallelism + FSDP2.

    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml train/finetune.py --recipe recipes/tiny/wan.yaml
    accelerate launch --config_file configs/accelerate/gpu_8.yaml train/finetune.py \
        --recipe recipes/wan/1.3b_lora.yaml --set parallel.cp=4 --set train.max_steps=2000

Reads top to bottom: recipe → processes and mesh → model (LoRA/full, CP, FSDP) → optimizer → data → resume → loop →
export. Everything per model family comes from its spec (train/models/) and CP plan (cp_plans/).
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
from pathlib import Path

if __package__ in (None, ""):  # `accelerate launch train/finetune.py` runs this file as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from train.checkpoint import AppState, latest_checkpoint, load_checkpoint, save_checkpoint
from train.config import Recipe, add_recipe_args, recipe_from_args, recipe_to_dict, save_recipe
from train.data.batches import build_dataset, check_text_lengths, make_batches
from train.export import export_full, export_lora
from train.metrics import MetricsLogger, peak_memory_bytes
from train.modeling import apply_finetune, load_transformer
from train.models import get_family
from train.objective import add_noise, flow_matching_loss, flow_matching_target, loss_weight, sample_stream_sigmas
from train.parallel import Mesh, ParallelDims, parallelize


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


def step_generator(seed: int, step: int, micro: int, dp_rank: int) -> torch.Generator:
    """Noise, timesteps and caption dropout for one micro-batch. Seeded by the DATA-PARALLEL rank, so every rank of
    a CP group draws the same values (they share one sample) and DP groups differ. Stateless: exact on resume."""
    return torch.Generator().manual_seed(hash((seed, step, micro, dp_rank)) & 0x7FFF_FFFF_FFFF_FFFF)


def compute_loss(model, spec, batch: dict, recipe: Recipe, gen: torch.Generator, cp: bool, device) -> torch.Tensor:
    """One micro-batch of the flow-matching objective: noise the latents, predict the velocity, weighted MSE."""
    t = recipe.train
    x0 = {s: batch[s] for s in spec.streams}
    B = x0["latents"].shape[0]
    sigmas = sample_stream_sigmas(B, spec, scheme=t.timestep_sampling, logit_mean=t.logit_mean, logit_std=t.logit_std,
                                  mode_scale=t.mode_scale, image_seq_len=spec.image_seq_len(x0["latents"].shape[1:]),
                                  generator=gen)  # fmt: skip
    noise = {s: torch.randn(x.shape, generator=gen).to(device=device, dtype=x.dtype) for s, x in x0.items()}
    noisy = {s: add_noise(x0[s], noise[s], sigmas[s].to(device)) for s in x0}
    kwargs = spec.forward_kwargs(batch, noisy, {s: v.to(device) for s, v in sigmas.items()},
                                 model_config=model.config, cp=cp)  # fmt: skip
    autocast = recipe.train.mixed_precision != "no" and device.type == "cuda"
    with torch.autocast(device.type, dtype=torch.bfloat16) if autocast else nullcontext():
        out = model(**kwargs, return_dict=False)
    preds = spec.predictions(out, {s: x.shape for s, x in x0.items()}, model_config=model.config)
    losses = [
        flow_matching_loss(preds[s], flow_matching_target(x0[s], noise[s]), loss_weight(sigmas[s], t.loss_weighting))
        for s in x0
    ]
    return sum(losses)


def print_layout(recipe: Recipe, mesh: Mesh, model, reduction, n_trainable: int, out_dir: Path) -> None:
    spec_plan = getattr(model, "_cp_plan_spec", None)
    layout = {
        "mesh": mesh.describe(),
        "cp_plan": str(spec_plan.path) if spec_plan is not None else "none (cp = 1)",
        "gradient_reduction": f"{reduction.mode}: SUM over cp={reduction.cp}, MEAN over dp={reduction.dp} "
        "(startup self-check passed)",
        "trainable_parameters": n_trainable,
    }
    if dist.get_rank() == 0:
        print("recipe:", json.dumps(recipe_to_dict(recipe), indent=1))
        print("parallel layout:", json.dumps(layout, indent=1))
        save_recipe(recipe, out_dir / "recipe.yaml")
        (out_dir / "layout.json").write_text(json.dumps(layout, indent=1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_recipe_args(parser)
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
    args = parser.parse_args(argv)
    recipe = recipe_from_args(args)
    t = recipe.train

    # --- processes, devices, mesh ---------------------------------------------------------------------------------
    accelerator = init_processes(recipe)
    device = accelerator.device
    dims = ParallelDims(*recipe.parallel.resolve(dist.get_world_size()))
    mesh = dims.build(device.type)
    spec = get_family(recipe.model.family)
    out_dir = Path(recipe.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    # --- model: load → LoRA/full → CP hooks → checkpointing → FSDP2 (one place, one order: train/parallel.py) ------
    model = load_transformer(recipe.model, spec, seed=t.seed)
    apply_finetune(model, recipe.finetune, spec, seed=t.seed)
    model.to(device)
    reduction = parallelize(
        model, mesh, cp_plan=recipe.model.cp_plan, gradient_checkpointing=t.gradient_checkpointing,
        fsdp=recipe.parallel.fsdp, reshard_after_forward=recipe.parallel.reshard_after_forward,
        param_dtype=torch.bfloat16 if device.type == "cuda" and t.mixed_precision != "no" else None,
        cp_transport=recipe.parallel.cp_transport,
    )  # fmt: skip
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), eps=t.eps, weight_decay=t.weight_decay)
    from diffusers.optimization import get_scheduler

    scheduler = get_scheduler(t.lr_schedule, optimizer, num_warmup_steps=t.warmup_steps, num_training_steps=t.max_steps)

    # --- data: every rank of a CP group reads the same batches; DP groups read different ones ----------------------
    dataset = build_dataset(recipe, spec)
    check_text_lengths(dataset, spec, recipe)
    batches = make_batches(dataset, recipe, dp_rank=mesh.dp_rank, dp_size=dims.dp, device=device)

    # --- resume ---------------------------------------------------------------------------------------------------
    app = AppState(model, optimizer, trainable_only=recipe.finetune.method == "lora")
    metrics = MetricsLogger(accelerator, out_dir, recipe_to_dict(recipe), recipe.logging, recipe.name or "run")
    step = 0
    ckpt = latest_checkpoint(out_dir) if (args.resume or recipe.checkpoint.resume) else None
    if ckpt is not None:
        state = load_checkpoint(ckpt, app)
        scheduler.load_state_dict(state["scheduler"])
        batches.load_state_dict(state["data"])
        step = state["step"]
        metrics.truncate_after(step)
        if dist.get_rank() == 0:
            print(f"resumed from {ckpt} at step {step}")
    else:
        metrics.truncate_after(0)  # a fresh run in a used output_dir starts a fresh metrics.jsonl
    print_layout(recipe, mesh, model, reduction, sum(p.numel() for p in params), out_dir)
    batches.check_contract(mesh)  # a cheap cross-rank hash of the next batch: CP peers equal, DP groups differ

    # --- loop -----------------------------------------------------------------------------------------------------
    cp_on, dp_group = dims.cp > 1, (mesh.dp.get_group() if dims.dp > 1 else None)
    progress = range(step, t.max_steps)
    if dist.get_rank() == 0 and recipe.logging.progress_bar:
        from tqdm.auto import tqdm

        progress = tqdm(progress, initial=step, total=t.max_steps, desc="train")
    for step in progress:
        t0, loss_sum, tokens = time.perf_counter(), torch.zeros((), device=device), 0
        for micro in range(t.grad_accum):
            if reduction.mode == "fsdp2":  # reduce-scatter once per optimizer step, on the last micro-batch
                model.set_requires_gradient_sync(micro == t.grad_accum - 1)
            batch = next(batches)
            gen = step_generator(t.seed, step, micro, mesh.dp_rank)
            batch = batches.caption_dropout(batch, t.caption_dropout, gen)
            loss = compute_loss(model, spec, batch, recipe, gen, cp_on, device) / t.grad_accum
            loss.backward()
            loss_sum += loss.detach()
            tokens += batch["latents"].numel() // batch["latents"].shape[1]  # latent positions in the micro-batch
        if reduction.mode == "allreduce":
            reduction.reduce_gradients(params)  # SUM over CP, MEAN over DP
        grad_norm = torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm or math.inf)  # the true global norm
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if dp_group is not None:  # loss logged as the mean over data-parallel groups (CP peers already agree)
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG, group=dp_group)
        dt = time.perf_counter() - t0
        # tokens/s over the whole job: each DP group processes its own micro-batches (CP ranks share one).
        if (step + 1) % recipe.logging.every_n_steps == 0 or step + 1 == t.max_steps:
            metrics.log({
                "step": step + 1, "loss": loss_sum.item(), "grad_norm": grad_norm.item(),
                "lr": scheduler.get_last_lr()[0], "tokens_per_s": tokens * dims.dp / dt,
                "step_time_s": dt, "peak_mem_bytes": peak_memory_bytes(device),
            })  # fmt: skip
        every = recipe.checkpoint.every_n_steps
        if every and (step + 1) % every == 0:
            trainer_state = {"step": step + 1, "scheduler": scheduler.state_dict(), "data": batches.state_dict()}
            save_checkpoint(out_dir, step + 1, app, trainer_state, recipe.checkpoint.keep_last)

    # --- export ---------------------------------------------------------------------------------------------------
    export = recipe.checkpoint.export
    if export == "auto":
        export = recipe.finetune.method
    if export == "lora":
        path = export_lora(model, spec.pipeline_class, out_dir)
    elif export == "full":
        path = export_full(model, out_dir)
    if dist.get_rank() == 0:
        print(f"metrics: {out_dir / 'metrics.jsonl'}")
        if export != "none":
            print(f"exported {export} weights: {path}")
        if recipe.logging.wandb_mode == "offline":
            print(f"wandb offline run under {out_dir / 'wandb'} (upload later with `wandb sync`)")
    dist.barrier()
    metrics.close()  # ends accelerate's trackers (which may tear the process group down): after the last collective
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # diffusers transformers return reshaped views; FSDP2 warns on every forward. The trainer never modifies the
    # output in place (family specs map it out of place), which is the case that warning is about.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    main()
    # Everything is written and the process group is destroyed. Skip the interpreter's teardown: gloo's background
    # threads were seen to abort a finished process there ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
