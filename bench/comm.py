"""Collectives and bytes per attention layer (forward + backward) under Ulysses CP 2 and 4, and ring / hybrid ring ×
Ulysses next to Ulysses on the same tokens, CPU/gloo.

Compares our trainable Ulysses-Anything attention (`train.cp.ulysses`) with diffusers' own even Ulysses
(`TemplatedUlyssesAttention`, forward + backward, even shapes only) and diffusers' stock Ulysses-Anything (forward
only: its backward raises). Ours is counted by the `CommStats` of the CP state's transport; diffusers' by wrapping
`funcol.all_to_all_single` (reached directly or through `attention_dispatch._all_to_all_single`) and
`torch.distributed.all_gather` (its size exchange and mask gather) while it runs.

Bytes are bytes that leave a rank, summed over all ranks of the group. The Ulysses minimum is
(N-1)/N x (|Q|+|K|+|V|+|O|) local-shard bytes forward (dO, dQ, dK, dV backward), summed over ranks; "exact min" is
what the actual uneven split must move: every rank keeps the heads it owns, so it is slightly below (N-1)/N when
heads or tokens do not divide.

Run: python -m bench.comm
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from bench._common import fmt_bytes, header, parallel_config, table

WORLDS = (2, 4)
B, D = 1, 16
# (label, global sequence length, heads, mask kind)
CASES = [
    ("H8 S64 (even)", 64, 8, None),
    ("H8 S61 (uneven S)", 61, 8, None),
    ("H7 S64 (uneven H)", 64, 7, None),
    ("H7 S61 (uneven H, S)", 61, 7, None),
    ("H7 S61 + split key mask", 61, 7, "keypad"),
]
PAYLOAD_SITES = ("qkv", "out", "d_out", "d_qkv")


def _split(n: int, world: int) -> list[int]:
    return [n // world + (1 if i < n % world else 0) for i in range(world)]


def _minimum(S: int, H: int, world: int, rank: int, el: int) -> dict[str, float]:
    """This rank's share of the Ulysses minimum, per pass (forward = Q,K,V,O; backward = dO,dQ,dK,dV)."""
    s, h = _split(S, world), _split(H, world)
    local = B * s[rank] * H * D * el
    formula = 4 * local * (world - 1) / world
    # Exact for the split: Q/K/V (and dQ/dK/dV) send this rank's tokens of every other rank's heads; O (and dO) send
    # every other rank's tokens of this rank's heads.
    exact = (3 * B * s[rank] * (H - h[rank]) * D + B * (S - s[rank]) * h[rank] * D) * el
    return {"formula": formula, "exact": exact}


class _StockCounter:
    """Counts diffusers' own collectives while active: funcol all-to-all(-v) and dist.all_gather."""

    def __init__(self) -> None:
        self.sites: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        self._label = None

    def _record(self, site: str, nbytes: int) -> None:
        self.sites[site][0] += 1
        self.sites[site][1] += nbytes

    @contextlib.contextmanager
    def active(self):
        import torch.distributed._functional_collectives as funcol
        from diffusers.models import attention_dispatch as ad

        orig_a2a, orig_inner, orig_gather = funcol.all_to_all_single, ad._all_to_all_single, dist.all_gather

        def a2a(x, output_split_sizes, input_split_sizes, group, *args, **kwargs):
            rank, world = dist.get_rank(group), dist.get_world_size(group)
            if input_split_sizes is None:
                sent = x.numel() * (world - 1) // world
            else:
                row = x.numel() // max(x.shape[0], 1)
                sent = (sum(input_split_sizes) - input_split_sizes[rank]) * row
            self._record(self._label or "all_to_all_v (anything)", sent * x.element_size())
            return orig_a2a(x, output_split_sizes, input_split_sizes, group, *args, **kwargs)

        def inner(x, group):
            self._label = "all_to_all (_all_to_all_single)"
            try:
                return orig_inner(x, group)
            finally:
                self._label = None

        def gather(tensor_list, tensor, group=None, *args, **kwargs):
            world = dist.get_world_size(group)
            self._record("all_gather", tensor.numel() * tensor.element_size() * (world - 1))
            return orig_gather(tensor_list, tensor, group, *args, **kwargs)

        funcol.all_to_all_single, ad._all_to_all_single, dist.all_gather = a2a, inner, gather
        try:
            yield self
        finally:
            funcol.all_to_all_single, ad._all_to_all_single, dist.all_gather = orig_a2a, orig_inner, orig_gather


