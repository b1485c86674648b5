"""Prepared single-H200 benchmark (< 5 minutes): local Ulysses attention cost and a Wan-1.3B-size training step.

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

Every case is timed with CUDA events (median of a few repeats after warm-up), catches OOM and any other error (the
row says so and the next case runs), and nothing new starts after DEADLINE_S seconds. Rows print as they finish.
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

DEADLINE_S = float(os.environ.get("BENCH_DEADLINE_S", 240))
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


def out_of_time() -> bool:
    return time.perf_counter() - T0 > DEADLINE_S


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
        if out_of_time():
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
    # bf16, except what diffusers keeps in fp32 (norms, RoPE, time embedder), as from_pretrained(torch_dtype=bf16).
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    for pname, p in model.named_parameters():
        if not keep & set(pname.split(".")):
            p.data = p.data.to(torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"{n_params / 1e9:.3f} B parameters; MFU vs {PEAK_TFLOPS} TFLOP/s; FLOPs = 3 x forward (see docstring)\n")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    header(["case", "latent (F, H, W)", "video tokens", "grad ckpt", "compile", "step ms", "tokens/s",
            "model TFLOP/step", "TFLOP/s", "MFU", "peak mem GiB"])  # fmt: skip
    for label, frames, height, width, ckpt, compile in cases:
        S = frames * (height // 2) * (width // 2)
        cells = [label, f"({frames}, {height}, {width})", S, "on" if ckpt else "off", "on" if compile else "off"]
        if out_of_time():
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: checks the code paths only")
    args = parser.parse_args()
    if args.smoke:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        log("No CUDA device: this benchmark is for an H200. Use --smoke to check the code paths on CPU.")
        sys.exit(2)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke test, tiny shapes)"
    import diffusers

    log(f"# H200 benchmark\n\n{time.strftime('%Y-%m-%d %H:%M')}, {name}, torch {torch.__version__}, "
        f"diffusers {diffusers.__version__}, deadline {DEADLINE_S:.0f} s")  # fmt: skip
    try:
        attention_part(device, SMOKE_ATTN if args.smoke else WAN_14B_ATTN)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    free(device)
    try:
        backends_part(device, SMOKE_WAN if args.smoke else dict(WAN_1_3B, num_layers=2), smoke=args.smoke)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    free(device)
    try:
        training_part(device, SMOKE_WAN if args.smoke else WAN_1_3B, SMOKE_STEP_CASES if args.smoke else STEP_CASES,
                      SMOKE_TEXT_TOKENS if args.smoke else TEXT_TOKENS, reps=2 if args.smoke else 5)  # fmt: skip
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    if dist.is_initialized():
        dist.destroy_process_group()
    log(f"\n(total {time.perf_counter() - T0:.0f} s)")


if __name__ == "__main__":
    main()
