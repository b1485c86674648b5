"""Declarative context-parallel (CP) plans: `cp_plans/*.yaml` <-> diffusers `_cp_plan` dicts, and their checks.

A diffusers model declares `_cp_plan`: module path -> either a *split* dict (forward-argument name or output index ->
`ContextParallelInput`) or a *gather* (`ContextParallelOutput`, or a list of them, one per output). Module paths are
dotted attribute paths from the model, "" is the model itself, and one "*" may stand for every element of a
`ModuleList`. The plan files spell the same thing in YAML, so a plan can be read, reviewed and changed without
touching model code:

    model_class: WanTransformer3DModel   # matched against the model's class or its nearest base class, by name
    training: supported                  # or: unsupported
    reason: null                         # required text when unsupported
    per_head_mask_inputs: []             # forward() args whose masks Ulysses can't shard: refused when fed in training
    layout_registry: true                # attention lengths come from the splits (train/cp/layout.py); default false
    local_attention: []                  # module paths whose attention runs on replicated tokens: no CP there
    cp_processors: null                  # "module:function" called with the model before CP attaches (optional)
    joint_key_mask: []                   # a whole mask over a joint sequence: its segments, "<path>:<input>", in
                                         # model order (masks.py puts its keys in the ranks' order)
    replicated_tail: false               # modules after the gather run on the whole sequence (see below)
    plan:
      rope:                              # a module path
        split_outputs:                   # output index -> spec (ContextParallelInput with split_output=True)
          0: {dim: 1, expected_dims: 4}
      blocks.0:
        split_inputs:                    # forward-argument name -> spec, or a list of specs for a list/tuple argument
          hidden_states: {dim: 1, expected_dims: 3}
      proj_out:
        gather: {dim: 1, expected_dims: 3}   # one spec, or a list with one spec per output of the module

`dim` is the split/gather dimension; `expected_dims` (optional, null = unchecked) is the rank the tensor must have,
else diffusers leaves it unsplit (with a warning). The file's schema is `PlanFile` below, checked by the engine that
checks recipes (train/schema.py): unknown keys, wrong types and duplicate keys are errors, all reported together as
`<file>: <dotted.key>: <problem>` (a PlanError, a UserError: train/errors.py).

A ModuleList index of `-1` names its last element (`blocks.-1`), whatever the model's depth: where a model reshapes
the tokens inline before its output layer, no module after the blocks outputs the sequence, so the plan gathers the
last block's output and declares `replicated_tail: true` (the output layers then run on the whole sequence on every
rank; `enable.py` scales gradients so that the SUM over CP ranks stays the serial gradient).

A path may both split and gather (Helios does this around attn1/attn2/ffn; SkyReels-V2 around its output projection).
A diffusers plan holds one value per key, so the gathers of such paths live in `CPPlanSpec.extra_gathers`;
`enable_context_parallel` applies them after the plan, and `CPPlanSpec.diffusers_plan(model)` expands wildcard ones to
concrete per-element paths, the way Helios' built-in plan hard-codes `blocks.0..39` (a concrete path that splits and
gathers has no diffusers spelling).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
import yaml
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from pydantic import AfterValidator, BeforeValidator, Discriminator, Field, Tag, model_validator

from train.schema import SchemaError, Section, load_yaml, report, validate

__all__ = [
    "PLAN_DIR",
    "CPPlanSpec",
    "PlanError",
    "PlanFile",
    "ResolvedEntry",
    "load_plan_file",
    "load_plans",
    "plan_for",
    "resolve_plan",
    "training_problems",
    "validate_plan",
]

PLAN_DIR: Path = Path(__file__).resolve().parents[2] / "cp_plans"

SplitValue = ContextParallelInput | list[ContextParallelInput] | tuple[ContextParallelInput, ...]
SplitPlan = dict[str | int, SplitValue]
GatherPlan = ContextParallelOutput | list[ContextParallelOutput] | tuple[ContextParallelOutput, ...]
DiffusersPlan = dict[str, SplitPlan | GatherPlan]


@dataclass(frozen=True)
class CPPlanSpec:
    """One plan file, loaded. `plan` is diffusers-format; hand `diffusers_plan(model)` to `apply_context_parallel`:
    it is `plan` itself unless `extra_gathers` is non-empty (Helios), whose gathers `plan` cannot hold."""

    model_class: str
    training_supported: bool
    reason: str | None
    per_head_mask_inputs: tuple[str, ...]
    plan: DiffusersPlan
    path: Path
    # Gathers on wildcard paths that `plan` also splits (see the module docstring). Empty for every plan but Helios.
    extra_gathers: dict[str, GatherPlan] = field(default_factory=dict)
    # Every attention sequence is built from this plan's splits, so per-rank lengths can come from the
    # layout registry instead of a size exchange in every layer (train/cp/layout.py). Off unless the file says so.
    layout_registry: bool = False
    # Module paths (wildcards allowed) whose attention modules see only replicated, unsplit tokens (e.g. a text
    # refiner that runs before the sequence is split): they attend locally on every rank instead of through Ulysses,
    # which would gather N identical copies of the sequence.
    local_attention: tuple[str, ...] = ()
    # "module:function" called with the model before CP attaches: it swaps in attention processors whose masks CP
    # can split (e.g. a key-padding mask where the stock processor builds a (B, 1, S, S) mask from local lengths).
    cp_processors: str | None = None
    # The forward builds one mask whole over a joint sequence made of these splits ("<plan path>:<input>" or
    # "<plan path>:<output index>"), in model order, each rank's keys being the same concatenation of its shards
    # (HunyuanVideo's [video | text] key mask): CP reorders its keys into the ranks' order (train/cp/masks.py).
    joint_key_mask: tuple[str, ...] = ()
    # The modules after the plan's gathers run on the whole, replicated sequence (forward() reshapes the tokens before
    # its output layer, so the last block's output is gathered): gathers multiply their backward by the CP degree and
    # the model's output gradient is divided by it, so each rank holds 1/CP of those modules' gradients and a share
    # of the others', and the SUM over CP ranks is the serial gradient.
    replicated_tail: bool = False

    def diffusers_plan(self, model: torch.nn.Module) -> DiffusersPlan:
        """`plan` plus `extra_gathers` expanded to this model's concrete module paths: what to hand to diffusers."""
        if not self.extra_gathers:
            return dict(self.plan)
        out = dict(self.plan)
        for path, gather in self.extra_gathers.items():
            found, error = _find_modules(model, path)
            if error is not None:
                raise ValueError(f"{_display(self.path)}: plan path {path!r}: {error}")
            for concrete, _ in found:
                if concrete in out:  # a concrete path that splits and gathers (SkyReels-V2's proj_out)
                    raise ValueError(f"{_display(self.path)}: plan path {path!r}: {concrete!r} both splits and "
                                     "gathers, which a diffusers plan (one value per path) cannot hold; apply it "
                                     "with train.cp.enable_context_parallel")  # fmt: skip
                out[concrete] = gather
        return out


