"""FLUX.1's original LoRA keys: the module names of Black Forest Labs' checkpoint (`double_blocks`, `single_blocks`,
`img_in`, ...) with `diffusion_model.` in front and kohya's `lora_down` / `lora_up` / `alpha` tensors, as ComfyUI and
kohya's sd-scripts read them. diffusers' `_convert_kohya_flux_lora_to_diffusers` (FluxLoraLoaderMixin.lora_state_dict
of such a file: `diffusion_model.` -> `lora_unet_`) maps every one back, splitting the fused `qkv` and `linear1`
layers (block-diagonal up: each module's own adapter); it splits `single_blocks.N.linear1` at FLUX.1's widths
(3 x 3072 + 12288 rows) only. The blocks only: that converter names the embedders (`img_in`, `txt_in`, `time_in`,
`vector_in`, `guidance_in`) and `final_layer` without the `transformer.` prefix, so load_lora_weights drops them
(diffusers 0.42). Chroma and FLUX.1 Kontext share the names (ChromaPipeline and FluxKontextPipeline load through the
same converter; Chroma's blocks have no modulation linears, its distilled guidance layer no name there)."""

from train.lora_format import LoraFormat, Rename, fused

_DOUBLE = (
    *fused(tuple(f"transformer_blocks.{{0}}.attn.{m}" for m in ("to_q", "to_k", "to_v")),
            "double_blocks.{0}.img_attn.qkv"),
    *fused(tuple(f"transformer_blocks.{{0}}.attn.{m}" for m in ("add_q_proj", "add_k_proj", "add_v_proj")),
            "double_blocks.{0}.txt_attn.qkv"),
    *(Rename(f"transformer_blocks.{{0}}.{d}", f"double_blocks.{{0}}.{o}") for d, o in
      (("attn.to_out.0", "img_attn.proj"), ("attn.to_add_out", "txt_attn.proj"), ("ff.net.0.proj", "img_mlp.0"),
       ("ff.net.2", "img_mlp.2"), ("ff_context.net.0.proj", "txt_mlp.0"), ("ff_context.net.2", "txt_mlp.2"),
       ("norm1.linear", "img_mod.lin"), ("norm1_context.linear", "txt_mod.lin"))),
)  # fmt: skip
_SINGLE = (
    *fused(tuple(f"single_transformer_blocks.{{0}}.{m}" for m in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")),
            "single_blocks.{0}.linear1"),
    Rename("single_transformer_blocks.{0}.proj_out", "single_blocks.{0}.linear2"),
    Rename("single_transformer_blocks.{0}.norm.linear", "single_blocks.{0}.modulation.lin"),
)  # fmt: skip

# Full weights (BFL's single-file checkpoint, which `from_single_file`'s
# `convert_flux_transformer_checkpoint_to_diffusers` reads; it too splits linear1 at FLUX.1's widths): the embedders,
# the RMSNorms' `scale`, and the final AdaLN with BFL's (shift, scale) halves where diffusers has (scale, shift).
_EMBEDDERS = (("timestep_embedder", "time_in"), ("text_embedder", "vector_in"), ("guidance_embedder", "guidance_in"))
_NORMS = (("norm_q", "img_attn.norm.query_norm"), ("norm_k", "img_attn.norm.key_norm"),
          ("norm_added_q", "txt_attn.norm.query_norm"), ("norm_added_k", "txt_attn.norm.key_norm"))  # fmt: skip
_FULL = (
    *(Rename(f"time_text_embed.{d}.linear_{i}", f"{o}.{layer}") for d, o in _EMBEDDERS
      for i, layer in ((1, "in_layer"), (2, "out_layer"))),
    Rename("context_embedder", "txt_in"),
    Rename("x_embedder", "img_in"),
    *(Rename(f"transformer_blocks.{{0}}.attn.{d}.weight", f"double_blocks.{{0}}.{o}.scale") for d, o in _NORMS),
    *(Rename(f"single_transformer_blocks.{{0}}.attn.{d}.weight", f"single_blocks.{{0}}.norm.{o}.scale")
      for d, o in (("norm_q", "query_norm"), ("norm_k", "key_norm"))),
    Rename("proj_out", "final_layer.linear"),
    Rename("norm_out.linear", "final_layer.adaLN_modulation.1", rows=(1, 0)),
)  # fmt: skip

FORMAT = LoraFormat(name="FLUX.1 original (ComfyUI, kohya sd-scripts)", renames=_DOUBLE + _SINGLE, full=_FULL)
