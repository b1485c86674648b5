"""The trainer's ranks (train/finetune.py's entry, forked warm by tests/harness.py `train`) on CPU.

A CP run must be indistinguishable, step by step, from the single-process run of the same recipe and seed:
per-step loss and grad_norm within 1e-5 relative (`assert_same_steps`). Runs go through the session's `runs`
(one run per distinct command), and the serial references are shared: the 4-step serial tiny-wan LoRA run
(`SERIAL`) is the reference of CP 2, the activation levers and compile here, of the two-"node" run of
tests/test_launch.py, of the samples in tests/test_validation.py and of the bf16 run in tests/test_runtime.py, and the
checkpointed run that tests/test_resume.py and tests/test_bad_inputs.py resume; the CP 2 LoRA run (`CP2`, wandb
offline) is tests/test_report.py's run and tests/test_validation.py's run without validation. Where only the first
optimizer step matters (dp_shard 2 × cp 2 with 2 micro-batches per step: the reduction over both axes and the
micro-batches of one step, one 4-rank launch), the reference is the serial oracle computed in this process with the
trainer's own pieces (`first_step`); LoRA (CP 2) and full fine-tuning (CP 2) are compared over 4 steps (the optimizer
state across steps). Both LoRA runs checkpoint after every step (the last 3 kept): copies of them resume from step 2
at the other CP degree (and at the same one, exactly).

Other degrees and layouts through this entry point: CP 3, CP 4 and ring 2 × Ulysses 2 against the serial launch are
tests/test_families_e2e.py's HunyuanVideo exact test; this recipe (7 heads, 35 tokens: divisible by none of 2, 3, 4)
at CP 4 = ring 2 × Ulysses 2 against `SERIAL` is tests/test_launch.py's two-node run. Every family trains through this
entry point in tests/test_families_e2e.py (its tiny pipeline's cache, one CP launch against the first-step oracle);
every family's tiny model runs at every CP layout against the pipeline-form serial oracle in tests/test_cp_models.py.
The startup memory warning and bf16 autocast are checked on tests/test_runtime.py's long CP 2 run.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.harness import REL_TOL, REPO, assert_same_steps, check_lora_reload, first_step, train

TINY = "recipes/tiny/wan.yaml"  # LoRA, 4 steps, batch 2, 35 video tokens, 7 heads (neither divisible by 2, 3, 4)
CKPT = ("checkpoint.every_n_steps=1", "checkpoint.keep_last=3")
SERIAL = ("parallel.cp=1", *CKPT)  # the serial tiny-wan LoRA run: tests/test_launch.py, test_resume.py, ... share it
CP2 = ("parallel.cp=2", "logging.wandb_mode=offline", *CKPT)  # tests/test_report.py and test_validation.py share it
FULL = ("finetune.method=full", "train.gradient_checkpointing=true", "checkpoint.export_format=both")
TIMING = ("transformer_tokens_per_s", "step_time_s", "peak_mem_bytes")  # measurements, not results: they may differ


def _serial(runs):
    return runs(TINY, *SERIAL)


def test_lora_cp2_matches_single_process(runs) -> None:
    """LoRA at CP 2 (7 heads and 35 tokens, neither divisible) against the serial run, 4 steps (the optimizer state
    carries the equality across steps); the serial run's first step is the in-process oracle's. (CP 3 and 4: see the
    module docstring.)"""
    serial = _serial(runs).metrics
    assert_same_steps(runs(TINY, *CP2, nproc=2).metrics, serial, "lora CP 2 vs 1")
    assert_same_steps(serial, [{"step": 1, **first_step(TINY)}], "serial launch vs first_step", steps=1)
    assert len(serial) == 4 and serial[-1]["loss"] != serial[0]["loss"]  # parameters did move


def test_full_cp2_matches_single_process(runs) -> None:
    """Full fine-tuning (with gradient checkpointing) at CP 2 against the serial run, 4 steps: every weight and its
    AdamW state equal across steps."""
    serial, cp2 = runs(TINY, *FULL, "parallel.cp=1"), runs(TINY, *FULL, "parallel.cp=2", nproc=2)
    assert_same_steps(cp2.metrics, serial.metrics, "full CP 2 vs 1")
    assert len(serial.metrics) == 4 and serial.metrics[-1]["loss"] != serial.metrics[0]["loss"]


# Every lever and compile in one CP 2 run: block 0 recomputed in backward (its recompute compiled), block 1 not; the
# tensors both blocks save kept in host memory (save_on_cpu, around the checkpoint too); each block's forward compiled
# (inductor on CPU). Checkpointing of every block under CP 2 is the full fine-tuning run's (`FULL`).
LEVERS = ("train.gradient_checkpointing=true", "train.checkpoint_every=2", "train.offload_activations=true",
          "train.compile=true")  # fmt: skip


def test_activation_levers_and_compile_under_cp2_match_single_process(runs) -> None:
    """The memory levers (checkpointing every 2nd block, activation offload) and torch.compile (per block, the CP
    attention a graph break), together at CP 2, against the plain serial run: the same loss and grad norm, 4 steps."""
    run = runs(TINY, "parallel.cp=2", *LEVERS, nproc=2)
    assert_same_steps(run.metrics, _serial(runs).metrics, f"{LEVERS} CP 2 vs 1")


# dp_shard 2 × cp 2, 2 micro-batches of 1 per step, 1 step: one 4-rank launch for the two first-step tests below
DP_CP_ACCUM = ("parallel.cp=2", "parallel.dp_shard=2", "train.grad_accum=2", "train.batch_size=1", "train.max_steps=1")


def _dp_cp_accum(runs):
    return runs(TINY, *DP_CP_ACCUM, nproc=4)


@functools.cache
def _dp_cp_accum_oracle() -> dict[str, float]:
    return first_step(TINY, *DP_CP_ACCUM, dp=2)


def test_grad_accumulation_cp2_matches_single_process(runs) -> None:
    """2 micro-batches of 1 per step at CP 2 (in each of 2 data-parallel groups): the step's loss and grad norm are
    the serial oracle's (`first_step`: the same micro-batches, generators and 1/(grad_accum × dp) scaling, in this
    process)."""
    ref = _dp_cp_accum_oracle()
    assert_same_steps(_dp_cp_accum(runs).metrics, [{"step": 1, **ref}], "accum 2, CP 2, dp 2 vs first_step", steps=1)


def test_dp2_cp2_matches_the_data_parallel_oracle(runs) -> None:
    """dp_shard 2 × cp 2 (4 ranks): the first step's loss (the mean over the 2 data-parallel groups) and grad norm (of
    the mean gradient) are the serial oracle's for 2 groups (`first_step(dp=2)`: each group's own batches and
    generators, in this process), so CP inside each data-parallel group changes nothing and the reduction is SUM over
    CP, MEAN over DP. Its step accumulates 2 micro-batches per group (the launch it shares with the test above)."""
    dp_cp = _dp_cp_accum(runs)
    ref = _dp_cp_accum_oracle()
    assert_same_steps(dp_cp.metrics, [{"step": 1, **ref}], "dp_shard 2 × cp 2 vs first_step(dp=2)", steps=1)
    layout = json.loads((dp_cp.out / "layout.json").read_text())
    assert "SUM over cp=2, MEAN over dp=2" in layout["gradient_reduction"], layout


def test_cp2_run_outputs_wandb_and_lora_export(runs, tiny_pipeline) -> None:
    """The CP 2 LoRA run with wandb offline: its metrics lines, layout, recipe, checkpoints (keep_last 3), wandb run,
    and a LoRA export that diffusers' WanPipeline loads with the trained values and scale (lora_alpha / rank)."""
    run = runs(TINY, *CP2, nproc=2)
    assert len(list((run.out / "wandb").glob("offline-run-*/run-*.wandb"))) == 1, run.stdout[-2000:]
    assert [m["step"] for m in run.metrics] == [1, 2, 3, 4]
    for m in run.metrics:
        assert {"step", "loss", "grad_norm", "lr", "transformer_tokens_per_s", "peak_mem_bytes"} <= set(m)
        assert m["transformer_tokens_per_s"] > 0 and m["peak_mem_bytes"] > 0
        # tokens/s × step time = the step's transformer tokens: 2 clips × (5 × 2/2 × 14/2 = 35 video tokens) = 70
        assert round(m["transformer_tokens_per_s"] * m["step_time_s"]) == 70
    layout = json.loads((run.out / "layout.json").read_text())
    assert "SUM over cp=2" in layout["gradient_reduction"] and layout["cp_plan"].endswith("wan.yaml")
    assert layout["mixed_precision"] == "no: fp32"
    assert (run.out / "recipe.yaml").exists()
    ckpts = [p.name for p in sorted((run.out / "checkpoints").iterdir())]
    assert ckpts == ["step_000002", "step_000003", "step_000004"]  # keep_last 3 of 4
    pipe = check_lora_reload("wan", tiny_pipeline("wan"), run.out / "lora", rank=4, alpha=8.0)
    layer = pipe.transformer.blocks[0].attn1.to_q
    assert layer.scaling[next(iter(layer.scaling))] == 8.0 / 4  # lora_alpha / rank from the recipe


