"""The one schema engine for every YAML file we read (recipes: train/config.py; CP plans: train/cp/plans.py).

A file's schema is a tree of pydantic v2 models derived from `Section`: unknown keys are errors (`extra="forbid"`),
types are strict (`int` does not take `true`, `str` does not take `7`; `float` does take ints) and each field is
documented by the string literal right under it (`use_attribute_docstrings`). Rules that concern one value live in its
annotation (`Annotated[int, Field(ge=1)]`, `Annotated[str, AfterValidator(...)]`), so a `--set` override of that key
is checked by the same rule; rules across fields are `model_validator(mode="after")`s that call `report` with every
problem they find (they run once the section's own fields are valid).

`validate(schema, data, source)` turns pydantic's errors into one line per problem, `<source>: <dotted.path>:
<problem>`, walking the schema along each error's location: mapping keys are joined with dots (a key holding a dot is
quoted: `plan."blocks.0".gather`), list items are `[i]`, an unknown key names the closest valid key and lists the valid
ones, and a wrong type says what was expected (`expected float or null, got 'fast' (str)`). The lines are raised
together as one `SchemaError` (a `UserError`); recipes raise its subclass `RecipeError`.

YAML is read YAML 1.2-like where 1.1 surprises: `1e-4` is a float (1.1 reads a string) and only `true`/`false` are
booleans (1.1 reads `no`, `off`, `yes`, `on` as booleans, so `mixed_precision: no` stays a string). Duplicate keys
are errors (PyYAML silently keeps the last one).
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from collections.abc import Iterable, Sequence
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Tag, TypeAdapter, ValidationError
from pydantic_core import PydanticCustomError

from train.errors import UserError

__all__ = [
    "STRICT",
    "SchemaError",
    "Section",
    "annotation_of",
    "doc",
    "dotted",
    "dump_yaml",
    "json_schema",
    "load_yaml",
    "report",
    "keys_of",
    "show",
    "suggest",
    "suggest_key",
    "type_name",
    "validate",
]

Loc = tuple[str | int, ...]
Problem = tuple[Loc, str]  # (location inside the validated data, problem)

STRICT = ConfigDict(strict=True, allow_inf_nan=False)  # a number in a recipe is finite (`.inf`, `.nan`)


class Section(BaseModel):
    """Base of every schema model: strict types, no unknown keys, field docs from the docstring under each field."""

    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True, allow_inf_nan=False)


class SchemaError(UserError):
    """Invalid file or override; `errors` holds one `<source>: <dotted.path>: <problem>` line per problem. A user
    error (train/errors.py): every rank reads the same file and raises the same lines, so rank 0 alone prints them."""

    what = "the file"

    def __init__(self, errors: Sequence[str]) -> None:
        self.errors = list(errors)
        if len(self.errors) == 1:
            super().__init__(self.errors[0])
        else:
            super().__init__("\n  ".join([f"{len(self.errors)} problems in {self.what}:", *self.errors]))


def report(problems: Iterable[tuple[str | Loc, str]]) -> None:
    """Raise every cross-field problem a model validator found, each as (where, message); no problems: no-op.

    `where` is a dotted key under the model ("checkpoint.export") or a location tuple (for keys holding dots:
    ("plan", "blocks.0")). `validate` expands them into one line each, under the model's own path.
    """
    found = [(tuple(where.split(".")) if isinstance(where, str) else tuple(where), msg) for where, msg in problems]
    if found:
        raise PydanticCustomError("problems", "{count} problem(s)", {"count": len(found), "problems": found})


# ------------------------------------------------------------------------------------------------------ messages


def show(value: Any) -> str:
    """`'fast' (str)`, `True (bool)`, `null`: a value as an error message quotes it."""
    if value is None:
        return "null"
    text = repr(value)
    text = text if len(text) <= 80 else text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def suggest(word: Any, options: Iterable[str]) -> str:
    """` (did you mean 'lr'?)` when an option is close to `word`, else ``."""
    close = difflib.get_close_matches(str(word), list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def suggest_key(word: Any, siblings: Iterable[str], schema: Any) -> str:
    """` (did you mean 'lr'?)` from the keys beside `word`; when none is close, the closest key anywhere in `schema`,
    dotted (` (did you mean 'finetune.lora_rank'?)`): a key put in the wrong section."""
    hint = suggest(word, siblings)
    if hint:
        return hint
    every = {}  # last component -> first dotted key with that name
    for key in keys_of(schema):
        every.setdefault(key.rsplit(".", 1)[-1], key)
    close = difflib.get_close_matches(str(word), list(every), n=1)
    return f" (did you mean {every[close[0]]!r}?)" if close else ""


def keys_of(schema: Any, prefix: str = "") -> list[str]:
    """Every dotted key of a schema: the fields of its models, sections (`X | None` too) expanded."""
    out = []
    tp = _strip(schema)
    for arm in typing.get_args(tp) if _is_union(tp) else (tp,):
        arm = _strip(arm)
        if _is_model(arm):
            for name, info in arm.model_fields.items():
                out += [prefix + name, *keys_of(info.annotation, f"{prefix}{name}.")]
    return out


def _strip(tp: Any) -> Any:
    while typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def type_name(tp: Any) -> str:
    """What a value of annotation `tp` looks like, for error messages and --list-keys: `a list of float`, ..."""
    tp = _strip(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return "anything"
    if tp is type(None):
        return "null"
    if _is_model(tp) or origin is dict or tp is dict:
        return "a mapping"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if _is_union(tp):
        return " or ".join(type_name(a) for a in args)
    if origin is list:
        item = type_name(args[0]) if args else "anything"
        return "a list of mappings" if item == "a mapping" else f"a list of {item}"
    return getattr(tp, "__name__", str(tp))


def dotted(loc: Iterable[str | int | tuple[str, Any]]) -> str:
    """`plan."blocks.0".split_inputs.hidden_states`, `train.betas[1]`: keys joined by dots, list items as [i].

    Items are keys, or ("index", i) for a list item; keys holding a dot, a space or nothing are quoted.
    """
    out = ""
    for item in loc:
        if isinstance(item, tuple):
            out += f"[{item[1]}]"
            continue
        text = str(item)
        text = f'"{text}"' if (text == "" or "." in text or " " in text) else text
        out += f".{text}" if out else text
    return out


def _tags(tp: Any) -> dict[str, Any]:
    """Tag name -> arm of a tagged union (`Annotated[X, Tag("one")] | ...`)."""
    out = {}
    for arm in typing.get_args(tp):
        for meta in getattr(arm, "__metadata__", ()):
            if isinstance(meta, Tag):
                out[meta.tag] = arm
    return out


class _Where:
    """Where an error's location points in a schema: the dotted path, the annotation there, the parent model."""

    def __init__(self, schema: Any, loc: Loc, prefix: Loc = ()) -> None:
        self.path: list[str | int | tuple[str, Any]] = list(prefix)
        self.tp: Any = schema  # the annotation at the last real (non-tag) step: what the value should have been
        self.parent: type[BaseModel] | None = None  # the model owning the last key, when it is a model field
        self.unknown = False  # the last key is not a field of `parent`
        self.is_key = False  # the error is about a mapping key, not its value
        tp, items = schema, list(loc)
        i = 0
        while i < len(items):
            seg = items[i]
            tp = _strip(tp)
            if _is_union(tp):
                tags = _tags(tp)
                if seg in tags:  # a tagged union's arm: not part of the path
                    tp, i = tags[seg], i + 1
                    continue
                arms = [a for a in typing.get_args(tp) if a is not type(None)]
                tp = arms[0] if len(arms) == 1 else Any
                continue
            self.parent, self.unknown = None, False
            if _is_model(tp):
                self.path.append(seg)
                self.parent = tp
                if seg in tp.model_fields:
                    tp = tp.model_fields[seg].annotation
                else:
                    tp, self.unknown = Any, True
            elif typing.get_origin(tp) is dict:
                key_tp, value_tp = typing.get_args(tp)
                self.path.append(seg)
                if i + 1 < len(items) and items[i + 1] == "[key]":
                    tp, self.is_key, i = key_tp, True, i + 1
                else:
                    tp = value_tp
            elif typing.get_origin(tp) in (list, tuple) and isinstance(seg, int):
                self.path.append(("index", seg))
                tp = (typing.get_args(tp) or (Any,))[0]
            else:
                self.path.append(("index", seg) if isinstance(seg, int) else seg)
                tp = Any
            self.tp = tp
            i += 1

    def parent_path(self) -> str:
        return dotted(self.path[:-1])


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
_BOUND_KEYS = {"greater_than": "gt", "greater_than_equal": "ge", "less_than": "lt", "less_than_equal": "le"}


