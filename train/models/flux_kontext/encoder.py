"""FLUX.1 Kontext's data encoder: FLUX.1's target latents and prompt, plus the reference image resized and
VAE-encoded exactly as FluxKontextPipeline.__call__ prepares its input image."""

from __future__ import annotations

import torch

from train.data.media import Geometry
from train.models.encoder import load_reference_image
from train.models.flux.encoder import FluxEncoder


def reference_size(width: int, height: int, multiple_of: int) -> tuple[int, int]:
    """(width, height) FluxKontextPipeline.__call__ resizes an input image of this size to (``_auto_resize``, the
    default): the preferred Kontext resolution closest in aspect ratio, floored to ``multiple_of``."""
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

    aspect_ratio = width / height
    _, width, height = min((abs(aspect_ratio - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
    return width // multiple_of * multiple_of, height // multiple_of * multiple_of


class FluxKontextEncoder(FluxEncoder):
    """Cache tensors as FluxKontextPipeline prepares them (see the package docstring)."""

    name = "flux_kontext"
    validation_image = "required"  # the pipeline's `image`: its conditioning input (train/validation.py)
    default_geometry = Geometry("flux_kontext", "image", 16)
    needs_reference = True

    def latent_shapes(self, frames, height, width, fps):
        # the reference at the pipeline's size for an input image of the target's aspect ratio
        ref_width, ref_height = reference_size(width, height, 16)
        return super().latent_shapes(frames, height, width, fps) | {
            "reference_latents": (16, ref_height // 8, ref_width // 8)
        }

    def load_extra(self, src, info, bucket, fps, reference=None) -> torch.Tensor:
        """The VAE input (1, 3, H', W') in [-1, 1]: FluxKontextPipeline.__call__'s image preprocessing."""
        image = load_reference_image(reference, str(src))
        processor = self.pipe.image_processor
        height, width = processor.get_default_height_width(image)
        width, height = reference_size(width, height, self.pipe.vae_scale_factor * 2)
        return processor.preprocess(processor.resize(image, height, width), height, width)

    def encode_extra(self, extra, generator, mode, fps):
        # FluxKontextPipeline._encode_vae_image: the posterior's mode (argmax), (z - shift_factor) * scaling_factor
        pixels = extra.to(self.device, self.pipe.vae.dtype)
        return {"reference_latents": self.pipe._encode_vae_image(pixels, generator=None)[0]}
