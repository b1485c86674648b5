"""The layout registry (train/cp/layout.py): its core property, and one registry per model.

For any recorded splits and any true per-rank table the plan allows, what each rank decides from its OWN lengths must
agree across ranks: either every rank identifies the true table, or every rank finds it ambiguous and names the same
upper bounds, which cover the true lengths. Disagreement is what makes ranks enter different collectives (a hang).
Checked exhaustively without processes.

Every model CP is enabled on keeps its own registry, transport and stats in the state `enable_context_parallel`
returns; the CP core keeps nothing per process. Two models in one process, with interleaved forwards and
checkpoint recomputes, are checked on 2 gloo ranks against serial runs.
"""

from __future__ import annotations

import importlib
import pkgutil
import random

import pytest
import torch

from tests.harness import rank_job
from train.cp.layout import LayoutRegistry, split_sizes

TIES = (None, None, 0, 1)  # (q length, kv length, mask q dim, mask k dim), as the attention asks


def _verdicts(reg: LayoutRegistry, state: tuple, world: int, table: tuple) -> list[tuple]:
    return [reg.decide(state, world, TIES, r, tuple(col[r] for col in table)) for r in range(world)]


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
def test_every_rank_decides_alike(world: int) -> None:
    rng = random.Random(world)
    reg = LayoutRegistry()
    checked = ambiguous = 0
    for _ in range(60):
        # A few split lengths, often close to each other (the hard case) and sometimes shorter than the world.
        base = rng.randint(1, 40)
        lengths = sorted({max(1, base + rng.randint(-world, world)) for _ in range(rng.randint(1, 3))})
        state = tuple(dict.fromkeys(tuple(split_sizes(n, world)) for n in lengths))
        tables, _, _ = reg._hypotheses(state, world, TIES)
        for table in rng.sample(tables, min(40, len(tables))):
            verdicts = _verdicts(reg, state, world, table)
            kinds = {v for v, _ in verdicts}
            assert kinds in ({"identified"}, {"ambiguous"}), (state, table, verdicts)
            if kinds == {"identified"}:
                assert all(t == table for _, t in verdicts)
            else:
                ambiguous += 1
                bounds = {t for _, t in verdicts}
                assert len(bounds) == 1, (state, table, bounds)
                (bound,) = bounds
                assert all(b >= x for bc, tc in zip(bound, table) for b, x in zip(bc, tc)), (table, bound)
            checked += 1
    assert checked > 1000 and ambiguous > 0  # both outcomes were exercised


def test_a_sequence_the_splits_do_not_explain() -> None:
    # 12 tokens split outside the hooks, registry holding only an 11-token split (6, 5): rank 1 sees a length no
    # candidate has and raises; rank 0 alone cannot tell. This is what a wrong `layout_registry: true` looks like, and
    # why verify mode (every rank checks every call from exchanged sizes) exists for new plans.
    reg = LayoutRegistry()
    state = (tuple(split_sizes(11, 2)),)
    assert reg.decide(state, 2, TIES, 1, (6, 6, -1, -1))[0] == "unexplained"
    assert reg.decide(state, 2, TIES, 0, (6, 6, -1, -1)) == ("identified", ((6, 5), (6, 5), (-1, -1), (-1, -1)))


# --------------------------------------------------------------------------------------------- one registry per model


def test_the_cp_core_keeps_no_per_process_state() -> None:
    import train.cp
    from train.cp.comm import CommStats, TorchTransport

    modules = {m.name: importlib.import_module(f"train.cp.{m.name}") for m in pkgutil.iter_modules(train.cp.__path__)}
    gone = {"layout": ("REGISTRY", "checkpoint_with_layout"), "enable": ("_ENABLED_MODELS",),
            "comm": ("_STATS", "_DEFAULT", "_BY_GROUP", "_NOTED", "get_transport")}  # fmt: skip
    for mod, names in gone.items():
        assert not [n for n in names if hasattr(modules[mod], n)], mod
    for name, mod in modules.items():
        held = [k for k, v in vars(mod).items() if isinstance(v, (LayoutRegistry, TorchTransport, CommStats))]
        assert not held, f"train.cp.{name} holds {held}"


