"""Wan 2.2 I2V A14B's training spec: Wan 2.1 I2V's channel condition without its image embeddings, the two experts of
Wan 2.2 A14B."""

from __future__ import annotations

import dataclasses
from typing import Any

from train.models import Batch, Config, Streams
from train.models.wan import spec as wan
from train.models.wan22 import spec as wan22
from train.models.wan_i2v import spec as wan_i2v


def build_inputs(batch: Batch, noisy_latents: Streams, timesteps: Streams, *, model_config: Config) -> dict[str, Any]:
    # the pipeline encodes image embeddings only for a transformer with image_dim (Wan 2.1): none here
    return wan_i2v.channel_inputs(batch, noisy_latents, timesteps)


SPEC = dataclasses.replace(
    wan_i2v.SPEC,
    name="wan22_i2v",
    # Wan 2.2's i2v_A14B sample_shift (wan/configs/wan_i2v_A14B.py); the Diffusers scheduler config is not known here
    shift=wan.unipc_flow_shift(5.0),
    build_inputs=build_inputs,
    batch_keys=("latents", "prompt_embeds", "condition_latents"),
    # WanImageToVideoPipeline runs `transformer` while its timestep >= boundary_ratio * 1000, then `transformer_2`
    experts=wan22.SPEC.experts,
)
