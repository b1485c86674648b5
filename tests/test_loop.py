"""Around the loop (issue 24): the EMA of the trained weights, the held-out loss, the weights at every checkpoint, and
one wandb run across a resume.

Three launches of the tiny Wan recipe with all four on, plus one resume:

- serial (1 process) and CP 2, LoRA: the same losses, the same held-out loss at steps 0, 2 and 4 (CP-parallel
  evaluation = the 1-process value), the same EMA export; the serial run's EMA equals the EMA computed here from the
  adapters its checkpoints exported at steps 1-4, and each checkpoint's adapter file loads in WanPipeline;
- cp 2 × dp_shard 2 (4 ranks), full fine-tuning: each rank averages its own FSDP shard, and the exported EMA equals the
  EMA computed here from the transformer folders its checkpoints exported; a copy stopped after step 2 resumes to step
  6: its step-4 EMA is bit-identical to the uninterrupted run's, its wandb run has the first run's id and holds only
  steps 5-6 (1-4 were logged by the first process), read back from the offline run files.
"""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest
import torch

from tests.harness import REL_TOL, assert_same_steps, check_lora_reload, train

TINY = "recipes/tiny/wan.yaml"  # 8 synthetic samples, batch 2, 4 steps
DECAY = 0.6  # far from 1, so that every step's weights weigh in the average visibly
LOOP = (f"ema.decay={DECAY}", "ema.start_step=1", "validation_loss.fraction=0.25", "validation_loss.every_n_steps=2",
        "validation_loss.at_start=true", "checkpoint.every_n_steps=1", "checkpoint.keep_last=6",
        "checkpoint.export_every_checkpoint=true")  # fmt: skip
