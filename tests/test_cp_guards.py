"""Startup guards: what cannot train correctly under CP is refused with a clear error, before any collective.

After every refusal the ranks must still be in step: each case ends with a collective that would time out (the
process group has a timeout) if a rank had entered a collective the others skipped.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.distributed import run_distributed
from tests.tiny_models import build_inputs, build_model, output_tensors


def _expect_error(fn, exc=ValueError) -> str | None:
    try:
        fn()
    except exc as e:
        return str(e)
    return None


def _in_step() -> bool:
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item() == dist.get_world_size()


def _guard_cases(rank: int, world: int) -> dict:
    from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn
    from torch.distributed.device_mesh import init_device_mesh

    from train.cp import enable_context_parallel

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("ring", "ulysses"))
    res: dict = {}

    # Helios: refused for training (at enable time when asked, else at the first training forward) ...
    helios = build_model("helios")
    res["helios_enable"] = _expect_error(lambda: enable_context_parallel(helios, mesh=mesh, for_training=True))
    helios = build_model("helios")
    state = enable_context_parallel(helios, mesh=mesh)
    res["helios_problems"] = list(state.problems)  # the model's CP state says why (the guard refuses with it)
    inputs = build_inputs("helios")
    res["helios_train"] = _expect_error(lambda: helios(**inputs, return_dict=False))
    res["helios_in_step"] = _in_step()
    # ... while inference stays allowed and matches serial.
    with torch.no_grad():
        cp_out = output_tensors("helios", helios(**inputs, return_dict=False))[0]
        ref = output_tensors("helios", build_model("helios")(**build_inputs("helios"), return_dict=False))[0]
    res["helios_inference_err"] = (cp_out - ref).abs().max().item()

    # LTX / LTX2 with a text mask: per-head masks; refused in training, with the fix in the message.
    for name in ("ltx", "ltx2"):
        model = build_model(name)
        enable_context_parallel(model, mesh=mesh)
        masked = build_inputs(name, with_text_mask=True)
        res[f"{name}_mask"] = _expect_error(lambda m=model, x=masked: m(**x, return_dict=False))
        res[f"{name}_in_step"] = _in_step()

    # The same text mask passed by position is refused too.
    model, masked = build_model("ltx"), build_inputs("ltx", with_text_mask=True)
    enable_context_parallel(model, mesh=mesh)
    first = ("hidden_states", "encoder_hidden_states", "timestep", "encoder_attention_mask")
    args = tuple(masked.pop(n) for n in first)
    res["ltx_positional_mask"] = _expect_error(lambda: model(*args, **masked, return_dict=False))
    res["positional_in_step"] = _in_step()

    # Op level: a per-head mask and attention dropout in training are refused on every rank, no hang.
    cfg = enable_context_parallel(build_model("wan"), mesh=mesh)
    q = torch.randn(1, 5, 4, 8, requires_grad=True)
    per_head = torch.ones(1, 4, 1, 5, dtype=torch.bool)
    call = dict(backend=AttentionBackendName.NATIVE, parallel_config=cfg)
    res["per_head"] = _expect_error(lambda: dispatch_attention_fn(q, q, q, attn_mask=per_head, **call))
    res["dropout"] = _expect_error(lambda: dispatch_attention_fn(q, q, q, dropout_p=0.1, **call))
    res["op_in_step"] = _in_step()
    # A processor shared by a local-attention module (MiniMax's text refiner) and a CP one: refused before CP is set up.
    minimax = build_model("minimax_h3")
    minimax.set_attn_processor(type(minimax.token_refiner.refiner_blocks[0].attn.processor)())  # one instance for all
    res["shared_local"] = _expect_error(lambda: enable_context_parallel(minimax, mesh=mesh))
    res["shared_in_step"] = _in_step()
    # Wrong plan file: a path that is not in the model.
    res["bad_degree"] = _expect_error(lambda: enable_context_parallel(build_model("wan"), mesh=mesh, degree=world + 1))
    return res


def test_guards_refuse_before_any_collective() -> None:
    for res in run_distributed(_guard_cases, 2):
        assert res["helios_enable"] and "cannot be trained" in res["helios_enable"]
        assert res["helios_train"] and "gather" in res["helios_train"]
        assert res["helios_problems"] and all(p in res["helios_train"] for p in res["helios_problems"])
        assert res["helios_inference_err"] < 1e-5
        for name in ("ltx", "ltx2"):
            assert res[f"{name}_mask"] and "encoder_attention_mask=None" in res[f"{name}_mask"], res[f"{name}_mask"]
        assert res["per_head"] and "per-head attention mask" in res["per_head"]
        assert res["dropout"] and "dropout" in res["dropout"]
        assert res["bad_degree"] and "disagrees" in res["bad_degree"]
        # Refused by the startup guard (which names the argument), not only later inside the attention op.
        positional = res["ltx_positional_mask"]
        assert positional and "turn ['encoder_attention_mask'] into per-head" in positional, positional
        assert res["positional_in_step"]
        assert res["shared_local"] and "are shared with other attention modules" in res["shared_local"]
        assert res["helios_in_step"] and res["ltx_in_step"] and res["ltx2_in_step"] and res["op_in_step"]
        assert res["shared_in_step"]
