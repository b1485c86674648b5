"""The plan tools: `python -m train.tools.draft_plan` drafts plans that `python -m train.tools.check_plan` passes and
that equal the shipped plans up to stated edits; check_plan fails broken plans, naming the module path.

All check cases run check_plan's own rank function in the shared gloo groups of 2 and 3 ranks (tests/harness.py): the
shipped plans of Wan, Flux and SkyReels V2 (which the drafts of Flux and SkyReels V2 equal, resolved), Wan's draft, and
two broken Wan plans (RoPE tables not split; no gather). HunyuanVideo's draft equals its shipped plan, joint key mask
included. Every family's draft equals its shipped plan up to the differences docs/plans.md lists (drafting only). A
plan whose ranks fall out of step (Qwen-Image split on entry) fails in its short collective timeout instead of
hanging, and a rank gloo aborts fails only its own case (the spawner replaced, no processes).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.harness import rank_job, shared_tmpdir
from train.cp.plans import PLAN_DIR, load_plan_file, resolve_plan
from train.tools.check_plan import Case, check_rank, format_report, merge_ranks, verdict
from train.tools.check_plan import main as check_main
from train.tools.draft_plan import draft, settings_diff
from train.tools.draft_plan import main as draft_main
from train.tools.probe import resolve_source

# class -> (shipped plan, what the draft leaves out and why: the stated edits)
MODELS = {
    "WanTransformer3DModel": ("wan.yaml", {'""'}),  # Wan 2.2 TI2V's per-token timestep: t2v tiny inputs have (B,)
    "FluxTransformer2DModel": ("flux.yaml", set()),
    "SkyReelsV2Transformer3DModel": ("skyreels_v2.yaml", set()),
}
# drafted and compared with the shipped plan, not check_plan'ed here (tests/test_cp_models.py runs it at every layout)
DRAFT_ONLY = {"HunyuanVideoTransformer3DModel": ("hunyuan_video.yaml", set())}  # its joint key mask


def _drafts(folder: Path) -> dict[str, Path]:
    out = {}
    for cls in {**MODELS, **DRAFT_ONLY}:
        path = folder / f"{cls}.yaml"
        path.write_text(draft(resolve_source(cls)).yaml(f"python -m train.tools.draft_plan {cls}"))
        out[cls] = path
    return out


def _broken(folder: Path) -> dict[str, Path]:
    text = (PLAN_DIR / "wan.yaml").read_text()
    no_rope = re.sub(r"  rope:\n    split_outputs:\n(      \d: .*\n)+", "", text)
    no_gather = re.sub(r"  proj_out:\n    gather: .*\n", "", text)
    assert no_rope != text and no_gather != text
    (folder / "no_rope.yaml").write_text(no_rope)
    (folder / "no_gather.yaml").write_text(no_gather)
    return {"no_rope": folder / "no_rope.yaml", "no_gather": folder / "no_gather.yaml"}


def _cases(drafts: dict[str, Path], broken: dict[str, Path]) -> list[Case]:
    # Drafts that resolve equal to the shipped plan (test below) are checked once, as the shipped file; Wan's draft
    # (without the TI2V timestep entry) is checked too; the broken plans last.
    cases = [Case(str(PLAN_DIR / plan), cls) for cls, (plan, _) in MODELS.items()]
    cases += [Case(str(drafts["WanTransformer3DModel"]), "WanTransformer3DModel")]
    return cases + [Case(str(broken[k]), "WanTransformer3DModel") for k in ("no_rope", "no_gather")]


@rank_job(2, 3)
def _check_cases(rank: int, world: int) -> list[dict]:
    """check_plan's own rank function on every case, in the shared group (the tool spawns one group per degree)."""
    import torch.distributed as dist

    folder = shared_tmpdir()
    if rank == 0:
        _drafts(folder), _broken(folder)
    dist.barrier()
    drafts = {cls: folder / f"{cls}.yaml" for cls in MODELS}
    return check_rank(rank, world, _cases(drafts, {k: folder / f"{k}.yaml" for k in ("no_rope", "no_gather")}))


@pytest.fixture(scope="module")
def drafts(tmp_path_factory) -> dict[str, Path]:
    return _drafts(tmp_path_factory.mktemp("drafts"))


@pytest.fixture(scope="module")
def checked(group) -> dict[int, list[dict]]:
    """Per degree, one merged result per case of `_cases` (check_plan's `merge_ranks`)."""
    return {world: merge_ranks(group(_check_cases, world)) for world in (2, 3)}


def test_drafts_equal_shipped_plans_up_to_stated_edits(drafts) -> None:
    for cls, (plan, left_out) in {**MODELS, **DRAFT_ONLY}.items():
        shipped, drafted = load_plan_file(PLAN_DIR / plan), load_plan_file(drafts[cls])
        model = resolve_source(cls).build(0)
        want = resolve_plan(shipped, model)
        if '""' in left_out:
            want.pop("")
        assert resolve_plan(drafted, model) == want, cls
        assert drafted.layout_registry == shipped.layout_registry
        assert drafted.local_attention == shipped.local_attention
        assert drafted.joint_key_mask == shipped.joint_key_mask
        diff = settings_diff(drafts[cls].read_text(), (PLAN_DIR / plan).read_text(), plan)
        print(f"\n{cls}:\n{diff}")


