"""Propose a CP plan YAML (the cp_plans/*.yaml format, docs/plans.md) for a diffusers transformer, from one forward of
a tiny instance under hooks.

Usage::

    python -m train.tools.draft_plan SkyReelsV2Transformer3DModel -o cp_plans/skyreels_v2.yaml
    python -m train.tools.draft_plan path/to/model_or_pipeline_folder
    python -m train.tools.draft_plan MyTransformer3DModel --inputs my_inputs:make_kwargs   # a class with no family

How the tiny instance and its inputs are made: train/tools/probe.py. What the draft decides, from what the hooks saw,
is one rule function each, applied in the order of :data:`RULES` (each docstring states its rule):

0. The blocks (`_find_blocks`): ModuleList elements with attention whose token argument (`_token_arg`: found by the
   tensor a block returns the same shape for, not by name) is a (B, S, C) sequence; text-only blocks (Flux3's
   ``txt_mode_blocks``) are passed over when other blocks carry another count.
1. `rule_sequence`: the first block's token argument holds S tokens (dim 1). Text is a split stream too when the
   blocks return it (joint attention); cross-attention text stays whole on every rank (Wan's choice).
2. `rule_where_formed`, `rule_split_at_entry`: when forward()'s own ``hidden_states`` already holds the S tokens (a
   packed model: Flux, LTX), every forward() input with a token dim is split on entry (``""``), unless a module
   before the blocks takes a sequence length as a number (Qwen-Image's RoPE: ``max_txt_seq_len``); otherwise
   (patchify in forward: Wan) the first block's token argument is split, and forward() inputs with the token count
   (per-token timesteps) are split on entry.
3. `rule_split_block_inputs`, `rule_split_tables`: every tensor the first block receives with a token dim that a
   module before the blocks produced (RoPE cos/sin) is split at that module's output, unless, for a packed model,
   re-running the module on split inputs already gives the split length (Flux builds RoPE from split ids).
   Per-token tensors forward() hands every block unsplit (a mask, a modulation index) are split at ``<blocks>.*``.
4. `rule_gather_output`: the last module after the blocks whose output holds the token dim (``proj_out``) is
   gathered.
5. `rule_local_attention`: cross-attention onto whole text that would all-to-all it, and attention on replicated
   tokens before the blocks, run locally.
6. `rule_layout_registry`: ``layout_registry: true`` when every attention call in the trace attends over a split
   length or the sum of two (what the layout registry assumes); check_plan verifies it.

The YAML's "Why each entry" block says what each hook saw. Nothing here is final: run
``python -m train.tools.check_plan`` on the draft.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from train.errors import UserError
from train.tools.probe import Call, ModelSource, as_outputs, flatten_tensors, resolve_source, trace

__all__ = ["RULES", "Draft", "draft", "main", "settings_diff"]


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
    joint_key_mask: list[str] = field(default_factory=list)  # a whole joint mask's segments (train/cp/masks.py)
    replicated_tail: bool = False  # the last block's output is gathered: what follows runs on every rank
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
            f"# Check it: python -m train.tools.check_plan <this file> --model {src.target}",
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
        if self.joint_key_mask:
            lines += ["joint_key_mask:", *[f'  - "{p}"' for p in self.joint_key_mask]]
        if self.replicated_tail:
            lines += ["replicated_tail: true"]
        lines += ["plan:"]
        for path, entry in sorted(self.plan.items(), key=lambda item: self.order.get(item[0], 0)):
            lines.append(f"  {_key(path)}:")
            for kind in ("split_inputs", "split_outputs"):
                if kind in entry:
                    lines.append(f"    {kind}:")
                    lines += [f"      {k}: {_flow(s)}" for k, s in entry[kind].items()]
            if "gather" in entry:
                gather = entry["gather"]
                flow = (
                    f"[{', '.join(_flow(g) if g else 'null' for g in gather)}]"
                    if isinstance(gather, list)
                    else _flow(gather)
                )
                lines.append(f"    gather: {flow}")
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
    """Trace one forward of the tiny model and apply the rules of :data:`RULES` in order (the module docstring says
    each); a rule adds its entries, why lines and notes, and may leave facts on the trace for the rules after it."""
    model = source.build(seed)
    kwargs = source.inputs(seed)
    try:
        calls, _ = trace(model, kwargs)
    except Exception as exc:
        raise UserError(f"{source.class_name}: the tiny forward failed ({type(exc).__name__}: {exc}); pass "
                        "--inputs module:function with inputs that fit this config") from exc  # fmt: skip
    out = Draft(source)
    seen = _Trace.of(calls, _find_blocks(source, model, calls))
    for rule in RULES:
        rule(out, seen)
    # Entries print in the order their modules ran; a `<blocks>.*` entry right after block 0's own entry.
    for path in out.plan:
        concrete = path.replace("*", "0")
        if path.endswith(".-1"):  # the last block of that list
            concrete = max((b for b in seen.blocks if b.rpartition(".")[0] == path[:-3]), key=lambda b: calls[b].end)
        out.order[path] = calls[concrete].start + (0.5 if "*" in path else 0) if concrete in calls else 0
    return out


def _is_attention(module: torch.nn.Module) -> bool:
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    return isinstance(module, (Attention, AttentionModuleMixin))


def _token_arg(call: Call) -> str | None:
    """The argument that carries a block's token sequence, found by the tensor, not by its name: a (B, S, C) input
    the block returns a tensor of the same shape for (the residual stream); ``hidden_states`` when several qualify
    (a joint block returns its text too), else the first in argument order."""
    shapes = {tuple(o.shape) for o in call.outputs if torch.is_tensor(o) and o.dim() == 3}
    names = [n for n, v in call.inputs.items() if torch.is_tensor(v) and v.dim() == 3 and tuple(v.shape) in shapes]
    return "hidden_states" if "hidden_states" in names else next(iter(names), None)


def _find_blocks(source: ModelSource, model: torch.nn.Module, calls: dict[str, Call]) -> list[Call]:
    """The repeated transformer blocks, in call order: ModuleList elements that carry a (B, S, C) token sequence
    (`_token_arg`) and hold an attention module. Blocks that run on the text alone (their tokens number forward()'s
    encoder_hidden_states; Flux3's txt_mode_blocks, Kandinsky's text blocks) are not where the sequence is read when
    other blocks carry another count. The model's own block lists win over nested ones, so the sequence is read
    where the main stack takes it; with no block at all there is nothing to draft from."""
    lists = {p for p, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)}
    block_calls = sorted((c for c in calls.values() if c.path.rpartition(".")[0] in lists), key=lambda c: c.start)
    block_calls = [c for c in block_calls if _token_arg(c) and any(_is_attention(m) for m in c.module.modules())]
    text = calls[""].inputs.get("encoder_hidden_states")
    if torch.is_tensor(text) and text.dim() == 3:
        on_text = [c for c in block_calls if c.inputs[_token_arg(c)].shape[1] == text.shape[1]]
        block_calls = [c for c in block_calls if c not in on_text] or block_calls
    top = [c for c in block_calls if "." not in c.path.rpartition(".")[0]]  # the model's own block lists first
    block_calls = top or block_calls
    if not block_calls:
        raise UserError(
            f"{source.class_name}: no repeated block (a ModuleList element with attention that returns a (B, S, C) "
            "token input of the same shape) ran in the tiny forward; write the plan by hand (docs/plans.md)"
        )
    return block_calls


@dataclass
class _Trace:
    """What the rules read from the traced forward: every call, the repeated blocks, and the sequence the first
    block receives; and what earlier rules decided for later ones (``packed``, ``root_split``, ``tables``)."""

    calls: dict[str, Call]  # module path -> its call ("" is forward() itself)
    first: Call  # the first block called
    blocks: list[str]  # every block's path
    list_path: str  # the ModuleList holding the first block
    last_end: float  # when the last block returned
    token_arg: str  # the first block's argument that carries the tokens (`_token_arg`)
    hidden: torch.Tensor  # that argument: (B, S, C)
    seq: int  # S
    text: Any  # the first block's encoder_hidden_states, if any
    text_len: int | None  # its token count when it is a (B, L, C) sequence
    joint: bool  # the blocks return the text (joint attention): it is split like the tokens
    counts: dict[int, str]  # a split length -> what it counts ("token", "text", "text + token")
    packed: bool = False  # split on entry: forward()'s own hidden_states holds the S tokens (`rule_where_formed`)
    root_split: set[str] = field(default_factory=set)  # forward() inputs split on entry (`rule_split_at_entry`)
    tables: dict[str, dict[int, tuple[int, torch.Tensor]]] = field(default_factory=dict)  # module -> outputs to split

    @property
    def root(self) -> Call:
        return self.calls[""]

    @classmethod
    def of(cls, calls: dict[str, Call], block_calls: list[Call]) -> _Trace:
        first = block_calls[0]
        token_arg = _token_arg(first)
        hidden = first.inputs[token_arg]
        seq = hidden.shape[1]
        counts = {seq: "token"}
        text = first.inputs.get("encoder_hidden_states")
        text_len = text.shape[1] if torch.is_tensor(text) and text.dim() == 3 else None
        joint = text_len is not None and any(
            torch.is_tensor(o) and o.dim() == 3 and o.shape[1] == text_len for o in first.outputs
        )
        if joint:
            counts |= {text_len: "text", seq + text_len: "text + token"}
        blocks = [c.path for c in block_calls]
        last_end = max(c.end for c in block_calls)
        list_path = first.path.rpartition(".")[0]
        return cls(calls, first, blocks, list_path, last_end, token_arg, hidden, seq, text, text_len, joint, counts)


def rule_sequence(out: Draft, seen: _Trace) -> None:
    """Rule 1, the sequence: the first repeated block's token argument holds S tokens on dim 1. The text is a split
    stream when the blocks return it (joint attention), else it stays whole on every rank (cross-attention only).
    Equal token and text counts would make a token dim ambiguous, so they get a note."""
    first, hidden, seq, text, text_len = seen.first, seen.hidden, seen.seq, seen.text, seen.text_len
    out.sequence = f"{first.path} receives {seen.token_arg} {_shape(hidden)}: S = {seq} tokens on dim 1."
    if text_len is not None:
        out.sequence += (
            f" Text encoder_hidden_states {_shape(text)}: the blocks return it (joint attention), so its "
            f"{text_len} tokens are split too." if seen.joint else
            f" Text encoder_hidden_states {_shape(text)} is cross-attention only (the blocks do not return it): "
            f"left whole on every rank."
        )  # fmt: skip
    if seq == text_len:  # one key of `counts` for both: the token and text dims could not be told apart
        out.notes.append(f"token and text counts coincide ({seq}, {text_len}): re-run with other input shapes")


def _whole_length(seen: _Trace) -> tuple[str, str, int] | None:
    """A module before the blocks that takes a sequence length as a number (an int or a 0-d tensor equal to a split
    count), as (path, argument, value): forward() read it from a whole input's shape."""
    for call in sorted(seen.calls.values(), key=lambda c: c.start):
        if not call.path or _is_inside(call.path, seen.blocks) or not 0 <= call.end < seen.first.start:
            continue
        for name, v in call.inputs.items():
            number = v.item() if torch.is_tensor(v) and v.dim() == 0 else v
            if isinstance(number, int) and not isinstance(number, bool) and number in seen.counts:
                return call.path, name, number
    return None


