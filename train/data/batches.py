"""The trainer's batch stream: dataset → bucketed batches for this data-parallel rank → device, with the CP batch
contract (every rank of a CP group gets the same batch; DP groups get different ones) checked at startup.

One cache (data.cache_dir), several (data.datasets: a `MixedDataset` drawn by weight or repeats, each with its own
caption dropout), or synthetic data; a fixed batch size (train.batch_size) or one per bucket from a token budget
(train.batch_tokens: an image bucket takes many samples, a long clip one)."""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..config import Recipe
from ..errors import UserError
from .dataset import SAMPLE_WEIGHT, BucketBatchSampler, CachedLatentDataset, CacheReads, MixedDataset, Share, collate
from .synthetic_latents import SyntheticLatentDataset


class Family(Protocol):
    """What the batch stream needs of a family's spec (train/models/spec.py `FamilySpec`; data knows no family)."""

    name: str
    batch_keys: tuple[str, ...]
    shared_text_length: bool

    def tokens_per_sample(self, latents_shapes: Mapping[str, Sequence[int]], model_config: Any) -> int: ...


def build_dataset(recipe: Recipe, spec: Family, reads: CacheReads | None = None):
    """The recipe's dataset: synthetic, the cache `train.prepare` wrote, or several (data.datasets), each checked at
    once against what the family reads (`reads`, from train.models.cache_reads; without it only the cache's family
    name is checked)."""
    data = recipe.data
    if data.synthetic is not None:
        missing = [k for k in spec.batch_keys if k not in data.synthetic.shapes]
        if missing:
            raise UserError(f"data.synthetic.shapes lacks {missing}: family {spec.name} reads {list(spec.batch_keys)}")
        return SyntheticLatentDataset(data.synthetic.num_samples, data.synthetic.shapes, recipe.train.seed,
                                      getattr(torch, recipe.model.dtype))  # fmt: skip
    if data.datasets is not None:  # checked now, each: files, sizes, family, keys
        parts = []
        for k, (d, name) in enumerate(zip(data.datasets, data.dataset_names())):
            try:
                parts.append(CachedLatentDataset(d.cache_dir, family=reads or recipe.model.family))
            except UserError as e:  # its messages say data.cache_dir: name the entry of the list
                raise type(e)(f"data.datasets[{k}] ({name}): {e}") from None
        return MixedDataset(parts, data.dataset_names())
    if data.cache_dir is None:
        raise UserError("set data.cache_dir (written by `python -m train.prepare`), data.datasets or data.synthetic")
    # checked now: files, sizes, family, keys
    return CachedLatentDataset(data.cache_dir, family=reads or recipe.model.family)


def caption_dropouts(dataset, recipe: Recipe) -> list[float]:
    """The caption dropout of each dataset of a mixture (its own, else train.caption_dropout); one dataset: [that]."""
    p = recipe.train.caption_dropout
    if not isinstance(dataset, MixedDataset):
        return [p]
    return [p if d.caption_dropout is None else d.caption_dropout for d in recipe.data.datasets]


def bucket_tokens(dataset, spec: Family, model_config: Any) -> Callable[[str], int]:
    """`tokens_of(bucket)` for train.batch_tokens: the transformer tokens of one sample of the bucket, from the
    per-sample shapes the data declares (a cache's manifest, the synthetic shapes) and the family's
    `tokens_per_sample` with the transformer's config (its patch size): known before the model is built."""

    def tokens_of(bucket: str) -> int:
        shapes = dataset.shapes if isinstance(dataset, SyntheticLatentDataset) else dataset.bucket_shapes(bucket)
        return spec.tokens_per_sample(shapes, model_config)

    return tokens_of