def test_check_plan_passes_shipped_and_drafted_plans(checked) -> None:
    results = checked
    for i in range(len(results[2]) - 2):
        report = format_report(results, i)
        print(report)
        assert verdict(results, i), report
        for world in (2, 3):  # every plan entry was seen and matched, every gradient group reported
            res = results[world][i]
            assert res["rows"] and all(r["ok"] for r in res["rows"]) and res["grads"], report


def test_check_plan_fails_broken_plans_naming_the_module(checked) -> None:
    results = checked
    no_rope, no_gather = len(results[2]) - 2, len(results[2]) - 1
    report = format_report(results, no_rope)
    assert not verdict(results, no_rope)
    assert "forward failed in blocks.0.attn1" in report and "made by rope output 0" in report, report
    report = format_report(results, no_gather)
    assert not verdict(results, no_gather)
    assert "the plan never gathers" in report and "proj_out is the last module" in report, report


def test_cli_user_errors(tmp_path, capsys) -> None:
    def error(fn, argv) -> str:
        assert fn(argv) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), lines
        return lines[0]

    assert "did you mean WanTransformer3DModel" in error(draft_main, ["WanTransformer3DModle"])
    assert "no config.json" in error(draft_main, [str(tmp_path)])
    # A class no family uses: inputs must come from --inputs.
    assert "--inputs module:function" in error(draft_main, ["SanaTransformer2DModel"])
    wan = str(PLAN_DIR / "wan.yaml")
    assert "is a plan for WanTransformer3DModel, not for FluxTransformer2DModel" in error(
        check_main, [wan, "--model", "FluxTransformer2DModel"]
    )
    assert "not a diffusers model class" in error(check_main, [wan, "--model", "NoSuchModel"])
    assert "no such plan file" in error(check_main, [str(tmp_path / "x.yaml"), "--model", "WanTransformer3DModel"])


def test_draft_from_folder_and_inputs_option(tmp_path, capsys) -> None:
    """A local model folder (config.json with _class_name; blocks cut to <= 2) and --inputs for a class with no
    family: the draft is the same as the family's."""
    from train.models import tiny_config

    config = {"_class_name": "WanTransformer3DModel", **tiny_config("wan"), "num_layers": 5}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert draft_main([str(tmp_path), "-o", str(tmp_path / "plan.yaml")]) == 0
    text = (tmp_path / "plan.yaml").read_text()
    assert "num_layers 5 -> 2" in text
    source = resolve_source(str(tmp_path), inputs="tests.test_plan_tools:wan_inputs")
    plan = draft(source).yaml("x")
    assert plan.split("model_class:")[1] == text.split("model_class:")[1]


def wan_inputs(config: dict) -> dict:
    """--inputs example: forward kwargs for a Wan-layout config (5 x 2 x 14 latents, 7 text tokens)."""
    import torch

    return {
        "hidden_states": torch.randn(1, config["in_channels"], 5, 2, 14),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": torch.randn(1, 7, config["text_dim"]),
    }


# A plan whose ranks fall out of step: Qwen-Image's packed inputs split on entry (the drafter's rule before it learnt
# that forward() reads the text length for its RoPE from the whole text). Each rank builds text RoPE rows for its
# local text length and the pos_embed split cuts them again: rank 0 (4 text tokens, 2 rows) raises in its first
# attention, rank 1 (3 tokens, 1 row: it broadcasts) enters the all-to-all and would wait for rank 0 for ever.
OUT_OF_STEP = """model_class: QwenImageTransformer2DModel
training: supported
reason: null
per_head_mask_inputs: []
layout_registry: true
plan:
  "":
    split_inputs:
      hidden_states: {dim: 1, expected_dims: 3}
      encoder_hidden_states: {dim: 1, expected_dims: 3}
      encoder_hidden_states_mask: {dim: 1, expected_dims: 2}
  pos_embed:
    split_outputs:
      0: {dim: 0, expected_dims: 2}
      1: {dim: 0, expected_dims: 2}
  proj_out:
    gather: {dim: 1, expected_dims: 3}
"""
CASE_TIMEOUT_S = 3.0


@rank_job(2)
def _check_out_of_step(rank: int, world: int) -> tuple[list[dict], float]:
    import time

    import torch.distributed as dist

    folder = shared_tmpdir()
    if rank == 0:
        (folder / "out_of_step.yaml").write_text(OUT_OF_STEP)
    dist.barrier()
    case = Case(str(folder / "out_of_step.yaml"), "QwenImageTransformer2DModel")
    start = time.perf_counter()
    return check_rank(rank, world, [case], case_timeout_s=CASE_TIMEOUT_S), time.perf_counter() - start


