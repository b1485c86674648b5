"""The latent cache on disk, the training dataset that reads it, bucketed batch sampling and collation.

Cache layout (written by `python -m train.prepare`, one folder per dataset x family x size):

    <cache_dir>/manifest.json              what is in the cache (below); written last, so its presence = complete
    <cache_dir>/prepare_config.json        the settings the cache was made with (a resumed prepare must match them)
    <cache_dir>/empty_prompt.safetensors   the empty caption's text tensors, for caption dropout
    <cache_dir>/samples/<index:06d>.safetensors   one per good item; index = the item's position in the source

Each sample file holds tensors (per sample, no batch dim; floating tensors in the cache dtype):

    latents         (C, F, H, W) video families, (C, H, W) image families (Qwen-Image: (C, 1, H, W)), normalised
                    exactly as the family's pipeline normalises VAE latents
    prompt_embeds   (L, D) text encoder states as the pipeline's encode_prompt returns them
    prompt_mask     (L,) bool, True = real token (kept for every family, even those whose pipeline passes no mask)
    pooled_embeds   (D2,) when the family has one (Flux: CLIP pooled)
    family extras   ChronoEdit: condition_latents (C, F, H, W), image_embeds (N, D3); LTX: frame_rate () float32
    loss_mask       (1, ...) float in [0, 1], the latents' shape with one channel, in every sample of a cache prepared
                    with data.mask_column (none otherwise): the item's mask pooled to latent resolution
                    (`FamilyEncoder.loss_mask`), multiplying the squared error of the latents in the loss
                    (train/objective.py); a training-only key that no family's forward reads
    preservation.*  with train.preservation: the preservation prompt's text tensors (each of the caption's text keys
                    under the `PRESERVATION` prefix, e.g. preservation.prompt_embeds), which train/step.py swaps in for
                    its preservation forwards; its caption is the metadata's preservation_caption

A mixture whose datasets set data.datasets[].loss_weight adds `loss_weight` (B,) to each batch (`SAMPLE_WEIGHT`).

and string metadata: caption, source (file path or dataset row), bucket ("FxHxW", the pixel clip shape), family,
index, and layout where the family's encoder records one (`batch_key`). `manifest.json` has: format, version, family,
pretrained_path, settings, counts (total/ok/bad, bad by reason), buckets (bucket -> count), tensors (name ->
shape/dtype per bucket), text (max_tokens, longest), samples (index, file, bucket, layout, caption, source, text_len,
bytes), bad (index, source, reason, detail), timing. See `train.prepare`.

Checked when a `CachedLatentDataset` opens (seconds for thousands of files, nothing but sizes and headers read): the
folder and its manifest exist and list samples, every sample file is present and of the size the manifest declares (a
cache written before sizes were recorded: of the size its own safetensors header implies), and, given the recipe's
family, that the cache was prepared for it and holds the keys and latent ranks its spec reads. Each item is checked
for NaN/Inf when it is loaded. A problem is one `UserError` line naming the cache (and file) and the fix.

Sampling contract (`BucketBatchSampler`): every batch comes from one bucket and layout (same shapes: it stacks); the
batch sequence depends only on (seed, epoch, dp_rank, dp_size), so all ranks of a context-parallel group (same
dp_rank) get the same batches and different data-parallel groups get disjoint ones; it runs forever over epochs, and
`state_dict()` records the exact position so a resumed run continues with the very next batch. Several caches
(`MixedDataset`, data.datasets) are one index space whose epoch holds each cache's samples its repeats times or its
weighted share (`Share`, carried over epochs so that a small weight is honoured over the run); a batch size per
bucket (train.batch_tokens) cuts each bucket with its own size.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError
from .synthetic_latents import SyntheticLatentDataset

__all__ = [
    "CACHE_FORMAT",
    "CACHE_VERSION",
    "LOSS_MASK",
    "PRESERVATION",
    "SAMPLE_WEIGHT",
    "BucketBatchSampler",
    "CachedLatentDataset",
    "MixedDataset",
    "Share",
    "SyntheticLatentDataset",
    "collate",
    "pad_text",
    "read_manifest",
    "safetensors_problem",
    "sample_path",
]

CACHE_FORMAT = "ctxtrain-latent-cache"
CACHE_VERSION = 1
TEXT_KEYS = ("prompt_embeds", "prompt_mask")
LOSS_MASK = "loss_mask"  # the optional per-sample loss mask (module doc); train/step.py applies it
# train.preservation: the preservation prompt's text tensors, each text key under this prefix (train.prepare)
PRESERVATION = "preservation."
SAMPLE_WEIGHT = "loss_weight"  # (B,) data.datasets[].loss_weight of each sample, in a mixture's batches that set one


def sample_path(cache_dir: str | Path, index: int) -> Path:
    return Path(cache_dir) / "samples" / f"{index:06d}.safetensors"


def _prepare_fix(cache_dir: str | Path) -> str:
    return f"run `python -m train.prepare --recipe <recipe>` with data.cache_dir={cache_dir}"


class CacheMissingError(UserError, FileNotFoundError):
    """No usable cache at data.cache_dir (a UserError that callers catching FileNotFoundError also see)."""


def read_manifest(cache_dir: str | Path) -> dict[str, Any]:
    folder = Path(cache_dir)
    path = folder / "manifest.json"
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise CacheMissingError(
            f"data.cache_dir {cache_dir} {what}: {_prepare_fix(cache_dir)} to create the cache, or fix the path"
        )
    if not path.is_file():
        if (folder / "samples").is_dir():
            why = f"{path.name} is missing: a prepare was started there but did not finish; {_prepare_fix(cache_dir)}"
            raise CacheMissingError(f"no cache at {cache_dir}: {why} again to resume and finish it")
        what = "is empty" if not any(folder.iterdir()) else f"holds no {path.name}, so it is not a prepared cache"
        raise CacheMissingError(
            f"no cache at {cache_dir}: the folder {what}; {_prepare_fix(cache_dir)}, or point data.cache_dir at a "
            "prepared cache"
        )
    try:
        manifest = json.loads(path.read_text())
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise UserError(
            f"{path}: not valid JSON ({e}); the cache is damaged: {_prepare_fix(cache_dir)} again"
        ) from None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != CACHE_FORMAT
        or manifest.get("version") != CACHE_VERSION
    ):
        found = manifest if isinstance(manifest, dict) else {}
        raise UserError(
            f"{path}: not a {CACHE_FORMAT} v{CACHE_VERSION} manifest (format {found.get('format')!r}, "
            f"version {found.get('version')!r}); re-run train.prepare into a new data.cache_dir"
        )
    return manifest


def safetensors_problem(path: Path, size: int | None = None) -> str | None:
    """Why `path` is not a whole safetensors file ("is missing", "is truncated ..."), or None when it is whole.

    Only the size is read when `size` (the bytes the manifest declares) is given; else the 8-byte length and the JSON
    header are read and the size the header implies (8 + header + the end of the last tensor) is compared: no tensor
    data is read either way, so thousands of files take well under a second.
    """
    try:
        actual = os.stat(path).st_size
    except FileNotFoundError:
        return "is missing"
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    if size is not None:
        return None if actual == size else f"has {actual} bytes, the manifest declares {size} (truncated or rewritten)"
    try:
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if not 8 < 8 + length <= actual:
                return f"is truncated or not a safetensors file ({actual} bytes)"
            header = json.loads(f.read(length))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return "has a damaged safetensors header"
    expected = 8 + length + end
    return None if actual == expected else f"has {actual} bytes where its header needs {expected} (truncated)"


def batch_key(sample: Mapping[str, Any]) -> str:
    """The key a manifest sample's batches are cut by: its bucket, and its layout where the family's encoder records
    one (`FamilyEncoder.batch_layout`: Qwen-Image-Edit-Plus' count and sizes of control images), so every sample of a
    batch, and every CP rank of it, has one sequence layout."""
    return f"{sample['bucket']} {sample['layout']}" if sample.get("layout") else sample["bucket"]


def pad_text(item: Mapping[str, torch.Tensor], length: int, prefix: str = "") -> dict[str, torch.Tensor]:
    """Right-pad prompt_embeds (L, D) with zeros and prompt_mask (L,) with False to `length` tokens (`prefix`: the
    preservation prompt's, `PRESERVATION`, padded per batch by `collate`: the manifest records captions only)."""
    out = dict(item)
    embeds, mask = prefix + "prompt_embeds", prefix + "prompt_mask"
    if embeds not in item:
        return out
    n = item[embeds].shape[0]
    if n > length and not prefix:
        raise UserError(
            f"a cached prompt_embeds has {n} tokens, more than the {length} its cache manifest records as "
            "the longest: re-run python -m train.prepare into a new data.cache_dir"
        )
    if n < length:
        emb = item[embeds]
        out[embeds] = torch.cat([emb, emb.new_zeros(length - n, *emb.shape[1:])])
        have = item.get(mask, torch.ones(n, dtype=torch.bool))
        out[mask] = torch.cat([have, have.new_zeros(length - n)])
    return out


@dataclass(frozen=True)
class CacheReads:
    """What a model family reads from a cache, as the family's side states it (train/models `cache_reads`): this
    module knows no family."""

    family: str
    keys: tuple[str, ...]  # the tensors every sample must hold: the noised streams, then what the spec reads
    latent_shapes: Callable[[int, int, int, float | None], Mapping[str, tuple[int, ...]]]  # per bucket and fps


class CachedLatentDataset:
    """Items of a prepared cache: dicts of tensors (see the module doc), loaded from the sample files on access.

    `pad_text=True` (default) right-pads every item's text (and `empty_prompt()`) to the longest text in the cache, so
    any batch stacks and caption dropout can swap in the empty caption; families whose pipeline pads to a fixed
    length (T5/UMT5) already have equal lengths and are untouched. `buckets[i]` is item i's bucket, for the sampler.
    Opening checks the files (see the module doc) and, given `family` (the recipe's model.family, or what it reads:
    `CacheReads`), that the cache was prepared for it and fits what it reads; every problem is a `UserError`.
    """

    def __init__(self, cache_dir: str | Path, *, pad_text: bool = True, family: str | CacheReads | None = None) -> None:
        self.cache_dir = Path(cache_dir)
        self.non_finite: set[Path] = set()  # samples already reported as holding NaN/Inf
        self._fingerprint: dict[str, Any] | None = None
        self.manifest = read_manifest(self.cache_dir)
        self.samples: list[dict[str, Any]] = self.manifest["samples"]
        if not self.samples:
            bad = self.manifest.get("counts", {}).get("bad", "all")
            raise UserError(
                f"cache {cache_dir} has no samples: {bad} items of the source were bad (see 'bad' in "
                f"{self.cache_dir / 'manifest.json'}); fix or replace the media and {_prepare_fix(cache_dir)} again"
            )
        if family is not None:
            self.check_family(family)
        self.check_files()
        self.buckets: list[str] = [batch_key(s) for s in self.samples]
        self.text_length: int | None = self.manifest["text"]["longest"] if pad_text else None

    def check_files(self) -> None:
        """Every sample file (and the empty caption's) is present and whole; a UserError naming the first that is not
        (sizes and headers only: seconds for thousands of files)."""
        files = [(s["file"], s.get("bytes")) for s in self.samples] + [("empty_prompt.safetensors", None)]
        problems = []
        for file, size in files:
            why = safetensors_problem(self.cache_dir / file, size)
            if why is not None:
                problems.append((file, why))
        if problems:
            (file, why), more = problems[0], len(problems) - 1
            others = f" (and {more} more files are missing or damaged)" if more else ""
            raise UserError(
                f"cache {self.cache_dir}: {file} {why}{others}; {_prepare_fix(self.cache_dir)} again (it re-encodes "
                "missing and damaged samples), or point data.cache_dir at a complete cache"
            )

    def check_family(self, family: str | CacheReads) -> None:
        """The cache was prepared for `family` (a name: the manifest's family), and, given what the family reads
        (`CacheReads`, from train.models.cache_reads), each bucket holds those keys with the latent rank its encoder
        writes (from the manifest: no file read). A UserError otherwise."""
        from .media import Bucket

        reads = family if isinstance(family, CacheReads) else None
        family = reads.family if reads is not None else family
        cached = self.manifest.get("family")
        fix = f"point data.cache_dir at a {family} cache, or {_prepare_fix('<a new folder>')}"
        if cached != family:
            raise UserError(f"cache {self.cache_dir} was prepared for model family {cached!r}, not {family!r}: {fix}")
        if reads is None:
            return
        fps = self.manifest.get("settings", {}).get("fps")
        first = {}
        for s in self.samples:
            first.setdefault(s["bucket"], s["file"])
        for bucket, tensors in self.manifest.get("tensors", {}).items():
            where = f"cache {self.cache_dir}: {first.get(bucket, bucket)} (bucket {bucket})"
            missing = [k for k in reads.keys if k not in tensors]
            if missing:
                raise UserError(f"{where} lacks {missing}, which {family} reads; {fix}")
            b = Bucket.parse(bucket)
            for key, shape in reads.latent_shapes(b.frames, b.height, b.width, fps).items():
                have = tuple(tensors[key]["shape"])
                if len(have) != len(shape):
                    raise UserError(
                        f"{where} has {key} of shape {have}, but {family} reads {len(shape)}-d {key} (C, ...) like "
                        f"{shape}; {fix}"
                    )

    @property
    def family(self) -> str:
        return self.manifest["family"]

    def fingerprint(self) -> dict[str, Any]:
        """What a checkpoint records of the data it trained on, for resume to compare: the sample count, and digests
        of the captions and of the rest of each sample's record (its file, bucket, source and size) with the
        encoding settings (folders and timestamps excluded: a moved or re-written identical cache is the same
        data). Computed once (the cache does not change under a run)."""
        import hashlib

        if self._fingerprint is not None:
            return self._fingerprint

        def digest(items) -> str:
            return hashlib.sha256(json.dumps(items, sort_keys=True).encode()).hexdigest()[:16]

        moved = ("source", "pretrained_path")  # folders: the same media and pipeline elsewhere are the same data
        settings = {k: v for k, v in self.manifest.get("settings", {}).items() if k not in moved}
        records = [[s.get(k) for k in ("file", "bucket", "source", "bytes")] for s in self.samples]
        self._fingerprint = {
            "cache_dir": str(self.cache_dir.resolve()),
            "samples": len(self.samples),
            "captions": digest([s.get("caption") for s in self.samples]),
            "content": digest([settings, records]),
        }
        return self._fingerprint

    def __len__(self) -> int:
        return len(self.samples)

    def bucket_shapes(self, bucket: str) -> dict[str, list[int]]:
        """Per-sample shape of each tensor of `bucket`'s samples: from the manifest, else (an older cache) from its
        first sample's file."""
        tensors = self.manifest.get("tensors", {}).get(bucket)
        if tensors is not None:
            return {k: list(v["shape"]) for k, v in tensors.items()}
        return {k: list(v.shape) for k, v in self[self.buckets.index(bucket)].items()}

    def _load(self, path: Path) -> dict[str, torch.Tensor]:
        """The tensors of one file: refused (UserError naming it) when unreadable; a warning naming it when not finite.
        Only the ranks that read this item (one CP group) see the problem, hence same_on_every_rank=False."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            item = load_file(path)
        except (OSError, SafetensorError) as e:
            why = safetensors_problem(path) or f"cannot be read ({str(e).splitlines()[0]})"
            raise UserError(
                f"{path} {why}: {_prepare_fix(self.cache_dir)} again (it re-encodes missing and damaged samples)",
                same_on_every_rank=False,
            ) from None
        bad = [k for k, t in item.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
        if bad and path not in self.non_finite:
            # Said once per file; the sample still goes into its batch, whose step the trainer then skips (no update)
            # and counts: one bad sample never stops nor poisons a run.
            self.non_finite.add(path)
            counts = ", ".join(f"{k}: {int((~torch.isfinite(item[k])).sum())} of {item[k].numel()}" for k in bad)
            print(f"warning: {path} holds NaN/Inf values ({counts}): the steps that read it are skipped; delete it and "
                  f"{_prepare_fix(self.cache_dir)} again (it re-encodes the item, or lists it as bad when the encoders "
                  "give NaN/Inf again)", file=sys.stderr, flush=True)  # fmt: skip
        return pad_text(item, self.text_length) if self.text_length else item

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self._load(self.cache_dir / self.samples[i]["file"])

    def caption(self, i: int) -> str:
        return self.samples[i]["caption"]

    def _text_length(self, file: str) -> int:
        from safetensors import safe_open

        with safe_open(self.cache_dir / file, "pt") as f:
            return f.get_slice("prompt_embeds").get_shape()[0]

    def text_lengths(self) -> list[int]:
        """Tokens of each item's caption as cached (before padding); from the manifest, else from the files."""
        return [s["text_len"] if "text_len" in s else self._text_length(s["file"]) for s in self.samples]

    def empty_prompt_length(self) -> int:
        """Tokens of the empty caption as cached (before padding)."""
        return self._text_length("empty_prompt.safetensors")

    def empty_prompt(self) -> dict[str, torch.Tensor]:
        """Text tensors of the empty caption (prompt_embeds, prompt_mask, pooled_embeds if any), for caption dropout."""
        return self._load(self.cache_dir / "empty_prompt.safetensors")


class MixedDataset:
    """Several caches as one dataset (data.datasets): cache k's item j is index `offsets[k] + j`, the index space the
    sampler draws from (`Share`s in the same order). Text is padded to the longest of all the caches, so a batch
    stacks whichever caches its samples come from; each cache keeps its own empty caption (caption dropout)."""

    def __init__(self, parts: Sequence[CachedLatentDataset], names: Sequence[str]) -> None:
        self.parts, self.names = list(parts), list(names)
        self.offsets = [0]
        for part in self.parts:
            self.offsets.append(self.offsets[-1] + len(part))
        lengths = [p.text_length for p in self.parts]
        if None not in lengths:
            for part in self.parts:
                part.text_length = max(lengths)
        self.buckets: list[str] = [b for p in self.parts for b in p.buckets]

    def __len__(self) -> int:
        return self.offsets[-1]

    def part_of(self, i: int) -> tuple[int, int]:
        """(cache k, its item j) of index i."""
        k = bisect.bisect_right(self.offsets, i) - 1
        return k, i - self.offsets[k]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        k, j = self.part_of(i)
        return self.parts[k][j]

    def sample_id(self, i: int) -> str:
        """`<name>: <cache_dir>/<sample file>`: the dataset and the file of index i, for error messages."""
        k, j = self.part_of(i)
        return f"{self.names[k]}: {self.parts[k].cache_dir / self.parts[k].samples[j]['file']}"

    def bucket_shapes(self, bucket: str) -> dict[str, list[int]]:
        return next(p.bucket_shapes(bucket) for p in self.parts if bucket in p.buckets)

    def text_lengths(self) -> list[int]:
        return [n for p in self.parts for n in p.text_lengths()]

    def empty_prompts(self) -> list[dict[str, torch.Tensor]]:
        """Each cache's empty caption (padded like every item), for caption dropout."""
        return [p.empty_prompt() for p in self.parts]


def collate(items: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack items into a batch (B, ...); text of unequal length is right-padded to the longest (mask False). When only
    some items have a `loss_mask` (caches with and without masks in one batch), the others get all ones: trained whole,
    as they would be alone."""
    if not items:
        raise ValueError("collate: no items")
    masked = [it for it in items if LOSS_MASK in it]
    if masked and len(masked) < len(items):
        ones = torch.ones_like(masked[0][LOSS_MASK])
        items = [it if LOSS_MASK in it else {**it, LOSS_MASK: ones} for it in items]
    keys = set(items[0])
    for it in items[1:]:
        if set(it) != keys:
            raise ValueError(f"collate: items have different tensors: {sorted(keys)} vs {sorted(it)}")
    for prefix in ("", PRESERVATION):
        if prefix + "prompt_embeds" in keys:
            longest = max(it[prefix + "prompt_embeds"].shape[0] for it in items)
            items = [pad_text(it, longest, prefix) for it in items]
    out = {}
    for k in sorted(keys):
        shapes = {tuple(it[k].shape) for it in items}
        if len(shapes) > 1:
            raise ValueError(f"collate: {k!r} has different shapes {sorted(shapes)} in one batch (mixed buckets?)")
        out[k] = torch.stack([it[k] for it in items])
    return out


@dataclass(frozen=True)
class Share:
    """How the sampler draws one dataset of a mixture (data.datasets), whose `samples` indices follow the previous
    dataset's in the combined index space: each sample `repeats` times per epoch, or, with a `weight`, a share of the
    weighted datasets' epoch (together they fill as many samples as they hold, split in proportion to weight)."""

    samples: int
    repeats: int = 1
    weight: float | None = None


def _number(x: Fraction | int) -> int | float:
    """A mean count per epoch for reports: whole, or rounded to 2 decimals."""
    return int(x) if x == int(x) else round(float(x), 2)


def carry(proportions: Sequence[Fraction], before: Sequence[int], total: int) -> list[int]:
    """Whole counts summing to `total` for parts of exact `proportions` (summing to 1), grown from the counts `before`
    at a smaller total: each is total × its proportion rounded down or up (within 1 of exact) and none is below its
    count before, so a part's draws over epochs (`total` = all samples drawn so far) follow its share however small.

    Each part first gets what it must (its exact count rounded down, or its count before); the seats left (fewer than
    the parts) go, one each, to the parts still below their exact count rounded up whose next seat falls due first
    (the smallest total at which their rounded-down exact count reaches it): earliest-deadline-first, which never
    leaves a part behind its share (cumulative quotas as in Pfair scheduling). Exact fractions: the same on every rank.
    """
    out = [max(c, math.floor(total * p)) for c, p in zip(before, proportions)]
    left = total - sum(out)
    due = sorted(
        (math.ceil((out[k] + 1) / p), k) for k, p in enumerate(proportions) if p and out[k] < math.ceil(total * p)
    )
    if not 0 <= left <= len(due):  # cannot happen for totals that grow (tests/test_data_mix.py: many random mixtures)
        raise AssertionError(f"carry: {left} seats left for {len(due)} parts (before {list(before)}, total {total})")
    for _, k in due[:left]:
        out[k] += 1
    return out


class BucketBatchSampler:
    """Infinite batches of dataset indices, one bucket per batch, split across data-parallel groups.

    Epoch e: the epoch's samples per bucket (every index once; for a mixture, `shares`: each dataset's samples its
    repeats times, or a weighted dataset's quota, split over its buckets in proportion to their sizes, its samples
    each quota // size times plus a seeded draw of the rest, a new one every epoch); a generator seeded with (seed, e)
    shuffles each bucket's samples (when `shuffle`), cuts them into batches of the bucket's batch size (`batch_size`:
    one for all, or per bucket, from train.batch_tokens; the last short batch of a bucket is dropped when `drop_last`,
    else kept), and shuffles the batch order. That global list is the same on every rank; data-parallel group
    `dp_rank` takes batches dp_rank, dp_rank + dp_size, ... so the groups see disjoint batches and every CP rank of a
    group sees the same ones. Every group gets the same number of batches in an epoch (`batches_per_epoch`): extra
    batches are dropped (drop_last) or the list wraps around (drop_last=False) so that no rank waits for a batch that
    never comes. `exclude`: indices never drawn (a held-out split).

    Weighted quotas are carried over epochs (`carry`): a dataset's exact share of an epoch (say 0.32 samples) is not
    rounded the same way every epoch but so that its samples drawn by the end of every epoch are its exact share of
    all drawn then, rounded down or up (one sample in about 3 epochs); likewise its split over its buckets. The
    weighted datasets fill the same number of samples every epoch, so the batches per epoch are the same every epoch
    unless the datasets' buckets differ (then an epoch may hold a batch more or fewer than the next: `__len__` is the
    current epoch's). Epoch e's plan is a function of e alone (and the settings): a resumed run continues exactly.
    """

    def __init__(
        self,
        dataset_buckets: Sequence[str],
        batch_size: int | Mapping[str, int],
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
        exclude: frozenset[int] = frozenset(),
        shares: Sequence[Share] = (),
    ) -> None:
        buckets = sorted({str(b) for b in dataset_buckets})
        sizes = {b: batch_size for b in buckets} if isinstance(batch_size, int) else {b: batch_size[b] for b in buckets}
        if min(sizes.values(), default=1) < 1:
            raise ValueError(f"batch sizes must be >= 1, got {sizes}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, dp_size={dp_size}), got {dp_rank}")
        self.num_samples = len(dataset_buckets)
        self.shares = tuple(shares) or (Share(self.num_samples),)
        if sum(s.samples for s in self.shares) != self.num_samples:
            raise ValueError(f"shares cover {sum(s.samples for s in self.shares)} samples of {self.num_samples}")
        self.batch_size = batch_size if isinstance(batch_size, int) else dict(sizes)  # as given: the state records it
        self.batch_sizes = sizes  # per bucket
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        # (bucket, dataset) -> its indices, ascending (one dataset: each bucket's indices, as before mixtures)
        self._strata: dict[tuple[str, int], list[int]] = {}
        start = 0
        for k, share in enumerate(self.shares):
            for i in range(start, start + share.samples):
                if i not in exclude:  # held out of training (validation_loss's seeded split)
                    self._strata.setdefault((str(dataset_buckets[i]), k), []).append(i)
            start += share.samples
        self._setup_quotas()
        self.counts = {b: _number(sum(q for (bb, _), q in self._mean.items() if bb == b)) for b in buckets}  # mean
        self._cached: tuple[int, list[list[int]]] | None = None  # (epoch, its global batch list)
        if self.batches_per_epoch(0) == 0:
            what = f"batches of {batch_size}" if isinstance(batch_size, int) else f"batches (per bucket: {sizes})"
            total = self._all_batches(0)
            # the trainer's only exclude is validation_loss's split of the training data: say what it took
            held = sum(1 for i in exclude if 0 <= i < self.num_samples)
            why, fix = "", ""
            if held:
                left = self.num_samples - held
                why = f" (validation_loss.fraction held out {held} of them, leaving {left} to train on)"
                fix = ", lower validation_loss.fraction (or hold out a cache of its own: validation_loss.cache_dir)"
            raise UserError(
                f"{self.num_samples} samples{why} (per bucket and epoch: {self.counts}) make {total} {what}, fewer "
                f"than the {dp_size} data-parallel groups: lower train.batch_size (or train.batch_tokens){fix}, add "
                "samples, or use fewer DP ranks"
            )
        self.epoch = 0
        self.index = 0

    def _setup_quotas(self) -> None:
        """What each epoch's quotas derive from: each (bucket, dataset)'s fixed count (its size × repeats) and, for the
        weighted datasets, their exact proportions of the weighted samples per epoch (the weighted datasets' sizes
        together) and each one's buckets' proportions of it (by size); their mean per epoch (`self._mean`)."""
        size = [sum(len(v) for (_, k), v in self._strata.items() if k == j) for j in range(len(self.shares))]
        self._weighted = [k for k, s in enumerate(self.shares) if s.weight is not None and size[k]]
        self._total = sum(size[k] for k in self._weighted)  # weighted samples per epoch, the same every epoch
        weights = [Fraction(self.shares[k].weight) for k in self._weighted]  # exact: the same on every rank
        self._proportions = [w / sum(weights) for w in weights]
        # each weighted dataset's strata (bucket, k) in order, and their proportions of that dataset's draws
        self._split: list[tuple[list[tuple[str, int]], list[Fraction]]] = []
        for k in self._weighted:
            strata = sorted(key for key in self._strata if key[1] == k)
            self._split.append((strata, [Fraction(len(self._strata[key]), size[k]) for key in strata]))
        self._fixed = {key: len(idx) * self.shares[key[1]].repeats for key, idx in self._strata.items()
                       if key[1] not in self._weighted}  # fmt: skip
        self._mean: dict[tuple[str, int], Fraction | int] = dict(self._fixed)
        for p, (strata, split) in zip(self._proportions, self._split):
            for key, q in zip(strata, split):
                self._mean[key] = self._total * p * q
        # cumulative draws by the start of epoch e: (per weighted dataset, per weighted stratum), e = 0, 1, ...
        self._drawn: list[tuple[list[int], list[list[int]]]] = [
            ([0] * len(self._weighted), [[0] * len(strata) for strata, _ in self._split])
        ]

    def _cumulative(self, epoch: int) -> tuple[list[int], list[list[int]]]:
        """The weighted datasets' (and their strata's) samples drawn in epochs 0 .. epoch - 1, each carried on from
        the epoch before (computed once, in order: a few fraction operations per dataset and epoch)."""
        while len(self._drawn) <= epoch:
            datasets, strata = self._drawn[-1]
            e = len(self._drawn)
            now = carry(self._proportions, datasets, e * self._total)
            split = [carry(q, before, n) for (_, q), before, n in zip(self._split, strata, now)]
            self._drawn.append((now, split))
        return self._drawn[epoch]

    def quotas(self, epoch: int) -> dict[tuple[str, int], int]:
        """Samples of each (bucket, dataset) in `epoch`: its size × repeats, or, weighted, what its carried share
        adds in that epoch."""
        out = dict(self._fixed)
        (_, before), (_, after) = self._cumulative(epoch), self._cumulative(epoch + 1)
        for (strata, _), b, a in zip(self._split, before, after):
            for key, x, y in zip(strata, b, a):
                out[key] = y - x
        return out

    def plan(self, epoch: int | None = None) -> list[int | float]:
        """Samples of each dataset (the shares' order), before batching: in `epoch`, or (None) per epoch on average
        (a weighted dataset's exact share, rounded to 2 decimals when not whole)."""
        quota = self._mean if epoch is None else self.quotas(epoch)
        return [_number(sum(q for (_, j), q in quota.items() if j == k)) for k in range(len(self.shares))]

    def _all_batches(self, epoch: int) -> int:
        """How many batches `epoch`'s samples make, from its per-bucket counts (nothing drawn)."""
        counts: dict[str, int] = {}
        for (b, _), q in self.quotas(epoch).items():
            counts[b] = counts.get(b, 0) + q
        size = self.batch_sizes
        return sum(n // size[b] if self.drop_last else -(-n // size[b]) for b, n in counts.items())

    def batches_per_epoch(self, epoch: int) -> int:
        """Batches of `epoch` for each data-parallel group."""
        total = self._all_batches(epoch)
        return total // self.dp_size if self.drop_last else -(-total // self.dp_size)

    def __len__(self) -> int:
        """Batches of the current epoch for this data-parallel group (the same every epoch but for a mixture of
        weighted datasets with different buckets)."""
        return self.batches_per_epoch(self.epoch)

    def _epoch_samples(self, epoch: int) -> dict[str, list[int]]:
        """Each bucket's samples of `epoch`, before shuffling. Weighted quotas that are not whole multiples of a
        bucket's samples draw the rest from a generator of their own: one dataset (or repeats only) draws nothing,
        and its sequence is the one it had before mixtures."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch + 0x5EED_0000)
        quota = self.quotas(epoch)
        out: dict[str, list[int]] = {}
        for (bucket, k), idx in sorted(self._strata.items()):
            copies, extra = divmod(quota[(bucket, k)], len(idx))
            drawn = idx * copies
            if extra:
                drawn += [idx[j] for j in sorted(torch.randperm(len(idx), generator=gen)[:extra].tolist())]
            out.setdefault(bucket, []).extend(drawn)
        return out

    def _batches(self, epoch: int) -> list[list[int]]:
        """All the batches `epoch`'s samples make, in order (before they are split over the data-parallel groups)."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        batches: list[list[int]] = []
        for bucket, idx in sorted(self._epoch_samples(epoch).items()):
            if self.shuffle:
                idx = [idx[j] for j in torch.randperm(len(idx), generator=gen).tolist()]
            size = self.batch_sizes[bucket]
            for s in range(0, len(idx), size):
                chunk = idx[s : s + size]
                if len(chunk) == size or not self.drop_last:
                    batches.append(chunk)
        if self.shuffle:
            batches = [batches[j] for j in torch.randperm(len(batches), generator=gen).tolist()]
        return batches

    def _global(self, epoch: int) -> list[list[int]]:
        """The batches of `epoch` for all data-parallel groups (group r's are r, r + dp_size, ...)."""
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        batches = self._batches(epoch)
        need = self.batches_per_epoch(epoch) * self.dp_size
        while batches and len(batches) < need:  # drop_last=False: wrap around so every group gets as many batches
            batches += batches[: need - len(batches)]
        self._cached = (epoch, batches[:need])
        return self._cached[1]

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This group's batches of `epoch`, in order."""
        return self._global(epoch)[self.dp_rank :: self.dp_size]

    def job_batch(self) -> list[int]:
        """The samples of every data-parallel group's batch at the position of the batch just handed out (the whole
        job's micro-batch): what each dataset contributes, counted alike on every rank without a collective."""
        i = self.index - 1
        return [x for b in self._global(self.epoch)[i * self.dp_size : (i + 1) * self.dp_size] for x in b]

    def __iter__(self) -> Iterator[list[int]]:
        empty = 0  # epochs in a row without a batch for the groups (a mixture's lean epoch may have none)
        while True:
            batches = self.epoch_batches(self.epoch)
            empty = 0 if batches else empty + 1
            if empty > 1000:
                raise RuntimeError(f"the data sampler made no batch in 1000 epochs up to epoch {self.epoch}")
            while self.index < len(batches):
                batch = batches[self.index]
                self.index += 1  # the position is the *next* batch as soon as this one is handed out
                yield batch
            self.epoch, self.index = self.epoch + 1, 0

    SETTINGS = ("seed", "batch_size", "num_samples", "shuffle", "drop_last", "mixture")  # what the order depends on

    def state_dict(self) -> dict[str, Any]:
        """Position of the next batch (epoch, index) plus what the sequence depends on (checked on load); a mixture
        adds each dataset's [samples, repeats, weight]."""
        state = {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "num_samples": self.num_samples,
            "dp_size": self.dp_size,
            "shuffle": int(self.shuffle),
            "drop_last": int(self.drop_last),
        }
        if self.shares != (Share(self.num_samples),):
            state["mixture"] = [[s.samples, s.repeats, s.weight] for s in self.shares]
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved position; call iter() again afterwards.

        seed, batch size(s), sample count, shuffle, drop_last and the mixture must match (else a different sequence
        would silently be resumed). A different dp_size (resuming on another number of GPUs) is allowed: each group
        resumes at the same point of the epoch's global batch list (exact when the old position x old dp_size divides
        by the new).
        """
        now = self.state_dict()
        changed = [k for k in self.SETTINGS if state.get(k) != now.get(k)]
        mismatched = [f"{k}: saved {state.get(k)}, now {now.get(k)}" for k in changed]
        if mismatched:
            raise ValueError("cannot resume the data order: " + "; ".join(mismatched))
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        old_dp = int(state.get("dp_size", self.dp_size))
        if old_dp != self.dp_size:
            self.index = self.index * old_dp // self.dp_size
        if self.index > len(self):
            raise ValueError(f"saved index {self.index} is past the {len(self)} batches of an epoch")
