"""The shipped CP plan files (cp_plans/*.yaml) and their loader/validator (train/cp/plans.py). CPU only, no collectives.

Every test that takes `plan_file` runs once per file found in cp_plans/, so a new plan file is tested automatically
(it needs an entry in TINY_CONFIGS for its model class).
"""

from __future__ import annotations

import functools
from pathlib import Path

import diffusers
import pytest
import torch
from diffusers.hooks.context_parallel import _get_submodule_by_name
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

from train.cp.plans import (
    PLAN_DIR,
    CPPlanSpec,
    load_plan_file,
    local_attention_processors,
    plan_for,
    resolve_plan,
    training_problems,
    validate_plan,
)

# Tiny constructor kwargs per model class: 1-2 blocks, 2 heads, head dim 8-16; every model stays under ~100k params
# and builds in milliseconds. Kept here (not in train/tools/tiny_models.py) so these tests depend on nothing else.
TINY_CONFIGS: dict[str, dict] = {
    "FluxTransformer2DModel": dict(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(4, 6, 6),
    ),
    "Flux2Transformer2DModel": dict(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),
    ),
    "QwenImageTransformer2DModel": dict(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        axes_dims_rope=(4, 6, 6),
    ),
    "WanTransformer3DModel": dict(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=32,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        rope_max_seq_len=32,
    ),
    "ChronoEditTransformer3DModel": dict(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=32,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        rope_max_seq_len=32,
    ),
    "LTXVideoTransformer3DModel": dict(
        in_channels=8,
        out_channels=8,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        num_layers=2,
        caption_channels=16,
    ),
    "MiniMaxH3Transformer3DModel": dict(
        num_attention_heads=2,
        attention_head_dim=16,
        hidden_size=32,
        num_layers=2,
        num_refiner_layers=1,
        ffn_dim=32,
        in_channels=4,
        audio_in_channels=4,
        text_dim=16,
        freq_dim=32,
        time_embed_hidden_dim=32,
        time_embed_dim=16,
        rope_freq_dim=2,
    ),
    "HeliosTransformer3DModel": dict(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        text_dim=32,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        rope_dim=(4, 6, 6),
    ),
    "LTX2VideoTransformer3DModel": dict(
        in_channels=8,
        out_channels=8,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        audio_in_channels=8,
        audio_out_channels=8,
        audio_num_attention_heads=2,
        audio_attention_head_dim=8,
        audio_cross_attention_dim=16,
        num_layers=2,
        caption_channels=16,
    ),
}
# Families whose class diffusers ships no `_cp_plan` for: their family's tiny config.
TINY_CONFIGS["SkyReelsV2Transformer3DModel"] = __import__("train.models", fromlist=["x"]).tiny_config("skyreels_v2")
TINY_CONFIGS["HunyuanVideoTransformer3DModel"] = __import__("train.models", fromlist=["x"]).tiny_config("hunyuan_video")
TINY_CONFIGS["HunyuanVideo15Transformer3DModel"] = __import__("train.models", fromlist=["x"]).tiny_config(
    "hunyuan_video15"
)

PLAN_FILES = sorted(PLAN_DIR.glob("*.yaml"))


@functools.cache
def tiny_model(class_name: str) -> torch.nn.Module:
    """One random-init tiny instance per class, shared by the tests (none of them mutates it)."""
    if class_name not in TINY_CONFIGS:  # a plan the CP sweep wrote: the sweep's tiny instance (train/tools/sweep.py)
        from train.tools.sweep import tiny_source

        return tiny_source(class_name).build(0)
    torch.manual_seed(0)
    return getattr(diffusers, class_name)(**TINY_CONFIGS[class_name])


def existing_paths(plan: dict, model: torch.nn.Module) -> dict:
    """The plan keys that name modules of `model`. Helios' built-in plan hard-codes gathers for blocks 0..39, which a
    2-block tiny model does not have, so those keys are dropped before comparing; every other key must exist."""
    out = {}
    for key, value in plan.items():
        try:
            _get_submodule_by_name(model, key)
        except ValueError:
            continue
        out[key] = value
    return out


