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

and string metadata: caption, source (file path or dataset row), bucket ("FxHxW", the pixel clip shape), family,
index. `manifest.json` has: format, version, family, pretrained_path, settings, counts (total/ok/bad, bad by reason),
buckets (bucket -> count), tensors (name -> shape/dtype per bucket), text (max_tokens, longest), samples (index, file,
bucket, caption), bad (index, source, reason, detail), timing. See `train.prepare`.

Sampling contract (`BucketBatchSampler`): every batch comes from one bucket (same shapes, so it stacks); the batch
sequence depends only on (seed, epoch, dp_rank, dp_size), so all ranks of a context-parallel group (same dp_rank) get
the same batches and different data-parallel groups get disjoint ones; it runs forever over epochs, and
`state_dict()` records the exact position so a resumed run continues with the very next batch.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .synthetic_latents import SyntheticLatentDataset

__all__ = [
    "CACHE_FORMAT",
    "CACHE_VERSION",
    "BucketBatchSampler",
    "CachedLatentDataset",
    "SyntheticLatentDataset",
    "collate",
    "pad_text",
    "read_manifest",
    "sample_path",
]

CACHE_FORMAT = "ctxtrain-latent-cache"
CACHE_VERSION = 1
TEXT_KEYS = ("prompt_embeds", "prompt_mask")


def sample_path(cache_dir: str | Path, index: int) -> Path:
    return Path(cache_dir) / "samples" / f"{index:06d}.safetensors"


def read_manifest(cache_dir: str | Path) -> dict[str, Any]:
    path = Path(cache_dir) / "manifest.json"
    if not path.is_file():
        hint = " (a prepare was started there but did not finish)" if (Path(cache_dir) / "samples").is_dir() else ""
        raise FileNotFoundError(
            f"no cache at {cache_dir}: {path.name} is missing{hint}; run `python -m train.prepare --recipe <recipe>` "
            "with data.cache_dir set to this folder"
        )
    manifest = json.loads(path.read_text())
    if manifest.get("format") != CACHE_FORMAT or manifest.get("version") != CACHE_VERSION:
        raise ValueError(
            f"{path}: not a {CACHE_FORMAT} v{CACHE_VERSION} manifest (format {manifest.get('format')!r}, "
            f"version {manifest.get('version')!r}); re-run train.prepare into a new cache_dir"
        )
    return manifest


def pad_text(item: Mapping[str, torch.Tensor], length: int) -> dict[str, torch.Tensor]:
    """Right-pad prompt_embeds (L, D) with zeros and prompt_mask (L,) with False to `length` tokens."""
    out = dict(item)
    if "prompt_embeds" not in item:
        return out
    n = item["prompt_embeds"].shape[0]
    if n > length:
        raise ValueError(f"prompt_embeds has {n} tokens, more than the {length} to pad to")
    if n < length:
        emb = item["prompt_embeds"]
        out["prompt_embeds"] = torch.cat([emb, emb.new_zeros(length - n, *emb.shape[1:])])
        mask = item.get("prompt_mask", torch.ones(n, dtype=torch.bool))
        out["prompt_mask"] = torch.cat([mask, mask.new_zeros(length - n)])
    return out


class CachedLatentDataset:
    """Items of a prepared cache: dicts of tensors (see the module doc), loaded from the sample files on access.

    `pad_text=True` (default) right-pads every item's text (and `empty_prompt()`) to the longest text in the cache, so
    any batch stacks and caption dropout can swap in the empty caption; families whose pipeline pads to a fixed
    length (T5/UMT5) already have equal lengths and are untouched. `buckets[i]` is item i's bucket, for the sampler.
    """

    def __init__(self, cache_dir: str | Path, *, pad_text: bool = True) -> None:
        self.cache_dir = Path(cache_dir)
        self.manifest = read_manifest(self.cache_dir)
        self.samples: list[dict[str, Any]] = self.manifest["samples"]
        if not self.samples:
            raise ValueError(f"cache {cache_dir} has no samples (every item was bad: see manifest.json 'bad')")
        self.buckets: list[str] = [s["bucket"] for s in self.samples]
        self.text_length: int | None = self.manifest["text"]["longest"] if pad_text else None

    @property
    def family(self) -> str:
        return self.manifest["family"]

    def __len__(self) -> int:
        return len(self.samples)

    def _load(self, path: Path) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        item = load_file(path)
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


