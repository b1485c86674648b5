"""Streamed export (`train.export.export_full`) and sharded checkpoints, on 2 real gloo ranks.

One spawn runs every case (a group costs ~10 s to start); rank 0 reloads each exported folder with `from_pretrained`
and compares it with the weights computed serially (the same seeded, perturbed model, never sharded):

* fsdp: a tiny Wan in bf16, FSDP2 per block + root: every tensor equal, dtype kept, ≥ 3 shard files + index;
* plain: a tiny Flux that is not sharded at all (plain tensors on both ranks);
* lora: a tiny Wan (FSDP2) with peft adapters (B ≠ 0): the folder is the plain transformer with the adapters merged
  (equal to peft's own merge on the serial model, and its forward equals the adapter model's);
* dcp: `save_checkpoint` of an FSDP2 model + AdamW never gathers a full parameter (`DTensor.full_tensor` and
  `redistribute` counted during the save: 0), while the export of the same model does (a control).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.harness import rank_job, shared_tmpdir

MAX_SHARD = 50_000  # bytes: the tiny models (180-840 kB) split into ≥ 3 shards
LORA_RANK, LORA_ALPHA = 4, 8


def _model(family: str, dtype: torch.dtype, lora: bool) -> torch.nn.Module:
    """The tiny transformer of `family` (with LoRA adapters), every tensor moved off its init by a seeded amount:
    the same on every rank and in every call."""
    import diffusers
    from peft import LoraConfig

    from train.models import get_family, tiny_config

    spec = get_family(family)
    torch.manual_seed(0)
    model = getattr(diffusers, spec.transformer_class).from_config(tiny_config(family)).to(dtype)
    if lora:
        model.requires_grad_(False)
        model.add_adapter(LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=list(spec.lora_targets)))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():  # lora_B included: the adapters change the model
            p.add_(0.1 * torch.randn(p.shape, generator=gen).to(p.dtype))
    return model


def _shard(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from train.parallel import repeated_blocks

    mesh = init_device_mesh("cpu", (2,))
    for block in repeated_blocks(model):
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _check_folder(record, expected: dict[str, torch.Tensor], cls: type) -> dict:
    """Rank 0: what the exported folder holds, against the expected (serial) state dict."""
    from safetensors import safe_open

    folder = record.path
    loaded = cls.from_pretrained(folder, torch_dtype=next(iter(expected.values())).dtype)
    # from_pretrained keeps the class's `_keep_in_fp32_modules` in fp32: an exact upcast of what the files hold
    got = {k: v.to(expected[k].dtype) if k in expected else v for k, v in loaded.state_dict().items()}
    index = json.loads((folder / "diffusion_pytorch_model.safetensors.index.json").read_text())
    files = sorted(f.name for f in folder.glob("*.safetensors"))
    shard_name = re.compile(rf"diffusion_pytorch_model-\d{{5}}-of-{len(files):05d}\.safetensors")
    dtypes = set()
    for f in files:
        with safe_open(folder / f, "pt") as fh:
            dtypes |= {fh.get_slice(k).get_dtype() for k in fh.keys()}
    return {
        "keys_equal": got.keys() == expected.keys() == index["weight_map"].keys(),
        "unequal": [k for k in expected if not torch.equal(got[k], expected[k])],
        "max_diff": max((got[k].double() - expected[k].double()).abs().max().item() for k in expected),
        "files": files,
        "names_ok": all(shard_name.fullmatch(f) for f in files) and set(index["weight_map"].values()) == set(files),
        "index_total": index["metadata"]["total_size"],
        "file_dtypes": dtypes,
        "class_name": json.loads((folder / "config.json").read_text())["_class_name"],
        "model_bytes": sum(t.nbytes for t in expected.values()),
        "largest": max(t.nbytes for t in expected.values()),
        "loaded": loaded,
    }


def _worker(rank: int, world: int, out: str) -> dict:
    import diffusers
    from peft.tuners.lora import LoraLayer
    from torch.distributed.tensor import DTensor

    from train.checkpoint import AppState, save_checkpoint
    from train.export import export_full
    from train.tools.tiny_models import build_inputs

    out, results = Path(out), {}
    calls = {"full_tensor": 0, "redistribute": 0}
    for method in calls:  # count every gather of a whole DTensor from here on (full_tensor redistributes)
        original = getattr(DTensor, method)

        def counted(self, *args, _original=original, _method=method, **kwargs):
            calls[_method] += 1
            return _original(self, *args, **kwargs)

        setattr(DTensor, method, counted)

    # fsdp: bf16 Wan, sharded per block + root.
    expected = {k: v.clone() for k, v in _model("wan", torch.bfloat16, lora=False).state_dict().items()}
    model = _shard(_model("wan", torch.bfloat16, lora=False))
    record = export_full(model, out / "fsdp", max_shard_size=MAX_SHARD)
    gathers = dict(calls)
    results["fsdp"] = {"record": record, "export_gathers": gathers["full_tensor"],
                       "dtensors": sum(isinstance(v, DTensor) for v in model.state_dict().values())}  # fmt: skip
    if rank == 0:
        results["fsdp"] |= _check_folder(record, expected, diffusers.WanTransformer3DModel)
        results["fsdp"]["auto"] = type(diffusers.AutoModel.from_pretrained(str(record.path))).__name__

    # dcp: the same FSDP2 model with AdamW state; the save must not gather anything.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    before = dict(calls)
    save_checkpoint(out / "dcp", step=1, app=AppState(model, optimizer, trainable_only=False),
                    trainer_state={"step": 1}, keep_last=1)  # fmt: skip
    results["dcp"] = {m: calls[m] - before[m] for m in calls}
    results["dcp"]["files"] = sorted(f.name for f in (out / "dcp" / "checkpoints" / "step_000001").iterdir())

    # plain: Flux, not sharded (plain tensors on both ranks).
    model = _model("flux", torch.float32, lora=False)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    record = export_full(model, out / "plain", max_shard_size=MAX_SHARD)
    results["plain"] = {"record": record}
    if rank == 0:
        results["plain"] |= _check_folder(record, expected, diffusers.FluxTransformer2DModel)

    # lora: Wan + adapters, sharded; expected = peft's merge on the serial model.
    record = export_full(_shard(_model("wan", torch.float32, lora=True)), out / "lora", max_shard_size=MAX_SHARD)
    results["lora"] = {"record": record}
    if rank == 0:
        serial = _model("wan", torch.float32, lora=True).eval()
        inputs = build_inputs("wan")
        reference = serial(**inputs, return_dict=False)[0]
        layers = [m for m in serial.modules() if isinstance(m, LoraLayer)]
        for layer in layers:
            layer.merge()
        merged = {k.replace(".base_layer.", "."): v for k, v in serial.state_dict().items() if ".lora_" not in k}
        check = _check_folder(record, merged, diffusers.WanTransformer3DModel)
        forward = check["loaded"](**inputs, return_dict=False)[0]
        check["forward_diff"] = (forward - reference).abs().max().item()
        check["lora_layers"] = len(layers)
        results["lora"] |= check
    for case in results.values():
        case.pop("loaded", None)
    return results


@rank_job(2)
def _job(rank: int, world: int) -> dict:
    return _worker(rank, world, str(shared_tmpdir()))


@pytest.fixture(scope="module")
def results(group) -> list[dict]:
    return group(_job, 2)


def _assert_streamed(ranks: list[dict], case: str) -> dict:
    """What every export must be: the expected keys, ≥ 3 diffusers-named shards + index, streamed."""
    r0, r1 = ranks[0][case], ranks[1][case]
    rec = r0["record"]
    assert r0["keys_equal"]
    assert rec.shards == len(r0["files"]) >= 3 and r0["names_ok"], r0["files"]
    assert rec.total_bytes == r0["index_total"] == r0["model_bytes"]
    # Rank 0 never held more than one shard + one tensor, and never the whole model; rank 1 buffered nothing.
    assert rec.peak_buffered_bytes <= MAX_SHARD + r0["largest"]
    assert rec.peak_buffered_bytes < r0["model_bytes"]
    r1_rec = r1["record"]
    assert (r1_rec.shards, r1_rec.total_bytes, r1_rec.peak_buffered_bytes) == (rec.shards, rec.total_bytes, 0)
    return r0


def test_streamed_export_of_fsdp2_model_reloads_exactly(results: list[dict]) -> None:
    r0 = _assert_streamed(results, "fsdp")
    assert r0["unequal"] == []
    assert r0["file_dtypes"] == {"BF16"}  # written in the model's dtype
    assert r0["class_name"] == r0["auto"] == "WanTransformer3DModel"  # not fully_shard's FSDPWanTransformer3DModel
    assert r0["export_gathers"] == r0["dtensors"] > 0  # one gather per sharded tensor


def test_streamed_export_of_unsharded_model(results: list[dict]) -> None:
    r0 = _assert_streamed(results, "plain")
    assert r0["unequal"] == []
    assert r0["file_dtypes"] == {"F32"}


def test_streamed_export_merges_lora(results: list[dict]) -> None:
    r0 = _assert_streamed(results, "lora")
    assert r0["lora_layers"] > 0  # and the keys are a plain transformer's: no lora_ / base_layer
    assert r0["max_diff"] <= 1e-6, r0["unequal"][:3]
    assert r0["forward_diff"] <= 1e-5


def test_checkpoint_save_never_gathers_a_full_parameter(results: list[dict]) -> None:
    for rank in results:
        dcp = rank["dcp"]
        assert (dcp["full_tensor"], dcp["redistribute"]) == (0, 0)
        assert "COMPLETE" in dcp["files"] and any(f.endswith(".distcp") for f in dcp["files"])
