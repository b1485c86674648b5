"""The benchmarks stay runnable: the GPU script's every code path at tiny shapes on CPU, and the plot's reader."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_script_smoke_runs_on_cpu() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_h200", "--smoke"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| smoke | (2, 8, 8) |" in proc.stdout and "| smoke, ckpt |" in proc.stdout


def test_memory_table_in_docs_parses() -> None:
    from bench.plot import memory_rows

    rows = memory_rows()
    mid4 = [r for r in rows if r["size"] == "mid" and r["CP"] == "4"]
    assert {r["model"] for r in mid4} == {"wan", "flux"}
    assert all(float(r["blocks ratio"]) <= 0.30 for r in mid4)  # issue 5's target: ≤ 30% of serial at CP 4


def test_comm_benchmark_meets_the_targets() -> None:
    """Issue 5's acceptance, from the benchmark's own records: per attention layer forward + backward, ours issues 4
    collectives (no size exchange, a split key mask included, lengths the registry can only bound included) and moves
    ≤ 1.02x the Ulysses minimum; a whole tiny model's first step issues no size exchange either."""
    from bench.comm import PAYLOAD_SITES, _merge, _rank_fn
    from tests.distributed import run_distributed

    for world in (2, 4):
        merged = _merge(run_distributed(_rank_fn, world))
        ours = [m for m in merged if m["impl"] in ("ours (trainable Ulysses-Anything)", "ours, registry bounds only")]
        assert len(ours) == 6
        for m in ours:
            sites = {**m["fwd"], **m["bwd"]}
            assert sum(c for c, _ in m["fwd"].values()) + sum(c for c, _ in m["bwd"].values()) == 4, (world, m)
            assert set(sites) == set(PAYLOAD_SITES), (world, m["case"], sites)
            for phase in ("fwd", "bwd"):
                payload = sum(b for s, (_, b) in m[phase].items() if s in PAYLOAD_SITES)
                assert payload <= 1.02 * m["min"]["formula"], (world, m["case"], phase, payload, m["min"])
        # Without the registry (op-level use): one size exchange per call, nothing else changes.
        bare = [m for m in merged if m["impl"] == "ours, no layout registry"]
        assert [m["fwd"]["sizes"][0] for m in bare] == [1]
        models = [m for m in merged if m["impl"] == "model"]
        assert {(m["case"], m["step"]) for m in models} == {(n, s) for n in ("wan", "flux") for s in (1, 2)}
        for m in models:  # per block: qkv + out forward, d_out + d_qkv backward; plus one output gather
            assert set(m["fwd"]) == {"qkv", "out", "gather"} and set(m["bwd"]) == {"d_out", "d_qkv"}, m
