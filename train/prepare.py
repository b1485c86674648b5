"""Encode media + captions into the latent cache the trainer reads (format: `train.data.dataset`).

    python -m train.prepare --recipe recipes/wan/1.3b_lora.yaml [--set data.cache_dir=/data/cache/wan480]
    accelerate launch --num_processes 8 -m train.prepare --recipe ...     # items sharded across processes by rank

Reads `data.source` (a folder with metadata.jsonl / metadata.csv or per-file .txt/.json caption sidecars, a single
metadata file, or a `datasets` name/path), loads the family's VAE and text encoder(s) from `model.pretrained_path` the
way its diffusers pipeline does, and writes one safetensors file per good item, the empty caption's embeddings and a
manifest. What it does per item (rank r of W takes items r, r + W, ...):

    caption present? -> probe -> bucket -> decode + resize/crop (PyAV/PIL, `train.data.media`) -> VAE -> text encoder
    -> samples/<index:06d>.safetensors (temp file + rename, so a killed run never leaves a half-written sample)

Families with sound (MiniMax-H3) also decode the clip's audio track in the loader (`FamilyEncoder.load_extra`) and
encode it with their audio VAE (`encode_extra`); editing families (Qwen-Image-Edit, FLUX.1 Kontext) load the item's
reference image (`data.reference_column`) there and encode it as their pipeline does. With `data.mask_column`, each
item's loss mask (an image or a video of the media's size) is decoded and cropped like its media (`load_mask`), pooled
to the latents' resolution as the family's VAE compresses (`FamilyEncoder.loss_mask`) and stored as `loss_mask`; an
item without one gets all ones. With `train.preservation`, each item's preservation prompt (its caption with the
trigger replaced by the class word) is encoded as its caption is and stored under `preservation.` keys.

Bad items (unreadable/corrupt, too short, too small, no caption or one that is not text (`bad_caption`: a lone
surrogate such as JSON's "\\ud800"), no audio track, reference image or named conditioning
video where the family needs one (`no_condition` / `bad_condition`: `data.condition_columns`), an unreadable or
mismatched loss mask (`bad_mask`), NaN/Inf from the encoders) are skipped, counted and
listed in the manifest; the run fails if they are more than `data.max_bad_fraction` of the source. Resumable: items
whose sample file exists and is whole are not encoded again (their metadata is re-read; a missing, truncated or damaged
file is encoded again), and a resumed run must use the same settings (prepare_config.json). Ctrl-C, a full disk or
a read-only cache_dir end it with one line saying how many samples the cache keeps (exit 130, or 2). Files are
written `0o666 & ~umask` (train/files.py). The manifest records each
sample's size, which the trainer checks at startup. Latents are sampled from the VAE posterior with a generator
seeded by (train.seed, item index) (`data.latent_sample: sample`, the pipelines' own default) or taken as its mean
(`mode`), so a resumed or re-sharded run writes the same tensors as an uninterrupted one.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import errno
import functools
import json
import os
import signal
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from train.config import DataConfig, Recipe, add_recipe_args, check_prepare_inputs, recipe_from_args
from train.data.dataset import CACHE_FORMAT, CACHE_VERSION, LOSS_MASK, PRESERVATION, safetensors_problem, sample_path
from train.data.media import (
    IMAGE_EXTENSIONS,
    VIDEO_EXTENSIONS,
    BadMediaError,
    Bucket,
    MediaInfo,
    choose_bucket,
    load_clip,
    probe,
    to_model_input,
)
from train.errors import UserError, report
from train.files import match_umask, read_umask
from train.models import get_encoder

__all__ = [
    "PrepareError",
    "SourceItem",
    "check_geometry",
    "check_ready",
    "fingerprint",
    "item_seed",
    "list_source",
    "load_mask",
    "main",
    "prepare",
    "summary",
]

MEDIA_KEYS = ("file_name", "video", "image", "path", "file", "media")


class PrepareError(UserError):
    """The source or the settings cannot give a usable cache (too many bad items, no items, changed settings)."""


# ------------------------------------------------------------------------------------------------------------ settings
# prepare reads the recipe's own sections (data, model, train.seed, logging.progress_bar); the defaults that refer to
# other keys (buckets, cache/text-encoder dtypes) are resolved by DataConfig.resolved, in train/config.py.


def fingerprint(recipe: Recipe) -> dict[str, Any]:
    """The settings that change what is written (prepare_config.json): a resumed prepare must match them."""
    model, data = recipe.model, recipe.data.resolved(recipe.model)
    return {
        "family": model.family,
        "pretrained_path": model.pretrained_path,
        "revision": model.revision,
        "source": data.source,
        "split": data.split,
        "media_column": data.media_column,
        "caption_column": data.caption_column,
        "mask_column": data.mask_column,
        "buckets": data.buckets,
        "fps": data.fps,
        "max_text_tokens": data.max_text_tokens,
        "latent_sample": data.latent_sample,
        "seed": recipe.train.seed,
        "cache_dtype": data.cache_dtype,
        "text_encoder_dtype": data.text_encoder_dtype,
        "allow_upscale": data.allow_upscale,
        **_media_columns(recipe),
        **_preservation(recipe),
    }


def _preservation(recipe: Recipe) -> dict[str, Any]:
    """train.preservation's prompts (the trigger and class word that make them), when the recipe asks for them: a
    cache made without them keeps its settings (and so its resume) as they were."""
    pres = recipe.train.preservation
    return {"preservation": {"trigger": pres.trigger, "class_word": pres.class_word}} if pres is not None else {}


def preservation_caption(caption: str, recipe: Recipe) -> str:
    """The preservation prompt of a caption (train.preservation): every occurrence of the trigger replaced by the
    class word, as ai-toolkit builds its differential-output-preservation prompt; a caption without the trigger is its
    own."""
    pres = recipe.train.preservation
    return caption.replace(pres.trigger, pres.class_word)


def _media_columns(recipe: Recipe) -> dict[str, Any]:
    """The columns a family's conditioning media come from, where it reads any: another column is another cache.
    The reference column only when it is not the default, so caches prepared before it was recorded still resume."""
    encoder, data = get_encoder(recipe.model.family), recipe.data
    out: dict[str, Any] = {}
    if encoder.needs_reference and data.reference_column != "reference":
        out["reference_column"] = data.reference_column
    if encoder.condition_media:
        out["condition_columns"] = data.condition_columns_of(encoder.condition_media)
    return out


def check_ready(recipe: Recipe) -> None:
    """Raise PrepareError when a setting prepare needs is null, and ValueError when a bucket has a size the family's
    VAE/transformer cannot take: at startup, before anything is loaded."""
    required = {
        "data.cache_dir: set the folder to write the cache to": recipe.data.cache_dir,
        "data.source: set a media folder, metadata file or datasets name": recipe.data.source,
        "model.pretrained_path: set the pipeline folder/hub id holding the VAE and text encoders": (
            recipe.model.pretrained_path
        ),
    }
    problems = [why for why, value in required.items() if value is None]
    if problems:
        raise PrepareError("cannot prepare:\n  " + "\n  ".join(problems))
    family, named = recipe.model.family, get_encoder(recipe.model.family).condition_media
    references, most = recipe.data.reference_column, get_encoder(family).max_references
    if not isinstance(references, str) and len(references) > most:
        raise PrepareError(f"data.reference_column: {family} reads at most {most} reference image(s) per item, the "
                           f"recipe names {len(references)} columns {references}; name at most {most}")  # fmt: skip
    if unknown := sorted(set(recipe.data.condition_columns) - set(named)):
        raise PrepareError(f"data.condition_columns: {family} reads no {unknown}; its conditioning media: "
                           f"{list(named) or 'none'}")  # fmt: skip
    check_geometry(recipe)


def check_geometry(recipe: Recipe) -> None:
    """Raise ValueError at startup when a bucket has a size the family's VAE/transformer cannot take."""
    model, data = recipe.model, recipe.data.resolved(recipe.model)
    encoder = get_encoder(model.family)
    geometry = encoder.geometry(model.pretrained_path, model.revision)
    geometry.check([Bucket.parse(b) for b in data.buckets])
    encoder.text_tokens(data.max_text_tokens)  # ChronoEdit: a fixed text length