def _state(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("method", ["lora", "full"])
def test_exported_weights_match_single_process(runs, method: str) -> None:
    """The weights a CP 2 run exports equal those of the single-process run (after 4 optimizer steps)."""
    if method == "lora":
        serial, cp2, sub = _serial(runs), runs(TINY, *CP2, nproc=2), "lora"
    else:
        serial, cp2 = runs(TINY, *FULL, "parallel.cp=1"), runs(TINY, *FULL, "parallel.cp=2", nproc=2)
        sub = "transformer"
    a, b = _state(cp2.out / sub), _state(serial.out / sub)
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        assert (a[k] - b[k]).abs().max() <= 1e-5 * b[k].abs().max().clamp_min(1e-3), k
    if method == "full":  # a diffusers folder that reloads, and training moved the weights away from the init
        from diffusers import WanTransformer3DModel

        from train.config import load_recipe

        model = WanTransformer3DModel.from_pretrained(serial.out / "transformer")
        torch.manual_seed(0)
        init = WanTransformer3DModel.from_config(load_recipe(REPO / TINY).model.init_config)
        moved = [n for n, p in model.named_parameters() if not torch.equal(p, init.state_dict()[n])]
        assert len(moved) >= 0.9 * len(list(model.parameters()))
        # the CP 2 run's Wan-original single file (export_format both), read by diffusers' from_single_file, is its
        # diffusers folder tensor for tensor
        single = WanTransformer3DModel.from_single_file(str(cp2.out / "transformer_original" / "model.safetensors"),
                                                        config=str(cp2.out / "transformer"))  # fmt: skip
        assert single.state_dict().keys() == a.keys()
        assert all(torch.equal(t, a[k]) for k, t in single.state_dict().items())


RESUMES = {"cp2_to_cp2": (2, 2), "cp2_to_cp1": (2, 1), "cp1_to_cp2": (1, 2)}


@pytest.mark.parametrize("case", sorted(RESUMES))
def test_resume_from_step_2_matches_the_uninterrupted_run(runs, tmp_path: Path, case: str) -> None:
    """A copy of a 4-step LoRA run with only its step-2 checkpoint (as a run stopped after step 2 leaves it) resumes
    to step 4, at the same CP degree or at another one (`parallel.cp` is applied on resume: the same samples and
    order). Same degree: steps 3-4 equal the uninterrupted run's exactly (every field but timings). Another degree:
    steps 3-4 equal both uninterrupted runs (CP 2 and serial) within 1e-5 relative, the float rounding of CP's
    reductions (the largest relative difference is printed)."""
    src_cp, to_cp = RESUMES[case]
    runs_by_cp = {1: _serial(runs), 2: runs(TINY, *CP2, nproc=2)}
    src, out = runs_by_cp[src_cp], tmp_path / case
    shutil.copytree(src.out, out)
    for later in ("step_000003", "step_000004"):
        shutil.rmtree(out / "checkpoints" / later)
    sets = SERIAL if to_cp == 1 else CP2
    resumed = train(out, TINY, *sets, nproc=to_cp, resume=True)
    assert f"resumed from {out / 'checkpoints' / 'step_000002'} at step 2" in resumed.stdout
    lines = resumed.metrics
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    if src_cp == to_cp:
        exact = [{k: v for k, v in m.items() if k not in TIMING} for m in lines]
        assert exact == [{k: v for k, v in m.items() if k not in TIMING} for m in src.metrics]
        return
    assert f"resume: parallel.cp: {src_cp} -> {to_cp}" in resumed.stdout
    worst = 0.0
    for cp, ref in runs_by_cp.items():
        assert_same_steps(lines[2:], ref.metrics[2:], f"{case} vs the uninterrupted CP {cp} run")
        worst = max(worst, *(abs(a[k] - b[k]) / abs(b[k]) for a, b in zip(lines[2:], ref.metrics[2:])
                             for k in ("loss", "grad_norm")))  # fmt: skip
    print(f"resume {case}: steps 3-4 vs the uninterrupted runs, max relative difference {worst:.2e} (≤ {REL_TOL})")


def test_mixed_precision_resolves_per_device() -> None:
    """`bf16` autocasts on any device (never silently fp32 on CPU); `auto` is bf16 on GPU only; `no` is fp32."""
    from train.finetune import autocast_dtype

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert [autocast_dtype(m, cpu) for m in ("bf16", "auto", "no")] == [torch.bfloat16, None, None]
    assert [autocast_dtype(m, gpu) for m in ("bf16", "auto", "no")] == [torch.bfloat16, torch.bfloat16, None]


def test_flow_shift_is_a_recipe_key() -> None:
    """Wan's flow shift (3.0 at 480p) is the recipe default; `model.flow_shift: 5.0` (720p) shifts every sigma."""
    from train.config import load_recipe
    from train.modeling import family_spec
    from train.objective import sample_stream_sigmas

    default = family_spec(load_recipe(REPO / TINY).model)
    shifted = family_spec(load_recipe(REPO / TINY, ["model.flow_shift=5.0"]).model)
    assert (default.shift.shift, shifted.shift.shift) == (3.0, 5.0)
    a, b = (sample_stream_sigmas(64, s, scheme="uniform", generator=torch.Generator().manual_seed(1))["latents"]
            for s in (default, shifted))  # fmt: skip
    u = a.double() / (3.0 - 2.0 * a.double())  # the same base draw: invert sigma = 3u / (1 + 2u)
    torch.testing.assert_close(b.double(), 5.0 * u / (1 + 4.0 * u), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_warmup_applies_with_every_schedule(schedule: str) -> None:
    """`train.warmup_steps` ramps the lr from 0 with every schedule: diffusers' "constant" alone ignores it (issue 20:
    15 shipped recipes set warmup with the constant default). The rates each optimizer step used, 6 steps."""
    from train.config import TrainConfig
    from train.finetune import build_optimizer

    t = TrainConfig(lr=1e-3, lr_schedule=schedule, warmup_steps=2, max_steps=6)
    optimizer, scheduler = build_optimizer([torch.nn.Parameter(torch.zeros(1))], t)
    used = []
    for _ in range(t.max_steps):
        used.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert used[:3] == pytest.approx([0.0, 5e-4, 1e-3]), used
    if schedule == "constant":
        assert used[3:] == pytest.approx([1e-3] * 3), used
    else:  # decays after the warmup, towards 0 at max_steps
        assert 0 < used[-1] < used[3] < 1e-3, used


@pytest.mark.slow
def test_logged_lr_is_the_rate_the_step_trained_at(tmp_path: Path) -> None:
    """Each metrics line's `lr` is the rate of its own step (it was the next step's): with 2 warmup steps and the
    constant schedule, step 1 trains at 0, step 2 at lr / 2, then lr."""
    run = train(tmp_path / "warmup", TINY, "parallel.cp=1", "train.warmup_steps=2", "logging.every_n_steps=1")
    assert [m["lr"] for m in run.metrics] == pytest.approx([0.0, 5e-4, 1e-3, 1e-3])


# --- one run's state per output_dir, and an export that cannot lose the run (issue 20) --------------------------------


def _files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_a_rerun_into_a_finished_runs_folder_is_refused_and_changes_nothing(runs) -> None:
    """The finished CP 2 LoRA run's folder (run.json, checkpoints, metrics, its LoRA export): the same command again
    without --resume is refused on every rank with one line (exit 2), and `--resume` of the full CP 2 run (its default
    `checkpoint.every_n_steps: 0`: metrics and an export, no checkpoint) says there is nothing to resume; neither
    changes a byte of the folder. The rules themselves: tests/test_rundir.py."""
    for sets, resume, said in ((CP2, False, "holds run "), ((*FULL, "parallel.cp=2"), True, "nothing to resume in")):
        done = runs(TINY, *sets, nproc=2)
        before = _files(done.out)
        again = train(done.out, TINY, *sets, nproc=2, resume=resume, check=False)
        assert again.rc == 2 and len(again.errors) == 1 and said in again.errors[0], again.log[-3000:]
        assert _files(done.out) == before, sets


def _export_fault_rank(rank: int, world: int, out: str, fault: str) -> dict:
    """train/finetune.py's `main` on this rank (the full CP 2 run's recipe, into `out`) with rank 0's writes of the
    transformer export faulted at the file layer: "disk full" (each fails with ENOSPC) or, resuming, "sigterm" (a
    SIGTERM to this rank as the export writes its shard). What it raised, and what it printed."""
    import contextlib
    import errno
    import io
    import os
    import signal

    import safetensors.torch

    from tests.harness import QUIET
    from train import finetune
    from train.errors import UserError

    real = safetensors.torch.save_file

    def faulty(tensors, filename, metadata=None):
        if ".transformer.partial" in str(filename):
            if fault.startswith("disk full"):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(filename))
            os.kill(os.getpid(), signal.SIGTERM)
        return real(tensors, filename, metadata)

    safetensors.torch.save_file = faulty
    disk = contextlib.ExitStack()  # (open until this rank returns)
    if fault == "disk full everywhere":  # the checkpoint written in the export's place fails too
        from tests.harness import full_disk

        disk.enter_context(full_disk(lambda path: "checkpoints" in path))
    sets = (f"output_dir={out}", *QUIET, *FULL, "parallel.cp=2")
    argv = [
        "--recipe",
        str(REPO / TINY),
        *[a for s in sets for a in ("--set", s)],
        *(["--resume"] * (fault == "sigterm")),
    ]
    said, printed = None, io.StringIO()
    with contextlib.redirect_stdout(printed):
        try:
            finetune.main(argv)
        except UserError as e:
            said = str(e)
    return {"said": said, "printed": printed.getvalue()}


def test_a_failed_export_leaves_a_checkpoint_that_resume_exports(runs, tmp_path: Path) -> None:
    """The full CP 2 run (no checkpoint until the end) whose final export fails on disk full: one line on every
    rank naming the cause and the checkpoint of the last step written in its place, no folder that looks like a
    model. `--resume` then trains nothing and exports it; a SIGTERM during that export lets it finish (the run
    complete, `stopped.json` marked so: train.launch exits 0 for it). The export equals the uninterrupted run's,
    tensor for tensor."""
    from safetensors.torch import load_file

    from tests.harness import spawn

    ref, out = runs(TINY, *FULL, "parallel.cp=2", nproc=2).out, tmp_path / "full"
    failed = spawn(_export_fault_rank, 2, str(out), "disk full", init_group=False)
    said = failed[0]["said"]
    assert failed[1]["said"] == said and said is not None, failed
    assert said.startswith(f"export of the full weights to {out / 'transformer'} failed (OSError: [Errno 28]"), said
    assert f"the trained state is in checkpoint {out / 'checkpoints' / 'step_000004'}" in said and "--resume" in said
    assert (out / "checkpoints" / "step_000004" / "COMPLETE").exists()
    assert not (out / "transformer").exists() and not list(out.glob(".transformer*"))

    # The disk full for the checkpoint too: one line naming both failures and that no checkpoint exists (no
    # --resume advised: nothing to resume), no checkpoint folder left behind.
    lost = tmp_path / "lost"
    failed = spawn(_export_fault_rank, 2, str(lost), "disk full everywhere", init_group=False)
    said = failed[0]["said"]
    assert failed[1]["said"] == said and said is not None and "\n" not in said, failed
    assert "the checkpoint written in its place failed too (rank 0: No space left on device)" in said, said
    assert "no complete checkpoint exists" in said and "--resume" not in said, said
    assert not list((lost / "checkpoints").glob("*")) and not list(lost.glob(".transformer*"))

    resumed = spawn(_export_fault_rank, 2, str(out), "sigterm", init_group=False)
    assert resumed[0]["said"] is None and resumed[1]["said"] is None, resumed
    printed = resumed[0]["printed"]
    assert "resume: step 4 is already train.max_steps (4): nothing to train" in printed, printed[-3000:]
    assert "SIGTERM arrived after the last step: the export finished first; the run is complete" in printed
    marker = json.loads((out / "stopped.json").read_text())
    assert marker["completed"] is True and marker["signal"] == "SIGTERM" and marker["step"] == 4
    shards = sorted(p.name for p in (ref / "transformer").glob("*.safetensors"))
    assert shards and shards == sorted(p.name for p in (out / "transformer").glob("*.safetensors"))
    for name in shards:
        a, b = load_file(out / "transformer" / name), load_file(ref / "transformer" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def _rotation_rank(rank: int, world: int, out: str) -> dict:
    """train/finetune.py's `main` (the tiny LoRA recipe, 1 process, 3 steps, a checkpoint and its export after each,
    keep_last 1) with every write and deletion under `out` recorded in order, and the export of step 3's checkpoint
    failing (ENOSPC at its adapter file)."""
    import contextlib
    import errno
    import io
    import os

    import safetensors.torch

    from tests.harness import QUIET
    from train import checkpoint, finetune

    events, real_save, real_rmtree = [], safetensors.torch.save_file, checkpoint.shutil.rmtree

    def save_file(tensors, filename, metadata=None):
        if "step_000003" in str(filename) and ".lora.partial" in str(filename):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(filename))
        real_save(tensors, filename, metadata)
        events.append(("wrote", os.path.relpath(filename, out)))

    def rmtree(path, *args, **kwargs):
        events.append(("deleted", os.path.relpath(path, out)))
        return real_rmtree(path, *args, **kwargs)

    safetensors.torch.save_file, checkpoint.shutil.rmtree = save_file, rmtree
    sets = (f"output_dir={out}", *QUIET, "parallel.cp=1", "train.max_steps=3", "checkpoint.every_n_steps=1",
            "checkpoint.keep_last=1", "checkpoint.export_every_checkpoint=true")  # fmt: skip
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):
        finetune.main(["--recipe", str(REPO / TINY), *[a for s in sets for a in ("--set", s)]])
    return {"events": events, "stderr": printed.getvalue()}


