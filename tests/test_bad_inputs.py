"""Bad inputs: every user error is one `error:` line with cause and fix, exit code 2, fast.

One table of cases (a broken recipe, path, cache, plan, checkpoint, ...), checked two ways:

* every case in-process (`test_message_in_process`): what the entry point calls before the error, called here —
  the trainer's `parse_args` (recipe, `--set`, degrees against `WORLD_SIZE`, paths, model config, tokens), then what
  its `main()` calls in order up to its first step (the dataset and cache and its loss masks, the memory estimate, the
  CP plan file and the pretrained weights as `build_model` reads them, resume's recipe check and checkpoint
  verification) on a 1-rank gloo group; `train.prepare`'s and `train.estimate`'s own `main`. The error must be a
  `UserError` (argparse's usage errors: its exit 2) whose line, as `train.errors.report` prints it, holds the
  expected words, in one line (several problems of one file: indented continuation lines);
* one representative case per way an error is delivered through the real entry point (`test_entry_point`: `python
  -m train.launch ... train/finetune.py`, 1 or 2 processes, the 2-process ones where the error arises after the process
  group exists; `python -m train.prepare`, `python -m train.estimate`): exit code 2 (train.launch exits with the
  rank's code), exactly one `error:` line (argparse's read `prog: error:`) holding the words, no traceback (ours or
  the launcher's), within TIME_LIMIT_S on this loaded 2-core machine. They run two at a time (`entry_runs`), each
  into an output_dir of its own.

`pytest -s tests/test_bad_inputs.py` prints the table (case, how, exit code, seconds, message). Shared setup, built
once in-process: the session's tiny wan pipeline, two clips and their cache (train.demo + train.prepare) and broken
copies; the resume cases use copies of the checkpointed 4-step serial LoRA run that tests/test_finetune.py and
tests/test_resume.py share (`runs`, identical overrides).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.harness import REPO, env, launch_command, one_rank_group

TIME_LIMIT_S = 120.0  # generous for a loaded 2-core machine; measured ~3-25 s each when idle (the table prints them)
ERROR_LINE = re.compile(r"^(?:[\w./-]+: )?error: ", re.M)  # ours, or argparse's `prog: error:`
OUR_FRAME = re.compile(r'File "(?:[^"]*/)?train/[^"]*\.py"')  # a traceback frame in our package
TABLE: list[tuple[str, str, int, float, str]] = []

TINY = "recipes/tiny/wan.yaml"
QUIET = ("logging.wandb_mode=disabled", "logging.progress_bar=false", "train.max_steps=2")
# The serial tiny-wan LoRA run (4 steps, a checkpoint after each, the last 3 kept) shared with tests/test_finetune.py
# and tests/test_resume.py: identical overrides, one run per session.
SERIAL = ("parallel.cp=1", "checkpoint.every_n_steps=1", "checkpoint.keep_last=3")


@dataclass
class Case:
    id: str
    entry: str  # train | prepare | estimate
    args: tuple[str, ...]  # after the entry point; {cache}, {pipe}, {media}, {tmp}, {ckpt_run}, ... are filled in
    words: tuple[str, ...]  # expected (case-insensitive) in the one error line
    nproc: int = 1
    recipe: str | None = TINY  # --recipe (None: the case passes its own, or none)
    sets: tuple[str, ...] = ()  # --set overrides
    env: dict[str, str] = field(default_factory=dict)
    launcher: tuple[str, ...] = ()  # extra `accelerate launch` options
    launch: bool = False  # the representative of its error source through the real entry point
    absent: str | None = None  # a path that must not exist afterwards (what a crafted input would have made)


def trainer(id, *sets, words, nproc=1, recipe=TINY, **kw) -> Case:
    base = (*QUIET, "output_dir={out}") + (("parallel.cp=1",) if nproc == 1 and recipe == TINY else ())
    return Case(id, "train", (), words, nproc=nproc, recipe=recipe, sets=(*base, *sets), **kw)


def preparer(id, *sets, words, recipe="recipes/demo.yaml", **kw) -> Case:
    base = (
        "model.pretrained_path={pipe}",
        "data.source={media}",
        "data.cache_dir={tmp}/cache",
        "logging.progress_bar=false",
    )
    return Case(id, "prepare", (), words, recipe=recipe, sets=(*base, *sets), **kw)


CASES = [
    # --- the recipe file and --set --------------------------------------------------------------------------------
    trainer("unknown_key_set", "train.lrr=1", words=("train.lrr", "unknown key", "'lr'")),
    trainer("unknown_key_file", words=("trian", "unknown key", "'train'"), recipe="{tmp}/typo.yaml"),
    trainer("wrong_type", "train.max_steps=abc", words=("train.max_steps", "expected int", "'abc'")),
    trainer("bool_for_int", "train.batch_size=true", words=("train.batch_size", "expected int", "true")),
    trainer("set_without_value", "train.lr", words=("--set", "expected KEY=VALUE")),
    trainer("set_bad_yaml", "train.betas=[0.9", words=("train.betas", "not valid YAML")),
    trainer("set_into_scalar", "train.lr.x=1", words=("train.lr", "has no sub-keys")),
    trainer("missing_recipe_file", words=("cannot read recipe", "nope.yaml"), recipe="{tmp}/nope.yaml"),
    trainer("recipe_invalid_yaml", words=("invalid YAML",), recipe="{tmp}/broken.yaml"),
    trainer("recipe_duplicate_key", words=("duplicate key 'lr'",), recipe="{tmp}/dup.yaml"),
    trainer("recipe_not_a_mapping", words=("expected a mapping",), recipe="{tmp}/list.yaml"),
    trainer("recipe_without_family", words=("model.family", "missing required key"), recipe="{tmp}/nofamily.yaml"),
    trainer("no_recipe_argument", words=("--recipe", "required"), recipe=None),
    trainer("unknown_family", "model.family=wann", words=("model.family", "did you mean 'wan'")),
    trainer("bad_literal", "train.mixed_precision=fp16", words=("train.mixed_precision", "expected one of")),
    trainer("negative_lr", "train.lr=-1", words=("train.lr", "must be > 0")),
    trainer("lr_not_finite", "train.lr=.inf", words=("--set: train.lr", "must be a finite number, got inf")),
    trainer("lr_absurd", "train.lr=1e38", words=("--set: train.lr", "must be <= 100, got 1e+38")),
    trainer("lora_rank_0", "finetune.lora_rank=0", words=("finetune.lora_rank", ">= 1")),
    trainer(
        "lora_rank_above_width",
        "finetune.lora_rank=64",
        words=("finetune.lora_rank", "set finetune.lora_rank to at most 56"),
    ),
    trainer(
        "master_weights_bf16_fp32_compute",
        "train.master_weights=bf16",
        words=("train.master_weights", "mixed_precision is no", "train.mixed_precision: bf16"),
    ),
    trainer(
        "fp8_base_with_full",
        "finetune.method=full",
        "finetune.fp8_base=true",
        "checkpoint.export=auto",
        words=("finetune.fp8_base", "FROZEN weights in float8", "method: lora with fp8_base"),
    ),
    trainer(
        "fp8_base_full_export",
        "finetune.fp8_base=true",
        "checkpoint.export=full",
        words=("checkpoint.export", "float8-rounded base", "use export lora"),
    ),
    trainer(
        "cpu_offload_without_fsdp",
        "parallel.cpu_offload=true",
        "parallel.fsdp=false",
        words=("parallel.cpu_offload", "fsdp is false", "parallel.fsdp: true"),
    ),
    trainer(
        "export_lora_with_full",
        "finetune.method=full",
        "checkpoint.export=lora",
        words=("checkpoint.export", "finetune.method is full"),
    ),
    trainer("bad_bucket", "data.buckets=[64x64]", words=("data.buckets[0]", "FRAMESxHEIGHTxWIDTH")),
    trainer("betas_one_number", "train.betas=[0.9]", words=("train.betas", "two numbers")),
    trainer("no_weights", "model.init_config=null", words=("pretrained_path", "init_config")),
    trainer(
        "lora_target_typo",
        "finetune.lora_targets=[to_q,to_kk]",
        words=("'to_kk' (did you mean 'to_k'?)", "no module of WanTransformer3DModel", "to_out.0"),
    ),
    trainer(
        "output_dir_dangling_link",
        "output_dir={tmp}/dangling/run",
        words=("dangling", "symbolic link", "does not exist"),
    ),
    trainer(
        "cp_plan_other_class",  # it aborted in the first CP collective (SIGABRT)
        "parallel.cp=2",
        "model.cp_plan=cp_plans/flux.yaml",
        words=("model.cp_plan", "plan for FluxTransformer2DModel", "WanTransformer3DModel"),
        nproc=2,
    ),
    # --- the pretrained weights: the sharded start's check as it loads, the whole-model start's in parse_args -------
    trainer(
        "pretrained_truncated_whole_model",
        "model.pretrained_path={tmp}/pipe_truncated",
        "model.init_config=null",
        "model.sharded_load=false",
        words=("diffusion_pytorch_model.safetensors is truncated", "download or copy it again"),
    ),
    *(
        trainer(
            f"pretrained_{kind}", f"model.pretrained_path={{tmp}}/pipe_{kind}", "model.init_config=null", words=words
        )  # fmt: skip
        for kind, words in (
            ("no_weights", ("no weights (.safetensors or .bin)", "pipe_no_weights/transformer", "config.json")),
            ("truncated", ("diffusion_pytorch_model.safetensors is truncated", "download or copy it again")),
            ("other_shapes", ("with shape (32, 56)", "config.json builds has (64, 56)", "different models")),
        )
    ),
    trainer(
        "validation_frames_rounded",  # the pipeline rounded 8 to 9 frames with a logged warning
        "model.pretrained_path={pipe}",
        "validation={{prompts: [{{prompt: a}}], num_frames: 8}}",  # braces doubled: the args are format strings
        words=("validation.num_frames 8", "4k+1", "use 5 or 9", "round it silently"),
    ),
    trainer(
        "two_problems_one_line",
        "train.lr=-1",
        "train.lrr=1",
        words=("2 problems", "train.lrr", "train.lr"),
        launch=True,  # the recipe/--set schema (train.config's preflight, before torch is imported)
    ),
    # --- degrees --------------------------------------------------------------------------------------------------
    trainer("cp_not_dividing_world", "parallel.cp=3", nproc=2, words=("world size 2", "cp (3)"), launch=True),
    trainer("dp_mismatch", "parallel.cp=2", "parallel.dp_shard=2", nproc=2, words=("dp_shard (2)", "world size is 2")),
    trainer("dp_shard_zero", "parallel.dp_shard=0", words=("parallel.dp_shard", ">= 1 or -1")),
    trainer("cp_on_one_process", "parallel.cp=2", words=("world size 1", "cp (2)")),
    # --- paths ----------------------------------------------------------------------------------------------------
    trainer(
        "pretrained_path_missing",
        "model.init_config=null",
        "model.pretrained_path={tmp}/no/such/pipeline",
        words=("model.pretrained_path", "no/such/pipeline", "does not exist"),
    ),
    trainer(
        "pretrained_path_without_config",
        "model.init_config=null",
        "model.pretrained_path={tmp}",
        words=("model.pretrained_path", "transformer/config.json"),
    ),
    trainer(
        "pretrained_hub_id_offline",
        "model.init_config=null",
        "model.pretrained_path=Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
        env={"HF_HUB_OFFLINE": "1"},
        words=("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "not a local folder", "hub id"),
    ),
    trainer(
        "pretrained_hub_id_unknown",
        "model.init_config=null",
        "model.pretrained_path=nosuchorg/nosuchmodel",
        words=("nosuchorg/nosuchmodel", "neither a local folder"),
    ),
    trainer(
        "cp_plan_missing",
        "parallel.cp=2",
        "model.cp_plan={tmp}/no_plan.yaml",
        nproc=2,
        words=("model.cp_plan", "no_plan.yaml"),
    ),
    trainer(
        "cp_plan_invalid",
        "parallel.cp=2",
        "model.cp_plan={tmp}/bad_plan.yaml",
        nproc=2,
        words=("bad_plan.yaml", "model_clas", "unknown key"),
    ),
    trainer("output_dir_is_a_file", "output_dir={tmp}/typo.yaml", words=("output_dir", "is a file")),
    trainer("output_dir_empty", "output_dir=''", words=("output_dir", "is empty", "current directory")),
    trainer(
        "accelerate_mixed_precision",
        launcher=("--mixed_precision", "bf16"),
        words=("--mixed_precision bf16", "train.mixed_precision"),
        launch=True,  # an `accelerate launch` option the recipe owns
    ),
    # --- the experiment tracker: online wandb without a login or a server (train/tracking.py, in parse_args) -------
    trainer(
        "wandb_online_without_login",  # took 19 s, then a traceback on every rank
        "logging.wandb_mode=online",  # after QUIET's wandb_mode=disabled: the later --set wins
        env={
            "WANDB_API_KEY": "",
            "NETRC": "/nonexistent/.netrc",
            "WANDB_BASE_URL": "",
            "WANDB_CONFIG_DIR": "/nonexistent",
        },
        words=("no wandb login was found", "WANDB_API_KEY", "wandb login", "logging.wandb_mode: offline"),
    ),
    trainer(
        "wandb_online_server_unreachable",  # took 100 s without a network, then a traceback
        "logging.wandb_mode=online",
        env={"WANDB_API_KEY": "k" * 40, "WANDB_BASE_URL": "http://127.0.0.1:9"},  # nothing listens on port 9
        words=("wandb server http://127.0.0.1:9", "cannot be reached", "connection refused", "wandb_mode: offline"),
    ),
    # --- model and shapes -----------------------------------------------------------------------------------------
    trainer(
        "init_config_typo",
        "model.init_config.num_layer=1",
        words=("model.init_config", "'num_layer'", "did you mean 'num_layers'"),
    ),
    trainer(
        "init_config_typo_cp2",
        "parallel.cp=2",
        "model.init_config.atention_head_dim=8",
        nproc=2,
        words=("model.init_config", "'atention_head_dim'"),
    ),
    trainer(
        "cp_more_than_tokens",
        "parallel.cp=2",
        "data.synthetic.shapes.latents=[4,1,2,2]",
        nproc=2,
        words=("parallel.cp=2", "1 transformer token"),
    ),
    trainer(
        "synthetic_shapes_missing_key",
        "data.synthetic.shapes={{latents: [4, 5, 2, 14]}}",
        words=("data.synthetic.shapes", "prompt_embeds"),
    ),
    # --- data and cache -------------------------------------------------------------------------------------------
    trainer("synthetic_and_cache", "data.cache_dir={cache}", words=("data.synthetic", "data.cache_dir")),
    trainer("no_data", "data.synthetic=null", words=("data.cache_dir", "data.synthetic")),
    trainer(
        "cache_dir_missing",
        "data.synthetic=null",
        "data.cache_dir={tmp}/no_cache",
        words=("data.cache_dir", "no_cache", "does not exist"),
    ),
    trainer(
        "cache_unfinished",
        "data.synthetic=null",
        "data.cache_dir={tmp}/unfinished",
        words=("manifest.json", "did not finish"),
    ),
    trainer(
        "cache_manifest_not_json",
        "data.synthetic=null",
        "data.cache_dir={tmp}/badjson",
        words=("manifest.json", "not valid JSON"),
    ),
    trainer(
        "cache_other_family",
        "data.synthetic=null",
        "data.cache_dir={cache}",
        "parallel.cp=1",
        recipe="recipes/tiny/flux.yaml",
        words=("wan", "flux"),
    ),
    trainer(
        "cache_sample_missing",
        "data.synthetic=null",
        "data.cache_dir={tmp}/nosample",
        words=("000001.safetensors", "missing"),
    ),
    trainer(
        "cache_sample_truncated",
        "data.synthetic=null",
        "data.cache_dir={tmp}/truncated",
        nproc=2,
        words=("000000.safetensors",),
        # The delivery of every error raised on 2 ranks after the process group exists (the lock taken, the
        # watchdog running), printed once: the cache here; the plan file, model config, hub id, token count and the
        # startup memory refusal are raised from the same state, their messages test_message_in_process's.
        launch=True,
    ),
    # --- the loop's features: what would train the wrong data, or export the wrong weights, silently --------------
    trainer("ema_start_after_the_last_step", "ema={{start_step: 3}}", words=("ema.start_step", "is 3", "max_steps 2")),
    trainer("seed_overflows", "train.seed=18000000000000", words=("train.seed", "must be < 4294967296")),
    trainer(
        "held_out_cache_is_the_training_cache",
        "data.synthetic=null",
        "data.cache_dir={cache}",
        "validation_loss={{cache_dir: '{tmp}/assets/../assets/cache'}}",  # another spelling of the same folder
        words=("validation_loss.cache_dir", "is the training cache", "trained samples"),
    ),
    trainer(
        "held_out_fraction_leaves_0_batches",  # said "2 samples ... make 0 batches", the held-out one unnamed
        "data.synthetic=null",
        "data.cache_dir={cache}",
        "validation_loss={{fraction: 0.5}}",  # 1 of the cache's 2 clips held out: 1 left, short of a batch of 2
        words=("make 0 batches of 2", "validation_loss.fraction held out 1 of them", "lower validation_loss.fraction"),
    ),
    trainer(
        "held_out_cache_fewer_tokens_than_cp",
        "parallel.cp=2",
        "validation_loss={{cache_dir: '{tmp}/held_one_token'}}",
        nproc=2,
        words=("validation_loss.cache_dir", "held_one_token", "parallel.cp=2", "1 transformer token"),
    ),
    trainer(
        "held_out_cache_other_text_width",
        "validation_loss={{cache_dir: '{tmp}/held_other_width'}}",
        words=("validation_loss.cache_dir", "prompt_embeds", "[7, 32]", "another width"),
    ),
    trainer(
        "loss_masks_all_black",
        "data.synthetic=null",
        "data.cache_dir={tmp}/all_black_masks",
        words=("every sample's loss mask is all black", "data.mask_column"),
    ),
    # --- resume ---------------------------------------------------------------------------------------------------
    Case(
        "resume_changed_model_and_lr",  # a checkpoint resumed onto fewer layers once dropped its weights silently
        "train",
        ("--resume",),
        ("model.init_config", "train.lr"),
        sets=(*SERIAL, "output_dir={ckpt_run}", "model.init_config.num_layers=1", "train.lr=0.01"),
        launch=True,
    ),
    Case(
        "resume_changed_lora_rank",
        "train",
        ("--resume",),
        ("finetune.lora_rank",),
        sets=(*SERIAL, "output_dir={ckpt_run}", "finetune.lora_rank=8"),
    ),
    Case(
        "resume_damaged_metrics_line_rank_0",
        "train",
        ("--resume",),
        ("metrics.jsonl, line 2: not a metrics line", "restore it, or delete that line"),
        sets=(*SERIAL, "output_dir={damaged_metrics_run}", "parallel.cp=2"),
        nproc=2,
        # Raised on rank 0 alone (it owns metrics.jsonl) while rank 1 is in the next collective: rank 1 gets gloo's
        # "connection closed" and exits quietly (train/errors.py `peer_reported`): one line, no traceback.
        launch=True,
    ),
    Case(
        "resume_changed_held_out_split",  # samples trained so far would be "held out" (or held-out ones trained)
        "train",
        ("--resume",),
        ("the held-out split: none -> validation_loss.fraction 0.5", "decides which samples train"),
        sets=(*SERIAL, "output_dir={ckpt_run}", "validation_loss={{fraction: 0.5}}"),
    ),
    Case(
        "resume_corrupt_only_checkpoint",
        "train",
        ("--resume",),
        ("checkpoint", "verifies"),
        sets=(*SERIAL, "output_dir={corrupt_run}"),
    ),
    # --- train.prepare --------------------------------------------------------------------------------------------
    preparer("prepare_unknown_key", "data.sourc=x", words=("data.sourc", "did you mean 'source'")),
    preparer("prepare_source_missing", "data.source={tmp}/no_media", words=("no_media",)),
    preparer(
        "prepare_pickled_text_encoder",  # torch.load(weights_only=True)'s UnpicklingError traceback
        "model.pretrained_path={tmp}/pipe_pickled",
        "data.cache_dir={tmp}/cache_pickled",  # its own: prepare records its settings there before loading
        words=("pickled weights file", "refused (it names posix.system)", "text_encoder/pytorch_model.bin"),
        absent="{tmp}/pickle_ran",
    ),
    preparer(
        "prepare_malformed_metadata",
        "data.source={tmp}/badmeta",
        words=("metadata.jsonl:2", "not valid JSON"),
        launch=True,
    ),
    preparer("prepare_pretrained_missing", "model.pretrained_path={tmp}/no_pipe", words=("no_pipe",)),
    preparer(  # chmod 0555 (refused by its mode even for root): said before loading, with what the cache keeps
        "prepare_cache_dir_read_only",
        "data.cache_dir={tmp}/ro_cache",
        words=("ro_cache is read-only", "non-writable folder", "2 of 2 samples are complete", "chmod u+w"),
    ),
    preparer(
        "prepare_cache_dir_read_only_parent",
        "data.cache_dir={tmp}/ro_parent/cache",
        words=("is read-only", "cannot write in", "ro_parent;", "0 of 2 samples", "writable folder"),
    ),
    # --- train.estimate: the CLI, and the trainer's startup check on 2 ranks (after the process group exists) -------
    Case("estimate_unknown_key", "estimate", (), ("train.lrr", "unknown key"), sets=("train.lrr=1",)),
    Case("estimate_bad_gpu_memory", "estimate", ("--gpu-memory", "lots"), ("--gpu-memory", "80GiB"), launch=True),
    trainer(
        "startup_memory_refused",
        "parallel.device_memory_gib=0.0001",
        nproc=2,
        words=("predicted peak per rank", "parallel.memory_check: warn"),
    ),
]
RESUME = {
    "{ckpt_run}",
    "{corrupt_run}",
    "{damaged_metrics_run}",
}  # cases that need the shared checkpointed run (a launch: slow tier)


def _needs_run(case: Case) -> bool:
    return any(k in s for s in case.sets for k in RESUME)


def _resumed(case: Case, where: dict[str, Path]) -> Path:
    """The checkpointed run a resume case resumes (its output_dir)."""
    return next(where[k.strip("{}")] for k in RESUME if any(k in s for s in case.sets))


def _fill(text: str, where: dict[str, Path]) -> str:
    return text.format(**{k: str(v) for k, v in where.items()})


def _argv(case: Case, where: dict[str, Path]) -> list[str]:
    """The entry point's own arguments (after the script or module)."""
    args = [_fill(a, where) for a in case.args]
    if case.recipe is not None:
        args += ["--recipe", _fill(case.recipe, where)]
    for s in case.sets:
        args += ["--set", _fill(s, where)]
    return args


