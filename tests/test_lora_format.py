"""LoRA files in the model's original key format, proven by diffusers' own converters.

For every family with a format (`FamilySpec.lora_format`, train/lora_format.py): a tiny transformer with trained-like
adapters (random A and B, alpha != rank) is exported both ways by the exporter's own writers. The original-format
file is then read by the family's pipeline class as a user loads it (`load_lora_weights`: diffusers'
`lora_conversion_utils` converter for those keys), into a fresh transformer, and so is the diffusers-format file into
another. Asserted: the converter consumes every key (it raises on leftovers, and peft reports no unexpected or
missing keys), every adapted layer's weight update s * B @ A is the same in both (a fused layer split back exactly;
zero blocks load as zero updates), and the transformer's output on the family's pipeline-form inputs is equal
(fp32, <= 1e-6 relative).

Full weights in the original layout (`LoraFormat.full`, train/original_full.py): a tiny transformer whose LoRA the
full export merges is written both ways by the exporter (the diffusers folder and the original single file, on a
1-rank group); diffusers' `from_single_file` (the family's `checkpoint_mapping_fn`) reads the single file back with
the diffusers folder's config. Asserted: the converter's keys are exactly the model's, every tensor equal to the
diffusers folder's (bitwise), and the output equal (fp32, <= 1e-6 relative).
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path

import diffusers
import pytest
import torch

from tests.harness import one_rank_group
from train.config import FinetuneConfig
from train.export import ORIGINAL_LORA_FILE, write_diffusers_lora, write_original_lora
from train.lora_format import LoraFormat, Rename, check_format, to_original
from train.modeling import apply_finetune
from train.tools.oracle import forward
from train.tools.tiny_models import FAMILY_NAMES, build_model, family_case, get_family, tiny_config

FORMATS = [n for n in FAMILY_NAMES if get_family(n).lora_format is not None]
FULL = [n for n in FORMATS if get_family(n).lora_format.full is not None and n != "flux_kontext"]  # FLUX.1's class
RANK, ALPHA = 4, 8.0  # scale 2: the alpha tensors matter
# diffusers' kohya FLUX.1 converter splits single_blocks.N.linear1 at FLUX.1's own widths (3 x 3072 + 12288 rows):
# the tiny models adapt their double blocks only, and FLUX.1's single block is proven at its real width below
NARROW = {
    "FluxTransformer2DModel": "single_transformer_blocks.",
    "ChromaTransformer2DModel": "single_transformer_blocks.",
}
FLUX_WIDTH = {"num_layers": 0, "num_single_layers": 1, "attention_head_dim": 128, "num_attention_heads": 24,
              "axes_dims_rope": [16, 56, 56]}  # fmt: skip


def _adapted(family: str, build, seed: int = 0) -> torch.nn.Module:
    """The transformer `build()` gives with the family's default LoRA targets (those under NARROW's prefix left out),
    A and B random (B = 0 would prove nothing)."""
    spec = get_family(family)
    model = build()
    skip = NARROW.get(type(model).__name__) if build is not _WIDE.get(family) else None
    targets = [n for n, _ in model.named_modules() if any(n == t or n.endswith(f".{t}") for t in spec.lora_targets)
               and not (skip and n.startswith(skip))]  # fmt: skip
    apply_finetune(model, FinetuneConfig(lora_rank=RANK, lora_alpha=ALPHA, lora_targets=targets), spec, "fp32")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def _load(family: str, lora: Path, build) -> tuple[torch.nn.Module, list[str]]:
    """A fresh tiny transformer with `lora` loaded through the family's pipeline as a user loads it; the warnings
    diffusers and peft logged. A pipeline built with its other components None where its constructor allows; else
    (a constructor that needs its processor; a modular pipeline, which takes its components from a folder) the same
    class's `lora_state_dict` + `load_lora_into_transformer`, the two calls its `load_lora_weights` makes."""
    cls = getattr(diffusers, get_family(family).pipeline_class)
    transformer = build()
    params = inspect.signature(cls.__init__).parameters
    try:
        required = {n: None for n, p in params.items() if n != "self" and p.default is inspect._empty
                    and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}  # fmt: skip
        pipe = cls(**required | {"transformer": transformer})
    except (AttributeError, TypeError):
        pipe = None
    if pipe is not None and getattr(pipe, "transformer", None) is not transformer:  # a modular pipeline
        pipe = None
    records: list[str] = []  # what loading the file logs
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = lambda r: records.append(r.getMessage())
    loggers = [logging.getLogger(n) for n in ("diffusers", "peft")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        if pipe is not None:
            pipe.load_lora_weights(lora)
        else:
            state, metadata = cls.lora_state_dict(lora, return_lora_metadata=True)
            cls.load_lora_into_transformer(state, transformer=transformer, metadata=metadata)
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    return transformer, records


def _updates(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each LoRA layer's weight update s * B @ A (every adapter of the layer)."""
    out = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and len(module.lora_A):
            out[name] = sum(module.scaling[a] * module.lora_B[a].weight @ module.lora_A[a].weight
                            for a in module.lora_A)  # fmt: skip
    return out


def _tiny(family: str):
    return lambda: build_model(family, seed=0)


def _flux_width() -> torch.nn.Module:
    torch.manual_seed(0)
    return diffusers.FluxTransformer2DModel(**{**tiny_config("flux"), **FLUX_WIDTH})


_WIDE = {"flux": _flux_width}


@pytest.mark.parametrize("family", FORMATS)
def test_original_format_loads_through_diffusers_converter(family: str, tmp_path: Path) -> None:
    _check_format(family, _tiny(family), tmp_path)


def test_flux_single_block_at_flux_width(tmp_path: Path) -> None:
    """FLUX.1's single block (24 heads x 128, ~190 M parameters, no double block) with the default targets: its
    to_q/to_k/to_v fused with a zero proj_mlp block into `linear1`, split back by diffusers' kohya converter."""
    _check_format("flux", _flux_width, tmp_path)


def _check_format(family: str, build, tmp_path: Path) -> None:
    spec = get_family(family)
    model = _adapted(family, build)
    from peft.utils import get_peft_model_state_dict

    lora = get_peft_model_state_dict(model)
    (tmp_path / "d").mkdir()
    (tmp_path / "o").mkdir()
    write_diffusers_lora(model, lora, spec.pipeline_class, tmp_path / "d")
    write_original_lora(model, lora, spec.lora_format, tmp_path / "o")
    from safetensors.torch import load_file

    keys = list(load_file(tmp_path / "o" / ORIGINAL_LORA_FILE))
    assert not any(".lora_A." in k or k.startswith("transformer.") for k in keys) or spec.lora_format.down == "lora_A"

    reference, _ = _load(family, tmp_path / "d", build)
    loaded, warned = _load(family, tmp_path / "o", build)
    # (FluxLoraLoaderMixin says it found no keys for the pipeline's absent text encoder: not this file's keys)
    warned = [w for w in warned if "prefix='text_encoder'" not in w]
    bad = [w for w in warned if any(s in w.lower() for s in ("unexpected", "missing", "not loaded", "were not"))]
    assert not bad, bad
    ours, theirs = _updates(reference), _updates(loaded)
    assert set(ours) <= set(theirs), sorted(set(ours) - set(theirs))[:5]
    for name, delta in theirs.items():
        expected = ours.get(name, torch.zeros_like(delta))
        torch.testing.assert_close(delta, expected, rtol=1e-6, atol=1e-7, msg=name)

    inputs = family_case(family, seed=1, dtype=torch.float32, batch_size=2)
    with torch.no_grad():
        a = torch.cat([t.flatten() for t in _outputs(forward(reference.eval(), inputs))])
        b = torch.cat([t.flatten() for t in _outputs(forward(loaded.eval(), inputs))])
    assert (a - b).abs().max() <= 1e-6 * a.abs().max(), (a - b).abs().max()


def _outputs(out) -> list[torch.Tensor]:
    from train.models.spec import output_tensors

    return list(output_tensors(out))


def test_fused_layer_is_block_diagonal_and_exact() -> None:
    """Parts of one fused layer: A stacked, B block-diagonal, a part without adapter a zero block of the same rank,
    different scales folded into B (alpha = rank); the fused product is each part's s * B @ A."""
    fmt = LoraFormat("t", (Rename("b.{0}.q", "x.{0}.qkv", 0, 3), Rename("b.{0}.k", "x.{0}.qkv", 1, 3),
                           Rename("b.{0}.v", "x.{0}.qkv", 2, 3)))  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    a_q, b_q, a_k, b_k = (torch.randn(s, generator=gen) for s in ((2, 5), (3, 2), (2, 5), (4, 2)))
    out = to_original(fmt, {"b.7.q": (a_q, b_q, 2.0), "b.7.k": (a_k, b_k, 0.5)}, lambda m: {"b.7.v": 6}[m])
    down, up = out["diffusion_model.x.7.qkv.lora_down.weight"], out["diffusion_model.x.7.qkv.lora_up.weight"]
    alpha = out["diffusion_model.x.7.qkv.alpha"].item()
    assert down.shape == (6, 5) and up.shape == (13, 6) and alpha == 6.0
    fused = alpha / down.shape[0] * up @ down
    torch.testing.assert_close(fused[:3], 2.0 * b_q @ a_q)
    torch.testing.assert_close(fused[3:7], 0.5 * b_k @ a_k)
    assert not fused[7:].any()


def test_unnamed_module_or_family_without_format_is_one_line() -> None:
    from train.errors import UserError

    fmt = get_family("wan").lora_format
    with pytest.raises(UserError, match=r"1 adapted module\(s\) of wan have no name.*vace_blocks.0.attn1.to_q"):
        check_format(fmt, "wan", ["blocks.0.attn1.to_q", "vace_blocks.0.attn1.to_q"])
    with pytest.raises(UserError, match="hunyuan_video15 has no original LoRA key format"):
        check_format(None, "hunyuan_video15", ["x"])


@pytest.mark.parametrize("family", FULL)
def test_original_full_weights_load_through_from_single_file(family: str, tmp_path: Path) -> None:
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES
    from safetensors.torch import load_file

    from train.export import export_full
    from train.original_full import ORIGINAL_FULL_FILE, export_original_full

    spec = get_family(family)
    if family == "flux":  # its converter splits linear1 at FLUX.1's widths: one block of each kind at that width
        torch.manual_seed(0)
        model = diffusers.FluxTransformer2DModel(**{**tiny_config("flux"), **FLUX_WIDTH, "num_layers": 1})
    else:
        model = _adapted(family, _tiny(family))  # the full export merges its LoRA: trained-like weights
    with one_rank_group(tmp_path):
        folder = export_full(model, tmp_path).path
        single = export_original_full(model, spec.lora_format, tmp_path) / ORIGINAL_FULL_FILE
    cls = type(model)
    del model  # FLUX.1's width: ~2 GB a copy
    reference = cls.from_pretrained(folder).eval()
    expected = reference.state_dict()
    convert = SINGLE_FILE_LOADABLE_CLASSES[cls.__name__]["checkpoint_mapping_fn"]
    converted = convert(checkpoint=load_file(single), config=dict(reference.config))
    assert set(converted) == set(expected), (sorted(set(converted) - set(expected))[:5],
                                             sorted(set(expected) - set(converted))[:5])  # fmt: skip
    del converted
    loaded = cls.from_single_file(str(single), config=str(folder)).eval()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    inputs = family_case(family, seed=1, dtype=torch.float32, batch_size=2)
    with torch.no_grad():
        a = torch.cat([t.flatten() for t in _outputs(forward(reference, inputs))])
        b = torch.cat([t.flatten() for t in _outputs(forward(loaded, inputs))])
    assert (a - b).abs().max() <= 1e-6 * a.abs().max(), (a - b).abs().max()


@pytest.mark.parametrize("family", ["chroma", "wan_animate", "hunyuan_video"])
def test_full_original_export_without_a_layout_is_one_line(family: str) -> None:
    """A full fine-tune asking for the original layout of a family that has none is refused before any step."""
    from train.config import load_recipe
    from train.errors import UserError
    from train.modeling import check_model

    recipe = load_recipe(f"recipes/tiny/{family}.yaml", ["finetune.method=full", "checkpoint.export_format=both"])
    with pytest.raises(UserError, match=f"{family} has no original full-checkpoint layout here") as e:
        check_model(recipe, get_family(family))
    assert "\n" not in str(e.value)