def check_text_lengths(dataset, spec: Family, recipe: Recipe, batch_sizes: Mapping[str, int] | None = None) -> None:
    """A family that packs one unpadded text layout per batch (`spec.shared_text_length`) cannot batch captions of
    different token lengths, nor swap in the empty caption (caption dropout) unless it has their length. Refuse such a
    recipe at startup, from the caches' manifests (the same on every rank), instead of failing at some later step.
    Batches are cut per bucket: each bucket with batches of more than one sample (`batch_sizes`, the sampler's; None:
    train.batch_size for all) needs one length."""
    if not spec.shared_text_length or not isinstance(dataset, CachedLatentDataset | MixedDataset):
        return
    parts = dataset.parts if isinstance(dataset, MixedDataset) else [dataset]
    dropouts = caption_dropouts(dataset, recipe)
    lengths: dict[str, set[int]] = {}
    for part, p in zip(parts, dropouts):
        empty = part.empty_prompt_length() if p > 0 else None
        for bucket, n in zip(part.buckets, part.text_lengths()):
            if (batch_sizes or {}).get(bucket, recipe.train.batch_size) > 1:
                lengths.setdefault(bucket, set()).update({n} if empty is None else {n, empty})
    bucket, worst = max(lengths.items(), key=lambda kv: len(kv[1]), default=(None, set()))
    if len(worst) > 1:
        which = "this cache's" if len(parts) == 1 else f"bucket {bucket}'s (data.datasets)"
        raise UserError(
            f"{spec.name} packs one text layout per batch (no text mask), but {which} captions (and the empty "
            f"caption, with caption dropout) have {len(worst)} different token lengths {sorted(worst)[:8]}: set "
            "train.batch_size: 1 (and no train.batch_tokens) and raise train.grad_accum for a larger effective batch"
            + (", or train.caption_dropout: 0" if max(dropouts) > 0 else "")
        )


def check_masks(dataset, rank: int = 0) -> None:
    """A cache prepared with `data.mask_column` records each sample's mean mask (train.prepare): every sample's mask
    all black trains nothing (loss and gradients 0 at every step) and is refused; some samples' all black is a warning
    (rank 0). Caches without the record (no masks, or older caches) are not checked."""
    parts = dataset.parts if isinstance(dataset, MixedDataset) else [dataset]
    caches = [p for p in parts if isinstance(p, CachedLatentDataset)]
    known = [(c, [s["mask_mean"] for s in c.samples if "mask_mean" in s]) for c in caches]
    known = [(c, means) for c, means in known if means]
    if not known:
        return
    zero = [(c, sum(m == 0 for m in means), len(means)) for c, means in known]
    fix = "white (255 in the red channel) marks what trains: check data.mask_column's masks (inverted?)"
    if all(n == total for _, n, total in zero) and sum(t for _, _, t in zero) == len(dataset):
        raise UserError(f"every sample's loss mask is all black ({', '.join(str(c.cache_dir) for c in caches)}): the "
                        f"loss and gradients would be 0 at every step and the export the base; {fix}")  # fmt: skip
    for cache, n, total in zero:
        if n and rank == 0:
            print(f"warning: {n} of {total} samples of {cache.cache_dir} have an all-black loss mask and train "
                  f"nothing; {fix}", file=sys.stderr, flush=True)  # fmt: skip


