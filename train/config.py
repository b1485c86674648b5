"""Typed training recipes: pydantic models loaded from YAML, overridden with `--set a.b=c`.

The models below are the schema, and the one place each setting is declared, defaulted and documented (the string
literal right under a field is its documentation; pydantic keeps it as the field's description). Nothing else
re-declares it: loading, `--set` overrides, `--list-keys`, saving, the wandb config, `train.prepare` and the JSON
Schema (`recipes/schema.json`, which editors use to check recipes) all come from these models.

    recipe = load_recipe("recipes/tiny/flux.yaml", ["train.lr=1e-4", "parallel.cp=2", "finetune.lora_targets=[to_q]"])
    python -m train.config --schema          # regenerate recipes/schema.json after changing a field
    python -m train.config --list-keys       # every key with its type, default and docs

Loading is strict (the engine, shared with the CP plan files, is train/schema.py): `int` takes ints only, not `true`;
`float` takes ints and floats; `Literal`s must be one of their values; `model.family` must be a family found under
train/models/. Unknown keys are errors naming the closest valid key. All problems are collected and raised together
as one `RecipeError` (a `UserError`, train/errors.py), one line each: `<file>: <dotted.path>: <problem>`.
"""

from __future__ import annotations

import argparse
import json
import os
import pkgutil
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, Field, model_validator

from train.errors import UserError
from train.schema import (
    SchemaError,
    Section,
    _is_union,
    annotation_of,
    doc,
    dump_yaml,
    json_schema,
    load_yaml,
    report,
    show,
    suggest,
    suggest_key,
    type_name,
    validate,
)

__all__ = [
    "SCHEMA_PATH",
    "CheckpointConfig",
    "DataConfig",
    "DatasetConfig",
    "FinetuneConfig",
    "LoggingConfig",
    "ModelConfig",
    "ParallelConfig",
    "PreservationConfig",
    "Recipe",
    "RecipeError",
    "SyntheticData",
    "TrainConfig",
    "ValidationConfig",
    "ValidationPrompt",
    "add_recipe_args",
    "load_recipe",
    "recipe_from_args",
    "recipe_from_dict",
    "recipe_help",
    "recipe_json_schema",
    "recipe_to_dict",
    "save_recipe",
]

SCHEMA_PATH: Path = Path(__file__).resolve().parents[1] / "recipes" / "schema.json"


class RecipeError(SchemaError):
    """Invalid recipe or `--set` override; `errors` holds one `<source>: <dotted.path>: <problem>` line per problem."""

    what = "the recipe"


# ----------------------------------------------------------------------------------------------------- value types


def _family_names() -> tuple[str, ...]:
    """The family packages under train/models/, by the rule `train.models.family_names` states, found without
    importing that package (it imports torch, diffusers and every family: seconds before a recipe error could show)."""
    found = pkgutil.iter_modules([str(Path(__file__).resolve().parent / "models")])
    return tuple(sorted(m.name for m in found if m.ispkg and not m.name.startswith("_")))


def _known_family(name: str) -> str:
    names = _family_names()
    if name not in names:
        known = ", ".join(repr(n) for n in names)
        raise ValueError(
            f"expected one of {known} (the families in train/models/), got {show(name)}{suggest(name, names)}"
        )
    return name


def _family_enum(schema: dict[str, Any]) -> None:
    schema["enum"] = list(_family_names())  # the JSON Schema lists the families found when it was generated


_BUCKET = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*[xX]\s*(\d+)\s*$")


def _bucket(text: str) -> str:
    match = _BUCKET.match(text)
    if not match:
        raise ValueError(f"bucket {text!r} is not FRAMESxHEIGHTxWIDTH (e.g. 17x480x832, 1x1024x1024 for images)")
    return "x".join(str(int(n)) for n in match.groups())


def _betas(betas: list[float]) -> list[float]:
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise ValueError(f"must be two numbers in [0, 1), got {betas}")
    return betas


def _folder(path: str) -> str:
    if not path.strip():
        raise ValueError("is empty: the run would write its checkpoints, metrics and exports into the current "
                         "directory; name a folder")  # fmt: skip
    return path


def _dp_shard(n: int) -> int:
    if n < 1 and n != -1:
        raise ValueError(f"must be >= 1 or -1 (the rest of the world size), got {n}")
    return n


def _shape(dims: list[int]) -> list[int]:
    if min(dims, default=0) < 1:
        raise ValueError(f"dims must be >= 1, got {dims}")
    return dims


Family = Annotated[str, AfterValidator(_known_family)]
Dtype = Literal["float32", "bfloat16", "float16"]
Positive = Annotated[int, Field(ge=1)]

# -------------------------------------------------------------------------------------------------------------- schema


class ModelConfig(Section):
    """Which transformer to fine-tune and how to load it."""

    family: Family = Field(json_schema_extra=_family_enum)
    """Model family (one found under train/models/): selects the transformer class, CP plan, LoRA targets, inputs."""
    pretrained_path: str | None = None
    """A diffusers pipeline folder or hub id to load the transformer (and, for prepare, the VAE/text encoders) from."""
    subfolder: str = "transformer"
    """Subfolder of `pretrained_path` that holds the transformer weights."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) of `pretrained_path`; null = the default branch."""
    dtype: Dtype = "bfloat16"
    """Dtype the transformer weights are loaded (or randomly initialised) in."""
    init_config: dict[str, Any] | None = None
    """Random-initialise the transformer from these constructor kwargs instead of loading weights (tiny CPU recipes)."""
    attention_backend: str = "native"
    """diffusers attention backend name (e.g. native, flash, _native_cudnn)."""
    cp_plan: str | None = None
    """CP plan file to use; null = the plan shipped in cp_plans/ for the transformer class."""
    sharded_load: bool = True
    """Build the transformer on the meta device, shard it, then read only each rank's slice of the pretrained
    safetensors (no rank holds the whole model); false = every rank loads the whole model, then FSDP shards it."""
    flow_shift: Annotated[float, Field(gt=0)] | None = None
    """Flow-matching timestep shift of the primary stream; null = the family scheduler's own (Wan 2.1: 3.0, the
    480p default; use 5.0 for 720p). A number replaces a resolution-dependent shift too."""
    boundary_ratio: Annotated[float, Field(gt=0, lt=1)] | None = None
    """Mixture-of-experts families (Wan 2.2 A14B): the sigma where the pipeline switches from the high-noise expert
    (`transformer`) to the low-noise one (`transformer_2`); model.subfolder picks the expert trained, whose sigmas are
    the only ones drawn. null = the pipeline's own (model_index.json)."""
    both_experts: bool = False
    """Mixture-of-experts families (Wan 2.2 A14B): train the high- and the low-noise expert in one run (model.subfolder
    is then not read), alternating by optimizer step, each step's sigmas drawn from its expert's range; both sharded
    by FSDP2, both in the checkpoint, exported as `lora/` + `lora_2/` (or `transformer/` + `transformer_2/`) and
    both in validation samples (train/experts.py)."""

    @model_validator(mode="after")
    def _weights(self) -> ModelConfig:
        if self.pretrained_path is None and self.init_config is None:
            report([("pretrained_path", "set pretrained_path (weights to load) or init_config (random init), or both")])
        return self


