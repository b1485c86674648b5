"""Propose a CP plan YAML (the cp_plans/*.yaml format, docs/plans.md) for a diffusers transformer, from one forward of
a tiny instance under hooks.

Usage::

    python -m train.cp.draft_plan SkyReelsV2Transformer3DModel -o cp_plans/skyreels_v2.yaml
    python -m train.cp.draft_plan path/to/model_or_pipeline_folder
    python -m train.cp.draft_plan MyTransformer3DModel --inputs my_inputs:make_kwargs   # a class with no family

How the tiny instance and its inputs are made: train/cp/probe.py. What the draft decides, from what the hooks saw:

1. The sequence: the first repeated block (the first ModuleList element called) receives ``hidden_states`` of S
   tokens (dim 1). Text is a split stream too when the blocks return it (joint attention: a block output with the
   text length); cross-attention text stays whole on every rank (Wan's choice).
2. Where the sequence is formed: when forward()'s own ``hidden_states`` already holds the S tokens (a packed model:
   Flux, LTX), every forward() input with a token dim is split on entry (``""``); otherwise (patchify in forward:
   Wan) the first block's ``hidden_states`` is split, and forward() inputs with a token dim (per-token timesteps)
   are split on entry.
3. Tables and per-token tensors: every tensor the first block receives with a token dim that a module before the
   blocks produced (RoPE cos/sin) is split at that module's output, unless, for a packed model, re-running the
   module on split inputs already gives the split length (Flux builds RoPE from split ids). Per-token tensors
   forward() hands every block unsplit (a mask, a modulation index) are split at ``<blocks>.*``.
4. The output: the last module after the blocks whose output holds the token dim (``proj_out``) is gathered.

The YAML's "Why each entry" block says what each hook saw. ``layout_registry: true`` when every attention call in the
trace attends over a split length or the sum of two (what the layout registry assumes); check_plan verifies it.
Nothing here is final: run ``python -m train.cp.check_plan`` on the draft.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from train.cp.probe import Call, ModelSource, as_outputs, flatten_tensors, resolve_source, trace
from train.errors import UserError

__all__ = ["Draft", "draft", "main", "settings_diff"]


@dataclass
class Draft:
    """A drafted plan: ``plan`` in the YAML layout (path -> {split_inputs | split_outputs | gather: ...})."""

    source: ModelSource
    plan: dict[str, dict[str, Any]] = field(default_factory=dict)
    why: list[tuple[str, str]] = field(default_factory=list)  # (entry label, what the hooks saw)
    notes: list[str] = field(default_factory=list)
    sequence: str = ""
    layout_registry: bool = True
    local_attention: list[str] = field(default_factory=list)
    order: dict[str, float] = field(default_factory=dict)  # plan path -> when its module ran (entries in that order)

    def add(self, path: str, kind: str, key: Any, dim: int, ndim: int) -> None:
        entry = self.plan.setdefault(path, {})
        spec = {"dim": dim, "expected_dims": ndim}
        if kind == "gather":
            entry["gather"] = spec
        else:
            entry.setdefault(kind, {})[key] = spec

    def yaml(self, command: str) -> str:
        src = self.source
        made = f"family {src.family}'s tiny config and inputs" if src.inputs_fn is None else "--inputs"
        if src.shrunk:
            made += "; config shrunk: " + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in src.shrunk.items())
        lines = [
            f"# CP plan for {src.class_name}, drafted by `{command}`",
            f"# from one forward of a tiny instance ({made}). Format: docs/plans.md.",
            f"# Check it: python -m train.cp.check_plan <this file> --model {src.target}",
            "#",
            *_wrap("# Sequence: ", self.sequence),
            "#",
            "# Why each entry:",
        ]
        width = max((len(label) for label, _ in self.why), default=0) + 2
        for label, text in self.why:
            lines += _wrap(f"#   {label:<{width}}", text, indent="#   " + " " * width)
        for note in self.notes:
            lines += _wrap("# Note: ", note, indent="#       ")
        lines += [
            f"model_class: {src.class_name}",
            "training: supported",
            "reason: null",
            "per_head_mask_inputs: []",
            f"layout_registry: {'true' if self.layout_registry else 'false'}",
        ]
        if self.local_attention:
            lines += ["local_attention:", *[f"  - {p}" for p in self.local_attention]]
        lines += ["plan:"]
        for path, entry in sorted(self.plan.items(), key=lambda item: self.order.get(item[0], 0)):
            lines.append(f"  {_key(path)}:")
            for kind in ("split_inputs", "split_outputs"):
                if kind in entry:
                    lines.append(f"    {kind}:")
                    lines += [f"      {k}: {_flow(s)}" for k, s in entry[kind].items()]
            if "gather" in entry:
                lines.append(f"    gather: {_flow(entry['gather'])}")
        return "\n".join(lines) + "\n"


def _key(path: str) -> str:
    return '""' if path == "" else path


def _flow(spec: dict[str, int]) -> str:
    return f"{{dim: {spec['dim']}, expected_dims: {spec['expected_dims']}}}"


def _wrap(first: str, text: str, indent: str | None = None, width: int = 118) -> list[str]:
    indent = indent if indent is not None else "#" + " " * (len(first) - 1)
    lines, line = [], first
    for word in text.split():
        if len(line) + len(word) + 1 > width and line.strip() not in ("#", first.strip()):
            lines.append(line.rstrip())
            line = indent
        line += word + " "
    lines.append(line.rstrip())
    return lines


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(n) for n in t.shape) + ")"


def _token_dim(t: torch.Tensor, counts: dict[int, str]) -> int | None:
    """The dim that carries a split sequence (size in ``counts``): dim 1 first, then 0, then the others."""
    order = [1, 0, *range(2, t.dim())] if t.dim() > 1 else [0]
    return next((d for d in order if t.shape[d] in counts), None)


def _is_inside(path: str, blocks: list[str]) -> bool:
    return any(path == b or path.startswith(b + ".") for b in blocks)


def draft(source: ModelSource, seed: int = 0) -> Draft:
    """Trace one forward of the tiny model and propose a plan (see the module docstring)."""
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    model = source.build(seed)
    kwargs = source.inputs(seed)
    try:
        calls, _ = trace(model, kwargs)
    except Exception as exc:
        raise UserError(f"{source.class_name}: the tiny forward failed ({type(exc).__name__}: {exc}); pass "
                        "--inputs module:function with inputs that fit this config") from exc  # fmt: skip
    out = Draft(source)
    lists = {p for p, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)}
    block_calls = sorted((c for c in calls.values() if c.path.rpartition(".")[0] in lists), key=lambda c: c.start)
    attention = (Attention, AttentionModuleMixin)
    block_calls = [  # repeated transformer blocks: take a (B, S, C) sequence and hold an attention module
        c for c in block_calls
        if torch.is_tensor(c.inputs.get("hidden_states")) and c.inputs["hidden_states"].dim() == 3
        and any(isinstance(m, attention) for m in c.module.modules())
    ]  # fmt: skip
    top = [c for c in block_calls if "." not in c.path.rpartition(".")[0]]  # the model's own block lists first
    block_calls = top or block_calls
    if not block_calls:
        raise UserError(
            f"{source.class_name}: no repeated block (a ModuleList element with attention, taking "
            "(B, S, C) hidden_states) ran in the tiny forward; write the plan by hand (docs/plans.md)"
        )
    first, root = block_calls[0], calls[""]
    list_path = first.path.rpartition(".")[0]
    blocks = [c.path for c in block_calls]
    last_end = max(c.end for c in block_calls)
    hidden = first.inputs["hidden_states"]
    seq = hidden.shape[1]
    counts = {seq: "token"}
    text = first.inputs.get("encoder_hidden_states")
    text_len = text.shape[1] if torch.is_tensor(text) and text.dim() == 3 else None
    joint = text_len is not None and any(
        torch.is_tensor(o) and o.dim() == 3 and o.shape[1] == text_len for o in first.outputs
    )
    if joint:
        counts |= {text_len: "text", seq + text_len: "text + token"}
    out.sequence = f"{first.path} receives hidden_states {_shape(hidden)}: S = {seq} tokens on dim 1."
    if text_len is not None:
        out.sequence += (
            f" Text encoder_hidden_states {_shape(text)}: the blocks return it (joint attention), so its "
            f"{text_len} tokens are split too." if joint else
            f" Text encoder_hidden_states {_shape(text)} is cross-attention only (the blocks do not return it): "
            f"left whole on every rank."
        )  # fmt: skip
    if len(set(counts)) < len(counts) or seq == text_len:
        out.notes.append(f"token and text counts coincide ({seq}, {text_len}): re-run with other input shapes")

    root_hidden = root.inputs.get("hidden_states")
    packed = torch.is_tensor(root_hidden) and root_hidden.dim() == 3 and root_hidden.shape[1] == seq
    # Producers of the tensors the first block receives: forward() inputs, or outputs of modules run before it.
    root_ids = {id(t): n for name, v in root.inputs.items() for n, t in flatten_tensors(v, name)}
    produced: dict[int, tuple[Call, int]] = {}
    for call in sorted(calls.values(), key=lambda c: (len(c.path), c.start)):  # outermost module first
        if call.path and not _is_inside(call.path, blocks) and 0 <= call.end < first.start:
            for i, o in enumerate(call.outputs):
                if torch.is_tensor(o):
                    produced.setdefault(id(o), (call, i))

    root_split: set[str] = set()
    if packed:
        out.sequence += " forward()'s hidden_states already holds the S tokens (packed): split on entry."
    else:
        shape = _shape(root_hidden) if torch.is_tensor(root_hidden) else "?"
        out.sequence += f" forward()'s hidden_states {shape} is patchified in forward(): split at {first.path}."
        out.add(first.path, "split_inputs", "hidden_states", 1, hidden.dim())
        out.why.append((f"{first.path} hidden_states", f"{_shape(hidden)} is where the {seq}-token sequence is "
                        "first formed; it flows split through every block to the output"))  # fmt: skip
        if joint:
            out.add(first.path, "split_inputs", "encoder_hidden_states", 1, text.dim())
            out.why.append((f"{first.path} encoder_hidden_states",
                            f"{_shape(text)}: joint attention over [text, tokens]: split the text alike"))  # fmt: skip
    for name, value in root.inputs.items():
        for n, t in flatten_tensors(value, name):
            d = _token_dim(t, counts)
            if d is None or (not packed and name == "hidden_states"):
                continue
            if not packed and t.shape[d] != seq:  # text is split where the blocks take it, not on entry
                continue
            if n != name:
                out.notes.append(f"forward() input {n} {_shape(t)} has a token dim inside a list: not drafted")
                continue
            out.add("", "split_inputs", name, d, t.dim())
            root_split.add(name)
            what = "per-token" if packed else "per-token (split at its source, so all it derives is split)"
            out.why.append((f'"" {name}', f"forward() input {_shape(t)}: dim {d} has the {counts[t.shape[d]]} "
                            f"count {t.shape[d]}, {what}"))  # fmt: skip

    # Tensors the first block receives with a token dim, other than the sequence itself.
    split_outputs: dict[str, dict[int, tuple[int, torch.Tensor]]] = {}
    for name, value in first.inputs.items():
        if name == "hidden_states" or (joint and name == "encoder_hidden_states"):
            continue
        for n, t in flatten_tensors(value, name):
            d = _token_dim(t, counts)
            if d is None:
                continue
            if id(t) in root_ids:
                if root_ids[id(t)] not in root_split:
                    out.notes.append(
                        f"{first.path} gets forward() input {n} {_shape(t)} unchanged but it was not split"
                    )
                continue
            if id(t) in produced:
                call, index = produced[id(t)]
                if packed and _follows_split(call, index, d, counts):
                    out.notes.append(f"{call.path} output {index} {_shape(t)} (-> {first.path} {n}) is rebuilt from "
                                     "split inputs (re-run on halves: half the rows): not split again")  # fmt: skip
                    continue
                split_outputs.setdefault(call.path, {})[index] = (d, t)
                continue
            if root_split - {"hidden_states"} and not packed:
                out.notes.append(f"{first.path} {n} {_shape(t)} is built in forward() (assumed from the split "
                                 f"{', '.join(sorted(root_split))}): not split again")  # fmt: skip
                continue
            if n != name:
                out.notes.append(f"{first.path} {n} {_shape(t)}: a per-token tensor inside a list: not drafted")
                continue
            if t.dim() >= 2 and sum(s in counts for s in t.shape[1:]) > 1:
                out.notes.append(f"{first.path} {n} {_shape(t)} has two token dims (a pairwise mask): write by hand")
                continue
            out.add(f"{list_path}.*", "split_inputs", name, d, t.dim())
            out.why.append((f"{list_path}.* {name}", f"{_shape(t)} is built in forward() and handed to every block "
                            f"with the whole {counts[t.shape[d]]} count on dim {d}: each block splits "
                            "its copy"))  # fmt: skip
    for path, outs in split_outputs.items():
        for index, (d, t) in sorted(outs.items()):
            out.add(path, "split_outputs", index, d, t.dim())
        idx = " / ".join(str(i) for i in sorted(outs))
        shapes = ", ".join(_shape(t) for _, t in outs.values())
        whole = ", ".join(sorted({f"{counts[t.shape[d]]} count on dim {d}" for d, t in outs.values()}))
        why = f"{shapes} reach {first.path} with the whole {whole}: split them like the tokens"
        if packed:
            why += " (re-run on split inputs they keep every row: built from shapes, not from the split inputs)"
        out.why.append((f"{path} outputs {idx}", why))

    # The output: the last module after the blocks whose output carries the sequence.
    tail = [c for c in calls.values() if c.path and not _is_inside(c.path, blocks) and c.start > last_end]
    tail = [c for c in tail if any(torch.is_tensor(o) and _token_dim(o, {seq: "token"}) == 1 for o in c.outputs)]
    if not tail:
        out.notes.append("no module after the blocks outputs the token sequence: add a gather by hand")
    else:
        last = max(tail, key=lambda c: c.end)
        o = last.outputs
        if len(o) != 1:
            out.notes.append(f"{last.path} has {len(o)} outputs: gather drafted for output 0 only; check it")
        firsts = [c for c in sorted(tail, key=lambda c: c.start) if not any(
            c.path.startswith(d.path + ".") for d in tail)]  # fmt: skip
        feeds = last.inputs.get(next(iter(last.inputs), ""), None)
        body_made = any(p.endswith(".*") for p in out.plan)  # per-token tensors forward() builds itself
        if body_made and len(firsts) > 1 and firsts[0] is not last and not any(feeds is o for o in firsts[0].outputs):
            head = firsts[0]
            name = next(iter(last.inputs))
            out.add(head.path, "gather", None, 1, head.outputs[0].dim())
            out.add(last.path, "split_inputs", name, 1, feeds.dim())
            out.why.append((f"{head.path} gather", f"{_shape(head.outputs[0])}: forward() transforms it before "
                            f"{last.path} and builds per-token tensors itself (whole on every rank): gather here so "
                            "that step runs on whole tensors"))  # fmt: skip
            out.why.append(
                (
                    f"{last.path} {name} split",
                    f"{_shape(feeds)}: split again so that {last.path} and "
                    "what feeds it see only this rank's tokens in backward (gradients stay a SUM)",
                )
            )
        out.add(last.path, "gather", None, 1, o[0].dim())
        others = sorted({c.path for c in tail} - {last.path})
        others = [p for p in others if not any(p.startswith(q + ".") for q in others)]
        more = f" (after {', '.join(others)})" if others else ""
        out.why.append((f"{last.path} gather", f"{_shape(o[0])} is the last module output with the {seq} tokens"
                        f"{more}: gather the sequence so the loss sees the whole prediction"))  # fmt: skip

    # Cross-attention onto whole text: a processor that still hands it its parallel config would all-to-all every
    # rank's identical copy of the text through Ulysses; such attention runs locally (exact: local queries, all keys).
    local = set()
    for call in calls.values():
        kv = call.inputs.get("encoder_hidden_states")
        if (isinstance(call.module, (Attention, AttentionModuleMixin)) and not joint and torch.is_tensor(kv)
                and kv.shape[1] == text_len and _is_inside(call.path, blocks) and _attends_with_cp(call)):  # fmt: skip
            block = next(b for b in blocks if call.path.startswith(b + "."))
            local.add(f"{list_path}.*{call.path[len(block) :]}")
    # Attention before the blocks (a text refiner) runs on replicated tokens: local, at the model's child holding it.
    for call in calls.values():
        if (isinstance(call.module, (Attention, AttentionModuleMixin)) and call.path
                and not _is_inside(call.path, blocks) and call.end < first.start):  # fmt: skip
            local.add(call.path.split(".")[0])
    out.local_attention = sorted(local)
    for path in out.local_attention:
        out.why.append((f"local_attention {path}", "cross-attention onto the whole text, yet its processor passes "
                        "the parallel config to dispatch_attention_fn (seen by a spy): attend locally"))  # fmt: skip

    for path in out.plan:
        concrete = path.replace("*", "0")
        out.order[path] = calls[concrete].start + (0.5 if "*" in path else 0) if concrete in calls else 0

    # layout_registry: every attention call attends over a split length or the sum of two (or whole text).
    allowed = set(counts) | {a + b for a in counts for b in counts}
    whole = {text_len} if text_len is not None and not joint else set()
    for call in calls.values():
        if isinstance(call.module, (Attention, AttentionModuleMixin)):
            q = call.inputs.get("hidden_states")
            kv = call.inputs.get("encoder_hidden_states")
            lengths = [x.shape[1] for x in (q, kv) if torch.is_tensor(x) and x.dim() == 3]
            if any(n not in allowed | whole for n in lengths):
                out.layout_registry = False
                out.notes.append(f"{call.path} attends over {lengths} tokens, not built from the splits: "
                                 "layout_registry false (every layer exchanges sizes)")  # fmt: skip
                break
    return out


def _attends_with_cp(call: Call) -> bool:
    """Re-run an attention module with a spy on its processor module's dispatch_attention_fn: does the processor
    pass its parallel config (Ulysses) for this call?"""
    import sys as _sys

    proc = getattr(call.module, "processor", None)
    namespace = _sys.modules.get(type(proc).__module__)
    if proc is None or not hasattr(namespace, "dispatch_attention_fn"):
        return False
    original, marker, seen = namespace.dispatch_attention_fn, object(), []

    def spy(*args, **kwargs):
        seen.append(kwargs.get("parallel_config"))
        return original(*args, **{**kwargs, "parallel_config": None})

    had = proc.__dict__.get("_parallel_config", None)
    namespace.dispatch_attention_fn, proc._parallel_config = spy, marker
    try:
        with torch.no_grad():
            call.module(**call.inputs)
    except Exception:
        return False
    finally:
        namespace.dispatch_attention_fn, proc._parallel_config = original, had
    return any(s is marker for s in seen)


def _follows_split(call: Call, index: int, dim: int, counts: dict[int, str]) -> bool:
    """Re-run a module with its token-dim inputs cut to the first half: does output ``index`` shrink on ``dim``?"""
    cut: dict[str, Any] = {}
    any_cut = False
    for name, value in call.inputs.items():
        if torch.is_tensor(value) and (d := _token_dim(value, counts)) is not None:
            cut[name] = torch.tensor_split(value, 2, dim=d)[0]
            any_cut = True
        else:
            cut[name] = value
    if not any_cut:
        return False
    try:
        with torch.no_grad():
            again = as_outputs(call.module(**cut))
    except Exception:
        return False
    before = call.outputs[index]
    return torch.is_tensor(again[index]) and again[index].shape[dim] < before.shape[dim]


def settings_diff(draft_text: str, shipped_text: str, shipped_name: str) -> str:
    """Unified diff of two plan files' settings (comments and blank lines dropped): what the draft got wrong."""
    import difflib

    def settings(text: str) -> list[str]:
        return [line.split(" #")[0].rstrip() + "\n" for line in text.splitlines() if line.strip()
                and not line.lstrip().startswith("#")]  # fmt: skip

    return "".join(difflib.unified_diff(settings(draft_text), settings(shipped_text), "draft", shipped_name, n=1))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.cp.draft_plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("model", help="diffusers class name (e.g. WanTransformer3DModel) or a local model folder")
    parser.add_argument("-o", "--output", help="write the plan here (default: print it)")
    parser.add_argument("--inputs", help="module:function returning the forward kwargs for a config dict")
    parser.add_argument("--family", help="which family's inputs, when several use the class (default: the first)")
    parser.add_argument("--diff", metavar="PLAN", help="print the diff of the draft's settings against this plan file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--debug", action="store_true", help="tracebacks for user errors")
    args = parser.parse_args(argv)
    try:
        source = resolve_source(args.model, args.inputs, args.family)
        result = draft(source, args.seed)
    except UserError as err:
        if args.debug:
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    extra = [f"--{k} {v}" for k, v in (("inputs", args.inputs), ("family", args.family)) if v]
    command = " ".join(["python -m train.cp.draft_plan", args.model, *extra])
    text = result.yaml(command)
    if args.diff:
        print(settings_diff(text, Path(args.diff).read_text(), args.diff), end="")
        return 0
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}")
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
