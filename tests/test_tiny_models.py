"""Serial sanity checks for train/tools/tiny_models.py (CPU, fast). Run with ``-s`` to see the per-model summary.

Generic over the discovered families (every family's tiny transformer and its spec-built inputs) plus the two guard
models (Helios, LTX-2).
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import re
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from diffusers.models.attention import AttentionModuleMixin
from diffusers.models.attention_processor import Attention

from train.cp import whole
from train.cp.plans import local_attention_processors, plan_for, resolve_plan
from train.models import family_names, get_family
from train.tools import tiny_models as tm

CP_DEGREES = (2, 3, 4)
# CosmosRotaryPosEmbed divides by (head_dim // 6 * 2 - 2): a head dim of 8 gives 0
HEAD_DIM = {"cosmos": 12}
# Z-Image pads its image tokens and each caption to a multiple of 32 (SEQ_MULTI_OF) before it builds the sequence its
# plan splits: 2 and 4 divide every such length, 3 the tiny one (128) not (7: tests/test_new_families.py)
PADDED_TO = {"zimage": 32}
# Kandinsky 5's time embedding feeds fp32 sinusoids to its first linear (the class keeps it in fp32): no float64 model
# runs. Its checks here run in float32 (tests/test_cp_models.py skips its fp64 runs likewise).
NO_FP64 = {n for n in tm.FAMILY_NAMES if get_family(n).transformer_class == "Kandinsky5Transformer3DModel"}


def _forward_backward(name: str, seed: int = 0) -> tuple[torch.nn.Module, list[torch.Tensor], torch.Tensor, float]:
    model = tm.build_model(name, seed=seed)
    inputs = tm.build_inputs(name, seed=seed)
    start = time.perf_counter()
    outputs = tm.output_tensors(name, model(**inputs, return_dict=False))
    loss = tm.make_loss(name, outputs, seed=seed)
    loss.backward()
    return model, outputs, loss, (time.perf_counter() - start) * 1e3


def _heads(name: str) -> list[int]:
    cfg = tm.tiny_config(name)
    return [cfg[k] for k in ("num_attention_heads", "audio_num_attention_heads", "n_heads") if k in cfg]  # Z-Image's


def _head_dim(name: str) -> int:
    cfg = tm.tiny_config(name)
    return get_family(name).attention_shape(cfg)[1] if name in tm.FAMILY_NAMES else cfg["attention_head_dim"]


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def test_names() -> None:
    assert tm.FAMILY_NAMES == family_names() and len(tm.FAMILY_NAMES) >= 7
    assert tm.GUARD_MODEL_NAMES == ("helios",) and tm.TRAINED_MODEL_NAMES == ()  # LTX-2 is a family
    assert not set(tm.OTHER_MODEL_NAMES) & set(tm.FAMILY_NAMES)
    with pytest.raises(KeyError):
        tm.build_model("nope")


@pytest.mark.parametrize("name", tm.FAMILY_NAMES)
def test_tiny_config_is_the_tiny_recipe_init_config(name: str) -> None:
    """The family's tiny config (``train.models.tiny_config``, read as plain YAML) is what its tiny recipe validates."""
    recipe = tm.tiny_recipe(name)
    assert recipe.model.family == name
    assert {k: _plain(v) for k, v in tm.tiny_config(name).items()} == _plain(recipe.model.init_config)
    assert set(get_family(name).batch_keys) <= set(recipe.data.synthetic.shapes)