def test_check_plan_fails_ranks_out_of_step_without_hanging(group) -> None:
    """The case fails within its short collective timeout, with the first failing rank's error and the verdict that
    the ranks fell out of step; the shared group goes on (later jobs ran in it)."""
    ranks = group(_check_out_of_step, 2)
    assert max(seconds for _, seconds in ranks) < 60
    merged = merge_ranks([results for results, _ in ranks])
    report = format_report({2: merged})
    assert not verdict({2: merged}) and "forward failed in transformer_blocks.0.attn" in report, report
    assert "ranks out of step: rank 0 failed here first, rank(s) 1 went on" in report, report
    assert "FAIL pos_embed                    output 1" in report, report  # the entry that is wrong


# Every shipped plan of a family home: what its draft differs in (plan paths as resolved on the tiny model, and the
# settings compared), each difference explained in docs/plans.md ("Drafts of the shipped families").
SHIPPED_DRAFT_DIFFERENCES = {
    "wan.yaml": {""},  # Wan 2.2 TI2V's per-token timestep: the t2v tiny inputs pass (B,)
    "chronoedit.yaml": set(),
    "flux.yaml": set(),
    "flux2.yaml": set(),
    "qwenimage.yaml": {"transformer_blocks.0", "transformer_blocks.1"},  # the Edit variant's modulate_index
    "ltx.yaml": {"", "local_attention"},  # text kept whole and attended locally: the draft passes check_plan too
    # two token streams (video, audio), each with RoPE tables and an output head: the drafter follows one
    "ltx2.yaml": {
        "",
        "rope",
        "audio_rope",
        "cross_attn_rope",
        "cross_attn_audio_rope",
        "audio_proj_out",
        "local_attention",
    },  # fmt: skip
    "helios.yaml": {"blocks.0", "blocks.0.attn1", "blocks.0.attn2", "blocks.0.ffn"},  # a refused hand-written try
    # two output heads (proj_out, audio_proj_out); per-token indices split where they are used, not on entry
    "minimax_h3.yaml": {"", "transformer_blocks.0", "norm_out", "proj_out"},
    "skyreels_v2.yaml": set(),
    "hunyuan_video.yaml": set(),
    "hunyuan_video15.yaml": set(),  # its cp_processors setting is written by hand (not compared)
}


@pytest.mark.parametrize("plan", sorted(SHIPPED_DRAFT_DIFFERENCES))
def test_drafts_of_shipped_families(plan, tmp_path) -> None:
    """The drafter on each family's tiny instance (the sweep's, train/tools/sweep.py) gives the shipped plan up to
    the listed differences: no more, no fewer."""
    from train.tools.sweep import tiny_source

    shipped = load_plan_file(PLAN_DIR / plan)
    source = tiny_source(shipped.model_class)
    path = tmp_path / plan
    path.write_text(draft(source).yaml("x"))
    drafted, model = load_plan_file(path), source.build(0)
    mine, theirs = resolve_plan(drafted, model), resolve_plan(shipped, model)
    differ = {p for p in set(mine) | set(theirs) if mine.get(p) != theirs.get(p)}
    differ |= {k for k in ("layout_registry", "local_attention", "joint_key_mask")
               if getattr(drafted, k) != getattr(shipped, k)}  # fmt: skip
    assert differ == SHIPPED_DRAFT_DIFFERENCES[plan], settings_diff(path.read_text(), shipped.path.read_text(), plan)


def test_check_survives_a_rank_gloo_aborted(monkeypatch) -> None:
    """gloo aborts a rank (no exception to catch) when ranks disagree on a collective's sizes: `check` keeps the
    cases every rank finished, fails the one in flight with that verdict, and runs the rest in a new group. The
    spawner is replaced by one that records progress as the ranks do (a torn write of the next case included)."""
    import torch

    import train.tools.spawn as spawning
    from train.tools.check_plan import check

    cases = [Case(f"{name}.yaml", name) for name in ("a", "b", "c")]
    calls = []

    def result(case: Case) -> dict:
        return {"case": case, "rows": [], "error": None, "out": 0.0, "loss": 0.0, "grads": {}}

    def fake(fn, world, cases, tol, timeout, progress):
        calls.append([c.model for c in cases])
        if progress is None or len(cases) == 1:
            return [[result(c) for c in cases] for _ in range(world)]
        for rank in range(world):
            torch.save([result(cases[0])], f"{progress}/rank{rank}.pt")
        (Path(progress) / "rank0.tmp").write_bytes(b"torn")  # killed while writing case b's results
        raise spawning.RankError("a rank died: process 1 terminated with signal SIGABRT")

    monkeypatch.setattr(spawning, "run_distributed", fake)
    merged = check(cases, degrees=(2,))[2]
    assert [r["case"].model for r in merged] == ["a", "b", "c"] and calls == [["a", "b", "c"], ["c"]]
    assert merged[0]["error"] is None and merged[2]["error"] is None
    assert "SIGABRT" in merged[1]["error"] and "ranks out of step" in merged[1]["diagnosis"]