class ParallelConfig(Section):
    """Device mesh: dp_replicate x dp_shard x cp must equal the world size."""

    cp: Positive = 1
    """Context-parallel degree: ranks that split each sample's sequence (ring x Ulysses)."""
    cp_ring: Positive = 1
    """Ring-attention degree inside cp (must divide it): Ulysses = cp / cp_ring, each Ulysses group on consecutive ranks
    (one node), the ring across them (nodes); 1 = Ulysses only. See docs/performance.md for when a ring pays."""
    dp_shard: Annotated[int, AfterValidator(_dp_shard)] = -1
    """Data-parallel ranks that shard parameters (FSDP); -1 = whatever is left of the world size."""
    dp_replicate: Positive = 1
    """Data-parallel replicas of the sharded group (HSDP across nodes); 1 = no replication."""
    fsdp: bool = True
    """Shard parameters with FSDP2 over dp_shard x cp; false = replicate them and all-reduce gradients."""
    reshard_after_forward: bool = True
    """FSDP2: free the gathered parameters after forward (less memory, one more all-gather in backward)."""
    memory_check: Literal["refuse", "warn", "off"] = "refuse"
    """At startup, compare train.estimate's predicted peak per rank with the device memory: refuse (exit before the
    first step) or warn when it clearly exceeds it; off = skip."""
    device_memory_gib: Annotated[float, Field(gt=0)] | None = None
    """Device memory per rank the memory check compares with; null = the GPU's own total (no check on CPU)."""
    timeout_s: Positive = 600
    """Seconds a collective may wait for the other ranks before the job fails with an error naming it (process-group
    timeout and the hang watchdog); long enough for a checkpoint save or a first compile."""
    attention_kernel: Literal[
        "auto", "backend", "cpu_flash", "cuda_cudnn", "flash_attn", "cuda_flash", "cuda_efficient", "math"
    ] = "auto"
    """The kernel the CP attention calls on the head-sharded Q/K/V, in the layout the all-to-all writes for it, its
    backward taking the saved output and LSE (train/cp/kernels.py): auto = the fastest that runs the call on this
    device (CPU: torch's CPU flash kernel; CUDA: cuDNN, flash-attn when installed, torch's flash, the memory-efficient
    one for masked calls); backend = the op pair of model.attention_backend (diffusers'; its native pair recomputes
    the attention forward in backward). cp: 1 runs model.attention_backend."""
    cp_transport: Literal["torch", "symm_mem"] = "torch"
    """CP all-to-all transport: torch (all_to_all_single) or symm_mem (intra-node CUDA, self-tested, else torch)."""
    cpu_offload: bool = False
    """FSDP2 CPU offload (CPUOffloadPolicy): the sharded parameters, gradients and optimizer state live in pinned host
    memory, each block's shards are copied to the GPU for its all-gather, and the optimizer steps on the CPU. Frees
    the GPU of everything but the gathered blocks and activations, at the cost of host-device copies and a CPU
    optimizer step. Needs fsdp; on a CPU-only machine the state is in host memory already (no effect)."""

    @model_validator(mode="after")
    def _offload(self) -> ParallelConfig:
        if self.cpu_offload and not self.fsdp:
            report([("cpu_offload", "offloads FSDP2's sharded state, and fsdp is false; set parallel.fsdp: true, or "
                     "cpu_offload: false")])  # fmt: skip
        return self

    def resolve(self, world_size: int) -> tuple[int, int, int]:
        """(dp_replicate, dp_shard, cp) for `world_size` ranks, with dp_shard = -1 filled in.

        Raises UserError, with the numbers, when the degrees do not multiply to the world size.
        """
        rep, shard, cp = self.dp_replicate, self.dp_shard, self.cp
        if world_size < 1:
            raise UserError(f"parallel: world size must be >= 1, got {world_size}")
        if rep < 1 or cp < 1 or (shard < 1 and shard != -1):
            raise UserError(
                f"parallel: dp_replicate ({rep}) and cp ({cp}) must be >= 1 and dp_shard ({shard}) >= 1 or -1"
            )
        if cp % self.cp_ring:
            raise UserError(
                f"parallel: cp_ring ({self.cp_ring}) does not divide cp ({cp}), and cp = ring x Ulysses: choose a "
                f"cp_ring that divides {cp}, or a cp that is a multiple of {self.cp_ring}"
            )
        if shard == -1:
            if world_size % (rep * cp):
                raise UserError(
                    f"parallel: world size {world_size} is not divisible by dp_replicate ({rep}) x cp ({cp}) = "
                    f"{rep * cp}; choose dp_replicate and cp whose product divides {world_size}"
                )
            shard = world_size // (rep * cp)
        if rep * shard * cp != world_size:
            raise UserError(
                f"parallel: dp_replicate ({rep}) x dp_shard ({shard}) x cp ({cp}) = {rep * shard * cp}, but the world "
                f"size is {world_size}; change them to multiply to {world_size}, or set dp_shard: -1 to use the rest"
            )
        return rep, shard, cp


class PreservationConfig(Section):
    """Differential output preservation (DOP, ai-toolkit's `diff_output_preservation`): each sample's preservation
    prompt is its caption with every `trigger` replaced by `class_word` (its text embeddings cached by train.prepare
    beside the sample); the frozen base's prediction (the trained adapter off) on that prompt and the step's noisy
    latents is the target of the adapted model's prediction on it, and `weight` times their mean squared error is
    added to the loss (logged as `preservation_loss`, unweighted). One more forward without gradients and one with
    per micro-batch (both graphs held until backward: twice the activations, train.estimate counts them). LoRA only.
    DreamBooth's prior preservation is a class dataset mixed in with its own weight: data.datasets[].loss_weight."""

    trigger: Annotated[str, Field(min_length=1)]
    """The trigger word (or phrase) of the captions, replaced in each caption to give its preservation prompt."""
    class_word: Annotated[str, Field(min_length=1)]
    """What the trigger is replaced with: the class the subject belongs to (e.g. `person`, `dog`)."""
    weight: float = Field(1.0, gt=0, le=100)
    """Weight of the preservation term in the loss (ai-toolkit's diff_output_preservation_multiplier)."""


