"""Qwen-Image 2.1's block-causal attention under CP: the stock segment loop on head shards of the whole sequence.

diffusers' ``QwenImage21AttnProcessor`` (the default) attends the joint [text | image] sequence block-causally: it cuts
the queries and keys into segments by their positions in the whole sequence (``segments``, from forward()) and attends
each text segment causally to the keys before it, each condition image bidirectionally to the keys up to its end, the
target image to every key; padded text keys are dropped (``key_valid``, (B, S)). On a rank's token shard those
positions are other tokens, so the stock processor under CP attends wrong (measured on the sweep's tiny instance: the
split key norm used whole, four 11-token calls the splits do not explain).

:class:`QwenImage21CPAttnProcessor` projects, normalises and rotates this rank's tokens as the stock processor does,
then moves Q/K/V to head shards of the whole sequence (train/cp/whole.py: one all-to-all over the whole CP group), runs
the stock segment loop there unchanged, locally, and moves the output back. Exact: attention is per head. The plan
(cp_plans/qwenimage21.yaml, ``cp_processors``) installs it on every block; serial runs keep the stock processor.

Not covered under CP: the pipeline's prefix KV cache (``kv_cache``: its decode steps run only the target tokens, a
sequence the plan's splits do not describe) and the flex processor (its BlockMask has no CPU backward here). Both are
refused in one line.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_qwenimage21 import (
    QwenImage21AttnProcessor,
    _qwenimage21_prepare_qkv,
)

from train.cp import whole  # by module: tests stand in for its functions
from train.errors import UserError


def _segment_attention(query, key, value, segments, key_valid, backend) -> torch.Tensor:
    """The stock prefill loop (QwenImage21AttnProcessor.__call__), on whole-sequence tensors, without CP."""
    prefix_len = segments[-1][1] if segments else 0
    outputs = []
    for start, end, is_text in segments:
        mask = None
        if is_text:  # causal within the text segment, everything before it
            n = end - start
            ones = torch.ones(n, start, dtype=torch.bool, device=query.device)
            mask = torch.cat([ones, torch.tril(torch.ones(n, n, dtype=torch.bool, device=query.device))], dim=1)
            mask = mask[None, None]
        if key_valid is not None:
            valid = key_valid[:, None, None, :end]
            mask = valid if mask is None else mask & valid
        outputs.append(
            dispatch_attention_fn(query[:, start:end], key[:, :end], value[:, :end], attn_mask=mask, backend=backend)
        )
    mask = None if key_valid is None else key_valid[:, None, None, :]
    outputs.append(dispatch_attention_fn(query[:, prefix_len:], key, value, attn_mask=mask, backend=backend))
    return torch.cat(outputs, dim=1)


class QwenImage21CPAttnProcessor(QwenImage21AttnProcessor):
    """``QwenImage21AttnProcessor`` with the segment loop between the two all-to-alls of head-sharded attention."""

    replaces = QwenImage21AttnProcessor
    _attention_backend = None
    _parallel_config = None

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        attention_mask=None,
        rotary_emb: torch.Tensor | None = None,
        layer_cache=None,
        kv_cache_mode: str | None = None,
        cache_write_slice: slice | None = None,
        segments: list[tuple[int, int, bool]] | None = None,
        key_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if layer_cache is not None or segments is None:
            raise UserError(
                "Qwen-Image 2.1 under context parallelism runs the whole joint sequence (its prefill); its prefix KV "
                "cache is not supported there: call the pipeline with use_kv_cache=False"
            )
        query, key, value, _ = _qwenimage21_prepare_qkv(attn, hidden_states, rotary_emb, None, None, None)
        dtype = query.dtype
        query, key, value, back = whole.heads_on_whole_sequence(self._parallel_config, query, key, value)
        out = _segment_attention(query, key, value, segments, key_valid, None)
        out = back(out).flatten(2, 3).to(dtype)
        return attn.to_out[1](attn.to_out[0](out))


def install(model: torch.nn.Module) -> int:
    """Give every block's attention running the stock processor the CP processor; returns how many."""
    count = 0
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if type(processor) is QwenImage21CPAttnProcessor.replaces:
            module.set_processor(QwenImage21CPAttnProcessor())
            count += 1
    return count
