"""Z-Image's non-diffusers LoRA keys as the LoRA trainers write them (musubi-tuner, ai-toolkit): diffusers' module
paths behind `diffusion_model.`, kohya's `lora_down` / `lora_up` / `alpha`. diffusers'
`_convert_non_diffusers_z_image_lora_to_diffusers` (ZImageLoraLoaderMixin) reads it back. Not the fused `qkv` of
Z-Image's own checkpoint: diffusers reads that only in a kohya dot form no loader here was shown to share."""

from train.lora_format import LoraFormat

FORMAT = LoraFormat(name="Z-Image diffusion_model. keys (lora_down/lora_up/alpha)", renames=(), keep_names=True)