# -------------------------------------------------------------------------------------------------------------- source


@dataclass
class SourceItem:
    index: int
    media: Any
    """A path, or a {"path", "bytes"} cell of a `datasets` row."""
    caption: str | None
    name: str
    """How reports name the item: the file relative to the source folder, or `<dataset>[<split>][<row>]`."""
    reference: Any = None
    """The item's reference image (data.reference_column: a path, or a datasets cell), None when it has none."""
    mask: Any = None
    """The item's loss mask (data.mask_column: a path, or a datasets cell), None when it has none."""
    conditions: dict[str, Any] = field(default_factory=dict)
    """The item's conditioning media by name (the family's `condition_media`: a path, or a datasets cell), None for
    one it lacks."""


class _Listing:
    """Indexable items of a source (a datasets source fetches rows lazily)."""

    def __init__(self, n: int, get: Callable[[int], SourceItem]) -> None:
        self._n, self._get = n, get

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> SourceItem:
        return self._get(i)


def _references(row: Mapping[str, Any], column: str | Sequence[str], value: Callable[[Any], Any]) -> Any:
    """The item's reference (data.reference_column) as `value` makes it, or, for a list of columns, its references
    in column order (None where it lacks one)."""
    return value(row.get(column)) if isinstance(column, str) else [value(row.get(c)) for c in column]


def _pick_media_key(row_keys: Iterable[str], media_column: str | None, where: str) -> str:
    keys = list(row_keys)
    if media_column is not None:
        if media_column not in keys:
            raise PrepareError(f"{where}: no column {media_column!r} (data.media_column); columns: {keys}")
        return media_column
    for k in MEDIA_KEYS:
        if k in keys:
            return k
    raise PrepareError(f"{where}: no media column among {keys}; name it file_name, or set data.media_column")


def _caption(value: Any) -> str | None:
    return value if isinstance(value, str) and value.strip() else None


def _say_repeats(meta: Path, rows: list[dict[str, Any]]) -> None:
    """A row repeated exactly (same file, caption and every other field) becomes a sample trained twice as often:
    said once, naming the rows (a deliberate repeat is allowed)."""
    first: dict[str, int] = {}
    repeats = []
    for i, row in enumerate(rows):
        key = json.dumps(row, sort_keys=True, default=str)
        if key in first:
            repeats.append((first[key], i))
        else:
            first[key] = i
    if repeats and os.environ.get("RANK", "0") == "0":  # once per job
        pairs = ", ".join(f"row {b + 1} repeats row {a + 1}" for a, b in repeats[:3])
        more = f" (+{len(repeats) - 3} more)" if len(repeats) > 3 else ""
        print(f"warning: {meta}: {len(repeats)} repeated row(s), each a sample of its own (trained twice as often): "
              f"{pairs}{more}; delete them if they are not meant as repeats", file=sys.stderr, flush=True)  # fmt: skip