def rule_where_formed(out: Draft, seen: _Trace) -> None:
    """Rule 2, where the sequence is formed. Packed (split on entry) when forward()'s own ``hidden_states`` already
    holds the S tokens, unless forward() reads a sequence length from a whole input before the blocks (a module
    there takes the length as a number: Qwen-Image's RoPE takes ``max_txt_seq_len``): split on entry, each rank would
    build that from its local length, so the sequence is split at the first block instead, as when forward()
    patchifies it itself (Wan)."""
    root_hidden = seen.root.inputs.get("hidden_states")
    seen.packed = torch.is_tensor(root_hidden) and root_hidden.dim() == 3 and root_hidden.shape[1] == seen.seq
    if not seen.packed:
        shape = _shape(root_hidden) if torch.is_tensor(root_hidden) else "?"
        out.sequence += f" forward()'s hidden_states {shape} is patchified in forward(): split at {seen.first.path}."
        return
    whole = _whole_length(seen)
    if whole is None:
        out.sequence += " forward()'s hidden_states already holds the S tokens (packed): split on entry."
        return
    seen.packed = False
    path, name, n = whole
    out.sequence += (f" forward()'s hidden_states already holds the S tokens, but {path} takes {name} = {n}, a length "
                     f"read from a whole input: split at {seen.first.path}, not on entry.")  # fmt: skip