def _inputs(S: int, H: int, mask_kind, rank: int, world: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(B, S, H, D, generator=gen) for _ in range(4))
    mask = None
    if mask_kind == "keypad":
        keep = torch.rand(B, S, generator=gen) > 0.3
        keep[:, 0] = True
        mask = keep.tensor_split(world, dim=-1)[rank]
    shard = lambda t: t.tensor_split(world, dim=1)[rank].clone()  # noqa: E731
    return shard(q), shard(k), shard(v), shard(dout), mask


def _rank_fn(rank: int, world: int) -> list[dict]:
    from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn

    from train.cp import install_ulysses_anything_backward
    from train.cp.layout import LayoutRegistry
    from train.cp.patch import stock_diffusers

    install_ulysses_anything_backward()
    cfg_any, cfg_even = parallel_config(world, anything=True), parallel_config(world, anything=False)
    stats = cfg_any.stats
    attn = lambda q, k, v, m, cfg: dispatch_attention_fn(  # noqa: E731
        q, k, v, attn_mask=m, backend=AttentionBackendName.NATIVE, parallel_config=cfg
    )

    def snap() -> dict[str, list[int]]:
        return {name: [s.calls, s.bytes_sent] for name, s in stats.sites.items()}

    records = []
    for seed, (label, S, H, mask_kind) in enumerate(CASES):
        minimum = _minimum(S, H, world, rank, 4)
        even = S % world == 0 and H % world == 0
        # Ours: forward + backward. As under a plan with `layout_registry: true` (every shipped plan): the split
        # hook has recorded the sequence's partition, so the layer takes every rank's length from the registry.
        # Once without it (op-level use, or a plan without the registry): one size exchange per call.
        # Once more where the registry can only bound the lengths (a second split of S-1 tokens shares local lengths
        # on some rank): padded chunks plus 8 bytes per length in-band.
        variants = (("ours (trainable Ulysses-Anything)", True, (S,)), ("ours, no layout registry", False, (S,)),
                    ("ours, registry bounds only", True, (S, S - 1)))  # fmt: skip
        for impl, registry, recorded in variants:
            if impl != variants[0][0] and label != "H7 S61 (uneven H, S)":
                continue
            cfg_any.layout = LayoutRegistry(f"bench-{label}-{len(recorded)}")  # a fresh model, as far as it knows
            cfg_any.layout.reset(enabled=registry)  # a forward starts
            for length in recorded:  # what the plan's split hooks record
                cfg_any.layout.record(length, world)
            q, k, v, dout, mask = _inputs(S, H, mask_kind, rank, world, seed)
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            stats.reset()
            out = attn(q, k, v, mask, cfg_any)
            fwd = snap()
            stats.reset()
            out.backward(dout)
            bwd = snap()
            records.append(dict(impl=impl, case=label, fwd=fwd, bwd=bwd, min=minimum))

        if mask_kind is not None:
            continue  # stock paths are compared without masks (stock anything assembles uneven split masks wrongly)
        # diffusers' even Ulysses (TemplatedUlyssesAttention): forward + backward, divisible shapes only.
        if even:
            q, k, v, dout, _ = _inputs(S, H, None, rank, world, seed)
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            with _StockCounter().active() as c:
                out = attn(q, k, v, None, cfg_even)
                fwd = {s: list(v) for s, v in c.sites.items()}
                c.sites.clear()
                out.backward(dout)
                bwd = {s: list(v) for s, v in c.sites.items()}
            records.append(dict(impl="diffusers Ulysses (even)", case=label, fwd=fwd, bwd=bwd, min=minimum))
        # diffusers' stock Ulysses-Anything: forward only (head padding included in the bytes).
        with stock_diffusers():
            q, k, v, _, _ = _inputs(S, H, None, rank, world, seed)
            with torch.no_grad(), _StockCounter().active() as c:
                attn(q, k, v, None, cfg_any)
                fwd = {s: list(v) for s, v in c.sites.items()}
            records.append(dict(impl="diffusers Ulysses-Anything (fwd only)", case=label, fwd=fwd, bwd=None,
                                min=minimum))  # fmt: skip
    return records + _model_records(rank, world)


MODELS = ("wan", "flux")


