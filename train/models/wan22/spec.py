"""Wan 2.2 A14B's training spec: Wan 2.1's inputs and outputs, two experts split at the pipeline's boundary_ratio."""

from __future__ import annotations

import dataclasses

from train.models.spec import ShiftSpec, frozen
from train.models.wan.spec import SPEC as WAN_SPEC

# Wan-AI/Wan2.2-T2V-A14B-Diffusers scheduler/scheduler_config.json (relevant keys): UniPC with flow sigmas and flow
# shift 3.0 (Wan 2.2's own t2v_A14B sampler uses 12.0: set model.flow_shift to train at that shift).
SCHEDULER_CONFIG = frozen(
    num_train_timesteps=1000,
    prediction_type="flow_prediction",
    use_flow_sigmas=True,
    flow_shift=3.0,
)

SPEC = dataclasses.replace(
    WAN_SPEC,
    name="wan22",
    shift=ShiftSpec(
        kind="static",
        scheduler_class="UniPCMultistepScheduler",
        scheduler_config=SCHEDULER_CONFIG,
        shift=SCHEDULER_CONFIG["flow_shift"],
    ),
    # WanPipeline runs `transformer` while its timestep >= boundary_ratio * 1000, then `transformer_2`.
    experts=("transformer", "transformer_2"),
)