def rule_split_at_entry(out: Draft, seen: _Trace) -> None:
    """Rule 2, what is split where the sequence is formed. Packed: every forward() input with a token dim is split on
    entry. Formed in forward(): the first block's token argument (and joint text) is split there, and only forward()
    inputs with the token count (per-token timesteps) are split on entry, so all forward() derives from them is split
    too; text is split where the blocks take it. Leaves the names split on entry in ``seen.root_split``."""
    first, root, hidden, seq, text, counts = seen.first, seen.root, seen.hidden, seen.seq, seen.text, seen.counts
    packed = seen.packed
    if not packed:
        out.add(first.path, "split_inputs", seen.token_arg, 1, hidden.dim())
        out.why.append((f"{first.path} {seen.token_arg}", f"{_shape(hidden)} is where the {seq}-token sequence is "
                        "first formed; it flows split through every block to the output"))  # fmt: skip
        if seen.joint:
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
            seen.root_split.add(name)
            what = "per-token" if packed else "per-token (split at its source, so all it derives is split)"
            out.why.append((f'"" {name}', f"forward() input {_shape(t)}: dim {d} has the {counts[t.shape[d]]} "
                            f"count {t.shape[d]}, {what}"))  # fmt: skip


def rule_split_block_inputs(out: Draft, seen: _Trace) -> None:
    """Rule 3, per-token tensors the first block receives. A forward() input arrives split already (or gets a note if
    it was not). One a module before the blocks produced (RoPE cos/sin) is left in ``seen.tables`` for
    `rule_split_tables`, unless for a packed model re-running the module on split inputs already gives the split
    length. One forward() builds itself is split at ``<blocks>.*`` (each block splits its whole copy), unless
    forward() built it from inputs already split on entry; one built whole over the joint [tokens | text] sequence
    is a joint key mask (`_joint_key_mask`)."""
    first, counts, packed, root_split = seen.first, seen.counts, seen.packed, seen.root_split
    root_ids = {id(t): n for name, v in seen.root.inputs.items() for n, t in flatten_tensors(v, name)}
    produced: dict[int, tuple[Call, int]] = {}  # outputs of modules run before the first block, by tensor id
    for call in sorted(seen.calls.values(), key=lambda c: (len(c.path), c.start)):  # outermost module first
        if call.path and not _is_inside(call.path, seen.blocks) and 0 <= call.end < first.start:
            for i, o in enumerate(call.outputs):
                if torch.is_tensor(o):
                    produced.setdefault(id(o), (call, i))
    for name, value in first.inputs.items():
        if name == seen.token_arg or (seen.joint and name == "encoder_hidden_states"):
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
                seen.tables.setdefault(call.path, {})[index] = (d, t)
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
            if seen.joint and not packed and "mask" in name and t.shape[d] == seen.seq + seen.text_len:
                _joint_key_mask(out, seen, name, t)
                continue
            out.add(f"{seen.list_path}.*", "split_inputs", name, d, t.dim())
            out.why.append((f"{seen.list_path}.* {name}", f"{_shape(t)} is built in forward() and handed to every "
                            f"block with the whole {counts[t.shape[d]]} count on dim {d}: each block splits "
                            "its copy"))  # fmt: skip


