"""Z-Image's non-diffusers LoRA keys as the LoRA trainers write them (musubi-tuner, ai-toolkit): diffusers' module
paths behind `diffusion_model.`, kohya's `lora_down` / `lora_up` / `alpha`. diffusers'
`_convert_non_diffusers_z_image_lora_to_diffusers` (ZImageLoraLoaderMixin) reads it back. Not the fused `qkv` of
Z-Image's own checkpoint: diffusers reads that only in a kohya dot form no loader here was shown to share."""

from train.lora_format import LoraFormat, Rename, fused

# Full weights (Z-Image's own single-file checkpoint, which `from_single_file`'s
# `convert_z_image_transformer_checkpoint_to_diffusers` reads): the fused qkv, `out`, `q_norm`/`k_norm`, and the one
# patch size's embedder and final layer without diffusers' "2-1" (patch 2, frame patch 1) key.
_FULL = (
    *(r for blocks in ("layers", "noise_refiner", "context_refiner") for r in (
        *fused(tuple(f"{blocks}.{{0}}.attention.to_{p}" for p in "qkv"), f"{blocks}.{{0}}.attention.qkv"),
        Rename(f"{blocks}.{{0}}.attention.to_out.0", f"{blocks}.{{0}}.attention.out"),
        Rename(f"{blocks}.{{0}}.attention.norm_q", f"{blocks}.{{0}}.attention.q_norm"),
        Rename(f"{blocks}.{{0}}.attention.norm_k", f"{blocks}.{{0}}.attention.k_norm"))),
    Rename("all_x_embedder.2-1", "x_embedder"),
    Rename("all_final_layer.2-1.linear", "final_layer.linear"),
    Rename("all_final_layer.2-1.adaLN_modulation.{0}", "final_layer.adaLN_modulation.{0}"),
)  # fmt: skip

FORMAT = LoraFormat(name="Z-Image diffusion_model. keys (lora_down/lora_up/alpha)", renames=(), keep_names=True,
                    full=_FULL)  # fmt: skip