def _message(error: Any, where: _Where, schema: Any) -> str:
    kind, ctx, value = error["type"], error.get("ctx") or {}, error.get("input")
    if kind == "missing":
        return f"missing required key ({type_name(where.tp)})"
    if kind == "extra_forbidden":
        fields = list(where.parent.model_fields) if where.parent else []
        of = f" of {where.parent_path()}" if where.parent_path() else ""
        return f"unknown key{suggest_key(where.path[-1], fields, schema)}; valid keys{of}: " + ", ".join(fields)
    if kind in ("value_error", "assertion_error"):
        return str(ctx.get("error", error["msg"]))
    if kind == "finite_number":
        return f"must be a finite number, got {_number(value)}"
    if kind in _BOUNDS:
        return f"must be {_BOUNDS[kind]} {_number(ctx[_BOUND_KEYS[kind]])}, got {_number(value)}"
    if kind.endswith("_type") or kind.endswith("_parsing") or kind in ("literal_error", "int_from_float"):
        tp = _strip(where.tp)
        hint = ""
        if isinstance(value, str) and typing.get_origin(tp) is Literal:
            hint = suggest(value, [str(a) for a in typing.get_args(tp)])
        what = f"{type_name(where.tp)} keys" if where.is_key else type_name(where.tp)
        return f"expected {what}, got {show(value)}{hint}"
    return error["msg"]  # pragma: no cover - a pydantic error kind this schema does not produce