def _joint_key_mask(out: Draft, seen: _Trace, name: str, t: torch.Tensor) -> None:
    """A mask forward() builds whole over the joint [tokens | text] sequence: split into contiguous chunks it would
    mask the wrong keys (each rank holds [tokens_r | text_r]); the plan declares its segments instead and the CP core
    puts its keys in the ranks' order. The segments' model order [tokens | text] is the processors' concatenation
    order; check_plan compares with the serial run, so a wrong order fails there."""
    first = seen.first.path
    out.joint_key_mask = [f"{first}:{seen.token_arg}", f"{first}:encoder_hidden_states"]
    out.why.append((f"joint_key_mask ({name})", f"{_shape(t)} is built in forward() over the whole "
                    f"{seen.seq} + {seen.text_len} tokens, [tokens | text] in model order: not split; CP reorders "
                    "its keys into the order the ranks hold them (train/cp/masks.py)"))  # fmt: skip


def rule_split_tables(out: Draft, seen: _Trace) -> None:
    """Rule 3, tables: the outputs `rule_split_block_inputs` traced to a module before the blocks (RoPE cos/sin) reach
    the first block with the whole count, so they are split like the tokens where they are made, one entry per
    module."""
    for path, outs in seen.tables.items():
        for index, (d, t) in sorted(outs.items()):
            out.add(path, "split_outputs", index, d, t.dim())
        idx = " / ".join(str(i) for i in sorted(outs))
        shapes = ", ".join(_shape(t) for _, t in outs.values())
        whole = ", ".join(sorted({f"{seen.counts[t.shape[d]]} count on dim {d}" for d, t in outs.values()}))
        why = f"{shapes} reach {seen.first.path} with the whole {whole}: split them like the tokens"
        if seen.packed:
            why += " (re-run on split inputs they keep every row: built from shapes, not from the split inputs)"
        out.why.append((f"{path} outputs {idx}", why))


