"""The pluggable CP transport: selection and fallback, set up on CP subgroups only, never a hang.

On CPU the symmetric-memory fast path is never available, so these tests prove the part that must hold everywhere:
a request for it falls back to torch with a reason, several CP groups run side by side, a rank outside every CP group
is never waited for, closing a transport issues no collective, and every selection is a transport of its own (a CP
state owns its transport; nothing is kept per group or per process).
"""

from __future__ import annotations

import contextlib
import gc
import io
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.harness import rank_job


def _attention(rank_in_group: int, world: int, group, seed: int, transport=None) -> float:
    """Ulysses attention on `group` (7 heads, 13 tokens) vs serial SDPA; returns the max abs error. With `transport`,
    through a CP state holding it (as a model's state does); without, through a plain config (diffusers' own API)."""
    from diffusers.models.attention_dispatch import _native_attention_backward_op, _native_attention_forward_op

    from train.cp import ContextParallelState
    from train.cp.ulysses import UlyssesAnythingAttention

    # What the Function reads from diffusers' ParallelConfig: the Ulysses group. A namespace stands in for diffusers'
    # context-parallel config only; every collective is real.
    cp_config = SimpleNamespace(_ulysses_mesh=SimpleNamespace(get_group=lambda: group))
    if transport is None:
        cfg = SimpleNamespace(context_parallel_config=cp_config)
    else:
        cfg = ContextParallelState(context_parallel_config=cp_config, transport=transport)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 13, 7, 8, generator=gen) for _ in range(3))
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    shard = lambda t: t.tensor_split(world, dim=1)[rank_in_group].clone().requires_grad_()  # noqa: E731
    ql, kl, vl = shard(q), shard(k), shard(v)
    out = UlyssesAnythingAttention.apply(ql, kl, vl, None, 0.0, False, None, False, False,
                                         _native_attention_forward_op, _native_attention_backward_op, cfg)  # fmt: skip
    out.sum().backward()
    return (out - ref.tensor_split(world, dim=1)[rank_in_group]).abs().max().item()


@rank_job(4)
def _two_groups(rank: int, world: int) -> dict:
    """4 ranks as 2 CP groups {0,1} and {2,3}: each selects its transport and attends over its own data at once."""
    from train.cp.comm import TorchTransport, select_transport
    from train.cp.ulysses import install_ulysses_anything_backward

    install_ulysses_anything_backward()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group (torch's rule)
    mine = groups[rank // 2]
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        chosen = select_transport("symm_mem", mine, torch.device("cpu"))
    err = _attention(dist.get_rank(mine), 2, mine, seed=rank // 2, transport=chosen)
    calls = {site: s.calls for site, s in chosen.stats.sites.items()}  # the attention went through the chosen one
    chosen.close()
    gc.collect()  # nothing may happen in a destructor
    dist.barrier()
    fallback = isinstance(chosen, TorchTransport) and chosen.name == "torch"
    return {"fallback": fallback, "err": err, "calls": calls, "said": said.getvalue()}


@rank_job(3)
def _rank_outside(rank: int, world: int) -> dict:
    """3 ranks, CP group {0, 1}; rank 2 joins no CP group. Ranks 0 and 1 select a transport and run attention; rank
    2 only creates the group (torch's rule) and goes on. A WORLD collective in setup would wait for rank 2 forever
    (until the group timeout): reaching the final barrier proves it did not happen."""
    from train.cp.comm import select_transport
    from train.cp.ulysses import install_ulysses_anything_backward

    install_ulysses_anything_backward()
    group = dist.new_group([0, 1])
    err = None
    if rank < 2:
        select_transport("symm_mem", group, torch.device("cpu"))
        err = _attention(rank, 2, group, seed=3)
        dist.barrier(group=group)
    dist.barrier()
    return {"err": err}


@rank_job(2)
def _selection(rank: int, world: int) -> dict:
    from train.cp.comm import select_transport

    group = dist.new_group([0, 1])
    first, second = (select_transport("torch", group, torch.device("cpu")) for _ in range(2))
    out = {"torch": first.name}
    try:
        select_transport("nccl_fast", group, torch.device("cpu"))
    except ValueError as e:
        out["bad"] = str(e)
    # Two selections for one group (two models): two transports, two sets of stats.
    out["separate"] = first is not second and first.stats is not second.stats
    return out


def test_symm_mem_request_falls_back_on_cpu_with_two_cp_groups(group) -> None:
    for res in group(_two_groups, 4):
        assert res["fallback"] and res["err"] <= 1e-6
        assert res["calls"] == {"qkv": 1, "out": 1, "d_out": 1, "d_qkv": 1, "sizes": 1}, res["calls"]
        # said once, on this rank, naming why
        assert res["said"].count("symm_mem requested, using torch all_to_all_single: device cpu") == 1, res["said"]


def test_rank_outside_every_cp_group_is_never_waited_for(group) -> None:
    res = group(_rank_outside, 3)
    assert res[0]["err"] <= 1e-6 and res[1]["err"] <= 1e-6 and res[2]["err"] is None


def test_transport_selection_and_unknown_kind(group) -> None:
    for res in group(_selection, 2):
        assert res["torch"] == "torch" and res["separate"]
        assert "unknown CP transport 'nccl_fast'" in res["bad"]
