"""The layout advisor (train/advisor.py) against references nobody here computed.

- FLOPs: the advisor's forward FLOPs of the real Wan 2.1 1.3B recipe (FlopCounterMode on the calibration instance,
  scaled) against the MFU formula of bench/gpu_h200.py (`wan_forward_flops`, hand-written from the architecture), ±2%.
- Placement: the groups the advisor prices (Ulysses consecutive, ring strided by Ulysses, FSDP dp_shard × cp
  consecutive, replicas strided by it) against torch's own DeviceMesh built with train/parallel.py's shape and names.
- Published tables (docs/performance.md section 8 cites each with its settings): xDiT's FLUX.1-dev USP table on 4×H100
  and its HunyuanVideo Ulysses tables on H100 and H20. The published seconds are the oracle: per table the
  predicted best layout equals the published best, and predicted relative times are within ±25% of the published
  ones — except the rows and groups listed in MISSES, which docs/performance.md reports as misses; the test checks
  they still miss, so the doc stays true when the model changes.
- The CLI: `--layouts` ranks, its memory column is train.estimate's own number, a bad --nodes is one line, exit 2.
- CPU (slow tier): the advisor's prediction for 2/3/4 gloo ranks against the CP step measured on this machine.

Costs (2 shared cores, measured): FLOPs ~10 s, placement < 1 s, tables < 1 s, CLI ~10 s; CPU row (slow) ~60 s.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from train import advisor
from train.advisor import DEVICES, Layout, Work, step_time

ROOT = Path(__file__).resolve().parents[1]
BAND = 0.25


def _dit(blocks: int, tokens: int, hidden: int = 3072, heads: int = 24) -> Work:
    """An MMDiT inference step (FLUX.1 / HunyuanVideo): every token, image or text, passes 12·d² weights per block
    (double blocks: q, k, v, out + a 4x MLP on its own stream; single blocks: fused qkv + MLP in, proj out), and
    attention is joint over all tokens: the MFU formula's 2·weights per token and 4·S²·d per block."""
    return Work(tokens=tokens, a=2 * 12 * hidden**2 * blocks, b=4 * hidden * blocks, blocks=blocks, hidden=hidden,
                heads=heads, backward=0.0, fsdp=False)  # fmt: skip


# Each table: the published seconds per (label, gpus, ring, ulysses); `normalize`: the row the relative times are
# taken against ("best": the table's published fastest, for a layout-choice table; else a label).
TABLES = {
    # xDiT docs/performance/flux.md, "Scalability of Flux.1 Dev": FLUX.1-dev (12B: 19 double + 38 single blocks, 24
    # heads × 128), 1024px (4096 image + 512 text tokens), 28 steps, 4×H100 one node (NVLink), torch.compile column.
    "flux_4xh100": dict(
        work=_dit(57, 4096 + 512), device="h100", per_node=4, normalize="best",
        groups={"2 GPUs": ("Ulysses-2", "Ring-2"), "4 GPUs": ("Ulysses-2 x Ring-2", "Ulysses-4", "Ring-4")},
        rows=[("1 GPU", 1, 1, 1, 4.30), ("Ulysses-2", 2, 1, 2, 2.68), ("Ring-2", 2, 2, 1, 2.60),
              ("Ulysses-2 x Ring-2", 4, 2, 2, 1.80), ("Ulysses-4", 4, 1, 4, 1.63), ("Ring-4", 4, 4, 1, 1.98)],
    ),
    # xDiT docs/performance/hunyuanvideo.md: HunyuanVideo (13B: 20 double + 40 single blocks, 24 heads × 128), 129
    # frames, 50 steps, official HunyuanVideo repo + xDiT Ulysses, one 8-GPU node. 1280×720 and 960×960 are both
    # 33 × 45 × 80 = 33 × 60 × 60 = 118,800 video tokens (+ 256 text).
    "hunyuanvideo_720p_h100": dict(
        work=_dit(60, 118_800 + 256), device="h100", per_node=8, normalize="1 GPU", groups={},
        rows=[("1 GPU", 1, 1, 1, 1904.08), ("2 GPUs", 2, 1, 2, 925.04), ("4 GPUs", 4, 1, 4, 514.08),
              ("8 GPUs", 8, 1, 8, 337.58)],
    ),
    "hunyuanvideo_720p_h20": dict(
        work=_dit(60, 118_800 + 256), device="h20", per_node=8, normalize="1 GPU", groups={},
        rows=[("1 GPU", 1, 1, 1, 6639.17), ("2 GPUs", 2, 1, 2, 3400.55), ("4 GPUs", 4, 1, 4, 1762.86),
              ("8 GPUs", 8, 1, 8, 940.97)],
    ),
    "hunyuanvideo_960_h100": dict(
        work=_dit(60, 118_800 + 256), device="h100", per_node=8, normalize="1 GPU", groups={},
        rows=[("1 GPU", 1, 1, 1, 1735.01), ("2 GPUs", 2, 1, 2, 934.09), ("3 GPUs", 3, 1, 3, 645.45),
              ("6 GPUs", 6, 1, 6, 367.02)],
    ),
    "hunyuanvideo_960_h20": dict(
        work=_dit(60, 118_800 + 256), device="h20", per_node=8, normalize="1 GPU", groups={},
        rows=[("1 GPU", 1, 1, 1, 6621.46), ("2 GPUs", 2, 1, 2, 3400.55), ("3 GPUs", 3, 1, 3, 2310.48),
              ("6 GPUs", 6, 1, 6, 1214.67)],
    ),
}  # fmt: skip
# What the model gets wrong, reported in docs/performance.md section 8: (table, group or row label).
MISSES = {
    ("flux_4xh100", "4 GPUs"),  # predicted Ring-4 fastest, published Ulysses-4
    ("flux_4xh100", "1 GPU"),  # predicted 3.47x the best, published 2.64x (launch/serial time at 1152 tokens a GPU)
    ("flux_4xh100", "Ring-4"),  # predicted 0.90x, published 1.21x
    ("hunyuanvideo_720p_h100", "8 GPUs"),  # predicted 0.127 of 1 GPU, published 0.177
}


