"""HunyuanVideo's original LoRA keys: the module names of Tencent's own checkpoint (`HunyuanVideo` repository,
`double_blocks.N.img_attn_qkv`, `single_blocks.N.linear1`, `txt_in.individual_token_refiner...`) with
`diffusion_model.` in front and peft's `lora_A` / `lora_B` tensors, as ComfyUI and musubi-tuner read them. diffusers'
`_convert_hunyuan_video_lora_to_diffusers` (what HunyuanVideoLoraLoaderMixin.lora_state_dict runs on a file with an
`img_attn_qkv` key) maps them back: it splits a fused qkv / linear1 by sharing `lora_A` and cutting `lora_B` by rows,
exact for the block-diagonal fused adapter. It reads no alpha tensor (nor `lora_down` / `lora_up`), so every layer
carries its scale in `lora_B`. Not named: `norm_out.linear` (its converter also permutes `lora_A`) and `x_embedder`
(a convolution)."""

from train.lora_format import LoraFormat, Rename

_DOUBLE = (
    *(Rename(f"transformer_blocks.{{0}}.attn.{d}", "double_blocks.{0}.img_attn_qkv", i, 3)
      for i, d in enumerate(("to_q", "to_k", "to_v"))),
    *(Rename(f"transformer_blocks.{{0}}.attn.{d}", "double_blocks.{0}.txt_attn_qkv", i, 3)
      for i, d in enumerate(("add_q_proj", "add_k_proj", "add_v_proj"))),
    *(Rename(f"transformer_blocks.{{0}}.{d}", f"double_blocks.{{0}}.{o}") for d, o in
      (("attn.to_out.0", "img_attn_proj"), ("attn.to_add_out", "txt_attn_proj"), ("norm1.linear", "img_mod.linear"),
       ("norm1_context.linear", "txt_mod.linear"), ("ff.net.0.proj", "img_mlp.fc1"), ("ff.net.2", "img_mlp.fc2"),
       ("ff_context.net.0.proj", "txt_mlp.fc1"), ("ff_context.net.2", "txt_mlp.fc2"))),
)  # fmt: skip
_SINGLE = (
    *(Rename(f"single_transformer_blocks.{{0}}.{d}", "single_blocks.{0}.linear1", i, 4)
      for i, d in enumerate(("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"))),
    Rename("single_transformer_blocks.{0}.proj_out", "single_blocks.{0}.linear2"),
    Rename("single_transformer_blocks.{0}.norm.linear", "single_blocks.{0}.modulation.linear"),
)  # fmt: skip
_REFINER = (
    *(Rename(f"context_embedder.token_refiner.refiner_blocks.{{0}}.attn.{d}",
             "txt_in.individual_token_refiner.blocks.{0}.self_attn_qkv", i, 3)
      for i, d in enumerate(("to_q", "to_k", "to_v"))),
    *(Rename(f"context_embedder.token_refiner.refiner_blocks.{{0}}.{d}", f"txt_in.individual_token_refiner.blocks.{{0}}.{o}")
      for d, o in (("attn.to_out.0", "self_attn_proj"), ("ff.net.0.proj", "mlp.fc1"), ("ff.net.2", "mlp.fc2"),
                   ("norm_out.linear", "adaLN_modulation.1"))),
)  # fmt: skip
_OUTSIDE = tuple(
    Rename(d, o)
    for d, o in (
        ("context_embedder.proj_in", "txt_in.input_embedder"),
        ("context_embedder.time_text_embed.timestep_embedder.linear_1", "txt_in.t_embedder.mlp.0"),
        ("context_embedder.time_text_embed.timestep_embedder.linear_2", "txt_in.t_embedder.mlp.2"),
        ("context_embedder.time_text_embed.text_embedder.linear_1", "txt_in.c_embedder.linear_1"),
        ("context_embedder.time_text_embed.text_embedder.linear_2", "txt_in.c_embedder.linear_2"),
        ("time_text_embed.timestep_embedder.linear_1", "time_in.mlp.0"),
        ("time_text_embed.timestep_embedder.linear_2", "time_in.mlp.2"),
        ("time_text_embed.guidance_embedder.linear_1", "guidance_in.mlp.0"),
        ("time_text_embed.guidance_embedder.linear_2", "guidance_in.mlp.2"),
        ("time_text_embed.text_embedder.linear_1", "vector_in.in_layer"),
        ("time_text_embed.text_embedder.linear_2", "vector_in.out_layer"),
        ("proj_out", "final_layer.linear"),
    )
)

FORMAT = LoraFormat(
    name="HunyuanVideo original (ComfyUI, musubi-tuner)",
    renames=_DOUBLE + _SINGLE + _REFINER + _OUTSIDE,
    down="lora_A",
    up="lora_B",
    alpha=False,
)
