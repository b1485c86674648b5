"""Z-Image's data encoder: FLUX.1's latents (the same VAE and normalisation), ZImagePipeline._encode_prompt's caption
features (Qwen3, chat template, hidden_states[-2], padding dropped), stored first at a fixed length with their mask."""

from __future__ import annotations

import torch

from train.data.media import Geometry
from train.models.flux.encoder import FluxEncoder


class ZImageEncoder(FluxEncoder):
    name = "zimage"
    default_text_tokens = 512  # ZImagePipeline.__call__(max_sequence_length=512)
    default_geometry = Geometry("zimage", "image", 16)

    def encode_text(self, caption, max_tokens):
        (kept,) = self.pipe._encode_prompt(prompt=[caption], device=self.device, max_sequence_length=max_tokens)
        embeds = kept.new_zeros(max_tokens, kept.shape[-1])
        embeds[: len(kept)] = kept
        mask = torch.zeros(max_tokens, dtype=torch.bool)
        mask[: len(kept)] = True
        return {"prompt_embeds": embeds, "prompt_mask": mask}
