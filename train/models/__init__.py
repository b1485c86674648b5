"""Model-family specs (data, not branches): one module per family, each defining ``SPEC``.

Usage::

    from train.models import get_family

    spec = get_family("flux")
    kwargs = spec.forward_kwargs(batch, noisy, sigmas, model_config=transformer.config, cp=cp_enabled)
    preds = spec.predictions(transformer(**kwargs, return_dict=False), shapes, model_config=transformer.config)
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

from .spec import PRIMARY_STREAM, FamilySpec, ShiftSpec

# Family modules, in a fixed order. Adding a family = adding a module with a SPEC and listing it here.
_FAMILY_MODULES: tuple[str, ...] = ("flux", "flux2", "qwenimage", "wan", "chronoedit", "ltx", "minimax_h3")


def _load() -> dict[str, FamilySpec]:
    families: dict[str, FamilySpec] = {}
    for module_name in _FAMILY_MODULES:
        spec = importlib.import_module(f"{__name__}.{module_name}").SPEC
        if spec.name != module_name:
            raise ValueError(f"train.models.{module_name}.SPEC.name is {spec.name!r}")
        families[spec.name] = spec
    return families


FAMILIES: dict[str, FamilySpec] = _load()


def family_names() -> tuple[str, ...]:
    """The discovered family keys (sorted), without importing any family module: cheap enough for recipe validation."""
    shared = {"spec"}  # shared plumbing, not a family
    found = (m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)]))
    return tuple(sorted(n for n in found if not n.startswith("_") and n not in shared))


def get_family(name: str) -> FamilySpec:
    """The spec of family ``name`` (a key of :data:`FAMILIES`)."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown model family {name!r}; known families: {sorted(FAMILIES)}") from None


def family_for_transformer(class_name: str) -> FamilySpec:
    """The spec whose ``transformer_class`` is ``class_name`` (e.g. ``type(transformer).__name__``)."""
    matches = [spec for spec in FAMILIES.values() if spec.transformer_class == class_name]
    if len(matches) != 1:
        raise KeyError(f"no unique model family for transformer class {class_name!r}")
    return matches[0]


__all__ = ["FAMILIES", "PRIMARY_STREAM", "FamilySpec", "ShiftSpec", "family_for_transformer", "family_names", "get_family"]
