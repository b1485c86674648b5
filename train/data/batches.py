"""The trainer's batch stream: dataset → bucketed batches for this data-parallel rank → device, with the CP batch
contract (every rank of a CP group gets the same batch; DP groups get different ones) checked at startup."""

from __future__ import annotations

import hashlib
from typing import Protocol

import torch
import torch.distributed as dist

from ..config import Recipe
from ..errors import UserError
from .dataset import BucketBatchSampler, CachedLatentDataset, CacheReads, collate
from .synthetic_latents import SyntheticLatentDataset


class Family(Protocol):
    """What the batch stream needs of a family's spec (train/models/spec.py `FamilySpec`; data knows no family)."""

    name: str
    batch_keys: tuple[str, ...]
    shared_text_length: bool


def build_dataset(recipe: Recipe, spec: Family, reads: CacheReads | None = None):
    """The recipe's dataset: synthetic, or the cache `train.prepare` wrote, checked at once against what the family
    reads (`reads`, from train.models.cache_reads; without it only the cache's family name is checked)."""
    data = recipe.data
    if data.synthetic is not None:
        missing = [k for k in spec.batch_keys if k not in data.synthetic.shapes]
        if missing:
            raise UserError(f"data.synthetic.shapes lacks {missing}: family {spec.name} reads {list(spec.batch_keys)}")
        return SyntheticLatentDataset(data.synthetic.num_samples, data.synthetic.shapes, recipe.train.seed,
                                      getattr(torch, recipe.model.dtype))  # fmt: skip
    if data.cache_dir is None:
        raise UserError("set data.cache_dir (written by `python -m train.prepare`) or data.synthetic")
    # checked now: files, sizes, family, keys
    return CachedLatentDataset(data.cache_dir, family=reads or recipe.model.family)


def check_text_lengths(dataset, spec: Family, recipe: Recipe) -> None:
    """A family that packs one unpadded text layout per batch (`spec.shared_text_length`) cannot batch captions of
    different token lengths, nor swap in the empty caption (caption dropout) unless it has their length. Refuse such a
    recipe at startup, from the cache's manifest (the same on every rank), instead of failing at some later step."""
    if not spec.shared_text_length or recipe.train.batch_size == 1 or not isinstance(dataset, CachedLatentDataset):
        return
    lengths = set(dataset.text_lengths())
    if recipe.train.caption_dropout > 0:
        lengths.add(dataset.empty_prompt_length())
    if len(lengths) > 1:
        raise UserError(
            f"{spec.name} packs one text layout per batch (no text mask), but this cache's captions (and the empty "
            f"caption, with caption dropout) have {len(lengths)} different token lengths {sorted(lengths)[:8]}: set "
            "train.batch_size: 1 and raise train.grad_accum for a larger effective batch"
            + (", or train.caption_dropout: 0" if recipe.train.caption_dropout > 0 else "")
        )