class TrainConfig(Section):
    """Optimisation: steps, batch, optimizer, schedule, timestep sampling and loss."""

    max_steps: Positive = 1000
    """Number of optimizer steps to train for."""
    batch_size: Positive = 1
    """Samples per micro-batch per data-parallel group (the cp ranks of a group share the same samples)."""
    batch_tokens: Positive | None = None
    """A budget of transformer tokens per micro-batch instead of a fixed batch_size: each bucket's batch size is
    max(1, batch_tokens // the tokens of one of its samples), so an image bucket takes many samples and a long clip
    one (per data-parallel group; batch_size stays 1). The report lists the batch size of each bucket. null = batch_size
    for every bucket."""
    grad_accum: Positive = 1
    """Micro-batches accumulated per optimizer step."""
    lr: float = Field(1e-4, gt=0, le=100)
    """Peak learning rate (AdamW; fine-tuning rates are ~1e-6 to 1e-3, above 100 is a typo)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate decay after warmup: constant, linear to 0, or cosine to 0 at max_steps."""
    warmup_steps: int = Field(0, ge=0)
    """Steps of linear warmup from 0 to lr, with every schedule (constant too): logged step s ≤ N trains at
    (s - 1) / N × lr (the logged `lr`)."""
    weight_decay: float = Field(0.0, ge=0, le=10)
    """AdamW decoupled weight decay."""
    betas: Annotated[list[float], AfterValidator(_betas)] = Field(default_factory=lambda: [0.9, 0.999])
    """AdamW (beta1, beta2), each in [0, 1)."""
    eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    max_grad_norm: Annotated[float, Field(gt=0)] | None = 1.0
    """Clip the global gradient norm to this value; null = no clipping."""
    seed: int = Field(42, ge=0, lt=2**32)
    """Seed for parameter init, data order, noise and timesteps (and, in train.prepare, the latent samples); below
    2^32 (the data order's generators are seeded with seed x 1e6)."""
    gradient_checkpointing: bool = False
    """Recompute transformer block activations in backward (less memory, about one more forward of compute)."""
    checkpoint_every: Positive = 1
    """With gradient_checkpointing: recompute every k-th block only (1 = every block; 2 = half of them, ...)."""
    checkpoint_policy: Literal["full", "keep_attention", "keep_attention_matmul"] = "full"
    """With gradient_checkpointing, what a recomputed block keeps from its forward: full = nothing (recompute it
    all); keep_attention = the attention kernels' outputs (and LSE: the attention backward needs no forward again),
    recomputing the cheap rest (norms, modulation, activations, projections, the CP all-to-alls); keep_attention_matmul
    = the matmul outputs too (recompute only the elementwise work). Torch's selective activation checkpointing."""
    offload_activations: bool = False
    """Keep the tensors the blocks save for backward in (pinned) host memory instead of on the device."""
    compile: bool = False
    """torch.compile each transformer block (regional compilation; after checkpointing, before FSDP)."""
    mixed_precision: Literal["auto", "no", "bf16"] = "auto"
    """Autocast: auto = bf16 on GPU and fp32 on CPU; no = off; bf16 = always bf16."""
    timestep_sampling: Literal["logit_normal", "uniform", "mode"] = "logit_normal"
    """Distribution of training timesteps (flow matching sigmas) in [0, 1]."""
    logit_mean: float = 0.0
    """logit_normal: mean of the normal that is squashed by a sigmoid."""
    logit_std: float = Field(1.0, gt=0)
    """logit_normal: standard deviation of that normal."""
    mode_scale: float = 1.29
    """mode: scale of the SD3 mode sampling (0 = uniform)."""
    loss_weighting: Literal["none", "sigma_sqrt", "cosmap"] = "none"
    """Per-timestep weight of the flow-matching loss (SD3 weighting schemes)."""
    frame_sigmas: Literal["shared", "independent", "non_decreasing"] | None = None
    """Sigmas along the latent frames: shared (one per sample), independent (one per frame) or non_decreasing (per
    frame, later frames at least as noisy: diffusion forcing); null = the family's default. Per-frame needs a
    transformer that takes a per-frame timestep (SkyReels-V2: shared for its T2V checkpoints, null for DF ones)."""
    max_bad_steps: Positive = 3
    """Steps in a row with a non-finite loss or gradient norm (each skipped: no update) before the run stops."""
    caption_dropout: float = Field(0.0, ge=0, le=1)
    """Probability of replacing a sample's caption with the empty caption (for classifier-free guidance)."""
    optimizer: Literal["adamw", "adamw_8bit", "adamw_4bit"] = "adamw"
    """AdamW's two moments: adamw = in the trained weights' dtype (fp32; bf16 with master_weights: bf16); adamw_8bit /
    adamw_4bit = torchao's block-quantized moments (1 / 0.5 byte per value each, for tensors of at least 4096 values
    on a rank; smaller ones keep adamw's). Each keeps FSDP2's sharding, DCP checkpoints and exact resume."""
    master_weights: Literal["fp32", "bf16"] = "fp32"
    """The trained weights' dtype: fp32, or bf16 with each update stochastically rounded (torchao, seeded per step:
    exact on resume), which needs train.mixed_precision: bf16. Full fine-tuning then holds 8 bytes per parameter
    with adamw (6 with adamw_8bit) instead of 16 (every parameter bf16, norms too: FSDP2 trains one dtype)."""
    preservation: PreservationConfig | None = None
    """Differential output preservation (LoRA): keep the base model's output on each caption with the trigger
    replaced by a class word (train.prepare caches those prompts); null = off."""

    @model_validator(mode="after")
    def _policy(self) -> TrainConfig:
        if self.checkpoint_policy != "full" and not self.gradient_checkpointing:
            report([("checkpoint_policy", f"is {self.checkpoint_policy}, which says what checkpointed blocks keep, "
                     "but gradient_checkpointing is false; set train.gradient_checkpointing: true, or "
                     "checkpoint_policy: full")])  # fmt: skip
        return self

    @model_validator(mode="after")
    def _budget(self) -> TrainConfig:
        if self.batch_tokens is not None and self.batch_size != 1:
            report([("batch_tokens", f"sets each bucket's batch size from a token budget, and batch_size is "
                     f"{self.batch_size}: set train.batch_size: 1, or batch_tokens: null")])  # fmt: skip
        return self

    @model_validator(mode="after")
    def _master(self) -> TrainConfig:
        if self.master_weights == "bf16" and self.mixed_precision != "bf16":
            report([("master_weights", f"is bf16, whose weights compute in bf16, but mixed_precision is "
                     f"{self.mixed_precision}; set train.mixed_precision: bf16, or master_weights: fp32")])  # fmt: skip
        return self


# What finetune.init_lora's file brings (its ranks, alphas, targets): not set beside it.
INIT_LORA_OWNS = ("lora_rank", "lora_alpha", "lora_targets")


