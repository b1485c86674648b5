"""Wan 2.2 A14B's training spec: Wan 2.1's inputs, outputs and shift, two experts split at the pipeline's
boundary_ratio."""

from __future__ import annotations

import dataclasses

from train.models.wan import spec as wan

SPEC = dataclasses.replace(
    wan.SPEC,
    name="wan22",
    # Wan-AI/Wan2.2-T2V-A14B-Diffusers' scheduler has Wan 2.1's flow shift 3.0 (Wan 2.2's own t2v_A14B sampler uses
    # 12.0: set model.flow_shift to train at that shift).
    # WanPipeline runs `transformer` while its timestep >= boundary_ratio * 1000, then `transformer_2`.
    experts=("transformer", "transformer_2"),
)