def _model_records(rank: int, world: int) -> list[dict]:
    """One forward + backward of the tiny Wan / Flux (train/tools/tiny_models.py: 7 heads, odd tokens) under CP."""
    from torch.distributed.device_mesh import init_device_mesh

    from train.cp import enable_context_parallel
    from train.tools.tiny_models import build_inputs, build_model, make_loss, output_tensors

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("ring", "ulysses"))
    records = []
    for name in MODELS:
        model = build_model(name)
        stats = enable_context_parallel(model, mesh=mesh).stats  # this model's collectives only
        for step in (1, 2):  # the 1st step of a shape issues no more collectives than later ones
            stats.reset()
            out = output_tensors(name, model(**build_inputs(name, seed=1), return_dict=False))
            fwd = {s: [v.calls, v.bytes_sent] for s, v in stats.sites.items()}
            stats.reset()
            make_loss(name, out).backward()
            bwd = {s: [v.calls, v.bytes_sent] for s, v in stats.sites.items()}
            records.append(dict(impl="model", case=name, step=step, fwd=fwd, bwd=bwd, min=dict(formula=1, exact=1)))
    return records


def _model_rows(world: int, merged: list[dict]) -> list[list]:
    from train.tools.tiny_models import tiny_config, token_counts

    rows = []
    for m in merged:
        if m["impl"] != "model":
            continue
        cfg = tiny_config(m["case"])
        layers = cfg["num_layers"] + cfg.get("num_single_layers", 0)
        tokens = ", ".join(f"{k} {v}" for k, v in token_counts(m["case"]).items())
        row = [world, m["case"], f"{layers} blocks, {cfg['num_attention_heads']} heads; {tokens}", m["step"]]
        for phase in ("fwd", "bwd"):
            sites = m[phase]
            row.append(f"{sum(c for c, _ in sites.values())} (" + ", ".join(f"{s} {c}" for s, (c, _) in sites.items())
                       + ")")  # fmt: skip
            row.append(", ".join(f"{s} {fmt_bytes(b)}" for s, (_, b) in sites.items()))
        rows.append(row)
    return rows


def _merge(per_rank: list[list[dict]]) -> list[dict]:
    """Sum bytes over ranks; collective counts are per rank (every rank issues the same collectives)."""
    merged = []
    for recs in zip(*per_rank):
        r0 = recs[0]
        m = dict(impl=r0["impl"], case=r0["case"], step=r0.get("step"))
        for phase in ("fwd", "bwd"):
            if r0[phase] is None:
                m[phase] = None
                continue
            sites = {}
            for rec in recs:
                assert {s: c for s, (c, _) in rec[phase].items()} == {s: c for s, (c, _) in r0[phase].items()}
                for site, (calls, nbytes) in rec[phase].items():
                    sites.setdefault(site, [calls, 0])[1] += nbytes
            m[phase] = sites
        m["min"] = {k: sum(rec["min"][k] for rec in recs) for k in ("formula", "exact")}
        merged.append(m)
    return merged


def _rows(world: int, merged: list[dict]) -> list[list]:
    rows = []
    for m in merged:
        if m["impl"] == "model":
            continue
        mins = m["min"]
        row = [world, m["impl"], m["case"]]
        total_calls = 0
        for phase in ("fwd", "bwd"):
            sites = m[phase]
            if sites is None:
                row += ["n/a (raises)", "", ""]
                continue
            calls = sum(c for c, _ in sites.values())
            total_calls += calls
            if m["impl"].startswith("ours"):
                payload = sum(b for s, (_, b) in sites.items() if s in PAYLOAD_SITES)
                other = sum(b for s, (_, b) in sites.items() if s not in PAYLOAD_SITES)
            else:
                payload = sum(b for s, (_, b) in sites.items() if "all_to_all" in s)
                other = sum(b for s, (_, b) in sites.items() if "all_to_all" not in s)
            desc = ", ".join(f"{s} {c}" for s, (c, _) in sites.items())
            row += [f"{calls} ({desc})", f"{fmt_bytes(payload)} = {payload / mins['formula']:.3f}x "
                    f"({payload / mins['exact']:.3f}x exact)", fmt_bytes(other)]  # fmt: skip
        row += [total_calls, fmt_bytes(mins["formula"]), fmt_bytes(mins["exact"])]
        rows.append(row)
    return rows


# -- ring and hybrid ring × Ulysses next to Ulysses, on the same tokens ------------------------------------------------