class FinetuneConfig(Section):
    """What is trained: every weight, or adapters (LoRA, DoRA, LoKr, LoHa: peft's)."""

    method: Literal["full", "lora"] = "lora"
    """full = train every transformer weight; lora = train adapters only, of the kind `adapter` names."""
    adapter: Literal["lora", "lokr", "loha"] = "lora"
    """The adapter kind (peft's), for method lora: lora = low-rank B·A (with `dora`, DoRA); lokr = Kronecker product
    of two factors (LyCORIS LoKr, exported as a LoRA file diffusers' `load_lora_weights` reads); loha = Hadamard
    product of two low-rank products (LyCORIS LoHa: no diffusers loader reads it, so it is exported merged into the
    base weights, a `from_pretrained` transformer folder). lora_rank, lora_alpha, lora_dropout (LoRA/DoRA only) and
    lora_targets apply to every kind."""
    dora: bool = False
    """Adapter lora only: weight-decomposed LoRA (DoRA, peft's use_dora): a trained per-output-channel magnitude,
    starting at the base weight's row norms, times the direction of W + B·A. Exported as a LoRA file
    `load_lora_weights` reads (its `lora_magnitude_vector`s)."""
    lora_rank: int = 16
    """Adapter rank r (>= 1 for method lora): LoRA's r; LoKr's and LoHa's r (peft's LoKrConfig / LoHaConfig)."""
    lora_alpha: float = 16.0
    """Adapter alpha; adapter outputs are scaled by alpha / rank (every kind)."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA input, in [0, 1) (adapter lora only)."""
    lora_targets: list[str] | None = None
    """Module names (peft target_modules) that get adapters; null = the family's default targets."""
    init_lora: str | None = None
    """Start from an existing adapter instead of B = 0: a LoRA .safetensors file or folder in diffusers/PEFT keys or
    the original / ComfyUI / kohya keys the family's pipeline reads (its `load_lora_weights` converters); its own
    ranks, alphas and targets are used (so lora_rank, lora_alpha and lora_targets are not set with it)."""
    base_adapter: str | None = None
    """A frozen LoRA applied to the base while training and left out of the export and of validation samples: the
    "training adapter" of a distilled model (Z-Image-Turbo, Flux.2 Klein, LTX distilled), so the trained LoRA is used on
    the distilled model alone (train/base_adapter.py). Any key format the family's pipeline reads, as init_lora."""
    fp8_base: bool = False
    """LoRA: store the frozen linear weights of the transformer blocks in float8 e4m3 with one power-of-two scale per
    output channel (train/fp8.py), upcast one matmul at a time: those weights take 1 byte per value instead of 2 (bf16),
    sharded and gathered as bytes; the sharded start quantizes each rank's bf16 slice as it reads it. Embedders, norms
    and the output projection stay in model.dtype; the exported LoRA loads on the bf16 base."""

    @model_validator(mode="after")
    def _lora(self) -> FinetuneConfig:
        if self.method != "lora":
            return self
        problems = []
        if self.lora_rank < 1:
            problems.append(("lora_rank", f"must be >= 1 for method: lora, got {self.lora_rank}"))
        if not self.lora_alpha > 0:
            problems.append(("lora_alpha", f"must be > 0, got {self.lora_alpha}"))
        if not 0 <= self.lora_dropout < 1:
            problems.append(("lora_dropout", f"must be in [0, 1), got {self.lora_dropout}"))
        if self.lora_targets is not None and not self.lora_targets:
            problems.append(("lora_targets", "is empty; list module names, or null for the family's defaults"))
        if self.dora and self.adapter != "lora":
            problems.append(("dora", f"is true, which decomposes a LoRA, but adapter is {self.adapter}; set "
                             "finetune.adapter: lora, or dora: false"))  # fmt: skip
        if self.lora_dropout and self.adapter != "lora":
            problems.append(("lora_dropout", f"is LoRA's input dropout, and adapter is {self.adapter}; set it to 0"))
        if self.base_adapter is not None and (self.adapter != "lora" or self.dora):
            problems.append(("base_adapter", "is a frozen LoRA beside the trained plain LoRA; with adapter lokr / loha "
                             "or dora it is not built: train adapter: lora, dora: false"))  # fmt: skip
        if self.init_lora is not None and (self.adapter != "lora" or self.dora):
            problems.append(("init_lora", "starts a plain LoRA from a file; with adapter lokr / loha or dora it "
                             "cannot: drop finetune.init_lora, or train adapter: lora, dora: false"))  # fmt: skip
        if self.init_lora is not None:
            problems += [(k, f"is set, but init_lora {self.init_lora} brings its own ranks, alphas and targets; drop "
                          f"finetune.{k}") for k in INIT_LORA_OWNS
                         if k in self.model_fields_set]  # fmt: skip
        report(problems)
        return self

    @model_validator(mode="after")
    def _fp8(self) -> FinetuneConfig:
        if self.fp8_base and self.method != "lora":
            report([("fp8_base", "stores the FROZEN weights in float8, and finetune.method full trains every weight; "
                     "use method: lora with fp8_base, or fp8_base: false (for full fine-tuning's memory see "
                     "train.optimizer and train.master_weights)")])  # fmt: skip
        return self


class SyntheticData(Section):
    """Random latents and text embeddings, for tiny recipes before a cache exists."""

    num_samples: Positive = 8
    """Number of distinct random samples (the epoch length)."""
    shapes: dict[str, Annotated[list[int], AfterValidator(_shape)]] = Field(default_factory=dict)
    """Per-sample shape of each tensor the family reads (spec batch_keys); *_mask keys: bool, last quarter padded."""


class DatasetConfig(Section):
    """One cache of a mixture (data.datasets), drawn each epoch `repeats` times or by `weight`."""

    cache_dir: str
    """Folder of cached latents and text embeddings, written by `python -m train.prepare` (one run per dataset)."""
    name: str | None = None
    """Its name in the metrics (`samples/<name>`: samples trained on so far) and the report; null = the folder's
    name."""
    repeats: Positive | None = None
    """Each sample this many times per epoch (not with weight); null, without weight = once."""
    weight: Annotated[float, Field(gt=0)] | None = None
    """Its share of the weighted datasets' epoch: together they take as many samples per epoch as they hold, split in
    proportion to weight (a small dataset's samples repeat, a large one gives a seeded part, another every epoch). Not
    with repeats."""
    caption_dropout: Annotated[float, Field(ge=0, le=1)] | None = None
    """Its caption dropout; null = train.caption_dropout."""
    loss_weight: Annotated[float, Field(gt=0, le=100)] | None = None
    """Its samples' weight in the loss (each sample's flow-matching loss times it; DreamBooth's prior preservation:
    a class dataset at e.g. 1.0 beside the subject's); null = 1."""

    @model_validator(mode="after")
    def _draw(self) -> DatasetConfig:
        if self.repeats is not None and self.weight is not None:
            report([("weight", f"is set, and so is repeats ({self.repeats}): a dataset is drawn by one of them; "
                     "drop the other")])  # fmt: skip
        return self