def rule_gather_output(out: Draft, seen: _Trace) -> None:
    """Rule 4, the output: the last module after the blocks whose output holds the S tokens on dim 1 (``proj_out``) is
    gathered, so the loss sees the whole prediction. When forward() builds per-token tensors itself (a
    ``<blocks>.*`` entry) and transforms the sequence between the first module after the blocks and the last, the
    first is gathered instead, so that step runs on whole tensors, and the last one's input is split again, so
    backward sees only this rank's tokens (gradients stay a SUM)."""
    seq, blocks = seen.seq, seen.blocks
    tail = [c for c in seen.calls.values() if c.path and not _is_inside(c.path, blocks) and c.start > seen.last_end]
    tail = [c for c in tail if any(torch.is_tensor(o) and _token_dim(o, {seq: "token"}) == 1 for o in c.outputs)]
    if not tail:
        _gather_last_block(out, seen)
        return
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


def _gather_last_block(out: Draft, seen: _Trace) -> None:
    """No module after the blocks outputs the S tokens (forward() reshapes them before its output layer): gather the
    last block's token output (``<blocks>.-1``, any depth) and declare the replicated tail, so the output layers run
    on the whole sequence on every rank with their gradients scaled to stay a SUM (train/cp/enable.py)."""
    last = max((seen.calls[p] for p in seen.blocks), key=lambda c: c.end)
    dims = [_token_dim(o, {seen.seq: "token"}) if torch.is_tensor(o) else None for o in last.outputs]
    if dims.count(1) != 1:
        out.notes.append(f"no module after the blocks outputs the token sequence and {last.path} returns "
                         f"{len(dims)} outputs: add a gather by hand")  # fmt: skip
        return
    path = f"{last.path.rpartition('.')[0]}.-1"
    specs = [{"dim": 1, "expected_dims": o.dim()} if d == 1 else None for o, d in zip(last.outputs, dims)]
    out.plan.setdefault(path, {})["gather"] = specs[0] if len(specs) == 1 else specs
    out.replicated_tail = True
    out.why.append((f"{path} gather", f"{_shape(last.outputs[dims.index(1)])}: no module after the blocks outputs the "
                    f"{seen.seq} tokens (forward() reshapes them first): gather the last block's output; the "
                    "modules after it run on the whole sequence on every rank (replicated_tail)"))  # fmt: skip


