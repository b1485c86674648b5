"""Sharded checkpoints with exact resume: model + optimizer (torch.distributed.checkpoint), LR scheduler, data
position and RNG state, every N steps, keeping the last K. Nothing read back can run code, a damaged checkpoint is
detected before it is loaded, and a checkpoint is never written from non-finite weights.

Layout of `<output_dir>/checkpoints/step_000004/`, in the order it is written:

    __<r>_<i>.distcp          DCP shards of model + optimizer, written by rank r
    .metadata                 DCP's index (a pickle): read with an unpickler that allows only DCP's metadata classes
    rng_rank<r>.safetensors   rank r's torch RNG state
    trainer.json              step, scheduler, data position, recipe, layout (plain data; tuples come back as lists)
    manifest.json             every file above with its size and sha256
    COMPLETE                  written last: a run killed mid-save never resumes from a partial checkpoint

`save_checkpoint` writes one (synchronous DCP save: FACTS.md's async caveat does not arise); `restore` loads the
newest one that verifies, falling back to older ones with a warning; `load_checkpoint` loads a given one unverified.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from train.errors import UserError
from train.runtime import keep_alive

MANIFEST, COMPLETE, TRAINER_STATE = "manifest.json", "COMPLETE", "trainer.json"


class AppState(Stateful):
    """Model + optimizer through DCP's state-dict helpers (handles FSDP2 shards and frozen LoRA bases), and the EMA of
    the trained weights when the run keeps one (train/ema.py: its shards, saved and loaded in place)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainable_only: bool,
                 ema: Any = None) -> None:  # fmt: skip
        self.model, self.optimizer, self.ema = model, optimizer, ema
        # LoRA: only the adapters are saved; the frozen base comes from the pretrained weights again on resume.
        self.options = StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self.options)
        return {"model": model_sd, "optim": optim_sd, **({"ema": self.ema.state_dict()} if self.ema else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=self.options)  # fmt: skip
        if self.ema is not None:
            self.ema.load_state_dict(state["ema"])


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Checkpoints with a COMPLETE marker, oldest first (verified or not)."""
    return sorted(p.parent for p in checkpoint_root(output_dir).glob(f"step_*/{COMPLETE}"))


def _saved_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints with a manifest (the only ones rotation counts), oldest first."""
    return [p for p in complete_checkpoints(output_dir) if (p / MANIFEST).exists()]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    done = complete_checkpoints(output_dir)
    return done[-1] if done else None


# --- save -----------------------------------------------------------------------------------------------------------


class _RecordingWriter(FileSystemWriter):
    """DCP's file writer, remembering which files this rank wrote (so this rank hashes exactly those)."""

    written: list[str]  # set by write_data, which DCP calls once per save

    def write_data(self, plan, planner):
        try:
            fut = super().write_data(plan, planner)  # synchronous: the future is already done
            self.written = sorted({r.storage_data.relative_path for r in fut.wait()})
        except Exception as e:
            # A full disk surfaces as torch's serializer's RuntimeError ("unexpected pos") whose context is the
            # ENOSPC; DCP pickles the failure to every rank, which drops that context: raise the OS error itself.
            if (cause := os_error(e)) is not None and cause is not e:
                raise cause from None
            raise
        return fut


def _describe(file: Path) -> dict[str, Any]:
    """Size and sha256 of a file, streamed (sha256 measured ~1 GB/s here, twice blake2b: hardware SHA)."""
    keep_alive()
    digest = hashlib.sha256()
    with file.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return {"size": file.stat().st_size, "sha256": digest.hexdigest()}


def finite(t: torch.Tensor) -> torch.Tensor:
    """Whether every element of `t` (a DTensor: this rank's shard) is finite, as a 0-dim bool tensor on its device.
    One min/max pass (a NaN propagates to both, an inf is one of them): ~25x faster on CPU than `isfinite(t).all()`,
    which writes a bool per element (at startup on a 1.3B bf16 model that was seconds per rank)."""
    t = (t.to_local() if isinstance(t, DTensor) else t).detach()
    if t.numel() == 0 or not t.is_floating_point():
        return torch.ones((), dtype=torch.bool, device=t.device)
    lo, hi = torch.aminmax(t)
    return torch.isfinite(lo) & torch.isfinite(hi)


def parameters_finite(model: torch.nn.Module) -> bool:
    """Whether every parameter of the model (each rank's local shards) is finite, agreed by all ranks."""
    ok = torch.stack([finite(p) for p in model.parameters()]).all().to(dtype=torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # one collective; every rank gets the same answer
    return bool(ok.item())


class CheckpointFailed(UserError):
    """A checkpoint write that failed on some rank (disk full, quota, permissions), the same on every rank: `cause`
    (the first failing rank's OS error) and `latest`, the last complete checkpoint (None: there is none)."""

    def __init__(self, step: int, path: Path, cause: str, latest: Path | None) -> None:
        self.cause, self.latest = cause, latest
        super().__init__(f"checkpoint step {step}: writing {path} failed ({cause}); {kept(latest)}")


def kept(latest: Path | None) -> str:
    """Where a run that could not write stands, and what helps: `--resume` only when a checkpoint exists."""
    if latest is None:
        return ("no complete checkpoint exists, so the steps trained so far are lost: free space (or fix the "
                "folder), then start the run again")  # fmt: skip
    return f"the latest complete checkpoint is {latest}: free space (or fix the folder), then rerun with --resume"


def save_checkpoint(
    output_dir: str | Path, step: int, app: AppState, trainer_state: dict, keep_last: int | None
) -> Path | None:
    """Write checkpoint `step` (collective) and rotate to the last `keep_last` (None: the caller rotates, with
    `rotate_checkpoints`, once what it adds to the checkpoint is complete); return its path, or None (nothing
    written) when a model parameter is not finite. A write that fails on any rank (disk full, quota, permissions) is
    the same CheckpointFailed on every rank, naming the latest complete checkpoint; the partial folder is removed."""
    rank, root = dist.get_rank(), checkpoint_root(output_dir)
    if not parameters_finite(app.model):
        if rank == 0:
            latest = (_saved_checkpoints(output_dir) or ["none"])[-1]
            print(f"warning: step {step}: model parameters are not finite (NaN/Inf), checkpoint not written; the "
                  f"latest stays {latest}", file=sys.stderr, flush=True)  # fmt: skip
        return None
    path = root / f"step_{step:06d}"
    if rank == 0 and path.exists():  # a leftover (an earlier run, a killed save): no stale COMPLETE or shard survives
        shutil.rmtree(path)
    dist.barrier()
    failure = None
    try:
        writer = _RecordingWriter(path)
        dcp.save({"app": app}, storage_writer=writer)  # synchronous; rank 0 writes .metadata once all shards are done
        rng = f"rng_rank{rank}.safetensors"
        save_file({"torch": torch.get_rng_state()}, path / rng)
        mine = [*writer.written, rng]
        if rank == 0:
            (path / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=1))
            mine += [".metadata", TRAINER_STATE]
    except (OSError, CheckpointException) as e:
        failure = _write_failure(e)
    failure = _agreed(failure)  # every rank takes the same branch: no rank waits in a collective the others left
    if failure is None:
        # Each rank hashes the files it wrote itself: the hashing runs in parallel (total size / world per rank) and
        # reads data this host just wrote (page cache), where rank 0 alone would re-read every rank's shards serially.
        keep_alive()  # the checkpoint phase's deadline: the DCP save, then each file hashed (train/runtime.py)
        entries = {name: _describe(path / name) for name in mine}
        gathered = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(entries, gathered, dst=0)
        if rank == 0:
            try:
                files = {name: e for part in gathered for name, e in part.items()}
                manifest = {"step": step, "files": dict(sorted(files.items()))}
                (path / f"{MANIFEST}.tmp").write_text(json.dumps(manifest, indent=1))
                (path / f"{MANIFEST}.tmp").rename(path / MANIFEST)
                (path / COMPLETE).touch()
            except OSError as e:
                failure = _write_failure(e)
            else:
                if keep_last is not None:
                    rotate_checkpoints(output_dir, keep_last, path)
        failure = _agreed(failure)  # also the barrier that ends the save
    if failure is not None:
        if rank == 0:  # nothing half-written stays: the previous checkpoints are untouched
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
        raise CheckpointFailed(step, path, failure, (_saved_checkpoints(output_dir) or [None])[-1])
    return path


def rotate_checkpoints(output_dir: str | Path, keep_last: int, newest: Path) -> None:
    """Rank 0: delete all but the last `keep_last` checkpoints up to `newest`. Counts only checkpoints with a manifest
    and COMPLETE (`newest` is one, just hashed from disk): a damaged or foreign folder never deletes the last good one.
    Callers rotate only once `newest` is whole, its export included (finetune.save_state)."""
    saved = [p for p in _saved_checkpoints(output_dir) if p <= newest]
    for old in saved[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def os_error(e: BaseException) -> OSError | None:
    """The OSError behind `e` (itself, or in its cause/context chain), else None. A full disk surfaces as torch's
    serializer's RuntimeError ("unexpected pos") whose context is the ENOSPC."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _write_failure(e: BaseException) -> str:
    """One line for a failed checkpoint write, naming the rank that failed: the OSError (disk full, quota,
    permissions) behind the first failure DCP gathered from every rank that has one; a failure without an OSError on
    any rank (a bug, not the disk) is raised as it is."""
    failures = {r: f[0] for r, f in e.failures.items()} if isinstance(e, CheckpointException) else {dist.get_rank(): e}
    found = [(r, err) for r, f in sorted(failures.items()) if (err := os_error(f)) is not None]
    if not found:
        raise e
    rank, first = found[0]
    return f"rank {rank}: {first.strerror or first}" + (f": {first.filename}" if first.filename else "")


def _agreed(failure: str | None) -> str | None:
    """The first failing rank's line, on every rank (one small collective)."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, failure)
    return next((f for f in every if f is not None), None)


# --- safe reading ---------------------------------------------------------------------------------------------------

_DCP = "torch.distributed.checkpoint"
_METADATA_CLASSES = {
    *((f"{_DCP}.metadata", name) for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
      "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # "torch.strided" → the layout
    ("collections", "OrderedDict"),
    *((module, cls) for module in ("pathlib", "pathlib._local") for cls in ("PosixPath", "WindowsPath")),
}  # fmt: skip


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` is a pickle, which DCP reads with `pickle.load` (any callable it names runs). This one
    resolves only the classes DCP metadata is made of (and torch dtypes); anything else is refused before it runs."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refused to unpickle {module}.{name}")


def read_dcp_metadata(path: Path) -> Metadata:
    """A checkpoint's DCP `.metadata` (path: the file), read without running code; UserError when refused."""
    try:
        with path.open("rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise UserError(f"{path}: missing: the checkpoint is incomplete; delete {path.parent}") from None
    except Exception as e:  # a crafted or damaged pickle: refused globals, bad opcodes, truncation
        raise UserError(f"{path}: not DCP metadata ({type(e).__name__}: {e}); the file is damaged or crafted: "
                        f"delete {path.parent}") from None  # fmt: skip
    if not isinstance(metadata, Metadata):
        raise UserError(f"{path}: holds a {type(metadata).__name__}, not DCP metadata: delete {path.parent}")
    return metadata


class _SafeReader(FileSystemReader):
    """DCP's file reader with `.metadata` read by `read_dcp_metadata`. Its tensor data path is already safe: each
    tensor item of a `.distcp` file is read with `torch.load(..., weights_only=True)`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner unpickles the non-tensor items of a `.distcp` file (optimizer hyperparameters) with
    `torch.load(..., weights_only=False)`; this one uses `weights_only=True` (plain data and tensors only)."""

    def load_bytes(self, read_item, value) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            found = re.search(r"GLOBAL (\S+)", str(e))
            raise UserError(f"checkpoint item {fqn}: refused to unpickle {found[1] if found else 'it'}") from None
        if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes does, from the safely loaded object
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def read_trainer_state(path: Path) -> dict:
    """The trainer state (`trainer.json`) of checkpoint directory `path`."""
    file = path / TRAINER_STATE
    if not file.exists():
        old = " (an older format: its trainer.pt is never unpickled)" if (path / "trainer.pt").exists() else ""
        raise UserError(f"{path}: no {TRAINER_STATE}{old}; delete the checkpoint to resume from an older one, or "
                        "start without resuming")  # fmt: skip
    try:
        return json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{file}: not JSON ({e}); the file is damaged or crafted: delete {path}") from None


def load_rng(path: Path, rank: int) -> bool:
    """Set this process's torch RNG from rank `rank`'s file in checkpoint `path`; False when there is none (resuming
    on more ranks than saved: the RNG then restarts from the seed)."""
    file = path / f"rng_rank{rank}.safetensors"
    if not file.exists():
        return False
    try:
        state = load_file(file)["torch"]
    except (SafetensorError, KeyError) as e:
        raise UserError(f"{file}: not an RNG state ({type(e).__name__}: {e}); delete {path}") from None
    torch.set_rng_state(state)
    return True


def load_checkpoint(path: Path, app: AppState) -> dict:
    """Restore model/optimizer in place and this rank's RNG from checkpoint `path` (collective; not verified against
    its manifest: `restore` does that); return the trainer state (step, scheduler, data, recipe, layout)."""
    state = read_trainer_state(path)  # checked before anything is modified
    read_dcp_metadata(path / ".metadata")  # a refusal as a one-line error here, not inside DCP's collectives
    try:
        dcp.load({"app": app}, storage_reader=_SafeReader(path), planner=_SafeLoadPlanner())
    except CheckpointException as e:  # DCP gathers every rank's failure; each rank raises the same first refusal
        refused = [exc for exc, _ in e.failures.values() if isinstance(exc, (UserError, pickle.UnpicklingError))]
        if not refused:
            raise
        first = refused[0]  # a UserError from _SafeLoadPlanner, or torch.load(weights_only=True) on a tensor item
        cause = first if isinstance(first, UserError) else "a tensor item failed torch.load(weights_only=True)"
        raise UserError(f"{path}: {cause}; the checkpoint is damaged or crafted: delete it") from e
    load_rng(path, dist.get_rank())
    return state


# --- verify and restore ---------------------------------------------------------------------------------------------


def _read_manifest(path: Path) -> tuple[dict | None, str | None]:
    """(files, None) or (None, problem): the manifest's file table, checked for shape and coverage."""
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
        well_formed = isinstance(files, dict) and all(
            isinstance(e["size"], int) and isinstance(e["sha256"], str) and "/" not in n and n not in (".", "..")
            for n, e in files.items()
        )
    except FileNotFoundError:
        return None, f"no {MANIFEST}"
    except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None, f"{MANIFEST} unreadable ({type(e).__name__}: {e})".replace("\n", " ")
    if not well_formed:
        return None, f"{MANIFEST} is not a table of file sizes and checksums"
    missing = {".metadata", TRAINER_STATE} - files.keys()
    if missing:
        return None, f"{MANIFEST} does not list {', '.join(sorted(missing))}"
    return files, None


def _my_share(files: dict[str, dict], rank: int, world: int) -> list[str]:
    """The files this rank verifies: largest first to the least-loaded rank (the same split on every rank)."""
    load, mine = [0] * world, []
    for name in sorted(files, key=lambda n: (-files[n]["size"], n)):
        r = min(range(world), key=lambda i: (load[i], i))
        load[r] += files[name]["size"] + 1
        if r == rank:
            mine.append(name)
    return mine


def _file_problem(path: Path, name: str, entry: dict) -> str | None:
    file = path / name
    if not file.exists():
        return f"{name} missing"
    size = file.stat().st_size
    if size != entry["size"]:
        return f"{name} is {size} bytes, the manifest says {entry['size']}"
    if _describe(file)["sha256"] != entry["sha256"]:
        return f"{name} sha256 differs from the manifest"
    return None


def _coverage_problem(path: Path, files: dict) -> str | None:
    """Every shard file DCP will read is in the (verified) manifest; `.metadata` itself is safe to read."""
    try:
        metadata = read_dcp_metadata(path / ".metadata")
    except UserError as e:
        return str(e)
    unlisted = {info.relative_path for info in metadata.storage_data.values()} - files.keys()
    return f"{MANIFEST} does not list {', '.join(sorted(unlisted))}" if unlisted else None


def verify_checkpoint(path: Path) -> str | None:
    """None when checkpoint `path` matches its manifest, else the problem (one line). Collective: the ranks split
    the hashing and gather the results, so every rank returns the same answer."""
    rank, world = dist.get_rank(), dist.get_world_size()
    box = [_read_manifest(path) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    files, problem = box[0]
    if problem:
        return problem
    mine = [p for name in _my_share(files, rank, world) if (p := _file_problem(path, name, files[name]))]
    problems = [None] * world
    dist.all_gather_object(problems, mine)
    problems = sorted(p for part in problems for p in part)
    if problems:
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        return "; ".join(problems[:3]) + more
    box = [_coverage_problem(path, files) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def restore(output_dir: str | Path, app: AppState) -> tuple[Path, dict] | None:
    """Load the newest complete checkpoint of `output_dir` that verifies against its manifest (model, optimizer and
    RNG in place) and return (its path, its trainer state); None when there is no complete checkpoint. A damaged one
    is skipped with a one-line warning; UserError when none verifies. Collective: all ranks load the same one."""
    rank = dist.get_rank()
    box = [complete_checkpoints(output_dir)[::-1] if rank == 0 else None]  # rank 0's listing, newest first
    dist.broadcast_object_list(box, src=0)
    problems = {}
    for path in box[0]:
        t0 = time.perf_counter()
        problem = verify_checkpoint(path)
        if problem is None:
            return path, load_checkpoint(path, app)
        problems[path.name] = problem
        if rank == 0:
            print(f"warning: checkpoint {path} is damaged ({problem}; found in {time.perf_counter() - t0:.2f} s), "
                  "falling back to an older one", file=sys.stderr, flush=True)  # fmt: skip
    if not problems:
        return None
    listed = "; ".join(f"{name}: {p}" for name, p in problems.items())
    raise UserError(f"no checkpoint in {checkpoint_root(output_dir)} verifies ({listed}); delete them (or move them "
                    "away) and start without resuming")  # fmt: skip
