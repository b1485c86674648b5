"""Wan's training spec: the latents, the UMT5 states and ``sigma * 1000`` as WanPipeline passes them; the UniPC flow
shift the Wan-architecture families (Wan 2.1 / 2.2, SkyReels-V2, ChronoEdit) derive theirs from."""

from __future__ import annotations

from typing import Any

from train.models import Batch, Config, Streams
from train.models.spec import Classes, FamilySpec, ShiftSpec, frozen
from train.models.wan.lora_format import FORMAT


def unipc_flow_shift(flow_shift: float) -> ShiftSpec:
    """The static shift of a Wan-architecture checkpoint's scheduler/scheduler_config.json (relevant keys): UniPC with
    flow sigmas and a fixed ``flow_shift``."""
    config = frozen(
        num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=flow_shift
    )
    return ShiftSpec.static(config, "UniPCMultistepScheduler")


def build_inputs(batch: Batch, noisy_latents: Streams, timesteps: Streams, *, model_config: Config) -> dict[str, Any]:
    return {
        "hidden_states": noisy_latents["latents"],
        "timestep": timesteps["latents"],
        "encoder_hidden_states": batch["prompt_embeds"],
    }


SPEC = FamilySpec(
    name="wan",
    classes=Classes("WanTransformer3DModel", "WanPipeline", "AutoencoderKLWan"),
    latent_kind="video",
    # Wan-AI/Wan2.1-T2V-{1.3B,14B}-Diffusers: flow shift 3.0, the 480p default (WanPipeline's docs: 5.0 for 720p).
    shift=unipc_flow_shift(3.0),
    build_inputs=build_inputs,
    batch_keys=("latents", "prompt_embeds"),
    lora_format=FORMAT,
    # The defaults: LoRA on the attention projections of self- and cross-attention (`attn1` / `attn2`), as the
    # diffusers/finetrainers Wan LoRA recipes; timestep sigma * 1000; the transformer patchifies the latents itself,
    # (1, 2, 2) patches of (F, H, W) (`patch`: the config's patch_size), and returns the prediction in their layout.
)