class Batches:
    """Infinite iterator of collated batches on `device`; its position is part of every checkpoint."""

    def __init__(self, dataset, sampler: BucketBatchSampler, device: torch.device) -> None:
        self.dataset, self.sampler, self.device = dataset, sampler, device
        self._it = iter(sampler)
        self._empty = dataset.empty_prompt()

    def __next__(self) -> dict[str, torch.Tensor]:
        return self.take()[0]

    def take(self) -> tuple[dict[str, torch.Tensor], list[str]]:
        """The next batch and the ids of its samples. The ids stay out of the batch, which holds only what the model
        reads (family specs, caption dropout and the contract hash see tensors only); errors name the data with them."""
        indices = next(self._it)
        batch = {k: v.to(self.device) for k, v in collate([self.dataset[i] for i in indices]).items()}
        return batch, self.sample_ids(indices)

    def sample_ids(self, indices: list[int]) -> list[str]:
        """`#<dataset index>`, plus the sample file under data.cache_dir for cached data."""
        if isinstance(self.dataset, CachedLatentDataset):
            return [f"#{i} ({self.dataset.samples[i]['file']})" for i in indices]
        return [f"#{i}" for i in indices]

    def state_dict(self) -> dict:
        """The sampler's position, and (a cache) the data's fingerprint (`CachedLatentDataset.fingerprint`)."""
        cached = isinstance(self.dataset, CachedLatentDataset)
        return {**self.sampler.state_dict(), **({"cache": self.dataset.fingerprint()} if cached else {})}

    def resume_notes(self, saved: dict, step: int) -> list[str]:
        """The saved data state (a checkpoint's `data`) against this run's, before any weights are read: a cache of
        another size (the epoch's order cannot continue) is a UserError; a cache whose captions or samples changed
        at the same size is a note (the run continues on the new data, and says so)."""
        now, was = self.state_dict(), saved.get("cache")
        if not isinstance(self.dataset, CachedLatentDataset) or was is None:
            return []
        fp = now["cache"]
        if was["samples"] != fp["samples"]:
            raise UserError(f"resume: the checkpoint of step {step} trained on a cache of {was['samples']} samples "
                            f"({was['cache_dir']}), data.cache_dir ({fp['cache_dir']}) now holds {fp['samples']}: its "
                            "epoch order cannot continue; resume with that cache, or start a new run (another "
                            "output_dir, or --archive-previous)")  # fmt: skip
        changed = [what for what in ("captions", "content") if was[what] != fp[what]]
        if not changed:
            return []
        said = {"captions": "its captions", "content": "its samples (files, sizes or encoding settings)"}
        return [
            f"data: the cache changed since step {step} ({' and '.join(said[c] for c in changed)}, same sample "
            f"count {fp['samples']}): training continues on the new data at the same position"
        ]

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
        self._it = iter(self.sampler)

    def caption_dropout(self, batch: dict, p: float, gen: torch.Generator) -> dict:
        """Replace whole captions by the empty caption's embeddings with probability p (drawn from the step's
        generator, so CP peers drop the same captions)."""
        if p <= 0:
            return batch
        drop = torch.rand(batch["latents"].shape[0], generator=gen) < p
        if not drop.any():
            return batch
        out = dict(batch)
        for key, empty in self._empty.items():
            if key in batch:
                e = empty.to(batch[key].device, batch[key].dtype)  # same (L, D) as each sample's: cached alike
                out[key] = torch.where(drop.view(-1, *[1] * e.dim()).to(e.device), e, batch[key])
        return out

    def check_contract(self, mesh) -> None:
        """Hash the next batch (without consuming it) and compare across ranks: equal inside a CP group, else an
        error; equal across DP groups only when the dataset is too small to differ (a warning)."""
        state = self.sampler.state_dict()
        batch = next(self)
        self.load_state_dict(state)
        digest = hashlib.sha256()
        for k in sorted(batch):
            digest.update(batch[k].detach().float().cpu().numpy().tobytes())
        h = torch.tensor([int.from_bytes(digest.digest()[:7], "little")], dtype=torch.int64)
        groups = [(mesh.cp_group, "CP")] + ([(mesh.dp.get_group(), "DP")] if mesh.dims.dp > 1 else [])
        for group, what in groups:
            seen = [torch.zeros_like(h) for _ in range(dist.get_world_size(group))]
            dist.all_gather(seen, h, group=group)
            values = {int(s) for s in seen}
            if what == "CP" and len(values) != 1:
                raise RuntimeError("ranks of one CP group received different batches: the CP batch contract is broken")
            if what == "DP" and len(values) < len(seen) and dist.get_rank() == 0:
                print(f"warning: {len(seen) - len(values) + 1} data-parallel groups drew the same first batch")


def make_batches(dataset, recipe: Recipe, dp_rank: int, dp_size: int, device: torch.device) -> Batches:
    sampler = BucketBatchSampler(dataset.buckets, recipe.train.batch_size, dp_rank=dp_rank, dp_size=dp_size,
                                 seed=recipe.train.seed, shuffle=recipe.data.shuffle)  # fmt: skip
    return Batches(dataset, sampler, device)
