"""Wan VACE's data encoder: Wan's latents and text, plus WanVACEPipeline's control latents of the item's control video
(data.reference_column) with the pipeline's default full mask and no reference images."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from train.data.media import Geometry
from train.models.wan.encoder import WanEncoder
from train.models.wan_i2v.encoder import skip_missing_ftfy


def _pil_frames(frames: torch.Tensor) -> list[Any]:
    """uint8 (F, 3, H, W) -> the list of PIL frames the pipeline takes as a video."""
    from PIL import Image

    return [Image.fromarray(f.permute(1, 2, 0).cpu().numpy()) for f in frames]


class WanVACEEncoder(WanEncoder):
    """Every item needs a control video (`needs_reference`: data.reference_column names it). ``control_latents`` are
    what ``WanVACEPipeline.__call__`` hands its transformer as ``control_hidden_states`` for ``video=<control>``,
    ``mask=None``, no reference images: its own ``preprocess_conditions``, ``prepare_video_latents`` and
    ``prepare_masks``, concatenated as it does."""

    name = "wan_vace"
    needs_reference = True
    default_geometry = Geometry("wan_vace", "video", 16, 4, 1)

    def load(self, pretrained_path, *, revision=None, **kwargs):
        from diffusers import WanVACETransformer3DModel

        super().load(pretrained_path, revision=revision, **kwargs)
        skip_missing_ftfy(self.pipe)  # WanVACEPipeline's prompt_clean calls ftfy unguarded
        # preprocess_conditions / prepare_masks read the transformer's patch size: the transformer built from its
        # config on the meta device (no weights, no memory), in the pipeline's slot
        config = WanVACETransformer3DModel.load_config(pretrained_path, subfolder="transformer", revision=revision)
        with torch.device("meta"):
            self.pipe.register_modules(transformer=WanVACETransformer3DModel.from_config(config))

    def load_extra(self, src, info, bucket, fps, reference=None) -> torch.Tensor:
        """The control video, uint8 (F, 3, H, W): a video of the media's frame count sampled at the media's rate, or
        an image held for every frame, resized and centre-cropped to the bucket as the media is."""
        from train.data.media import BadMediaError, Bucket, load_clip, probe

        if reference is None:
            raise BadMediaError("no_reference", f"{src}: no control video (data.reference_column)")
        try:
            control = probe(reference)
            counts = control.num_frames, info.num_frames
            if control.kind == "video" and all(counts) and counts[0] != counts[1]:
                raise BadMediaError("bad_reference", f"control video {control.name} has {control.num_frames} frames, "
                                    f"its media {info.num_frames}: give it one frame per media frame")  # fmt: skip
            still = control.kind == "image"
            frames = load_clip(reference, Bucket(1, bucket.height, bucket.width) if still else bucket, fps,
                               allow_upscale=True, info=control)  # fmt: skip
        except BadMediaError as e:
            detail = e.detail if e.reason == "bad_reference" else f"control: {e.detail}"
            raise BadMediaError("bad_reference", detail) from None
        return frames.expand(bucket.frames, -1, -1, -1) if still else frames

    def encode_extra(self, extra, generator, mode, fps):
        return {"control_latents": self.control_latents(extra)}

    @torch.no_grad()
    def control_latents(
        self, video: torch.Tensor, mask: torch.Tensor | None = None, reference_images: Sequence[Any] = ()
    ) -> torch.Tensor:
        """WanVACEPipeline's ``conditioning_latents`` (vace_in_channels, R + F', H', W') for one item: ``video`` and
        ``mask`` uint8 (F, 3, H, W) frames (mask None: the pipeline's all-ones mask, the whole clip generated; white =
        generate), ``reference_images`` R PIL images. [inactive | reactive] latents of the video outside / inside the
        mask (VAE mode, normalised), the mask at the 8x8 patch grid resampled to the latent frames, and the reference
        images' latents (and zero mask) as R leading latent frames, last image first (as the pipeline prepends them).
        With references, an item's ``latents`` must carry ``control[:z, :R]`` as their first R frames: the pipeline
        denoises R + F' frames and drops the first R after the loop."""
        pipe, (frames, _, height, width) = self.pipe, video.shape
        masks = None if mask is None else _pil_frames(mask)
        refs = list(reference_images) or None
        video, mask, refs = pipe.preprocess_conditions(_pil_frames(video), masks, refs, 1, height, width, frames,
                                                       torch.float32, self.device)  # fmt: skip
        latents = pipe.prepare_video_latents(video, mask, refs, None, self.device)
        return torch.cat([latents, pipe.prepare_masks(mask, refs, None)], dim=1)[0]