class _Shell:
    """Unpickles into a shell command (what a crafted weights file does)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        import os

        return os.system, (self.command,)


@pytest.fixture(scope="module")
def where(tmp_path_factory, tiny_pipeline) -> dict[str, Path]:
    """The shared inputs, built once in this process: the session's tiny wan pipeline, two clips, their cache, broken
    copies."""
    import torch

    from train import demo
    from train import prepare as prep

    tmp = tmp_path_factory.mktemp("bad_inputs")
    pipe, media, cache = tiny_pipeline("wan"), tmp / "assets" / "media", tmp / "assets" / "cache"
    assets = ["--recipe", "recipes/demo.yaml", f"--set=model.pretrained_path={pipe}", f"--set=data.source={media}",
              f"--set=data.cache_dir={cache}", "--set=logging.progress_bar=false"]  # fmt: skip
    demo.main([*assets, "--clips", "2"])
    prep.main(assets)
    (tmp / "typo.yaml").write_text((REPO / TINY).read_text().replace("\ntrain:", "\ntrian:"))
    (tmp / "broken.yaml").write_text("model: [wan\n")
    (tmp / "dup.yaml").write_text("model: {family: wan}\ntrain:\n  lr: 1.0e-3\n  lr: 2.0e-3\n")
    (tmp / "list.yaml").write_text("- model\n")
    (tmp / "nofamily.yaml").write_text("model: {dtype: float32}\n")
    plan = (REPO / "cp_plans" / "wan.yaml").read_text()
    (tmp / "bad_plan.yaml").write_text(plan.replace("model_class:", "model_clas:"))
    (tmp / "dangling").symlink_to(tmp / "unmounted_volume")  # an output_dir under a link to nothing
    for kind in ("no_weights", "truncated", "other_shapes"):  # the pipeline's transformer, broken three ways
        shutil.copytree(pipe / "transformer", tmp / f"pipe_{kind}" / "transformer")
    (weights,) = (tmp / "pipe_no_weights" / "transformer").glob("*.safetensors")
    weights.unlink()
    (weights,) = (tmp / "pipe_truncated" / "transformer").glob("*.safetensors")
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    shutil.copytree(pipe, tmp / "pipe_pickled")  # its text encoder as a pickle naming os.system (never run)
    encoder = tmp / "pipe_pickled" / "text_encoder"
    (encoder / "model.safetensors").unlink()
    torch.save({"weight": _Shell(f"touch {tmp}/pickle_ran")}, encoder / "pytorch_model.bin")
    config = tmp / "pipe_other_shapes" / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "ffn_dim": 64}))  # the weights' is 32
    for name, key, shape in (("held_one_token", "latents", [4, 1, 2, 2]), ("held_other_width", "prompt_embeds",
                                                                             [7, 32])):  # fmt: skip
        shutil.copytree(cache, tmp / name)  # a held-out cache: one token per sample, or another text encoder's width
        manifest = json.loads((tmp / name / "manifest.json").read_text())
        for tensors in manifest["tensors"].values():
            tensors[key]["shape"] = shape
        (tmp / name / "manifest.json").write_text(json.dumps(manifest))
    shutil.copytree(cache, tmp / "all_black_masks")  # as train.prepare records a mask_column's black masks
    manifest = json.loads((tmp / "all_black_masks" / "manifest.json").read_text())
    manifest["samples"] = [{**s, "mask_mean": 0.0} for s in manifest["samples"]]
    (tmp / "all_black_masks" / "manifest.json").write_text(json.dumps(manifest))
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
    shutil.copytree(cache, tmp / "ro_cache")  # a finished cache made read-only, and a cache_dir under such a folder
    (tmp / "ro_cache").chmod(0o555)
    (tmp / "ro_parent").mkdir()
    (tmp / "ro_parent").chmod(0o555)
    return {"tmp": tmp, "pipe": pipe, "media": media, "cache": cache, "out": tmp / "out"}


def _with_checkpoints(case: Case, where: dict[str, Path], request: pytest.FixtureRequest) -> dict[str, Path]:
    """`where` plus, for a resume case, copies of the shared checkpointed run: as it is, and with only its newest
    checkpoint, one of whose shards is truncated."""
    if not _needs_run(case):
        return where
    key = f"checkpointed:{case.id}"
    root = where["tmp"] / key.replace(":", "_")
    if not root.exists():
        run = request.getfixturevalue("runs")(TINY, *SERIAL)
        ckpt_run, corrupt_run, damaged = root / "ckpt_run", root / "corrupt_run", root / "damaged_metrics_run"
        shutil.copytree(run.out, ckpt_run)
        shutil.copytree(run.out, corrupt_run)
        shutil.copytree(run.out, damaged)
        lines = (damaged / "metrics.jsonl").read_text().splitlines(keepends=True)
        (damaged / "metrics.jsonl").write_text("".join([lines[0], '{"step": 2, "lo\n', *lines[2:]]))
        *older, newest = sorted((corrupt_run / "checkpoints").glob("step_*"))
        for path in older:
            shutil.rmtree(path)
        shards = sorted(newest.rglob("*.distcp"))
        assert shards, sorted(newest.rglob("*"))
        shards[0].write_bytes(shards[0].read_bytes()[: shards[0].stat().st_size // 2])
    return {**where, **{name: root / name for name in ("ckpt_run", "corrupt_run", "damaged_metrics_run")}}


# ------------------------------------------------------------------------------------------------------ in-process


def _trainer_error(argv: list[str], world: int, tmp: Path) -> BaseException:
    """What train/finetune.py calls before its first step, in its order, until one raises: `parse_args` (what the
    entry point's `preflight` checks, and the model's config and tokens), then main()'s data (`build_dataset`,
    `make_batches` without the held-out split, `check_text_lengths`) and memory check (`startup_check`), the CP plan
    file (`load_plan_file`, as CP is enabled), the pretrained weights' folder and files (`pretrained_folder`,
    `check_weights`) and the LoRA targets (`check_lora_targets`) as build_model reads them, and resume's recipe check
    (`plan_resume` against the newest checkpoint's `read_trainer_state`), data check (`resume_notes`), checkpoint
    verification (`restore`) and its metrics file (`truncate_after`'s `read_metrics`, rank 0's)."""
    import torch

    from train.checkpoint import complete_checkpoints, read_trainer_state, restore, verify_checkpoint
    from train.config import recipe_to_dict
    from train.cp.plans import load_plan_file
    from train.data.batches import build_dataset, check_masks, check_text_lengths, make_batches
    from train.estimate import startup_check
    from train.finetune import parse_args, token_budget
    from train.heldout import split
    from train.modeling import check_lora_targets, family_spec, meta_transformer, pretrained_folder
    from train.models import cache_reads
    from train.report import read_metrics
    from train.resume import plan_resume

    try:
        recipe, args = parse_args(argv)
        spec, m = family_spec(recipe.model), recipe.model
        dataset = build_dataset(recipe, spec, cache_reads(spec.name))
        held = recipe.validation_loss  # main's batches skip HeldOutLoss.of's split of the training data
        exclude = split(len(dataset), held.fraction, recipe.train.seed) if held and held.cache_dir is None else ()
        dp_replicate, dp_shard, _ = recipe.parallel.resolve(world)
        make_batches(dataset, recipe, 0, dp_replicate * dp_shard, torch.device("cpu"), exclude=frozenset(exclude),
                     tokens_of=token_budget(recipe, spec, dataset))  # fmt: skip
        check_text_lengths(dataset, spec, recipe)
        check_masks(dataset)
        with one_rank_group(tmp):
            startup_check(recipe, world, torch.device("cpu"))
            if recipe.parallel.cp > 1 and m.cp_plan is not None:
                load_plan_file(m.cp_plan)
            if m.init_config is None and m.sharded_load and recipe.parallel.fsdp:
                pretrained_folder(m)
            if recipe.finetune.method == "lora":  # build_model's LoRA targets, on the transformer built on meta
                check_lora_targets(meta_transformer(m, spec), list(recipe.finetune.lora_targets or spec.lora_targets))
            found = complete_checkpoints(recipe.output_dir) if args.resume else []
            if found:
                saved = read_trainer_state(found[-1])
                dp_replicate, dp_shard, cp = recipe.parallel.resolve(world)
                plan_resume(saved["recipe"], recipe_to_dict(recipe), reset_lr_schedule=args.reset_lr_schedule,
                            saved_layout=saved["layout"], layout={"dp_replicate": dp_replicate, "dp_shard": dp_shard,
                            "cp": cp}, checkpoint=str(found[-1]))  # fmt: skip
                make_batches(dataset, recipe, 0, 1, torch.device("cpu")).resume_notes(saved["data"], saved["step"])
                if all(verify_checkpoint(path) for path in found):  # none verifies: restore's UserError (no load)
                    restore(recipe.output_dir, None)
                if (Path(recipe.output_dir) / "metrics.jsonl").exists():  # MetricsLogger.truncate_after (rank 0)
                    read_metrics(Path(recipe.output_dir) / "metrics.jsonl")
    except (ValueError, SystemExit) as e:  # UserError is a ValueError; argparse's usage error exits
        return e
    raise AssertionError(f"no error from {argv}")


def _in_process(case: Case, where: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> BaseException:
    argv = _argv(case, where)
    for k, v in case.env.items():
        monkeypatch.setenv(k, v)
    if case.env.get("HF_HUB_OFFLINE") == "1":  # huggingface_hub reads it at import
        import huggingface_hub.constants

        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    if case.entry == "train":
        monkeypatch.setenv("WORLD_SIZE", str(case.nproc))  # as the launcher sets it for each rank
        if "--mixed_precision" in case.launcher:  # what `accelerate launch --mixed_precision X` exports to its ranks
            precision = case.launcher[case.launcher.index("--mixed_precision") + 1]
            monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", precision)
        return _trainer_error(argv, case.nproc, where["tmp"])
    from train import estimate, prepare

    try:
        (prepare.main if case.entry == "prepare" else estimate.main)(argv)
    except (ValueError, SystemExit) as e:  # prepare reports its own line and exits 2; estimate's __main__ prints it
        return e
    raise AssertionError(f"no error from {case.entry} {argv}")


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c.id, marks=[pytest.mark.slow] if _needs_run(c) else []) for c in CASES]
)
def test_message_in_process(
    case: Case, where: dict[str, Path], monkeypatch, capsys, request: pytest.FixtureRequest
) -> None:
    """The case's error in this process: a UserError (or argparse's exit 2), printed by `train.errors.report` as one
    `error:` line (continuation lines indented) holding the words."""
    from train.errors import UserError, report

    paths = _with_checkpoints(case, where, request)
    capsys.readouterr()
    t0 = time.perf_counter()
    error = _in_process(case, paths, monkeypatch)
    seconds = time.perf_counter() - t0
    if isinstance(error, SystemExit):  # argparse (or train.prepare, which reported the UserError itself)
        code, err = error.code, capsys.readouterr().err
    else:
        assert isinstance(error, UserError) or case.entry == "estimate", f"not a UserError: {error!r}"
        code = report(error if isinstance(error, UserError) else UserError(str(error)), rank=0)
        err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if ERROR_LINE.match(line)]
    TABLE.append((case.id, "in-process", code, seconds, lines[0] if len(lines) == 1 else f"<{len(lines)} lines>"))
    assert code == 2, (code, err[-3000:])
    assert len(lines) == 1, err[-3000:]
    message = re.search(re.escape(lines[0]) + r"(?:\n  .*)*", err).group(0)
    missing = [w for w in case.words if w.lower() not in message.lower()]
    assert not missing, f"error message lacks {missing}: {message}"
    assert case.absent is None or not Path(_fill(case.absent, paths)).exists(), f"{case.absent} exists"


# --------------------------------------------------------------------------------------------- through the entry point


def _command(case: Case, where: dict[str, Path]) -> list[str]:
    if case.entry != "train":
        return [sys.executable, "-m", f"train.{case.entry}", *_argv(case, where)]
    # train.launch (what launch/*.sh run) through the harness's command line; accelerate's own options before the script
    sets, args = [_fill(s, where) for s in case.sets], [_fill(a, where) for a in case.args]
    cmd = launch_command(None, _fill(case.recipe, where), *sets, nproc=case.nproc, extra=args)
    script = cmd.index("train/finetune.py")
    return [*cmd[:script], *case.launcher, *cmd[script:]]


LAUNCHED = [c for c in CASES if c.launch]
# Two entry points at a time, the longest (2-process) first: each is mostly one process importing, one core of the two.
AT_ONCE = 2


@pytest.fixture(scope="module")
def entry_runs(where: dict[str, Path], request: pytest.FixtureRequest) -> dict[str, tuple]:
    """The selected `test_entry_point` cases through their entry points, AT_ONCE at a time, each into an output_dir
    of its own: case id -> (the finished process, seconds, the checkpointed run's metrics before it, its paths)."""
    ids = {item.callspec.params["case"].id for item in request.session.items
           if item.module is request.module and item.originalname == "test_entry_point"}  # fmt: skip
    cases = sorted((c for c in LAUNCHED if c.id in ids), key=lambda c: -c.nproc)
    paths = {c.id: {**_with_checkpoints(c, where, request), "out": where["tmp"] / "out" / c.id} for c in cases}
    before = {c.id: (_resumed(c, paths[c.id]) / "metrics.jsonl").read_text() if _needs_run(c) else None
              for c in cases}  # fmt: skip

    def launch(case: Case) -> tuple[subprocess.CompletedProcess, float]:
        t0 = time.perf_counter()
        proc = subprocess.run(_command(case, paths[case.id]), cwd=REPO, env=env(**case.env), capture_output=True,
                              text=True, timeout=600)  # fmt: skip
        return proc, time.perf_counter() - t0

    with ThreadPoolExecutor(AT_ONCE) as pool:
        done = dict(zip([c.id for c in cases], pool.map(launch, cases), strict=True))
    return {i: (*done[i], before[i], paths[i]) for i in done}


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in LAUNCHED])
def test_entry_point(case: Case, entry_runs: dict[str, tuple], launcher) -> None:
    proc, seconds, before, paths = entry_runs[case.id]
    out = proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if ERROR_LINE.match(line)]
    code = proc.returncode
    shown = lines[0] if len(lines) == 1 else f"<{len(lines)} error lines>"
    TABLE.append((case.id, f"launched ×{case.nproc}", code, seconds, shown))
    assert code == 2, f"exit code {code}\n{out[-4000:]}"
    assert len(lines) == 1, f"expected one error line, got {lines}\n{out[-4000:]}"
    # The message: the error line and its indented continuation (several problems in one file, one line each).
    message = re.search(re.escape(lines[0]) + r"(?:\n  .*)*", proc.stderr).group(0)
    missing = [w for w in case.words if w.lower() not in message.lower()]
    assert not missing, f"error message lacks {missing}: {message}"
    assert not OUR_FRAME.search(out), f"a traceback through our code:\n{out[-4000:]}"
    assert "Traceback" not in out, out[-4000:]  # nor the launcher's
    assert seconds < TIME_LIMIT_S, f"{seconds:.1f} s to fail"
    if before is not None:  # a refused resume leaves the run as it was
        assert (_resumed(case, paths) / "metrics.jsonl").read_text() == before


def teardown_module() -> None:
    if TABLE:
        print(f"\n{'case':36} {'how':12} {'exit':>4} {'s':>6}  message")
        for case, how, code, seconds, line in TABLE:
            print(f"{case:36} {how:12} {code:>4} {seconds:6.1f}  {line[:150]}")
        launched = [t for _, how, _, t, _ in TABLE if how.startswith("launched")]
        print(json.dumps({"cases": len({c for c, *_ in TABLE}), "launched": len(launched),
                          "max_launched_s": round(max(launched, default=0.0), 1)}))  # fmt: skip