def _predict(table: dict) -> dict[str, float]:
    dev = DEVICES[table["device"]]
    return {label: step_time(table["work"], Layout(1, 1, ring, u), dev, table["per_node"])["step"]
            for label, _, ring, u, _ in table["rows"]}  # fmt: skip


def _relative(table: dict, times: dict[str, float]) -> dict[str, float]:
    published = {label: s for label, *_, s in table["rows"]}
    ref = min(published, key=published.get) if table["normalize"] == "best" else table["normalize"]
    return {label: t / times[ref] for label, t in times.items()}


@pytest.mark.parametrize("name", list(TABLES))
def test_published_table(name: str) -> None:
    table = TABLES[name]
    published = {label: s for label, *_, s in table["rows"]}
    predicted = _predict(table)
    groups = table["groups"] or {"all": tuple(published)}
    for group, labels in groups.items():
        best_pub = min(labels, key=published.get)
        best_pred = min(labels, key=predicted.get)
        if (name, group) in MISSES:
            assert best_pred != best_pub, f"{name} {group}: now predicted right: update MISSES and the doc"
        else:
            assert best_pred == best_pub, f"{name} {group}: predicted {best_pred}, published {best_pub}"
    rel_pub, rel_pred = _relative(table, published), _relative(table, predicted)
    for label in published:
        ratio = rel_pred[label] / rel_pub[label]
        inside = abs(ratio - 1) <= BAND
        if (name, label) in MISSES:
            assert not inside, f"{name} {label}: now inside ±25% ({ratio:.2f}): update MISSES and the doc"
        else:
            assert inside, f"{name} {label}: predicted {rel_pred[label]:.3f}, published {rel_pub[label]:.3f}"


def test_flops_match_the_mfu_formula() -> None:
    sys.path.insert(0, str(ROOT))
    from bench.gpu_h200 import wan_forward_flops
    from train.config import load_recipe
    from train.estimate import model_shape

    recipe = load_recipe(ROOT / "recipes/wan/1.3b_lora.yaml")
    w = advisor.work_from_recipe(recipe, model_shape(recipe))
    cfg = dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, text_dim=4096, in_channels=16,
               patch_size=[1, 2, 2], num_layers=30)  # fmt: skip
    for tokens in (14040, 32760):  # docs/performance.md section 4: 218.8 and 849.0 TFLOP a step (3 x forward)
        ref = wan_forward_flops(cfg, tokens, 512)
        ours = w.c + w.a * tokens + w.b * tokens**2
        assert abs(ours / ref - 1) < 0.02, (tokens, ours, ref)


