"""Kandinsky 5's attention processor with its RoPE result kept in the query's dtype (float32 in a float32 run), the
processor the family trains with, serially and under CP alike (``SPEC.prepare_transformer``).

diffusers' ``Kandinsky5AttnProcessor`` rotates the queries and keys in float32, then rounds the result to bfloat16
(``apply_rotary`` ends in ``.to(torch.bfloat16)``) and casts it back to the query's dtype. In a bfloat16 run that is
the query's own dtype: the two processors compute the same values, bit for bit. In a float32 (or float64) run the
stock rounding puts every gradient upstream of the attention through bfloat16, so two float32 runs that differ only in
the last bits (serial vs CP: other GEMM shapes and reduction orders) differ by bfloat16 steps (measured with the stock
processor: 3e-4 at CP 2, 8e-3 at CP 3, where the fp32 parity tolerance is 2e-5). This processor keeps the rotation's
result in the query's dtype and is otherwise the stock one (the NABLA sparse mask included, for the pipeline's 10 s
checkpoints)."""

from __future__ import annotations

import torch


class Float32RopeProcessor:
    """``Kandinsky5AttnProcessor`` whose rotated queries and keys stay in the query's dtype (no bfloat16 rounding)."""

    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, rotary_emb=None, sparse_params=None):
        # the functions the stock processor calls, looked up where it looks them up (its module's names)
        from diffusers.models.transformers import transformer_kandinsky as stock

        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        query = attn.to_query(hidden_states).unflatten(-1, (attn.num_heads, -1))
        key = attn.to_key(context).unflatten(-1, (attn.num_heads, -1))
        value = attn.to_value(context).unflatten(-1, (attn.num_heads, -1))
        query = attn.query_norm(query.float()).type_as(query)
        key = attn.key_norm(key.float()).type_as(key)
        if rotary_emb is not None:
            query, key = rotate(query, rotary_emb), rotate(key, rotary_emb)
        mask = None
        if sparse_params is not None:  # the stock processor's NABLA block mask
            mask = stock.nablaT_v2(query, key, sparse_params["sta_mask"], thr=sparse_params["P"])
        out = stock.dispatch_attention_fn(query, key, value, attn_mask=mask, backend=self._attention_backend,
                                          parallel_config=self._parallel_config)  # fmt: skip
        return attn.out_layer(out.flatten(-2, -1))


def rotate(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """The stock ``apply_rotary`` (at least float32 arithmetic), its result in ``x``'s dtype instead of bfloat16."""
    compute = torch.promote_types(x.dtype, torch.float32)
    rotated = (rope * x.reshape(*x.shape[:-1], -1, 1, 2).to(compute)).sum(dim=-1)
    return rotated.reshape(*x.shape).to(x.dtype)


def float32_rope(model: torch.nn.Module) -> None:
    """with its RoPE in float32 (the stock processor rounds the rotated q and k to bfloat16).

    Every ``Kandinsky5Attention`` of ``model`` gets a :class:`Float32RopeProcessor` (set before the attention backend
    and CP, which configure the processors they find). The stock processor's ``apply_rotary`` ends in
    ``.to(torch.bfloat16)``, so every gradient upstream of the attention passes through bfloat16: two float32 runs that
    differ in the last bits (serial vs CP: other GEMM shapes and reduction orders) then differ by bfloat16 steps
    (measured with the stock processor: 3e-4 at CP 2, 8e-3 at CP 3). In bfloat16 both processors compute the same.
    """
    from diffusers.models.transformers.transformer_kandinsky import Kandinsky5Attention

    for module in model.modules():
        if isinstance(module, Kandinsky5Attention):
            module.set_processor(Float32RopeProcessor())
