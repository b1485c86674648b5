"""Prepared single-H200 benchmark (< 9 minutes): local Ulysses attention cost, a Wan-1.3B-size training step, and the
real trainer's peak device memory against train.estimate's prediction.

Not runnable on the CPU machines this project is developed on; `--smoke` runs every code path at tiny shapes on CPU
(or whatever device is present) so the script itself is tested. On the H200: `python -m bench.gpu_h200`.

Part 1 (Wan-14B attention shapes, bf16, S = 27280 tokens, H = 40 heads, D = 128): for a CP degree N in 1, 2, 4, 8 a
rank attends over all S tokens with H/N heads. Per N, forward + backward of one attention layer:
- `sdpa`: plain `F.scaled_dot_product_attention` on (1, H/N, S, D) (the floor: no layout work at all);
- `backend op`: diffusers' `_native_flash` forward/backward ops on (1, S, H/N, D) (what our CP path calls; it
  transposes to (B, H, S, D) and back internally);
- `layout`: our packing copies alone, the real `seq_to_heads` / `heads_to_seq` of `train.cp.a2a` with the
  layout of rank 0 at degree N and a loopback transport (the all-to-all returns its send buffer: no communication,
  only the copies a rank does): Q/K/V and dO in, O and dQ/dK/dV out;
- `layout + op`: their sum = the local work of our Ulysses-Anything attention per rank, without the wire;
- `full fn, 1 rank`: `UlyssesAnythingAttention` on a real 1-rank NCCL group with input (1, S, H/N, D): the whole
  function as under a plan (lengths from the layout registry: no size exchange, no device->host sync; packing,
  1-rank all-to-all, backend op).
The ratios are against `sdpa`.

Part 2: the attention backends with a real kernel (flash, _native_cudnn, _native_efficient, _native_flash), each
against `native` on the same 2-block Wan model in bf16 (4096 video tokens): output and every gradient.

Part 3: a bf16 training step (forward, MSE loss, backward, fused AdamW on bf16 weights) of a random-init
WanTransformer3DModel of Wan2.1-1.3B size (30 layers, 12 heads x 128 = 1536, ffn 8960, text_dim 4096, in/out 16,
patch (1, 2, 2)), 512 text tokens, 480p latents (60 x 104) at 9 and 21 latent frames (14040 and 32760 video tokens),
with and without gradient checkpointing and torch.compile, both applied per block exactly as the trainer does
(`train.parallel.apply_activation_levers`). Reported: step time, video tokens/s, TFLOP/s and MFU against 989 TFLOP/s
(H200 SXM dense bf16). Model FLOPs per step = 3 x forward FLOPs (recomputation not counted), forward FLOPs =
  layers x [2 S (4 d^2 + 2 d^2 + 2 d f) + 2 L (2 d^2) + 4 S^2 d + 4 S L d]
  + 2 S d (2 c p) + 2 L (t d + d^2)
with S video tokens, L text tokens, d model dim, f ffn dim, c p = 16 x 4 patch channels, t text_dim: self-attention
Q/K/V/O, cross-attention Q/O on video and K/V on text, FFN, self- and cross-attention scores + weighted sums, patch
embedding + output projection, text embedder. Norms, modulation, RoPE and the time embedder are left out (< 1%).

Part 4: the real trainer's peak device memory against train.estimate, at the Wan 2.1 1.3B shape. The Part 3 model
(random init, bf16, built on the GPU) is written once as a local pipeline folder (`transformer/` only); each case
then launches the trainer as a user does, `python -m train.launch --config_file <1-GPU accelerate config>
--num_processes 1 train/finetune.py --recipe recipes/wan/1.3b_lora.yaml --set ...`, on synthetic 480p 81-frame data
(latents (16, 21, 60, 104): 32760 video tokens, 512 text tokens), gradient checkpointing, 3 steps, no checkpoint or
export: LoRA with adamw, with `finetune.fp8_base`, with `parallel.cpu_offload`; full fine-tuning with adamw (fp32
masters), bf16 masters, cpu_offload, adamw_8bit, and bf16 masters + adamw_8bit. Per case, from the run's own files:
predicted = `memory.json`'s predicted_peak_bytes (train.estimate for that exact recipe, layout and device); measured
true peak = max over the steps of metrics.jsonl's peak_reserved + device_used - reserved (the caching allocator's
reserved peak plus the CUDA context and NCCL buffers), less what the device held before the launch (`others`: this
process's CUDA context; device_used counts the whole device); max allocated (max_memory_allocated); their ratio;
the last step's time; the run's exit (a failed launch: its exit code and the line naming the cause). On CPU
(`--smoke`: the tiny model, one case) the device fields do not exist and say so ("n/a (CPU)"): only the launch, the
prediction and the files' reading are exercised.

Every case of Parts 1-3 is timed with CUDA events (median of a few repeats after warm-up), catches OOM and any other
error (the row says so and the next case runs), and none starts after PARTS_1_3_S seconds; a Part 4 launch runs at
most CASE_TIMEOUT_S and until DEADLINE_S (then it is killed and the row says so), none starts with less than
MIN_CASE_S left. Rows print as they finish.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

# The whole script: nothing starts after it, and a trainer launch still running then is killed (< 9 minutes in all).
DEADLINE_S = float(os.environ.get("BENCH_DEADLINE_S", 510))
# Parts 1-3 (78 s in all on the H200 of docs/performance.md section 4) start no new case after PARTS_1_3_S, leaving
# Part 4's trainer launches the rest.
PARTS_1_3_S = 0.3 * DEADLINE_S
PEAK_TFLOPS = 989.4  # H200 SXM dense bf16 (no sparsity)
T0 = time.perf_counter()

WAN_14B_ATTN = dict(S=27280, H=40, D=128, degrees=(1, 2, 4, 8))
WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6)  # fmt: skip
# (label, latent frames, latent height, latent width, gradient checkpointing, compile): the levers applied as the
# trainer applies them (train.parallel.apply_activation_levers: per-block checkpoint, then per-block torch.compile).
STEP_CASES = [
    ("480p, 81 frames (32k tokens)", 21, 60, 104, False, False),  # may OOM without checkpointing: reported
    ("480p, 81 frames, ckpt", 21, 60, 104, True, False),
    ("480p, 81 frames, compile", 21, 60, 104, False, True),
    ("480p, 81 frames, ckpt + compile", 21, 60, 104, True, True),
    ("480p, 33 frames", 9, 60, 104, False, False),
]
# Attention backends with a real kernel, each checked against `native` (a Wan model's output and every gradient).
BACKENDS = ["flash", "_native_cudnn", "_native_efficient", "_native_flash"]
TEXT_TOKENS = 512

SMOKE_ATTN = dict(S=96, H=8, D=16, degrees=(1, 2, 4, 8))
SMOKE_WAN = dict(WAN_1_3B, num_attention_heads=2, attention_head_dim=16, text_dim=32, freq_dim=32, ffn_dim=64,
                 num_layers=2)  # fmt: skip
# No compile row on CPU: inductor's C++ build of its kernels is ~40 s on a cold cache (one g++ run per kernel), and the
# levers it would exercise (`_set_levers` -> train.parallel.apply_activation_levers, compile included) are the
# trainer's, proven under CP 2 by tests/test_finetune.py's activation-levers-and-compile run.
SMOKE_STEP_CASES = [("smoke", 2, 8, 8, False, False), ("smoke, ckpt", 2, 8, 8, True, False)]
SMOKE_TEXT_TOKENS = 8


def log(msg: str = "") -> None:
    print(msg, flush=True)


def elapsed() -> float:
    return time.perf_counter() - T0


def out_of_time(limit_s: float = DEADLINE_S) -> bool:
    return elapsed() > limit_s


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device: torch.device, warmup: int = 2, reps: int = 5) -> float:
    """Median wall time of `fn()` in ms (CUDA events on GPU)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def row(cells: list) -> None:
    log("| " + " | ".join(str(c) for c in cells) + " |")


