"""Full weights in the model's original checkpoint layout: one safetensors file with the authors' parameter names, as
ComfyUI and the authors' code load it, and as diffusers' `from_single_file` converts it back
(`checkpoint.export_format: original | both` of a full fine-tune).

The names are the family's data (`LoraFormat.full`, train/lora_format.py): the LoRA renames of the modules, plus the
parameters only a full checkpoint has (norms, modulation tables, embedders). A diffusers tensor that is one part of
a fused original tensor (Z-Image's `to_q`/`to_k`/`to_v` in one `qkv`) is that tensor's rows `part` of `parts`, in the
original's concatenation order.

Streamed like the diffusers folder (train/export.py): the file's header (names, dtypes, shapes, byte offsets) is
planned from shapes alone, identically on every rank; then every rank walks the state dict in order and gathers one
tensor at a time, and rank 0 writes its bytes at their offset in the file (a fused part into its rows of the fused
tensor). Rank 0's peak: one tensor. The format (an 8-byte header length, the JSON header, the raw row-major bytes) is
safetensors' own; its reader, and `from_single_file`, are the proof (tests/test_lora_format.py).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
import torch.distributed as dist

from train.errors import UserError
from train.export import _entries, _Publish, gathered
from train.lora_format import LoraFormat

ORIGINAL_FULL_FILE = "model.safetensors"  # in <name>_original/: one file, as ComfyUI users copy it
_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64", torch.int32: "I32",
           torch.uint8: "U8", torch.bool: "BOOL"}  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """The file's header, and where each diffusers tensor's bytes go: key -> [(file offset, chunk)] (the tensor in
    len(chunks) equal row chunks, chunk i at its offset)."""

    header: bytes
    places: dict[str, list[int]]
    size: int


def plan(fmt: LoraFormat, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], metadata: dict[str, str]) -> Plan:
    """The original file's layout for diffusers tensors of these shapes and dtypes (in state-dict order)."""
    groups: dict[str, dict[int, tuple[str, object]]] = {}
    for key in shapes:
        original, rename = fmt.original_param(key)
        parts = groups.setdefault(original, {})
        assert rename.part not in parts, (key, original)  # two diffusers tensors in one place: a wrong rename
        parts[rename.part] = (key, rename)
    tensors, places, offset = {}, {}, 0
    for original, parts in groups.items():
        first = parts[min(parts)][1]
        if sorted(parts) != list(range(first.parts)):
            raise UserError(f"checkpoint.export_format: the {fmt.name} tensor {original} fuses {first.parts} "
                            f"tensors, this model has {len(parts)}; set export_format: diffusers")  # fmt: skip
        (key0, _), dtype = parts[0], shapes[parts[0][0]][1]
        rest, rows, start = tuple(shapes[key0][0][1:]), 0, offset
        for part in range(first.parts):
            key, rename = parts[part]
            shape, part_dtype = shapes[key]
            assert tuple(shape[1:]) == rest and part_dtype == dtype, (key, original)
            nbytes = dtype.itemsize * torch.Size(shape).numel()
            order = rename.rows or (0,)
            chunk = nbytes // len(order)
            places[key] = [offset + order.index(c) * chunk for c in range(len(order))]
            offset, rows = offset + nbytes, rows + (shape[0] if shape else 1)
        shape = [rows, *rest] if shapes[key0][0] else []
        tensors[original] = {"dtype": _DTYPES[dtype], "shape": shape, "data_offsets": [start, offset]}
    head = json.dumps({"__metadata__": metadata, **tensors}, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data 8-byte aligned, as safetensors writes it
    header = struct.pack("<Q", len(head)) + head
    return Plan(header, {k: [len(header) + o for o in v] for k, v in places.items()}, len(header) + offset)


def _open(path: Path, header: bytes, box: list[BinaryIO]) -> None:
    box.append(path.open("wb"))
    box[0].write(header)


def _put(out: list[BinaryIO], value: torch.Tensor, places: list[int]) -> None:
    data = value.contiguous().reshape(-1).view(torch.uint8).numpy()
    step = len(data) // len(places)
    for i, at in enumerate(places):
        out[0].seek(at)
        out[0].write(memoryview(data[i * step : (i + 1) * step]))


def _close(out: list[BinaryIO], size: int) -> None:
    out[0].truncate(size)
    out[0].close()


@torch.no_grad()
def export_original_full(model: torch.nn.Module, fmt: LoraFormat, out_dir: Path, name: str = "transformer") -> Path:
    """Write `<out_dir>/<name>_original/model.safetensors`, one gathered tensor at a time. Collective."""
    state = model.state_dict()
    entries = _entries(model, state)
    shapes = {e.key: (tuple(state[e.source].shape), state[e.source].dtype) for e in entries}
    layout = plan(fmt, shapes, {"format": "pt", "ctxtrain_format": fmt.name, **fmt.metadata})
    publish, out = _Publish(out_dir, f"{name}_original"), []
    publish.write(_open, publish.staging / ORIGINAL_FULL_FILE, layout.header, out)
    for e, value in gathered(model, state, entries):
        if dist.get_rank() == 0:
            publish.write(_put, out, value, layout.places[e.key])
    publish.write(_close, out, layout.size)
    if out and not out[0].closed:  # a failed write: close before the staging folder is removed
        out[0].close()
    return publish.finish()
