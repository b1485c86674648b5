"""Qwen-Image 2.1's data encoder: ``(z - mean) / std`` latents of AutoencoderKLQwenImage21 (RGBA input, a frame axis
of 1), QwenImage21Pipeline.encode_prompt's Qwen3-VL text of one caption."""

from __future__ import annotations

import torch

from train.data.media import Geometry
from train.models.encoder import FamilyEncoder, load_processor_without_video, mean_std_normalise


def load_processor(path: str, subfolder: str = "processor", revision: str | None = None):
    """The checkpoint's Qwen3VLProcessor less the video processor, which text-to-image prompts never use; loads where
    torchvision is missing. Its chat template (the pipeline counts the system turn's tokens with it) is the
    tokenizer's."""
    processor = load_processor_without_video("Qwen3VLProcessor", path, subfolder, revision)
    processor.chat_template = processor.chat_template or processor.tokenizer.chat_template
    return processor


class QwenImage21Encoder(FamilyEncoder):
    name = "qwenimage21"
    default_geometry = Geometry("qwenimage21", "image", 32)
    latent_strides = (64, 1, 16)

    def pipeline_components(self, pretrained_path, revision):
        return {"processor": load_processor(pretrained_path, revision=revision)}

    def latent_shapes(self, frames, height, width, fps):
        return {"latents": (64, 1, height // 16, width // 16)}  # the VAE keeps a frame axis of 1

    def text_tokens(self, max_text_tokens: int | None) -> int | None:
        return max_text_tokens  # None: the whole prompt, as encode_prompt returns it (it neither pads nor truncates)

    def _geometry(self, vae_config, tr_config):
        # QwenImage21Pipeline: vae_scale_factor = 16 (fixed), sizes rounded down to multiples of vae_scale_factor * 2
        return 16 * 2, 1, 0

    def encode_text(self, caption, max_tokens):
        # encode_prompt of the caption alone: the t2i template, Qwen3-VL's last decoder layer before its final norm,
        # the system turn dropped; one prompt is never padded, and no condition image fills a slot. A
        # data.max_text_tokens keeps the first rows (the pipeline itself never truncates).
        embeds, mask, image_pad_mask = self.pipe.encode_prompt(prompt=[caption], device=self.device)
        assert mask is None and not image_pad_mask.any(), (mask, image_pad_mask)
        embeds = embeds[0, :max_tokens]
        return {"prompt_embeds": embeds, "prompt_mask": torch.ones(embeds.shape[0], dtype=torch.bool)}

    def encode_media(self, pixels, generator, mode, fps):
        # QwenImage21Pipeline._encode_vae_image on the (B, 4, 1, H, W) RGBA layout: an RGB image converted to RGBA
        # (the pipeline's img.convert("RGBA")) is opaque, alpha 1 in [-1, 1]; then (z - mean) / std
        cfg = self.pipe.vae.config
        frame = pixels[:, :1]
        rgba = torch.cat([frame, torch.ones_like(frame[:1])])
        z = self._vae_encode(rgba.unsqueeze(0), generator, mode)
        return {"latents": mean_std_normalise(z, cfg.latents_mean, cfg.latents_std)[0]}
