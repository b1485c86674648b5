"""MiniMax-H3's original LoRA keys: the module names of MiniMax's own checkpoint (`blocks.N.attn.qkv_proj`,
`token_refiner.blocks.N`, `final_layer.video_out`, ...) with `diffusion_model.` in front, as ai-toolkit writes them,
and kohya's `lora_down` / `lora_up` / `alpha` tensors. diffusers' `_convert_non_diffusers_minimax_h3_lora_to_diffusers`
(what MiniMaxH3LoraLoaderMixin.lora_state_dict runs on `diffusion_model.` keys) maps them back, folding each alpha
into the weights and splitting the fused qkv by sharing `lora_down` and cutting `lora_up` in thirds (exact for the
block-diagonal fused adapter). Not named: `ff.net.0.proj` (`mlp.fc1`, whose two output halves the original holds in
the other order: a row swap of `lora_up` this format does not express)."""

from train.lora_format import LoraFormat, Rename

_BLOCKS = tuple(
    r
    for d, o in (("transformer_blocks", "blocks"), ("token_refiner.refiner_blocks", "token_refiner.blocks"))
    for r in (
        *(Rename(f"{d}.{{0}}.attn.{p}", f"{o}.{{0}}.attn.qkv_proj", i, 3)
          for i, p in enumerate(("to_q", "to_k", "to_v"))),
        Rename(f"{d}.{{0}}.attn.to_out.0", f"{o}.{{0}}.attn.out_proj"),
        Rename(f"{d}.{{0}}.ff.net.2", f"{o}.{{0}}.mlp.fc2"),
    )
) + (Rename("transformer_blocks.{0}.adaln_proj.linear", "blocks.{0}.adaln_proj.linear"),)  # fmt: skip
_OUTSIDE = tuple(
    Rename(d, o)
    for d, o in (
        ("proj_in", "video_patch_proj"),
        ("audio_proj_in", "audio_patch_proj"),
        ("context_embedder", "condition_proj"),
        ("time_embedder.linear_1", "time_embedder.proj_in"),
        ("time_embedder.linear_2", "time_embedder.proj_out"),
        ("norm_out.linear", "final_layer.adaln_proj.linear"),
        ("proj_out", "final_layer.video_out"),
        ("audio_proj_out", "final_layer.audio_out"),
    )
)

# Full weights (the published single file, Comfy-Org/MiniMax-H3, which `from_single_file`'s
# `convert_minimax_h3_transformer_checkpoint_to_diffusers` reads with its default `[q; k; v]` stack): the blocks' norms
# under the original block names, and the gated MLP's fc1 as `[gate; value]` where diffusers' SwiGLU has
# `[value; gate]`.
_FULL = tuple(
    r
    for d, o in (("transformer_blocks", "blocks"), ("token_refiner.refiner_blocks", "token_refiner.blocks"))
    for r in (
        Rename(f"{d}.{{0}}.norm{{1}}", f"{o}.{{0}}.norm{{1}}"),
        Rename(f"{d}.{{0}}.attn.norm_q", f"{o}.{{0}}.attn.q_norm"),
        Rename(f"{d}.{{0}}.attn.norm_k", f"{o}.{{0}}.attn.k_norm"),
        Rename(f"{d}.{{0}}.ff.net.0.proj", f"{o}.{{0}}.mlp.fc1", rows=(1, 0)),
    )
) + (Rename("norm_out.norm", "final_layer.norm"),)

FORMAT = LoraFormat(name="MiniMax-H3 original (ai-toolkit, ComfyUI)", renames=_BLOCKS + _OUTSIDE, full=_FULL)
