"""FLUX.2's data encoder: 2x2-patchified, batch-norm normalised latents; Mistral `encode_prompt` + the chat template's
mask."""

from __future__ import annotations

import torch

from train.data.media import Geometry
from train.models.encoder import FamilyEncoder


class Flux2Encoder(FamilyEncoder):
    name = "flux2"
    validation_image = "optional"  # Flux2Pipeline's `image`: optional reference images (train/validation.py)
    default_text_tokens = 512  # Flux2Pipeline.__call__(max_sequence_length=512)
    default_geometry = Geometry("flux2", "image", 16)
    latent_strides = (128, 1, 16)  # the encoder caches 2×2-patchified latents

    def _geometry(self, vae_config, tr_config):
        # Flux2Pipeline.check_inputs: multiples of vae_scale_factor * 2 (latents are 2x2-patchified)
        return 2 ** (len(vae_config.get("block_out_channels", (0,) * 4)) - 1) * 2, 1, 0

    def encode_text(self, caption, max_tokens):
        from diffusers.pipelines.flux2.pipeline_flux2 import format_input

        pipe = self.pipe
        embeds, _ = pipe.encode_prompt(prompt=[caption], device=self.device, max_sequence_length=max_tokens)
        ids = pipe.tokenizer.apply_chat_template(  # the tokenization _get_mistral_3_small_prompt_embeds runs
            format_input(prompts=[caption], system_message=pipe.system_message),
            add_generation_prompt=False,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            padding="max_length",
            truncation=True,
            max_length=max_tokens,
        )
        return {"prompt_embeds": embeds[0], "prompt_mask": ids["attention_mask"][0].bool()}

    def encode_media(self, pixels, generator, mode, fps):
        # Flux2Pipeline._encode_vae_image with the configured sampling: patchify 2x2, then the VAE's batch-norm stats
        pipe, vae = self.pipe, self.pipe.vae
        z = pipe._patchify_latents(self._vae_encode(pixels[:, 0].unsqueeze(0), generator, mode))
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(z.device, z.dtype)
        return {"latents": ((z - mean) / std)[0]}
