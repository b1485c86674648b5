"""SkyReels-V2's data encoder: Wan's (the pipelines copy WanPipeline's VAE normalisation and UMT5 prompt embeddings),
plus the clip's fps index the transformer's fps embedding reads."""

from __future__ import annotations

import torch

from train.models.wan.encoder import WanEncoder

from .spec import fps_index


class SkyReelsV2Encoder(WanEncoder):
    """Wan's latents and UMT5 text; ``fps_index`` (1,): 0 for 16 fps clips, else 1 (the pipelines' ``fps_embeds``)."""

    name = "skyreels_v2"

    def encode_media(self, pixels, generator, mode, fps):
        out = super().encode_media(pixels, generator, mode, fps)
        out["fps_index"] = torch.tensor([float(fps_index(fps))])
        return out

    def encode_text(self, caption, max_tokens):
        from diffusers import WanPipeline

        # The SkyReels-V2 pipelines' `_get_t5_prompt_embeds` is copied from WanPipeline's, but their prompt_clean calls
        # ftfy unguarded (a NameError without it); Wan's, run on this pipeline's tokenizer and encoder, is the same
        # computation, ftfy applied when installed.
        embeds = WanPipeline._get_t5_prompt_embeds(self.pipe, prompt=[caption], max_sequence_length=max_tokens,
                                                   device=self.device)  # fmt: skip
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        mask = self._t5_mask(self.pipe.tokenizer, prompt_clean(caption), max_tokens)
        return {"prompt_embeds": embeds[0], "prompt_mask": mask}
