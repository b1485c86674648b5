"""The user docs stay true: the recipe reference is the schema's, the errors troubleshooting quotes are the code's,
and the links between README and docs/ resolve."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"


def test_recipe_reference_is_current() -> None:
    """docs/recipes.md is generated from train/config.py's models: stale after any field or family change."""
    from train import recipe_docs
    from train.config import Recipe

    text = recipe_docs.render()
    assert (DOCS / "recipes.md").read_text() == text, "docs/recipes.md is stale: run python -m train.recipe_docs"
    rows = re.findall(r"^\| `([a-z0-9_.]+)` \|", text, flags=re.M)

    def keys(model, prefix=""):  # every dotted key of the schema, sections included
        from train.config import _section_of

        for name, info in model.model_fields.items():
            yield prefix + name
            section = _section_of(info.annotation)
            if section is not None:
                yield from keys(section, prefix + name + ".")

    assert len(rows) == len(set(rows)) and sorted(rows) == sorted(keys(Recipe))  # every key, once


# (file the message is raised in, a fragment of it) for every message docs/troubleshooting.md quotes
QUOTED = [
    ("train/data/batches.py", "ranks of one CP group received different batches: the CP batch contract is broken"),
    ("train/parallel.py", "ranks hold different {what} (seed every rank alike before creating parameters, and "),
    ("train/cp/enable.py", "and each CP rank needs at least one: set parallel.cp <= "),
    ("train/cp/layout.py", "match no split recorded by the plan's hooks"),
    ("train/cp/layout.py", "or run once with CTXTRAIN_CP_VERIFY_LAYOUT=1 to see the failing call on every rank."),
    ("train/runtime.py", "the ranks were started with different jobs: "),
    ("train/runtime.py", "did not arrive (stopped, hung or dead)"),
    ("train/runtime.py", "every rank reached this phase and is alive: a collective mismatch (ranks calling different "),
    ("train/config.py", "but the world "),
    ("train/estimate.py", "over by more than the estimate's"),
    ("train/rundir.py", "choose another output_dir, or pass "),
    ("train/rundir.py", "--archive-previous to move that run into output_dir/archive/ first"),
    ("train/rundir.py", ": nothing to resume in "),
    ("train/finetune.py", "the trained state is in checkpoint "),
    ("train/finetune.py", "arrived after the last step: the export finished first; the run is complete"),
    ("train/modeling.py", "the starting weights hold NaN/Inf in "),
    ("train/modeling.py", "the weights are of different models"),
    ("train/checkpoint.py", "free space (or fix the folder), then rerun with --resume"),
    ("train/data/batches.py", "epoch order cannot continue"),
    ("train/validation.py", "the pipeline would round it silently"),
    ("train/models/encoder.py", "weights_only=True loads tensors only, and nothing in it ran"),
    ("train/launch.py", "before the trainer could checkpoint"),
    ("train/prepare.py", "longer ones were cut there"),
]


@pytest.mark.parametrize("path,fragment", QUOTED, ids=[f"{p}:{f[:24]}" for p, f in QUOTED])
def test_troubleshooting_quotes_the_real_messages(path: str, fragment: str) -> None:
    assert fragment in (REPO / path).read_text(), f"{path} no longer says {fragment!r}: update docs/troubleshooting.md"
    doc = " ".join((DOCS / "troubleshooting.md").read_text().split())
    quoted = " ".join(fragment.replace("{what}", "initial weights").split())
    assert quoted.strip() in doc.replace("`", ""), f"docs/troubleshooting.md does not quote {fragment!r}"


@pytest.mark.parametrize("page", ["README.md", "docs/troubleshooting.md", "docs/recipes.md"])
def test_links_resolve(page: str) -> None:
    text = (REPO / page).read_text()
    links = [t for t in re.findall(r"\]\(([^)#\s]+)[^)]*\)", text) if "://" not in t]
    for target in links:
        assert ((REPO / page).parent / target).exists(), f"{page} links to {target}, which does not exist"
    if page == "README.md":
        assert {"docs/recipes.md", "docs/troubleshooting.md", "docs/plans.md"} <= set(links)