def collate(items: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack items into a batch (B, ...); text of unequal length is right-padded to the longest (mask False)."""
    if not items:
        raise ValueError("collate: no items")
    keys = set(items[0])
    for it in items[1:]:
        if set(it) != keys:
            raise ValueError(f"collate: items have different tensors: {sorted(keys)} vs {sorted(it)}")
    if "prompt_embeds" in keys:
        longest = max(it["prompt_embeds"].shape[0] for it in items)
        items = [pad_text(it, longest) for it in items]
    out = {}
    for k in sorted(keys):
        shapes = {tuple(it[k].shape) for it in items}
        if len(shapes) > 1:
            raise ValueError(f"collate: {k!r} has different shapes {sorted(shapes)} in one batch (mixed buckets?)")
        out[k] = torch.stack([it[k] for it in items])
    return out


class BucketBatchSampler:
    """Infinite batches of dataset indices, one bucket per batch, split across data-parallel groups.

    Epoch e: a generator seeded with (seed, e) shuffles each bucket's indices (when `shuffle`), cuts them into batches
    of `batch_size` (the last short batch of a bucket is dropped when `drop_last`, else kept), and shuffles the batch
    order. That global list is the same on every rank; data-parallel group `dp_rank` takes batches dp_rank,
    dp_rank + dp_size, ... so the groups see disjoint batches and every CP rank of a group sees the same ones. Every
    group gets the same number of batches per epoch (`len(self)`): extra batches are dropped (drop_last) or the list
    wraps around (drop_last=False) so that no rank waits for a batch that never comes.
    """

    def __init__(
        self,
        dataset_buckets: Sequence[str],
        batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, dp_size={dp_size}), got {dp_rank}")
        self.batch_size, self.dp_rank, self.dp_size = batch_size, dp_rank, dp_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.num_samples = len(dataset_buckets)
        self._groups: dict[str, list[int]] = {}
        for i, b in enumerate(dataset_buckets):
            self._groups.setdefault(str(b), []).append(i)
        full = [len(v) // batch_size for v in self._groups.values()]
        total = sum(full) if drop_last else sum(-(-len(v) // batch_size) for v in self._groups.values())
        self._per_rank = total // dp_size if drop_last else -(-total // dp_size)
        if self._per_rank == 0:
            counts = {k: len(v) for k, v in sorted(self._groups.items())}
            raise ValueError(
                f"{self.num_samples} samples (per bucket: {counts}) make {total} batches of {batch_size}, fewer than "
                f"the {dp_size} data-parallel groups: lower train.batch_size, add samples, or use fewer DP ranks"
            )
        self.epoch = 0
        self.index = 0

    def __len__(self) -> int:
        """Batches per epoch for this data-parallel group."""
        return self._per_rank

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This group's batches of `epoch`, in order."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        batches: list[list[int]] = []
        for bucket in sorted(self._groups):
            idx = self._groups[bucket]
            if self.shuffle:
                idx = [idx[j] for j in torch.randperm(len(idx), generator=gen).tolist()]
            for s in range(0, len(idx), self.batch_size):
                chunk = idx[s : s + self.batch_size]
                if len(chunk) == self.batch_size or not self.drop_last:
                    batches.append(chunk)
        if self.shuffle:
            batches = [batches[j] for j in torch.randperm(len(batches), generator=gen).tolist()]
        need = self._per_rank * self.dp_size
        while len(batches) < need:  # drop_last=False: wrap around so every group gets as many batches
            batches += batches[: need - len(batches)]
        return batches[self.dp_rank : need : self.dp_size]

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            batches = self.epoch_batches(self.epoch)
            while self.index < len(batches):
                batch = batches[self.index]
                self.index += 1  # the position is the *next* batch as soon as this one is handed out
                yield batch
            self.epoch, self.index = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        """Position of the next batch (epoch, index) plus what the sequence depends on (checked on load)."""
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "num_samples": self.num_samples,
            "dp_size": self.dp_size,
            "shuffle": int(self.shuffle),
            "drop_last": int(self.drop_last),
        }

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue from a saved position; call iter() again afterwards.

        seed, batch_size, sample count, shuffle and drop_last must match (else a different sequence would silently be
        resumed). A different dp_size (resuming on another number of GPUs) is allowed: each group resumes at the same
        point of the epoch's global batch list (exact when the old position x old dp_size divides by the new).
        """
        mismatched = [
            f"{k}: saved {state[k]}, now {v}"
            for k, v in self.state_dict().items()
            if k in state and k not in ("epoch", "index", "dp_size") and int(state[k]) != int(v)
        ]
        if mismatched:
            raise ValueError("cannot resume the data order: " + "; ".join(mismatched))
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        old_dp = int(state.get("dp_size", self.dp_size))
        if old_dp != self.dp_size:
            self.index = self.index * old_dp // self.dp_size
        if self.index > len(self):
            raise ValueError(f"saved index {self.index} is past the {len(self)} batches of an epoch")
