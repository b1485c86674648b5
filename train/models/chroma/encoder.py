"""Chroma's data encoder: FLUX.1's latents (the same VAE and normalisation), T5 prompt embeddings encoded with the
tokenizer's mask (ChromaPipeline._get_t5_prompt_embeds)."""

from __future__ import annotations

from train.data.media import Geometry
from train.models.flux.encoder import FluxEncoder


class ChromaEncoder(FluxEncoder):
    name = "chroma"
    default_text_tokens = 512  # ChromaPipeline.__call__(max_sequence_length=512), its maximum
    default_geometry = Geometry("chroma", "image", 16)

    def encode_text(self, caption, max_tokens):
        embeds, _ = self.pipe._get_t5_prompt_embeds(prompt=[caption], max_sequence_length=max_tokens,
                                                    device=self.device)  # fmt: skip
        # the tokenizer's mask; the spec derives the pipeline's attention mask from it (one more token kept)
        return {"prompt_embeds": embeds[0], "prompt_mask": self._t5_mask(self.pipe.tokenizer, caption, max_tokens)}
