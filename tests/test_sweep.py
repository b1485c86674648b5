"""The CP sweep (train/tools/sweep.py): discovery by code, the published table kept current, refusals honoured, and a
sample of classes end to end.

The whole sweep (`python -m train.tools.sweep`, ~40 s) does not run here. Every plan file it wrote is loaded and
validated against the sweep's tiny instance by tests/test_cp_plans.py (every file in cp_plans/). Here: the table in
docs/plans.md names exactly the discovered classes and agrees with the plan files; a refusal file makes
`enable_context_parallel` refuse with its reason; and two classes are rebuilt, drafted and checked at CP 2 and 3 in
the shared gloo groups: Flux3 (no pipeline family; text-only blocks run before the joint blocks, which the drafter
must not take for the sequence) and Kandinsky 6 (forward() reshapes the tokens to the video grid before its output
layer: the draft gathers the last block and declares the replicated tail, whose gradient scaling makes it exact) must
train exactly with a draft equal to their plan files, and NucleusMoE-Image (forward() builds its joint key mask
inline and hands it to every block inside attention_kwargs, which no split reaches) must still fail the check, as its
refusal file says.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import rank_job
from train.cp.plans import PLAN_DIR, load_plan_file, plan_for, resolve_plan
from train.tools import sweep

DOC = Path(__file__).resolve().parents[1] / "docs" / "plans.md"
SAMPLE = {
    "Flux3Transformer2DModel": "exact",
    "Kandinsky6Transformer3DModel": "exact",
    "NucleusMoEImageTransformer2DModel": "unsupported",
}


def _table() -> dict[str, dict[str, str]]:
    text = DOC.read_text()
    body = text[text.index(sweep.TABLE_BEGIN) : text.index(sweep.TABLE_END)]
    rows = {}
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[0] not in ("class", "---"):
            rows[cells[0]] = {"verdict": cells[3], "plan": cells[6].strip("`")}
    return rows


def test_discovery_finds_classes_by_code() -> None:
    found = sweep.discover()
    # A class without a pipeline, classes that reach the attention through another family's processor, the shipped.
    assert found["Flux3Transformer2DModel"] == "direct"
    assert found["ChromaTransformer2DModel"] == "via transformer_flux"
    assert found["WanVACETransformer3DModel"] == "via transformer_wan"
    assert {"WanTransformer3DModel", "FluxTransformer2DModel", "QwenImageTransformer2DModel"} <= set(found)
    assert "SD3Transformer2DModel" not in found  # its processors call SDPA themselves


def test_table_is_current() -> None:
    """The table names every discovered class once, and each verdict agrees with the class's plan file: an exact
    class has a supported plan, an unsupported one a refusal, a class not swept no file."""
    rows = _table()
    assert set(rows) == set(sweep.discover()), "rerun: python -m train.tools.sweep --write"
    for name, row in rows.items():
        if row["verdict"] == "not swept":
            with pytest.raises(ValueError, match=f"no CP plan for {name}"):
                plan_for(name)
            continue
        spec = plan_for(name)
        assert str(spec.path.relative_to(PLAN_DIR.parent)) == row["plan"], name
        assert spec.training_supported == (row["verdict"] == "exact"), name


def test_refusal_file_is_honoured(tmp_path) -> None:
    """enable_context_parallel on a class whose file says `training: unsupported`: one UserError naming the reason,
    before any collective (for_training=True; the default refuses the first training forward the same way)."""
    import torch.distributed as dist

    from train.cp import enable_context_parallel
    from train.errors import UserError

    name = "SanaVideoTransformer3DModel"
    spec = plan_for(name)
    assert not spec.training_supported and "GLUMBConv" in spec.reason
    model = sweep.tiny_source(name).build(0)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        with pytest.raises(UserError) as err:
            enable_context_parallel(model, degree=1, for_training=True)
    finally:
        dist.destroy_process_group()
    message = str(err.value)
    assert "\n" not in message and "training: unsupported" in message and "GLUMBConv" in message


def _sample_rows() -> list[sweep.Row]:
    return sweep.prepare(list(SAMPLE))


@rank_job(2, 3)
def _check_sample(rank: int, world: int) -> list[dict]:
    """check_plan's rank function on the sample classes' drafts, rebuilt from scratch on every rank."""
    import tempfile

    import torch.distributed as dist

    from train.tools.check_plan import Case, check_rank

    rows = _sample_rows()
    folder = Path(tempfile.mkdtemp())
    cases = []
    for row in rows:
        path = folder / sweep.plan_file_name(row.name)
        path.write_text(row.draft_text)
        cases.append(Case(str(path), row.name, source=row.source))
    dist.barrier()
    return check_rank(rank, world, cases)


@pytest.fixture(scope="module")
def checked(group) -> dict[int, list[dict]]:
    from train.tools.check_plan import merge_ranks

    return {world: merge_ranks(group(_check_sample, world)) for world in (2, 3)}


def test_sample_end_to_end(checked) -> None:
    from train.tools.check_plan import format_report, verdict

    for i, (name, expected) in enumerate(SAMPLE.items()):
        report = format_report(checked, i)
        assert verdict(checked, i) == (expected == "exact"), report
        assert _table()[name]["verdict"] == expected
        for world in (2, 3):
            grads = checked[world][i]["grads"]
            assert grads and (max(grads.values()) < 1e-4) == (expected == "exact"), report


def test_sample_drafts_equal_their_plan_files(tmp_path) -> None:
    """The draft the sweep makes today resolves to the plan it wrote (settings; comments aside)."""
    for row in _sample_rows():
        shipped = plan_for(row.name)
        model = row.source.build(0)
        path = tmp_path / sweep.plan_file_name(row.name)
        path.write_text(row.draft_text)
        drafted = load_plan_file(path)
        assert resolve_plan(drafted, model) == resolve_plan(shipped, model), row.name
        assert drafted.local_attention == shipped.local_attention and drafted.joint_key_mask == shipped.joint_key_mask
        assert drafted.replicated_tail == shipped.replicated_tail, row.name
