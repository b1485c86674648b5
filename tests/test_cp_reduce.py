"""Gradient reduction with data parallelism: SUM over CP, MEAN over DP — plain all-reduce, DDP and FSDP2.

4 gloo ranks as dp 2 × cp 2 (CP groups {0,1} and {2,3}); each DP replica trains on its own sample. The serial
reference is one process computing the mean of the two samples' losses.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.harness import rank_job
from train.tools.tiny_models import build_inputs, build_model, make_loss, output_tensors

MODEL = "wan"
GRAD_TOL = 2e-5  # relative, fp32
PARAM_TOL = 2e-6  # absolute after one AdamW step (lr 1e-3)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp_shard", "ring", "ulysses"))


def _serial_step(dp: int) -> tuple[dict, dict]:
    model = build_model(MODEL, seed=0)
    loss = sum(make_loss(MODEL, output_tensors(MODEL, model(**build_inputs(MODEL, seed=10 + d), return_dict=False)),
                         seed=20 + d) for d in range(dp)) / dp  # fmt: skip
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}


@rank_job(4)
def _fsdp2_case(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    from train.cp import enable_context_parallel
    from train.cp.reduce import GradReduction

    mesh = _mesh()
    dp_rank = mesh["dp_shard"].get_local_rank()
    ref_grads, ref_params = _serial_step(dp=2)

    model = build_model(MODEL, seed=0)
    enable_context_parallel(model, mesh=mesh["ring", "ulysses"])  # 1. CP hooks first
    flat = mesh["dp_shard", "ring", "ulysses"]._flatten("dp_cp")  # 2. FSDP2 shards over dp×cp ...
    for block in model.blocks:
        fully_shard(block, mesh=flat)
    fully_shard(model, mesh=flat)
    reduction = GradReduction("fsdp2", mesh["ulysses"].get_group(), mesh["dp_shard"].get_group(), reduce_mesh=flat)
    reduction.configure_fsdp(model)  # 3. ... dividing by dp only
    probe = reduction.self_check()

    out = output_tensors(MODEL, model(**build_inputs(MODEL, seed=10 + dp_rank), return_dict=False))
    make_loss(MODEL, out, seed=20 + dp_rank).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    params = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    return {
        "probe": probe,
        "grad": {n: _rel(grads[n], ref_grads[n]) for n in ref_grads},
        "param": {n: (params[n] - ref_params[n]).abs().max().item() for n in ref_params},
    }


def test_fsdp2_dp2_cp2_matches_serial(group) -> None:
    for rank, res in enumerate(group(_fsdp2_case, 4)):
        assert res["probe"] == pytest.approx(3 * 1.5)  # cp(cp+1)/2 · (dp+1)/2
        worst = max(res["grad"], key=res["grad"].get)
        assert res["grad"][worst] <= GRAD_TOL, f"rank {rank}: grad {worst} off by {res['grad'][worst]:.3g}"
        worst = max(res["param"], key=res["param"].get)
        assert res["param"][worst] <= PARAM_TOL, f"rank {rank}: param {worst} off by {res['param'][worst]:.3g}"


@rank_job(4)
def _modes_case(rank: int, world: int) -> dict:
    """allreduce and DDP give the serial gradients; the self-check passes for all modes and catches a wrong one."""
    from train.cp import enable_context_parallel
    from train.cp.reduce import GradReduction

    mesh = _mesh()
    cp_group, dp_group = mesh["ulysses"].get_group(), mesh["dp_shard"].get_group()
    flat = mesh["dp_shard", "ring", "ulysses"]._flatten("dp_cp")
    dp_rank = mesh["dp_shard"].get_local_rank()
    ref_grads, _ = _serial_step(dp=2)
    out: dict = {"grad": {}, "probe": {}}
    for mode in ("allreduce", "ddp"):
        reduction = GradReduction(mode, cp_group, dp_group, reduce_mesh=flat if mode == "ddp" else None)
        out["probe"][mode] = reduction.self_check()
        model = build_model(MODEL, seed=0)
        enable_context_parallel(model, mesh=mesh["ring", "ulysses"])
        wrapped = reduction.wrap_ddp(model) if mode == "ddp" else model
        y = output_tensors(MODEL, wrapped(**build_inputs(MODEL, seed=10 + dp_rank), return_dict=False))
        make_loss(MODEL, y, seed=20 + dp_rank).backward()
        if mode == "allreduce":
            reduction.reduce_gradients(model.parameters())
        out["grad"][mode] = max(_rel(p.grad, ref_grads[n]) for n, p in model.named_parameters())

    # A FSDP2 layout left at its default divide factor (dp×cp) averages over CP: the self-check must refuse it.
    reduction = GradReduction("fsdp2", cp_group, dp_group, reduce_mesh=flat)
    reduction.configure_fsdp = lambda m: [x.set_force_sum_reduction_for_comms(True) for x in [m]]
    try:
        reduction.self_check()
        out["wrong_caught"] = None
    except RuntimeError as e:
        out["wrong_caught"] = str(e)
    # A reduction mesh that leaves out the CP ranks is refused up front.
    try:
        GradReduction("fsdp2", cp_group, dp_group, reduce_mesh=mesh["dp_shard"])
        out["bad_mesh"] = None
    except ValueError as e:
        out["bad_mesh"] = str(e)
    dist.barrier()  # everyone is still in step after the refused cases
    return out


def test_reduction_modes_and_self_check(group) -> None:
    for res in group(_modes_case, 4):
        assert res["probe"] == {"allreduce": pytest.approx(4.5), "ddp": pytest.approx(4.5)}
        for mode, err in res["grad"].items():
            assert err <= GRAD_TOL, f"{mode}: gradient off by {err:.3g}"
        assert res["wrong_caught"] and "MEAN over CP" in res["wrong_caught"]
        assert res["bad_mesh"] and "leaves partial gradients unsummed" in res["bad_mesh"]