@pytest.mark.parametrize("name", tm.ALL_MODEL_NAMES)
def test_forward_backward_deterministic_and_all_grads_nonzero(name: str) -> None:
    start = time.perf_counter()
    model, outputs, loss, fwd_bwd_ms = _forward_backward(name)
    build_and_run_s = time.perf_counter() - start
    assert build_and_run_s < 5.0
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert torch.isfinite(loss)
    assert all(torch.isfinite(o).all() for o in outputs)

    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    no_grad = [n for n, p in params if p.grad is None]
    zero_grad = [n for n, p in params if p.grad is not None and not torch.any(p.grad)]
    assert not no_grad, f"{name}: parameters without gradient: {no_grad}"
    assert not zero_grad, f"{name}: parameters with all-zero gradient: {zero_grad}"
    assert all(torch.isfinite(p.grad).all() for _, p in params)

    # Same seed twice -> bitwise identical outputs, loss and gradients.
    model2, outputs2, loss2, _ = _forward_backward(name)
    for a, b in zip(outputs, outputs2, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(loss, loss2)
    for (n, p), (n2, p2) in zip(model.named_parameters(), model2.named_parameters(), strict=True):
        assert n == n2 and torch.equal(p, p2)
        assert (p.grad is None and p2.grad is None) or torch.equal(p.grad, p2.grad)

    # A different seed changes weights, inputs and target.
    _, outputs3, loss3, _ = _forward_backward(name, seed=1)
    assert not torch.equal(outputs[0], outputs3[0])
    assert not torch.equal(loss, loss3)

    min_grad = min((p.grad.abs().max().item(), n) for n, p in params)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    print(
        f"\n[tiny] {name:11s} params={tm.count_params(model):>7,d} (frozen {frozen:,d}) heads={_heads(name)} "
        f"head_dim={_head_dim(name)} tokens={tm.token_counts(name)} "
        f"batch={tm.batch_size(name)} out={[tuple(o.shape) for o in outputs]} loss={loss.item():.3f} "
        f"fwd+bwd={fwd_bwd_ms:.1f}ms min|grad|max={min_grad[0]:.1e} ({min_grad[1]})"
    )


@pytest.mark.parametrize("name", [n for n in tm.FAMILY_NAMES if n not in NO_FP64])
def test_float64_matches_float32(name: str) -> None:
    """The CP parity tests also run in float64 (exactness check), through the family's own loss (not Kandinsky 5's:
    no float64 run, see NO_FP64)."""
    outs = {}
    for dtype in (torch.float32, torch.float64):
        model = tm.build_model(name, dtype=dtype)
        case = tm.family_case(name, dtype=dtype)
        assert all(p.dtype == dtype for p in model.parameters())
        assert case.noisy["latents"].dtype == dtype
        outs[dtype] = tm.output_tensors(name, model(**case.kwargs, return_dict=False))
        assert all(o.dtype == dtype for o in outs[dtype])
        tm.family_loss(case, outs[dtype], model.config).backward()
        assert all(p.grad is not None and torch.any(p.grad) for p in model.parameters() if p.requires_grad)
    for a, b in zip(outs[torch.float32], outs[torch.float64], strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", tm.ALL_MODEL_NAMES)
def test_config_sizes(name: str) -> None:
    start = time.perf_counter()
    model = tm.build_model(name)
    assert time.perf_counter() - start < 1.0
    assert all(h == 7 for h in _heads(name)), _heads(name)
    assert _head_dim(name) == HEAD_DIM.get(name, 8)
    # HunyuanVideo 1.5's ByT5 projection has its 2048 hidden width fixed in the class, not in the config: ~4.3M;
    # Z-Image's timestep MLP its 1024 (~0.3M).
    fixed = sum(p.numel() for n, p in model.named_parameters()
                if n.startswith(("context_embedder_2.linear_", "t_embedder.mlp.")))  # fmt: skip
    assert 20_000 <= tm.count_params(model) - fixed <= 300_000
    # Every attention module has 7 heads.
    attn_modules = [m for m in model.modules() if isinstance(m, (Attention, AttentionModuleMixin))]
    heads = {m.heads if hasattr(m, "heads") else m.num_heads for m in attn_modules}  # Kandinsky5Attention: num_heads
    assert heads == {7}, heads


def _plan_split_sizes(model: torch.nn.Module, inputs: dict[str, Any]) -> dict[str, int]:
    """The length of every tensor the model's CP plan splits, recorded by hooks during one serial forward:
    'module path: input name or output index' -> length along the split dim (first call of each module)."""
    split: dict[str, int] = {}

    def record(key: str, value: Any, c: Any) -> None:
        if isinstance(value, torch.Tensor) and c.expected_dims in (None, value.ndim):
            split.setdefault(key, value.shape[c.split_dim])

    def input_hook(signature: inspect.Signature, key: str, label: str, c: Any):
        def hook(module, args, kwargs):
            record(label, signature.bind_partial(*args, **kwargs).arguments.get(key), c)

        return hook

    def output_hook(index: int, label: str, c: Any):
        def hook(module, args, out):
            record(label, out[index], c)

        return hook

    handles = []
    for path, entry in resolve_plan(plan_for(model), model).items():
        module = model.get_submodule(path)
        for key, cpis in entry.split.items():
            for c in cpis if isinstance(cpis, tuple) else (cpis,):
                label = f"{path or '<root>'}: {key}"
                if c.split_output:
                    handles.append(module.register_forward_hook(output_hook(key, label, c)))
                else:
                    hook = input_hook(inspect.signature(module.forward), key, label, c)
                    handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(**inputs, return_dict=False)
    finally:
        for h in handles:
            h.remove()
    return split


@pytest.mark.parametrize("name", tm.FAMILY_NAMES)
def test_family_split_tokens_not_divisible_by_cp_degrees(name: str) -> None:
    """Every tensor the family's CP plan splits (inputs and rope outputs alike) has a length that 2, 3 and 4 do not
    divide, with the default (spec-built) inputs: every split the CP tests run is uneven. And `tokens_per_sample` is
    the transformer's sequence of noised tokens: what the plan splits, alone or packed with the text (MiniMax-H3)."""
    case = tm.family_case(name)
    split = _plan_split_sizes(tm.build_model(name), case.kwargs)
    assert split, f"{name}: the CP plan split nothing"
    pad = PADDED_TO.get(name, 1)
    degrees = [d for d in CP_DEGREES if pad % d]  # the degrees a length padded to a multiple of `pad` can escape
    even = {k: n for k, n in split.items() if not all(n % d for d in degrees)}
    assert not even, f"{name}: split lengths divisible by one of {degrees}: {even} (all: {split})"
    # every cached tensor's shape: editing families count their reference tokens from reference_latents
    shapes = {k: x.shape[1:] for k, x in case.batch.items()} | {s: x[1:] for s, x in case.shapes.items()}
    tokens = case.spec.tokens_per_sample(shapes, tm.tiny_config(name))
    if name in PADDED_TO:  # the image tokens and the longest kept caption, each padded
        tokens, text = (-(-int(n) // pad) * pad for n in (tokens, case.batch["prompt_mask"].sum(dim=1).max()))
    else:
        text = case.kwargs["encoder_hidden_states"].shape[1]
    # two noised streams split apart (LTX-2's video and audio tokens) count together
    pairs = {a + b for a, b in itertools.combinations(split.values(), 2)}
    assert {tokens, tokens + text} & (set(split.values()) | pairs), (tokens, text, split)


@pytest.mark.parametrize("name", tm.OTHER_MODEL_NAMES)
def test_guard_token_counts_not_divisible_by_cp_degrees(name: str) -> None:
    counts = tm.token_counts(name)
    for key, count in counts.items():
        if (name, key) in tm.UNSPLIT_COUNTS:
            continue
        assert all(count % d for d in CP_DEGREES), f"{name}.{key} = {count} divisible by one of {CP_DEGREES}"
    inputs = tm.build_inputs(name)
    assert inputs["encoder_hidden_states"].shape[:2] == (tm.batch_size(name), counts["text"])
    if name == "helios":  # the sequence the blocks see is built inside the model
        model = tm.build_model(name)
        seen: list[int] = []
        model.blocks[0].register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[1]))
        with torch.no_grad():
            model(**inputs, return_dict=False)
        assert seen == [counts["total"]]


def test_batch_sizes() -> None:
    sizes = [tm.batch_size(n) for n in tm.ALL_MODEL_NAMES]
    assert sum(b == 2 for b in sizes) >= 3
    assert set(sizes) <= {1, 2}


@pytest.mark.parametrize("name", tm.FAMILY_NAMES)
def test_frozen_params_are_exactly_the_dead_ones(name: str) -> None:
    """A family's `unused_params` lists exactly the parameters that are structurally unused (grad None or all zero) or
    whose true gradient is zero (HunyuanVideo's token-refiner key bias, cancelled by the softmax: float64 round-off)."""
    dtype = torch.float32 if name in NO_FP64 else torch.float64
    model = tm.build_model(name, dtype=dtype)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    patterns = tm.frozen_params(name, model.config)
    assert all(any(re.fullmatch(pat, n) for pat in patterns) for n in frozen)
    model.requires_grad_(True)
    outputs = tm.output_tensors(name, model(**tm.build_inputs(name, dtype=dtype), return_dict=False))
    tm.make_loss(name, outputs).backward()
    scale = max(p.grad.abs().max().item() for p in model.parameters() if p.grad is not None)
    for n, p in model.named_parameters():
        dead = p.grad is None or p.grad.abs().max().item() <= 1e-12 * scale
        assert dead == (n in frozen), f"{name}.{n}: dead={dead}, frozen={n in frozen}"


def test_some_family_has_unused_params() -> None:
    assert any(tm.frozen_params(n, tm.tiny_config(n)) for n in tm.FAMILY_NAMES)  # Qwen-Image's last text stream


MASKED = [n for n in tm.FAMILY_NAMES if any(k.endswith("_mask") for k in tm.tiny_recipe(n).data.synthetic.shapes)]


@pytest.mark.parametrize("name", MASKED)
def test_family_text_masks_pad_each_prompt_to_its_own_length(name: str) -> None:
    """The inputs every CP test feeds carry the family's text masks as its pipeline passes them (the same with and
    without CP): 2 samples whose prompts keep different numbers of tokens, each padded over more positions than any
    last rank of 2, 3 or 4 holds of the text (the tail), so a mask applied in the wrong key order hides kept tokens
    (the bug class HunyuanVideo's joint mask had)."""
    case = tm.family_case(name, batch_size=2)
    for key in (k for k in case.batch if k.endswith("_mask")):
        mask = case.batch[key].bool()
        kept = mask.sum(dim=-1).tolist()
        assert kept[0] != kept[1] and all(k >= 1 for k in kept), (key, kept)
        assert all(bool(m[:k].all()) and not bool(m[k:].any()) for m, k in zip(mask, kept)), key  # right-padded
        n = mask.shape[-1]
        assert all(n - k > n // 2 for k in kept), (key, kept, n)  # more than the tail's share at CP 2 padded
    assert MASKED and len(MASKED) >= 4, MASKED


def test_ltx2_text_mask_inputs() -> None:
    """The ltx2 family's inputs carry the connectors' int64 mask for both prompts (padded in the tiny recipe's
    synthetic cache), and the mask reaches the model: an all-ones mask changes both outputs."""
    masked = tm.build_inputs("ltx2")
    mask = masked["encoder_attention_mask"]
    assert mask.dtype == torch.int64 and mask.shape == (tm.batch_size("ltx2"), tm.token_counts("ltx2")["text"])
    assert (mask == 0).any() and torch.equal(masked["audio_encoder_attention_mask"], mask)
    plain = {**masked, "encoder_attention_mask": torch.ones_like(mask), "audio_encoder_attention_mask": None}
    model = tm.build_model("ltx2")
    with torch.no_grad():
        out_plain = tm.output_tensors("ltx2", model(**plain, return_dict=False))
        out_masked = tm.output_tensors("ltx2", model(**masked, return_dict=False))
    assert not torch.allclose(out_plain[0], out_masked[0]) and not torch.allclose(out_plain[1], out_masked[1])


def test_helios_has_no_text_mask() -> None:
    with pytest.raises(ValueError):
        tm.build_inputs("helios", with_text_mask=True)


def test_output_tensors_and_loss() -> None:
    out = torch.randn(2, 3)
    assert tm.output_tensors("flux", (out,))[0] is out
    video, audio = torch.randn(2, 3), torch.randn(2, 4)
    assert tm.output_tensors("minimax_h3", (video, audio)) == [video, audio]
    loss = tm.make_loss("minimax_h3", [video, audio], seed=3)
    expected = torch.nn.functional.mse_loss(video, tm.make_target(video.shape, 3, 0)) + torch.nn.functional.mse_loss(
        audio, tm.make_target(audio.shape, 3, 1)
    )
    torch.testing.assert_close(loss, expected)


# Context parallelism reaches attention through `dispatch_attention_fn(..., parallel_config=self._parallel_config)`.
# Set every processor's `_parallel_config` to a sentinel (as ModelMixin.enable_parallelism does), wrap the
# `dispatch_attention_fn` imported by the model's module, and record which attention calls carry the config.

_SENTINEL = object()


def _record_dispatch(name: str, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    model = tm.build_model(name)
    swap = plan_for(type(model)).cp_processors  # the plan's processor swap, as enable_context_parallel makes it
    if swap:  # (Cosmos: its attn1 processor, the stock one passes no parallel_config)
        module_name, _, function = swap.partition(":")
        getattr(importlib.import_module(module_name), function)(model)
    calls: list[dict[str, Any]] = []
    # the modules whose processors call it: the model's own, and any it takes processors from (Chroma: Flux's)
    processors = [m.processor for m in model.modules() if isinstance(m, (Attention, AttentionModuleMixin))]
    names = dict.fromkeys([type(model).__module__, *(type(p).__module__ for p in processors)])
    modules = [m for m in map(importlib.import_module, names) if hasattr(m, "dispatch_attention_fn")]

    # Attention of the plan's local_attention modules (text refiners on replicated text; HunyuanVideo's calls SDPA
    # itself) stays out of CP: neither its dispatch nor its SDPA calls are recorded.
    local = {id(p) for p in local_attention_processors(model, plan_for(type(model)).local_attention)}
    inside = [0]
    for m in model.modules():
        if isinstance(m, (Attention, AttentionModuleMixin)) and id(m.processor) in local:
            m.register_forward_pre_hook(lambda *_: inside.__setitem__(0, inside[0] + 1))
            m.register_forward_hook(lambda *_: inside.__setitem__(0, inside[0] - 1))

    # A family processor that moves Q/K/V to head shards of the whole sequence itself (train/cp/whole.py: Qwen-Image
    # 2.1) dispatches between the two all-to-alls without a config: those calls are CP's. Stand-ins, serial-exact:
    # no exchange (q, k, v as they are), and a shard that is the whole sequence.
    heads_moved = [False]

    def on_whole_sequence(parallel_config: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
        assert parallel_config is _SENTINEL
        heads_moved[0] = True
        return q, k, v, lambda out: heads_moved.__setitem__(0, False) or out

    monkeypatch.setattr(whole, "heads_on_whole_sequence", on_whole_sequence)
    monkeypatch.setattr(whole, "shard_span", lambda parallel_config, n, device: (0, n))

    def wrap(original: Callable) -> Callable:
        def wrapper(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not inside[0]:
                cp = kwargs.get("parallel_config") is _SENTINEL or heads_moved[0]
                calls.append({"q": query.shape[1], "k": key.shape[1], "cp": cp})
            kwargs["parallel_config"] = None
            return original(query, key, value, *args, **kwargs)

        return wrapper

    for module in modules:
        monkeypatch.setattr(module, "dispatch_attention_fn", wrap(module.dispatch_attention_fn))
    # Count every SDPA call, to show that none bypasses dispatch_attention_fn (the native backend calls SDPA once).
    sdpa = torch.nn.functional.scaled_dot_product_attention
    n_sdpa = [0]

    def counting_sdpa(*args: Any, **kwargs: Any) -> torch.Tensor:
        n_sdpa[0] += not inside[0]
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting_sdpa)
    n_processors = 0
    for m in model.modules():
        if isinstance(m, (Attention, AttentionModuleMixin)) and hasattr(m.processor, "_parallel_config"):
            monkeypatch.setattr(m.processor, "_parallel_config", _SENTINEL)
            n_processors += 1
    assert n_processors
    with torch.no_grad():
        model(**tm.build_inputs(name), return_dict=False)
    assert n_sdpa[0] == len(calls), f"{name}: {n_sdpa[0]} SDPA calls but {len(calls)} dispatch_attention_fn calls"
    return calls


@pytest.mark.parametrize("name", tm.ALL_MODEL_NAMES)
def test_self_attention_goes_through_dispatch_with_parallel_config(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _record_dispatch(name, monkeypatch)
    assert calls, f"{name}: no dispatch_attention_fn call recorded (attention bypasses dispatch)"
    # Self / joint attention: query and key sequences are the same tokens (no cross-attention here has len(q)==len(k)).
    self_attn = [c for c in calls if c["q"] == c["k"]]
    assert self_attn and all(c["cp"] for c in self_attn), f"{name}: {calls}"
    cross = sorted({(c["q"], c["k"], c["cp"]) for c in calls if c["q"] != c["k"]})
    print(f"\n[dispatch] {name:11s} self/joint calls={len(self_attn)} (all with parallel_config); cross q,k,cp={cross}")
