"""MiniMax-H3 text-to-video+audio (MiniMaxH3Transformer3DModel / MiniMaxH3ModularPipeline, `t2va` workflow).

MiniMax-H3 denoises one packed sequence ``[text | audio | video]`` with full self-attention, and two streams at once:
the video latents (primary ``"latents"`` stream) and the audio latents (``"audio_latents"`` stream, its own shift).

Cache: ``latents`` (C, F, H, W) video latents of AutoencoderKLMiniMaxH3 (24 channels, ``17n + 5`` pixel frames ->
``5n + 2`` latent frames); ``audio_latents`` (2, 32, N): the stereo soundtrack's AutoencoderKLMiniMaxH3Audio latents,
one row per stereo channel (the ``(audio_channels, latent_channels, num_audio_latents)`` layout the pipeline's
``audio_latents`` input takes); ``prompt_embeds`` (L, 5120) Qwen3-VL ``hidden_states[50]`` (no padding: the packed
sequence is unpadded); optional ``text_token_tags`` (L,) (1 = text, 0 = vision rows of a keyframe block; default all
text) and ``prompt_mask`` (L,) (only to drop padding of a cache padded to a common length: every sample must keep the
same positions).

Forward kwargs, as the modular pipeline's denoising loop (``MiniMaxH3LoopDenoiser``): ``hidden_states`` video
rows (``patchify_video_latents``), ``audio_hidden_states`` channel-major audio rows, ``encoder_hidden_states``, and the
layout of ``MiniMaxH3PrepareLayoutStep.build_packed_sequence`` (``position_ids``, ``token_tags``, ``video_indices``,
``audio_indices``, ``text_indices``) plus ``MiniMaxH3SetTimestepsStep.build_row_timesteps`` (``timestep`` = the distinct
``t = 1 - sigma`` values, ``timestep_indices`` per row). The layout and timesteps describe one packed sequence every
batch item shares, so all samples of a batch share their shapes, their text length and one sigma per stream
(``shared_timestep=True``). The transformer predicts a data-ward velocity ``x0 - noise`` (``velocity_sign=-1``).

Not covered: only the text-to-video+audio (t2va) layout; keyframe (fl2va) and reference (ref2va, transformer_ref/)
conditioning rows are not built. One sigma per stream per batch (the transformer shares one timestep layout across the
batch); the audio sigma is the video's base draw through the audio shift, as the pipeline steps both schedules over
the same base grid.
"""

from .encoder import MiniMaxH3Encoder as Encoder
from .spec import SPEC
from .tiny import build_tiny

__all__ = ["SPEC", "Encoder", "build_tiny"]
