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

    def _tensors(self, gen: torch.Generator) -> dict[str, torch.Tensor]:
        item = {}
        for key, shape in sorted(self.shapes.items()):
            if key.endswith("_mask"):
                mask = torch.ones(shape, dtype=torch.bool)
                mask[..., shape[-1] - shape[-1] // 4 :] = False  # padded tail, as a tokenizer pads a short caption
                item[key] = mask
            else:
                item[key] = torch.randn(shape, generator=gen).to(self.dtype)
        return item

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self._tensors(torch.Generator().manual_seed(self.seed * 100_003 + index))

    def empty_prompt(self) -> dict[str, torch.Tensor]:
        """The 'empty caption' embeddings used for caption dropout (a fixed sample of its own)."""
        item = self._tensors(torch.Generator().manual_seed(self.seed * 100_003 - 1))
        return {k: v for k, v in item.items() if k.startswith(("prompt", "pooled"))}
