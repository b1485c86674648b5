"""The real checkpoints, as data: the shipped transformer configs (train/models/<family>/configs/*.json) and the real
recipes (recipes/<family>/*.yaml, not recipes/tiny/).

Each shipped config builds on the meta device with no unused key and exactly the checkpoint's public parameter count,
and its family's CP plan validates against that model. Each real recipe names a shipped checkpoint, its clip size is
legal for the family (`train.prepare.check_geometry`), its per-sample token count (`spec.tokens_per_sample`) is the one
its header states and is at least its CP degree, every CP rank gets at least one attention head, and its CP layout fits
the hardware its header names, with CP inside a node. Meta device only: no weights, no network (the hub is offline here,
so the geometry falls back to the family's published strides). Parametrized over the files found, so a new config or
recipe is tested automatically (a new config needs its count in PUBLISHED_PARAMS).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import diffusers
import huggingface_hub.constants
import pytest
import torch

from train.config import Recipe, load_recipe
from train.cp.layout import split_sizes
from train.cp.plans import plan_for, training_problems, validate_plan
from train.data.media import Bucket
from train.models import family_names, get_encoder, get_family, real_configs, transformer_config
from train.prepare import check_geometry

# diffusers' config lookups pass huggingface_hub an argument it deprecated; harmless here
pytestmark = pytest.mark.filterwarnings("ignore:The `local_dir_use_symlinks` argument:UserWarning")

REPO = Path(__file__).resolve().parents[1]
CONFIGS = [(family, hub_id) for family in family_names() for hub_id in real_configs(family)]
RECIPES = sorted(p for p in REPO.glob("recipes/*/*.yaml") if p.parent.name != "tiny")

# Exact parameter counts of the released transformers, as published (tolerance: none).
PUBLISHED_PARAMS = {
    # "frozen_wan_parameters" of public evaluation harnesses that load the checkpoint
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": 1_418_996_800,
    # element count of the safetensors of Wan2.2-T2V-A14B's experts, the same architecture (public loader manifests)
    "Wan-AI/Wan2.1-T2V-14B-Diffusers": 14_288_491_584,
    # Wan2.1-T2V-1.3B's published count + the fps embedding (2 x 1536) and fps projection (1536 -> 1536 -> 9216, with
    # biases) of inject_sample_info: 1,418,996,800 + 3,072 + 2,360,832 + 14,164,992 (no published total found)
    "Skywork/SkyReels-V2-DF-1.3B-540P-Diffusers": 1_435_525_696,
    # Wan2.1-I2V-14B's architecture (SkyReels-V2-I2V-14B's published count); "14B" in the name, 16.4B in fact
    "nvidia/ChronoEdit-14B-Diffusers": 16_394_878_784,
    # Wan2.1-I2V-14B (480P and 720P share it): ChronoEdit's architecture, SkyReels-V2-I2V-14B's published count
    "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers": 16_394_878_784,
    "Wan-AI/Wan2.1-I2V-14B-720P-Diffusers": 16_394_878_784,
    # the hub's safetensors index: total_size 19,999,150,848 B of fp32 = 4,999,787,712 parameters (825 tensors)
    "Wan-AI/Wan2.2-TI2V-5B-Diffusers": 4_999_787_712,
    # each expert of Wan2.2-T2V-A14B: Wan2.1-T2V-14B's count (public loader manifests of the experts' safetensors)
    "Wan-AI/Wan2.2-T2V-A14B-Diffusers": 14_288_491_584,
    "Wan-AI/Wan2.2-T2V-A14B-Diffusers/transformer_2": 14_288_491_584,
    # the hub's safetensors total, as model registries list it
    "black-forest-labs/FLUX.1-dev": 11_901_408_320,
    # "32.2B parameter total" of public FLUX.2 analyses
    "black-forest-labs/FLUX.2-dev": 32_223_281_152,
    # finetrainers' LTX-Video full fine-tune log: "trainable parameters"
    "Lightricks/LTX-Video": 1_923_385_472,
    # the hub's safetensors total (40.86 GB of bf16 shards)
    "Qwen/Qwen-Image": 20_430_401_088,
    # the Qwen-Image 20B transformer (Qwen-Image-Edit is trained from it; the same config)
    "Qwen/Qwen-Image-Edit": 20_430_401_088,
    # Qwen-Image-Edit-2509 / -2511: the same 20B transformer further trained (2511's zero_cond_t adds no parameter)
    "Qwen/Qwen-Image-Edit-2509": 20_430_401_088,
    "Qwen/Qwen-Image-Edit-2511": 20_430_401_088,
    # the FLUX.1-dev 12B transformer (the same config; the hub's safetensors total is FLUX.1-dev's)
    "black-forest-labs/FLUX.1-Kontext-dev": 11_901_408_320,
    # a public component registry that counts the hub's 6 transformer shards of hunyuanvideo-community/HunyuanVideo
    # (the safetensors index's total_size, bf16 bytes = 2 x this, was not found in the stored sources)
    "hunyuanvideo-community/HunyuanVideo": 12_821_012_544,
    # public model catalogs' totalParams of hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v (and 720p_t2v),
    # the count the HunyuanVideo 1.5 technical report rounds to 8.3B
    "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v": 8_326_608_160,
    # the hub's num_parameters of MiniMaxAI/MiniMax-H3
    "MiniMaxAI/MiniMax-H3": 33_122_992_896,
    # Chroma1-HD: its model card's "8.9 billion parameters"; no exact published total found, this is the count of the
    # shipped config, which the 8.9B rounds
    "lodestones/Chroma1-HD": 8_899_983_424,
    # each expert of Wan2.2-I2V-A14B: no exact published total found; Wan2.1-T2V-14B's published count (above) + the
    # 20 more input channels of the patch embedding (36 vs 16, x 5120 x 1 x 2 x 2 = 409,600); no image branch
    "Wan-AI/Wan2.2-I2V-A14B-Diffusers": 14_288_901_184,
    "Wan-AI/Wan2.2-I2V-A14B-Diffusers/transformer_2": 14_288_901_184,
    # Wan2.1-VACE: no exact published totals found; Wan2.1-T2V-1.3B's / -14B's published counts (above) + the VACE
    # branch the shipped configs build (vace_patch_embedding and 15 / 8 VACE blocks with their before/after
    # projections): 734,975,232 and 3,049,101,312
    "Wan-AI/Wan2.1-VACE-1.3B-diffusers": 2_153_972_032,
    "Wan-AI/Wan2.1-VACE-14B-diffusers": 17_337_592_896,
    # Cosmos Predict 2.5: no exact published totals found; these are the counts of the shipped configs (diffusers'
    # converter values), which the model names' 2B and 14B round
    "nvidia/Cosmos-Predict2.5-2B": 2_059_174_912,
    "nvidia/Cosmos-Predict2.5-14B": 14_368_047_104,
    # Z-Image and Z-Image-Turbo (one architecture): the hub's 6,154,908,736 parameters as public loaders and model
    # catalogs list them (the model card's "6B")
    "Tongyi-MAI/Z-Image": 6_154_908_736,
    "Tongyi-MAI/Z-Image-Turbo": 6_154_908_736,
    # HunyuanImage 2.1 (base): public model catalogs' totalParams of hunyuanvideo-community/HunyuanImage-2.1-Diffusers
    # (the model card's "17B")
    "hunyuanvideo-community/HunyuanImage-2.1-Diffusers": 17_425_795_520,
    # Kandinsky 5.0 T2V Lite: no exact published total found; the count of the shipped config (the released
    # dit_params), which the model card's "2B" rounds
    "kandinskylab/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers": 2_007_702_848,
    # Kandinsky 5.0 I2V Lite: no exact published total found; the T2V Lite's architecture (the same released
    # dit_params), the count of its shipped config
    "kandinskylab/Kandinsky-5.0-I2V-Lite-5s-Diffusers": 2_007_702_848,
    # Qwen-Image 2.1: the hub's num_parameters of Qwen/Qwen-Image-2.1 (its transformer safetensors index's total_size,
    # 14,230,249,472 bf16 bytes over 297 tensors, is twice it); the model card's "7B"
    "Qwen/Qwen-Image-2.1": 7_115_124_736,
    # Wan2.2-Animate-14B: no exact published total found (public model cards say "17.3B transformer parameters");
    # Wan2.1-I2V-14B's count (above) + the Animate parts the shipped config builds: the face adapters (839,026,688),
    # the motion encoder (22,736,436), the face encoder (17,842,176) and the pose patch embedding (332,800)
    "Wan-AI/Wan2.2-Animate-14B-Diffusers": 17_274_816_884,
    # Krea 2 Raw: no exact published total found (public model cards and catalogs say "12B" / "12.9B"); the count of the
    # shipped config, diffusers' Krea2Transformer2DModel, which drops the original final layer's linear up/down residual
    "krea/Krea-2-Raw": 12_820_073_036,
    # LTX-2 (audio + video): no exact published total found (the model card's "19B"); the count of the shipped config,
    # diffusers' convert_ltx2_to_diffusers.py values, which the 19B rounds
    "Lightricks/LTX-2": 18_876_174_592,
}

# The per-sample cache layout (C, ...) each family's encoder writes for a clip of F frames × H × W pixels (documented in
# train/models/<family>/__init__.py): the latent channels and VAE strides of the shipped checkpoints' VAEs.

_TOKENS = re.compile(r"^# Tokens per sample after patching: ([\d,]+)", re.M)
_HARDWARE = re.compile(
    r"^# Hardware: (\d+) nodes? × (\d+) × [^;]+; cp (\d+) \(inside (?:a|the) node\) × dp_shard (\d+)", re.M
)


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No hub requests: config lookups fail fast and fall back (without this each retries for ~20 s offline)."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def _params(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if not k.startswith("_")}


@functools.cache
def _meta_model(family: str, hub_id: str) -> torch.nn.Module:
    cls = getattr(diffusers, get_family(family).transformer_class)
    with torch.device("meta"):
        return cls.from_config(_params(real_configs(family)[hub_id]))


@functools.cache
def _recipe(path: Path) -> Recipe:
    return load_recipe(path)


def _header(path: Path, pattern: re.Pattern[str]) -> re.Match[str]:
    match = pattern.search(path.read_text())
    assert match, f"{path.relative_to(REPO)}: the header needs a line matching {pattern.pattern!r}"
    return match


def _id(path: Path) -> str:
    return str(path.relative_to(REPO / "recipes"))


def test_every_family_ships_a_real_config_and_a_recipe() -> None:
    assert {family for family, _ in CONFIGS} == set(family_names())
    assert {_recipe(p).model.family for p in RECIPES} == set(family_names())


# ----------------------------------------------------------------------------------------------------------- configs


@pytest.mark.parametrize(("family", "hub_id"), CONFIGS, ids=[hub_id for _, hub_id in CONFIGS])
def test_config_file(family: str, hub_id: str) -> None:
    config = real_configs(family)[hub_id]
    assert config["_class_name"] == get_family(family).transformer_class
    assert isinstance(config["_diffusers_version"], str)
    source = config["_source"]
    assert isinstance(source, str) and source.strip() and "\n" not in source


@pytest.mark.parametrize(("family", "hub_id"), CONFIGS, ids=[hub_id for _, hub_id in CONFIGS])
def test_config_builds_on_meta_with_the_published_size(family: str, hub_id: str) -> None:
    cls = getattr(diffusers, get_family(family).transformer_class)
    _, unused, _ = cls.extract_init_dict(_params(real_configs(family)[hub_id]))
    assert not unused, f"{hub_id}: keys {sorted(unused)} are not {cls.__name__} arguments (diffusers would warn)"
    model = _meta_model(family, hub_id)
    assert all(p.is_meta for p in model.parameters())
    assert hub_id in PUBLISHED_PARAMS, f"add {hub_id}'s published parameter count to PUBLISHED_PARAMS"
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMS[hub_id]


@pytest.mark.parametrize(("family", "hub_id"), CONFIGS, ids=[hub_id for _, hub_id in CONFIGS])
def test_cp_plan_fits_the_real_model(family: str, hub_id: str) -> None:
    model = _meta_model(family, hub_id)
    spec = plan_for(model)
    validate_plan(spec, model)
    assert training_problems(spec, model) == []


# ----------------------------------------------------------------------------------------------------------- recipes


@pytest.mark.parametrize("path", RECIPES, ids=_id)
def test_recipe_resolves_to_a_shipped_config(path: Path) -> None:
    model = _recipe(path).model
    assert model.init_config is None, "a real recipe loads a checkpoint"
    config = transformer_config(model.family, pretrained_path=model.pretrained_path, subfolder=model.subfolder)
    assert config == _params(real_configs(model.family)[model.pretrained_path])


@pytest.mark.parametrize("path", RECIPES, ids=_id)
def test_recipe_tokens_and_heads_suit_its_cp_degree(path: Path) -> None:
    recipe = _recipe(path)
    model, cp = recipe.model, recipe.parallel.cp
    check_geometry(recipe)
    config = transformer_config(model.family, pretrained_path=model.pretrained_path, subfolder=model.subfolder)
    data = recipe.data.resolved(model)
    stated = int(_header(path, _TOKENS).group(1).replace(",", ""))
    for bucket in map(Bucket.parse, data.buckets):
        shapes = get_encoder(model.family).latent_shapes(bucket.frames, bucket.height, bucket.width, data.fps)
        tokens = get_family(model.family).tokens_per_sample(shapes, config)
        assert tokens == stated, f"bucket {bucket}: {tokens} tokens per sample, the header says {stated}"
        assert min(split_sizes(tokens, cp)) >= 1, f"{tokens} tokens cannot give each of {cp} CP ranks one"
    heads, _ = get_family(model.family).attention_shape(config)
    assert min(split_sizes(heads, cp)) >= 1, f"cp {cp} > {heads} heads: some CP ranks would attend over no head"


@pytest.mark.parametrize("path", RECIPES, ids=_id)
def test_recipe_layout_fits_its_hardware(path: Path) -> None:
    recipe = _recipe(path)
    nodes, per_node, cp, dp_shard = (int(g) for g in _header(path, _HARDWARE).groups())
    assert recipe.parallel.resolve(nodes * per_node) == (recipe.parallel.dp_replicate, dp_shard, cp)
    assert per_node % cp == 0, f"cp {cp} must tile the {per_node} GPUs of a node (CP groups stay inside a node)"


_ESTIMATE = re.compile(r"^# Estimated peak per GPU: ([\d.]+) GiB of 80 GiB \(python -m train.estimate --recipe (\S+) "
                       r"--gpus (\d+)\)", re.M)  # fmt: skip


@pytest.mark.parametrize("path", RECIPES, ids=_id)
def test_recipe_header_states_the_estimate(path: Path) -> None:
    """The header's per-GPU peak is what `train.estimate` predicts now for the stated hardware (re-run the command in
    the header after changing the recipe, the calibration or the estimator), and it fits in the GPU."""
    from train.estimate import GIB, estimate

    stated, cmd_path, gpus = _header(path, _ESTIMATE).groups()
    nodes, per_node, *_ = (int(g) for g in _header(path, _HARDWARE).groups())
    assert cmd_path == str(path.relative_to(REPO)) and int(gpus) == nodes * per_node
    peak = estimate(_recipe(path), int(gpus), "cuda").peak / GIB
    assert f"{peak:.1f}" == stated, f"the estimate is now {peak:.1f} GiB, the header says {stated}"
    assert peak < 0.9 * 80