@dataclass(frozen=True)
class ResolvedEntry:
    """What the plan does to one concrete module. Equality ignores which plan keys contributed (`*_sources`)."""

    split: dict[str | int, ContextParallelInput | tuple[ContextParallelInput, ...]] = field(default_factory=dict)
    gather: tuple[ContextParallelOutput, ...] = ()
    split_sources: tuple[str, ...] = field(default=(), compare=False)
    gather_sources: tuple[str, ...] = field(default=(), compare=False)


# ----------------------------------------------------------------------------------------------------------- loading
# The plan file's schema, checked by the engine recipes use (train/schema.py): strict types, unknown keys named with
# the closest valid one, every problem reported as `<file>: <dotted.key>: <problem>`.


class PlanError(SchemaError):
    """Invalid plan file; `errors` holds one `<file>: <dotted.key>: <problem>` line per problem."""

    what = "the plan file"


def _identifier(what: str) -> Any:
    def check(name: str) -> str:
        if not name.isidentifier():
            raise ValueError(f"expected {what}, got {name!r}")
        return name

    return AfterValidator(check)


def _module_path(path: str) -> str:
    if path.count("*") > 1:
        raise ValueError("at most one '*' wildcard per module path (a diffusers limit)")
    if path and any(atom == "" or ("*" in atom and atom != "*") for atom in path.split(".")):
        raise ValueError("malformed module path; use dotted attribute names, '*' as a whole segment")
    if any(atom.startswith("-") and atom != "-1" for atom in path.split(".")):
        raise ValueError("the only negative index is -1 (a ModuleList's last element)")
    return path


