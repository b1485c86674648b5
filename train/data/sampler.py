"""Batches of sample indices, one shape bucket per batch, split across data-parallel groups.

The order depends only on (seed, epoch, dp_rank, dp_size): every rank of a CP group (same dp_rank) draws the same
batches, different DP groups draw different ones, and the position (epoch, batch) resumes exactly.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


class BucketBatchSampler:
    def __init__(self, buckets: list[str], batch_size: int, *, dp_rank: int, dp_size: int, seed: int,
                 shuffle: bool = True) -> None:  # fmt: skip
        self.buckets, self.batch_size = list(buckets), batch_size
        self.dp_rank, self.dp_size, self.seed, self.shuffle = dp_rank, dp_size, seed, shuffle
        self.epoch, self.position = 0, 0  # batches of this epoch already yielded on this rank
        by_bucket: dict[str, list[int]] = {}
        for i, b in enumerate(self.buckets):
            by_bucket.setdefault(b, []).append(i)
        self.by_bucket = dict(sorted(by_bucket.items()))
        if not self._epoch_batches(0):
            sizes = {b: len(ix) for b, ix in self.by_bucket.items()}
            raise ValueError(
                f"no full batch: batch_size {batch_size} × {dp_size} data-parallel groups needs more samples per "
                f"shape bucket than {sizes}"
            )

    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        """This DP rank's batches of `epoch`: full batches per bucket, dealt round-robin to the DP groups."""
        g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
        batches = []
        for indices in self.by_bucket.values():
            order = [indices[i] for i in torch.randperm(len(indices), generator=g)] if self.shuffle else indices
            usable = len(order) // (self.batch_size * self.dp_size) * self.batch_size * self.dp_size
            batches += [order[i : i + self.batch_size] for i in range(0, usable, self.batch_size)]
        if self.shuffle:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=g)]
        # Deal in groups of dp_size consecutive batches, so every DP rank gets the same number of batches.
        usable = len(batches) // self.dp_size * self.dp_size
        return batches[self.dp_rank : usable : self.dp_size]

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            batches = self._epoch_batches(self.epoch)
            while self.position < len(batches):
                self.position += 1
                yield batches[self.position - 1]
            self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}
