"""Model families: one package per family under ``train/models/<family>/``, found by discovery, never listed.

Usage::

    from train.models import get_family

    spec = get_family("flux")
    kwargs = spec.forward_kwargs(batch, noisy, sigmas, model_config=transformer.config)
    preds = spec.predictions(transformer(**kwargs, return_dict=False), shapes, model_config=transformer.config)

A family is a package (a folder with ``__init__.py``; its name is the family key recipes use) whose ``__init__``
exports:

* ``SPEC``: the :class:`~train.models.spec.FamilySpec` the trainer reads (``SPEC.name`` is the folder name),
* ``Encoder``: the :class:`~train.models.encoder.FamilyEncoder` subclass ``train.prepare`` caches data with,
* ``build_tiny(path)``: writes a tiny random-init pipeline folder (``save_pretrained`` of the real pipeline class)
  whose transformer is the family's tiny config (:func:`tiny_config`),

and documents in its docstring the cache layout, the forward kwargs and what the spec does not cover. Besides its
folder, a family needs a CP plan for its transformer class (``cp_plans/<family>.yaml``; variants of one class, such as
Wan 2.1 text- and image-to-video, share one) and its tiny recipe (``recipes/tiny/<family>.yaml``), whose
``model.init_config`` is the family's tiny transformer config, declared there once.
The modules next to the packages (``spec``, ``encoder``, ``tiny``) are shared plumbing, not families.

Families load on first use: discovering them (:func:`family_names`) imports none, :func:`get_family` /
:func:`family_module` import the one asked for, and no family imports a diffusers pipeline module (or a transformers
model) before it runs one of its functions.
"""

from __future__ import annotations

import copy
import functools
import importlib
import json
import pkgutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import yaml

from train.data.dataset import CacheReads

from .encoder import FamilyEncoder
from .spec import PRIMARY_STREAM, Batch, Config, FamilySpec, Shapes, ShiftSpec, Streams

_CONTRACT = ("SPEC", "Encoder", "build_tiny")
_TINY_SEED = 0
TINY_RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "tiny"


def family_names() -> tuple[str, ...]:
    """The discovered family keys (sorted): the packages of this folder, found without importing any of them (cheap
    enough for recipe validation). Modules (``spec.py``, ``encoder.py``, ``tiny.py``) are shared plumbing."""
    found = pkgutil.iter_modules([str(Path(__file__).parent)])
    return tuple(sorted(m.name for m in found if m.ispkg and not m.name.startswith("_")))


def _check_known(name: str) -> None:
    if name not in family_names():
        raise KeyError(f"unknown model family {name!r}; known families: {list(family_names())}")


@functools.cache
def family_module(name: str) -> ModuleType:
    """The package of family ``name`` (imported on first use), checked against the family contract (see the module
    docstring)."""
    _check_known(name)
    module = importlib.import_module(f"{__name__}.{name}")
    missing = [attr for attr in _CONTRACT if not hasattr(module, attr)]
    if missing:
        raise ImportError(f"train/models/{name}/__init__.py must export {list(_CONTRACT)}; missing {missing}")
    if module.SPEC.name != name or module.Encoder.name != name:
        raise ValueError(f"train/models/{name}: SPEC.name / Encoder.name must be {name!r}")
    return module


class _Families(Mapping[str, FamilySpec]):
    """The family specs by key, in :func:`family_names` order; a family's package is imported when its spec is read."""

    def __getitem__(self, name: str) -> FamilySpec:
        if name not in family_names():
            raise KeyError(name)
        return family_module(name).SPEC

    def __contains__(self, name: object) -> bool:
        return name in family_names()

    def __iter__(self) -> Iterator[str]:
        return iter(family_names())

    def __len__(self) -> int:
        return len(family_names())

    def __repr__(self) -> str:
        return f"FAMILIES({list(family_names())})"


FAMILIES: Mapping[str, FamilySpec] = _Families()


def get_family(name: str) -> FamilySpec:
    """The spec of family ``name`` (a key of :data:`FAMILIES`)."""
    return family_module(name).SPEC


def get_encoder(name: str) -> FamilyEncoder:
    """A fresh data encoder for family ``name`` (nothing loaded until ``.load``)."""
    return family_module(name).Encoder()


def cache_reads(name: str) -> CacheReads:
    """What family ``name`` reads from a prepared cache (checked when the trainer opens one): its noised streams and
    batch keys, and the latent shapes its encoder writes per bucket."""
    spec = get_family(name)
    return CacheReads(name, tuple(dict.fromkeys((*spec.streams, *spec.batch_keys))), get_encoder(name).latent_shapes)


def tiny_config(name: str) -> dict[str, Any]:
    """The tiny transformer's init config of family ``name`` (7 heads of dim 8, 1-2 layers): ``model.init_config`` of
    its tiny recipe ``recipes/tiny/<family>.yaml`` (plain YAML: lists, not tuples), a fresh copy on every call."""
    _check_known(name)
    return copy.deepcopy(_tiny_init_config(name))


@functools.cache
def _tiny_init_config(name: str) -> dict[str, Any]:
    return dict(yaml.safe_load((TINY_RECIPES / f"{name}.yaml").read_text())["model"]["init_config"])


