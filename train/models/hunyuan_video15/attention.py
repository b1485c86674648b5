"""HunyuanVideo 1.5's joint attention with a key-padding mask, the form context parallelism can split.

diffusers' ``HunyuanVideo15AttnProcessor2_0`` pads the (B, S_text) conditioning mask with True over the video tokens
and attends with the outer product ``mask_i & mask_j`` (B, 1, S, S). A row of a valid query is ``mask_j``: the key
mask. Rows of padded conditioning tokens differ (all False there, every valid key here), but a padded token's state
reaches nothing else: later blocks see it only as a masked key / value, its feed-forward is per token, and the model
output reads the video tokens only. So the video output and every parameter gradient are the same with the key mask
(B, 1, 1, S) (tests/test_hunyuan15.py checks both against the stock processor). Under Ulysses that mask is split along
the keys like the [video_r | text_r] sequence of each rank and rides in the Q/K/V all-to-all; the stock processor
would build only each rank's own (s_r x s_r) block from its local sequence length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.attention_dispatch import dispatch_attention_fn  # a module global, as the stock processor's
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0


class HunyuanVideo15KeyMaskAttnProcessor(HunyuanVideo15AttnProcessor2_0):
    """The stock processor with the key mask (B, 1, 1, S) in place of ``mask_i & mask_j``."""

    replaces = HunyuanVideo15AttnProcessor2_0

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        from diffusers.models.embeddings import apply_rotary_emb

        query = attn.to_q(hidden_states).unflatten(2, (attn.heads, -1))
        key = attn.to_k(hidden_states).unflatten(2, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        query, key = attn.norm_q(query), attn.norm_k(key)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        if encoder_hidden_states is not None:
            encoder_query = attn.add_q_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
            encoder_key = attn.add_k_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
            encoder_value = attn.add_v_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
            if attn.norm_added_q is not None:
                encoder_query = attn.norm_added_q(encoder_query)
            if attn.norm_added_k is not None:
                encoder_key = attn.norm_added_k(encoder_key)
            query = torch.cat([query, encoder_query], dim=1)
            key = torch.cat([key, encoder_key], dim=1)
            value = torch.cat([value, encoder_value], dim=1)

        batch_size, seq_len = query.shape[:2]
        attention_mask = F.pad(attention_mask, (seq_len - attention_mask.shape[1], 0), value=True).bool()
        attention_mask = attention_mask.view(batch_size, 1, 1, seq_len)

        hidden_states = dispatch_attention_fn(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
            backend=self._attention_backend, parallel_config=self._parallel_config,
        )  # fmt: skip
        hidden_states = hidden_states.flatten(2, 3).to(query.dtype)

        if encoder_hidden_states is not None:
            text_len = encoder_hidden_states.shape[1]
            hidden_states, encoder_hidden_states = hidden_states[:, :-text_len], hidden_states[:, -text_len:]
            if getattr(attn, "to_out", None) is not None:
                hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
            if getattr(attn, "to_add_out", None) is not None:
                encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        return hidden_states, encoder_hidden_states


def install(model: torch.nn.Module) -> int:
    """Give every attention module running the stock processor its own key-mask processor; returns how many."""
    count = 0
    for module in model.modules():
        if type(getattr(module, "processor", None)) is HunyuanVideo15KeyMaskAttnProcessor.replaces:
            processor = HunyuanVideo15KeyMaskAttnProcessor()
            processor._attention_backend = module.processor._attention_backend  # set_attention_backend's choice
            module.set_processor(processor)
            count += 1
    return count