def _output_index(index: Any) -> Any:
    if not _is_int(index) or index < 0:  # before the int check: a quoted "0" gets this message, not "expected int"
        raise ValueError("output indices must be non-negative integers (unquoted)")
    return index


def _non_empty(message: str) -> Any:
    def check(value: Any) -> Any:
        if not value:
            raise ValueError(message)
        return value

    return AfterValidator(check)


ModulePath = Annotated[str, AfterValidator(_module_path)]
InputName = Annotated[str, _identifier("a forward() argument name")]
OutputIndex = Annotated[int, BeforeValidator(_output_index)]


class Spec(Section):
    """How one tensor is split or gathered."""

    dim: int
    """The split/gather dimension."""
    expected_dims: Annotated[int, Field(ge=1)] | None = None
    """The rank the tensor must have (else diffusers leaves it unsplit, with a warning); null = unchecked."""

    @model_validator(mode="after")
    def _dim_in_range(self) -> Spec:
        e = self.expected_dims
        if e is not None and not -e <= self.dim < e:  # a dim the tensor cannot have: the entry would be a no-op
            report([("dim", f"dim {self.dim} is out of range for a {e}-d tensor")])
        return self


def _one_or_list(empty: str) -> Any:
    """A spec, or a non-empty list of specs (one per element/output): a single mapping stays a single spec."""
    return Annotated[
        Annotated[Spec, Tag("spec")] | Annotated[list[Spec], _non_empty(empty), Tag("list of specs")],
        Discriminator(lambda v: "list of specs" if isinstance(v, list) else "spec"),
    ]


InputSpecs = _one_or_list("empty list; give one spec per element of the argument")
GatherSpecs = Annotated[
    Annotated[Spec, Tag("spec")]
    | Annotated[
        list[Spec | None],
        _non_empty("empty gather list; give one {dim, expected_dims} per module output"),
        Tag("list of specs"),
    ],
    Discriminator(lambda v: "list of specs" if isinstance(v, list) else "spec"),
]  # a list may hold null: that output is left as it is (a block that also returns its text)


class PlanEntry(Section):
    """What the plan does at one module path."""

    split_inputs: Annotated[dict[InputName, InputSpecs], _non_empty("expected a non-empty mapping")] | None = None
    """forward() argument name -> spec, or a list of specs for a list/tuple argument."""
    split_outputs: Annotated[dict[OutputIndex, Spec], _non_empty("expected a non-empty mapping")] | None = None
    """Output index -> spec: the output is split after forward (ContextParallelInput with split_output=True)."""
    gather: GatherSpecs | None = None
    """One spec, or a list with one spec (or null: left as it is) per output of the module (ContextParallelOutput)."""

    @model_validator(mode="after")
    def _not_empty(self) -> PlanEntry:
        if self.split_inputs is None and self.split_outputs is None and self.gather is None:
            report([((), "empty entry; expected one of " + ", ".join(PlanEntry.model_fields))])
        return self

    def split(self) -> SplitPlan:
        out: SplitPlan = {}
        for name, specs in (self.split_inputs or {}).items():
            if isinstance(specs, list):
                out[name] = [ContextParallelInput(s.dim, s.expected_dims) for s in specs]
            else:
                out[name] = ContextParallelInput(specs.dim, specs.expected_dims)
        for index, s in (self.split_outputs or {}).items():
            out[index] = ContextParallelInput(s.dim, s.expected_dims, split_output=True)
        return out

    def gathers(self) -> GatherPlan | None:
        if isinstance(self.gather, list):
            return [None if s is None else ContextParallelOutput(s.dim, s.expected_dims) for s in self.gather]
        return None if self.gather is None else ContextParallelOutput(self.gather.dim, self.gather.expected_dims)


