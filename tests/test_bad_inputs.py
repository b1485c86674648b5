"""Bad inputs through the real entry points: every user error is one `error:` line with cause and fix, fast.

Each case runs `accelerate launch ... train/finetune.py` (1 process, a few with 2), `python -m train.prepare` or
`python -m train.estimate` on a broken recipe, path, cache or checkpoint, and asserts:

* the exit code: 2 (a user error); under `accelerate launch` the launcher itself exits 1 (torchrun's ChildFailedError,
  whatever the rank's code), so there the rank's code 2 is read from the launcher's failure summary;
* exactly one `error:` line (argparse's own usage errors read `prog: error:`), holding the expected words;
* no traceback through our code (the launcher's own ChildFailedError traceback names only torch/accelerate frames);
* the time to fail, under TIME_LIMIT_S on this loaded 2-core machine.

`pytest -s tests/test_bad_inputs.py` prints the table (case, exit code, seconds, message). Shared setup, built once:
a tiny wan pipeline + two clips + their cache (train.demo + train.prepare, ~20 s) and a 2-step run with a checkpoint.
The cases run one after another: each launch imports torch and diffusers (seconds of CPU), and the machine has 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TIME_LIMIT_S = 40.0
ERROR_LINE = re.compile(r"^(?:[\w./-]+: )?error: ", re.M)  # ours, or argparse's `prog: error:`
OUR_FRAME = re.compile(r'File "(?:[^"]*/)?train/[^"]*\.py"')  # a traceback frame in our package
TABLE: list[tuple[str, int, float, str]] = []

TINY = "recipes/tiny/wan.yaml"
QUIET = ("logging.wandb_mode=disabled", "logging.progress_bar=false", "train.max_steps=2")


@dataclass
class Case:
    id: str
    entry: str  # train | prepare | estimate
    args: tuple[str, ...]  # after the entry point; {cache}, {pipe}, {media}, {tmp}, {ckpt_run} are filled in
    words: tuple[str, ...]  # expected (case-insensitive) in the one error line
    nproc: int = 1
    recipe: str | None = TINY  # --recipe (None: the case passes its own, or none)
    sets: tuple[str, ...] = ()  # --set overrides
    env: dict[str, str] = field(default_factory=dict)
    launcher: tuple[str, ...] = ()  # extra `accelerate launch` options


def train(id, *sets, words, nproc=1, recipe=TINY, **kw) -> Case:
    base = (*QUIET, "output_dir={tmp}/out") + (("parallel.cp=1",) if nproc == 1 and recipe == TINY else ())
    return Case(id, "train", (), words, nproc=nproc, recipe=recipe, sets=(*base, *sets), **kw)


def prepare(id, *sets, words, recipe="recipes/demo.yaml", **kw) -> Case:
    base = (
        "model.pretrained_path={pipe}",
        "data.source={media}",
        "data.cache_dir={tmp}/cache",
        "logging.progress_bar=false",
    )
    return Case(id, "prepare", (), words, recipe=recipe, sets=(*base, *sets), **kw)


CACHE = ("data.synthetic=null", "data.cache_dir={cache}")  # the tiny wan recipe on the shared tiny wan cache
CASES = [
    # --- the recipe file and --set --------------------------------------------------------------------------------
    train("unknown_key_set", "train.lrr=1", words=("train.lrr", "unknown key", "'lr'")),
    train("unknown_key_file", words=("trian", "unknown key", "'train'"), recipe="{tmp}/typo.yaml"),
    train("wrong_type", "train.max_steps=abc", words=("train.max_steps", "expected int", "'abc'")),
    train("bool_for_int", "train.batch_size=true", words=("train.batch_size", "expected int", "true")),
    train("set_without_value", "train.lr", words=("--set", "expected KEY=VALUE")),
    train("set_bad_yaml", "train.betas=[0.9", words=("train.betas", "not valid YAML")),
    train("set_into_scalar", "train.lr.x=1", words=("train.lr", "has no sub-keys")),
    train("missing_recipe_file", words=("cannot read recipe", "nope.yaml"), recipe="{tmp}/nope.yaml"),
    train("recipe_invalid_yaml", words=("invalid YAML",), recipe="{tmp}/broken.yaml"),
    train("recipe_duplicate_key", words=("duplicate key 'lr'",), recipe="{tmp}/dup.yaml"),
    train("recipe_not_a_mapping", words=("expected a mapping",), recipe="{tmp}/list.yaml"),
    train("recipe_without_family", words=("model.family", "missing required key"), recipe="{tmp}/nofamily.yaml"),
    train("no_recipe_argument", words=("--recipe", "required"), recipe=None),
    train("unknown_family", "model.family=wann", words=("model.family", "did you mean 'wan'")),
    train("bad_literal", "train.mixed_precision=fp16", words=("train.mixed_precision", "expected one of")),
    train("negative_lr", "train.lr=-1", words=("train.lr", "must be > 0")),
    train("lora_rank_0", "finetune.lora_rank=0", words=("finetune.lora_rank", ">= 1")),
    train(
        "export_lora_with_full",
        "finetune.method=full",
        "checkpoint.export=lora",
        words=("checkpoint.export", "finetune.method is full"),
    ),
    train("bad_bucket", "data.buckets=[64x64]", words=("data.buckets[0]", "FRAMESxHEIGHTxWIDTH")),
    train("betas_one_number", "train.betas=[0.9]", words=("train.betas", "two numbers")),
    train("no_weights", "model.init_config=null", words=("pretrained_path", "init_config")),
    train("two_problems_one_line", "train.lr=-1", "train.lrr=1", words=("2 problems", "train.lrr", "train.lr")),
    # --- degrees --------------------------------------------------------------------------------------------------
    train("cp_not_dividing_world", "parallel.cp=3", nproc=2, words=("world size 2", "cp (3)")),
    train("dp_mismatch", "parallel.cp=2", "parallel.dp_shard=2", nproc=2, words=("dp_shard (2)", "world size is 2")),
    train("dp_shard_zero", "parallel.dp_shard=0", words=("parallel.dp_shard", ">= 1 or -1")),
    train("cp_on_one_process", "parallel.cp=2", words=("world size 1", "cp (2)")),
    # --- paths ----------------------------------------------------------------------------------------------------
    train(
        "pretrained_path_missing",
        "model.init_config=null",
        "model.pretrained_path={tmp}/no/such/pipeline",
        words=("model.pretrained_path", "no/such/pipeline", "does not exist"),
    ),
    train(
        "pretrained_path_without_config",
        "model.init_config=null",
        "model.pretrained_path={tmp}",
        words=("model.pretrained_path", "transformer/config.json"),
    ),
    train(
        "pretrained_hub_id_offline",
        "model.init_config=null",
        "model.pretrained_path=Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
        env={"HF_HUB_OFFLINE": "1"},
        words=("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "not a local folder", "hub id"),
    ),
    train(
        "pretrained_hub_id_unknown",
        "model.init_config=null",
        "model.pretrained_path=nosuchorg/nosuchmodel",
        words=("nosuchorg/nosuchmodel", "neither a local folder"),
    ),
    train(
        "cp_plan_missing",
        "parallel.cp=2",
        "model.cp_plan={tmp}/no_plan.yaml",
        nproc=2,
        words=("model.cp_plan", "no_plan.yaml"),
    ),
    train(
        "cp_plan_invalid",
        "parallel.cp=2",
        "model.cp_plan={tmp}/bad_plan.yaml",
        nproc=2,
        words=("bad_plan.yaml", "model_clas", "unknown key"),
    ),
    train("output_dir_is_a_file", "output_dir={tmp}/typo.yaml", words=("output_dir", "is a file")),
    train(
        "accelerate_mixed_precision",
        launcher=("--mixed_precision", "bf16"),
        words=("--mixed_precision bf16", "train.mixed_precision"),
    ),
    # --- model and shapes -----------------------------------------------------------------------------------------
    train(
        "init_config_typo",
        "model.init_config.num_layer=1",
        words=("model.init_config", "'num_layer'", "did you mean 'num_layers'"),
    ),
    train(
        "init_config_typo_cp2",
        "parallel.cp=2",
        "model.init_config.atention_head_dim=8",
        nproc=2,
        words=("model.init_config", "'atention_head_dim'"),
    ),
    train(
        "cp_more_than_tokens",
        "parallel.cp=2",
        "data.synthetic.shapes.latents=[4,1,2,2]",
        nproc=2,
        words=("parallel.cp=2", "1 transformer token"),
    ),
    train(
        "synthetic_shapes_missing_key",
        "data.synthetic.shapes={{latents: [4, 5, 2, 14]}}",
        words=("data.synthetic.shapes", "prompt_embeds"),
    ),
    # --- data and cache -------------------------------------------------------------------------------------------
    train("synthetic_and_cache", "data.cache_dir={cache}", words=("data.synthetic", "data.cache_dir")),
    train("no_data", "data.synthetic=null", words=("data.cache_dir", "data.synthetic")),
    train(
        "cache_dir_missing",
        "data.synthetic=null",
        "data.cache_dir={tmp}/no_cache",
        words=("data.cache_dir", "no_cache", "does not exist"),
    ),
    train(
        "cache_unfinished",
        "data.synthetic=null",
        "data.cache_dir={tmp}/unfinished",
        words=("manifest.json", "did not finish"),
    ),
    train(
        "cache_manifest_not_json",
        "data.synthetic=null",
        "data.cache_dir={tmp}/badjson",
        words=("manifest.json", "not valid JSON"),
    ),
    train(
        "cache_other_family",
        "data.synthetic=null",
        "data.cache_dir={cache}",
        "parallel.cp=1",
        recipe="recipes/tiny/flux.yaml",
        words=("wan", "flux"),
    ),
    train(
        "cache_sample_missing",
        "data.synthetic=null",
        "data.cache_dir={tmp}/nosample",
        words=("000001.safetensors", "missing"),
    ),
    train(
        "cache_sample_truncated", "data.synthetic=null", "data.cache_dir={tmp}/truncated", words=("000000.safetensors",)
    ),
    # --- resume ---------------------------------------------------------------------------------------------------
    Case(
        "resume_changed_lora_rank",
        "train",
        ("--resume",),
        ("finetune.lora_rank",),
        sets=(*QUIET, "parallel.cp=1", "output_dir={ckpt_run}", "finetune.lora_rank=8"),
    ),
    Case(
        "resume_corrupt_only_checkpoint",
        "train",
        ("--resume",),
        ("checkpoint",),
        sets=(*QUIET, "parallel.cp=1", "output_dir={corrupt_run}", "train.max_steps=3"),
    ),
    # --- train.prepare --------------------------------------------------------------------------------------------
    prepare("prepare_unknown_key", "data.sourc=x", words=("data.sourc", "did you mean 'source'")),
    prepare(
        "prepare_source_missing",
        "data.source={tmp}/no_media",
        words=("no_media",),
    ),
    prepare("prepare_malformed_metadata", "data.source={tmp}/badmeta", words=("metadata.jsonl:2", "not valid JSON")),
    prepare(
        "prepare_pretrained_missing",
        "model.pretrained_path={tmp}/no_pipe",
        words=("no_pipe",),
    ),
    # --- train.estimate -------------------------------------------------------------------------------------------
    Case("estimate_unknown_key", "estimate", (), ("train.lrr", "unknown key"), sets=("train.lrr=1",)),
    Case("estimate_bad_gpu_memory", "estimate", ("--gpu-memory", "lots"), ("--gpu-memory", "80GiB")),
]


def _fill(text: str, where: dict[str, Path]) -> str:
    return text.format(**{k: str(v) for k, v in where.items()})


def _command(case: Case, where: dict[str, Path]) -> list[str]:
    args = [_fill(a, where) for a in case.args]
    if case.recipe is not None:
        args += ["--recipe", _fill(case.recipe, where)]
    for s in case.sets:
        args += ["--set", _fill(s, where)]
    if case.entry == "train":
        # the launch scripts' entry: accelerate launch, exiting with the failed rank's code and no launcher traceback
        return [sys.executable, "-m", "train.launch", "--config_file", "configs/accelerate/cpu.yaml",
                "--num_processes", str(case.nproc), *case.launcher, "train/finetune.py", *args]  # fmt: skip
    return [sys.executable, "-m", f"train.{case.entry}", *args]


def _run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", **(env or {})}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _ok(cmd: list[str]) -> None:
    proc = _run(cmd)
    assert proc.returncode == 0, f"setup failed: {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


@pytest.fixture(scope="module")
def where(tmp_path_factory) -> dict[str, Path]:
    """The shared inputs, built once: a tiny wan pipeline, two clips, their cache, broken copies, a checkpoint."""
    tmp = tmp_path_factory.mktemp("bad_inputs")
    pipe, media, cache = tmp / "assets" / "pipe", tmp / "assets" / "media", tmp / "assets" / "cache"
    demo = ["--recipe", "recipes/demo.yaml", f"--set=model.pretrained_path={pipe}", f"--set=data.source={media}",
            f"--set=data.cache_dir={cache}", "--set=logging.progress_bar=false"]  # fmt: skip
    _ok([sys.executable, "-m", "train.demo", *demo, "--clips", "2"])
    _ok([sys.executable, "-m", "train.prepare", *demo])
    (tmp / "typo.yaml").write_text((REPO / TINY).read_text().replace("\ntrain:", "\ntrian:"))
    (tmp / "broken.yaml").write_text("model: [wan\n")
    (tmp / "dup.yaml").write_text("model: {family: wan}\ntrain:\n  lr: 1.0e-3\n  lr: 2.0e-3\n")
    (tmp / "list.yaml").write_text("- model\n")
    (tmp / "nofamily.yaml").write_text("model: {dtype: float32}\n")
    plan = (REPO / "cp_plans" / "wan.yaml").read_text()
    (tmp / "bad_plan.yaml").write_text(plan.replace("model_class:", "model_clas:"))
    (tmp / "unfinished" / "samples").mkdir(parents=True)
    shutil.copytree(cache, tmp / "badjson")
    (tmp / "badjson" / "manifest.json").write_text('{"format": ')
    shutil.copytree(cache, tmp / "nosample")
    (tmp / "nosample" / "samples" / "000001.safetensors").unlink()
    shutil.copytree(cache, tmp / "truncated")
    sample = tmp / "truncated" / "samples" / "000000.safetensors"
    sample.write_bytes(sample.read_bytes()[: sample.stat().st_size // 2])
    shutil.copytree(media, tmp / "badmeta")
    lines = (tmp / "badmeta" / "metadata.jsonl").read_text().splitlines()
    (tmp / "badmeta" / "metadata.jsonl").write_text(
        "\n".join([lines[0], '{"file_name": "x.mp4", "text": ', *lines[2:]])
    )
    # A 2-step LoRA run with a checkpoint at each step (resume cases), and a copy whose only checkpoint is truncated.
    ckpt_run, corrupt_run = tmp / "ckpt_run", tmp / "corrupt_run"
    w = {"tmp": tmp, "pipe": pipe, "media": media, "cache": cache, "ckpt_run": ckpt_run, "corrupt_run": corrupt_run}
    _ok(
        _command(
            train("setup", "checkpoint.every_n_steps=1", "checkpoint.keep_last=1", "output_dir={ckpt_run}", words=()), w
        )
    )
    shutil.copytree(ckpt_run, corrupt_run)
    shards = sorted(p for p in (corrupt_run / "checkpoints").rglob("*") if p.is_file() and p.suffix == ".distcp")
    assert shards, sorted((corrupt_run / "checkpoints").rglob("*"))
    shards[0].write_bytes(shards[0].read_bytes()[: shards[0].stat().st_size // 2])
    return w


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_bad_input_is_one_line(case: Case, where: dict[str, Path]) -> None:
    cmd = _command(case, where)
    t0 = time.perf_counter()
    proc = _run(cmd, case.env)
    seconds = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if ERROR_LINE.match(line)]
    code = proc.returncode
    TABLE.append((case.id, code, seconds, lines[0] if len(lines) == 1 else f"<{len(lines)} error lines>"))
    assert code == 2, f"exit code {code}\n{out[-4000:]}"
    assert len(lines) == 1, f"expected one error line, got {lines}\n{out[-4000:]}"
    # The message: the error line and its indented continuation (several problems in one file, one line each).
    message = re.search(re.escape(lines[0]) + r"(?:\n  .*)*", proc.stderr).group(0)
    missing = [w for w in case.words if w.lower() not in message.lower()]
    assert not missing, f"error message lacks {missing}: {message}"
    assert not OUR_FRAME.search(out), f"a traceback through our code:\n{out[-4000:]}"
    assert "Traceback" not in out, out[-4000:]  # nor the launcher's
    assert seconds < TIME_LIMIT_S, f"{seconds:.1f} s to fail"


def teardown_module() -> None:
    if TABLE:
        print(f"\n{'case':36} {'exit':>4} {'s':>6}  message")
        for case, code, seconds, line in TABLE:
            print(f"{case:36} {code:>4} {seconds:6.1f}  {line[:150]}")
        print(json.dumps({"cases": len(TABLE), "max_s": round(max(t for _, _, t, _ in TABLE), 1)}))