def to_bf16(model: torch.nn.Module) -> None:
    """bf16, except what diffusers keeps in fp32 (norms, RoPE, time embedder), as from_pretrained(torch_dtype=bf16)."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    for pname, p in model.named_parameters():
        if not keep & set(pname.split(".")):
            p.data = p.data.to(torch.bfloat16)


def header(cols: list[str]) -> None:
    row(cols)
    log("|" + "|".join("---" for _ in cols) + "|")


# Part 1: attention + layout ----------------------------------------------------------------------------------------


class _Ctx:
    """Stands in for an autograd ctx for diffusers' forward/backward ops."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


class _Loopback:
    """A transport whose all-to-all returns its send buffer: only the local packing copies remain."""

    def __init__(self) -> None:
        from train.cp.comm import CommStats

        self.stats = CommStats()

    def all_to_all(self, flat, in_splits, out_splits, group, site, max_elems=None):
        assert sum(in_splits) == sum(out_splits), "loopback needs even shapes"
        return flat

    def all_gather(self, x, group, site):
        return x.unsqueeze(0)


def backend_ops(device: torch.device):
    from diffusers.models import attention_dispatch as ad

    if device.type == "cuda":
        return ad._native_flash_attention_forward_op, ad._native_flash_attention_backward_op, "_native_flash"
    return ad._native_attention_forward_op, ad._native_attention_backward_op, "native"