class DataConfig(Section):
    """Training data: the latent/embedding cache, the media it is prepared from (train.prepare), and loading."""

    cache_dir: str | None = None
    """Folder of cached latents and text embeddings, written by `python -m train.prepare`."""
    datasets: Annotated[list[DatasetConfig], Field(min_length=1)] | None = None
    """Train on several caches instead of cache_dir, each {cache_dir, name, repeats or weight, caption_dropout,
    loss_weight}, mixed per epoch by a seeded sampler (bucketed batches may hold samples of several); null =
    cache_dir."""
    source: str | None = None
    """Media folder, metadata.jsonl/csv file or datasets name that `train.prepare` encodes into cache_dir."""
    caption_column: str = "text"
    """Column (datasets) or sidecar key (media folder) holding each sample's caption."""
    reference_column: str | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] = "reference"
    """Editing families (Qwen-Image-Edit, FLUX.1 Kontext): column or metadata key holding each sample's reference
    (input) image, a path relative to the metadata file or a dataset image. A list names several, in order, for the
    families that take more than one (Qwen-Image-Edit-Plus: up to 3 control images, e.g. [control_1, control_2,
    control_3]); an item may lack some of them (those it has keep their order), not all."""
    mask_column: str | None = None
    """Masked training: column or metadata key naming each sample's loss mask, an image (one mask for every frame) or
    a video of the media's frame count and rate, of the media's own size (a path relative to the metadata file, or a
    dataset image/video). Its first (red) channel / 255 weighs each pixel's loss: white = trained, black = left out,
    grey = in between. train.prepare crops and resizes it as the media, pools it to latent resolution (the mean over
    each latent cell's pixels and frames) and caches it; the loss multiplies the squared error by it (its mean still
    over every element). A sample with no mask trains on all of it; an unreadable or mismatched mask makes the item
    bad (`bad_mask`). null = no masks."""
    condition_columns: dict[str, str] = Field(default_factory=dict)
    """Families whose items need named conditioning media (Wan Animate: `pose_video`, `face_video`): the column or
    metadata key holding each, a path relative to the metadata file or a dataset video; a name not listed is read from
    the column of its own name. An item without one is bad (`no_condition`), one that cannot be read `bad_condition`."""
    height: Positive = 512
    """Pixel height media is resized/cropped to before encoding (when buckets is null)."""
    width: Positive = 512
    """Pixel width media is resized/cropped to before encoding (when buckets is null)."""
    num_frames: Positive = 1
    """Frames per video clip, 1 for images (when buckets is null)."""
    fps: Annotated[float, Field(gt=0)] | None = None
    """Frame rate clips are resampled to; null = keep the source rate."""
    max_text_tokens: Positive | None = None
    """Truncate/pad captions to this many tokens; null = the family's default."""
    synthetic: SyntheticData | None = None
    """Train on random latents/embeddings of these shapes instead of cache_dir; null = use the cache."""
    buckets: list[Annotated[str, AfterValidator(_bucket)]] | None = None
    """Clip shapes FxHxW items are sorted into (most frames, then closest aspect); null = num_frames×height×width."""
    max_bad_fraction: float = Field(0.1, ge=0, le=1)
    """train.prepare fails when more than this fraction of the source items is unreadable or unusable."""
    allow_upscale: bool = False
    """Upscale media smaller than its bucket instead of skipping it as too_small."""
    latent_sample: Literal["sample", "mode"] = "sample"
    """Cache a seeded posterior sample (seed from train.seed and the item index) or the posterior mean."""
    cache_dtype: Dtype | None = None
    """dtype of the cached tensors; null = model.dtype."""
    text_encoder_dtype: Dtype | None = None
    """dtype the text encoders run in during prepare (the VAE always runs in fp32); null = model.dtype."""
    split: str = "train"
    """datasets split read when data.source is a dataset."""
    media_column: str | None = None
    """Column or metadata key holding the media; null = the first Image/Video feature, else file_name."""
    num_workers: int = Field(0, ge=0)
    """DataLoader worker processes (and, at least 1, items decoded ahead in threads during prepare)."""
    shuffle: bool = True
    """Shuffle sample order each epoch."""

    @model_validator(mode="after")
    def _names(self) -> DataConfig:
        seen: dict[str, int] = {}
        for i, name in enumerate(self.dataset_names()):
            if name in seen:
                report([(("datasets", i, "name"), f"{name!r} is also data.datasets[{seen[name]}]'s name (the metrics "
                         "tell datasets apart by name): set a name of its own")])  # fmt: skip
            seen[name] = i
        return self

    def condition_columns_of(self, names: Sequence[str]) -> dict[str, str]:
        """The column each of the conditioning media `names` is read from (condition_columns, else the name)."""
        return {name: self.condition_columns.get(name, name) for name in names}

    def dataset_names(self) -> list[str]:
        """The names of data.datasets (a cache folder's name when unnamed); [] without datasets."""
        return [d.name or Path(d.cache_dir).name for d in self.datasets or []]

    def cache_dirs(self) -> list[str]:
        """The caches the trainer reads: data.datasets', else [data.cache_dir] (none for synthetic data)."""
        if self.datasets is not None:
            return [d.cache_dir for d in self.datasets]
        return [self.cache_dir] if self.cache_dir is not None else []

    def resolved(self, model: ModelConfig) -> DataConfig:
        """This section with its defaults-by-reference filled in (the one place they are resolved): buckets null =
        [num_frames×height×width], cache_dtype / text_encoder_dtype null = model.dtype."""
        return self.model_copy(
            update={
                "buckets": self.buckets or [f"{self.num_frames}x{self.height}x{self.width}"],
                "cache_dtype": self.cache_dtype or model.dtype,
                "text_encoder_dtype": self.text_encoder_dtype or model.dtype,
            }
        )


class LoggingConfig(Section):
    """Metrics: wandb and the console progress bar."""

    wandb_project: str = "ctxtrain"
    """wandb project name."""
    wandb_run: str | None = None
    """wandb run name; null = the recipe name."""
    wandb_mode: Literal["online", "offline", "disabled"] = "offline"
    """wandb mode: online uploads, offline writes ./wandb for a later `wandb sync`, disabled logs nothing."""
    every_n_steps: Positive = 1
    """Log metrics every this many optimizer steps."""
    progress_bar: bool = True
    """Show a tqdm progress bar on rank 0 (training and train.prepare)."""


class CheckpointConfig(Section):
    """Training-state checkpoints and the final export."""

    every_n_steps: int = Field(0, ge=0)
    """Save a resumable checkpoint every this many optimizer steps; 0 = off."""
    keep_last: Positive = 2
    """Number of most recent checkpoints kept in output_dir/checkpoints."""
    resume: bool = False
    """Continue the run recorded in output_dir from its latest checkpoint; with none, start fresh, unless output_dir
    holds a run's state (then refused: train/rundir.py). `--resume` insists: nothing to resume is refused."""
    export: Literal["auto", "full", "lora", "none"] = "auto"
    """Final weights written to output_dir: auto = what was trained (lora adapters or the full transformer)."""
    export_format: Literal["diffusers", "original", "both"] = "diffusers"
    """Key format of the export: diffusers = `lora/`, the diffusers/PEFT file `load_lora_weights` reads (a full
    fine-tune: `transformer/`, a from_pretrained folder); original = `lora_original/lora.safetensors`, the model
    authors' key names (what ComfyUI and their code read, train/lora_format.py), or for full weights
    `transformer_original/model.safetensors`, the authors' single-file checkpoint (train/original_full.py; the
    families with each: docs/interop.md); both = the two folders."""
    export_every_checkpoint: bool = False
    """Each checkpoint also holds the trained weights in the export format (`step_N/lora/`, the file a pipeline's
    `load_lora_weights` reads, or `step_N/transformer/`, a `from_pretrained` folder; and the EMA's beside them),
    rotated with it: an intermediate adapter to try without resuming. Not with export: none."""


class ValidationPrompt(Section):
    """One validation sample: a prompt and, for the variants that condition on an image, that image."""

    prompt: str
    """The text prompt."""
    image: str | None = None
    """Path of the conditioning image: the first frame of image-to-video variants, the image to edit of editing ones
    (required there, see the family's encoder `validation_image`); null for text-to-video/image."""
    media: dict[str, str] = Field(default_factory=dict)
    """Paths of the family's named conditioning videos (its encoder's `condition_media`, as `data.condition_columns`
    names them: Wan Animate's `pose_video` and `face_video`), each handed to the pipeline argument of that name as
    its frames; required there, empty for every other family."""


