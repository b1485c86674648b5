"""FLUX.2's original LoRA keys: the module names of Black Forest Labs' checkpoint (`double_blocks`, `single_blocks`,
`img_in`, ...) in kohya's form (`lora_unet_` + the name with `_` for `.`, `lora_down` / `lora_up` / `alpha`), as
ComfyUI and kohya's sd-scripts / musubi-tuner read them. diffusers' `_convert_kohya_flux2_lora_to_diffusers`
(Flux2LoraLoaderMixin.lora_state_dict of a file with `lora_down` keys) maps every one back, splitting the fused
double-block `qkv` layers (block-diagonal up: each module's own adapter); the single blocks' `linear1` / `linear2` are
diffusers' fused `to_qkv_mlp_proj` / `to_out` as they are. That converter has no names for the guidance embedder, the
shared modulation layers or the final AdaLN: they are not in this format."""

from train.lora_format import LoraFormat, Rename, fused

_DOUBLE = (
    *fused(tuple(f"transformer_blocks.{{0}}.attn.{m}" for m in ("to_q", "to_k", "to_v")),
            "double_blocks.{0}.img_attn.qkv"),
    *fused(tuple(f"transformer_blocks.{{0}}.attn.{m}" for m in ("add_q_proj", "add_k_proj", "add_v_proj")),
            "double_blocks.{0}.txt_attn.qkv"),
    *(Rename(f"transformer_blocks.{{0}}.{d}", f"double_blocks.{{0}}.{o}") for d, o in
      (("attn.to_out.0", "img_attn.proj"), ("attn.to_add_out", "txt_attn.proj"), ("ff.linear_in", "img_mlp.0"),
       ("ff.linear_out", "img_mlp.2"), ("ff_context.linear_in", "txt_mlp.0"), ("ff_context.linear_out", "txt_mlp.2"))),
)  # fmt: skip
_SINGLE = (
    Rename("single_transformer_blocks.{0}.attn.to_qkv_mlp_proj", "single_blocks.{0}.linear1"),
    Rename("single_transformer_blocks.{0}.attn.to_out", "single_blocks.{0}.linear2"),
)
_OUTSIDE = tuple(
    Rename(d, o)
    for d, o in (
        ("x_embedder", "img_in"),
        ("context_embedder", "txt_in"),
        ("time_guidance_embed.timestep_embedder.linear_1", "time_in.in_layer"),
        ("time_guidance_embed.timestep_embedder.linear_2", "time_in.out_layer"),
        ("proj_out", "final_layer.linear"),
    )
)

# Full weights (BFL's single-file checkpoint, which `from_single_file`'s
# `convert_flux2_transformer_checkpoint_to_diffusers` reads): the guidance embedder, the shared modulations, the
# RMSNorms' `scale` and the final AdaLN with BFL's (shift, scale) halves where diffusers has (scale, shift).
_NORMS = (("norm_q", "img_attn.norm.query_norm"), ("norm_k", "img_attn.norm.key_norm"),
          ("norm_added_q", "txt_attn.norm.query_norm"), ("norm_added_k", "txt_attn.norm.key_norm"))  # fmt: skip
_FULL = (
    Rename("time_guidance_embed.guidance_embedder.linear_1", "guidance_in.in_layer"),
    Rename("time_guidance_embed.guidance_embedder.linear_2", "guidance_in.out_layer"),
    *(Rename(f"{m}.linear", f"{m}.lin") for m in ("double_stream_modulation_img", "double_stream_modulation_txt",
                                                    "single_stream_modulation")),
    *(Rename(f"transformer_blocks.{{0}}.attn.{d}.weight", f"double_blocks.{{0}}.{o}.scale") for d, o in _NORMS),
    *(Rename(f"single_transformer_blocks.{{0}}.attn.{d}.weight", f"single_blocks.{{0}}.norm.{o}.scale")
      for d, o in (("norm_q", "query_norm"), ("norm_k", "key_norm"))),
    Rename("norm_out.linear", "final_layer.adaLN_modulation.1", rows=(1, 0)),
)  # fmt: skip

FORMAT = LoraFormat(
    name="FLUX.2 original (ComfyUI, kohya sd-scripts)", renames=_DOUBLE + _SINGLE + _OUTSIDE, kohya=True, full=_FULL
)
