"""Qwen-Image 2.1's training spec: unpatched latents flattened into the joint [text | image] sequence, the image slots
of the Qwen3-VL prompt, the batch's text trimmed to its longest prompt, the prediction as the sequence's last H*W
tokens."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from train.lora_format import fused
from train.models import Batch, Config, Shapes, Streams
from train.models.qwenimage.lora_format import FORMAT
from train.models.qwenimage.spec import SCHEDULER_CONFIG as QWEN_IMAGE_SCHEDULER
from train.models.spec import Classes, FamilySpec, Patch, ShiftSpec, frozen, output_tensors, sigma_identity

# One image slot of the Qwen3-VL prompt stands for a 2x2 group of latent tokens (the transformer module's
# _IMG_TOKENS_PER_SLOT; QwenImage21Pipeline's append_target_slots).
TOKENS_PER_SLOT = 4


def build_inputs(batch: Batch, noisy_latents: Streams, timesteps: Streams, *, model_config: Config) -> dict[str, Any]:
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import QwenImage21Pipeline

    latents = noisy_latents["latents"]  # (B, C, 1, H, W)
    batch_size, channels, _, height, width = latents.shape
    embeds = batch["prompt_embeds"]
    mask = batch.get("prompt_mask")  # (the estimator's calibration instance has none: every token valid)
    if mask is not None:
        mask = mask.to(latents.device).bool()
        # encode_prompt pads a batch to its longest prompt, and here padding is not neutral (it moves the image
        # block's rope frame position): drop the columns the cache padded beyond that
        longest = int(mask.sum(dim=1).max())
        embeds, mask = embeds[:, :longest], mask[:, :longest]
        mask = None if bool(mask.all()) else mask.long()  # encode_prompt's int64 mask, None when nothing is padded
    # encode_prompt's image_pad_mask (no condition image: no slot in the prompt), then one slot per 2x2 group of
    # target latents (the pipeline's append_target_slots)
    slots = torch.zeros(batch_size, embeds.shape[1] + height * width // TOKENS_PER_SLOT, dtype=torch.bool,
                        device=latents.device)  # fmt: skip
    slots[:, embeds.shape[1] :] = True
    return {
        "hidden_states": QwenImage21Pipeline._pack_latents(latents, batch_size, channels, height, width),
        "timestep": timesteps["latents"],
        "encoder_hidden_states": embeds,
        "encoder_hidden_states_mask": mask,
        "img_shapes": [[(1, height, width)]] * batch_size,
        "img_mask": slots,
    }


def unpack_output(out: Any, latents_shapes: Shapes, *, model_config: Config) -> dict[str, torch.Tensor]:
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import QwenImage21Pipeline

    *_, height, width = latents_shapes["latents"]
    # the output covers the whole joint sequence; the pipeline keeps its last H*W tokens (the target image)
    target = output_tensors(out)[0][:, -height * width :]
    # vae_scale_factor=1: height/width are given in latent pixels. Returns (B, C, 1, H, W).
    return {"latents": QwenImage21Pipeline._unpack_latents(target, height, width, 1)}


# Full weights as ComfyUI's single file holds them (what `from_single_file`'s
# `convert_qwen_image21_transformer_checkpoint_to_diffusers` reads): diffusers' names, the SwiGLU's gate and up
# projections fused in one `gate_up`, gate rows first.
FULL_FORMAT = dataclasses.replace(FORMAT, full=fused(
    ("transformer_blocks.{0}.img_mlp.gate_layer", "transformer_blocks.{0}.img_mlp.proj"),
    "transformer_blocks.{0}.img_mlp.gate_up"))  # fmt: skip


def shift_seq_len(latents_shape: Sequence[int]) -> int:
    *_, height, width = latents_shape
    return height * width  # the pipeline's latents.shape[1]: one token per latent pixel


SPEC = FamilySpec(
    name="qwenimage21",
    lora_format=FULL_FORMAT,  # Qwen-Image's LoRA keys (the pipeline's QwenImageLoraLoaderMixin reads them)
    classes=Classes("QwenImage21Transformer2DModel", "QwenImage21Pipeline", "AutoencoderKLQwenImage21"),
    latent_kind="image",
    # Qwen/Qwen-Image-2.1 scheduler/scheduler_config.json (relevant keys), as third-party copies of the released file
    # state it (not found verbatim from Qwen): Qwen-Image's values, dynamic shifting. Its model_index.json has no
    # sample_sigmas (Qwen-Image-2.1-Turbo's has, with a non-shifting scheduler: an inference schedule).
    shift=ShiftSpec.linear_mu("diffusers.pipelines.qwenimage21.pipeline_qwenimage21", **QWEN_IMAGE_SCHEDULER),
    build_inputs=build_inputs,
    unpack_output=unpack_output,
    timestep_from_sigma=sigma_identity,
    patch=Patch((1, 1, 1)),  # the (1, H, W) grid, unpatched (patch_size 1)
    shift_seq_len=shift_seq_len,
    batch_keys=("latents", "prompt_embeds", "prompt_mask"),
    # the prefix KV cache runs its later steps on the target tokens alone, which the CP plan does not describe (the
    # CP processor refuses it): validation samples run the whole sequence every step, as training does
    validation_kwargs=frozen(use_kv_cache=False),
)