class PlanFile(Section):
    """One cp_plans/*.yaml file."""

    model_class: Annotated[str, _identifier("a class name")]
    """diffusers transformer class, matched against the model's class or its nearest base class, by name."""
    training: Literal["supported", "unsupported"]
    """Whether training under this plan gives correct gradients."""
    reason: str | None = None
    """Why training is unsupported (required then, and only then)."""
    per_head_mask_inputs: list[InputName] = Field(default_factory=list)
    """forward() arguments whose masks Ulysses cannot shard: a training forward that feeds one is refused. Per-head
    masks (B, heads, q, k) do shard (each rank keeps its heads' rows) and are not listed; LTX-2 lists its (B, S, S)
    video self-attention mask."""
    layout_registry: bool = False
    """Attention lengths come from the splits (train/cp/layout.py) instead of a size exchange in every layer."""
    local_attention: list[ModulePath] = Field(default_factory=list)
    """Module paths whose attention runs on replicated tokens: no CP there."""
    cp_processors: str | None = None
    """"module:function" called with the model before CP attaches, to swap in processors CP can split."""
    joint_key_mask: list[str] = Field(default_factory=list)
    """The split inputs ("<plan path>:<input>", or ":<output index>") a mask the forward builds whole over a joint
    sequence is made of, in model order (each rank's keys: the same concatenation of its shards); CP puts the mask's
    keys in the order ranks deliver them. Empty: such a mask is refused."""
    replicated_tail: bool = False
    """The modules after the gathers run on the whole sequence on every rank (the plan gathers the last block's
    output where forward() reshapes the tokens before its output layer); CP scales gradients so that SUM stays exact."""
    plan: Annotated[dict[ModulePath, PlanEntry], _non_empty("expected a non-empty mapping of module path -> entry")]
    """Module path ("" = the model, one '*' = every element of a ModuleList) -> what is split or gathered there."""

    @model_validator(mode="after")
    def _rules(self) -> PlanFile:
        problems: list[tuple[tuple[str, ...], str]] = []
        if self.training == "unsupported" and not (self.reason or "").strip():
            problems.append((("reason",), "'training: unsupported' needs a reason (text)"))
        if self.training == "supported" and self.reason is not None:
            problems.append((("reason",), "only 'training: unsupported' takes a reason; use a YAML comment for notes"))
        splits = {f"{path}:{key}" for path, entry in self.plan.items() for key in entry.split()}
        for i, name in enumerate(self.joint_key_mask):
            if name not in splits:
                problems.append((("joint_key_mask", str(i)), f"{name!r} is not a split of this plan (known: "
                                 f"{', '.join(sorted(splits)) or 'none'})"))  # fmt: skip
        if len(self.joint_key_mask) == 1:
            problems.append((("joint_key_mask",), "a joint sequence has at least two segments"))
        report(problems)
        return self

    def to_spec(self, path: Path) -> CPPlanSpec:
        plan: DiffusersPlan = {}
        extra_gathers: dict[str, GatherPlan] = {}
        for module_path, entry in self.plan.items():
            split, gather = entry.split(), entry.gathers()
            if split and gather is not None:  # a wildcard path that splits and gathers (see the module docstring)
                extra_gathers[module_path] = gather
            plan[module_path] = split if split else gather
        return CPPlanSpec(
            model_class=self.model_class,
            training_supported=self.training == "supported",
            reason=self.reason,
            per_head_mask_inputs=tuple(self.per_head_mask_inputs),
            plan=plan,
            path=path,
            extra_gathers=extra_gathers,
            layout_registry=self.layout_registry,
            local_attention=tuple(self.local_attention),
            cp_processors=self.cp_processors,
            joint_key_mask=tuple(self.joint_key_mask),
            replicated_tail=self.replicated_tail,
        )