def _folder_listing(
    root: Path,
    meta: Path | None,
    caption_column: str,
    media_column: str | None,
    reference_column: str | Sequence[str] = "reference",
    mask_column: str | None = None,
    condition_columns: Mapping[str, str] | None = None,
) -> _Listing:
    items: list[SourceItem] = []
    condition_columns = condition_columns or {}
    if meta is not None:
        rows = _jsonl_rows(meta) if meta.suffix == ".jsonl" else _csv_rows(meta)
        if not rows:
            raise PrepareError(f"{meta}: no rows")
        key = _pick_media_key(rows[0].keys(), media_column, str(meta))
        if mask_column is not None and not any(mask_column in row for row in rows):  # a typo would mask nothing
            raise PrepareError(f"{meta}: no row has a {mask_column!r} key (data.mask_column); name each item's mask "
                               f"there, or set data.mask_column to one of {sorted(rows[0])}")  # fmt: skip
        _say_repeats(meta, rows)
        for i, row in enumerate(rows):
            rel, mask = str(row.get(key) or ""), row.get(mask_column or "")
            ref = _references(row, reference_column, lambda v: str(root / v) if isinstance(v, str) and v else None)
            mask = str(root / mask) if isinstance(mask, str) and mask else None
            conditions = {name: row.get(column) for name, column in condition_columns.items()}
            conditions = {name: str(root / v) if isinstance(v, str) and v else None for name, v in conditions.items()}
            caption, name = _caption(row.get(caption_column)), rel or f"row {i}"
            items.append(SourceItem(i, str(root / rel), caption, name, ref, mask, conditions))
    elif mask_column is not None:
        raise PrepareError(f"{root}: data.mask_column is set, but the folder has no metadata.jsonl/csv to name each "
                           "item's mask in: add one (file_name, text and the mask column), or set data.mask_column: "
                           "null")  # fmt: skip
    else:  # media files with caption sidecars: clip.mp4 + clip.txt (the caption) or clip.json ({caption_column: ...})
        files = sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS | VIDEO_EXTENSIONS)
        for i, p in enumerate(files):
            caption = None
            if p.with_suffix(".txt").is_file():
                caption = p.with_suffix(".txt").read_text()
            elif p.with_suffix(".json").is_file():
                caption = _json_object(p.with_suffix(".json"), p.with_suffix(".json").read_text()).get(caption_column)
            conditions = dict.fromkeys(condition_columns)  # no metadata names them: the item lacks them
            items.append(SourceItem(i, str(p), _caption(caption), str(p.relative_to(root)), conditions=conditions))
    return _Listing(len(items), items.__getitem__)


def _json_object(path: Path, text: str, line: int | None = None) -> dict[str, Any]:
    """`text` (line `line` of `path`, or all of it) as a JSON object, or a PrepareError naming the file and line."""
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        where = f"{path}:{line or e.lineno}"
        raise PrepareError(f"{where}: not valid JSON ({e.msg} at column {e.colno}): fix or delete that line") from None
    if not isinstance(row, dict):
        raise PrepareError(
            f'{path}:{line or 1}: a JSON {type(row).__name__}, not an object like {{"file_name": ..., "text": ...}}'
        )
    return row


def _utf8_error(meta: Path, e: UnicodeDecodeError) -> PrepareError:
    return PrepareError(f"{meta}: not UTF-8 (byte 0x{e.object[e.start]:02x} at offset {e.start}): save it as UTF-8 "
                        "(e.g. `iconv -f latin1 -t utf-8`)")  # fmt: skip


def _jsonl_rows(meta: Path) -> list[dict[str, Any]]:
    """The rows of a metadata.jsonl file (UTF-8, a BOM allowed; one JSON object a line; blank lines skipped)."""
    try:
        text = meta.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise _utf8_error(meta, e) from None
    return [_json_object(meta, line, n) for n, line in enumerate(text.splitlines(), 1) if line.strip()]


def _csv_rows(meta: Path) -> list[dict[str, Any]]:
    """The rows of a metadata.csv file (a header line, then one row a line); a row whose field count differs from the
    header's (an unquoted comma in a caption) is an error naming its line."""
    rows = []
    with open(meta, newline="", encoding="utf-8-sig") as f:  # a BOM (spreadsheet exports) is not part of the header
        reader = csv.DictReader(f)
        try:
            for row in reader:
                extra, missing = row.get(None, []), [k for k, v in row.items() if v is None]
                if extra or missing:  # DictReader puts extra fields under None and fills missing ones with None
                    header = len(reader.fieldnames)
                    n = header + len(extra) - len(missing)
                    raise PrepareError(
                        f"{meta}:{reader.line_num}: {n} field{'s' * (n != 1)} where the header has {header}: quote "
                        'fields that hold commas ("a, b") and give every row each column'
                    )
                rows.append(row)
        except csv.Error as e:
            raise PrepareError(f"{meta}:{reader.line_num}: malformed CSV ({e}): fix that row") from None
        except UnicodeDecodeError as e:
            raise _utf8_error(meta, e) from None
    return rows


def _datasets_listing(
    name: str,
    split: str,
    caption_column: str,
    media_column: str | None,
    reference_column: str | Sequence[str] = "reference",
    mask_column: str | None = None,
    condition_columns: Mapping[str, str] | None = None,
) -> _Listing:
    import datasets

    condition_columns = condition_columns or {}
    ds = datasets.load_dataset(name, split=split)
    media_features = [k for k, f in ds.features.items() if isinstance(f, (datasets.Image, datasets.Video))]
    key = media_column or (media_features[0] if media_features else None)
    key = _pick_media_key(ds.column_names, key, f"dataset {name} [{split}]")
    feature = ds.features[key]
    if isinstance(feature, (datasets.Image, datasets.Video)):
        # decode=False: rows carry {"path", "bytes"}; PyAV/PIL decode them (datasets' Video() needs torchcodec)
        ds = ds.cast_column(key, type(feature)(decode=False))
    for column in [reference_column] if isinstance(reference_column, str) else reference_column:
        if isinstance(ds.features.get(column), datasets.Image):
            ds = ds.cast_column(column, datasets.Image(decode=False))
    for column in (mask_column or "", *condition_columns.values()):
        if isinstance(ds.features.get(column), (datasets.Image, datasets.Video)):
            ds = ds.cast_column(column, type(ds.features[column])(decode=False))
    if caption_column not in ds.column_names:
        raise PrepareError(f"dataset {name} [{split}]: no caption column {caption_column!r}; columns {ds.column_names}")
    if mask_column is not None and mask_column not in ds.column_names:
        raise PrepareError(f"dataset {name} [{split}]: no mask column {mask_column!r} (data.mask_column); columns "
                           f"{ds.column_names}")  # fmt: skip

    def get(i: int) -> SourceItem:
        row = ds[i]
        ref = _references(row, reference_column, lambda v: v)  # None where a reference column is missing
        mask = row[mask_column] or None if mask_column is not None else None  # an empty cell: no mask
        conditions = {n: row.get(column) or None for n, column in condition_columns.items()}
        return SourceItem(i, row[key], _caption(row[caption_column]), f"{name}[{split}][{i}]", ref, mask, conditions)

    return _Listing(len(ds), get)


