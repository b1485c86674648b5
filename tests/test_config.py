"""Typed recipes (train/config.py on train/schema.py): strict YAML, `--set` overrides, mesh resolution, field docs,
the JSON Schema, shipped recipes.

CPU only. `test_shipped_recipe_loads` runs once per `recipes/**/*.yaml`, so a new recipe is checked automatically.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
from pydantic import BaseModel

from train.config import (
    SCHEMA_PATH,
    Recipe,
    RecipeError,
    SyntheticData,
    _section_of,
    add_recipe_args,
    load_recipe,
    recipe_from_args,
    recipe_from_dict,
    recipe_help,
    recipe_json_schema,
    recipe_to_dict,
    save_recipe,
)
from train.models import family_names

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted({*REPO.glob("recipes/**/*.yaml"), *REPO.glob("recipes/**/*.yml")})

MINIMAL = {"model": {"family": "flux", "init_config": {"num_layers": 1}}}


def _write(tmp_path: Path, text: str, name: str = "r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _errors(excinfo: pytest.ExceptionInfo) -> list[str]:
    assert isinstance(excinfo.value, ValueError)
    return excinfo.value.errors


def _section(tp: object) -> type[BaseModel] | None:
    for arm in (tp, *getattr(tp, "__args__", ())):
        if isinstance(arm, type) and issubclass(arm, BaseModel):
            return arm
    return None


def _sections(cls: type[BaseModel] = Recipe) -> list[type[BaseModel]]:
    """`cls` and every section model reachable from its fields (Optional sections included)."""
    out = [cls]
    for info in cls.model_fields.values():
        sub = _section(info.annotation)
        if sub is not None and sub not in out:
            out += [s for s in _sections(sub) if s not in out]
    return out


# -------------------------------------------------------------------------------------------------------- round trip


def _contains(big: object, small: object) -> bool:
    """Every key of (nested) mapping `small` is in `big` with an equal value; other values compare equal."""
    if isinstance(small, dict) and isinstance(big, dict):
        return all(k in big and _contains(big[k], v) for k, v in small.items())
    return big == small and type(big) is type(small)


def test_round_trip_dict_recipe_dict():
    d = {
        "model": {"family": "wan", "pretrained_path": "some/hub-id", "init_config": {"num_layers": 2, "x": [1, 2]}},
        "parallel": {"cp": 2, "dp_shard": 1},
        "train": {"lr": 3e-5, "betas": [0.9, 0.95], "max_grad_norm": None, "mixed_precision": "no"},
        "finetune": {"method": "lora", "lora_targets": ["to_q", "to_k"]},
        "data": {"synthetic": {"num_samples": 4, "shapes": {"pooled_embeds": [32]}}},
        "name": "run",
    }
    recipe = recipe_from_dict(d)
    assert recipe.parallel.cp == 2 and recipe.train.lr == 3e-5 and recipe.finetune.lora_targets == ["to_q", "to_k"]
    assert isinstance(recipe.data.synthetic, SyntheticData) and recipe.data.synthetic.shapes["pooled_embeds"] == [32]
    full = recipe_to_dict(recipe)
    assert _contains(full, d), full
    assert recipe_from_dict(full) == recipe
    assert recipe_to_dict(recipe_from_dict(full)) == full


def test_int_widens_to_float_and_defaults_fill(tmp_path):
    recipe = recipe_from_dict({**MINIMAL, "train": {"lr": 1}})
    assert recipe.train.lr == 1.0 and isinstance(recipe.train.lr, float)
    assert recipe.parallel.dp_shard == -1 and recipe.finetune.method == "lora" and recipe.data.synthetic is None


def test_save_and_load_yaml(tmp_path):
    recipe = recipe_from_dict({**MINIMAL, "name": "1e-4", "train": {"mixed_precision": "no", "lr": 2e-4}})
    save_recipe(recipe, tmp_path / "sub" / "saved.yaml")
    assert load_recipe(tmp_path / "sub" / "saved.yaml") == recipe  # strings that look like floats/bools stay strings
    # a run started from an adapter file: its saved recipe.yaml reads back (train.report loads it at the run's end)
    recipe = recipe_from_dict(
        {**MINIMAL, "name": "r", "finetune": {"method": "lora", "init_lora": str(tmp_path / "a.safetensors")}}
    )
    save_recipe(recipe, tmp_path / "init.yaml")
    assert load_recipe(tmp_path / "init.yaml") == recipe


def test_yaml_dialect(tmp_path):
    """1e-4 is a float and `no` a string (YAML 1.1 reads them the other way round); duplicate keys are errors."""
    path = _write(tmp_path, "model: {family: flux, init_config: {}}\ntrain: {lr: 1e-4, mixed_precision: no}\n")
    recipe = load_recipe(path)
    assert recipe.train.lr == 1e-4 and recipe.train.mixed_precision == "no"
    assert recipe.name == "r"  # name defaults to the file stem
    dup = _write(tmp_path, "model: {family: flux, init_config: {}}\ntrain: {lr: 1.0, lr: 2.0}\n", "dup.yaml")
    with pytest.raises(RecipeError, match="duplicate key 'lr'"):
        load_recipe(dup)


# ------------------------------------------------------------------------------------------------------------ errors


def test_unknown_key_names_nested_dotted_path(tmp_path):
    path = _write(
        tmp_path, "model: {family: flux, init_config: {}}\ntrain:\n  lrr: 1.0e-4\ndata:\n  synthetic: {fo: 1}\n"
    )
    with pytest.raises(RecipeError) as excinfo:
        load_recipe(path)
    errors = _errors(excinfo)
    assert len(errors) == 2, errors
    assert errors[0].startswith(f"{path}: train.lrr: unknown key (did you mean 'lr'?)")
    assert "valid keys of train: max_steps, batch_size" in errors[0]
    assert errors[1].startswith(f"{path}: data.synthetic.fo: unknown key")
    assert "num_samples" in errors[1]


def test_wrong_types(tmp_path):
    d = {
        "model": {"family": "flux", "init_config": {}},
        "parallel": {"cp": True},  # bool is not an int
        "train": {"lr": "fast", "betas": [0.9, "x"], "max_steps": 1.5},
        "data": {"synthetic": 3},
        "name": 7,
    }
    with pytest.raises(RecipeError) as excinfo:
        recipe_from_dict(d, source="recipes/x.yaml")
    errors = _errors(excinfo)
    expected = [
        "recipes/x.yaml: parallel.cp: expected int, got True (bool)",
        "recipes/x.yaml: train.max_steps: expected int, got 1.5 (float)",
        "recipes/x.yaml: train.lr: expected float, got 'fast' (str)",
        "recipes/x.yaml: train.betas[1]: expected float, got 'x' (str)",
        "recipes/x.yaml: data.synthetic: expected a mapping or null, got 3 (int)",
        "recipes/x.yaml: name: expected str or null, got 7 (int)",
    ]
    assert sorted(errors) == sorted(expected)
    assert str(excinfo.value).startswith("6 problems in the recipe:")


def test_literal_error_and_missing_required():
    with pytest.raises(RecipeError) as excinfo:
        recipe_from_dict({"model": {"family": "fluxx", "init_config": {}}, "train": {"lr_schedule": "cosin"}})
    errors = _errors(excinfo)
    family = next(e for e in errors if e.startswith("<dict>: model.family: expected one of "))
    assert all(repr(name) in family for name in family_names()) and "did you mean 'flux'" in family, family
    assert any(
        e.startswith("<dict>: train.lr_schedule: expected one of 'constant', 'linear', 'cosine'") for e in errors
    )
    with pytest.raises(RecipeError, match=r"^<dict>: model: missing required key"):
        recipe_from_dict({})
    with pytest.raises(RecipeError, match=r"model.family: missing required key"):
        recipe_from_dict({"model": {}})


def test_cross_field_checks_are_collected_with_type_errors():
    d = {
        "model": {"family": "ltx"},  # neither pretrained_path nor init_config
        "train": {"grad_accum": 0, "lr": 0.0, "caption_dropout": 1.5, "betas": [0.9]},
        "finetune": {"lora_rank": 0},
        "checkpoint": {"keep_last": 0},
        "logging": {"wandb_mode": "on"},  # a type error in another section
    }
    with pytest.raises(RecipeError) as excinfo:
        recipe_from_dict(d)
    paths = sorted(e.split(": ")[1] for e in _errors(excinfo))
    assert paths == sorted(
        [
            "model.pretrained_path",
            "train.grad_accum",
            "train.lr",
            "train.caption_dropout",
            "train.betas",
            "finetune.lora_rank",
            "checkpoint.keep_last",
            "logging.wandb_mode",
        ]
    )
    assert recipe_from_dict({**MINIMAL, "finetune": {"method": "full", "lora_rank": 0}}).finetune.lora_rank == 0
    with pytest.raises(RecipeError, match="checkpoint.export: is lora but finetune.method is full"):
        recipe_from_dict({**MINIMAL, "finetune": {"method": "full"}, "checkpoint": {"export": "lora"}})


# --------------------------------------------------------------------------------------------------------- overrides


def test_set_overrides_nested_list_and_none(tmp_path):
    path = _write(tmp_path, "model: {family: wan, pretrained_path: x, cp_plan: plan.yaml}\ntrain: {lr: 1.0e-4}\n")
    recipe = load_recipe(
        path,
        [
            "train.lr=3e-5",
            "parallel.cp=2",
            "finetune.lora_targets=[to_q, to_k]",
            "model.cp_plan=null",
            "data.synthetic.num_samples=3",  # creates the null optional section
            "model.init_config.num_layers=2",  # a key inside a dict field
            "name=smoke",
        ],
    )
    assert recipe.train.lr == 3e-5 and recipe.parallel.cp == 2
    assert recipe.finetune.lora_targets == ["to_q", "to_k"]
    assert recipe.model.cp_plan is None and recipe.model.pretrained_path == "x"
    assert recipe.data.synthetic == SyntheticData(num_samples=3)
    assert recipe.model.init_config == {"num_layers": 2} and recipe.name == "smoke"


def test_set_errors(tmp_path):
    path = _write(tmp_path, "model: {family: wan, pretrained_path: x}\n")
    with pytest.raises(RecipeError) as excinfo:
        load_recipe(path, ["train.lrr=1", "parallel.cp=two", "train.lr.x=1", "finetune.method=lorra", "oops"])
    errors = _errors(excinfo)
    assert errors[0].startswith("--set: train.lrr: unknown key (did you mean 'lr'?)")
    assert errors[1] == "--set: parallel.cp: expected int, got 'two' (str)"
    assert errors[2] == "--set: train.lr.x: train.lr is float and has no sub-keys"
    assert errors[3].startswith("--set: finetune.method: expected one of 'full', 'lora', got 'lorra'")
    assert errors[4].startswith("--set: oops: expected KEY=VALUE")
    with pytest.raises(RecipeError, match=r"--set: nosuch: unknown key; valid keys: model, parallel"):
        load_recipe(path, ["nosuch=1"])


def test_argparse_integration(tmp_path, capsys):
    path = _write(tmp_path, "model: {family: flux, init_config: {}}\n")
    parser = argparse.ArgumentParser()
    add_recipe_args(parser)
    args = parser.parse_args(["--recipe", str(path), "--set", "train.lr=0.5", "--set", "parallel.cp=2"])
    recipe = recipe_from_args(args)
    assert recipe.train.lr == 0.5 and recipe.parallel.cp == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["--list-keys"])
    out = capsys.readouterr().out
    assert "train.lr (float; default 0.0001): Peak learning rate" in out
    assert "data.synthetic.num_samples (int; default 8):" in out


# ---------------------------------------------------------------------------------------------------------- parallel


def test_parallel_resolve():
    p = recipe_from_dict(MINIMAL).parallel
    assert p.resolve(8) == (1, 8, 1)
    p.cp = 2
    assert p.resolve(8) == (1, 4, 2)
    p.dp_replicate = 2
    assert p.resolve(8) == (2, 2, 2)
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by dp_replicate \(2\) x cp \(2\) = 4"):
        p.resolve(6)
    p.dp_shard = 3
    with pytest.raises(
        ValueError, match=r"dp_replicate \(2\) x dp_shard \(3\) x cp \(2\) = 12, but the world size is 8"
    ):
        p.resolve(8)
    with pytest.raises(RecipeError, match="parallel.dp_shard: must be >= 1 or -1"):
        recipe_from_dict({**MINIMAL, "parallel": {"dp_shard": 0}})


# -------------------------------------------------------------------------------------------------------------- docs


@pytest.mark.parametrize("cls", _sections(), ids=lambda c: c.__name__)
def test_every_field_is_documented(cls):
    missing = [name for name, info in cls.model_fields.items() if not (info.description or "").strip()]
    assert not missing, f"{cls.__name__}: add a docstring under each of {missing}"


def _dotted_keys(cls: type[BaseModel] = Recipe, prefix: str = "") -> list[str]:
    keys = []
    for name, info in cls.model_fields.items():
        keys.append(prefix + name)
        sub = _section_of(info.annotation)  # sections and `X | None` ones; a list of sections is one key
        if sub is not None:
            keys += _dotted_keys(sub, f"{prefix}{name}.")
    return keys


def test_help_lists_every_key():
    listed = [line.split(" ")[0].rstrip(":") for line in recipe_help().splitlines()]
    assert listed == _dotted_keys()


# ------------------------------------------------------------------------------------------------------------ recipes


def test_recipes_are_shipped():
    assert len(RECIPES) >= 8  # the tiny recipes, the demo and the real-size ones: a glob that finds none would pass


@pytest.mark.parametrize("path", [pytest.param(p, id=str(p.relative_to(REPO))) for p in RECIPES])
def test_shipped_recipe_loads(path, tmp_path):
    recipe = load_recipe(path)
    save_recipe(recipe, tmp_path / "resolved.yaml")
    assert load_recipe(tmp_path / "resolved.yaml") == recipe


@pytest.mark.parametrize("path", [pytest.param(p, id=str(p.relative_to(REPO))) for p in RECIPES])
def test_shipped_recipe_names_the_json_schema(path):
    """Editors (yaml-language-server) check a recipe against recipes/schema.json when its first line points there."""
    first = path.read_text().splitlines()[0]
    relative = os.path.relpath(SCHEMA_PATH, path.parent)
    assert first == f"# yaml-language-server: $schema={relative}", first


# ------------------------------------------------------------------------------------------------------- JSON Schema


def test_json_schema_is_current():
    """recipes/schema.json is what the models generate now; regenerate with `python -m train.config --schema`."""
    assert json.loads(SCHEMA_PATH.read_text()) == recipe_json_schema(), "run: python -m train.config --schema"


def test_json_schema_lists_the_families_and_forbids_unknown_keys():
    schema = recipe_json_schema()
    model = schema["$defs"]["ModelConfig"]
    assert model["properties"]["family"]["enum"] == list(family_names())
    assert model["additionalProperties"] is False and "flow_shift" in model["properties"]
    assert schema["properties"]["train"]["description"] == "Optimisation and loss."


# ------------------------------------------------------------------------------------------------------ nested typos


@pytest.mark.parametrize(
    ("key", "closest"),
    [
        ("finetune.lora_rnak", "lora_rank"),
        ("data.synthetic.num_sampels", "num_samples"),
        ("model.flow_shfit", "flow_shift"),
        ("train.lora_rnak", "finetune.lora_rank"),  # no close key in train: the closest key anywhere, dotted
    ],
)
def test_typo_in_a_nested_key_names_its_path_and_the_closest_key(tmp_path, key, closest):
    *sections, name = key.split(".")
    d = {"model": {"family": "flux", "init_config": {}}}
    node = d
    for section in sections:
        node = node.setdefault(section, {})
    node[name] = 3
    with pytest.raises(RecipeError) as excinfo:
        recipe_from_dict(d, source="r.yaml")
    (error,) = _errors(excinfo)
    assert error.startswith(f"r.yaml: {key}: unknown key (did you mean {closest!r}?); "), error
    assert f"valid keys of {'.'.join(sections)}: " in error
    # the same typo as a --set override is refused naming the key, the closest one and the valid ones
    path = _write(tmp_path, "model: {family: flux, init_config: {}}\n")
    with pytest.raises(RecipeError, match=rf"^--set: {key}: unknown key \(did you mean {closest!r}\?\); valid keys"):
        load_recipe(path, [f"{key}=3"])


# ------------------------------------------------------------------------------------------------------ added keys


def test_flow_shift_is_a_positive_number_or_null():
    assert recipe_from_dict(MINIMAL).model.flow_shift is None
    recipe = recipe_from_dict({"model": {**MINIMAL["model"], "flow_shift": 5}})
    assert recipe.model.flow_shift == 5.0 and isinstance(recipe.model.flow_shift, float)
    with pytest.raises(RecipeError, match=r"^<dict>: model.flow_shift: must be > 0, got 0$"):
        recipe_from_dict({"model": {**MINIMAL["model"], "flow_shift": 0}})
    with pytest.raises(RecipeError, match=r"model.flow_shift: expected float or null, got True \(bool\)"):
        recipe_from_dict({"model": {**MINIMAL["model"], "flow_shift": True}})


def test_data_resolved_fills_buckets_and_dtypes():
    recipe = recipe_from_dict({**MINIMAL, "data": {"num_frames": 17, "height": 480, "width": 832}})
    data = recipe.data.resolved(recipe.model)
    assert data.buckets == ["17x480x832"] and data.cache_dtype == data.text_encoder_dtype == "bfloat16"
    assert recipe.data.buckets is None  # the recipe itself is unchanged
    recipe = recipe_from_dict({**MINIMAL, "data": {"buckets": [" 17X480x832", "1x64x64"], "cache_dtype": "float32"}})
    assert recipe.data.resolved(recipe.model).buckets == ["17x480x832", "1x64x64"]
    assert recipe.data.resolved(recipe.model).cache_dtype == "float32"
    with pytest.raises(RecipeError, match=r"data.buckets\[1\]: bucket '64x64' is not FRAMESxHEIGHTxWIDTH"):
        recipe_from_dict({**MINIMAL, "data": {"buckets": ["1x64x64", "64x64"]}})
