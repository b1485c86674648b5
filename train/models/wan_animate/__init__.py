"""Wan 2.2 Animate, animation mode (WanAnimateTransformer3DModel / WanAnimatePipeline):
Wan-AI/Wan2.2-Animate-14B-Diffusers, Wan 2.1 I2V-14B plus a pose patch embedding, a motion encoder and a face encoder
run on the face video inside the transformer, and a face adapter (cross-attention from each latent frame's tokens to
that frame's motion features) after every ``inject_face_latents_blocks``-th block: a reference character image driven
by a pose video and a face video.

Cache: per item of F = 4k + 1 frames (T = k + 1 latent frames), as ``WanAnimatePipeline.__call__(image, pose_video,
face_video, mode="animate", segment_frame_length=F)`` computes its first (only) segment: ``latents`` (C, T + 1, H, W):
the reference image's latent frame (its ``prepare_reference_image_latents`` latents, VAE mode, normalised), then the
clip's (Wan's, normalised, ``data.latent_sample``); ``reference_latents`` (4 + C, T + 1, H, W): the pipeline's
``reference_latents``, [I2V mask | latents] of the reference image (mask ones) then of F zero frames
(``prepare_prev_segment_cond_latents`` of segment 0: zero mask); ``pose_latents`` (C, T, H, W): ``prepare_pose_latents``
of the pose video (VAE mode); ``face_pixels`` (3, F, M, M): the face video resized to the motion encoder's side M
(512) and scaled to [-1, 1], as the pipeline hands it over (in the cache dtype: 77 frames at 512 x 512 are 121 MB per
item in bf16, 12x the latents); ``image_embeds`` (257, 1280): CLIP vision ``hidden_states[-2]`` of the reference image
(``encode_image``); ``prompt_embeds`` (512, 4096) UMT5 states zero-padded to 512 (the blocks take the tokens before
the last 512 as image context) and ``prompt_mask``. The media: the item's clip; its reference image
(``data.reference_column``, any size: the pipeline fits it into the frame, black bars around it, and CLIP sees it
whole); its pose video and face video (``data.condition_columns``, columns ``pose_video`` and ``face_video`` by
default), each of the clip's frame count, read at its rate; the pose video cropped to the bucket as the clip, the face
video at its own size (the pipeline resizes it to M x M). The encoder calls the pipeline's own methods
(``WanAnimateEncoder.conditioning``).

Forward kwargs, as the pipeline's denoising loop: ``hidden_states = cat([latents, reference_latents], dim=1)`` (2C + 4
channels, T + 1 frames), ``timestep = sigma * 1000``, ``encoder_hidden_states``, ``encoder_hidden_states_image``,
``pose_hidden_states`` (added to the patch embeddings of frames 1..T) and ``face_pixel_values``; the pipeline's
``motion_encode_batch_size`` (None: the config's) only batches the motion encoder. Every latent frame is noised and in
the loss, the reference frame included: the pipeline denoises all T + 1 from noise and drops the first after decoding
(a loss mask, ``data.mask_column``, covers the clip's frames; the reference frame is trained whole). The face adapter
regroups the tokens by latent frame, so a sequence shard must be whole frames: see cp_plans/wananimate.yaml.

Not covered: replace mode (``background_video`` / ``mask_video``: the background latents and the inverted person mask
instead of zeros); later segments (segment i > 0 conditions on the last ``prev_segment_conditioning_frames`` (1 or
5) decoded frames of segment i - 1, mask ones there: a clip is trained as a first segment); classifier-free guidance's
blanked face (the pipeline's default guidance 1.0 has none); the relighting LoRA of the original release. A clip
longer than one segment is not split: train on clips of the segment length (77 frames). LoRA adapts the blocks'
attention only (spec.py); the flow shift is 5.0 (Wan 2.2's animate sample_shift; set ``model.flow_shift`` if the
Diffusers scheduler config differs). Validation samples: each prompt gives the reference image (``image``) and its
``media: {pose_video: ..., face_video: ...}`` (train/validation.py), rendered by WanAnimatePipeline's defaults (77-frame
segments).
"""

from .encoder import WanAnimateEncoder as Encoder
from .spec import SPEC
from .tiny import build_tiny

__all__ = ["SPEC", "Encoder", "build_tiny"]