def real_configs(name: str) -> dict[str, dict[str, Any]]:
    """The public transformer configs of family ``name``'s real checkpoints, shipped as data in
    ``train/models/<family>/configs/<org>--<repo>[--<subfolder>].json``, keyed by hub id (plus ``/<subfolder>`` when
    the transformer is not in ``transformer/``). A pipeline's ``--model_index.json`` is not a transformer config: see
    :func:`pipeline_boundary_ratio`."""
    folder = Path(__file__).parent / name / "configs"
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(folder.glob("*.json")):
        if path.stem.endswith("--model_index"):
            continue
        org, repo, *sub = path.stem.split("--")
        key = f"{org}/{repo}" + (f"/{sub[0]}" if sub else "")
        found[key] = json.loads(path.read_text())
    return found


def transformer_config(
    family: str,
    *,
    init_config: dict[str, Any] | None = None,
    pretrained_path: str | None = None,
    subfolder: str = "transformer",
) -> dict[str, Any]:
    """The transformer's constructor config without loading any weights: ``init_config`` when given, else the local
    pipeline folder's ``<subfolder>/config.json``, else the shipped config of a real checkpoint's hub id."""
    if init_config is not None:
        return dict(init_config)
    if pretrained_path is None:
        raise ValueError("set model.pretrained_path or model.init_config")
    local = Path(pretrained_path).expanduser()
    if local.is_dir():
        config = local / subfolder / "config.json" if subfolder else local / "config.json"
        if not config.is_file():
            raise ValueError(f"model.pretrained_path {pretrained_path}: no {config.relative_to(local)} in it")
        return {k: v for k, v in json.loads(config.read_text()).items() if not k.startswith("_")}
    shipped = real_configs(family)
    key = pretrained_path if subfolder == "transformer" else f"{pretrained_path}/{subfolder}"
    if key not in shipped:
        raise ValueError(
            f"model.pretrained_path {pretrained_path!r} is neither a local folder nor a checkpoint whose config "
            f"train/models/{family}/configs/ ships (known: {sorted(shipped)}); download it and pass the folder"
        )
    return {k: v for k, v in shipped[key].items() if not k.startswith("_")}


def pipeline_boundary_ratio(family: str, pretrained_path: str | None) -> float | None:
    """``boundary_ratio`` of a mixture-of-experts pipeline (Wan 2.2 A14B): the local folder's model_index.json, else
    the family's shipped ``configs/<org>--<repo>--model_index.json``; None when neither has one."""
    if pretrained_path is None:
        return None
    local = Path(pretrained_path).expanduser() / "model_index.json"
    if local.is_file():
        return json.loads(local.read_text()).get("boundary_ratio")
    shipped = Path(__file__).parent / family / "configs" / f"{pretrained_path.replace('/', '--')}--model_index.json"
    return json.loads(shipped.read_text()).get("boundary_ratio") if shipped.is_file() else None


def expert_sigma_range(spec: FamilySpec, model: Any) -> tuple[float, float] | None:
    """The sigma range a recipe's transformer is trained on: None for one-transformer families; for a mixture
    (``spec.experts``, high-noise expert first) the part of [0, 1] the pipeline routes to ``model.subfolder``:
    ``sigma >= boundary`` for the high-noise expert, below it for the low-noise one (the pipeline compares its
    timestep ``sigma * 1000`` with ``boundary_ratio * 1000``). ``model`` is the recipe's model section."""
    from train.errors import UserError

    if not spec.experts:
        return None
    if model.subfolder not in spec.experts:
        raise UserError(
            f"model.subfolder: {spec.name} is a mixture of experts {list(spec.experts)} (high noise first), got "
            f"{model.subfolder!r}; set model.subfolder to the expert to train"
        )
    ratio = model.boundary_ratio
    if ratio is None:
        ratio = pipeline_boundary_ratio(spec.name, model.pretrained_path)
    if ratio is None:
        raise UserError(
            f"model.boundary_ratio: {spec.name} needs the pipeline's boundary_ratio to know which sigmas "
            f"{model.subfolder} denoises, and {model.pretrained_path} has none; set model.boundary_ratio"
        )
    if len(spec.experts) != 2:
        raise NotImplementedError("one boundary_ratio splits two experts")
    return (float(ratio), 1.0) if model.subfolder == spec.experts[0] else (0.0, float(ratio))


def build_tiny_pipeline(name: str, path: str | Path) -> Path:
    """Build the tiny pipeline of family ``name`` with fixed weights and save it to ``path`` (reused when already
    there); returns ``path``. Modular-only pipelines (MiniMax-H3) save modular_model_index.json, the others
    model_index.json; the family is recorded in it under ``_tiny_family`` (diffusers ignores keys starting with _)."""
    build = family_module(name).build_tiny
    path = Path(path)
    indexes = [path / "model_index.json", path / "modular_model_index.json"]
    if any(m.exists() and json.loads(m.read_text()).get("_tiny_family") == name for m in indexes):
        return path
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_TINY_SEED)
        build(path)
    marker = next(m for m in indexes if m.exists())
    index = json.loads(marker.read_text())
    index["_tiny_family"] = name
    marker.write_text(json.dumps(index, indent=2))
    return path


__all__ = [
    "Batch",
    "Config",
    "FAMILIES",
    "TINY_RECIPES",
    "PRIMARY_STREAM",
    "FamilyEncoder",
    "FamilySpec",
    "Shapes",
    "ShiftSpec",
    "Streams",
    "build_tiny_pipeline",
    "cache_reads",
    "expert_sigma_range",
    "pipeline_boundary_ratio",
    "family_module",
    "real_configs",
    "transformer_config",
    "family_names",
    "get_encoder",
    "get_family",
    "tiny_config",
]