def wan_spec(plan: dict) -> CPPlanSpec:
    return CPPlanSpec("WanTransformer3DModel", True, None, (), plan, Path("<test>"))


def test_plan_dir_has_the_shipped_plans() -> None:
    names = {p.stem for p in PLAN_FILES}
    expected = {"flux", "flux2", "qwenimage", "wan", "chronoedit", "ltx", "minimax_h3", "helios", "ltx2"}
    assert expected <= names


# ---------------------------------------------------------------------------------------------- every shipped file


@pytest.fixture(params=PLAN_FILES, ids=[p.stem for p in PLAN_FILES])
def plan_file(request: pytest.FixtureRequest) -> Path:
    return request.param


def test_loads(plan_file: Path) -> None:
    spec = load_plan_file(plan_file)
    assert spec.path == plan_file
    assert hasattr(diffusers, spec.model_class), f"{spec.model_class} is not a diffusers class"
    assert spec.plan
    assert spec.training_supported == (spec.reason is None)


def test_validates_against_tiny_model(plan_file: Path) -> None:
    spec = load_plan_file(plan_file)
    validate_plan(spec, tiny_model(spec.model_class))


# What a plan file adds to the built-in plan: file -> module path -> the inputs it also splits (None: the whole entry
# is new). LTX image-to-video's per-token (B, S) timestep, split like the tokens (the built-in plan leaves every
# timestep whole); LTX-2's audio stream, audio prompt and audio/cross-attention RoPE (the built-in plan shards only the
# video stream, which cannot train).
_AUDIO = ["audio_hidden_states", "audio_encoder_hidden_states", "audio_encoder_attention_mask"]
BEYOND_BUILTIN = {
    "ltx.yaml": {"": ["timestep"]},
    "ltx2.yaml": {"": _AUDIO, "audio_rope": None, "cross_attn_rope": None, "cross_attn_audio_rope": None,
                  "audio_proj_out": None},
}  # fmt: skip


# Classes diffusers 0.42.1 routes through dispatch_attention_fn but ships no `_cp_plan` for: our file is the only plan.
NO_BUILTIN_PLAN = {"HunyuanVideoTransformer3DModel", "HunyuanVideo15Transformer3DModel", "SkyReelsV2Transformer3DModel"}


def test_matches_builtin_plan(plan_file: Path) -> None:
    spec = load_plan_file(plan_file)
    model = tiny_model(spec.model_class)
    if spec.model_class in NO_BUILTIN_PLAN or spec.model_class not in TINY_CONFIGS:  # the sweep's: none built in
        assert type(model)._cp_plan is None, f"diffusers now ships a _cp_plan for {spec.model_class}: compare them"
        return
    builtin = existing_paths(type(model)._cp_plan, model)
    assert builtin, "the built-in plan names no module of the tiny model"
    ours = resolve_plan(spec, model)
    for path, names in BEYOND_BUILTIN.get(plan_file.name, {}).items():
        if names is None:
            del ours[path]
        for name in names or ():
            ours[path].split.pop(name)
    assert ours == resolve_plan(builtin, model)
    # What would be handed to diffusers resolves the same as the spec, and diffusers itself can resolve every key.
    diffusers_plan = spec.diffusers_plan(model)
    assert resolve_plan(diffusers_plan, model) == resolve_plan(spec, model)
    for key in diffusers_plan:
        _get_submodule_by_name(model, key)


def test_training_problems(plan_file: Path) -> None:
    spec = load_plan_file(plan_file)
    problems = training_problems(spec, tiny_model(spec.model_class))
    if spec.training_supported:
        assert problems == []
    else:
        assert problems and problems[0] == f"training: unsupported: {spec.reason}"