# world → (ring, ulysses) layouts compared on the same tokens; (label, sequence length, heads)
LAYOUTS = {2: ((1, 2), (2, 1)), 4: ((1, 4), (2, 2), (4, 1))}
RING_CASES = [("H8 S64 (even)", 64, 8), ("H7 S61 (uneven H, S)", 61, 7), ("H2 S61 (heads < degree)", 61, 2)]
A2A_SITES = ("qkv", "out", "d_out", "d_qkv")  # Ulysses all-to-alls (inside a Ulysses group: one node)
RING_SITES = ("ring_kv", "ring_kv_bwd", "ring_kv_grad", "ring_grad")  # ring shifts (across the ring: across nodes)


def _layout_minimum(S: int, H: int, ring: int, uly: int, el: int) -> dict[str, float]:
    """Bytes a (ring, ulysses) layout must move per pass, summed over all ranks. Ulysses part, exact for the uneven
    split (each rank keeps its own heads of its own tokens): Q/K/V and O forward, dO and dQ/dK/dV backward, inside each
    Ulysses group. Ring part: every ring rank must see every other ring rank's K/V once ((R-1)·|K+V| forward, all
    heads together) and, backward, K/V again plus dK/dV home ((R-1)·(|K+V| + |dK+dV|))."""
    s, h = _split(S, ring * uly), _split(H, uly)
    a2a = 0
    for g in range(ring * uly):
        i, u = divmod(g, uly)
        group = sum(s[i * uly : (i + 1) * uly])
        a2a += (3 * B * s[g] * (H - h[u]) * D + B * (group - s[g]) * h[u] * D) * el if uly > 1 else 0
    kv = 2 * B * S * H * D * el
    return {"a2a": a2a, "ring_fwd": (ring - 1) * kv, "ring_bwd": 2 * (ring - 1) * kv}


def _attention_balance(S: int, H: int, ring: int, uly: int) -> float:
    """Max over ranks of the score entries (queries × keys × heads) a rank computes, over the ideal S·S·H / N: 1.0 is
    balanced; Ulysses with fewer heads than ranks leaves ranks idle and loads the others more."""
    n = ring * uly
    s, h = _split(S, n), _split(H, uly)
    work = [sum(s[i * uly : (i + 1) * uly]) * S * h[u] for i in range(ring) for u in range(uly)]
    return max(work) / (S * S * H / n)