def _onto_other_tokens(call: Call, seq: int, text_len: int | None) -> bool:
    """Cross-attention: its keys come from a (B, L, C) input that is not the S tokens (``encoder_hidden_states``
    of the text length, or a context under another name: Stable Audio 3's ``context``)."""
    kv = call.inputs.get("encoder_hidden_states")
    if torch.is_tensor(kv):
        return kv.shape[1] == text_len if text_len is not None else kv.shape[1] != seq
    tensors = [t for t in call.inputs.values() if torch.is_tensor(t) and t.dim() == 3]
    return len(tensors) >= 2 and tensors[0].shape[1] == seq and any(t.shape[1] != seq for t in tensors[1:])


def rule_local_attention(out: Draft, seen: _Trace) -> None:
    """Rule 5, which attention runs locally. Cross-attention onto whole text: a processor that still hands it its
    parallel config would all-to-all every rank's identical copy of the text through Ulysses, so such attention runs
    locally (exact: local queries, all keys). Attention before the blocks (a text refiner) runs on replicated tokens:
    local, at the model's child holding it; unless the model is packed and it attends over tokens split on entry
    (Flux3's per-mode blocks): those attend through CP like the blocks."""
    first, blocks, text_len = seen.first, seen.blocks, seen.text_len
    local = set()
    for call in seen.calls.values():
        if (_is_attention(call.module) and not seen.joint and _onto_other_tokens(call, seen.seq, text_len)
                and _is_inside(call.path, blocks) and _attends_with_cp(call)):  # fmt: skip
            block = next(b for b in blocks if call.path.startswith(b + "."))
            local.add(f"{seen.list_path}.*{call.path[len(block) :]}")
    for call in seen.calls.values():
        q = call.inputs.get("hidden_states")
        split_on_entry = seen.packed and torch.is_tensor(q) and q.dim() == 3 and q.shape[1] in seen.counts
        if (_is_attention(call.module) and call.path and not split_on_entry
                and not _is_inside(call.path, blocks) and call.end < first.start):  # fmt: skip
            local.add(call.path.split(".")[0])
    out.local_attention = sorted(local)
    for path in out.local_attention:
        out.why.append((f"local_attention {path}", "cross-attention onto the whole text, yet its processor passes "
                        "the parallel config to dispatch_attention_fn (seen by a spy): attend locally"))  # fmt: skip


def rule_layout_registry(out: Draft, seen: _Trace) -> None:
    """Rule 6, ``layout_registry: true`` only when every attention call attends over a split length, the sum of
    two, or the whole text: what the layout registry assumes. The first call that does not turns it off (every layer
    then exchanges sizes) and says which. Attention that `rule_local_attention` runs locally never asks the
    registry, so it does not count."""
    counts = seen.counts
    allowed = set(counts) | {a + b for a in counts for b in counts}
    whole = {seen.text_len} if seen.text_len is not None and not seen.joint else set()
    local = [re.compile(re.escape(p).replace(r"\*", r"\d+") + r"(\.|$)") for p in out.local_attention]
    for call in seen.calls.values():
        if _is_attention(call.module) and not any(m.match(call.path) for m in local):
            q = call.inputs.get("hidden_states")
            kv = call.inputs.get("encoder_hidden_states")
            lengths = [x.shape[1] for x in (q, kv) if torch.is_tensor(x) and x.dim() == 3]
            if any(n not in allowed | whole for n in lengths):
                out.layout_registry = False
                out.notes.append(f"{call.path} attends over {lengths} tokens, not built from the splits: "
                                 "layout_registry false (every layer exchanges sizes)")  # fmt: skip
                break


# The rules `draft` applies, in order.
RULES = (
    rule_sequence,
    rule_where_formed,
    rule_split_at_entry,
    rule_split_block_inputs,
    rule_split_tables,
    rule_gather_output,
    rule_local_attention,
    rule_layout_registry,
)


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
    parser = argparse.ArgumentParser(prog="python -m train.tools.draft_plan", description=__doc__,
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
    command = " ".join(["python -m train.tools.draft_plan", args.model, *extra])
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
