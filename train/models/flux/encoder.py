"""FLUX.1's data encoder: ``(z - shift_factor) * scaling_factor`` latents, T5 + CLIP-pooled `encode_prompt`."""

from __future__ import annotations

from train.data.media import Geometry
from train.models.encoder import FamilyEncoder


class FluxEncoder(FamilyEncoder):
    name = "flux"
    default_text_tokens = 512  # FluxPipeline.__call__(max_sequence_length=512); schnell checkpoints use 256
    default_geometry = Geometry("flux", "image", 16)
    latent_strides = (16, 1, 8)

    def _geometry(self, vae_config, tr_config):
        # FluxPipeline.check_inputs: multiples of vae_scale_factor * 2 (latents are packed in 2x2 patches)
        return 2 ** (len(vae_config.get("block_out_channels", (0,) * 4)) - 1) * 2, 1, 0

    def encode_text(self, caption, max_tokens):
        embeds, pooled, _ = self.pipe.encode_prompt(
            prompt=[caption], prompt_2=None, device=self.device, max_sequence_length=max_tokens
        )
        mask = self._t5_mask(self.pipe.tokenizer_2, caption, max_tokens)
        return {"prompt_embeds": embeds[0], "prompt_mask": mask, "pooled_embeds": pooled[0]}

    def encode_media(self, pixels, generator, mode, fps):
        cfg = self.pipe.vae.config
        z = self._vae_encode(pixels[:, 0].unsqueeze(0), generator, mode)
        return {"latents": ((z - cfg.shift_factor) * cfg.scaling_factor)[0]}
