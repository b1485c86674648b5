"""Check a CP plan on a tiny instance of its model: CP 2 and 3 (default) vs a serial run, on gloo in spawned processes.

Usage::

    python -m train.tools.check_plan cp_plans/wan.yaml --model WanTransformer3DModel
    python -m train.tools.check_plan draft.yaml --model path/to/model_folder --degrees 2 3 4
    python -m train.tools.check_plan draft.yaml --model MyTransformer3DModel --inputs my_inputs:make_kwargs

Every rank builds the same tiny model (train/tools/probe.py), runs it serially on one training step's inputs as the
family's pipeline builds them (train/step.py: two samples whose prompts pad to different lengths, the real text masks;
`--inputs` for a class without a family), then enables CP with the plan (`enable_context_parallel`, layout registry
in verify mode) and runs the same forward, the same loss (the family's training loss; MSE against seeded targets
with `--inputs`) and backward; gradients are SUM-reduced over the CP group. Printed per degree:

* one verdict per plan entry, at every concrete module path it resolves to: the tensors CP hands the module
  (split inputs), what it returns (split outputs) and the gathered output must equal the serial tensors' slices
  (``torch.tensor_split`` of the serial tensor, this rank's part) or the serial tensor itself (gathers);
* output and loss errors, and the gradient error per parameter group (``blocks.*.attn1``, ...): its largest
  difference over its largest serial gradient;
* where a CP forward failed: the module path it failed in, and which tensor reached it whole (not split) or left
  split (not gathered), with the module that made it.

Ends with PASS (exit 0) or FAIL (exit 1); a user mistake (unknown class, a plan for another class, a folder without a
config) is one line, exit 2. Relative errors: max|cp - serial| / max|serial|, tolerance ``--tol`` (default 1e-4, fp32).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from train.errors import UserError

__all__ = ["Case", "check", "format_report", "main"]

TOL = 1e-4
# Seconds a CP collective of one case may wait for a peer. Each case attends over its own process group with this
# timeout: a plan that makes one rank fail before a collective its peers already entered (ranks out of step: they
# disagree on shapes, so one raises and the others wait) fails the case in this time instead of hanging the check.
CASE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Case:
    """One plan on one model (picklable: each rank resolves it again)."""

    plan: str
    model: str
    inputs: str | None = None
    family: str | None = None
    # A tiny instance made elsewhere (train/tools/sweep.py: a derived config and synthesized inputs); it replaces
    # model/inputs/family. Picklable: its inputs function is a module-level function or a partial of one.
    source: Any = None


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    if a.is_complex() or b.is_complex():  # a complex RoPE table (Z-Image): compare both parts
        a, b = torch.view_as_real(a.to(torch.complex128)), torch.view_as_real(b.to(torch.complex128))
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _shape(t: Any) -> str:
    return "(" + ", ".join(str(n) for n in t.shape) + ")" if torch.is_tensor(t) else type(t).__name__


def param_group(name: str) -> str:
    """``blocks.0.attn1.to_q.weight`` -> ``blocks.*.attn1``; ``proj_out.weight`` -> ``proj_out``."""
    atoms = re.sub(r"\.\d+(?=\.|$)", ".*", name).split(".")[:-1] or [name]
    keep = 3 if len(atoms) > 1 and atoms[1] == "*" else 1
    return ".".join(atoms[:keep])


def _output_tensors(outputs: Sequence[Any]) -> list[torch.Tensor]:
    """The tensors of a forward's outputs, a list output's elements included (Z-Image returns one tensor per
    sample)."""
    flat = [t for o in outputs for t in (o if isinstance(o, (list, tuple)) else [o])]
    return [t for t in flat if torch.is_tensor(t)]


def _step_loss(step, raw: Any, outputs: list[torch.Tensor], model: torch.nn.Module) -> torch.Tensor:
    """The family's training loss of the output (train/step.py `loss_of`), or without a family (--inputs) the MSE of
    every output against a seeded target."""
    if step is None:
        return _loss(outputs)
    from train.step import Objective, loss_of

    return loss_of(step.spec, step, raw, Objective(), model_config=model.config)


def _loss(outputs: list[torch.Tensor]) -> torch.Tensor:
    loss = outputs[0].new_zeros((), dtype=torch.float32)
    for i, out in enumerate(outputs):
        target = torch.randn(tuple(out.shape), generator=torch.Generator().manual_seed(10_000 + i))
        loss = loss + torch.nn.functional.mse_loss(out.float(), target)
    return loss


class _Recorder:
    """What a run hands the plan's modules and gets back; plus a module stack and every module's input shapes, so a
    failed forward can be located. ``inner`` hooks sit inside CP's split/gather hooks (registered before them)."""

    def __init__(self, model: torch.nn.Module, paths: list[str]) -> None:
        from diffusers.hooks.hooks import HookRegistry, ModelHook

        from train.tools.probe import as_outputs, bind_inputs

        self.inner_in: dict[str, dict[str, Any]] = {}
        self.inner_out: dict[str, list[Any]] = {}
        self.outer_out: dict[str, list[Any]] = {}
        self.in_shapes: dict[str, dict[str, Any]] = {}
        self.out_shapes: dict[str, list[Any]] = {}
        self.made_by: dict[int, tuple[str, int]] = {}
        self.stack: list[str] = []
        self.finished: list[str] = []
        recorder = self

        class Inner(ModelHook):
            def __init__(self, path: str) -> None:
                super().__init__()
                self.path = path

            def pre_forward(self, module, *args, **kwargs):
                if self.path not in recorder.inner_in:
                    bound = bind_inputs(module, args, kwargs)
                    recorder.inner_in[self.path] = {k: _detach(v) for k, v in bound.items()}
                return args, kwargs

            def post_forward(self, module, output):
                recorder.inner_out.setdefault(self.path, [_detach(o) for o in as_outputs(output)])
                return output

        modules = dict(model.named_modules())
        for path in paths:
            HookRegistry.check_if_exists_or_initialize(modules[path]).register_hook(Inner(path), "plan_check_probe")
        for path, module in modules.items():

            def pre(mod, args, kw, path=path):
                self.stack.append(path)
                if path not in self.in_shapes:
                    bound = bind_inputs(mod, args, kw)
                    self.in_shapes[path] = {k: _shapes(v) for k, v in bound.items()}

            def post(mod, args, kw, out, path=path):
                self.stack.pop()
                self.finished.append(path)
                outs = as_outputs(out)
                if path not in self.out_shapes:
                    self.out_shapes[path] = [_shapes(o) for o in outs]
                    for i, o in enumerate(outs):
                        if torch.is_tensor(o):
                            self.made_by.setdefault(id(o), (path, i))
                if path in paths:
                    self.outer_out.setdefault(path, [_detach(o) for o in outs])

            module.register_forward_pre_hook(pre, with_kwargs=True)
            module.register_forward_hook(post, with_kwargs=True)