class ValidationConfig(Section):
    """Samples rendered during training by the family's own diffusers pipeline around the training transformer as
    it is (CP hooks and FSDP shards in place, every rank taking part), written to `output_dir/samples/step_N/<i>.mp4`
    (video) or `.png` (image) and logged to wandb with the prompt as caption. Training state is untouched: a run with
    validation has the metrics lines of one without. Needs model.pretrained_path (the VAE and text encoders)."""

    prompts: Annotated[list[ValidationPrompt], Field(min_length=1)]
    """Samples to render, each a mapping {prompt: ..., image: null or a path}."""
    every_n_steps: Positive = 100
    """Render after every this many optimizer steps, and after the last one."""
    at_start: bool = False
    """Also render before the first step (step_0: the starting weights, a baseline); not on resume."""
    num_inference_steps: Positive = 30
    """Denoising steps of each sample."""
    guidance_scale: float | None = None
    """The pipeline's `guidance_scale` (its own meaning: classifier-free guidance for Wan/LTX, the distilled
    guidance embedding for FLUX); null = the pipeline's default."""
    negative_prompt: str | None = None
    """Negative prompt (pipelines that take one); null = the pipeline's default."""
    height: Positive | None = None
    """Sample height in pixels; null = data.height."""
    width: Positive | None = None
    """Sample width in pixels; null = data.width."""
    num_frames: Positive | None = None
    """Frames per video sample; null = data.num_frames (ignored for image families)."""
    fps: Annotated[float, Field(gt=0)] | None = None
    """Frame rate of the written mp4; null = data.fps, else 16."""
    seed: int = 0
    """Seed of sample i's generator (seed + i), the same at every validation: samples of different steps compare."""
    offload: bool = True
    """Keep the VAE and text encoders in host memory between validations (moved to the device for the call)."""
    save_tensors: bool = False
    """Also write `<i>.pt`: the pipeline's float output before 8-bit encoding (for exact comparisons)."""


class EMAConfig(Section):
    """An exponential moving average of the trained weights (the LoRA adapters, or every weight of full fine-tuning):
    `ema = decay · ema + (1 − decay) · weights` after each applied optimizer step `s` with `s ≥ start_step` and
    `(s − start_step) % every_n_steps == 0`, starting from the weights before the first step (start_step 0) or from
    a copy of the weights at step start_step. Each rank keeps the EMA of its own FSDP shard (nothing gathered), in
    fp32, in every checkpoint (exact resume). Exported beside the weights: `lora_ema/` or `transformer_ema/`."""

    decay: float = Field(0.999, gt=0, lt=1)
    """Weight of the running average at each update."""
    start_step: int = Field(0, ge=0)
    """First optimizer step whose weights enter the average (0: from the first step)."""
    every_n_steps: Positive = 1
    """Update the average every this many optimizer steps."""
    validation: bool = False
    """Render the validation samples with the EMA weights instead of the trained ones."""


class ValidationLossConfig(Section):
    """The loss on held-out samples every N steps, comparable across steps and runs: sample i is evaluated at the
    noise and timestep drawn from a generator seeded by (train.seed, i), the same every evaluation, under the run's
    CP layout (data-parallel groups split the samples). Logged as `val_loss` in metrics.jsonl, wandb and the report.
    Held out: data.cache_dir's own samples set aside by a seeded split (`fraction`, never trained on), or another
    cache (`cache_dir`)."""

    every_n_steps: Positive = 100
    """Evaluate after every this many optimizer steps, and after the last one."""
    at_start: bool = False
    """Also evaluate before the first step (step 0: the starting weights; not on resume)."""
    cache_dir: str | None = None
    """A cache written by train.prepare for the same family, evaluated whole; null = `fraction` of the training
    cache."""
    fraction: float = Field(0.1, gt=0, lt=1)
    """Without cache_dir: this share of the training samples (at least 1), chosen with train.seed, held out of
    training."""
    max_samples: Positive | None = None
    """Evaluate at most this many held-out samples (the first of the seeded order); null = all."""


class Recipe(Section):
    """A complete training run."""

    model: ModelConfig
    """The transformer to fine-tune."""
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    """Device mesh and sharding."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """Optimisation and loss."""
    finetune: FinetuneConfig = Field(default_factory=FinetuneConfig)
    """Full fine-tuning or LoRA."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Training data, and what train.prepare encodes."""
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """Metrics logging."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpoints and export."""
    validation: ValidationConfig | None = None
    """Validation samples during training; null = none."""
    ema: EMAConfig | None = None
    """An EMA of the trained weights; null = none."""
    validation_loss: ValidationLossConfig | None = None
    """A held-out loss during training; null = none."""
    output_dir: Annotated[str, AfterValidator(_folder)] = "outputs/run"
    """Folder for checkpoints, exported weights and the resolved recipe."""
    name: str | None = None
    """Run name; null = the recipe file's stem (filled in by load_recipe)."""

    @property
    def exported(self) -> str:
        """What the final export writes: lora (an adapter file), full (a transformer folder) or none. auto = what was
        trained; a LoHa run exports full (its adapters merged: no diffusers loader reads LoHa files)."""
        if self.checkpoint.export != "auto":
            return self.checkpoint.export
        ft = self.finetune
        return "full" if ft.method == "full" or ft.adapter == "loha" else "lora"

    @model_validator(mode="after")
    def _export(self) -> Recipe:
        if self.checkpoint.export_every_checkpoint and self.checkpoint.export == "none":
            report([("checkpoint.export_every_checkpoint", "is true but checkpoint.export is none: set export to auto "
                     "(or lora / full), or export_every_checkpoint to false")])  # fmt: skip
        if self.ema is not None and self.ema.start_step >= self.train.max_steps:
            n, last = self.ema.start_step, self.train.max_steps
            what = "a copy of the last step's weights" if n == last else "the starting weights (no step enters it)"
            report([("ema.start_step", f"is {n}, not below train.max_steps {last}: the exported EMA would be {what}; "
                     "set start_step below max_steps")])  # fmt: skip
        held = self.validation_loss.cache_dir if self.validation_loss is not None else None
        if held is not None and (same := [c for c in self.data.cache_dirs() if _same_folder(c, held)]):
            report([("validation_loss.cache_dir", f"is the training cache ({same[0]}): the held-out loss would be "
                     "measured on trained samples; point it at a cache of other samples, or set cache_dir: null to "
                     "hold out validation_loss.fraction of the training cache")])  # fmt: skip
        if self.ema is not None and self.ema.validation and self.validation is None:
            report([("ema.validation", "is true but there is no validation section to render with the EMA")])
        exported = self.exported
        ft = self.finetune
        if self.model.both_experts and (ft.init_lora or ft.base_adapter):
            key = "init_lora" if ft.init_lora else "base_adapter"
            report([(f"finetune.{key}", "is one file, and model.both_experts trains two experts (each with LoRAs of "
                     "its own): train each expert alone (model.subfolder) to start it from its file")])  # fmt: skip
        kind = "dora" if ft.dora else ft.adapter
        if self.checkpoint.export_format != "diffusers" and exported == "lora" and kind != "lora":
            report([("checkpoint.export_format", f"is {self.checkpoint.export_format}, but the original key formats "
                     f"(train/lora_format.py) hold plain LoRA only, and this run trains {kind}; set export_format: "
                     "diffusers")])  # fmt: skip
        if self.checkpoint.export == "lora" and ft.method == "lora" and ft.adapter == "loha":
            report([("checkpoint.export", "is lora, but no diffusers loader reads a LoHa file: LoHa exports merged "
                     "into the base weights; set export: auto (or full)")])  # fmt: skip
        if exported == "full" and ft.method == "lora" and ft.adapter == "loha" and ft.fp8_base:
            report([("finetune.fp8_base", "rounds the base weights to float8, and a LoHa run exports merged into "
                     "them (no loader reads LoHa files); use fp8_base: false, or adapter: lora / lokr")])  # fmt: skip
        if self.finetune.base_adapter is not None and exported == "full":
            report([("checkpoint.export", "is full, which would merge finetune.base_adapter into the exported "
                     "transformer; export the LoRA (auto or lora) to use it on the distilled base")])  # fmt: skip
        if self.train.preservation is not None and ft.method != "lora":
            report([("train.preservation", "keeps the base model's output with the trained adapter switched off, and "
                     "finetune.method full has no adapter to switch off (no frozen base); use method: lora, or "
                     "train.preservation: null")])  # fmt: skip
        if self.checkpoint.export == "lora" and self.finetune.method != "lora":
            report([("checkpoint.export", "is lora but finetune.method is full; use auto or full")])
        if self.checkpoint.export == "full" and self.finetune.fp8_base and ft.adapter != "loha":
            report([("checkpoint.export", "is full, which would merge the adapters into the float8-rounded base "
                     "(finetune.fp8_base): use export lora (or auto) and load it on the bf16 base")])  # fmt: skip
        return self