def test_plan_for_finds_each_file(plan_file: Path) -> None:
    spec = load_plan_file(plan_file)
    cls = getattr(diffusers, spec.model_class)
    assert plan_for(cls).path == plan_file
    assert plan_for(tiny_model(spec.model_class)).path == plan_file
    assert plan_for(spec.model_class).path == plan_file


# ------------------------------------------------------------------------------------------------ specific models


def test_unsupported_models() -> None:
    assert not plan_for(diffusers.HeliosTransformer3DModel).training_supported
    ltx2 = plan_for(diffusers.LTX2VideoTransformer3DModel)
    # Per-head text masks shard under Ulysses now (train/cp/ulysses.py): LTX and LTX-2 train with them; only LTX-2's
    # (B, S, S) video self-attention mask cannot reach the attention intact under CP and is refused.
    assert ltx2.training_supported and ltx2.per_head_mask_inputs == ("video_self_attention_mask",)
    assert plan_for(diffusers.LTXVideoTransformer3DModel).per_head_mask_inputs == ()


def test_helios_flagged_for_gathers_inside_blocks_and_split_and_gather() -> None:
    spec = plan_for(diffusers.HeliosTransformer3DModel)
    problems = training_problems(spec, tiny_model("HeliosTransformer3DModel"))
    inside = [p for p in problems if "gathers inside a repeated block" in p]
    both = [p for p in problems if "is both split" in p]
    assert {p.split("'")[1] for p in inside} == {"blocks.*.attn1", "blocks.*.attn2", "blocks.*.ffn"}
    assert len(both) == 3 and any("blocks.0.attn1, blocks.1.attn1" in p for p in both)


def test_helios_wildcard_gathers_expand_to_the_models_blocks() -> None:
    spec = plan_for(diffusers.HeliosTransformer3DModel)
    model = tiny_model("HeliosTransformer3DModel")
    plan = spec.diffusers_plan(model)
    assert isinstance(plan["blocks.*.attn1"], dict)
    assert plan["blocks.1.ffn"] == ContextParallelOutput(gather_dim=1, expected_dims=3)
    assert "blocks.2.ffn" not in plan
    # The built-in plan, by contrast, hard-codes 40 blocks and does not fit a smaller model.
    with pytest.raises(ValueError, match=r"plan path 'blocks\.2\.attn1': '2' is not a submodule of ModuleList"):
        resolve_plan(type(model)._cp_plan, model)


def test_minimax_split_inside_repeated_blocks_is_fine() -> None:
    model = tiny_model("MiniMaxH3Transformer3DModel")
    resolved = resolve_plan(plan_for(model), model)
    assert "adaln_indices" in resolved["transformer_blocks.1"].split
    assert training_problems(plan_for(model), model) == []


def test_local_attention_names_the_text_refiner_of_minimax() -> None:
    # The refiner attends over the replicated text before the split: its processors (and only those) stay local.
    model = tiny_model("MiniMaxH3Transformer3DModel")
    spec = plan_for(model)
    assert spec.local_attention == ("token_refiner",)
    local = local_attention_processors(model, spec.local_attention)
    refiner = [m.attn.processor for m in model.token_refiner.refiner_blocks]
    assert [id(p) for p in local] == [id(p) for p in refiner] and len(refiner) >= 1
    bad = CPPlanSpec(**{**spec.__dict__, "local_attention": ("token_refinr", "proj_out")})
    with pytest.raises(ValueError) as err:
        validate_plan(bad, model)
    assert "local_attention 'token_refinr': 'token_refinr' is not a submodule" in str(err.value)
    assert "local_attention 'proj_out': no attention module there" in str(err.value)


def test_plan_for_base_class_and_unknown_class() -> None:
    class MyWan(diffusers.WanTransformer3DModel):
        pass

    assert plan_for(MyWan).model_class == "WanTransformer3DModel"
    with pytest.raises(ValueError, match="no CP plan for Linear") as err:
        plan_for(torch.nn.Linear(2, 2))
    assert "WanTransformer3DModel" in str(err.value) and "FluxTransformer2DModel" in str(err.value)


