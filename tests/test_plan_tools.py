"""The plan tools: `python -m train.tools.draft_plan` drafts plans that `python -m train.tools.check_plan` passes and
that equal the shipped plans up to stated edits; check_plan fails broken plans, naming the module path.

All check cases run check_plan's own rank function in the shared gloo groups of 2 and 3 ranks (tests/harness.py): the
shipped plans of Wan, Flux and SkyReels V2 (which the drafts of Flux and SkyReels V2 equal, resolved), Wan's draft, and
two broken Wan plans (RoPE tables not split; no gather). HunyuanVideo's draft equals its shipped plan, joint key mask
included.
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
