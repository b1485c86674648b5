"""Per-rank sequence lengths for every attention layer without a size exchange, decided identically on every rank.

Uneven Ulysses needs every rank's local lengths (the all-to-all split sizes). Exchanging them in every attention
call is one extra blocking collective per layer; caching them by LOCAL length hangs, because ranks hit and miss such
a cache differently.

The CP split hooks record each partition they make: a tensor of global length L split over W ranks has per-rank sizes
`tensor_split(L, W)`, which every rank knows (global shapes are the same everywhere). Plans marked
`layout_registry: true` assert that every attention sequence is one recorded partition or the sum of two (joint
attention concatenates text and image shards). The candidate per-rank tables of a call are then known on every rank,
and each rank sees one row of the true table: its own local lengths.

Decision, the same on every rank (no collective needed to agree):
- the call is *identified* when the true table is the only candidate matching its row on EVERY rank. A rank whose own
  row matches one candidate knows the table and can check that; a rank whose row matches several knows the answer is
  "no". So every rank reaches the same verdict, and identified calls issue no collective, first forward included.
- otherwise two candidates share a rank's local length (split lengths within ~W tokens of each other). The tables
  linked that way form a class every rank can name (each rank's matches all lie in the true table's class), so every
  rank knows the same per-rank UPPER BOUNDS: the attention pads its all-to-all chunks to them and carries each rank's
  true lengths in-band (ulysses.py), still without a collective of its own. A caller that cannot pad (the output
  gather, a call with a mask) exchanges sizes once instead; that table is remembered under the call's position in the
  forward (recorded partitions, call number, site: identical on all ranks), so later forwards need none.

Every model CP is enabled on has its own registry (`state.layout` of the state `enable_context_parallel` returns):
its own splits, call numbering and memos, so two models in one process (a transformer and a second expert) never see
each other's splits or remembered tables, whatever order their forwards and backwards interleave in.

Activation checkpointing recomputes blocks inside the backward, possibly after other forwards changed the registry.
`LayoutRegistry.checkpoint` (what `enable_gradient_checkpointing` uses once CP is enabled) restores, for the
recompute, the registry as the original forward saw it: same splits, same call numbers, so again no collective. A
recompute without that (another checkpoint function) exchanges sizes in every call: slower, but the same on every rank.

A rank whose length matches no candidate has met a plan whose assertion is wrong; it raises. `verify` mode (env
`CTXTRAIN_CP_VERIFY_LAYOUT=1`; the model tests use it for every shipped plan) exchanges in every call and checks, from
exchanged data only, that the registry decides right on every rank; it raises the same error on all ranks if not.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from itertools import combinations, product

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from .comm import TorchTransport, exchange_ints

Table = tuple[tuple[int, ...], ...]  # one column per value, one entry per rank


def split_sizes(n: int, world: int) -> list[int]:
    """Sizes of `torch.tensor_split(n_items, world)`: the first n % world parts get one more."""
    return [n // world + (1 if i < n % world else 0) for i in range(world)]


class LayoutError(RuntimeError):
    """The plan's `layout_registry: true` assertion does not hold for this model."""


