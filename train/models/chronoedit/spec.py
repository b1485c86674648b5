"""ChronoEdit's training spec: Wan 2.1 image-to-video's (first-frame mask and condition latents concatenated in
channels: ChronoEdit is Wan2.1-I2V-14B), with ChronoEdit's classes and flow shift."""

from __future__ import annotations

import dataclasses

from train.models.spec import Classes
from train.models.wan.spec import unipc_flow_shift
from train.models.wan_i2v import spec as wan_i2v

SPEC = dataclasses.replace(
    wan_i2v.SPEC,
    name="chronoedit",
    classes=Classes("ChronoEditTransformer3DModel", "ChronoEditPipeline", "AutoencoderKLWan"),
    # UniPC with flow sigmas like Wan; the official ChronoEdit inference (nv-tlabs/ChronoEdit
    # scripts/run_inference_diffusers.py) sets `flow_shift=5.0` (720p).
    shift=unipc_flow_shift(5.0),
)