def init_single_rank_group(device: torch.device) -> str | None:
    """A 1-rank process group (NCCL on GPU, gloo on CPU); returns an error string when it cannot be made."""
    if dist.is_initialized():
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    try:
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, rank=0, world_size=1, **kwargs)
        return None
    except Exception as e:  # noqa: BLE001 - reported in the table
        return f"{type(e).__name__}: {e}"


class _StubMesh:
    def get_group(self):
        return dist.group.WORLD


class _StubCP:
    _ulysses_mesh = _StubMesh()
    _world_size = 1


def attention_part(device: torch.device, shapes: dict) -> None:
    fwd_op, bwd_op, op_name = backend_ops(device)
    S, H, D = shapes["S"], shapes["H"], shapes["D"]
    log(f"\n## Part 1: one attention layer, forward + backward, bf16, S={S}, H={H}, D={D} (per rank at degree N)\n")
    log(f"backend op = diffusers `{op_name}` forward/backward ops; ratios vs plain SDPA on (1, H/N, S, D).\n")
    group_error = init_single_rank_group(device)
    header(["N", "local q shape", "sdpa ms", "backend op ms", "layout ms (Q/K/V,O,dO,dQ/dK/dV)", "layout GB/s",
            "layout + op ms", "(layout + op) / sdpa", "full fn, 1 rank ms", "full fn / sdpa"])  # fmt: skip
    for N in shapes["degrees"]:
        if out_of_time(PARTS_1_3_S):
            row([N, "skipped (time budget)"] + [""] * 8)
            continue
        cells = [N]
        try:
            _attention_case(N, S, H, D, device, fwd_op, bwd_op, group_error, cells)
        except Exception as e:  # noqa: BLE001 - one failed case must not stop the others
            cells.append("OOM" if is_oom(e) else f"error: {type(e).__name__}: {e}"[:200])
            if not is_oom(e):
                traceback.print_exc(file=sys.stderr)
        row(cells + [""] * (10 - len(cells)))
        free(device)


def _attention_case(N, S, H, D, device, fwd_op, bwd_op, group_error, cells: list) -> None:
    """Fills `cells` as it goes, so a case that fails half-way still reports what it measured."""
    from train.cp import ContextParallelState
    from train.cp.a2a import Layout as _Layout
    from train.cp.a2a import heads_to_seq as _heads_to_seq
    from train.cp.a2a import seq_to_heads as _seq_to_heads
    from train.cp.layout import split_sizes
    from train.cp.ulysses import UlyssesAnythingAttention

    h, s_local = H // N, S // N
    assert H % N == 0 and S % N == 0, "even shapes only"
    gen = torch.Generator(device=device).manual_seed(0)

    def mk(*shape):
        return torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen)

    cells.append(f"(1, {S}, {h}, {D}) from (1, {s_local}, {H}, {D})")
    # Plain SDPA on (B, h, S, D).
    q, k, v = (mk(1, h, S, D).requires_grad_() for _ in range(3))
    do = mk(1, h, S, D)

    def sdpa():
        torch.autograd.grad(F.scaled_dot_product_attention(q, k, v), (q, k, v), do)

    t_sdpa = time_ms(sdpa, device)
    cells.append(f"{t_sdpa:.2f}")
    del q, k, v, do
    # diffusers' backend op on (B, S, h, D).
    q, k, v, do = (mk(1, S, h, D) for _ in range(4))

    def op():
        ctx = _Ctx()
        fwd_op(ctx, q, k, v, None, 0.0, False, None, False, False, _save_ctx=True)
        bwd_op(ctx, do)

    t_op = time_ms(op, device)
    cells.append(f"{t_op:.2f}")
    # Our layout copies at degree N, rank 0, loopback transport.
    lay = _Layout(0, N, (s_local,) * N, (s_local,) * N, tuple(split_sizes(H, N)))
    ql, kl, vl, dol = (mk(1, s_local, H, D) for _ in range(4))
    seq = [lay.q_sizes, lay.kv_sizes, lay.kv_sizes]

    lb = _Loopback()

    def layout():
        (qh, kh, vh), _ = _seq_to_heads([ql, kl, vl], seq, lay, None, lb, "qkv")  # (1, S, h, D) each
        _heads_to_seq([qh], [lay.q_sizes], lay, None, lb, "out")  # O back to (1, s_local, H, D)
        _seq_to_heads([dol], [lay.q_sizes], lay, None, lb, "d_out")
        _heads_to_seq([qh, kh, vh], seq, lay, None, lb, "d_qkv")

    t_layout = time_ms(layout, device)
    # Each of the 8 tensors is copied into the send buffer and again by the concatenation: read + write twice.
    moved = 8 * ql.numel() * ql.element_size() * 4
    cells += [f"{t_layout:.2f}", f"{moved / t_layout / 1e6:.0f}", f"{t_layout + t_op:.2f}",
              f"{(t_layout + t_op) / t_sdpa:.3f}"]  # fmt: skip
    # The whole function on a 1-rank group (local input = what a rank attends over at degree N).
    if group_error:
        cells += [f"no group: {group_error}"[:80], ""]
        return
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    state = ContextParallelState(context_parallel_config=_StubCP(), scope="bench")  # a 1-rank CP state

    def full():
        state.layout.reset(enabled=True)  # as under a plan: lengths from the split, no size exchange
        state.layout.record(S, 1)
        out = UlyssesAnythingAttention.apply(qf, kf, vf, None, 0.0, False, None, False, False, fwd_op, bwd_op,
                                             state)  # fmt: skip
        torch.autograd.grad(out, (qf, kf, vf), do)

    t_full = time_ms(full, device)
    cells += [f"{t_full:.2f}", f"{t_full / t_sdpa:.3f}"]


