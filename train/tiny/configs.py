"""Tiny transformer configs for every family: 7 heads (divisible by none of 2, 3, 4) of dim 8, 1-2 layers.

Used by the tiny recipes (as their init_config), the tiny pipelines of the demo, and the tests.
"""

from __future__ import annotations

from typing import Any

NUM_HEADS = 7
HEAD_DIM = 8
INNER_DIM = NUM_HEADS * HEAD_DIM  # 56
TEXT_DIM = 16

# Wan, ChronoEdit and Helios share the Wan block layout.
_WAN_BLOCKS: dict[str, Any] = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=NUM_HEADS,
    attention_head_dim=HEAD_DIM,
    in_channels=4,
    out_channels=4,
    text_dim=TEXT_DIM,
    freq_dim=32,
    ffn_dim=32,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
)

# Model configs --------------------------------------------------------------------------------------------------------

CONFIGS: dict[str, dict[str, Any]] = {
    "flux": dict(
        patch_size=1,
        in_channels=16,
        num_layers=1,  # double-stream block
        num_single_layers=1,  # single-stream block
        attention_head_dim=HEAD_DIM,
        num_attention_heads=NUM_HEADS,
        joint_attention_dim=TEXT_DIM,
        pooled_projection_dim=12,
        guidance_embeds=True,
        axes_dims_rope=(2, 2, 4),  # sums to HEAD_DIM
    ),
    "flux2": dict(
        patch_size=1,
        in_channels=16,
        num_layers=1,  # double-stream block
        num_single_layers=1,  # single-stream (parallel attention + MLP) block
        attention_head_dim=HEAD_DIM,
        num_attention_heads=NUM_HEADS,
        joint_attention_dim=TEXT_DIM,
        timestep_guidance_channels=32,
        mlp_ratio=3.0,
        axes_dims_rope=(2, 2, 2, 2),  # sums to HEAD_DIM
        guidance_embeds=True,
    ),
    "qwenimage": dict(
        patch_size=2,
        in_channels=16,  # 4 latent channels x 2x2 patch
        out_channels=4,
        num_layers=2,
        attention_head_dim=HEAD_DIM,
        num_attention_heads=NUM_HEADS,
        joint_attention_dim=TEXT_DIM,
        axes_dims_rope=(2, 2, 4),  # sums to HEAD_DIM
    ),
    "wan": dict(_WAN_BLOCKS, rope_max_seq_len=32),
    # Image-to-video config (like the real ChronoEdit-14B): image embeddings go through the added K/V projections
    # (projected to the inner dim first).
    "chronoedit": dict(_WAN_BLOCKS, image_dim=12, added_kv_proj_dim=INNER_DIM, rope_max_seq_len=32),
    "ltx": dict(
        in_channels=8,
        out_channels=8,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=NUM_HEADS,
        attention_head_dim=HEAD_DIM,
        cross_attention_dim=INNER_DIM,  # cross-attention K/V come from caption_projection (-> inner dim)
        num_layers=2,
        caption_channels=TEXT_DIM,
        qk_norm="rms_norm_across_heads",
    ),
    # num_attention_heads * attention_head_dim (56) differs from hidden_size (48), as in the real checkpoint, and the
    # rope rotates 2 * 3 * rope_freq_dim = 6 of the 8 head channels (partial-rotary path exercised).
    "minimax_h3": dict(
        num_attention_heads=NUM_HEADS,
        attention_head_dim=HEAD_DIM,
        hidden_size=48,
        num_layers=1,  # main AdaLN block
        num_refiner_layers=1,  # text token-refiner block
        ffn_dim=32,
        in_channels=4,
        audio_in_channels=6,
        patch_size=(1, 2, 2),
        text_dim=TEXT_DIM,
        freq_dim=16,
        time_embed_hidden_dim=32,
        time_embed_dim=24,
        rope_freq_dim=1,
    ),
    "helios": dict(
        _WAN_BLOCKS,
        num_layers=1,
        rope_dim=(4, 2, 2),  # sums to HEAD_DIM
        guidance_cross_attn=True,
        zero_history_timestep=True,
        has_multi_term_memory_patch=True,
    ),
    "ltx2": dict(
        in_channels=8,
        out_channels=8,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=NUM_HEADS,
        attention_head_dim=HEAD_DIM,
        cross_attention_dim=INNER_DIM,
        audio_in_channels=4,
        audio_out_channels=4,
        audio_num_attention_heads=NUM_HEADS,
        audio_attention_head_dim=4,
        audio_cross_attention_dim=NUM_HEADS * 4,  # = audio inner dim (a2v / v2a attention width)
        num_layers=1,
        qk_norm="rms_norm_across_heads",
        caption_channels=TEXT_DIM,
        rope_double_precision=False,
    ),
}