def _display(path: Path) -> str:
    """A path relative to the repo when it is inside it (short error messages), else as given."""
    try:
        return str(Path(path).resolve().relative_to(PLAN_DIR.parent))
    except ValueError:
        return str(path)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # YAML `true` is a bool, and bool is an int


def load_plan_file(path: str | Path) -> CPPlanSpec:
    """Load and strictly check one plan file. Raises PlanError (a UserError) naming the file and each dotted key."""
    path = Path(path)
    source = _display(path)
    try:
        raw = load_yaml(path.read_text(encoding="utf-8"))
    except OSError as exc:
        why = exc.strerror or str(exc)
        fix = "point model.cp_plan at a plan YAML (cp_plans/ holds the shipped ones), or null for the shipped plan"
        raise PlanError([f"{source}: cannot read the CP plan ({why}); {fix}"]) from exc
    except yaml.YAMLError as exc:
        raise PlanError([f"{source}: invalid YAML: {exc}"]) from exc
    plan, errors = validate(PlanFile, raw, source)
    if errors:
        raise PlanError(errors)
    return plan.to_spec(path)


def load_plans(plan_dir: str | Path = PLAN_DIR) -> dict[str, CPPlanSpec]:
    """Every `*.yaml` in `plan_dir`, by `model_class`. Two files for one class is an error (which would win?).
    Parsed once per process while the files are unchanged (a model enabled twice reads no YAML again)."""
    files = tuple((str(f), f.stat().st_mtime_ns) for f in sorted(Path(plan_dir).glob("*.yaml")))
    return dict(_load_plans(files))


@functools.lru_cache(maxsize=8)
def _load_plans(files: tuple[tuple[str, int], ...]) -> dict[str, CPPlanSpec]:
    specs: dict[str, CPPlanSpec] = {}
    for name, _ in files:
        file = Path(name)
        spec = load_plan_file(file)
        if spec.model_class in specs:
            other = _display(specs[spec.model_class].path)
            raise ValueError(f"{_display(file)}: model_class {spec.model_class} is already planned by {other}")
        specs[spec.model_class] = spec
    return specs


def plan_for(model_or_class: torch.nn.Module | type | str, plan_dir: str | Path = PLAN_DIR) -> CPPlanSpec:
    """The shipped plan for a model (instance, class or class name): its class, else its nearest planned base."""
    if isinstance(model_or_class, str):
        names = [model_or_class]
    else:
        cls = model_or_class if isinstance(model_or_class, type) else type(_unwrap(model_or_class))
        names = [c.__name__ for c in cls.__mro__]
    specs = load_plans(plan_dir)
    for name in names:  # MRO order = nearest first
        if name in specs:
            return specs[name]
    raise ValueError(
        f"no CP plan for {names[0]} (nor its base classes) in {_display(Path(plan_dir))}; "
        f"plans exist for: {', '.join(sorted(specs)) or 'none'}"
    )


# --------------------------------------------------------------------------------------------------------- resolving


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    # torch.compile wraps modules in an OptimizedModule; diffusers' hooks look through it the same way.
    return getattr(module, "_orig_mod", module)