# Part 2: Wan-1.3B-size training step -------------------------------------------------------------------------------


def wan_forward_flops(cfg: dict, S: int, L: int) -> float:
    d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    f, t = cfg["ffn_dim"], cfg["text_dim"]
    cp = cfg["in_channels"] * cfg["patch_size"][0] * cfg["patch_size"][1] * cfg["patch_size"][2]
    per_layer = 2 * S * (4 * d * d + 2 * d * d + 2 * d * f) + 2 * L * (2 * d * d) + 4 * S * S * d + 4 * S * L * d
    return cfg["num_layers"] * per_layer + 2 * S * d * (2 * cp) + 2 * L * (t * d + d * d)


def training_part(device: torch.device, cfg: dict, cases: list, text_tokens: int, reps: int) -> None:
    from diffusers import WanTransformer3DModel

    log(f"\n## Part 3: Wan-1.3B-size training step, bf16 weights, fused AdamW, {text_tokens} text tokens\n")
    with torch.device(device):
        torch.manual_seed(0)
        model = WanTransformer3DModel(**cfg).train()
    to_bf16(model)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"{n_params / 1e9:.3f} B parameters; MFU vs {PEAK_TFLOPS} TFLOP/s; FLOPs = 3 x forward (see docstring)\n")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    header(["case", "latent (F, H, W)", "video tokens", "grad ckpt", "compile", "step ms", "tokens/s",
            "model TFLOP/step", "TFLOP/s", "MFU", "peak mem GiB"])  # fmt: skip
    for label, frames, height, width, ckpt, compile in cases:
        S = frames * (height // 2) * (width // 2)
        cells = [label, f"({frames}, {height}, {width})", S, "on" if ckpt else "off", "on" if compile else "off"]
        if out_of_time(PARTS_1_3_S):
            row(cells + ["skipped (time budget)"] + [""] * 5)
            continue
        try:
            _set_levers(model, ckpt, compile)
            _training_case(model, opt, cfg, device, frames, height, width, text_tokens, reps, cells)
        except Exception as e:  # noqa: BLE001
            cells.append("OOM" if is_oom(e) else f"error: {type(e).__name__}: {e}"[:200])
            if not is_oom(e):
                traceback.print_exc(file=sys.stderr)
            opt.zero_grad(set_to_none=True)
        row(cells + [""] * (11 - len(cells)))
        free(device)


def _set_levers(model, ckpt: bool, compile: bool) -> None:
    """The trainer's per-block levers (train.parallel), after removing the previous case's wrappers."""
    from train.parallel import apply_activation_levers, repeated_blocks

    blocks = repeated_blocks(model)
    for block in blocks:
        block.__dict__.pop("forward", None)  # back to the class's forward
    apply_activation_levers(blocks, 1 if ckpt else None, offload=False, compile=compile)


def _training_case(model, opt, cfg, device, frames, height, width, text_tokens, reps, cells: list) -> None:
    S = frames * (height // 2) * (width // 2)
    gen = torch.Generator(device=device).manual_seed(1)
    latents = torch.randn(1, 16, frames, height, width, device=device, dtype=torch.bfloat16, generator=gen)
    target = torch.randn(latents.shape, device=device, generator=gen)
    text = torch.randn(1, text_tokens, cfg["text_dim"], device=device, dtype=torch.bfloat16, generator=gen)
    timestep = torch.tensor([500.0], device=device)

    def step():
        opt.zero_grad(set_to_none=True)
        out = model(hidden_states=latents, encoder_hidden_states=text, timestep=timestep, return_dict=False)[0]
        F.mse_loss(out.float(), target).backward()
        opt.step()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t = time_ms(step, device, warmup=2, reps=reps) / 1e3
    flops = 3 * wan_forward_flops(cfg, S, text_tokens)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    cells += [f"{t * 1e3:.0f}", f"{S / t:.0f}", f"{flops / 1e12:.1f}", f"{flops / t / 1e12:.1f}",
              f"{flops / t / 1e12 / PEAK_TFLOPS:.1%}", f"{peak:.1f}"]  # fmt: skip


def backends_part(device: torch.device, cfg: dict, smoke: bool) -> None:
    """Each real-kernel attention backend against `native` on the same Wan model (bf16, 2 blocks, 4k tokens): the
    output and every gradient, max |difference| / max |native|. On CPU (smoke) only `native` exists: it is compared
    with itself and the other rows say they are unavailable."""
    from diffusers import WanTransformer3DModel

    log("\n## Part 2: attention backends vs native (Wan blocks, bf16, output and every gradient)\n")
    with torch.device(device):
        torch.manual_seed(0)
        model = WanTransformer3DModel(**cfg).to(torch.bfloat16).train()
    frames, hw = (2, 8) if smoke else (4, 64)
    gen = torch.Generator(device=device).manual_seed(2)
    latents = torch.randn(1, 16, frames, hw, hw, device=device, dtype=torch.bfloat16, generator=gen)
    text = torch.randn(1, 64, cfg["text_dim"], device=device, dtype=torch.bfloat16, generator=gen)
    timestep = torch.tensor([500.0], device=device)

    def run(backend: str) -> list[torch.Tensor]:
        model.set_attention_backend(backend)
        model.zero_grad(set_to_none=True)
        out = model(hidden_states=latents, encoder_hidden_states=text, timestep=timestep, return_dict=False)[0]
        out.float().square().mean().backward()
        return [out.detach().float()] + [p.grad.float() for p in model.parameters() if p.grad is not None]

    ref = run("native")
    header(["backend", "output rel err", "worst gradient rel err", "verdict (≤ 2e-2, bf16)"])
    for backend in (["native"] if smoke else []) + BACKENDS:
        if device.type != "cuda" and backend != "native":
            row([backend, "n/a on CPU", "", ""])
            continue
        try:
            got = run(backend)
            errs = [(g - r).abs().max().item() / max(r.abs().max().item(), 1e-12) for g, r in zip(got, ref)]
            row([backend, f"{errs[0]:.1e}", f"{max(errs[1:]):.1e}", "ok" if max(errs) <= 2e-2 else "MISMATCH"])
        except Exception as e:  # noqa: BLE001
            row([backend, f"unavailable: {type(e).__name__}: {e}"[:120], "", ""])
    model.set_attention_backend("native")


# Part 4: the real trainer's peak memory vs train.estimate --------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]
TRAINER_RECIPE = "recipes/wan/1.3b_lora.yaml"
TRAINER_STEPS = 3
CASE_TIMEOUT_S = 180  # one launch: imports, the sharded load, 3 steps (torchao's first step compiles for tens of s)
MIN_CASE_S = 60  # fewer seconds than this left before DEADLINE_S: the case is skipped rather than started and killed
_FULL = ("finetune.method=full",)
_BF16 = ("train.master_weights=bf16", "train.mixed_precision=bf16")
# (case, --set overrides on top of `_common_sets`): LoRA and full fine-tuning with each memory lever. torchao's cases
# last: their first step compiles (tens of seconds), so a short time budget drops them first.
MEMORY_CASES = [
    ("LoRA, adamw", ()),
    ("LoRA, fp8_base", ("finetune.fp8_base=true",)),
    ("LoRA, cpu_offload", ("parallel.cpu_offload=true",)),
    ("full, adamw (fp32 masters)", _FULL),
    ("full, bf16 masters", (*_FULL, *_BF16)),
    ("full, cpu_offload", (*_FULL, "parallel.cpu_offload=true")),
    ("full, adamw_8bit", (*_FULL, "train.optimizer=adamw_8bit")),
    ("full, bf16 masters + adamw_8bit", (*_FULL, *_BF16, "train.optimizer=adamw_8bit")),
]
# One launch (~15 s on 2 cores): the launch, memory.json and metrics.jsonl read back, the fp8 base's quantized start
# (full fine-tuning and every lever train on CPU in tests/test_optim.py, tests/test_fp8.py and tests/test_finetune.py).
SMOKE_MEMORY_CASES = [c for c in MEMORY_CASES if c[0] == "LoRA, fp8_base"]
# Per-sample synthetic shapes: latents (C, F, H, W) and prompt embeddings (L, text_dim). 480p, 81 frames: 32760 video
# tokens (what train.estimate reads too: the synthetic shapes' tokens).
MEMORY_SHAPES = dict(latents=[16, 21, 60, 104], prompt_embeds=[TEXT_TOKENS, WAN_1_3B["text_dim"]])
SMOKE_MEMORY_SHAPES = dict(latents=[16, 2, 8, 8], prompt_embeds=[SMOKE_TEXT_TOKENS, SMOKE_WAN["text_dim"]])
# What a launcher puts in its ranks' environment: dropped from the trainer launches' (the smoke test runs this script
# as a forked rank, and Part 1 sets MASTER_* for its own group), so each launch is a fresh job of its own.
LAUNCHER_KEYS = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                 "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "CTXTRAIN_LAUNCHER_PID")  # fmt: skip
LAUNCHER_PREFIXES = ("ACCELERATE_", "TORCHELASTIC_")
# One GPU process through torchrun, as configs/accelerate/cpu.yaml with --num_processes 1 (a MULTI_GPU config with
# a single gpu_id is refused by accelerate: `all`, and the process uses cuda:0 of what CUDA_VISIBLE_DEVICES shows).
GPU_ACCELERATE_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
num_machines: 1
num_processes: 1
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
rdzv_backend: static
same_network: true
gpu_ids: all
"""


def gib(n: float | None) -> str:
    return "—" if n is None else f"{n / 2**30:.2f}" if n >= 2**30 else f"{n / 2**30:.3g}"


def write_pipeline(folder: Path, cfg: dict, device: torch.device) -> int:
    """A local pipeline folder holding only `transformer/` (what the trainer reads with model.subfolder): a random-init
    WanTransformer3DModel of `cfg`, bf16 (fp32 where diffusers keeps it), built on `device` (quick on a GPU), then
    freed. Its parameter count."""
    from diffusers import WanTransformer3DModel

    with torch.device(device):
        torch.manual_seed(0)
        model = WanTransformer3DModel(**cfg)
    to_bf16(model)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder / "transformer")
    del model
    free(device)
    return n


def _common_sets(out: Path, pipeline: Path, shapes: dict) -> list[str]:
    synthetic = (f"{{num_samples: 4, shapes: {{latents: {shapes['latents']}, "
                 f"prompt_embeds: {shapes['prompt_embeds']}}}}}")  # fmt: skip
    return [f"output_dir={out}", f"model.pretrained_path={pipeline}", "model.init_config=null", "parallel.cp=1",
            "parallel.dp_shard=1", "parallel.memory_check=off", f"train.max_steps={TRAINER_STEPS}",
            "checkpoint.every_n_steps=0", "checkpoint.export=none", "logging.wandb_mode=disabled",
            "logging.progress_bar=false", "logging.every_n_steps=1", "train.gradient_checkpointing=true",
            "data.cache_dir=null", f"data.synthetic={synthetic}"]  # fmt: skip


def trainer_command(config: str, sets: list[str]) -> list[str]:
    """`python -m train.launch` with accelerate's arguments (one process, a free port of its own), as tests/harness.py
    `launch_command` builds it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "train.launch", "--config_file", config, "--num_processes", "1",
            "--main_process_port", str(port), "train/finetune.py", "--recipe", TRAINER_RECIPE,
            *[a for s in sets for a in ("--set", s)]]  # fmt: skip


def launch_env(device: torch.device) -> dict[str, str]:
    """This process's environment less a launcher's keys; no GPU visible when this script runs on CPU (the smoke)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_KEYS and not k.startswith(LAUNCHER_PREFIXES)}
    env |= {"WANDB_SILENT": "true", "TOKENIZERS_PARALLELISM": "false"}
    return env | ({} if device.type == "cuda" else {"CUDA_VISIBLE_DEVICES": ""})


def run_launch(cmd: list[str], env: dict[str, str], log_path: Path, timeout: float) -> int | None:
    """Run `cmd`, stdout and stderr into `log_path`; its exit code, None when it ran past `timeout`: then the launcher
    and every process under it (its ranks run in sessions of their own) are SIGKILLed and waited for, so that the
    device is free for the next case."""
    import psutil  # (accelerate's dependency)

    with log_path.open("w") as log_file:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log_file,
                                stderr=subprocess.STDOUT)  # fmt: skip
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                tree = []
            for p in tree:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(tree, timeout=30)
            proc.wait()
            return None


def last_error_line(text: str) -> str:
    """The line that names a failed launch's cause: the trainer's one-line error (`error: ...`), else the last
    exception line of a traceback, else the last line that is not the launcher's closing one."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for pick in (lambda ln: ln.startswith("error"), lambda ln: "Error" in ln.split(":")[0] or "Exception" in ln,
                 lambda ln: not ln.startswith("launch:")):  # fmt: skip
        found = [ln for ln in lines if pick(ln)]
        if found:
            return found[-1]
    return "(no output)"


