"""Prepared one-GPU script (≤ 8 minutes of device time): the CP attention kernels at Wan-14B attention shapes, then
the real trainer (`python -m train.launch ... train/finetune.py`) on CUDA at the Wan 2.1 1.3B shape.

    python -m bench.gpu_trainer            # on the GPU machine
    python -m bench.gpu_trainer --smoke    # tiny shapes on CPU: every code path, no figure (a test runs it)

Part 1, kernels (S = 27280 tokens, H = 40 heads, D = 128, bf16; a rank of CP degree N attends over all S tokens with
H/N heads, N = 1 and 4): per kernel of train/cp/kernels.py that runs here (`auto`, `backend` = diffusers' native op
pair, cuDNN, torch's flash, memory-efficient, flash-attn when installed), the whole `UlyssesAnythingAttention`
forward + backward on a 1-rank group as under a plan (the all-to-all's packing included, no wire), against plain
`F.scaled_dot_product_attention` forward + backward on (1, H/N, S, D): the time ratio (target ≤ 1.05 for the kernel
path), and the output and dQ / dK / dV differences against SDPA's, max |x - sdpa| / max |sdpa|: every kernel checked
against the same reference, hence against each other.

Part 3, the trainer: a random-init WanTransformer3DModel of Wan2.1-1.3B size written once as a bf16 pipeline folder
(`transformer/` only), then per case one launch of `recipes/wan/1.3b_lora.yaml` as a user runs it (1 process,
FSDP2 on one rank, sharded start, synthetic 480p × 81-frame latents (16, 21, 60, 104) = 32760 video tokens, 512 text
tokens, bf16 autocast, 5 steps, no checkpoint, export or validation): LoRA and full fine-tuning, without
checkpointing, with full or selective checkpointing (`train.checkpoint_policy`), compile on/off, and each diffusers
attention backend (at cp 1 the model's `model.attention_backend` serves attention; `parallel.attention_kernel` is the
CP path's, Part 1). Per case: median step time of steps 3-5, video tokens/s, MFU and the true peak against
memory.json's prediction. MFU = model FLOPs / step time / 989.4 TFLOP/s (H200 SXM dense bf16); model FLOPs = 3 ×
forward FLOPs for full fine-tuning and 2 × for LoRA (the frozen weights get no gradient; the adapters' < 1% left
out), recomputation not counted; forward FLOPs as docs/performance.md section 4 (`bench.gpu_h200.wan_forward_flops`).
Targets: ≥ 50% MFU without checkpointing, ≥ 42% with selective checkpointing (full fine-tuning, as section 4).

Part 2, the run's state on a GPU (the family's tiny pipeline: a Wan transformer of 7 heads, its VAE and text
encoder, so that validation renders through `WanPipeline`): run A, 4 LoRA steps with a checkpoint every 2 steps,
selective checkpointing, validation samples at step 4 and the LoRA export; run B, a copy of A's folder holding only
its step-2 checkpoint, resumed to step 4. Reported: the resumed steps' loss and grad norm against A's (equal on CPU;
on a GPU the attention backward's atomics may differ in the last bits), the samples written, and the exported LoRA
loaded into `WanPipeline` (`load_lora_weights`).

Every case has a deadline (CASE_TIMEOUT_S, and nothing starts with less than MIN_CASE_S left before DEADLINE_S),
catches failures (the row says why and the next case runs) and prints its row as it ends.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.gpu_h200 import (
    PEAK_TFLOPS,
    SMOKE_WAN,
    WAN_1_3B,
    accelerate_config,
    device_used,
    free,
    gib,
    header,
    init_single_rank_group,
    is_oom,
    last_error_line,
    launch_env,
    log,
    measured_peaks,
    read_run,
    row,
    run_launch,
    start,
    time_ms,
    trainer_command,
    wan_forward_flops,
    write_pipeline,
)

DEADLINE_S = 470.0  # the whole script (< 8 minutes); a launch still running then is killed
CASE_TIMEOUT_S = 150.0  # one launch: imports, the sharded load, 5 steps (a compile case compiles for tens of s)
MIN_CASE_S = 45.0
T0 = time.perf_counter()

ATTN = dict(S=27280, H=40, D=128, degrees=(1, 4))
SMOKE_ATTN = dict(S=96, H=8, D=16, degrees=(1, 4))
STEPS, TIMED_FROM = 5, 2  # the step time: median of the steps after the first TIMED_FROM
TEXT_TOKENS = 512
SHAPES = dict(latents=[16, 21, 60, 104], prompt_embeds=[TEXT_TOKENS, WAN_1_3B["text_dim"]])
SMOKE_SHAPES = dict(latents=[16, 2, 8, 8], prompt_embeds=[8, SMOKE_WAN["text_dim"]])
_CKPT = ("train.gradient_checkpointing=true",)
_KEEP = (*_CKPT, "train.checkpoint_policy=keep_attention")
_FULL = ("finetune.method=full",)
# (case, --set overrides) in the order they run: the targets first, a short budget drops the last ones.
CASES = [
    ("full, no checkpointing", _FULL),
    ("full, keep_attention", (*_FULL, *_KEEP)),
    ("LoRA, no checkpointing", ()),
    ("LoRA, keep_attention", _KEEP),
    ("LoRA, checkpointing (full)", _CKPT),
    ("LoRA, keep_attention_matmul", (*_CKPT, "train.checkpoint_policy=keep_attention_matmul")),
    ("LoRA, compile", ("train.compile=true",)),
    ("LoRA, keep_attention + compile", (*_KEEP, "train.compile=true")),
    ("LoRA, backend _native_cudnn", ("model.attention_backend=_native_cudnn",)),
    ("LoRA, backend _native_flash", ("model.attention_backend=_native_flash",)),
    ("LoRA, backend _native_efficient", ("model.attention_backend=_native_efficient",)),
    ("LoRA, backend flash (flash-attn)", ("model.attention_backend=flash",)),
]
SMOKE_CASES = [c for c in CASES if c[0] == "LoRA, keep_attention"]


def elapsed() -> float:
    return time.perf_counter() - T0


# Part 1: the kernels -----------------------------------------------------------------------------------------------


def kernels_part(device: torch.device, shapes: dict) -> None:
    from train.cp.kernels import AUTO_ORDER, KERNELS, pick

    S, H, D = shapes["S"], shapes["H"], shapes["D"]
    log(f"\n## Part 1: CP attention kernels, forward + backward, bf16, S={S}, H={H}, D={D} (a rank of degree N)\n")
    error = init_single_rank_group(device)
    if error:
        log(f"no 1-rank process group: {error}")
        return
    dtype = torch.bfloat16
    names = ["auto", "backend"] + [n for n in AUTO_ORDER if KERNELS[n].refuses(device, dtype, False) is None]
    log(f"auto = {pick('auto', device, dtype, False).name} here. Differences: max |x - sdpa| / max |sdpa|.\n")
    header(["N", "kernel", "sdpa ms", "kernel path ms", "/ sdpa", "out", "dQ", "dK", "dV"])
    for N in shapes["degrees"]:
        _kernels_at(device, N, S, H // N, D, names)
        free(device)


def _kernels_at(device: torch.device, N: int, S: int, h: int, D: int, names: list[str]) -> None:
    from bench.gpu_h200 import _StubCP, backend_ops
    from train.cp import ContextParallelState
    from train.cp.ulysses import UlyssesAnythingAttention

    fwd_op, bwd_op, _ = backend_ops(device)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (torch.randn((1, S, h, D), device=device, dtype=torch.bfloat16, generator=gen) for _ in range(4))
    qs, ks, vs = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))

    def sdpa():
        out = F.scaled_dot_product_attention(qs, ks, vs)
        return [
            out.transpose(1, 2),
            *(g.transpose(1, 2) for g in torch.autograd.grad(out, (qs, ks, vs), do.transpose(1, 2))),
        ]

    ref = sdpa()
    t_sdpa = time_ms(sdpa, device)
    for name in names:
        if elapsed() > 0.25 * DEADLINE_S:
            row([N, name, "skipped (time budget)"] + [""] * 6)
            continue
        cells = [N, name, f"{t_sdpa:.2f}"]
        try:
            state = ContextParallelState(context_parallel_config=_StubCP(), scope="bench", kernel=name)
            qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))

            def path(state=state, qf=qf, kf=kf, vf=vf):
                state.layout.reset(enabled=True)  # as under a plan: lengths from the split, no size exchange
                state.layout.record(S, 1)
                out = UlyssesAnythingAttention.apply(qf, kf, vf, None, 0.0, False, None, False, False, fwd_op, bwd_op,
                                                     state)  # fmt: skip
                return [out, *torch.autograd.grad(out, (qf, kf, vf), do)]

            got = path()
            t_path = time_ms(path, device)
            diffs = [((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(got, ref)]
            cells += [f"{t_path:.2f}", f"{t_path / t_sdpa:.3f}", *(f"{d:.1e}" for d in diffs)]
        except Exception as e:  # noqa: BLE001 - one failed kernel must not stop the others
            cells.append("OOM" if is_oom(e) else f"error: {type(e).__name__}: {e}"[:160])
        row(cells + [""] * (9 - len(cells)))
        free(device)


# Part 3: the trainer -----------------------------------------------------------------------------------------------


def _sets(out: Path, pipeline: Path, shapes: dict, steps: int) -> list[str]:
    synthetic = (
        f"{{num_samples: 8, shapes: {{latents: {shapes['latents']}, prompt_embeds: {shapes['prompt_embeds']}}}}}"
    )
    return [f"output_dir={out}", f"model.pretrained_path={pipeline}", "model.init_config=null", "parallel.cp=1",
            "parallel.dp_shard=1", "parallel.memory_check=off", f"train.max_steps={steps}", "train.batch_size=1",
            "train.gradient_checkpointing=false",  # (the recipe's is on; the cases that checkpoint say so)
            "checkpoint.every_n_steps=0", "checkpoint.export=none", "logging.wandb_mode=disabled",
            "logging.progress_bar=false", "logging.every_n_steps=1", "data.cache_dir=null",
            f"data.synthetic={synthetic}"]  # fmt: skip


def _launch(device: torch.device, cmd: list[str], out: Path, timeout: float) -> tuple[int | None, str, float]:
    t = time.perf_counter()
    log_path = out.with_suffix(".log")
    rc = run_launch(cmd, launch_env(device), log_path, timeout)
    return rc, log_path.read_text(errors="replace"), time.perf_counter() - t


def _status(rc: int | None, text: str, wall: float, steps: int, timeout: float) -> str:
    if rc == 0:
        return f"ok ({steps} steps, {wall:.0f} s)"
    if rc is None:
        return f"timeout: killed after {timeout:.0f} s, {steps} steps logged"
    cause = "OOM: " if "out of memory" in text.lower() else ""
    return f"exit {rc}: {cause}{last_error_line(text)[:160]}".replace("|", "/")


def step_row(label: str, device: torch.device, cfg: dict, shapes: dict, out: Path, others: int, status: str) -> list:
    """One Part 3 row from a run's own files (metrics.jsonl, memory.json)."""
    memory, lines = read_run(out)
    timed = [m["step_time_s"] for m in lines[TIMED_FROM:]] or [m["step_time_s"] for m in lines]
    _, f, h, w = shapes["latents"]
    p = cfg["patch_size"]
    video = (f // p[0]) * (h // p[1]) * (w // p[2])
    full = "full" in label
    flops = (3 if full else 2) * wan_forward_flops(cfg, video, shapes["prompt_embeds"][0])
    cuda = device.type == "cuda"
    if not timed:
        return [label, "—", "—", "—", "—", gib(memory.get("predicted_peak_bytes")), "—", status]
    step = statistics.median(timed)
    true, _ = measured_peaks(lines, others)
    return [label, f"{step:.3f}", f"{video / step:.0f}", f"{flops / step / 1e12:.1f}",
            f"{100 * flops / step / 1e12 / PEAK_TFLOPS:.1f}%" if cuda else "n/a (CPU)",
            gib(memory.get("predicted_peak_bytes")), gib(true) if cuda else "n/a (CPU)", status]  # fmt: skip


def trainer_part(device: torch.device, cfg: dict, cases: list, shapes: dict, tmp: Path, config: Path) -> None:
    log(
        f"\n## Part 3: the trainer, 1 process, Wan-1.3B shape, latents {tuple(shapes['latents'])}, "
        f"{shapes['prompt_embeds'][0]} text tokens, {STEPS} steps (time: median of steps {TIMED_FROM + 1}-{STEPS})\n"
    )
    t = time.perf_counter()
    n = write_pipeline(tmp / "pipeline", cfg, device)
    log(f"Random-init transformer, {n / 1e9:.3f} B parameters, bf16, written in {time.perf_counter() - t:.0f} s.\n")
    header(["case", "step s", "video tokens/s", "TFLOP/s", "MFU", "predicted peak GiB", "measured true peak GiB",
            "run"])  # fmt: skip
    for i, (label, sets) in enumerate(cases):
        left = DEADLINE_S - elapsed()
        if left < MIN_CASE_S:
            row([label, "skipped (time budget)"] + [""] * 6)
            continue
        try:
            out = tmp / f"case{i}"
            free(device)
            others = device_used(device)
            cmd = trainer_command(str(config), _sets(out, tmp / "pipeline", shapes, STEPS) + list(sets))
            timeout = min(CASE_TIMEOUT_S, left)
            rc, text, wall = _launch(device, cmd, out, timeout)
            status = _status(rc, text, wall, len(read_run(out)[1]), timeout)
            row(step_row(label, device, cfg, shapes, out, others, status))
        except Exception as e:  # noqa: BLE001 - one failed case must not stop the others
            row([label, f"error: {type(e).__name__}: {e}"[:200]] + [""] * 6)


# Part 2: checkpoint, resume, validation, export --------------------------------------------------------------------


def state_part(device: torch.device, tmp: Path, config: Path) -> None:
    from train.models import build_tiny_pipeline

    log("\n## Part 2: checkpoint, resume, validation samples and export (the tiny Wan pipeline, LoRA, "
        "keep_attention)\n")  # fmt: skip
    if DEADLINE_S - elapsed() < 2 * MIN_CASE_S:
        log("skipped (time budget)")
        return
    pipeline = build_tiny_pipeline("wan", tmp / "tiny_pipeline")
    validation = ("validation={prompts: [{prompt: a red square moving left}], every_n_steps: 4, "
                  "num_inference_steps: 2, height: 32, width: 32, num_frames: 9}")  # fmt: skip
    sets = [f"model.pretrained_path={pipeline}", "model.init_config=null", "parallel.cp=1", "parallel.dp_shard=1",
            "train.max_steps=4", "checkpoint.every_n_steps=2", "checkpoint.keep_last=2", "checkpoint.export=lora",
            "logging.wandb_mode=disabled", "logging.progress_bar=false", "logging.every_n_steps=1", *_KEEP,
            validation]  # fmt: skip
    recipe = "recipes/tiny/wan.yaml"
    a, b = tmp / "run_a", tmp / "run_b"
    rc, text, wall = _launch(device, _command(config, recipe, [f"output_dir={a}", *sets]), a, CASE_TIMEOUT_S)
    _, lines_a = read_run(a)
    log(f"- run A: {_status(rc, text, wall, len(lines_a), CASE_TIMEOUT_S)}")
    if rc != 0:
        return
    samples = sorted(p.name for p in (a / "samples").rglob("*") if p.is_file())
    log(f"- validation samples of run A: {', '.join(samples) or 'none'}")
    log(f"- exported LoRA loads into WanPipeline: {_lora_loads(pipeline, a / 'lora')}")
    shutil.copytree(a, b)
    for later in sorted((b / "checkpoints").glob("step_*"))[1:]:
        shutil.rmtree(later)
    resumed = [f"output_dir={b}", *sets, "checkpoint.resume=true"]
    rc, text, wall = _launch(device, _command(config, recipe, resumed), b, CASE_TIMEOUT_S)
    _, lines_b = read_run(b)
    log(f"- run B (A's copy, step-2 checkpoint only, resumed): {_status(rc, text, wall, len(lines_b), CASE_TIMEOUT_S)}")
    if rc == 0:
        pairs = list(zip(lines_a[2:], lines_b[2:]))
        worst = max((abs(x[k] - y[k]) / max(abs(x[k]), 1e-30) for x, y in pairs for k in ("loss", "grad_norm")),
                    default=float("nan"))  # fmt: skip
        steps = [m["step"] for m in lines_b]
        log(f"- resumed steps {steps[2:]} vs run A's: loss and grad norm max relative difference {worst:.1e}"
            f"{' (exact)' if worst == 0 else ''}")  # fmt: skip


def _command(config: Path, recipe: str, sets: list[str]) -> list[str]:
    cmd = trainer_command(str(config), sets)
    cmd[cmd.index("--recipe") + 1] = recipe
    return cmd


def _lora_loads(pipeline: Path, lora: Path) -> str:
    try:
        from diffusers import WanPipeline

        pipe = WanPipeline.from_pretrained(pipeline)
        pipe.load_lora_weights(lora)
        n = sum("lora" in name for name, _ in pipe.transformer.named_parameters())
        return f"yes ({n} LoRA tensors)" if n else "NO (no LoRA tensor in the transformer)"
    except Exception as e:  # noqa: BLE001 - reported
        return f"NO: {type(e).__name__}: {e}"[:200]


def main() -> None:
    device, smoke = start(__doc__, "GPU trainer script", f"deadline {DEADLINE_S:.0f} s")
    try:
        kernels_part(device, SMOKE_ATTN if smoke else ATTN)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    if dist.is_initialized():
        dist.destroy_process_group()  # (and its NCCL buffers, before the launches measure the device)
    free(device)
    tmp = Path(tempfile.mkdtemp(prefix="ctxtrain-gpu-trainer-"))
    try:
        config = accelerate_config(device, tmp)
        for part in (  # the run's state first: two short launches the time budget must not drop
            lambda: state_part(device, tmp, config),
            lambda: trainer_part(device, SMOKE_WAN if smoke else WAN_1_3B, SMOKE_CASES if smoke else CASES,
                                 SMOKE_SHAPES if smoke else SHAPES, tmp, config),
        ):  # fmt: skip
            try:
                part()
            except Exception:  # noqa: BLE001
                traceback.print_exc()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"\n(total {elapsed():.0f} s)")


if __name__ == "__main__":
    main()
