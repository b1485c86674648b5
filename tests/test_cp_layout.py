"""The layout registry's core property, checked exhaustively without processes (train/cp/layout.py).

For any recorded splits and any true per-rank table the plan allows, what each rank decides from its OWN lengths must
agree across ranks: either every rank identifies the true table, or every rank finds it ambiguous and names the same
upper bounds, which cover the true lengths. Disagreement is what makes ranks enter different collectives (a hang).
"""

from __future__ import annotations

import random

import pytest

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