def read_run(out: Path) -> tuple[dict, list[dict]]:
    """memory.json (train.estimate's prediction, written at startup) and metrics.jsonl's lines (a torn one dropped)."""
    memory = json.loads((out / "memory.json").read_text()) if (out / "memory.json").exists() else {}
    lines = []
    if (out / "metrics.jsonl").exists():
        for ln in (out / "metrics.jsonl").read_text().splitlines():
            try:
                lines.append(json.loads(ln))
            except ValueError:
                pass
    return memory, lines


def measured_peaks(lines: list[dict], others: int) -> tuple[int | None, int | None]:
    """(the true device peak, the allocated peak), max over steps: true = peak_reserved + device_used - reserved (the
    allocator's reserved peak + the CUDA context and NCCL buffers), less `others` (what other processes, this one
    included, held on the device when the launch started: device_used counts the whole device). (None, None) off
    CUDA: the trainer logs these fields on CUDA only."""
    gpu = [ln for ln in lines if "peak_reserved_bytes" in ln]
    if not gpu:
        return None, None
    true = max(ln["peak_reserved_bytes"] + ln["device_used_bytes"] - ln["reserved_bytes"] for ln in gpu) - others
    return true, max(ln["peak_mem_bytes"] for ln in gpu)


def device_used(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    free_b, total = torch.cuda.mem_get_info(device)
    return total - free_b


def trainer_memory_part(device: torch.device, cfg: dict, cases: list, shapes: dict) -> None:
    """Part 4: the real trainer (`python -m train.launch ... train/finetune.py`), one process, per case; its measured
    peak against the prediction it recorded (memory.json). Rows print as each launch ends."""
    log("\n## Part 4: the trainer's peak device memory vs train.estimate (1 process, Wan-1.3B size, "
        f"{TRAINER_RECIPE}, latents {tuple(shapes['latents'])}, {shapes['prompt_embeds'][0]} text tokens, "
        f"gradient checkpointing, {TRAINER_STEPS} steps)\n")  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="ctxtrain-bench-memory-"))
    try:
        t = time.perf_counter()
        n = write_pipeline(tmp / "pipeline", cfg, device)
        log(f"Random-init transformer, {n / 1e9:.3f} B parameters, bf16, written in {time.perf_counter() - t:.0f} s.")
        log(
            "predicted = memory.json's predicted_peak_bytes; measured true peak = max over steps of peak_reserved"
            " + device_used - reserved (metrics.jsonl), less what the device held before the launch (others).\n"
        )
        config = accelerate_config(device, tmp)
        header(["case", "predicted GiB", "measured true peak GiB", "max allocated GiB", "predicted / measured",
                "last step s", "others GiB", "run"])  # fmt: skip
        for i, (label, sets) in enumerate(cases):
            left = DEADLINE_S - elapsed()
            if left < MIN_CASE_S:
                row([label, "skipped (time budget)"] + [""] * 6)
                continue
            try:
                out = tmp / f"case{i}"
                cmd = trainer_command(str(config), _common_sets(out, tmp / "pipeline", shapes) + list(sets))
                row(_memory_case(device, label, cmd, out, min(CASE_TIMEOUT_S, left)))
            except Exception as e:  # noqa: BLE001 - one failed case must not stop the others
                row([label, f"error: {type(e).__name__}: {e}"[:200]] + [""] * 6)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _memory_case(device: torch.device, label: str, cmd: list[str], out: Path, timeout: float) -> list:
    free(device)
    others = device_used(device)
    t = time.perf_counter()
    log_path = out.with_suffix(".log")
    rc = run_launch(cmd, launch_env(device), log_path, timeout)
    wall = time.perf_counter() - t
    text = log_path.read_text(errors="replace")
    memory, lines = read_run(out)
    predicted = memory.get("predicted_peak_bytes")
    true, allocated = measured_peaks(lines, others)
    cuda = device.type == "cuda"
    na = "n/a (CPU)"
    if rc == 0:
        status = f"ok (exit 0, {len(lines)} steps, {wall:.0f} s)"
    else:  # the launch's whole log kept where the row says, the row itself one line
        kept = REPO / "outputs" / "bench_gpu_h200" / f"{re.sub(r'[^a-z0-9]+', '-', label.lower()).strip('-')}.log"
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(log_path, kept)
        where = f"(log: {kept.relative_to(REPO)})"
        if rc is None:
            status = f"timeout: killed after {timeout:.0f} s, {len(lines)} steps logged {where}"
        else:
            cause = "OOM: " if "out of memory" in text.lower() else ""
            status = f"exit {rc}: {cause}{last_error_line(text)[:200]} {where}"
    if predicted is None:
        why = memory.get("why_no_prediction", "no memory.json")
        pred_cell = f"none ({why})"[:120]
    else:
        pred_cell = gib(predicted)
    ratio = f"{predicted / true:.2f}" if predicted and true else ("" if cuda else na)
    return [label, pred_cell, gib(true) if cuda else na, gib(allocated) if cuda else na, ratio,
            f"{lines[-1]['step_time_s']:.2f}" if lines else "—", gib(others) if cuda else na,
            status.replace("|", "/")]  # fmt: skip