def test_placement_is_torch_device_mesh() -> None:
    """The mesh train/parallel.py builds (through torch's init_device_mesh, on a fake process group of the world's
    size: no processes) gives rank 0 the groups the advisor prices."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from train.parallel import ParallelDims

    for rep, shard, ring, u, per_node in [(1, 2, 2, 4, 8), (2, 1, 4, 4, 8), (1, 4, 2, 2, 4), (2, 2, 1, 8, 8)]:
        world = rep * shard * ring * u
        dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
        try:
            mesh = ParallelDims(rep, shard, ring * u, ring).build("cpu")
            grid = mesh.world.mesh  # (dp_replicate, dp_shard, ring, ulysses)
            groups = {"ulysses": (grid[0, 0, 0, :], 1, u), "ring": (grid[0, 0, :, 0], u, ring),
                      "fsdp shard": (mesh.fsdp.mesh.reshape(-1, shard * ring * u)[0], 1, shard * ring * u),
                      "dp_replicate": (grid[:, 0, 0, 0], shard * ring * u, rep)}  # fmt: skip
            for name, (ranks, stride, size) in groups.items():
                ranks = [int(r) for r in ranks]
                assert ranks == [k * stride for k in range(size)], (name, ranks)  # where the advisor puts them
                on = sum(1 for r in ranks[1:] if r // per_node == 0)
                assert advisor._members(stride, size, per_node) == (on, size - 1 - on), name
        finally:
            dist.destroy_process_group()


def test_layouts_cli(capsys: pytest.CaptureFixture[str]) -> None:
    from train import estimate

    estimate.main(["--recipe", str(ROOT / "recipes/wan/1.3b_lora.yaml"), "--gpus", "16", "--nodes", "2",
                   "--layouts"])  # fmt: skip
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 1 |")]
    assert rows and "best: rep" in out
    # the memory column is train.estimate's prediction of that exact candidate
    from train.config import load_recipe

    recipe = load_recipe(ROOT / "recipes/wan/1.3b_lora.yaml")
    top = advisor.advise(recipe, 16, 2)[0]
    cand = advisor._candidate(recipe, top.layout, top.levers)
    assert top.peak == estimate.estimate(cand, 16, "cuda").peak
    assert f"{top.peak / advisor.GIB:.1f}" in rows[0]
    with pytest.raises(ValueError, match="split evenly over the nodes"):
        estimate.main(["--recipe", str(ROOT / "recipes/wan/1.3b_lora.yaml"), "--gpus", "16", "--nodes", "3",
                       "--layouts"])  # fmt: skip


@pytest.mark.slow
@pytest.mark.xfail(reason="known miss: the advisor predicts 0.47-0.50 of the measured CPU step (section 8)")
def test_cpu_prediction_against_measurement() -> None:
    """The CPU row: the advisor's CP step at 2 and 4 gloo ranks, from this machine's gloo profile
    (train/advisor_cpu.json) and a FLOP rate re-measured here at 1 rank, against the step measured right after.
    Only meaningful on a machine that is not oversubscribed: with more runnable processes than cores, the ranks' share
    of the cores depends on the other jobs (docs/performance.md section 8), so the comparison is skipped there."""
    import dataclasses
    import os

    from train.tools.spawn import run_distributed

    cores = os.cpu_count() or 1
    if os.getloadavg()[0] > 1.5 * cores:
        pytest.skip(f"load average {os.getloadavg()[0]:.1f} on {cores} cores: the CPU step time is the other jobs'")
    flops, _ = advisor._cpu_model_flops()
    one = run_distributed(advisor._cpu_rank, 1, 3)[0]["step_s"]
    dev = dataclasses.replace(advisor.cpu_device(), peak=3 * flops / one)
    for world in (2, 4):
        measured = run_distributed(advisor._cpu_rank, world, 3)[0]["step_s"]
        predicted = step_time(advisor.cpu_work(), Layout(1, 1, 1, world), dev, world)["step"]
        assert abs(predicted / measured - 1) <= CPU_BAND, (world, predicted, measured)


CPU_BAND = 0.5  # the CPU step is copy- and launch-bound next to its FLOPs: docs/performance.md section 8
