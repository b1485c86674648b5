"""Kandinsky 5 T2V's data encoder: the HunyuanVideo VAE's latents times its scaling factor, the pipeline's own
`encode_prompt` (Qwen2.5-VL states of its prompt template after the template crop, unpadded; CLIP's pooled output)."""

from __future__ import annotations

import torch

from train.data.media import Geometry
from train.models.encoder import FamilyEncoder, load_processor_without_video


def load_processor(path: str, subfolder: str = "tokenizer", revision: str | None = None):
    """The checkpoint's Qwen2VLProcessor (its `tokenizer` component) less the video processor, which the text-only
    prompt encoding never uses; loads where torchvision is missing."""
    return load_processor_without_video("Qwen2VLProcessor", path, subfolder, revision)


class Kandinsky5Encoder(FamilyEncoder):
    """latents ``z * scaling_factor`` (C, F, H, W); text: ``encode_prompt``'s Qwen2.5-VL states (L, D) unpadded, an
    all-true mask (L,) and CLIP's pooled embedding (768,)."""

    name = "kandinsky5"
    default_text_tokens = 512  # Kandinsky5T2VPipeline.__call__(max_sequence_length=512): tokens after the crop
    default_geometry = Geometry("kandinsky5", "video", 16, 4, 1)
    latent_strides = (16, 4, 8)

    def pipeline_components(self, pretrained_path, revision):
        return {"tokenizer": load_processor(pretrained_path, revision=revision)}

    def _geometry(self, vae_config, tr_config):
        # check_inputs: height and width multiples of 16 (x8 VAE, 2x2 patches); frames 4k + 1
        ratios = vae_config.get("spatial_compression_ratio", 8), vae_config.get("temporal_compression_ratio", 4)
        return self._patched_geometry(*ratios, tr_config)

    def encode_text(self, caption, max_tokens):
        # the pipeline's own: prompt_clean, the template, the crop at prompt_template_encode_start_idx, truncation to
        # max_sequence_length; one prompt is never padded (its cu_seqlens span it all)
        pipe = self.pipe
        qwen, pooled, cu_seqlens = pipe.encode_prompt(prompt=[caption], max_sequence_length=max_tokens,
                                                      device=self.device, dtype=pipe.text_encoder.dtype)  # fmt: skip
        assert int(cu_seqlens[-1]) == qwen.shape[1], (cu_seqlens, qwen.shape)
        mask = torch.ones(qwen.shape[1], dtype=torch.bool)
        return {"prompt_embeds": qwen[0], "prompt_mask": mask, "pooled_embeds": pooled[0]}

    def encode_media(self, pixels, generator, mode, fps):
        # Kandinsky5T2VPipeline decodes `latents / vae.config.scaling_factor` (no shift)
        z = self._vae_encode(pixels.unsqueeze(0), generator, mode)
        return {"latents": (z * self.pipe.vae.config.scaling_factor)[0]}
