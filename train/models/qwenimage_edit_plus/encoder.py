"""Qwen-Image-Edit-Plus' data encoder: Qwen-Image's target latents, plus each of an item's 1-3 control images resized,
VAE-encoded and shown to Qwen2.5-VL exactly as QwenImageEditPlusPipeline.__call__ prepares its list of images."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import torch

from train.data.media import BadMediaError, Geometry
from train.models.encoder import load_reference_image
from train.models.qwenimage.encoder import QwenImageEncoder
from train.models.qwenimage_edit.encoder import load_processor
from train.models.spec import PipelineFunction

from .spec import REFERENCES

PLUS = "diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus"
# (width, height) of about an area at an aspect ratio, multiples of 32: the Plus pipeline module's own.
calculate_dimensions = PipelineFunction(PLUS, "calculate_dimensions")


def areas() -> tuple[int, int]:
    """(the VL input's area, the VAE input's area): the Plus pipeline's CONDITION_IMAGE_SIZE (384 x 384) and
    VAE_IMAGE_SIZE (1024 x 1024); each image is resized to both at its own aspect ratio."""
    module = importlib.import_module(PLUS)
    return module.CONDITION_IMAGE_SIZE, module.VAE_IMAGE_SIZE


class QwenImageEditPlusEncoder(QwenImageEncoder):
    """Cache tensors as QwenImageEditPlusPipeline prepares them (see the package docstring)."""

    name = "qwenimage_edit_plus"
    validation_image = "required"  # the pipeline's `image`: one control image per validation prompt
    default_geometry = Geometry("qwenimage_edit_plus", "image", 16)
    needs_reference = True
    max_references = len(REFERENCES)

    def pipeline_components(self, pretrained_path, revision):
        return {"processor": load_processor(pretrained_path, revision=revision)}

    def latent_shapes(self, frames, height, width, fps):
        # the first control image at the pipeline's VAE size for an image of the target's aspect ratio (the others
        # are optional: batch_layout)
        ref_width, ref_height = calculate_dimensions(areas()[1], width / height)
        return super().latent_shapes(frames, height, width, fps) | {
            "reference_latents": (16, 1, ref_height // 8, ref_width // 8)
        }

    def load_extra(self, src, info, bucket, fps, reference=None) -> tuple[list[Any], list[torch.Tensor]]:
        """(the prompt images, the VAE inputs (1, 3, 1, H', W') in [-1, 1]) of the item's control images in column
        order, those it lacks left out: QwenImageEditPlusPipeline.__call__ step 3. None at all is `no_reference`."""
        given = reference if isinstance(reference, list) else [reference]
        present = [r for r in given if r is not None]
        if not present:
            raise BadMediaError("no_reference", f"{src}: no control image (data.reference_column)")
        condition_area, vae_area = areas()
        processor, prompt_images, vae_images = self.pipe.image_processor, [], []
        for ref in present:
            image = load_reference_image(ref, str(src))
            ratio = image.size[0] / image.size[1]
            (cond_w, cond_h), (vae_w, vae_h) = (calculate_dimensions(a, ratio) for a in (condition_area, vae_area))
            prompt_images.append(processor.resize(image, cond_h, cond_w))
            vae_images.append(processor.preprocess(image, vae_h, vae_w).unsqueeze(2))
        return prompt_images, vae_images

    def encode_extra(self, extra, generator, mode, fps):
        # QwenImageEditPlusPipeline._encode_vae_image of each image: the posterior's mode (argmax), (z - mean) / std
        return {
            key: self.pipe._encode_vae_image(pixels.to(self.device, self.pipe.vae.dtype), generator=None)[0]
            for key, pixels in zip(REFERENCES, extra[1])
        }

    def batch_layout(self, tensors: Mapping[str, torch.Tensor]) -> str | None:
        # the control images' count and latent sizes fix the sequence: "controls 64x64 48x80" (H' x W' each)
        sizes = [tensors[k].shape[-2:] for k in REFERENCES if k in tensors]
        return "controls " + " ".join(f"{h}x{w}" for h, w in sizes)

    def encode_item_text(self, caption, max_tokens, extra):
        # QwenImageEditPlusPipeline.encode_prompt(image=[prompt images]): "Picture k: <vision tokens>" per image, then
        # the caption; it takes no max_sequence_length (the vision tokens are part of the prompt).
        embeds, mask = self.pipe.encode_prompt(prompt=[caption], image=list(extra[0]), device=self.device)
        mask = torch.ones(embeds.shape[:2], dtype=torch.bool) if mask is None else mask.bool()
        return {"prompt_embeds": embeds[0], "prompt_mask": mask[0].cpu()}

    def encode_text(self, caption, max_tokens):
        # The empty caption (caption dropout): the cache has one empty prompt for all items, so it shows one mid-gray
        # control image at the pipeline's 1:1 VL size instead of each item's.
        from PIL import Image

        width, height = calculate_dimensions(areas()[0], 1.0)
        return self.encode_item_text(caption, max_tokens, ([Image.new("RGB", (width, height), (128, 128, 128))],))
