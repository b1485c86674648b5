"""Krea 2's data encoder: ``(z - mean) / std`` latents of AutoencoderKLQwenImage on the (C, 1, H, W) layout, and
Krea2Pipeline.encode_prompt's text of one caption: the stack of tapped Qwen3-VL layers over the fixed-length block."""

from __future__ import annotations

from train.data.media import Geometry
from train.models.encoder import FamilyEncoder, mean_std_normalise


class Krea2Encoder(FamilyEncoder):
    name = "krea2"
    default_text_tokens = 512  # Krea2Pipeline.__call__(max_sequence_length=512): the fixed text block
    default_geometry = Geometry("krea2", "image", 16)
    latent_strides = (16, 1, 8)

    def latent_shapes(self, frames, height, width, fps):
        return {"latents": (16, 1, height // 8, width // 8)}  # the Qwen-Image VAE keeps a frame axis of 1

    def _geometry(self, vae_config, tr_config):
        # Krea2Pipeline: vae_scale_factor = 2 ** len(temperal_downsample), sides multiples of vae_scale_factor * 2
        return 2 ** len(vae_config.get("temperal_downsample", (False, True, True))) * 2, 1, 0

    def encode_text(self, caption, max_tokens):
        # encode_prompt of the caption alone: [prefix | caption | PAD | suffix] tokenized to max_sequence_length +
        # 29 tokens, the selected hidden states stacked per token, the 34 system-prefix tokens dropped. The block
        # is max_sequence_length tokens whatever the caption; the mask is False on the padding in its middle.
        embeds, mask = self.pipe.encode_prompt(prompt=[caption], device=self.device, max_sequence_length=max_tokens)
        return {"prompt_embeds": embeds[0], "prompt_mask": mask[0].bool().cpu()}

    def encode_media(self, pixels, generator, mode, fps):
        # the inverse of Krea2Pipeline's decode (latents * std + mean), on the (B, C, 1, H, W) layout its VAE takes
        cfg = self.pipe.vae.config
        z = self._vae_encode(pixels[:, :1].unsqueeze(0), generator, mode)
        return {"latents": mean_std_normalise(z, cfg.latents_mean, cfg.latents_std)[0]}