def start(doc: str, title: str, deadline: str) -> tuple[torch.device, bool]:
    """The device scripts' start (this one's and bench.gpu_trainer's): `--smoke` (tiny shapes on CPU) or the GPU,
    and the heading with what ran where; (device, smoke)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: checks the code paths only")
    smoke = parser.parse_args().smoke
    if smoke:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        log(f"No CUDA device: {title} is for one GPU. Use --smoke to check the code paths on CPU.")
        sys.exit(2)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke test, tiny shapes)"
    import diffusers

    log(f"# {title}\n\n{time.strftime('%Y-%m-%d %H:%M')}, {name}, torch {torch.__version__}, "
        f"diffusers {diffusers.__version__}, {deadline}")  # fmt: skip
    return device, smoke


def accelerate_config(device: torch.device, folder: Path) -> Path:
    """The accelerate config of a trainer launch: one GPU (written into `folder`), or the repository's CPU one."""
    if device.type != "cuda":
        return REPO / "configs/accelerate/cpu.yaml"
    config = folder / "accelerate_1gpu.yaml"
    config.write_text(GPU_ACCELERATE_CONFIG)
    return config


def main() -> None:
    device, smoke = start(__doc__, "H200 benchmark", f"deadline {DEADLINE_S:.0f} s (parts 1-3: {PARTS_1_3_S:.0f} s)")
    try:
        attention_part(device, SMOKE_ATTN if smoke else WAN_14B_ATTN)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    free(device)
    try:
        backends_part(device, SMOKE_WAN if smoke else dict(WAN_1_3B, num_layers=2), smoke=smoke)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    free(device)
    try:
        training_part(device, SMOKE_WAN if smoke else WAN_1_3B, SMOKE_STEP_CASES if smoke else STEP_CASES,
                      SMOKE_TEXT_TOKENS if smoke else TEXT_TOKENS, reps=2 if smoke else 5)  # fmt: skip
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    if dist.is_initialized():
        dist.destroy_process_group()  # (and its NCCL buffers, before the device's memory is measured)
    free(device)
    try:
        trainer_memory_part(device, SMOKE_WAN if smoke else WAN_1_3B,
                            SMOKE_MEMORY_CASES if smoke else MEMORY_CASES,
                            SMOKE_MEMORY_SHAPES if smoke else MEMORY_SHAPES)  # fmt: skip
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    log(f"\n(total {time.perf_counter() - T0:.0f} s)")


if __name__ == "__main__":
    main()
