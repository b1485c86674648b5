"""The optimizer levers (`train.optimizer`, `train.master_weights`; train/optim.py) under FSDP2 and CP, through the
trainer's own step and checkpoint, on 2 gloo ranks (cp 2: FSDP2 shards every tensor over both): bench/optimizers.py's
`small` case (a 128-wide Wan, full fine-tuning, bf16 autocast in every case, lr 1e-3, 6 steps). FSDP2's CPU offload
(`parallel.cpu_offload`) runs beside them: a no-op move on this CPU-only machine, so it must train exactly as adamw.

- The loss curve against fp32 AdamW's (same weights, data, noise): within DRIFT, about 10× what was measured on this
  machine (max per-step relative difference over the 6 steps: adamw_8bit 2.0e-4, adamw_4bit 1.0e-3, bf16 masters
  3.0e-4, bf16 masters + adamw_8bit 1.7e-4), for other CPUs' kernels. 8-bit and 4-bit moments change each
  update by their quantization error (up to ~1/255 and ~1/15 of their block's largest value), bf16 masters each
  weight by a rounding of ~2^-9 of it (stochastic, so unbiased: it does not accumulate as round-to-nearest would).
- Exact resume: the trainer's checkpoint of step 3 (`save_state`: DCP shards, manifest, the scheduler's torchao
  tensor rates as JSON) restored by the trainer's `restore` into a freshly built model and optimizer continues
  bit-identically (steps 4-6's losses and gradient norms; stochastic rounding is seeded per step).
- The optimizer state each rank holds (the storage of every state tensor, quantized codes and scales included)
  against train.estimate's term at world 2: equal within 1% on rank 0, whose shards are FSDP's padded ones the
  estimate counts, not above it on rank 1; and weight + gradient + state per parameter as the lever promises (16,
  10, 9, 8, 6 bytes; ≤ 12% more, where small tensors keep plain moments).
"""

from __future__ import annotations

import math

import pytest

from bench.optimizers import LEVERS, drift, small
from tests.harness import rank_job

SAVE_AT = 3
DRIFT = {"adamw_8bit": 2e-3, "adamw_4bit": 1e-2, "bf16 masters": 5e-3, "bf16 masters + adamw_8bit": 5e-3}
BYTES_PER_PARAM = {"adamw": 16, "adamw_8bit": 10, "adamw_4bit": 9, "bf16 masters": 8, "bf16 masters + adamw_8bit": 6,
                   "cpu offload": 16}  # fmt: skip

rank_job(2)(small)


@pytest.fixture(scope="module")
def levers(group) -> list[dict]:
    return group(small, 2)


@pytest.mark.parametrize("name", list(LEVERS))
def test_lever_resumes_exactly_and_holds_what_the_estimate_says(levers: list[dict], name: str) -> None:
    for rank, cases in enumerate(levers):
        c = cases[name]
        assert c["resumed"]["loss"] == c["loss"][SAVE_AT:], (rank, c)
        assert c["resumed"]["grad_norm"] == c["grad_norm"][SAVE_AT:], (rank, c)
        assert c["state"] <= c["estimate"] * 1.001, (rank, c["state"], c["estimate"])
        if rank == 0:
            assert math.isclose(c["state"], c["estimate"], rel_tol=0.01), (c["state"], c["estimate"])
        per_param = (2 * c["weights"] + c["state"]) / (c["params"] / 2)  # this rank holds half of every tensor
        assert per_param <= BYTES_PER_PARAM[name] * 1.12, (rank, per_param)
        assert c["dtypes"] == (["torch.bfloat16"] if "bf16" in name else ["torch.float32"]), c["dtypes"]


@pytest.mark.parametrize("name", list(DRIFT))
def test_lever_loss_curve_stays_near_fp32_adamw(levers: list[dict], name: str) -> None:
    ref, got = levers[0]["adamw"], levers[0][name]
    print(f"{name}: max relative loss difference vs fp32 AdamW over {len(ref['loss'])} steps {drift(got, ref):.2e}")
    assert got["loss"] != ref["loss"]  # the lever is in force: a quantized or rounded update differs
    assert drift(got, ref) <= DRIFT[name], (name, got["loss"], ref["loss"])


def test_cpu_offload_trains_as_without_it(levers: list[dict]) -> None:
    """FSDP2's CPUOffloadPolicy in place (shards, gradients, state and the optimizer step in host memory): on a
    CPU-only machine nothing moves, so every figure equals fp32 AdamW's bit for bit; its checkpoint resumes exactly
    (the test above). What it frees on a GPU is train.estimate's (tests/test_estimate.py) and bench/gpu_h200.py's."""
    for cases in levers:
        ref, got = cases["adamw"], cases["cpu offload"]
        assert got["loss"] == ref["loss"] and got["grad_norm"] == ref["grad_norm"], (got, ref)
        assert got["state"] == ref["state"] and got["weights"] == ref["weights"]
