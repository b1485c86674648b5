"""LTX-Video's original LoRA keys: the LTX-Video code names its modules as diffusers does, and Lightricks'
LTX-Video-Trainer saves its ComfyUI LoRAs as those paths behind `diffusion_model.` with peft's `lora_A` / `lora_B`
and no alpha. diffusers' `_convert_non_diffusers_ltxv_lora_to_diffusers` (LTXVideoLoraLoaderMixin) strips the prefix
and reads alpha = rank, so the scale alpha / rank is folded into `lora_B`."""

from train.lora_format import LoraFormat

FORMAT = LoraFormat(name="LTX-Video original (LTX-Video-Trainer / ComfyUI)", renames=(), keep_names=True,
                    down="lora_A", up="lora_B", alpha=False)  # fmt: skip