FULL_DP_CP = ("finetune.method=full", "parallel.cp=2", "parallel.dp_shard=2", "logging.wandb_mode=offline", *LOOP)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def _ema_of(steps: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The EMA with start_step 1, every step: a copy of step 1's weights, then ema ← decay·ema + (1 − decay)·w."""
    ema = {k: v.double() for k, v in steps[0].items()}
    for weights in steps[1:]:
        ema = {k: DECAY * ema[k] + (1 - DECAY) * weights[k].double() for k in ema}
    return ema


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> float:
    assert a.keys() == b.keys() and a, what
    worst = max(float((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max().clamp_min(1e-6))
                for k in a)  # fmt: skip
    assert worst <= REL_TOL, (what, worst)
    return worst


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("loop")
    return {cp: train(root / f"cp{cp}", TINY, f"parallel.cp={cp}", *LOOP, nproc=cp) for cp in (1, 2)}


def test_held_out_loss_under_cp2_equals_one_process(lora_runs) -> None:
    """The held-out loss (2 of the 8 samples, fixed noise and sigmas per sample) at steps 0, 2 and 4: CP 2 equals the
    1-process run within 1e-5 relative, and training never saw those samples (the steps equal too)."""
    serial, cp2 = lora_runs[1].metrics, lora_runs[2].metrics
    held = {cp: [(m["step"], m["val_loss"]) for m in run.metrics if "val_loss" in m] for cp, run in lora_runs.items()}
    assert [s for s, _ in held[1]] == [s for s, _ in held[2]] == [0, 2, 4], held
    for (_, a), (_, b) in zip(held[2], held[1]):
        assert abs(a - b) <= REL_TOL * abs(b), held
    assert held[1][0][1] != held[1][-1][1]  # training moved it
    assert_same_steps([m for m in cp2 if "loss" in m], [m for m in serial if "loss" in m], "loop CP 2 vs 1")
    report = (lora_runs[2].out / "report.md").read_text()
    assert "held-out loss (step 0 → 4)" in report and (lora_runs[2].out / "report" / "val_loss.png").exists()
    worst = max(abs(a - b) / abs(b) for (_, a), (_, b) in zip(held[2], held[1]))
    print(f"held-out loss at steps 0, 2, 4: {[f'{v:.6g}' for _, v in held[1]]}; CP 2 vs 1 max relative difference "
          f"{worst:.2e}")  # fmt: skip


def test_lora_ema_equals_the_average_of_the_saved_adapters(lora_runs, tiny_pipeline) -> None:
    """The serial run's exported EMA (`lora_ema/`) equals the EMA computed here from the adapters exported with the
    checkpoints of steps 1-4, and the CP 2 run's equals the serial run's; every checkpoint's adapter file (the
    trained one and the EMA) loads in WanPipeline with its values."""
    out = lora_runs[1].out
    file = "pytorch_lora_weights.safetensors"
    saved = [_tensors(out / "checkpoints" / f"step_{s:06d}" / "lora") for s in range(1, 5)]
    assert all(len(s) > 0 for s in saved) and not all(torch.equal(saved[0][k], saved[-1][k]) for k in saved[0])
    worst = _assert_close(_tensors(out / "lora_ema"), _ema_of(saved), "LoRA EMA vs the saved adapters")
    assert torch.equal(_tensors(out / "lora")[next(iter(saved[-1]))], saved[-1][next(iter(saved[-1]))])
    ema_step2 = _tensors(out / "checkpoints" / "step_000002" / "lora_ema")
    _assert_close(ema_step2, _ema_of(saved[:2]), "the step-2 checkpoint's EMA")
    _assert_close(_tensors(lora_runs[2].out / "lora_ema"), _tensors(out / "lora_ema"), "LoRA EMA CP 2 vs 1")
    for sub in ("lora", "lora_ema"):
        assert (out / "checkpoints" / "step_000003" / sub / file).exists()
        check_lora_reload("wan", tiny_pipeline("wan"), out / "checkpoints" / "step_000003" / sub, rank=4, alpha=8.0)
    print(f"LoRA EMA vs the EMA of the saved adapters: max relative difference {worst:.2e}")


@pytest.fixture(scope="module")
def full_dp_cp(tmp_path_factory):
    return train(tmp_path_factory.mktemp("loop_full") / "run", TINY, *FULL_DP_CP, nproc=4)


def test_full_ema_at_cp2_dp_shard2_equals_the_average_of_the_saved_weights(full_dp_cp) -> None:
    """cp 2 × dp_shard 2, full fine-tuning: the exported EMA (`transformer_ema/`, a from_pretrained folder) equals the
    EMA computed here from the transformer folders the checkpoints of steps 1-4 hold."""
    from diffusers import WanTransformer3DModel

    out = full_dp_cp.out
    saved = [_tensors(out / "checkpoints" / f"step_{s:06d}" / "transformer") for s in range(1, 5)]
    worst = _assert_close(_tensors(out / "transformer_ema"), _ema_of(saved), "full EMA vs the saved weights")
    model = WanTransformer3DModel.from_pretrained(out / "transformer_ema")
    assert torch.equal(model.proj_out.weight, _tensors(out / "transformer_ema")["proj_out.weight"])
    print(f"full EMA (cp 2 x dp_shard 2) vs the EMA of the saved weights: max relative difference {worst:.2e}")


def _wandb_records(path: Path):
    """The records of an offline wandb run file (wandb's LevelDB-style log: 32 KiB blocks of checksum, length, type
    chunks; full=1, first=2, middle=3, last=4), as its protobuf `Record`s."""
    from wandb.proto import wandb_internal_pb2

    data, pos, chunk = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B", path
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if n == 0 and kind == 0:  # the block's zero padding
            pos += left
            continue
        chunk += data[pos + 7 : pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def _wandb_run(folder: Path) -> tuple[str, list[int]]:
    """(run id, the history steps it logged) of one offline run folder."""
    (file,) = folder.glob("run-*.wandb")
    run_id, steps = None, []
    for r in _wandb_records(file):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run_id = r.run.run_id
        elif kind == "history":
            steps.append(r.history.step.num)
    return run_id, steps


def test_resume_continues_the_ema_and_the_wandb_run(full_dp_cp, tmp_path: Path) -> None:
    """A copy of the 4-rank run with only its step-2 checkpoint (as a stop after step 2 leaves it, its wandb folder
    kept) resumes with max_steps 6: its step-4 checkpoint's EMA is bit-identical to the uninterrupted run's (the
    average's shards restored exactly), and its wandb run continues the first: the same id (run.json's), and only
    steps 5-6 logged by the second process."""
    import json

    out = tmp_path / "resumed"
    shutil.copytree(full_dp_cp.out, out)
    for later in ("step_000003", "step_000004"):
        shutil.rmtree(out / "checkpoints" / later)
    for export in ("transformer", "transformer_ema"):
        shutil.rmtree(out / export)
    resumed = train(out, TINY, *FULL_DP_CP, "train.max_steps=6", nproc=4, resume=True)
    assert "resumed from" in resumed.stdout and "step_000002 at step 2" in resumed.stdout
    step4 = "checkpoints/step_000004/transformer_ema"
    a, b = _tensors(out / step4), _tensors(full_dp_cp.out / step4)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    run_id = json.loads((out / "run.json").read_text())["id"]
    first, second = sorted((out / "wandb").glob("offline-run-*"))
    assert _wandb_run(first) == (run_id, [0, 1, 2, 3, 4])
    assert _wandb_run(second) == (run_id, [5, 6])
    assert [m["step"] for m in resumed.metrics] == [0, 1, 2, 3, 4, 5, 6]  # metrics.jsonl holds the whole run


@pytest.mark.parametrize("start, every", [(0, 2), (3, 1)])
def test_ema_rule_start_step_and_interval(start: int, every: int) -> None:
    """start_step 0 averages from the weights before the first step; start_step > 0 copies that step's weights; then
    every `every_n_steps`: against the rule written out here, on a plain parameter whose value is the step."""
    from types import SimpleNamespace

    from train.ema import EMA

    layer = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        layer.weight.fill_(0.0)
    ema = EMA.of(SimpleNamespace(decay=0.5, start_step=start, every_n_steps=every), layer)
    expected = 0.0
    for step in range(1, 8):
        with torch.no_grad():
            layer.weight.fill_(float(step))  # the weights after optimizer step `step`
        ema.update(step)
        if step == start:
            expected = float(step)
        elif step > start and (step - start) % every == 0:
            expected = 0.5 * expected + 0.5 * step
        assert ema.average["weight"].item() == expected, (step, ema.average["weight"].item(), expected)
    with ema.swapped():
        assert layer.weight.item() == expected
    assert layer.weight.item() == 7.0


def test_mistakes_are_one_line_naming_the_key() -> None:
    """Per-checkpoint exports without an export, EMA samples without validation, a held-out share that leaves nothing to
    train on: refused with the key and the fix."""
    from tests.harness import REPO
    from train.config import RecipeError, load_recipe
    from train.errors import UserError
    from train.heldout import split

    for sets, said in ((["checkpoint.export_every_checkpoint=true", "checkpoint.export=none"],
                        "checkpoint.export_every_checkpoint"),
                       (["ema.validation=true"], "ema.validation")):  # fmt: skip
        with pytest.raises(RecipeError, match=said):
            load_recipe(REPO / TINY, sets)
    with pytest.raises(UserError, match="leaves none to train on"):
        split(4, 0.9, 0)
    held = split(8, 0.25, 0)
    assert held == split(8, 0.25, 0) and len(held) == 2 and split(8, 0.25, 1) != held  # seeded: the same on every rank