def _same_folder(a: str, b: str) -> bool:
    """Whether two folder paths name one folder (through links, `~`, relative parts), existing or not."""
    a_path, b_path = Path(a).expanduser(), Path(b).expanduser()
    if a_path.exists() and b_path.exists():
        return os.path.samefile(a_path, b_path)
    return a_path.resolve() == b_path.resolve()


# ------------------------------------------------------------------------------------------------------------ overrides


def _override_type(parts: list[str]) -> tuple[Any, str | None]:
    """The annotation at a dotted key (keys inside dict fields allowed), or (None, why it is not a recipe key)."""
    tp: Any = Recipe
    for i, part in enumerate(parts):
        here = ".".join(parts[:i])
        inner = _section_of(tp)
        if not part:
            return None, "empty key component"
        if inner is not None:
            if part not in inner.model_fields:
                where = f" of {here}" if here else ""
                names = list(inner.model_fields)
                return None, f"unknown key{suggest_key(part, names, Recipe)}; valid keys{where}: " + ", ".join(names)
            tp = annotation_of(inner, part)
        elif _mapping_value(tp) is not None:
            tp = _mapping_value(tp)
        else:
            return None, f"{here} is {type_name(tp)} and has no sub-keys"
    return tp, None


def _section_of(tp: Any) -> type[BaseModel] | None:
    """The section model of a field annotation (`X` or `X | None`; not `list[X]`, a list of mappings), else None."""
    for arm in (tp, *(getattr(tp, "__args__", ()) if _is_union(tp) else ())):
        if isinstance(arm, type) and issubclass(arm, BaseModel):
            return arm
    return None


def _mapping_value(tp: Any) -> Any:
    """The value annotation of a `dict[K, V]` (or `dict | None`, or Any) field, else None."""
    if tp is Any:
        return Any
    for arm in (tp, *getattr(tp, "__args__", ())):
        if getattr(arm, "__origin__", None) is dict:
            return arm.__args__[1]
    return None


def _apply_overrides(data: dict, overrides: Iterable[str]) -> list[str]:
    """Merge `KEY=VALUE` overrides into the raw recipe mapping `data`, each checked against its key's annotation."""
    lines: list[str] = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            lines.append(f"--set: {item}: expected KEY=VALUE, e.g. train.lr=1e-4")
            continue
        parts = key.split(".")
        tp, why = _override_type(parts)
        if why:
            lines.append(f"--set: {key}: {why}")
            continue
        try:
            value = load_yaml(raw)
        except yaml.YAMLError as e:
            lines.append(f"--set: {key}: value {raw!r} is not valid YAML: {e}")
            continue
        _, errors = validate(tp, value, "--set", prefix=tuple(parts))
        if errors:
            lines += errors
            continue
        node = data
        for part in parts[:-1]:
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                break  # the file has a non-mapping here: its own validation reports it
        else:
            node[parts[-1]] = value
    return lines


# ------------------------------------------------------------------------------------------------------------------ API


def recipe_from_dict(d: Mapping[str, Any], source: str = "<dict>") -> Recipe:
    """A validated Recipe from a (YAML-shaped) mapping; raises RecipeError listing every problem."""
    recipe, errors = validate(Recipe, d, source)
    if errors:
        raise RecipeError(errors)
    return recipe


def load_recipe(path: str | Path, overrides: Iterable[str] = ()) -> Recipe:
    """Load a recipe YAML file, apply `--set` style overrides ("train.lr=1e-4", "finetune.lora_targets=[to_q,to_k]")."""
    source = str(path)
    try:
        data = load_yaml(Path(path).read_text())
    except OSError as e:
        raise RecipeError([f"{source}: cannot read recipe: {e.strerror or e}"]) from e
    except yaml.YAMLError as e:
        raise RecipeError([f"{source}: invalid YAML: {e}"]) from e
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise RecipeError([f"{source}: expected a mapping of recipe sections, got {show(data)}"])
    override_errors = _apply_overrides(data, list(overrides))
    recipe, errors = validate(Recipe, data, source)
    if override_errors or errors:
        raise RecipeError(override_errors + errors)
    if recipe.name is None:
        recipe.name = Path(path).stem
    return recipe


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # org/name: what pretrained_path may be instead of a folder


def check_pretrained_path(m: ModelConfig) -> None:
    """model.pretrained_path names a local folder or an org/name hub id (fetched later, or failing there)."""
    if m.pretrained_path is None:
        return
    local = Path(m.pretrained_path).expanduser()
    if not local.is_dir() and not _HUB_ID.match(m.pretrained_path):
        what = "is a file, not a folder" if local.exists() else "does not exist"
        raise UserError(f"model.pretrained_path: {local.resolve()} {what} (and it is no org/name hub id); point it "
                        f"at a diffusers pipeline folder (with {m.subfolder}/config.json) or a hub id")  # fmt: skip


def check_prepare_inputs(recipe: Recipe) -> None:
    """train.prepare's checks of the paths it reads, before loading any encoder: the pipeline and data.source (a
    local path that does not exist; a datasets name like org/name is looked up later)."""
    check_pretrained_path(recipe.model)
    source = recipe.data.source
    if source is not None and not _HUB_ID.match(source) and not Path(source).expanduser().exists():
        raise UserError(f"data.source: {Path(source).expanduser().resolve()} does not exist; point it at a folder of "
                        "media with metadata.jsonl/csv, such a file, or a datasets name (org/name)")  # fmt: skip