class LayoutRegistry:
    """One model's registry (see the module docstring). `scope` names the model in error messages."""

    MAX_MEMO = 100_000

    def __init__(self, scope: str = "") -> None:
        self.enabled = False  # set per forward from the plan's `layout_registry`; off: always exchange
        self.verify = os.environ.get("CTXTRAIN_CP_VERIFY_LAYOUT", "0") == "1"
        self.scope = scope
        self.partitions: list[tuple[int, ...]] = []
        self.segments: dict[str, int] = {}  # global length of each named split of this forward ("path:input")
        self.calls = 0
        self.exchanges = 0  # size exchanges actually issued (for tests and benchmarks)
        self.memo: dict[tuple, list[list[int]]] = {}  # unidentifiable calls: exchanged rows by call position
        self._tables: dict[tuple, tuple[list[Table], list[Counter]]] = {}
        self._decided: dict[tuple, tuple[str, Table | None]] = {}
        self.replaying = 0  # > 0 inside a checkpoint recompute that restored the forward's registry

    def reset(self, enabled: bool) -> None:
        """Start of a model forward: partitions and call numbering start afresh (memos are kept)."""
        self.enabled, self.partitions, self.segments, self.calls = enabled, [], {}, 0

    def record(self, length: int, world: int, name: str | None = None) -> None:
        """A split of a tensor of global length `length` over `world` ranks; `name` ("module path:input") lets a
        plan's `joint_key_mask` find the lengths of the segments a joint sequence is made of (masks.py)."""
        sizes = tuple(split_sizes(length, world))
        if sizes not in self.partitions:
            self.partitions.append(sizes)
        if name is not None:
            self.segments[name] = length

    # -- activation checkpointing -----------------------------------------------------------------------------------

    def snapshot(self) -> tuple:
        return self.enabled, tuple(self.partitions), dict(self.segments), self.calls

    def restore(self, snap: tuple) -> None:
        self.enabled, partitions, segments, self.calls = snap
        self.partitions, self.segments = list(partitions), dict(segments)

    def checkpoint(self, module: torch.nn.Module, *args):
        """A diffusers `gradient_checkpointing_func`: non-reentrant checkpoint whose recompute replays this registry."""
        return torch.utils.checkpoint.checkpoint(
            module.__call__, *args, use_reentrant=False, context_fn=self.checkpoint_contexts
        )

    def checkpoint_contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """`context_fn` for `torch.utils.checkpoint` (non-reentrant): called when the block first runs; its second
        context wraps the recompute in the backward, which then sees the registry exactly as the first run did."""
        return contextlib.nullcontext(), self._replay(self.snapshot())

    @contextlib.contextmanager
    def _replay(self, snap: tuple):
        outer = self.snapshot()
        self.restore(snap)
        self.replaying += 1
        try:
            yield
        finally:
            self.replaying -= 1
            self.restore(outer)

    # -- candidates -------------------------------------------------------------------------------------------------

    def _candidates(self, state: tuple, world: int) -> list[tuple[int, ...]]:
        parts = [p for p in state if len(p) == world]
        sums = [tuple(a + b for a, b in zip(p, q)) for p, q in combinations(parts, 2)]
        return list(dict.fromkeys(parts + sums))

    def _hypotheses(self, state: tuple, world: int, ties: tuple) -> tuple[list[Table], list[Counter], list[Table]]:
        """Every candidate table of a call; per rank how many tables share each row (for identifiability); and per
        table the upper bound of its confusable class (tables linked by sharing a row on some rank), column by column.

        A column with a tie `j` is not a length of its own (a mask dim): it is column j's layout, or the same on every
        rank: absent (-1), broadcast (1) or the global length."""
        key = (state, world, ties)
        if key not in self._tables:
            cands = self._candidates(state, world)
            free = [i for i, t in enumerate(ties) if t is None]
            tied = [i for i, t in enumerate(ties) if t is not None]
            tables: set[Table] = set()
            for choice in product(cands, repeat=len(free)):
                cols: dict[int, tuple[int, ...]] = dict(zip(free, choice))
                options = [
                    list(dict.fromkeys([cols[ties[i]]] + [(v,) * world for v in (-1, 1, sum(cols[ties[i]]))]))
                    for i in tied
                ]
                for opts in product(*options):
                    cols.update(zip(tied, opts))
                    tables.add(tuple(cols[i] for i in range(len(ties))))
            ordered = sorted(tables)
            row_of = lambda t, r: tuple(col[r] for col in t)  # noqa: E731
            rows = [Counter(row_of(t, r) for t in ordered) for r in range(world)]
            # Confusable classes (union-find over "same row on some rank"), and each class's per-column maxima.
            parent = list(range(len(ordered)))

            def find(i: int) -> int:
                while parent[i] != i:
                    parent[i] = parent[parent[i]]
                    i = parent[i]
                return i

            for r in range(world):
                first: dict[tuple, int] = {}
                for i, t in enumerate(ordered):
                    j = first.setdefault(row_of(t, r), i)
                    parent[find(i)] = find(j)
            top: dict[int, list[list[int]]] = {}
            for i, t in enumerate(ordered):
                b = top.setdefault(find(i), [list(col) for col in t])
                for c, col in enumerate(t):
                    b[c] = [max(x, y) for x, y in zip(b[c], col)]
            bounds = [tuple(tuple(col) for col in top[find(i)]) for i in range(len(ordered))]
            self._tables[key] = (ordered, rows, bounds)
        return self._tables[key]

    def decide(self, state: tuple, world: int, ties: tuple, rank: int, row: tuple[int, ...]):
        """What `rank`, seeing `row`, concludes: ("identified", table), ("ambiguous", upper bounds of the table's
        confusable class) or ("unexplained", None).

        A pure function of data every rank shares plus this rank's row; for the true table it gives the same verdict,
        and the same bounds, on every rank (see the module docstring)."""
        key = (state, world, ties, rank, row)
        if key not in self._decided:
            tables, rows, bounds = self._hypotheses(state, world, ties)
            match = [i for i, t in enumerate(tables) if tuple(col[rank] for col in t) == row]
            if not match:
                verdict: tuple[str, Table | None] = ("unexplained", None)
            else:
                t = tables[match[0]]
                unique = len(match) == 1 and all(rows[r][tuple(col[r] for col in t)] == 1 for r in range(world))
                verdict = ("identified", t) if unique else ("ambiguous", bounds[match[0]])
            if len(self._decided) >= self.MAX_MEMO:
                self._decided.clear()
            self._decided[key] = verdict
        return self._decided[key]

    # -- the call -------------------------------------------------------------------------------------------------

    def lengths(
        self,
        values: list[int],
        device: torch.device,
        group: dist.ProcessGroup,
        site: str,
        transport: TorchTransport,
        ties: tuple[int | None, ...] | None = None,
    ) -> list[list[int]]:
        """`values` of every rank (one row per rank), with a size exchange only when the layout is not identified."""
        rows, exact = self.resolve(values, device, group, site, transport, ties, bounds_ok=False)
        assert exact
        return rows

    def resolve(
        self,
        values: list[int],
        device: torch.device,
        group: dist.ProcessGroup,
        site: str,
        transport: TorchTransport,
        ties: tuple[int | None, ...] | None = None,
        bounds_ok: bool = False,
    ) -> tuple[list[list[int]], bool]:
        """(rows, exact): every rank's `values` (one row per rank) when `exact`; else, only with `bounds_ok`, per-rank
        upper bounds, the same on every rank, and the caller carries the true values in-band (ulysses.py pads its
        all-to-all to the bounds and sends each rank's row along). A size exchange only when the layout is not
        identified and bounds will not do. Exchanges go through `transport` (the model's: its stats count them)."""
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        ties = ties or (None,) * len(values)
        state = tuple(self.partitions)
        call = self.calls
        position = (state, call, site, ties)
        self.calls += 1
        # A recompute in the backward that did not restore its forward's registry (see the module docstring): the
        # splits recorded now may belong to another forward. Every rank is in the same backward: all exchange.
        unrestored = not self.replaying and torch._C._current_graph_task_id() != -1
        exchange = lambda: self._exchange(values, device, group, site, transport)  # noqa: E731
        if not self.enabled or unrestored:
            return exchange(), True
        if self.verify:
            rows = exchange()
            self._check(rows, state, world, ties, site)
            return rows, True
        verdict, table = self.decide(state, world, ties, rank, tuple(values))
        if verdict == "unexplained":
            raise LayoutError(
                f"CP layout registry: local lengths {values} at '{site}' (attention call {call} of "
                f"{self.scope}) match no split recorded by the plan's hooks {list(state)}. The plan's "
                "`layout_registry: true` is wrong for this model: set it to false (sizes are then exchanged in every "
                "call), or run once with CTXTRAIN_CP_VERIFY_LAYOUT=1 to see the failing call on every rank."
            )
        rows_of = [[col[i] for col in table] for i in range(world)]
        if verdict == "identified":
            return rows_of, True
        if bounds_ok:
            return rows_of, False
        rows = self.memo.get(position)
        if rows is not None:
            assert rows[rank] == list(values), "same model, same splits, same call: layouts must repeat"
            return rows, True
        rows = exchange()
        if len(self.memo) >= self.MAX_MEMO:
            self.memo.clear()
        self.memo[position] = rows
        return rows, True

    def _exchange(self, values, device, group, site, transport) -> list[list[int]]:
        self.exchanges += 1
        return exchange_ints(values, device, group, site, transport)

    def _check(self, rows: list[list[int]], state: tuple, world: int, ties: tuple, site: str) -> None:
        """Verify mode: what every rank would have decided, computed from exchanged rows (so raised on all ranks)."""
        truth = tuple(tuple(row[c] for row in rows) for c in range(len(ties)))
        verdicts = [self.decide(state, world, ties, r, tuple(rows[r])) for r in range(world)]
        kinds = {v for v, _ in verdicts}
        bounds = {t for _, t in verdicts}

        def covers(bound: Table) -> bool:
            return all(b >= x for bc, tc in zip(bound, truth) for b, x in zip(bc, tc))

        ok = (kinds == {"identified"} and bounds == {truth}) or (
            kinds == {"ambiguous"} and len(bounds) == 1 and covers(next(iter(bounds)))
        )
        if not ok:
            raise LayoutError(
                f"CP layout registry check failed at '{site}' (call {self.calls - 1} of {self.scope}): per-rank "
                f"lengths {rows}, recorded splits {list(state)}, per-rank verdicts {[v for v, _ in verdicts]}. This "
                "model builds an attention sequence the plan's splits do not explain: set `layout_registry: false` "
                "in its plan."
            )
