"""CPU step time: our trainable Ulysses-Anything vs diffusers' own even Ulysses (`TemplatedUlyssesAttention`).

Even shapes only (diffusers' even Ulysses needs heads and tokens divisible by the degree). Two levels:
- op: one attention layer forward + backward through `dispatch_attention_fn` (native backend) with a ParallelConfig
  that has `ulysses_anything=True` (ours, installed by `install_ulysses_anything_backward`) or False (diffusers);
- model: a small Wan (2 blocks, 8 heads x 32, 3072 video tokens) forward + loss + backward, ours via
  `enable_context_parallel`, diffusers' set up the same way with `ulysses_anything=False` (same plan, same weights).
Both use the same native backward op (SDPA recompute), so the difference is layout copies + collectives.

Each step is bracketed by barriers and timed as the max over ranks. After warm-up, ours and diffusers' alternate
(order flipped every pair); the reported number is the median over pairs of ours / diffusers (goal <= 1.0). The
ratio of the fastest steps is printed too: on a shared CPU it is the less load-sensitive of the two.

Run: python -m bench.step_time
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from bench._common import header, parallel_config, table

WORLDS = (2, 4)
WARMUP, OP_PAIRS, MODEL_PAIRS = 2, 9, 7
# (label, B, S, H, D)
OP_CASES = [
    ("attention-bound: S=1024 H=8 D=64", 1, 1024, 8, 64),
    ("layout-bound: S=256 H=32 D=128", 1, 256, 32, 128),
]
WAN = dict(patch_size=(1, 2, 2), num_attention_heads=8, attention_head_dim=32, in_channels=16, out_channels=16,
           text_dim=64, freq_dim=64, ffn_dim=1024, num_layers=2, cross_attn_norm=True,
           qk_norm="rms_norm_across_heads")  # fmt: skip
WAN_LATENT = (1, 16, 4, 64, 48)  # 4 x 32 x 24 = 3072 tokens
WAN_TEXT = 64


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _paired(ours, theirs, pairs: int) -> dict:
    for _ in range(WARMUP):
        ours()
        theirs()
    t_ours, t_theirs = [], []
    for i in range(pairs):
        if i % 2 == 0:
            t_ours.append(_timed(ours))
            t_theirs.append(_timed(theirs))
        else:
            t_theirs.append(_timed(theirs))
            t_ours.append(_timed(ours))
    ratios = [a / b for a, b in zip(t_ours, t_theirs)]
    return dict(ours=statistics.median(t_ours), theirs=statistics.median(t_theirs),
                ratio=statistics.median(ratios), lo=min(ratios), hi=max(ratios),
                best=min(t_ours) / min(t_theirs))  # fmt: skip


def _op_cases(rank: int, world: int) -> dict:
    from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn

    from train.cp import install_ulysses_anything_backward

    install_ulysses_anything_backward()
    cfg_any, cfg_even = parallel_config(world, anything=True), parallel_config(world, anything=False)
    results = {}
    for label, B, S, H, D in OP_CASES:
        gen = torch.Generator().manual_seed(0)
        q, k, v, dout = (torch.randn(B, S, H, D, generator=gen).tensor_split(world, dim=1)[rank] for _ in range(4))

        def step(cfg, q=q, k=k, v=v, dout=dout, S=S):
            # Ours as under a plan (layout registry: the split hook's partition is recorded, no size exchange).
            if cfg is cfg_any:
                cfg.layout.reset(enabled=True)
                cfg.layout.record(S, world)
            ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
            out = dispatch_attention_fn(ql, kl, vl, backend=AttentionBackendName.NATIVE, parallel_config=cfg)
            out.backward(dout)

        results[label] = _paired(lambda step=step: step(cfg_any), lambda step=step: step(cfg_even), OP_PAIRS)
    return results


def _stock_even_cp(model, mesh) -> None:
    """diffusers' own even Ulysses on a model, set up as `train/cp/enable.py` does but with ulysses_anything=False."""
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    from train.cp.plans import plan_for

    cp = ContextParallelConfig(ring_degree=1, ulysses_degree=mesh["ulysses"].size(), ulysses_anything=False,
                               mesh=mesh)  # fmt: skip
    config = ParallelConfig(context_parallel_config=cp)
    config.setup(dist.get_rank(), dist.get_world_size(), torch.device("cpu"), mesh=mesh)
    model._parallel_config = config
    for m in model.modules():
        if isinstance(m, (Attention, AttentionModuleMixin)) and hasattr(m.processor, "_parallel_config"):
            m.processor._parallel_config = config
    apply_context_parallel(model, cp, plan_for(model).diffusers_plan(model))


def _model_case(rank: int, world: int) -> dict:
    from diffusers import WanTransformer3DModel
    from torch.distributed.device_mesh import init_device_mesh

    from train.cp import enable_context_parallel

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("ring", "ulysses"))
    models = []
    for _ in range(2):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            models.append(WanTransformer3DModel(**WAN).train())
    ours, theirs = models
    enable_context_parallel(ours, mesh=mesh)
    _stock_even_cp(theirs, mesh)
    gen = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(WAN_LATENT, generator=gen),
                  encoder_hidden_states=torch.randn(1, WAN_TEXT, WAN["text_dim"], generator=gen),
                  timestep=torch.tensor([500.0]))  # fmt: skip
    target = torch.randn(WAN_LATENT, generator=gen)
    losses = {}

    def step(model):
        model.zero_grad(set_to_none=True)
        out = model(**inputs, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(out, target)
        loss.backward()
        losses[id(model)] = loss.item()

    res = _paired(lambda: step(ours), lambda: step(theirs), MODEL_PAIRS)
    res["loss_diff"] = abs(losses[id(ours)] - losses[id(theirs)])
    return {"Wan 2 blocks, 8x32 heads, 3072+64 tokens: fwd+loss+bwd": res}


def _rank_fn(rank: int, world: int) -> dict:
    import warnings

    from diffusers.utils import logging

    logging.set_verbosity_error()  # the (B,) timestep "split will not be applied" notice
    warnings.filterwarnings("ignore", category=FutureWarning)  # diffusers' funcol.all_gather_tensor deprecation
    return {**_op_cases(rank, world), **_model_case(rank, world)}


def main() -> None:
    from train.tools.spawn import run_distributed

    t0 = time.perf_counter()
    print(header("Step time: ours (Ulysses-Anything, trainable) vs diffusers' even Ulysses"))
    print(f"fp32, 1 thread per rank, N ranks sharing 2 cores (plus whatever else runs on the machine). Median of "
          f"{OP_PAIRS} (op) / {MODEL_PAIRS} (model) interleaved pairs after {WARMUP} warm-up pairs; a step = "
          "barrier, forward + backward, max over ranks.\n")  # fmt: skip
    rows = []
    for world in WORLDS:
        res = run_distributed(_rank_fn, world)[0]
        for label, r in res.items():
            extra = f" (loss diff {r['loss_diff']:.1e})" if "loss_diff" in r else ""
            rows.append([world, label + extra, f"{r['ours'] * 1e3:.1f}", f"{r['theirs'] * 1e3:.1f}",
                         f"**{r['ratio']:.3f}**", f"{r['lo']:.3f} - {r['hi']:.3f}", f"{r['best']:.3f}"])  # fmt: skip
    print(table(["N", "case", "ours ms (median)", "diffusers ms (median)", "ours / diffusers (median of pairs)",
                 "pair ratio range", "min ours / min diffusers"], rows))  # fmt: skip
    print(f"\n(run time {time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    import bench.step_time as _self  # so spawned ranks unpickle `bench.step_time._rank_fn`

    _self.main()
