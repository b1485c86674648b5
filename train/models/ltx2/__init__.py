"""LTX-2 text-to-video+audio (LTX2VideoTransformer3DModel / LTX2Pipeline).

LTX-2 denoises two streams in one forward: the video latents (primary ``"latents"`` stream) and the audio latents
(``"audio_latents"``), each attending to its own prompt and to the other stream (audio<->video attention).

Cache: (train/models/ltx2/encoder.py) ``latents`` (C, F, H, W) as LTX2Pipeline normalises them; ``audio_latents``
(C_a, N, M) the clip's own soundtrack (log-mel spectrogram through the pipeline's audio VAE, normalised as its
prepare_audio_latents normalises given latents; a clip without an audio stream is a bad item ``no_audio``);
``prompt_embeds`` / ``audio_prompt_embeds`` (L, caption_channels) and ``prompt_mask`` (L,): the pipeline's text
connectors' outputs (the connectors are a pipeline component, not part of the transformer: the cache holds what the
pipeline passes the transformer); ``frame_rate`` (optional, default the pipeline's 24 fps).

Forward kwargs, as LTX2Pipeline's denoising loop: ``hidden_states`` (``_pack_latents``), ``audio_hidden_states``
(``_pack_audio_latents``: one token per audio latent frame, channels x mel bins), both prompts, ``timestep`` =
``sigma`` = sigma * 1000 for both streams (the pipeline steps the audio with a copy of the video scheduler: one sigma),
the connectors' int64 mask for both prompts, ``num_frames`` / ``height`` / ``width`` (latent grid), ``fps``,
``audio_num_frames``, ``video_coords`` / ``audio_coords`` (the transformer's ropes' ``prepare_*_coords``, which the
pipeline precomputes), ``isolate_modalities=False``, ``use_cross_timestep=True``.

Loss: both streams against ``noise - x0`` (the pipeline's velocity, FlowMatchEulerDiscreteScheduler), summed with
weight 1 each (the trainer's sum over streams: ctxtrain has no per-stream loss weight, and the LTX-2 trainers we
know of add the two MSEs unweighted; a family that needs another weight would need that mechanism first).

Context parallelism: cp_plans/ltx2.yaml shards both streams, both prompts and their masks (per-head biases, the
Ulysses attention gives each rank its heads' rows).

Not covered: image-to-video / conditioning pipelines (LTX2ImageToVideoPipeline, LTX2ConditionPipeline), IC-LoRA
(its (B, S, S) video self-attention mask is refused under CP by the plan), STG / modality-isolation guidance
(inference only), LTX-2.3's per-modality prompt projections beyond what the config selects, and validation samples
with audio.
"""

from .encoder import LTX2Encoder as Encoder
from .spec import SPEC
from .tiny import build_tiny

__all__ = ["SPEC", "Encoder", "build_tiny"]