def list_source(
    source: str,
    caption_column: str = "text",
    media_column: str | None = None,
    split: str = "train",
    reference_column: str | Sequence[str] = "reference",
    mask_column: str | None = None,
    condition_columns: Mapping[str, str] | None = None,
) -> _Listing:
    """The items of `source`: a folder (metadata.jsonl, metadata.csv, or sidecar captions), a metadata file, or a
    `datasets` name/path (load_dataset). Index i is the item's position; sample files are named after it.
    `condition_columns`: the column of each conditioning medium the family reads, by name."""
    path = Path(source)
    columns = (caption_column, media_column, reference_column, mask_column, condition_columns)
    if path.is_file() and path.suffix in (".jsonl", ".csv"):
        return _folder_listing(path.parent, path, *columns)
    if path.is_dir():
        metas = [path / n for n in ("metadata.jsonl", "metadata.csv") if (path / n).is_file()]
        if metas or any(p.suffix.lower() in IMAGE_EXTENSIONS | VIDEO_EXTENSIONS for p in path.rglob("*")):
            return _folder_listing(path, metas[0] if metas else None, *columns)
    # a hub name or a parquet/arrow folder
    return _datasets_listing(source, split, *columns)


# ---------------------------------------------------------------------------------------------------------- processes


@dataclass
class _Procs:
    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    barrier: Callable[[], None] = lambda: None

    @classmethod
    def current(cls) -> _Procs:
        """accelerate's PartialState when launched on several processes (torchrun/accelerate launch), else one."""
        gpu = torch.cuda.is_available()
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            from accelerate import PartialState

            state = PartialState(cpu=not gpu)
            return cls(state.process_index, state.num_processes, state.device, state.wait_for_everyone)
        return cls(device=torch.device("cuda") if gpu else torch.device("cpu"))


# ------------------------------------------------------------------------------------------------------------- prepare


def item_seed(seed: int, index: int) -> int:
    """Seed of the generator that samples item `index`'s VAE posterior (data.latent_sample: sample)."""
    return (seed * 1_000_003 + index) % (2**63)


# Why a write into the cache failed, as the user's fix needs it: no room, or no permission to write there.
_NO_SPACE = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}
_READ_ONLY = {
    errno.EROFS: "a read-only filesystem",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
}


class _CacheWriteError(Exception):
    """Writing `path` in the cache failed for want of space or permission (prepare reports it with what is kept)."""

    def __init__(self, path: Path, error: OSError) -> None:
        super().__init__(f"{path}: {error}")
        self.path, self.error = path, error


@contextlib.contextmanager
def _writing(path: Path) -> Iterator[None]:
    """Writes to `path`: an OSError for want of space or permission becomes a _CacheWriteError."""
    try:
        yield
    except OSError as e:
        if e.errno in _NO_SPACE or e.errno in _READ_ONLY:
            raise _CacheWriteError(path, e) from e
        raise


