"""Wan Animate's data encoder: Wan's text (512 tokens) and latents, plus what WanAnimatePipeline computes for its
first segment in animation mode from the item's reference image, pose video and face video."""

from __future__ import annotations

from typing import Any

import torch

from train.data.media import Geometry
from train.models.encoder import load_condition_video, load_reference_image
from train.models.wan.encoder import WanEncoder
from train.models.wan_i2v.encoder import skip_missing_ftfy
from train.models.wan_vace.encoder import _pil_frames


class WanAnimateEncoder(WanEncoder):
    """Every item needs a reference (character) image (`data.reference_column`), a pose video and a face video
    (`condition_media`, `data.condition_columns`), each of the clip's frame count. ``conditioning`` calls the
    pipeline's own preprocessing and ``prepare_*`` methods as ``WanAnimatePipeline.__call__`` does for segment 0 with
    ``mode="animate"`` and ``prev_segment_conditioning_frames=1``. Text as Wan's with L fixed to 512 (the image
    context precedes the text in the blocks' cross-attention, which takes everything but the last 512 tokens as
    image)."""

    name = "wan_animate"
    needs_reference = True
    condition_media = ("pose_video", "face_video")
    validation_image = "required"  # the pipeline's `image`: the reference character (train/validation.py)
    fixed_text_tokens = 512
    default_geometry = Geometry("wan_animate", "video", 16, 4, 1)

    def load(self, pretrained_path, *, revision=None, **kwargs):
        from diffusers import WanAnimateTransformer3DModel

        super().load(pretrained_path, revision=revision, **kwargs)
        skip_missing_ftfy(self.pipe)  # WanAnimatePipeline's prompt_clean calls ftfy unguarded
        config = WanAnimateTransformer3DModel.load_config(pretrained_path, subfolder="transformer", revision=revision)
        self.face_size = int(config["motion_encoder_size"])  # the side the pipeline resizes face frames to

    def latent_shapes(self, frames, height, width, fps):
        channels, latent_frames, h, w = super().latent_shapes(frames, height, width, fps)["latents"]
        return {"latents": (channels, latent_frames + 1, h, w)}  # the reference image's frame first

    def loss_mask(self, mask, latents_shape):
        """The clip's mask on its latent frames (Wan's), the reference frame in front trained whole."""
        channels, frames, height, width = latents_shape
        clip = super().loss_mask(mask, (channels, frames - 1, height, width))
        return torch.cat([torch.ones_like(clip[:, :1]), clip], dim=1)

    def load_extra(self, src, info, bucket, fps, reference=None, *, pose_video=None, face_video=None):
        """(reference image as PIL, pose video uint8 (F, 3, H, W) cropped to the bucket as the media, face video
        uint8 (F, 3, h, w) at its own size: the pipeline resizes it to the motion encoder's square)."""
        image = load_reference_image(reference, info.name)
        pose = load_condition_video("pose_video", pose_video, info, bucket, fps)
        face = load_condition_video("face_video", face_video, info, bucket, fps, own_size=True)
        return image, pose, face

    def encode_item(self, pixels, extra, generator, mode, fps):
        clip = self.encode_media(pixels, generator, mode, fps)["latents"]  # (C, T, H, W), Wan's
        out = self.conditioning(*extra)
        out["latents"] = torch.cat([out.pop("reference_frame"), clip], dim=1)  # (C, T + 1, H, W)
        return out

    @torch.no_grad()
    def conditioning(self, image: Any, pose: torch.Tensor, face: torch.Tensor) -> dict[str, torch.Tensor]:
        """What ``WanAnimatePipeline.__call__(image, pose_video, face_video, mode="animate")`` hands its transformer
        for the first segment of ``segment_frame_length`` = F frames, per item: ``reference_latents`` (4 + C, T + 1,
        H', W') = [the I2V mask | normalised VAE mode] of the reference image (``prepare_reference_image_latents``)
        then of F zero frames (``prepare_prev_segment_cond_latents``, segment 0: zero mask); ``pose_latents`` (C, T,
        H', W') = ``prepare_pose_latents`` of the pose video; ``face_pixels`` (3, F, M, M) = the face video resized
        to the motion encoder's side M, in [-1, 1]; ``image_embeds`` = ``encode_image`` (CLIP) of the reference
        image; and ``reference_frame`` (C, 1, H', W'), the reference image's latents, the clean value of the latent
        frame the pipeline denoises in front of the clip's. ``image`` a PIL image; ``pose`` uint8 (F, 3, H, W) at
        the output size; ``face`` uint8 (F, 3, h, w)."""
        pipe, device, (frames, _, height, width) = self.pipe, self.device, pose.shape
        pixels = pipe.vae_image_processor.preprocess(image, height=height, width=width, resize_mode="fill")
        reference = pipe.prepare_reference_image_latents(pixels.to(device, torch.float32), 1, device=device)
        pose_video = pipe.video_processor.preprocess_video(_pil_frames(pose), height=height, width=width)
        pose_latents = pipe.prepare_pose_latents(pose_video.to(device, torch.float32), 1, device=device)
        face_video = pipe.video_processor.preprocess_video(_pil_frames(face), height=self.face_size,
                                                           width=self.face_size)  # fmt: skip
        zeros = pipe.prepare_prev_segment_cond_latents(None, batch_size=1, segment_frame_length=frames, start_frame=0,
                                                       height=height, width=width, prev_segment_cond_frames=1,
                                                       task="animate", device=device)  # fmt: skip
        return {
            "reference_latents": torch.cat([reference, zeros], dim=2)[0],
            "reference_frame": reference[0, pipe.vae_scale_factor_temporal :],  # after the mask channels
            "pose_latents": pose_latents[0],
            "face_pixels": face_video[0],
            "image_embeds": pipe.encode_image(image, device)[0],
        }
