"""Wan's original LoRA keys: the module names of Wan-AI's own checkpoint (`Wan2.1` / `Wan2.2` repositories), with
`diffusion_model.` in front and kohya's `lora_down` / `lora_up` / `alpha` tensors, as ComfyUI and musubi-tuner read
them. diffusers' `_convert_non_diffusers_wan_lora_to_diffusers` (what WanLoraLoaderMixin.load_lora_weights runs on
such a file) maps every one back. Its embedders' and head's branch pops no alpha tensor: those layers carry their
scale in `lora_up` instead."""

from train.lora_format import LoraFormat, Rename

_BLOCK = (
    *(Rename(f"blocks.{{0}}.attn1.{d}", f"blocks.{{0}}.self_attn.{o}") for d, o in
      (("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "o"))),
    *(Rename(f"blocks.{{0}}.attn2.{d}", f"blocks.{{0}}.cross_attn.{o}") for d, o in
      (("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "o"), ("add_k_proj", "k_img"),
       ("add_v_proj", "v_img"))),
    Rename("blocks.{0}.ffn.net.0.proj", "blocks.{0}.ffn.0"),
    Rename("blocks.{0}.ffn.net.2", "blocks.{0}.ffn.2"),
)  # fmt: skip
_OUTSIDE = tuple(
    Rename(d, o, alpha=False)
    for d, o in (
        ("condition_embedder.time_proj", "time_projection.1"),
        ("proj_out", "head.head"),
        ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
        ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
        ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
        ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
        ("condition_embedder.image_embedder.ff.net.0.proj", "img_emb.proj.1"),
        ("condition_embedder.image_embedder.ff.net.2", "img_emb.proj.3"),
    )
)

# Full weights (Wan-AI's single-file checkpoint, which `from_single_file`'s `convert_wan_transformer_to_diffusers`
# reads): what the LoRA renames do not name. diffusers' norm2 (the affine cross-attention norm) is Wan's norm3.
_FULL = (
    *(Rename(f"blocks.{{0}}.{d}.{n}", f"blocks.{{0}}.{o}.{n}") for d, o in (("attn1", "self_attn"),
      ("attn2", "cross_attn")) for n in ("norm_q", "norm_k")),
    Rename("blocks.{0}.attn2.norm_added_k", "blocks.{0}.cross_attn.norm_k_img"),
    Rename("blocks.{0}.norm2", "blocks.{0}.norm3"),
    Rename("blocks.{0}.scale_shift_table", "blocks.{0}.modulation"),
    Rename("scale_shift_table", "head.modulation"),
    Rename("condition_embedder.image_embedder.norm1", "img_emb.proj.0"),
    Rename("condition_embedder.image_embedder.norm2", "img_emb.proj.4"),
)  # fmt: skip

FORMAT = LoraFormat(name="Wan original (ComfyUI, musubi-tuner)", renames=_BLOCK + _OUTSIDE, full=_FULL)
