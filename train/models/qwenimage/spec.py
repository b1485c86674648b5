"""Qwen-Image's training spec: 2x2-packed latents, image shapes for the rope, the text key-padding mask."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from train.models import Batch, Config, Shapes, Streams
from train.models.qwenimage.lora_format import FORMAT
from train.models.spec import Classes, FamilySpec, Patch, ShiftSpec, frozen, output_tensors, sigma_identity

# Qwen/Qwen-Image scheduler/scheduler_config.json (relevant keys): the FlowMatchEulerDiscreteScheduler defaults but
# these, dynamic shifting
SCHEDULER_CONFIG = frozen(max_shift=0.9, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")


def unused_params(model_config: Config) -> tuple[str, ...]:
    """Regexes (``re.fullmatch`` on parameter names) of the parameters the forward never uses: the last block's text
    output path (see the package docstring)."""
    last = int(model_config["num_layers"]) - 1
    return (
        rf"transformer_blocks\.{last}\.attn\.(add_q_proj|norm_added_q|to_add_out)\..*",
        rf"transformer_blocks\.{last}\.txt_mlp\..*",
    )


def build_inputs(batch: Batch, noisy_latents: Streams, timesteps: Streams, *, model_config: Config) -> dict[str, Any]:
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline

    latents = noisy_latents["latents"]  # (B, C, 1, H, W)
    batch_size, channels, _, height, width = latents.shape
    mask = batch.get("prompt_mask")
    if mask is not None and bool(mask.all()):
        mask = None  # as QwenImagePipeline.encode_prompt
    guidance = None
    if model_config.get("guidance_embeds", False):
        guidance = batch["guidance"].to(device=latents.device, dtype=torch.float32).reshape(-1).expand(batch_size)
    return {
        "hidden_states": QwenImagePipeline._pack_latents(
            latents.permute(0, 2, 1, 3, 4), batch_size, channels, height, width
        ),
        "timestep": timesteps["latents"],
        "guidance": guidance,
        "encoder_hidden_states": batch["prompt_embeds"],
        "encoder_hidden_states_mask": mask,
        "img_shapes": [[(1, height // 2, width // 2)]] * batch_size,
    }


def unpack_output(out: Any, latents_shapes: Shapes, *, model_config: Config) -> dict[str, torch.Tensor]:
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline

    *_, height, width = latents_shapes["latents"]
    # vae_scale_factor=1: height/width are given in latent pixels. Returns (B, C, 1, H, W).
    return {"latents": QwenImagePipeline._unpack_latents(output_tensors(out)[0].contiguous(), height, width, 1)}


def shift_seq_len(latents_shape: Sequence[int]) -> int:
    *_, height, width = latents_shape
    return (height // 2) * (width // 2)


SPEC = FamilySpec(
    lora_format=FORMAT,
    name="qwenimage",
    classes=Classes("QwenImageTransformer2DModel", "QwenImagePipeline", "AutoencoderKLQwenImage"),
    latent_kind="image",
    # train_dreambooth_lora_qwen_image.py default `--lora_layers`.
    lora_targets=("to_k", "to_q", "to_v", "to_out.0"),
    shift=ShiftSpec.linear_mu("diffusers.pipelines.qwenimage.pipeline_qwenimage", **SCHEDULER_CONFIG),
    build_inputs=build_inputs,
    unpack_output=unpack_output,
    timestep_from_sigma=sigma_identity,
    patch=Patch((1, 2, 2)),  # the (1, H, W) grid, packed 2x2
    shift_seq_len=shift_seq_len,
    batch_keys=("latents", "prompt_embeds", "prompt_mask"),
)
