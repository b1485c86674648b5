"""Cosmos' self-attention through the dispatcher's CP path.

diffusers' ``CosmosAttnProcessor2_0`` calls ``dispatch_attention_fn`` without ``backend=`` and ``parallel_config=``
(and has no ``_parallel_config`` attribute for CP to set), so under CP each rank's self-attention would attend over
its own token shard only (measured on the sweep's tiny instance: the gathered output differs, relative 2e-1).
:class:`CosmosCPAttnProcessor` is the stock processor unchanged except that it hands the dispatcher its backend and
parallel config. The plan (cp_plans/cosmos.yaml, ``cp_processors``) installs it on the self-attention modules
(``attn1``) only: ``attn2`` is cross-attention onto the whole, replicated text, which each rank attends locally with
the stock processor, exactly. Serial runs keep the stock processor everywhere.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn  # a module global, as the stock processor's
from diffusers.models.transformers.transformer_cosmos import CosmosAttnProcessor2_0


class CosmosCPAttnProcessor(CosmosAttnProcessor2_0):
    """``CosmosAttnProcessor2_0.__call__`` plus ``backend`` / ``parallel_config`` in the dispatch call."""

    replaces = CosmosAttnProcessor2_0
    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        from diffusers.models.embeddings import apply_rotary_emb

        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        query = attn.to_q(hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        key = attn.to_k(context).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        value = attn.to_v(context).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        query, key = attn.norm_q(query), attn.norm_k(key)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, use_real=True, use_real_unbind_dim=-2)
            key = apply_rotary_emb(key, image_rotary_emb, use_real=True, use_real_unbind_dim=-2)
        key = key.repeat_interleave(query.size(3) // key.size(3), dim=3)  # GQA, as the stock processor
        value = value.repeat_interleave(query.size(3) // value.size(3), dim=3)
        out = dispatch_attention_fn(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=attention_mask,
            dropout_p=0.0, is_causal=False, backend=self._attention_backend, parallel_config=self._parallel_config,
        )  # fmt: skip
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def install(model: torch.nn.Module) -> int:
    """Give every self-attention module running the stock processor its own CP processor; returns how many."""
    count = 0
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if type(processor) is CosmosCPAttnProcessor.replaces and not module.is_cross_attention:
            new = CosmosCPAttnProcessor()
            new._attention_backend = getattr(processor, "_attention_backend", None)  # set_attention_backend's choice
            module.set_processor(new)
            count += 1
    return count