def _ring_rank_fn(rank: int, world: int) -> list[dict]:
    """One attention layer, forward + backward, per (ring, ulysses) layout of `world` ranks and per case, through
    diffusers' dispatch (native backend; our Ulysses / ring / hybrid attention installed)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn
    from torch.distributed.device_mesh import init_device_mesh

    from train.cp import ContextParallelState, install_ulysses_anything_backward

    install_ulysses_anything_backward()  # Ulysses, ring and ring x Ulysses
    records = []
    for ring, uly in LAYOUTS[world]:
        mesh = init_device_mesh("cpu", (ring, uly), mesh_dim_names=("ring", "ulysses"))
        state = ContextParallelState.on_mesh(mesh, scope=f"bench-{ring}x{uly}")
        for seed, (label, S, H) in enumerate(RING_CASES):
            q, k, v, dout, _ = _inputs(S, H, None, rank, world, seed)
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            state.stats.reset()
            out = dispatch_attention_fn(q, k, v, backend=AttentionBackendName.NATIVE, parallel_config=state)
            fwd = {name: [st.calls, st.bytes_sent] for name, st in state.stats.sites.items()}
            state.stats.reset()
            out.backward(dout)
            bwd = {name: [st.calls, st.bytes_sent] for name, st in state.stats.sites.items()}
            records.append(dict(layout=(ring, uly), case=label, S=S, H=H, fwd=fwd, bwd=bwd))
    return records


def _ring_merge(per_rank: list[list[dict]]) -> list[dict]:
    """Bytes summed over ranks (and the largest single rank's); collective counts per rank (the same on every rank)."""
    merged = []
    for recs in zip(*per_rank):
        m = {k: recs[0][k] for k in ("layout", "case", "S", "H")}
        for phase in ("fwd", "bwd"):
            calls = {site: c for site, (c, _) in recs[0][phase].items()}
            assert all({site: c for site, (c, _) in r[phase].items()} == calls for r in recs), (m, phase)
            m[phase] = {site: [c, sum(r[phase][site][1] for r in recs)] for site, c in calls.items()}
            m[phase + "_max_rank"] = max(sum(b for _, b in r[phase].values()) for r in recs)
        merged.append(m)
    return merged


def _ring_rows(world: int, merged: list[dict]) -> list[list]:
    rows = []
    for m in merged:
        ring, uly = m["layout"]
        mins = _layout_minimum(m["S"], m["H"], ring, uly, 4)
        row = [world, f"ring {ring} × Ulysses {uly}", m["case"]]
        total = 0
        for phase in ("fwd", "bwd"):
            sites = m[phase]
            calls = sum(c for c, _ in sites.values())
            total += calls
            a2a = sum(b for st, (_, b) in sites.items() if st in A2A_SITES)
            p2p = sum(b for st, (_, b) in sites.items() if st in RING_SITES)
            other = sum(b for st, (_, b) in sites.items() if st not in A2A_SITES + RING_SITES)
            minimum = mins["a2a"] + mins["ring_" + phase]
            desc = ", ".join(f"{st} {c}" for st, (c, _) in sites.items())
            row += [f"{calls} ({desc})", fmt_bytes(a2a), fmt_bytes(p2p), fmt_bytes(other),
                    f"{(a2a + p2p) / minimum:.3f}x"]  # fmt: skip
        row += [total, f"{_attention_balance(m['S'], m['H'], ring, uly):.2f}"]
        rows.append(row)
    return rows


def ring_table() -> str:
    """The ring / hybrid / Ulysses comparison, as printed by `python -m bench.comm` (its second section)."""
    from train.tools.spawn import run_distributed

    headers = ["N", "layout", "case", "fwd collectives", "fwd all-to-all", "fwd ring P2P", "fwd other",
               "fwd payload vs min", "bwd collectives", "bwd all-to-all", "bwd ring P2P", "bwd other",
               "bwd payload vs min", "collectives per layer", "attention load max/ideal"]  # fmt: skip
    rows = []
    for world in sorted(LAYOUTS):
        rows += _ring_rows(world, _ring_merge(run_distributed(_ring_rank_fn, world)))
    return table(headers, rows)


def main() -> None:
    from train.tools.spawn import run_distributed

    t0 = time.perf_counter()
    print(header("Collectives and bytes per attention layer (forward + backward)"))
    print(f"B={B}, head dim {D}, fp32; tokens split with tensor_split; bytes summed over the N ranks; collective "
          "counts per rank. 'payload' = the Q/K/V/O (dO/dQ/dK/dV) all-to-alls; 'other' = size exchanges and mask "
          "gathers. Ratio = payload / Ulysses minimum (N-1)/N x (|Q|+|K|+|V|+|O|) local-shard bytes.\n")  # fmt: skip
    headers = ["N", "implementation", "case", "fwd collectives", "fwd payload vs min", "fwd other",
               "bwd collectives", "bwd payload vs min", "bwd other", "total collectives",
               "min per pass (N-1)/N", "exact min per pass"]  # fmt: skip
    rows, model_rows = [], []
    for world in WORLDS:
        merged = _merge(run_distributed(_rank_fn, world))
        rows += _rows(world, merged)
        model_rows += _model_rows(world, merged)
    print(table(headers, rows))
    print("\n### Whole tiny model, two training steps (forward + backward) with the same shapes (ours)\n")
    print("Per-site collectives per rank and bytes summed over ranks. 'gather' = the output gather at proj_out (once "
          "per forward; its backward is a local slice).\n")  # fmt: skip
    print(
        table(
            ["N", "model", "shape", "step", "fwd collectives", "fwd bytes", "bwd collectives", "bwd bytes"], model_rows
        )
    )
    print("\n### Ring and hybrid ring × Ulysses next to Ulysses, same tokens (one attention layer, fwd + bwd)\n")
    print("Per-rank collective counts; bytes summed over the N ranks (fp32, B=1, head dim 16, no mask). 'all-to-all' "
          "= Ulysses Q/K/V/O (dO/dQ/dK/dV), inside each Ulysses group (consecutive ranks: one node); 'ring P2P' = K/V "
          "(and dK/dV) shifts between ring ranks (strided: across nodes); 'other' = size exchanges (ints). 'vs min' = "
          "(all-to-all + ring) / the layout's minimum: Ulysses exact for its uneven split plus (R-1)|K+V| forward and "
          "(R-1)(|K+V|+|dK+dV|) backward for the ring. 'attention load' = the busiest rank's score entries (queries x "
          "keys x heads) over the ideal S*S*H/N.\n")  # fmt: skip
    print(ring_table())
    print(f"\n(run time {time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    import bench.comm as _self  # so spawned ranks unpickle `bench.comm._rank_fn`, not `__main__._rank_fn`

    _self.main()
