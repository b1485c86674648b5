"""Wan Animate's face adapter under CP: each rank's tokens attend to their own latent frame's motion features.

The face adapter after every ``inject_face_latents_blocks``-th block is a cross-attention from the video tokens to the
motion features of the token's latent frame (forward()'s ``motion_vec``, (B, T, N + 1, C), built whole on every rank
from the face video). diffusers' ``WanAnimateFaceBlockAttnProcessor`` regroups the queries by frame
(``query.unflatten(1, (T, -1))``), which needs every frame's tokens: a rank's shard is whole tokens, not whole frames
(35 tokens on 2 ranks: 18 + 17, 7 per frame), and its dispatch with the model's CP config would run Ulysses over
(B * T, S / T) queries against (B * T, N + 1) keys.

:class:`WanAnimateFaceCPAttnProcessor` is the stock processor, except that the frame grouping uses each token's global
position (train/cp/whole.py ``shard_span``): this rank's queries are placed in the whole frames they touch (the first
and last one partly, zero rows beside them), attend to those frames' keys, and the padding rows are dropped. Exact:
the attention is token-wise (a query's keys are its frame's, whatever else the rank holds), so each rank computes its
tokens' outputs exactly, and the motion encoder's and adapters' gradients are this rank's share (their SUM over the
CP group is serial). The plan (cp_plans/wananimate.yaml, ``cp_processors``) installs it on every face adapter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_wan_animate import (
    WanAnimateFaceBlockAttnProcessor,
    _get_qkv_projections,
)

from train.cp import whole  # by module: tests stand in for its functions


class WanAnimateFaceCPAttnProcessor(WanAnimateFaceBlockAttnProcessor):
    """``WanAnimateFaceBlockAttnProcessor.__call__`` with the frames of this rank's tokens found by global position."""

    replaces = WanAnimateFaceBlockAttnProcessor
    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None) -> torch.Tensor:
        # forward() calls the adapter without a mask; the stock processor would multiply its output by one per token
        assert attention_mask is None, "WanAnimateTransformer3DModel passes the face adapter no mask"
        hidden_states = attn.pre_norm_q(hidden_states)
        motion = attn.pre_norm_kv(encoder_hidden_states)
        B, T, N, _ = motion.shape
        query, key, value = _get_qkv_projections(attn, hidden_states, motion.flatten(1, 2))
        query = attn.norm_q(query.unflatten(2, (attn.heads, -1)))  # (B, s, H, D)
        key = attn.norm_k(key.view(B, T, N, attn.heads, -1))  # (B, T, N, H, D)
        value = value.view(B, T, N, attn.heads, -1)

        s = query.shape[1]
        start, total = whole.shard_span(self._parallel_config, s, query.device)
        if total % T:
            raise ValueError(f"the face adapter needs whole frames: {total} video tokens over {T} motion frames")
        per_frame = total // T
        first, last = start // per_frame, -(-(start + s) // per_frame)  # the frames this rank's tokens touch
        lead = start - first * per_frame
        query = F.pad(query, (0, 0, 0, 0, lead, last * per_frame - start - s))  # whole frames: zero rows beside
        out = dispatch_attention_fn(
            query.unflatten(1, (last - first, per_frame)).flatten(0, 1),  # (B * frames, per_frame, H, D)
            key[:, first:last].flatten(0, 1),  # (B * frames, N, H, D)
            value[:, first:last].flatten(0, 1),
            attn_mask=None, dropout_p=0.0, is_causal=False, backend=self._attention_backend,
        )  # fmt: skip
        out = out.flatten(2, 3).type_as(query).unflatten(0, (B, last - first)).flatten(1, 2)
        return attn.to_out(out[:, lead : lead + s])


def install(model: torch.nn.Module) -> int:
    """Give every face adapter running the stock processor the CP processor; returns how many."""
    count = 0
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if type(processor) is WanAnimateFaceCPAttnProcessor.replaces:
            new = WanAnimateFaceCPAttnProcessor()
            new._attention_backend = getattr(processor, "_attention_backend", None)  # set_attention_backend's choice
            module.set_processor(new)
            count += 1
    return count