def _lines(exc: ValidationError, schema: Any, source: str, prefix: Loc = ()) -> list[str]:
    out = []
    for error in exc.errors(include_url=False):
        loc = tuple(error["loc"])
        subs = error["ctx"]["problems"] if error["type"] == "problems" else [((), None)]
        for sub, problem in subs:
            where = _Where(schema, (*loc, *sub), prefix)
            message = problem if problem is not None else _message(error, where, schema)
            path = dotted(where.path)
            out.append(f"{source}: {path}: {message}" if path else f"{source}: {message}")
    return out


def validate(schema: Any, data: Any, source: str, prefix: Loc = ()) -> tuple[Any, list[str]]:
    """`data` validated against `schema` (a Section class or any annotation): (value, []) or (None, error lines).

    `prefix` is where `data` sits in a bigger file (a `--set` key), so the lines name the full dotted path.
    """
    adapter = TypeAdapter(schema) if _is_model(_strip(schema)) else TypeAdapter(schema, config=STRICT)
    try:
        return adapter.validate_python(data), []
    except ValidationError as exc:
        return None, _lines(exc, schema, source, prefix)


def doc(text: str | None) -> str:
    """A field's docstring on one line (a long one wraps in the source)."""
    return " ".join((text or "").split())


def json_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a file validated by `model`, descriptions on one line."""

    def tidy(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: doc(v) if k == "description" and isinstance(v, str) else tidy(v) for k, v in node.items()}
        return [tidy(v) for v in node] if isinstance(node, list) else node

    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **tidy(model.model_json_schema())}


def annotation_of(model: type[BaseModel], name: str) -> Any:
    """The full annotation of a model field, its constraints and validators included (to validate it on its own)."""
    info = model.model_fields[name]
    return Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation


# ---------------------------------------------------------------------------------------------------------------- YAML

_FLOAT_12 = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)
_BOOL_12 = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_BOOL_TAG = "tag:yaml.org,2002:bool"
_FLOAT_TAG = "tag:yaml.org,2002:float"


class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # libyaml when built in: ~10x faster
    """SafeLoader with YAML 1.2 floats (`1e-4`) and booleans (only true/false), rejecting duplicate keys."""


_Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in resolvers if tag not in (_BOOL_TAG, _FLOAT_TAG)]
    for ch, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(_BOOL_TAG, _BOOL_12, list("tTfF"))
_Loader.add_implicit_resolver(_FLOAT_TAG, _FLOAT_12, list("-+0123456789."))


def _construct_unique_mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if isinstance(key, (str, int, float, bool, type(None))):  # a complex key: construct_mapping reports it
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


class _Dumper(yaml.SafeDumper):
    """SafeDumper that quotes strings either YAML 1.1 or our loader would read as non-strings (`no`, `1e-4`)."""


_Dumper.yaml_implicit_resolvers = {ch: list(rs) for ch, rs in yaml.SafeDumper.yaml_implicit_resolvers.items()}
_Dumper.add_implicit_resolver(_FLOAT_TAG, _FLOAT_12, list("-+0123456789."))


def load_yaml(text: str) -> Any:
    """Parse YAML text in our dialect; raises yaml.YAMLError (a duplicate key is one)."""
    return yaml.load(text, Loader=_Loader)  # a SafeLoader subclass: no arbitrary objects


def dump_yaml(data: Any, **kwargs: Any) -> str:
    """YAML text that `load_yaml` reads back to `data` (keys in insertion order)."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, **kwargs)