def test_rotation_keeps_the_last_export_until_its_successor_is_complete(tmp_path: Path) -> None:
    """keep_last 1 with an export in every checkpoint: the previous checkpoint (and its export) is deleted only after
    the new checkpoint's export is written; when that export fails, nothing is rotated away, so the run still holds
    an intermediate export (step 2's) beside step 3's complete checkpoint."""
    from tests.harness import spawn

    out = tmp_path / "rotation"
    (done,) = spawn(_rotation_rank, 1, str(out), init_group=False)
    events = done["events"]
    # a checkpoint deleted whole, or its adapter file written (into the export's staging folder, then renamed)
    order = [
        (what, path.split("/")[1])
        for what, path in events
        if path.startswith("checkpoints/")
        and (path.count("/") == 1 if what == "deleted" else path.endswith(".safetensors") and "lora" in path)
    ]
    assert order == [("wrote", "step_000001"), ("wrote", "step_000002"), ("deleted", "step_000001")], events
    assert (
        "step 3: the checkpoint's export" in done["stderr"]
        and "older checkpoints with their exports are kept" in (done["stderr"])
    ), done["stderr"]
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["step_000002", "step_000003"], ckpts
    assert list((out / "checkpoints" / "step_000002" / "lora").glob("*.safetensors"))
    assert (out / "checkpoints" / "step_000003" / "COMPLETE").exists()
    assert not (out / "checkpoints" / "step_000003" / "lora").exists()


def test_exported_files_are_readable_as_the_umask_says(runs) -> None:
    """safetensors writes 0600 whatever the umask; the exported adapter gets what `open()` would give it (the ranks
    inherit this process's umask)."""
    import os

    mask = os.umask(0o022)
    os.umask(mask)
    files = sorted((runs(TINY, *CP2, nproc=2).out / "lora").iterdir())
    assert any(f.suffix == ".safetensors" for f in files), files
    for f in files:
        assert f.stat().st_mode & 0o777 == 0o666 & ~mask, (f, oct(f.stat().st_mode))
