"""Seeded random latents and text embeddings in the cache's item format, for tiny recipes and tests.

Shapes come from the recipe (`data.synthetic.shapes`, one entry per tensor the family reads), so this module knows
nothing about any family. Items depend only on (seed, index): every rank builds the same dataset.
"""

from __future__ import annotations

import torch


class SyntheticLatentDataset:
    def __init__(self, num_samples: int, shapes: dict[str, list[int]], seed: int, dtype: torch.dtype) -> None:
        if "latents" not in shapes:
            raise ValueError("data.synthetic.shapes needs a 'latents' entry (the per-sample latent shape)")
        self.num_samples, self.shapes, self.seed, self.dtype = num_samples, shapes, seed, dtype
        bucket = "x".join(str(n) for n in shapes["latents"])
        self.buckets = [bucket] * num_samples  # one shape bucket: every sample has the same shapes

    def __len__(self) -> int:
        return self.num_samples

    def _tensors(self, gen: torch.Generator, index: int) -> dict[str, torch.Tensor]:
        item = {}
        for key, shape in sorted(self.shapes.items()):
            if key.endswith("_mask"):
                item[key] = self.text_mask(shape, index)
            else:
                item[key] = torch.randn(shape, generator=gen).to(self.dtype)
        return item

    @staticmethod
    def text_mask(shape: list[int], index: int) -> torch.Tensor:
        """A right-padded key mask, as a tokenizer pads a short caption to its maximum length: about two thirds of
        the positions padded (more than any CP rank's share of the text, so a mask applied in the wrong key order
        hides kept tokens), a different count for consecutive samples (prompts of different lengths in one batch);
        the empty caption (index -1) keeps one token."""
        n = shape[-1]
        kept = 1 if index < 0 else min(n, max(1, n // 3 + index % (n // 4 + 1)))
        mask = torch.zeros(shape, dtype=torch.bool)
        mask[..., :kept] = True
        return mask

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self._tensors(torch.Generator().manual_seed(self.seed * 100_003 + index), index)

    def empty_prompt(self) -> dict[str, torch.Tensor]:
        """The 'empty caption' embeddings used for caption dropout (a fixed sample of its own)."""
        item = self._tensors(torch.Generator().manual_seed(self.seed * 100_003 - 1), -1)
        return {k: v for k, v in item.items() if k.startswith(("prompt", "pooled"))}