# -------------------------------------------------------------------------------------------------- strict loading


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        (
            "0: {dim: 1, expected_dims: 4}",
            "0: {dimm: 1, expected_dims: 4}",
            "cp_plans/wan.yaml: plan.rope.split_outputs.0.dimm: unknown key (did you mean 'dim'?); "
            "valid keys of plan.rope.split_outputs.0: dim, expected_dims",
        ),
        (
            "split_outputs:",
            "split_output:",
            "plan.rope.split_output: unknown key (did you mean 'split_outputs'?); valid keys of plan.rope: split_in",
        ),
        ("reason: null", "reason: null\nnotes: x", "cp_plans/wan.yaml: notes: unknown key"),
        (
            "hidden_states: {dim: 1, expected_dims: 3}",
            "hidden_states: {dim: one, expected_dims: 3}",
            "plan.\"blocks.0\".split_inputs.hidden_states.dim: expected int, got 'one' (str)",
        ),
        ("0: {dim: 1, expected_dims: 4}", '"0": {dim: 1, expected_dims: 4}', "plan.rope.split_outputs.0: output ind"),
        ("{dim: 1, expected_dims: 4}", "{dim: 4, expected_dims: 4}", "dim 4 is out of range for a 4-d tensor"),
        ("training: supported", "training: unsupported", "reason: 'training: unsupported' needs a reason"),
        ("training: supported", "training: yes", "training: expected one of 'supported', 'unsupported', got 'yes'"),
        ("  proj_out:", "  rope:", "duplicate key 'rope'"),
        ("  blocks.0:", "  blocks..0:", 'plan."blocks..0": malformed module path'),
        ("gather: {dim: 1, expected_dims: 3}", "gather: []", "plan.proj_out.gather: empty gather list"),
        ("layout_registry: true", "local_attention: blocks", "local_attention: expected a list of str, got 'blocks'"),
        ("layout_registry: true", "local_attention: [blocks..0]", "local_attention[0]: malformed module path"),
        ("gather: {dim: 1, expected_dims: 3}", "gather: [{dim: x}]", "plan.proj_out.gather[0].dim: expected int"),
        ("  proj_out:", "  0:", "plan.0: expected str keys, got 0 (int)"),
        ("hidden_states: {dim", "1x: {dim", 'plan."blocks.0".split_inputs.1x: expected a forward() argument name'),
        ("gather: {dim: 1, expected_dims: 3}", "gather: null", "plan.proj_out: empty entry; expected one of split_in"),
    ],
)
def test_loader_is_strict(tmp_path: Path, old: str, new: str, message: str) -> None:
    text = (PLAN_DIR / "wan.yaml").read_text()
    assert old in text
    # Written inside a cp_plans/ folder so the error names it the way it names a shipped file.
    bad = tmp_path / "cp_plans" / "wan.yaml"
    bad.parent.mkdir()
    bad.write_text(text.replace(old, new, 1))
    with pytest.raises(ValueError) as err:
        load_plan_file(bad)
    assert message in str(err.value).replace(str(tmp_path) + "/", "")


# ------------------------------------------------------------------------------------------------------ validation


def test_bad_module_paths_are_all_named() -> None:
    model = tiny_model("WanTransformer3DModel")
    spec = wan_spec(
        {
            "blocks.0.atn1": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)},
            "rope.*": {0: ContextParallelInput(split_dim=1, expected_dims=4, split_output=True)},
            "blocks.0": {"hidden_state": ContextParallelInput(split_dim=1, expected_dims=3)},
            "proj_out": [],
        }
    )
    with pytest.raises(ValueError) as err:
        validate_plan(spec, model)
    message = str(err.value)
    assert "plan path 'blocks.0.atn1': 'atn1' is not a submodule of WanTransformerBlock" in message
    assert "plan path 'rope.*': '*' needs a ModuleList, but 'rope' is a WanRotaryPosEmbed" in message
    assert "plan path 'blocks.0': 'hidden_state' is not a forward() argument of WanTransformerBlock" in message
    assert "plan path 'proj_out': empty gather list" in message


