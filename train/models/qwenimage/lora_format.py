"""Qwen-Image's original LoRA keys: Qwen's reference code names its modules as diffusers does, so the original file is
diffusers' module paths behind `diffusion_model.` with kohya's `lora_down` / `lora_up` / `alpha` (what musubi-tuner
writes for Qwen-Image). diffusers' `_convert_non_diffusers_qwen_lora_to_diffusers` (QwenImageLoraLoaderMixin) reads
it back."""

from train.lora_format import LoraFormat

FORMAT = LoraFormat(name="Qwen-Image original (diffusion_model. + lora_down/lora_up/alpha)", renames=(),
                    keep_names=True)  # fmt: skip
