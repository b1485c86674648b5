"""SkyReels-V2's tiny SkyReelsV2DiffusionForcingPipeline (Wan's UMT5 and VAE) around the tiny transformer of
recipes/tiny/skyreels_v2.yaml (Wan's, with the DF checkpoints' fps embedding)."""

from __future__ import annotations

from pathlib import Path

from train.models.wan.tiny import text_to_video_components


def build_tiny(path: Path) -> None:
    from diffusers import SkyReelsV2DiffusionForcingPipeline, SkyReelsV2Transformer3DModel, UniPCMultistepScheduler

    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=8.0)
    components = text_to_video_components("skyreels_v2", SkyReelsV2Transformer3DModel, scheduler)
    SkyReelsV2DiffusionForcingPipeline(**components).save_pretrained(path)