# Two Wan transformers (as Wan 2.2's two experts), different seeds and token counts: 3x3x5 = 45 and 1x3x7 = 21 video
# tokens (split 23/22 and 11/10 on 2 ranks), 7 and 5 text tokens.
LATENTS = {"high": (2, 4, 3, 6, 10), "low": (1, 4, 1, 6, 14)}
TEXT = {"high": 7, "low": 5}
OUT_TOL, GRAD_TOL = 1e-5, 2e-5  # fp32, as tests/test_cp_models.py


def _wan(seed: int):
    from diffusers import WanTransformer3DModel

    from train.models import tiny_config

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return WanTransformer3DModel(**tiny_config("wan")).train()


def _data(name: str, seed: int) -> tuple[dict, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = LATENTS[name]
    inputs = {
        "hidden_states": torch.randn(shape, generator=gen),
        "encoder_hidden_states": torch.randn(shape[0], TEXT[name], 16, generator=gen),
        "timestep": torch.rand(shape[0], generator=gen) * 1000,
    }
    return inputs, torch.randn(shape, generator=gen)


def _step(models: dict, data: dict, order: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Forwards in `order`, then one backward of the summed loss."""
    outs = {n: models[n](**data[n][0], return_dict=False)[0] for n in order}
    sum(torch.nn.functional.mse_loss(outs[n], data[n][1]) for n in order).backward()
    return outs


@rank_job(2)
def _two_models(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from train.cp import GradReduction, enable_context_parallel

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("ring", "ulysses"))
    seeds = {"high": 0, "low": 1}
    data = {n: _data(n, 10 + s) for n, s in seeds.items()}
    serial = {n: _wan(s) for n, s in seeds.items()}
    ref = _step(serial, data, ("low", "high"))
    models = {n: _wan(s) for n, s in seeds.items()}
    states = {n: enable_context_parallel(m, mesh=mesh) for n, m in models.items()}
    for model in models.values():  # after CP (the README's order): recomputes replay their own model's registry
        model.enable_gradient_checkpointing()  # and run in the joint backward, after the other model's forward

    _step(models, data, ("high",))  # "high" alone: what its stats look like with no other model around
    alone = {site: (s.calls, s.bytes_sent) for site, s in states["high"].stats.sites.items()}
    for n in models:
        models[n].zero_grad(set_to_none=True)
        states[n].stats.reset()
    outs = _step(models, data, ("low", "high"))  # interleaved: low forward, high forward, one backward
    err = {}
    for n, model in models.items():
        GradReduction.for_model(states[n]).reduce_gradients(model.parameters())
        grads = {k: p.grad for k, p in serial[n].named_parameters()}
        err[n] = {
            "out": (outs[n] - ref[n]).abs().max().item(),
            "grad": max(
                ((p.grad - grads[k]).abs().max() / grads[k].abs().max()).item() for k, p in model.named_parameters()
            ),  # fmt: skip
        }
    high, low = states["high"], states["low"]
    return {
        "err": err,
        "own": all(models[n]._parallel_config is states[n] for n in models),
        "separate": high.layout is not low.layout and high.transport is not low.transport,
        "partitions": {n: list(s.layout.partitions) for n, s in states.items()},
        "exchanges": {n: s.layout.exchanges for n, s in states.items()},
        "alone": alone,
        "together": {site: (s.calls, s.bytes_sent) for site, s in high.stats.sites.items()},
        "low_calls": low.stats.calls,
        "plan": {n: s.plan.path.name for n, s in states.items()},
    }


def test_two_models_in_one_process_keep_their_own_state(group) -> None:
    for rank, res in enumerate(group(_two_models, 2)):
        for n, e in res["err"].items():
            assert e["out"] <= OUT_TOL and e["grad"] <= GRAD_TOL, (rank, n, e)
        assert res["own"] and res["separate"], res
        # Each registry holds only its own model's splits (the video tokens, and the RoPE tables split alike) ...
        assert res["partitions"] == {"high": [(23, 22)], "low": [(11, 10)]}, res["partitions"]
        # ... and identifies every layer from them, through interleaved forwards and recomputes: no size exchange.
        assert res["exchanges"] == {"high": 0, "low": 0}, res["exchanges"]
        # Each model's stats count its own collectives only: the same whether the other model ran or not.
        assert res["together"] == res["alone"] and res["low_calls"] > 0, res
        assert res["plan"] == {"high": "wan.yaml", "low": "wan.yaml"}
