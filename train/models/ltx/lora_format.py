"""LTX-Video's original LoRA keys: the LTX-Video code names its modules as diffusers does, and Lightricks'
LTX-Video-Trainer saves its ComfyUI LoRAs as those paths behind `diffusion_model.` with peft's `lora_A` / `lora_B`
and no alpha. diffusers' `_convert_non_diffusers_ltxv_lora_to_diffusers` (LTXVideoLoraLoaderMixin) strips the prefix
and reads alpha = rank, so the scale alpha / rank is folded into `lora_B`."""

from train.lora_format import LoraFormat, Rename

# Full weights (Lightricks' single-file checkpoint, which `from_single_file`'s
# `convert_ltx_transformer_checkpoint_to_diffusers` reads): the diffusers names but for these.
_FULL = (
    Rename("proj_in", "patchify_proj"),
    Rename("time_embed.emb.timestep_embedder.linear_{0}", "adaln_single.emb.timestep_embedder.linear_{0}"),
    Rename("time_embed.linear", "adaln_single.linear"),
    Rename("transformer_blocks.{0}.attn{1}.norm_q", "transformer_blocks.{0}.attn{1}.q_norm"),
    Rename("transformer_blocks.{0}.attn{1}.norm_k", "transformer_blocks.{0}.attn{1}.k_norm"),
)

FORMAT = LoraFormat(name="LTX-Video original (LTX-Video-Trainer / ComfyUI)", renames=(), keep_names=True,
                    down="lora_A", up="lora_B", alpha=False, full=_FULL)  # fmt: skip
