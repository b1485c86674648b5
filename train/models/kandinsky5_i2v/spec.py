"""Kandinsky 5 image-to-video's training spec: Kandinsky 5 T2V's, with latent frame 0 the clean image latents (not
noised, out of the loss), the visual-condition mask set on it, and one timestep shared by all frames
(Kandinsky5I2VPipeline's denoising loop)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from train.models import Batch, Config, Streams
from train.models.kandinsky5 import spec as k5
from train.models.spec import first_frame_condition


def shared_timestep(timestep: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
    """The (B,) timestep of the noised latent frames, from the trainer's per-element timesteps (broadcastable to the
    (B, C, F, H, W) latents, 0 on the clean frame 0): the pipeline passes one timestep for every frame, the clean one
    included, so every noised frame of a sample must share it."""
    batch_size, _, frames, height, width = latents.shape
    if timestep.ndim != latents.ndim:
        raise ValueError(f"kandinsky5_i2v takes per-element timesteps (condition_mask), got {tuple(timestep.shape)}")
    if frames < 2:
        raise ValueError("kandinsky5_i2v: a clip of one latent frame is all conditioning; give it at least 5 frames")
    noised = timestep.expand(batch_size, 1, frames, height, width)[:, 0, 1:].reshape(batch_size, -1)
    assert bool((noised == noised[:, :1]).all()), "per-frame sigmas: the objective refuses them for this family"
    return noised[:, 0]


def build_inputs(batch: Batch, noisy_latents: Streams, timesteps: Streams, *, model_config: Config) -> dict[str, Any]:
    latents = noisy_latents["latents"]  # frame 0 is the clean image latents: the trainer does not noise it
    timestep = shared_timestep(timesteps["latents"], latents)
    kwargs = k5.build_inputs(batch, noisy_latents, {"latents": timestep}, model_config=model_config)
    if model_config["visual_cond"]:  # prepare_latents: the zero condition, and its mask 1 on latent frame 0
        kwargs["hidden_states"][:, 0, ..., -1] = 1
    return kwargs


# kandinskylab/Kandinsky-5.0-I2V-*-5s-Diffusers: the T2V transformer class, VAE, text encoders, LoRA targets,
# float32-RoPE processor and flow shift 5.0 (FastVideo's Kandinsky5I2VConfig keeps its T2V parent's flow_shift 5.0;
# the released I2V inference configs sample at scheduler_scale 10: set model.flow_shift to train on that schedule).
SPEC = dataclasses.replace(
    k5.SPEC,
    name="kandinsky5_i2v",
    classes=k5.SPEC.classes._replace(pipeline="Kandinsky5I2VPipeline"),
    build_inputs=build_inputs,
    # 1 on latent frame 0, the image latents prepare_latents writes there and the loop never steps (`latents[:, 1:]`)
    condition_mask=first_frame_condition,
)