def _atomic_write(path: Path, data: bytes) -> None:
    """`data` as `path`: a temp file renamed into place, so `path` is whole or absent (a full disk or a kill midway
    leaves no half-written file under its name; a failed write removes its temp file), readable as the umask says."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with _writing(path):
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            match_umask(tmp)  # as `open` would make it (train/files.py), before the name appears
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    # Serialised here and written by Python (not save_file): a full disk is then an OSError with its errno (save_file's
    # is a SafetensorError "os error 28"), and the file is not left 0600.
    from safetensors.torch import save

    _atomic_write(path, save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata))


def _complete_samples(cache: Path) -> int:
    """How many sample files in `cache` are whole (what a resumed run keeps)."""
    with contextlib.suppress(OSError):
        return sum(safetensors_problem(p) is None for p in (cache / "samples").glob("[0-9]*.safetensors"))
    return 0


def _samples(n: int, total: int | None) -> str:
    """ "3 of 8 samples are", "1 sample is" (what the cache holds, out of the source's items where known)."""
    if total is not None:
        return f"{n} of {total} samples are"
    return f"{n} sample{'s' * (n != 1)} {'is' if n == 1 else 'are'}"


def _kept(cache: Path, total: int | None) -> str:
    return f"{_samples(_complete_samples(cache), total)} complete in {cache} and kept"


def _write_failed(e: _CacheWriteError, cache: Path, total: int | None) -> PrepareError:
    """The one line for a write the cache's disk refused: what happened, what is kept, the fix."""
    kept = f"{_kept(cache, total)} (prepare resumes from them)"
    if e.error.errno in _NO_SPACE:
        what, fix = _NO_SPACE[e.error.errno], "free space on its disk (or choose another data.cache_dir)"
        return PrepareError(f"{what} writing {e.path}: {kept}; {fix}, then rerun the same command to continue")
    return _read_only(cache, _READ_ONLY[e.error.errno], e.path.parent, total)


def _read_only(cache: Path, why: str, folder: Path, total: int | None) -> PrepareError:
    what = "cannot write in it" if folder == cache else f"cannot write in {folder}"
    return PrepareError(f"data.cache_dir {cache} is read-only ({why}): {what}; {_kept(cache, total)}; make it writable "
                        f"(chmod u+w {folder}) or set data.cache_dir to a writable folder, then rerun the same "
                        "command")  # fmt: skip


def _check_writable(cache: Path, total: int) -> None:
    """Raise PrepareError, before anything is written or loaded, when the cache folder (or, where it does not exist
    yet, the nearest folder above it) cannot be written: a read-only filesystem, no permission, or no write bit at all
    (a folder someone made read-only: refused even for root, whom the bits do not stop)."""
    folder = next((p for p in (cache, *cache.absolute().parents) if p.exists()), None)
    if folder is None or not folder.is_dir():
        return  # mkdir's own error
    for path in (folder, cache / "samples"):
        if not path.is_dir():
            continue
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            why = "a read-only filesystem"
        elif not os.access(path, os.W_OK | os.X_OK):
            why = "permission denied"
        elif not path.stat().st_mode & 0o222:
            why = f"a non-writable folder, mode {path.stat().st_mode & 0o777:o}"
        else:
            continue
        raise _read_only(cache, why, path, total)


def _cast(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating tensors with a shape go to the cache dtype (scalars such as frame_rate stay float32), all to CPU."""
    return {k: (v.to(dtype) if v.is_floating_point() and v.dim() > 0 else v).detach().cpu() for k, v in tensors.items()}


def _prefetched(fn: Callable[[SourceItem], Any], items: Iterable[SourceItem], depth: int) -> Iterator[tuple]:
    """(item, fn(item)) in order, with up to `depth` items decoded ahead in threads (PyAV releases the GIL)."""
    with ThreadPoolExecutor(max_workers=depth) as pool:
        pending: deque = deque()
        it = iter(items)
        for item in it:
            pending.append((item, pool.submit(fn, item)))
            if len(pending) >= depth:
                break
        while pending:
            item, fut = pending.popleft()
            nxt = next(it, None)
            if nxt is not None:
                pending.append((nxt, pool.submit(fn, nxt)))
            yield item, fut.result()


def _check_fingerprint(cache: Path, recipe: Recipe) -> None:
    path = cache / "prepare_config.json"
    if path.is_file():
        old = json.loads(path.read_text())
        new = fingerprint(recipe)
        optional = ("reference_column", "condition_columns", "preservation")  # settings not every cache has
        keys = dict.fromkeys([*new, *(k for k in optional if k in old)])
        diff = {k: (old.get(k), new.get(k)) for k in keys if old.get(k) != new.get(k)}
        if diff:
            lines = [f"{k}: cache has {a!r}, now {b!r}" for k, (a, b) in diff.items()]
            raise PrepareError(
                f"{cache} holds a cache prepared with other settings (delete it or use another data.cache_dir):\n  "
                + "\n  ".join(lines)
            )


@dataclass
class _Run:
    """One prepare run: the recipe (its data section resolved), the cache it fills, this process, the encoder."""

    recipe: Recipe
    data: DataConfig
    cache: Path
    procs: _Procs
    encoder: Any = None
    text_tokens: int = 0

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.data.cache_dtype)


def prepare(recipe: Recipe, *, stop_after: int | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Fill the cache; returns the manifest (or, when stopped by `stop_after`, a partial summary without one).

    `stop_after=k` encodes at most k new items on each process and returns without writing the manifest, as an
    interrupted run would (tests and smoke runs); a later run without it resumes and finishes the cache.
    """
    t_start = time.perf_counter()
    check_ready(recipe)  # missing settings and impossible sizes fail before anything is loaded
    data = recipe.data.resolved(recipe.model)
    run = _Run(recipe, data, Path(data.cache_dir), _Procs.current())
    _PROGRESS.update(cache=run.cache, total=None)
    try:
        return _prepare(run, t_start, stop_after, log)
    except _CacheWriteError as e:  # a full disk, a read-only folder: one line saying what the cache keeps
        raise _write_failed(e, run.cache, _PROGRESS["total"]) from None


def _prepare(run: _Run, t_start: float, stop_after: int | None, log: Callable[[str], None]) -> dict[str, Any]:
    recipe, data = run.recipe, run.data
    listing = _open_cache(run)
    model = recipe.model
    run.encoder = get_encoder(model.family)
    run.encoder.load(
        model.pretrained_path,
        revision=model.revision,
        device=run.procs.device,
        text_dtype=getattr(torch, data.text_encoder_dtype),
    )
    run.text_tokens = run.encoder.text_tokens(data.max_text_tokens)
    load_seconds = time.perf_counter() - t_start
    with torch.inference_mode():
        records, new = _encode_items(run, listing, stop_after)
    seconds = time.perf_counter() - t_start
    if stop_after is not None:  # every process returns here, so none waits at a barrier for a stopped one
        return {"interrupted": True, "new": new, "records": records, "seconds": seconds, "rank": run.procs.rank}
    part = {"rank": run.procs.rank, "records": records, "seconds": seconds, "load_seconds": load_seconds, "new": new}
    return _finish(run, part, len(listing), log)


def _open_cache(run: _Run) -> _Listing:
    """The source's items, after checking a resumed cache's settings and (rank 0) recording ours."""
    data, cache = run.data, run.cache
    _check_fingerprint(cache, run.recipe)
    conditions = data.condition_columns_of(get_encoder(run.recipe.model.family).condition_media)
    listing = list_source(data.source, data.caption_column, data.media_column, data.split, data.reference_column,
                          data.mask_column, conditions)  # fmt: skip
    if len(listing) == 0:
        raise PrepareError(f"{data.source}: no items")
    _PROGRESS["total"] = len(listing)
    _check_writable(cache, len(listing))  # every rank: each writes its samples
    if run.procs.rank == 0:
        with _writing(cache / "samples"):
            (cache / "samples").mkdir(parents=True, exist_ok=True)
            for stale in (cache / "samples").glob(".*.tmp"):  # a killed run's partial writes (no rank writes yet)
                stale.unlink(missing_ok=True)
        _atomic_write(cache / "prepare_config.json", (json.dumps(fingerprint(run.recipe), indent=2) + "\n").encode())
        with _writing(cache / "manifest.json"):
            (cache / "manifest.json").unlink(missing_ok=True)  # the manifest marks a complete cache
    run.procs.barrier()
    return listing


def _load_item(run: _Run, buckets: list[Bucket], item: SourceItem) -> tuple[str, Any]:
    """("reuse", None) when the sample exists and is whole, ("bad", BadMediaError), or ("ok", (bucket, clip, fps,
    extra, mask))."""
    data = run.data
    if safetensors_problem(sample_path(run.cache, item.index)) is None:  # missing or damaged: encoded (again)
        return "reuse", None
    if item.caption is None:
        return "bad", BadMediaError("no_caption", f"{item.name}: caption ({data.caption_column}) missing")
    if bad_text := _not_unicode(item.caption):  # the tokenizer and the file's metadata would raise on it
        return "bad", BadMediaError("bad_caption", f"{item.name}: caption ({data.caption_column}) {bad_text}")
    if missing := [name for name, src in item.conditions.items() if src is None]:
        columns = data.condition_columns_of(missing)
        what = ", ".join(f"{n} (column {columns[n]!r}, data.condition_columns)" for n in missing)
        return "bad", BadMediaError("no_condition", f"{item.name}: no {what}")
    try:
        info = probe(item.media)
        bucket = choose_bucket(info, buckets, data.fps)
        clip = load_clip(item.media, bucket, data.fps, allow_upscale=data.allow_upscale, info=info)
        # e.g. the soundtrack, the reference image of an editing family
        extra = run.encoder.load_extra(item.media, info, bucket, data.fps or info.fps, item.reference,
                                       **item.conditions)  # fmt: skip
        mask = None
        if data.mask_column is not None:  # an item without a mask trains on all of it
            ones = torch.ones(bucket.frames, bucket.height, bucket.width)
            mask = ones if item.mask is None else load_mask(item.mask, info, bucket, data.fps, data.allow_upscale)
        return "ok", (bucket, clip, data.fps or info.fps, extra, mask)
    except BadMediaError as e:
        return "bad", e


def _not_unicode(text: str) -> str | None:
    """Why `text` is no valid Unicode text (a lone surrogate, e.g. JSON's "\\ud800" or a mis-decoded file name), or
    None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"holds a lone surrogate (U+{ord(text[e.start]):04X} at character {e.start}), which is not text: fix "
                "the caption (half of an emoji's escaped pair?)")  # fmt: skip
    return None


def load_mask(src: Any, media: MediaInfo, bucket: Bucket, fps: float | None, allow_upscale: bool) -> torch.Tensor:
    """An item's loss mask at its clip's pixel geometry: float32 (F, H, W) in [0, 1], the mask's first (red) channel /
    255 (kohya's sd-scripts and diffusion-pipe read that channel too), its frames sampled at `fps` and resized/cropped
    exactly as `load_clip` does the media's. An image mask holds for every frame; a video mask needs the media's frame
    count and rate (where both headers state them), and any mask the media's size (so the same crop aligns them).
    Raises BadMediaError `bad_mask` otherwise, or when the mask cannot be read."""
    try:
        info = probe(src)
        name = info.name
        problem = None
        if (info.width, info.height) != (media.width, media.height):
            size = f"{info.width}x{info.height} (WxH), its media {media.width}x{media.height}"
            problem = f"is {size}: give it the media's size"
        elif info.kind == "video" and media.kind == "image":
            problem = "is a video, its media an image: use an image mask"
        elif info.kind == "video" and info.num_frames and media.num_frames and info.num_frames != media.num_frames:
            problem = f"has {info.num_frames} frames, its media {media.num_frames}: give it one frame per media frame"
        elif info.kind == "video" and info.fps and media.fps and abs(info.fps - media.fps) > 1e-3 * media.fps:
            problem = f"runs at {info.fps:g} fps, its media at {media.fps:g}: give it the media's frame rate"
        if problem:
            raise BadMediaError("bad_mask", f"mask {name} {problem}")
        still = info.kind == "image"
        frames = load_clip(src, Bucket(1, bucket.height, bucket.width) if still else bucket, fps,
                           allow_upscale=allow_upscale, info=info)  # fmt: skip
    except BadMediaError as e:
        raise BadMediaError("bad_mask", e.detail if e.reason == "bad_mask" else f"mask: {e.detail}") from None
    mask = frames[:, 0].float() / 255.0  # (F or 1, H, W)
    return mask.expand(bucket.frames, -1, -1) if still else mask


def _encode_items(run: _Run, listing: _Listing, stop_after: int | None) -> tuple[list[dict[str, Any]], int]:
    """Encode this process's items (rank r of W takes r, r + W, ...); returns their records and how many are new."""
    family, procs = run.recipe.model.family, run.procs
    if procs.rank == 0 and safetensors_problem(run.cache / "empty_prompt.safetensors") is not None:
        empty = _cast(run.encoder.encode_text("", run.text_tokens), run.dtype)
        if bad := _non_finite(empty):
            raise PrepareError(
                f"the text encoder of {run.recipe.model.pretrained_path} gives NaN/Inf for the empty caption ({bad}): "
                "check its weights and data.text_encoder_dtype"
            )
        _atomic_save(empty, run.cache / "empty_prompt.safetensors", {"family": family, "caption": ""})
    buckets = [Bucket.parse(b) for b in run.data.buckets]
    my_indices = range(procs.rank, len(listing), procs.world)
    mine = (listing[i] for i in my_indices)  # lazily: a datasets row may carry the media bytes
    records: list[dict[str, Any]] = []
    new = 0
    bar = None
    if procs.rank == 0 and run.recipe.logging.progress_bar:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(my_indices), desc=f"prepare {family}", unit="item")
        _PROGRESS["bar"] = bar
    prefetch = max(1, run.data.num_workers)
    for item, (status, payload) in _prefetched(functools.partial(_load_item, run, buckets), mine, prefetch):
        if status == "reuse":
            records.append(_reused_record(run.cache, item, run.text_tokens))
        elif status == "bad":
            records.append(
                {"index": item.index, "source": item.name, "reason": payload.reason, "detail": payload.detail}
            )
        else:
            if stop_after is not None and new >= stop_after:
                break
            try:
                records.append(_encode_item(run, item, *payload))
                new += 1
            except BadMediaError as e:  # non_finite
                records.append({"index": item.index, "source": item.name, "reason": e.reason, "detail": e.detail})
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
        _PROGRESS["bar"] = None
    return records, new


def _encode_item(
    run: _Run, item: SourceItem, bucket: Bucket, clip: torch.Tensor, fps: float, extra: Any, mask: torch.Tensor | None
) -> dict:
    """VAE + text encoder for one loaded item (and its loss mask pooled to the latents), written to its sample file;
    returns its record."""
    encoder, sample = run.encoder, run.data.latent_sample
    gen = None
    if sample == "sample":
        gen = torch.Generator(run.procs.device).manual_seed(item_seed(run.recipe.train.seed, item.index))
    tensors = encoder.encode_item(to_model_input(clip), extra, gen, sample, fps)
    if mask is not None:  # data.mask_column: at the latents' resolution, as this family's VAE compresses
        tensors[LOSS_MASK] = encoder.loss_mask(mask, tensors["latents"].shape)
    tensors.update(encoder.encode_item_text(item.caption, run.text_tokens, extra))
    if run.recipe.train.preservation is not None:  # the preservation prompt's text, beside the caption's
        kept = encoder.encode_item_text(preservation_caption(item.caption, run.recipe), run.text_tokens, extra)
        tensors.update({PRESERVATION + k: v for k, v in kept.items()})
    tensors = _cast(tensors, run.dtype)  # checked after the cast: a value past the cache dtype's range becomes Inf
    if bad := _non_finite(tensors):  # such an item would make the loss NaN at every step that reads it
        raise BadMediaError("non_finite", f"{item.name}: the encoders gave NaN/Inf ({bad})")
    meta = {
        "family": run.recipe.model.family,
        "caption": item.caption,
        "source": item.name,
        "bucket": str(bucket),
        "index": str(item.index),
    }
    if layout := encoder.batch_layout(tensors):  # batches are cut per bucket and layout (dataset.batch_key)
        meta["layout"] = layout
    if run.recipe.train.preservation is not None:
        meta["preservation_caption"] = preservation_caption(item.caption, run.recipe)
    path = sample_path(run.cache, item.index)
    _atomic_save(tensors, path, meta)
    record = _ok_record(item, bucket, int(tensors["prompt_embeds"].shape[0]), path.stat().st_size, reused=False)
    record |= {"layout": meta["layout"]} if "layout" in meta else {}
    if LOSS_MASK in tensors:  # the trainer refuses a cache whose masks leave nothing to train (batches.check_masks)
        record["mask_mean"] = float(tensors[LOSS_MASK].float().mean())
    return record | {"at_limit": _at_limit(tensors.get("prompt_mask"), run.text_tokens)}


def _at_limit(mask: torch.Tensor | None, limit: int | None) -> bool:
    """Whether a caption's tokens (its text mask's true entries) fill the text length: a longer caption was cut
    there by the tokenizer (`truncation=True` in every pipeline), which no pipeline says."""
    return bool(mask is not None and limit and int(mask.sum()) >= limit)


def _non_finite(tensors: dict[str, torch.Tensor]) -> str:
    """Which floating tensors hold NaN/Inf, as "key: n of numel, ..." ("" when all are finite)."""
    bad = [k for k, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    return ", ".join(f"{k}: {int((~torch.isfinite(tensors[k])).sum())} of {tensors[k].numel()}" for k in bad)


def _finish(run: _Run, part: dict[str, Any], total: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Gather every process's records into the manifest (rank 0 writes it); fail when too many items are bad."""
    procs, cache = run.procs, run.cache
    parts = cache / ".prepare"
    with _writing(parts):
        parts.mkdir(exist_ok=True)
    _atomic_write(parts / f"rank{procs.rank}-of-{procs.world}.json", json.dumps(part).encode())
    procs.barrier()
    all_parts = [json.loads((parts / f"rank{r}-of-{procs.world}.json").read_text()) for r in range(procs.world)]
    manifest = _manifest(run.recipe, cache, all_parts, total, procs.world, run.text_tokens)
    if procs.rank == 0:
        _atomic_write(cache / "manifest.json", (json.dumps(manifest, indent=1) + "\n").encode())
        log(summary(manifest, cache))
    procs.barrier()
    counts, max_bad = manifest["counts"], run.data.max_bad_fraction
    if counts["bad"] > max_bad * counts["total"]:
        raise PrepareError(
            f"{counts['bad']} of {counts['total']} items are bad ({_reasons(counts['bad_by_reason'])}), more than "
            f"data.max_bad_fraction = {max_bad}; see 'bad' in {cache / 'manifest.json'}"
        )
    return manifest


def _ok_record(item: SourceItem, bucket: Bucket | str, text_len: int, size: int, reused: bool) -> dict[str, Any]:
    file = sample_path("", item.index).as_posix()
    return {"index": item.index, "file": file, "bucket": str(bucket), "caption": item.caption, "source": item.name,
            "text_len": text_len, "bytes": size, "reused": reused}  # fmt: skip


def _reused_record(cache: Path, item: SourceItem, text_tokens: int | None) -> dict[str, Any]:
    from safetensors import safe_open

    path = sample_path(cache, item.index)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
        text_len = f.get_slice("prompt_embeds").get_shape()[0]
        mask = f.get_tensor("prompt_mask") if "prompt_mask" in f.keys() else None
        loss_mask = f.get_tensor(LOSS_MASK) if LOSS_MASK in f.keys() else None
    if meta.get("source") != item.name:
        raise PrepareError(
            f"{sample_path(cache, item.index)} was written for {meta.get('source')!r} but item {item.index} is now "
            f"{item.name!r}: the source listing changed; prepare into a new data.cache_dir"
        )
    record = _ok_record(item, meta["bucket"], text_len, path.stat().st_size, reused=True)
    record |= {"layout": meta["layout"]} if "layout" in meta else {}
    if loss_mask is not None:
        record["mask_mean"] = float(loss_mask.float().mean())
    return record | {"caption": meta.get("caption", item.caption), "at_limit": _at_limit(mask, text_tokens)}


def _tensor_info(path: Path) -> dict[str, dict[str, Any]]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        out = {}
        for k in f.keys():
            s = f.get_slice(k)
            out[k] = {"shape": list(s.get_shape()), "dtype": s.get_dtype()}
        return out


def _manifest(
    recipe: Recipe, cache: Path, parts: Sequence[dict], total: int, world: int, text_tokens: int
) -> dict[str, Any]:
    records = sorted((r for p in parts for r in p["records"]), key=lambda r: r["index"])
    ok = [r for r in records if "reason" not in r]
    bad = [r for r in records if "reason" in r]
    buckets = Counter(r["bucket"] for r in ok)
    first_of = {}
    for r in ok:
        first_of.setdefault(r["bucket"], r["file"])
    empty_len = _tensor_info(cache / "empty_prompt.safetensors")["prompt_embeds"]["shape"][0]
    seconds = max(p["seconds"] for p in parts)
    encode_seconds = max(p["seconds"] - p["load_seconds"] for p in parts)
    new = sum(p["new"] for p in parts)
    return {
        "format": CACHE_FORMAT,
        "version": CACHE_VERSION,
        "family": recipe.model.family,
        "pretrained_path": recipe.model.pretrained_path,
        "settings": fingerprint(recipe),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "counts": {
            "total": total,
            "ok": len(ok),
            "bad": len(bad),
            "bad_by_reason": dict(sorted(Counter(r["reason"] for r in bad).items())),
            "new": new,
            "reused": len(ok) - new,
        },
        "buckets": dict(sorted(buckets.items())),
        "tensors": {b: _tensor_info(cache / f) for b, f in sorted(first_of.items())},
        "text": {
            "max_tokens": text_tokens,
            "longest": max([empty_len, *(r["text_len"] for r in ok)]),
            "at_limit": [r["source"] for r in ok if r.get("at_limit")],
        },  # fmt: skip
        "empty_prompt": "empty_prompt.safetensors",
        "samples": [
            {
                k: r[k]
                for k in ("index", "file", "bucket", "layout", "caption", "source", "text_len", "bytes", "mask_mean")
                if k in r
            }
            for r in ok
        ],
        "bad": bad,
        "timing": {
            "seconds": round(seconds, 3),
            "load_seconds": round(max(p["load_seconds"] for p in parts), 3),
            "per_rank_seconds": [round(p["seconds"], 3) for p in parts],
            "new_items_per_second": round(new / encode_seconds, 3) if new and encode_seconds > 0 else None,
            "processes": world,
        },
    }


def _reasons(by_reason: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in by_reason.items()) or "none"


def summary(manifest: dict[str, Any], cache: Path | str) -> str:
    """The human summary printed at the end of a prepare run."""
    c, t = manifest["counts"], manifest["timing"]
    buckets = ", ".join(f"{b}: {n}" for b, n in manifest["buckets"].items()) or "none"
    lines = [
        f"prepared {manifest['family']} cache at {cache}",
        f"  items    {c['total']} total, {c['ok']} ok ({c['new']} new, {c['reused']} reused), {c['bad']} bad "
        f"({_reasons(c['bad_by_reason'])})",
        f"  buckets  {buckets}",
        f"  time     {t['seconds']:.1f} s on {t['processes']} process(es) (loading {t['load_seconds']:.1f} s)"
        + (f", {t['new_items_per_second']:.2f} new items/s after loading" if t["new_items_per_second"] else ""),
    ]
    cut = manifest["text"].get("at_limit", [])
    if cut:
        lines.append(f"  text     {len(cut)} caption(s) reach the {manifest['text']['max_tokens']}-token limit, so "
                     f"longer ones were cut there (e.g. {', '.join(cut[:3])}): shorten them, or raise "
                     "data.max_text_tokens where the family's pipeline takes more")  # fmt: skip
    for r in manifest["bad"][:20]:
        lines.append(f"  bad      {r['reason']}: {r['detail']}")
    if len(manifest["bad"]) > 20:
        lines.append(f"  bad      ... {len(manifest['bad']) - 20} more in manifest.json")
    return "\n".join(lines)


# What the Ctrl-C line reports: the cache being filled (None before the recipe is read), how many items its source has
# (None before it is listed), the progress bar to end the line of.
_PROGRESS: dict[str, Any] = {"cache": None, "total": None, "bar": None}


def _interrupt_line() -> str:
    cache, total = _PROGRESS["cache"], _PROGRESS["total"]
    if cache is None:
        return "interrupted before anything was written; rerun the same command to prepare"
    held = _samples(_complete_samples(cache), total)
    return f"interrupted: {held} cached in {cache}; rerun the same command to continue"


def _on_interrupt(signum: int, frame: Any) -> None:
    """Ctrl-C: one line saying what the cache keeps, exit 128 + signal, no traceback. It leaves at once
    like train/errors.py `quiet_interrupt` (an exception raised here would land inside whatever torch or PyAV call
    runs); every file is written by rename (`_atomic_write`), so nothing half-written looks complete, and the next
    run removes the temp file this may leave."""
    signal.signal(signum, lambda *_: os._exit(128 + signum))  # a second Ctrl-C while counting: leave at once
    if os.environ.get("RANK", "0") == "0":  # once per job
        bar = "\n" if _PROGRESS["bar"] is not None else ""  # end the progress bar's line
        print(f"{bar}{_interrupt_line()}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(128 + signum)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m train.prepare",
        description="Encode data.source into the latent cache at data.cache_dir (see train/prepare.py).",
    )
    add_recipe_args(parser)
    parser.add_argument(
        "--stop-after",
        type=int,
        default=None,
        metavar="N",
        help="encode at most N new items per process, then stop without writing the manifest (a later run resumes)",
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    args = parser.parse_args(argv)
    read_umask()  # once, before the prefetch threads: the cache's files get the user's umask (train/files.py)
    _PROGRESS.update(cache=None, total=None, bar=None)
    handle = not args.debug and threading.current_thread() is threading.main_thread()  # --debug: the traceback
    before = signal.signal(signal.SIGINT, _on_interrupt) if handle else None
    try:
        recipe = recipe_from_args(args)
        check_prepare_inputs(recipe)
        prepare(recipe, stop_after=args.stop_after)
    except ValueError as e:  # PrepareError and other user errors, impossible sizes: one line, exit code 2
        if args.debug:
            raise
        raise SystemExit(report(e if isinstance(e, UserError) else UserError(str(e)))) from None
    finally:
        if handle:  # called in-process (tests): the caller's own Ctrl-C handling again
            signal.signal(signal.SIGINT, before)


if __name__ == "__main__":
    main()