class Batches:
    """Infinite iterator of collated batches on `device`; its position is part of every checkpoint.

    `caption_dropout`: the rate of each dataset (`caption_dropouts`); `tokens`: each bucket's tokens per sample
    (train.batch_tokens), for `describe`."""

    def __init__(
        self,
        dataset,
        sampler: BucketBatchSampler,
        device: torch.device,
        caption_dropout: float | Sequence[float] = 0.0,
        tokens: Mapping[str, int] | None = None,
        loss_weights: Sequence[float] | None = None,
    ) -> None:
        self.dataset, self.sampler, self.device = dataset, sampler, device
        self.loss_weights = list(loss_weights) if loss_weights is not None else None  # per dataset of a mixture
        self.mixed = isinstance(dataset, MixedDataset)
        self._it = iter(sampler)
        self._empty = dataset.empty_prompts() if self.mixed else [dataset.empty_prompt()]
        self.dropout = [float(caption_dropout)] if isinstance(caption_dropout, int | float) else list(caption_dropout)
        self.tokens = dict(tokens) if tokens is not None else None
        self.drawn = [0] * len(self._empty)  # a mixture: the whole job's samples of each dataset so far

    def __next__(self) -> dict[str, torch.Tensor]:
        return self.take()[0]

    def _part(self, i: int) -> int:
        return self.dataset.part_of(i)[0] if self.mixed else 0

    def take(self, gen: torch.Generator | None = None) -> tuple[dict[str, torch.Tensor], list[str]]:
        """The next batch and the ids of its samples; given the step's generator `gen`, with caption dropout (each
        sample at its dataset's rate). The ids stay out of the batch, which holds only what the model reads (family
        specs, caption dropout and the contract hash see tensors only); errors name the data with them."""
        indices = next(self._it)
        if self.mixed:  # every DP group's samples at this position: the same count on every rank
            for i in self.sampler.job_batch():
                self.drawn[self._part(i)] += 1
        batch = {k: v.to(self.device) for k, v in collate([self.dataset[i] for i in indices]).items()}
        if self.loss_weights is not None:  # data.datasets[].loss_weight: each sample's, for the step's loss
            batch[SAMPLE_WEIGHT] = torch.tensor([self.loss_weights[self._part(i)] for i in indices], device=self.device)
        if gen is not None:
            batch = self.caption_dropout(batch, [self.dropout[self._part(i)] for i in indices], gen, indices)
        return batch, self.sample_ids(indices)

    def sample_ids(self, indices: list[int]) -> list[str]:
        """`#<dataset index>`, plus the sample file under data.cache_dir for cached data (a mixture: the dataset's
        name and the file)."""
        if self.mixed:
            return [f"#{i} ({self.dataset.sample_id(i)})" for i in indices]
        if isinstance(self.dataset, CachedLatentDataset):
            return [f"#{i} ({self.dataset.samples[i]['file']})" for i in indices]
        return [f"#{i}" for i in indices]

    def contributions(self) -> dict[str, int]:
        """A mixture: `samples/<name>`, the samples of each dataset the whole job has trained on so far (for the
        metrics line and the report); nothing for one dataset."""
        return {f"samples/{n}": c for n, c in zip(self.dataset.names, self.drawn)} if self.mixed else {}

    def describe(self) -> dict[str, Any]:
        """What the run trains on, for layout.json and the report: per bucket its samples per epoch, batch size (and
        tokens per sample with train.batch_tokens); a mixture's datasets with their settings and samples per epoch
        (weighted: the mean over epochs, e.g. 0.32, as each epoch's quota is carried over from the last)."""
        s = self.sampler
        buckets = {b: {"samples_per_epoch": n, "batch_size": s.batch_sizes[b],
                       **({"tokens_per_sample": self.tokens[b]} if self.tokens else {})}
                   for b, n in s.counts.items()}  # fmt: skip
        out: dict[str, Any] = {"batches_per_epoch": len(s), "buckets": buckets}
        if self.mixed:
            out["datasets"] = [{"name": name, "cache_dir": str(part.cache_dir), "samples": len(part),
                                "repeats": None if share.weight is not None else share.repeats, "weight": share.weight,
                                "caption_dropout": p, "samples_per_epoch": n,
                                **({"loss_weight": w} if w is not None else {})}
                               for name, part, share, p, n, w in zip(self.dataset.names, self.dataset.parts,
                                                                     s.shares, self.dropout, s.plan(),
                                                                     self._weights())]  # fmt: skip
        return out

    def _weights(self) -> list[float | None]:
        """Each dataset's loss weight (data.datasets[].loss_weight), None for all when none sets one."""
        return self.loss_weights if self.loss_weights is not None else [None] * len(self._empty)

    def _caches(self) -> list[CachedLatentDataset]:
        if self.mixed:
            return self.dataset.parts
        return [self.dataset] if isinstance(self.dataset, CachedLatentDataset) else []

    def state_dict(self) -> dict:
        """The sampler's position, and (a cache) the data's fingerprint (`CachedLatentDataset.fingerprint`); a
        mixture: each cache's, and the samples drawn from each so far."""
        state = self.sampler.state_dict()
        if self.mixed:
            state |= {"caches": [c.fingerprint() for c in self._caches()],
                      "drawn": dict(zip(self.dataset.names, self.drawn))}  # fmt: skip
        elif self._caches():
            state["cache"] = self.dataset.fingerprint()
        return state

    def resume_notes(self, saved: dict, step: int) -> list[str]:
        """The saved data state (a checkpoint's `data`) against this run's, before any weights are read: a cache of
        another size (the epoch's order cannot continue) is a UserError; a cache whose captions or samples changed
        at the same size is a note (the run continues on the new data, and says so)."""
        was = saved.get("caches") or ([saved["cache"]] if "cache" in saved else [])
        now = [c.fingerprint() for c in self._caches()]
        if not now or not was:
            return []
        if len(was) != len(now):
            raise UserError(f"resume: the checkpoint of step {step} trained on {len(was)} caches, this run reads "
                            f"{len(now)}: resume with its data, or start a new run (another output_dir, or "
                            "--archive-previous)")  # fmt: skip
        notes = []
        for k, (w, fp) in enumerate(zip(was, now)):
            which = f"data.datasets[{k}]" if self.mixed else "data.cache_dir"
            if w["samples"] != fp["samples"]:
                raise UserError(f"resume: the checkpoint of step {step} trained on a cache of {w['samples']} samples "
                                f"({w['cache_dir']}), {which} ({fp['cache_dir']}) now holds {fp['samples']}: its "
                                "epoch order cannot continue; resume with that cache, or start a new run (another "
                                "output_dir, or --archive-previous)")  # fmt: skip
            changed = [what for what in ("captions", "content") if w[what] != fp[what]]
            if changed:
                said = {"captions": "its captions", "content": "its samples (files, sizes or encoding settings)"}
                cache = f"the cache of {which} ({self.dataset.names[k]})" if self.mixed else "the cache"
                notes.append(f"data: {cache} changed since step {step} ({' and '.join(said[c] for c in changed)}, "
                             f"same sample count {fp['samples']}): training continues on the new data at the same "
                             "position")  # fmt: skip
        return notes

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
        if self.mixed:
            drawn = state.get("drawn", {})
            self.drawn = [int(drawn.get(name, 0)) for name in self.dataset.names]
        self._it = iter(self.sampler)

    def caption_dropout(
        self, batch: dict, p: float | Sequence[float], gen: torch.Generator, indices: Sequence[int] | None = None
    ) -> dict:
        """Replace whole captions by the empty caption's embeddings with probability p (one rate, or each sample's),
        drawn from the step's generator, so CP peers drop the same captions; no draw when every rate is 0. `indices`
        (the batch's dataset indices): each sample gets its own cache's empty caption (a mixture); else the first's."""
        n = batch["latents"].shape[0]
        rates = torch.tensor([float(p)] * n if isinstance(p, int | float) else list(p))
        if not (rates > 0).any():
            return batch
        drop = torch.rand(n, generator=gen) < rates
        if not drop.any():
            return batch
        parts = [self._part(i) for i in indices] if indices is not None else [0] * n
        out = dict(batch)
        for key in self._empty[0]:
            if key in batch:  # each sample's own cache's empty caption; the same (L, D) as its items: padded alike
                e = torch.stack([self._empty[k][key] for k in parts]).to(batch[key].device, batch[key].dtype)
                out[key] = torch.where(drop.view(-1, *[1] * (e.dim() - 1)).to(e.device), e, batch[key])
        return out

    def check_contract(self, mesh) -> None:
        """Hash the next batch (without consuming it) and compare across ranks: equal inside a CP group, else an
        error; equal across DP groups only when the dataset is too small to differ (a warning)."""
        state = self.state_dict()
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