def _detach(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return [_detach(v) for v in value]
    return None


def _shapes(value: Any) -> Any:
    if torch.is_tensor(value):
        return tuple(value.shape)
    if isinstance(value, (list, tuple)):
        return [tuple(v.shape) if torch.is_tensor(v) else None for v in value]
    return None


def _flat_shapes(shapes: dict[str, Any]) -> dict[str, tuple]:
    out = {}
    for k, v in shapes.items():
        if isinstance(v, tuple):
            out[k] = v
        elif isinstance(v, list):
            out.update({f"{k}[{i}]": s for i, s in enumerate(v) if s is not None})
    return out


def _diagnose(cp: _Recorder, serial: _Recorder, where: str) -> str:
    """Why a CP forward failed in ``where``: tensors that reached it whole next to split ones, or a split output that
    forward() used as if whole (a missing gather)."""
    mine, theirs = _flat_shapes(cp.in_shapes.get(where, {})), _flat_shapes(serial.in_shapes.get(where, {}))
    split = {k: s for k, s in mine.items() if k in theirs and s != theirs[k] and len(s) == len(theirs[k])}
    full_sizes = {theirs[k][d] for k, s in split.items() for d in range(len(s)) if s[d] != theirs[k][d]}
    whole = [k for k, s in mine.items() if k in theirs and s == theirs[k] and full_sizes & set(s[1:] or s)]
    if split and whole:
        parts = [f"{k} {theirs[k]} arrived whole" for k in whole]
        producers = _producers(cp, serial, [theirs[k] for k in whole], where)
        hint = f"; made by {', '.join(producers)}: split it there" if producers else "; split it where it is made"
        return f"{', '.join(parts)} next to split {', '.join(f'{k} {s}' for k, s in split.items())}{hint}"
    # A module output left split that forward() then used whole: the last finished module whose output differs.
    for path in reversed(cp.finished):
        a, b = cp.out_shapes.get(path), serial.out_shapes.get(path)
        if a and b and a != b:
            return (f"{path or 'forward()'} output {a[0]} is split (serial {b[0]}) and forward() then used it whole: "
                    f"gather it ({path}: gather)")  # fmt: skip
    return "no split/whole mismatch visible at module boundaries"


def _producers(cp: _Recorder, serial: _Recorder, shapes: list[tuple], where: str) -> list[str]:
    """Modules outside ``where`` whose serial output has one of ``shapes`` and whose CP output kept it (unsplit)."""
    found = []
    for path, outs in serial.out_shapes.items():
        if path in ("", where) or where.startswith(path + ".") or path.startswith(where + "."):
            continue
        for i, s in enumerate(outs):
            if s in shapes and cp.out_shapes.get(path, [None] * (i + 1))[i] == s:
                found.append(f"{path} output {i}")
    outer = [f for f in found if not any(f != g and f.startswith(g.split(" ")[0] + ".") for g in found)]
    return sorted(outer)[:3]


def _gather_hint(spec, model, serial: _Recorder) -> str:
    """Where a plan that never gathers should: the last module whose serial output has a split length on dim 1."""
    from train.cp.plans import resolve_plan

    lengths = set()
    for concrete, entry in resolve_plan(spec, model).items():
        for key, value in entry.split.items():
            ref = serial.inner_in.get(concrete, {}).get(key) if isinstance(key, str) else None
            for s in value if isinstance(value, tuple) else (value,):
                if torch.is_tensor(ref) and (s.expected_dims is None or ref.dim() == s.expected_dims):
                    lengths.add(ref.shape[s.split_dim])
    for path in reversed(serial.finished):
        outs = serial.out_shapes.get(path) or [None]
        if path and isinstance(outs[0], tuple) and len(outs[0]) > 1 and outs[0][1] in lengths:
            return f"; {path} is the last module whose output holds the sequence {outs[0]}: gather it there"
    return ""


def _expected(serial: torch.Tensor, spec: Any, rank: int, world: int) -> tuple[torch.Tensor, bool]:
    """The serial tensor's part this rank should hold under ``spec``; False when the spec leaves it whole."""
    if spec.expected_dims is not None and serial.dim() != spec.expected_dims:
        return serial, False
    return torch.tensor_split(serial, world, dim=spec.split_dim)[rank], True


def _group_errors(model: torch.nn.Module, ref_grads: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per parameter group, the largest gradient difference over its parameters relative to its largest serial
    gradient. Per parameter instead, a gradient that is zero by construction (a key bias: adding it to every score
    of a query does not change the softmax) would compare float32 rounding with rounding (3e-10 vs 2e-2 in the
    group: "rel 1.3"); a parameter the plan gets wrong still differs at the group's scale."""
    diff: dict[str, float] = {}
    scale: dict[str, float] = {}
    for n, p in model.named_parameters():
        if n not in ref_grads:
            continue
        group, ref = param_group(n), ref_grads[n].double()
        d = float("inf") if p.grad is None or p.grad.shape != ref.shape else (p.grad.double() - ref).abs().max().item()
        diff[group] = max(diff.get(group, 0.0), d)
        scale[group] = max(scale.get(group, 0.0), ref.abs().max().item())
    return {g: diff[g] / max(scale[g], 1e-30) for g in diff}


def _check_entries(spec, model, cp: _Recorder, serial: _Recorder, rank: int, world: int) -> list[dict]:
    from train.cp.plans import resolve_plan

    rows = []
    for concrete, entry in resolve_plan(spec, model).items():
        for key, value in entry.split.items():
            specs = value if isinstance(value, tuple) else (value,)
            if isinstance(key, str):
                got, ref = cp.inner_in.get(concrete, {}).get(key), serial.inner_in.get(concrete, {}).get(key)
                what = f"input {key}"
            else:
                got = (cp.outer_out.get(concrete) or [None] * (key + 1))[key]
                ref = (serial.outer_out.get(concrete) or [None] * (key + 1))[key]
                what = f"output {key}"
            if ref is None and isinstance(key, str) and concrete in serial.inner_in:
                # The module ran but this argument was None: a variant's entry (Qwen-Image Edit's modulate_index,
                # LTX-2's masks), which these inputs do not exercise. CP handed it None as well, or it is a failure.
                ok = got is None
                rows.append(dict(path=concrete, what=what, ok=ok, err=None, note="not passed (None): unexercised"))
                continue
            if ref is None:
                rows.append(dict(path=concrete, what=what, ok=False, err=None, note="never called with it"))
                continue
            got_list = got if isinstance(value, tuple) else [got]
            ref_list = ref if isinstance(value, tuple) else [ref]
            for i, (g, r, s) in enumerate(zip(got_list, ref_list, specs)):
                exp, split = _expected(r, s, rank, world)
                err = _rel(g, exp) if torch.is_tensor(g) else float("inf")
                label = what if len(specs) == 1 else f"{what}[{i}]"
                note = (
                    f"split {_shape(r)} -> {_shape(g)}"
                    if split
                    else f"left whole {_shape(r)} (not {s.expected_dims}-d)"
                )
                rows.append(dict(path=concrete, what=label, ok=err <= TOL, err=err, note=note))
        for i, g in enumerate(entry.gather):
            if g is None:  # that output is left as it is
                continue
            got = (cp.outer_out.get(concrete) or [None] * (i + 1))[i]
            local = (cp.inner_out.get(concrete) or [None] * (i + 1))[i]
            ref = (serial.outer_out.get(concrete) or [None] * (i + 1))[i]
            if ref is None or got is None:
                rows.append(dict(path=concrete, what=f"gather {i}", ok=False, err=None, note="never called"))
                continue
            err = max(_rel(got, ref), _rel(local, torch.tensor_split(ref, world, dim=g.gather_dim)[rank]))
            rows.append(dict(path=concrete, what=f"gather {i}", ok=err <= TOL, err=err,
                             note=f"local {_shape(local)} -> gathered {_shape(got)}"))  # fmt: skip
    return rows


def _case_mesh(rank: int, world: int, timeout_s: float):
    """A (ring 1, ulysses ``world``) CP mesh over fresh gloo groups with a short timeout, one per case: a case whose
    ranks fall out of step leaves its collectives pending in its own groups, never in the next case's or in the
    group that reports."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    timeout = timedelta(seconds=timeout_s)
    rings = [dist.new_group([r], backend="gloo", timeout=timeout) for r in range(world)]  # every rank makes each
    ulysses = dist.new_group(list(range(world)), backend="gloo", timeout=timeout)
    return DeviceMesh.from_group([rings[rank], ulysses], "cpu", torch.arange(world).reshape(1, world),
                                 mesh_dim_names=("ring", "ulysses"))  # fmt: skip


def _serial_reference(source, spec) -> tuple:
    """One serial step of the case's model on this rank: (its recorder, the plan's resolved paths, the step inputs,
    the forward kwargs, the outputs, the loss, every gradient)."""
    from train.cp.plans import resolve_plan
    from train.tools.probe import as_outputs

    serial_model = source.build(0)
    paths = sorted(resolve_plan(spec, serial_model))
    serial = _Recorder(serial_model, paths)
    step = source.step_inputs(1)  # a family's training step (train/step.py), else --inputs with an MSE loss
    kwargs = step.kwargs if step is not None else source.inputs(1)
    raw = serial_model(**kwargs, return_dict=False)
    ref_out = _output_tensors(as_outputs(raw))
    ref_loss = _step_loss(step, raw, ref_out, serial_model)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in serial_model.named_parameters() if p.grad is not None}
    return serial, paths, step, kwargs, ref_out, ref_loss, ref_grads


def check_rank(
    rank: int,
    world: int,
    cases: list[Case],
    tol: float = TOL,
    case_timeout_s: float = CASE_TIMEOUT_S,
    progress: str | None = None,
) -> list[dict]:
    """Every case on this rank (see the module docstring); a failure is caught and reported, never raised, so every
    rank reaches every case's closing barrier. ``case_timeout_s``: how long a case's collective waits for a peer;
    ``progress``: a folder where the results so far are written after every case (`_check_degree`)."""
    import time

    import torch.distributed as dist

    from train.cp import enable_context_parallel
    from train.cp.plans import load_plan_file
    from train.cp.reduce import GradReduction
    from train.tools.probe import as_outputs, resolve_source

    global TOL
    TOL = tol
    results = []
    for case in cases:
        mesh = _case_mesh(rank, world, case_timeout_s)
        reduction = GradReduction("allreduce", cp_group=mesh["ulysses"].get_group())
        source = case.source if case.source is not None else resolve_source(case.model, case.inputs, case.family)
        spec = load_plan_file(case.plan)
        serial, paths, step, kwargs, ref_out, ref_loss, ref_grads = _serial_reference(source, spec)
        model = source.build(0)
        cp = _Recorder(model, paths)
        res: dict[str, Any] = {"case": case, "rows": [], "error": None, "case_timeout_s": case_timeout_s}
        try:
            state = enable_context_parallel(model, mesh=mesh, plan=spec)
            state.layout.verify = True  # every layer checks, from exchanged sizes, that the registry decided right
            raw = model(**kwargs, return_dict=False)
            out = _output_tensors(as_outputs(raw))
            res["out"] = max(_rel(o, r) for o, r in zip(out, ref_out))
            res["out_shapes"] = [(_shape(o), _shape(r)) for o, r in zip(out, ref_out)]
            loss = _step_loss(step, raw, out, model)
            res["loss"] = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
            loss.backward()
            reduction.reduce_gradients(model.parameters())
            res["grads"] = _group_errors(model, ref_grads)
            res["rows"] = _check_entries(spec, model, cp, serial, rank, world)
        except Exception as exc:  # noqa: BLE001 - reported as the verdict
            where = cp.stack[-1] if cp.stack else ""
            res["failed_at"] = time.time()  # the ranks share a clock: merge_ranks reports the first to fail
            res["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            res["where"] = where
            if not cp.finished:  # refused before any module ran: the startup guard
                res["where"], res["diagnosis"] = "", "refused at startup" + _gather_hint(spec, model, serial)
            else:
                res["diagnosis"] = _diagnose(cp, serial, where)
                res["rows"] = _check_entries(spec, model, cp, serial, rank, world)
        results.append(res)
        if progress is not None:  # write, then rename: a rank killed mid-write leaves the previous file whole
            torch.save(results, Path(progress) / f"rank{rank}.tmp")
            os.replace(Path(progress) / f"rank{rank}.tmp", Path(progress) / f"rank{rank}.pt")
        # Every rank reaches here for every case (failures are caught; a rank left waiting in this case's groups
        # times out there), so the default group stays in step. A case's groups are freed when it ran clean here;
        # after a failure a peer may have left a collective pending in them, so they are left alone.
        dist.barrier()
        if not res["error"]:
            for g in {mesh["ring"].get_group(), mesh["ulysses"].get_group()}:
                dist.destroy_process_group(g)
    return results


def check(cases: list[Case], degrees: Sequence[int] = (2, 3), tol: float = TOL) -> dict[int, list[dict]]:
    """Run every case at every degree (one spawned gloo group per degree, all cases in it); per degree, one merged
    result per case (`merge_ranks`)."""
    return {world: _check_degree(cases, world, tol) for world in degrees}


def _check_degree(cases: list[Case], world: int, tol: float) -> list[dict]:
    """All cases in one spawned group. A plan whose ranks disagree on a collective's sizes can make gloo abort a rank
    (a size mismatch inside the collective, not a timeout), which ends the group: the cases every rank finished are
    kept (each rank records its results after every case), the one in flight fails with that verdict, and the rest
    run in a new group."""
    import tempfile

    from train.tools.spawn import RankError, run_distributed

    with tempfile.TemporaryDirectory() as progress:
        try:
            return merge_ranks(run_distributed(check_rank, world, cases, tol, CASE_TIMEOUT_S, progress))
        except RankError as exc:
            done = [_progress(Path(progress), r) for r in range(world)]
            error = f"a rank died: {str(exc).splitlines()[0]}"
    finished = min(len(d) for d in done)
    merged = merge_ranks([d[:finished] for d in done]) if finished else []
    why = "ranks out of step: a collective's sizes disagreed across ranks and gloo aborted a rank"
    if "signal" not in error:
        why = "the rank raised outside the checked CP forward (building the model, its inputs or the serial run)"
    died = {"case": cases[finished], "rows": [], "error": error, "where": "", "diagnosis": why}
    rest = _check_degree(cases[finished + 1 :], world, tol) if finished + 1 < len(cases) else []
    return [*merged, died, *rest]


def _progress(folder: Path, rank: int) -> list[dict]:
    path = folder / f"rank{rank}.pt"
    return torch.load(path, weights_only=False) if path.exists() else []


def merge_ranks(ranks: list[list[dict]]) -> list[dict]:
    """`check_rank`'s per-rank results, one per case: rows with the worst error over ranks, rank 0's output, loss
    and gradient errors, and the failure of the rank that failed first. When another did not fail, or failed half a
    case timeout later (it waited in a collective the first never reached: ranks out of step), the diagnosis says
    so."""
    per_case = []
    for i in range(len(ranks[0])):
        res = dict(ranks[0][i])
        rows = [dict(r) for r in res["rows"]]
        for other in ranks[1:]:
            for row, o in zip(rows, other[i]["rows"]):
                row["ok"] = row["ok"] and o["ok"]
                if o["err"] is not None and (row["err"] is None or o["err"] > row["err"]):
                    row["err"] = o["err"]
        failed = sorted((r[i]["failed_at"], rank) for rank, r in enumerate(ranks) if r[i]["error"])
        if failed:
            first = ranks[failed[0][1]][i]
            res.update(error=first["error"], where=first["where"], diagnosis=first["diagnosis"])
            others = [r for r in range(len(ranks)) if r != failed[0][1]]
            late = failed[0][0] + first["case_timeout_s"] / 2  # a rank failing this much later timed out waiting
            if len(failed) < len(ranks) or any(t >= late for t, _ in failed[1:]):
                res["diagnosis"] += (f"; ranks out of step: rank {failed[0][1]} failed here first, rank(s) "
                                     f"{', '.join(map(str, others))} went on (their collective timed out)")  # fmt: skip
        res["rows"] = rows
        per_case.append(res)
    return per_case


def verdict(results: dict[int, list[dict]], index: int = 0, tol: float = TOL) -> bool:
    for per_case in results.values():
        res = per_case[index]
        if res["error"] or not all(r["ok"] for r in res["rows"]):
            return False
        if res["out"] > tol or res["loss"] > tol or max(res["grads"].values(), default=0.0) > tol:
            return False
    return True


def format_report(results: dict[int, list[dict]], index: int = 0, tol: float = TOL) -> str:
    lines = []
    for world, per_case in results.items():
        res = per_case[index]
        case = res["case"]
        lines.append(f"CP {world}: {case.plan} on {case.model}")
        for r in res["rows"]:
            err = "n/a" if r["err"] is None else f"{r['err']:.1e}"
            path = r["path"] or '""'
            lines.append(f"  {'ok  ' if r['ok'] else 'FAIL'} {path:<28} {r['what']:<28} {err:>8}  {r['note']}")
        if res["error"]:
            where = res["where"] or "the model's forward()"
            lines.append(f"  FAIL forward failed in {where}: {res['error']}")
            lines.append(f"       {where}: {res['diagnosis']}")
            continue
        shapes = ", ".join(f"{a}" if a == b else f"{a} vs serial {b}" for a, b in res["out_shapes"])
        ok = res["out"] <= tol and res["loss"] <= tol
        lines.append(
            f"  {'ok  ' if ok else 'FAIL'} output {shapes}: max rel {res['out']:.1e}, loss rel {res['loss']:.1e}"
        )
        if "vs serial" in shapes:
            lines.append("       the output is not the whole sequence: add a gather where it is formed (proj_out)")
        for group, err in sorted(res["grads"].items()):
            lines.append(f"  {'ok  ' if err <= tol else 'FAIL'} grad {group:<44} max rel {err:.1e}")
    good = verdict(results, index, tol)
    lines.append(f"{'PASS' if good else 'FAIL'} (tolerance {tol:g}, relative)")
    return "\n".join(lines)


def _user_checks(case: Case) -> None:
    """One-line errors before spawning: the plan loads, the model resolves, the plan is for this class and fits."""
    from train.cp.plans import load_plan_file, validate_plan
    from train.tools.probe import resolve_source

    if not Path(case.plan).is_file():
        raise UserError(f"{case.plan}: no such plan file; pass a cp_plans/*.yaml or a drafted plan")
    spec = load_plan_file(case.plan)
    source = resolve_source(case.model, case.inputs, case.family)
    names = [c.__name__ for c in source.cls.__mro__]
    if spec.model_class not in names:
        raise UserError(f"{case.plan} is a plan for {spec.model_class}, not for {source.class_name}; pass "
                        f"--model {spec.model_class} or the plan for {source.class_name}")  # fmt: skip
    try:
        validate_plan(spec, source.build(0))
    except ValueError as exc:
        raise UserError(" ".join(str(exc).split())) from exc


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.tools.check_plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("plan", help="plan YAML (cp_plans/*.yaml or a draft)")
    parser.add_argument("--model", required=True, help="diffusers class name or local model folder")
    parser.add_argument("--degrees", type=int, nargs="+", default=[2, 3], help="CP degrees (default 2 3)")
    parser.add_argument("--inputs", help="module:function returning the forward kwargs for a config dict")
    parser.add_argument("--family", help="which family's inputs, when several use the class")
    parser.add_argument("--tol", type=float, default=TOL, help=f"relative tolerance (default {TOL:g})")
    parser.add_argument("--debug", action="store_true", help="tracebacks for user errors")
    args = parser.parse_args(argv)
    case = Case(args.plan, args.model, args.inputs, args.family)
    try:
        if any(d < 2 for d in args.degrees):
            raise UserError(f"--degrees {args.degrees}: CP degrees are 2 or more")
        _user_checks(case)
    except UserError as err:
        if args.debug:
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    results = check([case], args.degrees, args.tol)
    print(format_report(results, 0, args.tol))
    return 0 if verdict(results, 0, args.tol) else 1


if __name__ == "__main__":
    sys.exit(main())