def check_inputs(recipe: Recipe, world_size: int) -> None:
    """The trainer's checks of what a recipe names outside itself, in milliseconds, before anything heavy is imported
    or built (train/finetune.py runs them first): the degrees against the world size, the paths it reads and writes.
    Raises UserError, one line with cause and fix (the same on every rank)."""
    recipe.parallel.resolve(world_size)
    m, data = recipe.model, recipe.data
    if m.init_config is None:
        check_pretrained_path(m)
    if m.cp_plan is not None and recipe.parallel.cp > 1 and not Path(m.cp_plan).is_file():
        raise UserError(f"model.cp_plan: no file {Path(m.cp_plan).resolve()}; point it at a plan YAML (cp_plans/ holds "
                        "the shipped ones), or set model.cp_plan=null for the plan shipped for the model")  # fmt: skip
    if data.synthetic is not None and data.cache_dir is not None:
        raise UserError(f"data.synthetic and data.cache_dir ({data.cache_dir}) are both set, and synthetic data would "
                        "silently replace the cache: set data.synthetic=null to train on the cache, or drop "
                        "data.cache_dir")  # fmt: skip
    if data.datasets is not None and (data.cache_dir is not None or data.synthetic is not None):
        other = "data.cache_dir" if data.cache_dir is not None else "data.synthetic"
        raise UserError(f"data.datasets and {other} are both set, and only one is trained on: set {other}=null to "
                        "train on the datasets, or data.datasets=null")  # fmt: skip
    if data.synthetic is None and data.cache_dir is None and data.datasets is None:
        raise UserError("data: no training data: set data.cache_dir (written by `python -m train.prepare`), "
                        "data.datasets or data.synthetic")  # fmt: skip
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")  # `accelerate launch --mixed_precision` or config
    if launched != "no":
        raise UserError(f"accelerate launch --mixed_precision {launched} (or that key of its config file) would be "
                        "silently ignored: the recipe sets the precision; launch with mixed_precision 'no' (as "
                        "configs/accelerate/ do) and set train.mixed_precision (auto, no, bf16)")  # fmt: skip
    given = Path(recipe.output_dir).expanduser().absolute()
    for link in (given, *given.parents):  # a dangling link: the folder cannot be made (mkdir: "File exists")
        if link.is_symlink() and not link.exists():
            raise UserError(f"output_dir: {link} is a symbolic link to {os.readlink(link)}, which does not exist; "
                            "create its target (a mounted volume?) or choose another output_dir")  # fmt: skip
    out = given.resolve()
    parent = next(p for p in (out, *out.parents) if p.exists())
    if not parent.is_dir():
        raise UserError(f"output_dir: {parent} is a file, not a folder; choose another output_dir")
    if not os.access(parent, os.W_OK | os.X_OK):
        why = "a read-only filesystem" if os.statvfs(parent).f_flag & os.ST_RDONLY else "permission denied"
        raise UserError(f"output_dir: cannot write in {parent} ({why}); choose a writable output_dir")


def preflight(argv: list[str]) -> None:
    """`--recipe`/`--set` of a trainer command line loaded and `check_inputs`-checked before the trainer imports torch
    and diffusers (seconds): a user error is printed as one line (train/errors.py) and the process exits 2 at once;
    `--debug` leaves it to the trainer, which raises it with its traceback. Other arguments are the trainer's."""
    from train.errors import report

    if {"--debug", "-h", "--help"} & set(argv) or not any(a.split("=")[0] == "--recipe" for a in argv):
        return  # the trainer's own parser: help, or its usage error
    parser = argparse.ArgumentParser(add_help=False)
    add_recipe_args(parser)
    args, _ = parser.parse_known_args(argv)
    try:
        check_inputs(recipe_from_args(args), int(os.environ.get("WORLD_SIZE", "1")))
    except UserError as e:
        sys.stdout.flush()
        os._exit(report(e))  # nothing to tear down yet: no process group, no threads


def recipe_to_dict(r: Any) -> Any:
    """Plain (YAML/JSON-safe) nested dict of a recipe or any of its sections."""
    return r.model_dump() if isinstance(r, BaseModel) else r


def save_recipe(r: Recipe, path: str | Path) -> None:
    """Write the (resolved) recipe as YAML that `load_recipe` reads back to an equal Recipe."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = recipe_to_dict(r)
    if r.finetune.init_lora is not None:  # the file brings them; set beside init_lora they are refused at load
        data["finetune"] = {k: v for k, v in data["finetune"].items() if k not in INIT_LORA_OWNS}
    path.write_text(dump_yaml(data, default_flow_style=False))


def _flow(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def recipe_help(cls: type[BaseModel] = Recipe, prefix: str = "") -> str:
    """Every recipe key, one per line: `dotted.key (type; default X): docs` (sections expanded), for --list-keys."""
    lines = []
    for name, info in cls.model_fields.items():
        key, text = prefix + name, doc(info.description)
        section = _section_of(info.annotation)
        if section is not None:
            lines.append(f"{key}: ({'section' if info.is_required() or info.default is not None else 'null'}) {text}")
            lines.append(recipe_help(section, key + "."))
            continue
        default = "required" if info.is_required() else f"default {_flow(info.get_default(call_default_factory=True))}"
        lines.append(f"{key} ({type_name(info.annotation)}; {default}): {text}")
    return "\n".join(lines)


def recipe_json_schema() -> dict[str, Any]:
    """The JSON Schema of a recipe file (what recipes/schema.json holds), with the families found now as an enum."""
    return json_schema(Recipe)


class _ListKeys(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(recipe_help())
        parser.exit()


def add_recipe_args(parser: argparse.ArgumentParser) -> None:
    """Add `--recipe PATH`, repeatable `--set KEY=VALUE` and `--list-keys`; `recipe_from_args` loads the result."""
    parser.add_argument("--recipe", required=True, metavar="PATH", help="recipe YAML file (see recipes/)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe key, value in YAML (e.g. train.lr=1e-4, finetune.lora_targets=[to_q,to_k], "
        "model.cp_plan=null); repeatable; --list-keys shows every key",
    )
    parser.add_argument("--list-keys", action=_ListKeys, help="list every recipe key with its type, default and docs")


def recipe_from_args(args: argparse.Namespace) -> Recipe:
    """The recipe named by `--recipe`, with the `--set` overrides applied (after `add_recipe_args`)."""
    return load_recipe(args.recipe, args.set)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m train.config", description="The recipe schema.")
    parser.add_argument(
        "--schema",
        nargs="?",
        const=str(SCHEMA_PATH),
        metavar="PATH",
        help=f"write the recipe JSON Schema to PATH (default {SCHEMA_PATH.relative_to(SCHEMA_PATH.parents[1])})",
    )
    parser.add_argument("--list-keys", action=_ListKeys, help="list every recipe key with its type, default and docs")
    args = parser.parse_args(argv)
    if args.schema is None:
        parser.error("nothing to do: pass --schema or --list-keys")
    Path(args.schema).write_text(json.dumps(recipe_json_schema(), indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {args.schema}")


if __name__ == "__main__":
    main()