def make_batches(
    dataset,
    recipe: Recipe,
    dp_rank: int,
    dp_size: int,
    device: torch.device,
    exclude: frozenset[int] = frozenset(),
    tokens_of: Callable[[str], int] | None = None,
) -> Batches:
    """The batch stream of data-parallel group `dp_rank`. `exclude`: dataset indices never trained on (a held-out
    split); `tokens_of(bucket)` (`bucket_tokens`): needed with train.batch_tokens, each bucket's batch size being
    max(1, batch_tokens // its tokens per sample)."""
    t, data = recipe.train, recipe.data
    size: int | dict[str, int] = t.batch_size
    tokens = None
    if t.batch_tokens is not None:
        assert tokens_of is not None, "train.batch_tokens: make_batches needs tokens_of (bucket_tokens)"
        tokens = {b: tokens_of(b) for b in sorted(set(dataset.buckets))}
        # e.g. a budget of 36 tokens: a 6-token image bucket takes 6 samples per batch, a 30-token clip bucket 1
        size = {b: max(1, t.batch_tokens // n) for b, n in tokens.items()}
    shares = ()
    if isinstance(dataset, MixedDataset):
        shares = [Share(len(part), d.repeats or 1, d.weight) for part, d in zip(dataset.parts, data.datasets)]
    sampler = BucketBatchSampler(dataset.buckets, size, dp_rank=dp_rank, dp_size=dp_size, seed=t.seed,
                                 shuffle=data.shuffle, exclude=exclude, shares=shares)  # fmt: skip
    weights = None  # a batch holds each sample's loss weight only when some dataset sets one: else unchanged
    if isinstance(dataset, MixedDataset) and any(d.loss_weight is not None for d in data.datasets):
        weights = [d.loss_weight if d.loss_weight is not None else 1.0 for d in data.datasets]
    return Batches(dataset, sampler, device, caption_dropout=caption_dropouts(dataset, recipe), tokens=tokens,
                   loss_weights=weights)  # fmt: skip