def test_wrong_class_and_key_kinds() -> None:
    model = tiny_model("WanTransformer3DModel")
    spec = CPPlanSpec(
        "FluxTransformer2DModel",
        True,
        None,
        ("encoder_attention_mask",),
        {
            "rope": {"0": ContextParallelInput(split_dim=1, split_output=True)},
            "proj_out": ContextParallelOutput(gather_dim=1),
        },
        Path("<test>"),
    )
    with pytest.raises(ValueError) as err:
        validate_plan(spec, model)
    message = str(err.value)
    assert "the plan is for FluxTransformer2DModel, the model is a WanTransformer3DModel" in message
    assert "plan path 'rope': input '0' needs ContextParallelInput(s) with split_output=False" in message
    assert "per_head_mask_inputs: 'encoder_attention_mask' is not a forward() argument" in message


def test_double_split_of_one_input_is_refused() -> None:
    # "blocks.0" and "blocks.*" would register two split hooks on blocks.0: it would see 1/N^2 of its input.
    spec = wan_spec(
        {
            "blocks.0": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)},
            "blocks.*": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)},
            "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
        }
    )
    with pytest.raises(ValueError, match=r"'hidden_states' of 'blocks\.0' is already split by 'blocks\.0'"):
        validate_plan(spec, tiny_model("WanTransformer3DModel"))


def test_resolve_merges_spellings() -> None:
    model = tiny_model("WanTransformer3DModel")
    one = ContextParallelOutput(gather_dim=1, expected_dims=3)
    spec_in = ContextParallelInput(split_dim=1, expected_dims=3)
    assert resolve_plan({"proj_out": one}, model) == resolve_plan({"proj_out": [one]}, model)
    wildcard = resolve_plan({"blocks.*.attn1": {"hidden_states": spec_in}}, model)
    concrete = resolve_plan({f"blocks.{i}.attn1": {"hidden_states": spec_in} for i in range(2)}, model)
    assert wildcard == concrete and set(wildcard) == {"blocks.0.attn1", "blocks.1.attn1"}


def test_training_problems_flags_plans_without_split_or_gather() -> None:
    model = tiny_model("WanTransformer3DModel")
    only_split = wan_spec({"blocks.0": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)}})
    only_gather = wan_spec({"proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3)})
    assert any("never gathers" in p for p in training_problems(only_split, model))
    assert any("never splits" in p for p in training_problems(only_gather, model))


def test_last_block_gather_needs_the_replicated_tail() -> None:
    """`blocks.-1` names the last block at any depth. Gathering its output is a gather inside a repeated block unless
    the plan declares `replicated_tail` (enable.py then scales the gradients so the SUM over CP ranks stays exact);
    a gather inside an earlier block stays refused either way."""
    import dataclasses

    model = tiny_model("WanTransformer3DModel")
    split = {"blocks.0": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)}}
    last = {**split, "blocks.-1": ContextParallelOutput(gather_dim=1, expected_dims=3)}
    assert set(resolve_plan(last, model)) == {"blocks.0", f"blocks.{len(model.blocks) - 1}"}
    assert any("gathers inside a repeated block" in p for p in training_problems(wan_spec(last), model))
    tail = dataclasses.replace(wan_spec(last), replicated_tail=True)
    assert training_problems(tail, model) == []
    earlier = {**split, "blocks.0.ffn": ContextParallelOutput(gather_dim=1, expected_dims=3)}
    assert any(
        "gathers inside" in p
        for p in training_problems(dataclasses.replace(wan_spec(earlier), replicated_tail=True), model)
    )
    with pytest.raises(ValueError, match="only negative index is -1"):
        load_plan_file_text("plan:\n  blocks.-2:\n    gather: {dim: 1}\n")


def load_plan_file_text(body: str) -> CPPlanSpec:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write("model_class: WanTransformer3DModel\ntraining: supported\n" + body)
    return load_plan_file(f.name)
