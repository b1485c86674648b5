"""Cosmos Predict 2.5's data encoder: Wan 2.1 VAE latents normalised as Cosmos2_5_PredictBasePipeline does, the
pipeline's Qwen2.5-VL (Cosmos-Reason1) prompt embeddings, and each clip's clean conditioning frames."""

from __future__ import annotations

import zlib

import torch

from train.data.media import Geometry
from train.models.encoder import mean_std_normalise
from train.models.wan.encoder import WanEncoder

# How many latent frames of a clip are clean conditioning (0 text2world, 1 image2world, 2 video2world), with the
# released Predict 2.5 training config's probabilities (cosmos-predict2.5: conditional_frames_probs).
CONDITION_FRAMES_PROBS = {0: 0.5, 1: 0.25, 2: 0.25}
SYSTEM_PROMPT = "You are a helpful assistant who will provide prompts to an image generator."


class NoGuardrail:
    """A pass-through safety checker, for loading Cosmos2_5_PredictBasePipeline where ``cosmos_guardrail`` is not
    installed (its constructor raises then): encoding data never calls it; validation samples are then NOT screened."""

    def to(self, *args, **kwargs):
        return self

    def check_text_safety(self, prompt: str) -> bool:
        return True


def conversation(caption: str) -> list[dict]:
    """The chat ``Cosmos2_5_PredictBasePipeline._get_prompt_embeds`` tokenizes for one prompt."""
    return [
        {"role": "system", "content": [{"type": "text", "text": SYSTEM_PROMPT}]},
        {"role": "user", "content": [{"type": "text", "text": caption}]},
    ]


def condition_frames(generator: torch.Generator | None, pixels: torch.Tensor, latent_frames: int) -> int:
    """The item's number of clean conditioning latent frames, drawn from CONDITION_FRAMES_PROBS with the item's
    generator (after the VAE sample), or, without one (``data.latent_sample: mode``), with one seeded from the clip's
    bytes: the same clip always gets the same count. At most ``latent_frames - 1`` (an image gets none)."""
    if generator is None:
        generator = torch.Generator().manual_seed(zlib.crc32(pixels.float().cpu().numpy().tobytes()))
    u, edge = float(torch.rand(1, generator=generator, device=generator.device)), 0.0
    for count, p in CONDITION_FRAMES_PROBS.items():
        edge += p
        if u < edge:
            return min(count, latent_frames - 1)
    return min(max(CONDITION_FRAMES_PROBS), latent_frames - 1)


class CosmosEncoder(WanEncoder):
    """latents ``(z - latents_mean) * (1 / latents_std)`` (C, F, H, W); ``condition_mask`` (F,) bool, True on the
    clean conditioning frames (a prefix), whose latents are the posterior MODE as the pipeline's ``prepare_latents``
    encodes its conditioning video (``sample_mode="argmax"``); text ``_get_prompt_embeds`` (every Qwen2.5-VL layer's
    hidden states, each normalised, concatenated: (512, 28 x 3584) for Cosmos-Reason1-7B) + the tokenizer's mask."""

    name = "cosmos"
    validation_image = "optional"  # the pipeline's `image`: image2world when given, text2world without
    default_geometry = Geometry("cosmos", "video", 16, 4, 1)

    def pipeline_components(self, pretrained_path, revision):
        from diffusers.utils import is_cosmos_guardrail_available

        return {} if is_cosmos_guardrail_available() else {"safety_checker": NoGuardrail()}

    def encode_text(self, caption, max_tokens):
        embeds = self.pipe._get_prompt_embeds(prompt=[caption], max_sequence_length=max_tokens, device=self.device)
        ids = self.pipe.tokenizer.apply_chat_template(
            conversation(caption), tokenize=True, add_generation_prompt=False, add_vision_id=False,
            max_length=max_tokens, truncation=True, padding="max_length", return_dict=True,
        )  # fmt: skip
        return {"prompt_embeds": embeds[0], "prompt_mask": torch.tensor(ids["attention_mask"], dtype=torch.bool)}

    def encode_media(self, pixels, generator, mode, fps):
        vae = self.pipe.vae
        posterior = vae.encode(pixels.unsqueeze(0).to(self.device, vae.dtype)).latent_dist
        z = posterior.sample(generator) if mode == "sample" else posterior.mode()
        cfg = vae.config
        latents = mean_std_normalise(z, cfg.latents_mean, cfg.latents_std)[0]
        count = condition_frames(generator, pixels, latents.shape[1])
        # The causal VAE encodes latent frame k from pixel frames up to 4k only: the pipeline's conditioning video
        # (this clip's first 4 (count - 1) + 1 frames, padded) gives these frames' posterior, whose mode it keeps.
        latents[:, :count] = mean_std_normalise(posterior.mode(), cfg.latents_mean, cfg.latents_std)[0, :, :count]
        mask = torch.zeros(latents.shape[1], dtype=torch.bool)
        mask[:count] = True
        return {"latents": latents, "condition_mask": mask}
