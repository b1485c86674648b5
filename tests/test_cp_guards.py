"""Startup guards: what cannot train correctly under CP is refused with a clear error, before any collective.

After every refusal the ranks must still be in step: each case ends with a collective that would time out (the
process group has a timeout) if a rank had entered a collective the others skipped.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from tests.harness import rank_job
from train.tools.tiny_models import build_inputs, build_model, output_tensors


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


@rank_job(2)
def _guard_cases(rank: int, world: int) -> dict:
    from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn
    from torch.distributed.device_mesh import init_device_mesh

    from train.cp import enable_context_parallel
    from train.cp.plans import plan_for

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

    # LTX with its text mask (per-head inside its processors) trains under CP since issue 12: no refusal, serial output.
    model, masked = build_model("ltx"), build_inputs("ltx")
    enable_context_parallel(model, mesh=mesh)
    out = output_tensors("ltx", model(**masked, return_dict=False))[0]
    with torch.no_grad():
        ref = output_tensors("ltx", build_model("ltx")(**masked, return_dict=False))[0]
    res["ltx_mask_err"] = (out.detach() - ref).abs().max().item()
    res["ltx_in_step"] = _in_step()
    # LTX-2 trains with its text masks too, but its (B, S, S) video self-attention mask cannot reach the attention
    # intact under CP: its plan lists it (per_head_mask_inputs), so a training forward that feeds it is refused.
    model = build_model("ltx2")
    enable_context_parallel(model, mesh=mesh)
    masked = build_inputs("ltx2", with_text_mask=True)
    video = masked["hidden_states"].shape[1]
    masked["video_self_attention_mask"] = torch.ones(1, video, video)
    res["ltx2_mask"] = _expect_error(lambda: model(**masked, return_dict=False))
    res["ltx2_in_step"] = _in_step()

    # A plan's per_head_mask_inputs (masks it says cannot be sharded) are refused when fed, by position too.
    model, masked = build_model("ltx"), build_inputs("ltx")
    refusing = dataclasses.replace(plan_for(model), per_head_mask_inputs=("encoder_attention_mask",))
    enable_context_parallel(model, mesh=mesh, plan=refusing)
    first = ("hidden_states", "encoder_hidden_states", "timestep", "encoder_attention_mask")
    args = tuple(masked.pop(n) for n in first)
    res["ltx_positional_mask"] = _expect_error(lambda: model(*args, **masked, return_dict=False))
    res["positional_in_step"] = _in_step()

    # Op level: a mask whose head dim is neither 1 nor the heads, and attention dropout in training, are refused on
    # every rank, no hang.
    cfg = enable_context_parallel(build_model("wan"), mesh=mesh)
    q = torch.randn(1, 5, 4, 8, requires_grad=True)
    per_head = torch.ones(1, 3, 1, 5, dtype=torch.bool)
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


def test_guards_refuse_before_any_collective(group) -> None:
    for res in group(_guard_cases, 2):
        assert res["helios_enable"] and "cannot be trained" in res["helios_enable"]
        assert res["helios_train"] and "gather" in res["helios_train"]
        assert res["helios_problems"] and all(p in res["helios_train"] for p in res["helios_problems"])
        assert res["helios_inference_err"] < 1e-5
        assert res["ltx_mask_err"] < 1e-5, res["ltx_mask_err"]
        assert res["ltx2_mask"] and "pass video_self_attention_mask=None" in res["ltx2_mask"], res["ltx2_mask"]
        assert res["per_head"] and "or per head (B, 4, S_q|1, S_kv); got (1, 3, 1, 5)" in res["per_head"]
        assert res["dropout"] and "dropout" in res["dropout"]
        assert res["bad_degree"] and "disagrees" in res["bad_degree"]
        # Refused by the startup guard (which names the argument), not only later inside the attention op.
        positional = res["ltx_positional_mask"]
        assert positional and "lists ['encoder_attention_mask'] as masks Ulysses cannot shard" in positional
        assert res["positional_in_step"]
        assert res["shared_local"] and "are shared with other attention modules" in res["shared_local"]
        assert res["helios_in_step"] and res["ltx_in_step"] and res["ltx2_in_step"] and res["op_in_step"]
        assert res["shared_in_step"]
