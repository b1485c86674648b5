"""The held-out loss (`validation_loss`): the training objective on samples the run never trains on, comparable
across steps and runs.

Held out: another cache (`validation_loss.cache_dir`, evaluated whole), or a seeded share of the training cache
(`fraction`: `split`, whose indices the training sampler excludes). Sample i (its index in the held-out set's own
dataset) is evaluated alone, at the sigmas and noise drawn from a generator seeded by (train.seed, i): the same every
evaluation, whatever the step, the layout or the number of ranks. The value is the mean over the held-out samples.

Under CP every rank of a CP group evaluates the same sample (its forward is the CP forward); data-parallel groups take
every dp-th sample. Every rank runs the same number of forwards (FSDP's all-gathers span the whole mesh): a group
with fewer samples pads with a repeat that counts zero.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from train.data.dataset import CachedLatentDataset, CacheReads, collate, read_manifest
from train.errors import UserError
from train.step import Objective, micro_batch_loss
from train.validation import inference


def split(n: int, fraction: float, seed: int) -> list[int]:
    """The training-cache indices held out: round(fraction · n) of them (at least 1, leaving at least 1 to train),
    chosen by a generator seeded with `seed` (the same on every rank), sorted."""
    k = max(1, round(fraction * n))
    if k >= n:
        raise UserError(f"validation_loss.fraction {fraction:g} of {n} sample(s) leaves none to train on: lower it, "
                        "or give a cache of its own (validation_loss.cache_dir)")  # fmt: skip
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + 17)).tolist()
    return sorted(order[:k])


def _key_shapes(recipe) -> dict[str, set[tuple[int, ...]]]:
    """Every key the training data holds, with the per-sample shapes it has (synthetic shapes, or each bucket's in
    the training caches' manifests)."""
    if recipe.data.synthetic is not None:
        return {k: {tuple(v)} for k, v in recipe.data.synthetic.shapes.items()}
    out: dict[str, set[tuple[int, ...]]] = {}
    for cache in recipe.data.cache_dirs():
        for tensors in read_manifest(cache).get("tensors", {}).values():
            for key, t in tensors.items():
                out.setdefault(key, set()).add(tuple(t["shape"]))
    return out


def check_cache(recipe, spec, model_config) -> None:
    """`validation_loss.cache_dir` checked at startup as the training cache is (before any process group exists):
    its family (when opened), the CP degree against its samples' tokens, and that it holds what the model is trained
    on: each key of the training data, of the same rank, with the same channels (dim 0 of a noised stream) and width
    (the last dim of the text embeddings and other conditioning). A UserError naming the first difference."""
    from train.cp.enable import check_tokens

    cache = recipe.validation_loss.cache_dir
    where = f"validation_loss.cache_dir {cache}"
    try:
        tensors = read_manifest(cache).get("tensors", {})
    except UserError as e:
        raise UserError(f"{where}: {e}") from None
    if recipe.parallel.cp > 1:
        try:
            check_tokens(recipe.parallel.cp, spec, {b: {s: t[s]["shape"] for s in spec.streams if s in t}
                                                   for b, t in tensors.items()}, model_config)  # fmt: skip
        except UserError as e:
            raise UserError(f"{where}: {e}") from None
    trained = _key_shapes(recipe)
    for bucket, held in tensors.items():
        for key, shapes in trained.items():
            if key not in held:
                raise UserError(f"{where}: bucket {bucket} lacks {key}, which the training data holds: prepare the "
                                "held-out media with the training cache's recipe")  # fmt: skip
            have, like = tuple(held[key]["shape"]), sorted(shapes)[0]
            dim = 0 if key in spec.streams else -1  # a stream's channels; the text's width
            if len(have) != len(like) or (len(like) > 1 and have[dim] not in {s[dim] for s in shapes}):
                what = "rank" if len(have) != len(like) else "channels" if dim == 0 else "width"
                raise UserError(f"{where}: {key} of bucket {bucket} has shape {list(have)}, the training data's "
                                f"{list(like)}: another {what} (another model or text encoder); prepare the held-out "
                                "media with the training cache's recipe")  # fmt: skip


def sample_generator(seed: int, index: int) -> torch.Generator:
    """Sample `index`'s noise and sigmas: a function of the seed and the index only (never of the step)."""
    return torch.Generator().manual_seed(hash((seed, index, 0x5EED)) & 0x7FFF_FFFF_FFFF_FFFF)


class HeldOutLoss:
    """`at_step(model, step)` after every step (every rank): the held-out loss when due, else None."""

    def __init__(self, cfg, max_steps: int, seed: int, dataset, indices: list[int], excluded: frozenset[int], spec,
                 mesh, device: torch.device, amp: torch.dtype | None, objective: Objective) -> None:  # fmt: skip
        self.cfg, self.max_steps, self.seed, self.excluded = cfg, max_steps, seed, excluded
        self.dataset, self.spec, self.device, self.amp, self.objective = dataset, spec, device, amp, objective
        indices = indices[: cfg.max_samples] if cfg.max_samples else indices
        dp, rank = mesh.dims.dp, mesh.dp_rank
        per_group = math.ceil(len(indices) / dp)
        mine = indices[rank::dp]
        # (index, weight): the pad repeats a sample with weight 0, so every group runs per_group forwards
        self.mine = [(i, 1.0) for i in mine] + [(indices[0], 0.0)] * (per_group - len(mine))
        self.cp = mesh.dims.cp
        self.count = len(indices)

    @classmethod
    def of(cls, recipe, spec, dataset, reads: CacheReads | str, mesh, device: torch.device,
           amp: torch.dtype | None) -> HeldOutLoss | None:  # fmt: skip
        """The recipe's held-out loss, or None. Its set: another cache (checked like the training cache: files,
        family, keys), or `split` of the training dataset, whose indices (`excluded`) the training sampler skips."""
        cfg, t = recipe.validation_loss, recipe.train
        if cfg is None:
            return None
        if cfg.cache_dir is not None:
            held = CachedLatentDataset(cfg.cache_dir, family=reads)
            indices, excluded = list(range(len(held))), frozenset()
        else:
            held, indices = dataset, split(len(dataset), cfg.fraction, t.seed)
            excluded = frozenset(indices)
        objective = dataclasses.replace(Objective.of(recipe, spec), preservation=0.0)  # the plain flow-matching loss
        return cls(cfg, t.max_steps, t.seed, held, indices, excluded, spec, mesh, device, amp, objective)

    def due(self, step: int) -> bool:
        """Multiples of every_n_steps and the last step; step 0 with at_start (the trainer asks for it on a fresh run
        only: a resumed run's value at its checkpoint step was logged before it)."""
        if step == 0:
            return self.cfg.at_start
        return step % self.cfg.every_n_steps == 0 or step == self.max_steps

    def at_step(self, model: torch.nn.Module, step: int, watchdog=None) -> float | None:
        """The held-out loss of the model's weights now (a collective), when `step` is due; else None. The watchdog
        (train/runtime.py) is re-armed per sample: a held-out set of any size never reads as a hang."""
        if not self.due(step):
            return None
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        with inference(model):  # eval mode (no adapter dropout), no autograd graph
            self._evaluate(model, total, step, watchdog)
        # Over every rank: each CP peer of a group holds the same values, so the sum counts each sample cp times.
        dist.all_reduce(total)
        return float(total) / (self.count * self.cp)

    def _evaluate(self, model: torch.nn.Module, total: torch.Tensor, step: int, watchdog) -> None:
        for index, weight in self.mine:
            if watchdog is not None:
                watchdog.phase("validation_loss", step)
            batch = {k: v.to(self.device) for k, v in collate([self.dataset[index]]).items()}
            loss = micro_batch_loss(model, self.spec, batch, self.objective, sample_generator(self.seed, index),
                                    self.amp)  # fmt: skip
            total += weight * loss.double()