def _find_modules(model: torch.nn.Module, path: str) -> tuple[list[tuple[str, torch.nn.Module]], str | None]:
    """Concrete (path, module) pairs that `path` names, like diffusers' `_get_submodule_by_name`, or an error."""
    if path == "":
        return [("", model)], None
    if path.count("*") > 1:
        return [], "at most one '*' wildcard is allowed"
    frontier: list[tuple[str, torch.nn.Module]] = [("", _unwrap(model))]
    for atom in path.split("."):
        step: list[tuple[str, torch.nn.Module]] = []
        for prefix, module in frontier:
            where = repr(prefix) if prefix else "the model"
            if atom == "*":
                if not isinstance(module, torch.nn.ModuleList):
                    return [], f"'*' needs a ModuleList, but {where} is a {type(module).__name__}"
                step.extend((f"{prefix}.{i}" if prefix else str(i), _unwrap(m)) for i, m in enumerate(module))
            elif atom == "-1" and isinstance(module, torch.nn.ModuleList) and len(module):
                # The last block, at any depth: the concrete path names its index.
                step.append((f"{prefix}.{len(module) - 1}" if prefix else str(len(module) - 1), _unwrap(module[-1])))
            else:
                # `_modules`, not getattr: a parameter or a config attribute of the same name is not a hook target.
                child = module._modules.get(atom)
                if not isinstance(child, torch.nn.Module):
                    return [], f"{atom!r} is not a submodule of {type(module).__name__}"
                step.append((f"{prefix}.{atom}" if prefix else atom, _unwrap(child)))
        frontier = step
    if not frontier:
        return [], "the '*' wildcard matches no module (empty ModuleList)"
    return frontier, None


def _plan_items(plan: CPPlanSpec | Mapping[str, Any]) -> list[tuple[str, Any]]:
    """(path, split dict | gather) pairs, including a spec's extra gathers (so a path may appear twice)."""
    if isinstance(plan, CPPlanSpec):
        return [*plan.plan.items(), *plan.extra_gathers.items()]
    return list(plan.items())


def _as_gather_tuple(value: Any) -> tuple | None:
    if isinstance(value, ContextParallelOutput):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return None


def _resolve(
    plan: CPPlanSpec | Mapping[str, Any], model: torch.nn.Module
) -> tuple[dict[str, ResolvedEntry], list[str]]:
    """Expand wildcards and merge per concrete module; problems are returned, not raised (validate_plan lists all)."""
    split: dict[str, dict] = {}
    gather: dict[str, tuple] = {}
    split_src: dict[str, list[str]] = {}
    gather_src: dict[str, list[str]] = {}
    problems: list[str] = []
    for path, value in _plan_items(plan):
        found, error = _find_modules(model, path)
        if error is not None:
            problems.append(f"plan path {path!r}: {error}")
            continue
        gathers = _as_gather_tuple(value)
        if not isinstance(value, dict) and gathers is None:
            problems.append(f"plan path {path!r}: expected a split dict or ContextParallelOutput(s), got {value!r}")
            continue
        for concrete, _ in found:
            if isinstance(value, dict):
                merged = split.setdefault(concrete, {})
                for key, spec in value.items():
                    if key in merged:
                        # Two hooks (one per plan key) would each shard it: the module would see 1/N^2 of it.
                        others = ", ".join(repr(s) for s in split_src[concrete])
                        problems.append(f"plan path {path!r}: {key!r} of {concrete!r} is already split by {others}")
                        continue
                    merged[key] = tuple(spec) if isinstance(spec, (list, tuple)) else spec
                split_src.setdefault(concrete, []).append(path)
            else:
                if concrete in gather:
                    others = ", ".join(repr(s) for s in gather_src[concrete])
                    problems.append(f"plan path {path!r}: {concrete!r} is already gathered by {others}")
                    continue
                gather[concrete] = gathers
                gather_src.setdefault(concrete, []).append(path)
    resolved = {
        concrete: ResolvedEntry(
            split=split.get(concrete, {}),
            gather=gather.get(concrete, ()),
            split_sources=tuple(split_src.get(concrete, ())),
            gather_sources=tuple(gather_src.get(concrete, ())),
        )
        for concrete in sorted(set(split) | set(gather))
    }
    return resolved, problems


