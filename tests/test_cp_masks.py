"""train/cp/masks.py: a joint mask's key order, checked against a simulation of what the ranks hold (fast, serial).

A plan's `joint_key_mask` names the splits a joint sequence is made of, in model order. Each rank's keys are its
`tensor_split` shard of every segment, side by side; the all-to-all (or the ring) delivers them rank by rank. The
mask built whole in model order must be permuted into that order: `joint_order` must list, for each delivered key,
its model-order position. The simulation below splits positions with torch's own `tensor_split` (the rule diffusers'
sharder uses), not with the split sizes masks.py computes.
"""

from __future__ import annotations

import pytest
import torch

from train.cp.masks import joint_order, normalise_mask
from train.cp.plans import PlanError, load_plan_file


def _delivered(lengths: tuple[int, ...], world: int) -> list[int]:
    positions = torch.arange(sum(lengths))
    segments = positions.split(list(lengths))
    ranks = [torch.cat([seg.tensor_split(world)[r] for seg in segments]) for r in range(world)]
    return torch.cat(ranks).tolist()


@pytest.mark.parametrize("lengths", [(35, 9), (9, 35), (7, 1, 5), (4, 4), (1601, 729, 9)])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
def test_joint_order_is_the_order_ranks_deliver_keys_in(lengths: tuple[int, ...], world: int) -> None:
    order = joint_order(lengths, world)
    assert order == _delivered(lengths, world)
    assert sorted(order) == list(range(sum(lengths)))  # a permutation: every key once


def test_a_padding_mask_follows_its_keys() -> None:
    """[video | text] with the text padded: after the permutation each delivered key keeps its own mask bit."""
    video, text, kept = 35, 9, 6
    mask = torch.ones(video + text, dtype=torch.bool)
    mask[video + kept :] = False
    keys = torch.arange(video + text)
    for world in (2, 3, 4):
        order = torch.tensor(joint_order((video, text), world))
        assert torch.equal(mask[order], keys[order] < video + kept)


def test_masks_normalise_to_four_dims() -> None:
    assert normalise_mask(torch.ones(2, 5, dtype=torch.bool), 7).shape == (2, 1, 1, 5)
    assert normalise_mask(torch.ones(2, 7, 1, 5), 7).shape == (2, 7, 1, 5)
    with pytest.raises(ValueError, match="per head"):
        normalise_mask(torch.ones(2, 3, 1, 5), 7)


def test_joint_key_mask_must_name_splits_of_the_plan(tmp_path) -> None:
    plan = tmp_path / "bad.yaml"
    plan.write_text(
        "model_class: HunyuanVideoTransformer3DModel\ntraining: supported\n"
        'joint_key_mask: ["transformer_blocks.0:hidden_states", "transformer_blocks.0:encoder_states"]\n'
        "plan:\n  transformer_blocks.0:\n    split_inputs:\n      hidden_states: {dim: 1}\n"
        "      encoder_hidden_states: {dim: 1}\n  proj_out:\n    gather: {dim: 1}\n"
    )
    with pytest.raises(PlanError, match=r"joint_key_mask\.1: 'transformer_blocks.0:encoder_states' is not a split"):
        load_plan_file(plan)
