"""Qwen-Image-Edit's data encoder: Qwen-Image's target latents, plus the reference image resized, VAE-encoded and
shown to Qwen2.5-VL exactly as QwenImageEditPipeline.__call__ prepares its input image."""

from __future__ import annotations

from typing import Any

import torch

from train.data.media import Geometry
from train.models.encoder import load_processor_without_video, load_reference_image
from train.models.qwenimage.encoder import QwenImageEncoder
from train.models.spec import PipelineFunction

# QwenImageEditPipeline.__call__: calculate_dimensions(1024 * 1024, width / height) sizes the input image.
REFERENCE_AREA = 1024 * 1024
# (width, height, None) of about that area at an aspect ratio, multiples of 32: the edit pipeline module's own.
calculate_dimensions = PipelineFunction("diffusers.pipelines.qwenimage.pipeline_qwenimage_edit", "calculate_dimensions")


def load_processor(path: str, subfolder: str = "processor", revision: str | None = None):
    """The checkpoint's Qwen2VLProcessor less the video processor, which QwenImageEditPipeline never uses; loads where
    torchvision is missing."""
    return load_processor_without_video("Qwen2VLProcessor", path, subfolder, revision)


class QwenImageEditEncoder(QwenImageEncoder):
    """Cache tensors as QwenImageEditPipeline prepares them (see the package docstring)."""

    name = "qwenimage_edit"
    validation_image = "required"  # the pipeline's `image`: its conditioning input (train/validation.py)
    default_geometry = Geometry("qwenimage_edit", "image", 16)
    needs_reference = True

    def pipeline_components(self, pretrained_path, revision):
        return {"processor": load_processor(pretrained_path, revision=revision)}

    def latent_shapes(self, frames, height, width, fps):
        # the reference at the pipeline's size for an input image of the target's aspect ratio
        ref_width, ref_height, _ = calculate_dimensions(REFERENCE_AREA, width / height)
        return super().latent_shapes(frames, height, width, fps) | {
            "reference_latents": (16, 1, ref_height // 8, ref_width // 8)
        }

    def load_extra(self, src, info, bucket, fps, reference=None) -> tuple[Any, torch.Tensor]:
        """(the prompt image, the VAE input (1, 3, 1, H', W') in [-1, 1]): QwenImageEditPipeline.__call__ step 3."""
        image = load_reference_image(reference, str(src))
        width, height, _ = calculate_dimensions(REFERENCE_AREA, image.size[0] / image.size[1])
        processor = self.pipe.image_processor
        image = processor.resize(image, height, width)
        return image, processor.preprocess(image, height, width).unsqueeze(2)

    def encode_extra(self, extra, generator, mode, fps):
        # QwenImageEditPipeline._encode_vae_image: the posterior's mode (argmax), (z - mean) / std
        pixels = extra[1].to(self.device, self.pipe.vae.dtype)
        return {"reference_latents": self.pipe._encode_vae_image(pixels, generator=None)[0]}

    def encode_item_text(self, caption, max_tokens, extra):
        # QwenImageEditPipeline.encode_prompt(image=prompt_image): the prompt template with the image's vision tokens;
        # it takes no max_sequence_length (the vision tokens are part of the prompt).
        embeds, mask = self.pipe.encode_prompt(prompt=[caption], image=extra[0], device=self.device)
        mask = torch.ones(embeds.shape[:2], dtype=torch.bool) if mask is None else mask.bool()
        return {"prompt_embeds": embeds[0], "prompt_mask": mask[0].cpu()}

    def encode_text(self, caption, max_tokens):
        # The empty caption (caption dropout): the edit template needs an image, and the cache has one empty prompt
        # for all items, so it shows a mid-gray input image at the pipeline's 1:1 size instead of each item's.
        from PIL import Image

        width, height, _ = calculate_dimensions(REFERENCE_AREA, 1.0)
        return self.encode_item_text(caption, max_tokens, (Image.new("RGB", (width, height), (128, 128, 128)),))