def resolve_plan(plan: CPPlanSpec | Mapping[str, Any], model: torch.nn.Module) -> dict[str, ResolvedEntry]:
    """Concrete module path (e.g. "blocks.0.attn1") -> what the plan does there, wildcards expanded and merged.

    Two plans that do the same thing to the same modules resolve equal, however they spell it (wildcard vs one key
    per block, single gather vs one-element list). Raises ValueError when a path does not resolve.
    """
    resolved, problems = _resolve(plan, model)
    if problems:
        raise ValueError("cannot resolve the CP plan:\n  - " + "\n  - ".join(problems))
    return resolved


# -------------------------------------------------------------------------------------------------------- validation


def _forward_params(module: torch.nn.Module) -> set[str]:
    # diffusers maps split-input names to positions with inspect.signature(cls.forward), so *args/**kwargs don't count.
    params = list(inspect.signature(type(_unwrap(module)).forward).parameters.values())[1:]
    return {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def _check_split_value(path: str, key: Any, value: Any) -> str | None:
    if isinstance(key, str):
        specs = value if isinstance(value, (list, tuple)) else [value]
        if not specs or not all(isinstance(s, ContextParallelInput) and not s.split_output for s in specs):
            return f"plan path {path!r}: input {key!r} needs ContextParallelInput(s) with split_output=False"
        return None
    if _is_int(key):
        if key < 0:
            return f"plan path {path!r}: output index {key} is negative"
        if not (isinstance(value, ContextParallelInput) and value.split_output):
            return f"plan path {path!r}: output {key} needs one ContextParallelInput with split_output=True"
        return None
    return f"plan path {path!r}: split keys are forward() argument names or int output indices, got {key!r}"


def validate_plan(spec: CPPlanSpec, model: torch.nn.Module) -> None:
    """Check a plan against a model instance; raise one ValueError listing every problem found."""
    problems: list[str] = []
    names = [c.__name__ for c in type(_unwrap(model)).__mro__]
    if spec.model_class not in names:
        problems.append(f"the plan is for {spec.model_class}, the model is a {names[0]}")
    _, resolve_problems = _resolve(spec, model)
    problems += resolve_problems

    for path, value in _plan_items(spec):
        found, error = _find_modules(model, path)
        if error is not None:
            continue  # already reported by _resolve
        if isinstance(value, dict):
            if not value:
                problems.append(f"plan path {path!r}: empty split dict")
            for key, item in value.items():
                problem = _check_split_value(path, key, item)
                if problem:
                    problems.append(problem)
                    continue
                if isinstance(key, str):
                    missing = sorted({type(m).__name__ for _, m in found if key not in _forward_params(m)})
                    if missing:
                        problems.append(
                            f"plan path {path!r}: {key!r} is not a forward() argument of {', '.join(missing)}"
                        )
        else:
            gathers = _as_gather_tuple(value)
            if gathers is not None and not gathers:
                problems.append(f"plan path {path!r}: empty gather list")
            elif gathers is not None and not any(isinstance(g, ContextParallelOutput) for g in gathers):
                problems.append(f"plan path {path!r}: a gather list needs at least one spec")
            elif gathers is not None and not all(g is None or isinstance(g, ContextParallelOutput) for g in gathers):
                problems.append(f"plan path {path!r}: gathers must be ContextParallelOutput, got {value!r}")

    for path in spec.local_attention:
        found, error = _find_modules(model, path)
        if error is not None:
            problems.append(f"local_attention {path!r}: {error}")
        elif not local_attention_processors(model, [path]):
            problems.append(f"local_attention {path!r}: no attention module there")

    root_params = _forward_params(model)
    for name in spec.per_head_mask_inputs:
        if name not in root_params:
            problems.append(f"per_head_mask_inputs: {name!r} is not a forward() argument of {names[0]}")

    if problems:
        raise ValueError(
            f"{_display(spec.path)}: the CP plan for {spec.model_class} does not fit this {names[0]}:\n  - "
            + "\n  - ".join(problems)
        )


def local_attention_processors(model: torch.nn.Module, paths: Iterable[str]) -> list[Any]:
    """The attention processors of every attention module at or under `paths` (they stay out of CP)."""
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    modules: dict[int, torch.nn.Module] = {}  # one entry per attention module, however the paths overlap
    for path in paths:
        found, _ = _find_modules(model, path)
        for _, top in found:
            modules.update((id(m), m) for m in top.modules() if isinstance(m, (Attention, AttentionModuleMixin)))
    return [m.processor for m in modules.values()]


def _inside_repeated_block(model: torch.nn.Module, path: str) -> str | None:
    """The repeated block (a ModuleList element) that `path` is, or is inside of; None when there is none."""
    module, walked = _unwrap(model), []
    for atom in path.split(".") if path else []:
        walked.append(atom)
        if isinstance(module, torch.nn.ModuleList):
            return ".".join(walked)
        module = _unwrap(module._modules[atom])
    return None


def _is_last_block(model: torch.nn.Module, path: str) -> bool:
    """`path` is the last element of a ModuleList (a block itself, not a module inside one)."""
    parent, _, index = path.rpartition(".")
    found, error = _find_modules(model, parent) if parent else ([("", model)], None)
    return error is None and isinstance(found[0][1], torch.nn.ModuleList) and index == str(len(found[0][1]) - 1)


def _few(paths: list[str], limit: int = 3) -> str:
    shown = ", ".join(paths[:limit])
    return shown if len(paths) <= limit else f"{shown}, ... ({len(paths)} modules)"


def training_problems(spec: CPPlanSpec, model: torch.nn.Module) -> list[str]:
    """Why training under this plan would give wrong gradients; [] means none found. The plan must resolve.

    CP training is correct when every rank runs the replicated prefix, shards the sequence, and the loss is taken on
    one output gathered at the end: each parameter's gradient is then the SUM over ranks of their shard's share.
    Gathering inside a repeated block makes the sequence replicated again between sub-layers of every block, so part
    of the compute runs on all ranks and the per-parameter gradients are neither the SUM nor the MEAN over ranks.
    The one exception is the last block's output under `replicated_tail` (the stream ends there).
    """
    problems: list[str] = []
    if not spec.training_supported:
        problems.append(f"training: unsupported: {spec.reason}")
    resolved = resolve_plan(spec, model)

    inside: dict[str, list[str]] = {}  # gathering plan key -> concrete modules inside repeated blocks
    both: dict[tuple[tuple[str, ...], tuple[str, ...]], list[str]] = {}
    for concrete, entry in resolved.items():
        if entry.gather and spec.replicated_tail and _is_last_block(model, concrete):
            continue  # the stream's end: what follows runs replicated, with its gradients scaled (enable.py)
        if entry.gather and _inside_repeated_block(model, concrete) is not None:
            for source in entry.gather_sources:
                inside.setdefault(source, []).append(concrete)
        if entry.gather and entry.split and _inside_repeated_block(model, concrete) is not None:
            both.setdefault((entry.split_sources, entry.gather_sources), []).append(concrete)
    for source, concretes in inside.items():
        problems.append(
            f"plan path {source!r} gathers inside a repeated block ({_few(concretes)}): the loss is not taken on one "
            "fully gathered output at the end, so per-parameter gradients are neither SUM nor MEAN over CP ranks"
        )
    for (split_src, gather_src), concretes in both.items():
        problems.append(
            f"{_few(concretes)} is both split (by {', '.join(map(repr, split_src))}) and gathered "
            f"(by {', '.join(map(repr, gather_src))}): that module runs sharded inside an otherwise replicated stream"
        )
    if not any(entry.gather for entry in resolved.values()):
        problems.append("the plan never gathers: the loss would be taken on one rank's shard of the output")
    if not any(entry.split for entry in resolved.values()):
        problems.append("the plan never splits: gathering a replicated tensor repeats it CP-degree times")
    return problems
