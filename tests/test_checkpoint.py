"""Checkpoints (`train.checkpoint`): exact round trip, manifest verification with fallback, no checkpoint from
non-finite weights, and nothing read back runs code.

One 2-rank gloo spawn (a tiny Wan, FSDP2 per block + root, AdamW) runs every distributed case:

* a: three checkpoints; restore = the newest, exactly (local shards, AdamW state, trainer state, RNG); then the
  newest gets a truncated shard (→ the previous, with a warning), the previous an unparsable manifest (→ the first),
  the first a flipped byte (→ UserError naming all three);
* b: keep_last 1 with a newer COMPLETE directory that has no manifest, then NaN in one shard of rank 1: nothing is
  written, the last good checkpoint survives rotation and is what restore loads;
* c, d, e: crafted checkpoints whose manifest was rewritten to match (as an attacker would): a code-running
  `.metadata`, and a code-running pickle as a non-tensor item and as a tensor item of a `.distcp` file.

The single-file plants (trainer state, RNG, `.metadata`) run in-process. Every plant would create a marker file if it
ran (shown by a control that unpickles it unsafely); no marker may appear.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pickle
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.harness import rank_job, shared_tmpdir
from train.checkpoint import finite, load_rng, read_dcp_metadata, read_trainer_state
from train.errors import UserError


class _Evil:
    """Unpickling this runs `touch <marker>`, as the crafted trainer.pt of issue 11 ran a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _torch_evil(marker: Path) -> bytes:
    buf = io.BytesIO()
    torch.save(_Evil(marker), buf)
    return buf.getvalue()


# --- in-process: the plants are live, and each single-file reader refuses them ------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finite_is_isfinite_all(dtype: torch.dtype) -> None:
    """`finite` (one min/max pass, what the startup, checkpoint and export checks use) against `isfinite().all()`:
    a NaN, +inf or -inf anywhere, alone or together, in every position class, and the empty tensor."""
    base = torch.linspace(-3e4, 3e4, 257, dtype=dtype)
    cases = [base, torch.empty(0, dtype=dtype), base.view(1, 257)[:, ::2]]
    for bad in (float("nan"), float("inf"), -float("inf")):
        for i in (0, 128, 256):
            t = base.clone()
            t[i] = bad
            cases.append(t)
    both = base.clone()
    both[3], both[9] = float("inf"), -float("inf")
    cases.append(both)
    for t in cases:
        assert bool(finite(t)) == bool(torch.isfinite(t).all()), t


def test_planted_pickles_run_code_when_unpickled_unsafely(tmp_path: Path) -> None:
    """Control: the payloads used below do run (plain pickle, and torch.load(weights_only=False) as DCP's default
    planner uses for non-tensor items)."""
    pickle.loads(pickle.dumps(_Evil(tmp_path / "pickle")))
    torch.load(io.BytesIO(_torch_evil(tmp_path / "torch")), weights_only=False)
    assert (tmp_path / "pickle").exists() and (tmp_path / "torch").exists()


def test_trainer_state_is_json_and_never_unpickled(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    crafted = tmp_path / "json"
    crafted.mkdir()
    (crafted / "trainer.json").write_bytes(pickle.dumps(_Evil(marker)))
    with pytest.raises(UserError, match=r"trainer\.json: not JSON .*damaged or crafted"):
        read_trainer_state(crafted)
    old = tmp_path / "old"  # a checkpoint of the old format: its trainer.pt is never read
    old.mkdir()
    (old / "trainer.pt").write_bytes(_torch_evil(marker))
    with pytest.raises(UserError, match=r"no trainer\.json \(an older format: its trainer\.pt is never unpickled\)"):
        read_trainer_state(old)
    assert not marker.exists()


def test_rng_state_is_safetensors_and_never_unpickled(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    (tmp_path / "rng_rank0.safetensors").write_bytes(pickle.dumps(_Evil(marker)))
    with pytest.raises(UserError, match=r"rng_rank0\.safetensors: not an RNG state"):
        load_rng(tmp_path, 0)
    (tmp_path / "rng_rank1.pt").write_bytes(_torch_evil(marker))  # the old name: never read
    assert load_rng(tmp_path, 1) is False
    assert not marker.exists()


def test_dcp_metadata_unpickler_refuses_other_classes(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    with pytest.raises(UserError, match=r"\.metadata: not DCP metadata \(UnpicklingError: refused to unpickle "
                       r"(posix|os)\.system\)"):  # fmt: skip
        read_dcp_metadata(tmp_path / ".metadata")
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"a": 1}))  # allowed opcodes, but not DCP metadata
    with pytest.raises(UserError, match="holds a dict, not DCP metadata"):
        read_dcp_metadata(tmp_path / ".metadata")
    assert not marker.exists()


# --- distributed ----------------------------------------------------------------------------------------------------


def _sharded_wan() -> torch.nn.Module:
    import diffusers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from train.models import get_family, tiny_config
    from train.parallel import repeated_blocks

    torch.manual_seed(0)
    model = getattr(diffusers, get_family("wan").transformer_class).from_config(tiny_config("wan"))
    mesh = init_device_mesh("cpu", (2,))
    for block in repeated_blocks(model):
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, k: int) -> None:
    """One AdamW step with gradient k/10 everywhere, then a RNG state distinct per step and rank."""
    for p in model.parameters():
        p.grad = torch.full_like(p, k / 10)
    optimizer.step()
    torch.manual_seed(1000 * k + dist.get_rank())


def _snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {
        "params": {n: _local(p).detach().clone() for n, p in model.named_parameters()},
        "optim": [{k: _local(v).clone() for k, v in optimizer.state[p].items()} for p in model.parameters()],
        "rng": torch.get_rng_state(),
    }


def _differences(model: torch.nn.Module, optimizer: torch.optim.Optimizer, snap: dict) -> list[str]:
    """What differs between the model/optimizer/RNG now and a snapshot (exact comparison)."""
    now = _snapshot(model, optimizer)
    bad = [n for n, t in snap["params"].items() if not torch.equal(now["params"][n], t)]
    bad += [f"optim {i}.{k}" for i, (a, b) in enumerate(zip(now["optim"], snap["optim"])) for k in b
            if not torch.equal(a[k], b[k])]  # fmt: skip
    return bad + ["rng"] * (not torch.equal(now["rng"], snap["rng"]))


def _trainer_state(k: int) -> dict:
    return {"step": k, "scheduler": {"base_lrs": [0.01], "last_epoch": k, "_last_lr": [0.01 * 0.9**k]},
            "data": {"epoch": 0, "index": 2 * k}, "recipe": {"train": {"lr": 0.01, "eps": 1e-8, "seed": None}},
            "layout": {"dp_shard": 2, "cp": 1, "world_size": 2}}  # fmt: skip


def _reseal(ckpt: Path) -> None:
    """Rewrite the manifest to match the files as they are now (what a crafter of a checkpoint can do)."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for name, entry in manifest["files"].items():
        data = (ckpt / name).read_bytes()
        entry.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def _plant_in_distcp(ckpt: Path, payload: bytes, kind: type) -> str:
    """Point the first item whose metadata is of class `kind` at `payload`, appended to the shard file it is in."""
    metadata = read_dcp_metadata(ckpt / ".metadata")
    index = next(i for i in metadata.storage_data if isinstance(metadata.state_dict_metadata[i.fqn], kind))
    info = metadata.storage_data[index]
    with (ckpt / info.relative_path).open("ab") as f:
        info.offset, info.length = f.tell(), len(payload)
        f.write(payload)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    _reseal(ckpt)
    return index.fqn


def _restore(out: Path, app) -> tuple[str | None, str, float, dict | None]:
    """restore(), with its stderr captured and timed: (checkpoint name or None, stderr, seconds, trainer state)."""
    from train.checkpoint import restore

    err = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stderr(err):
        restored = restore(out, app)
    elapsed = time.perf_counter() - t0
    return (restored[0].name if restored else None), err.getvalue(), elapsed, (restored[1] if restored else None)


def _user_error(fn, *args) -> str:
    try:
        fn(*args)
    except UserError as e:
        return str(e)
    return "no error"


def _worker(rank: int, world: int, out: str) -> dict:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    from train.checkpoint import AppState, latest_checkpoint, load_checkpoint, restore, save_checkpoint

    out, res = Path(out), {}
    model = _sharded_wan()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    app = AppState(model, optimizer, trainable_only=False)
    res["empty"] = restore(out / "none", app)

    # a: round trip, then fallback through truncated shard → unparsable manifest → flipped byte.
    a, snaps = out / "a", {}
    for k in (1, 2, 3):
        _train(model, optimizer, k)
        snaps[k] = _snapshot(model, optimizer)
        t0 = time.perf_counter()
        save_checkpoint(a, k, app, _trainer_state(k), keep_last=3)
        res[f"save_s_{k}"] = time.perf_counter() - t0
    step3 = a / "checkpoints" / "step_000003"
    res["files"] = sorted(f.name for f in step3.iterdir())
    res["manifest"] = json.loads((step3 / "manifest.json").read_text())
    _train(model, optimizer, 4)  # the live state moves on: a restore must bring back step 3
    name, err, res["roundtrip_s"], state = _restore(a, app)
    res["roundtrip"] = {"name": name, "err": err, "diff": _differences(model, optimizer, snaps[3]),
                        "state_equal": state == _trainer_state(3)}  # fmt: skip
    res["cases"] = {}
    corruptions = [  # (checkpoint, damage, checkpoint expected next)
        (step3, lambda d: (d / "__1_0.distcp").write_bytes((d / "__1_0.distcp").read_bytes()[:-100]), 2),
        (a / "checkpoints" / "step_000002", lambda d: (d / "manifest.json").write_text('{"files": {"trainer'), 1),
    ]
    for ckpt, damage, expected in corruptions:
        if rank == 0:
            damage(ckpt)
        dist.barrier()
        _train(model, optimizer, 5)
        name, err, elapsed, state = _restore(a, app)
        res["cases"][ckpt.name] = {"name": name, "err": err, "seconds": elapsed, "state_equal":
                                   state == _trainer_state(expected), "diff": _differences(model, optimizer,
                                   snaps[expected])}  # fmt: skip
    if rank == 0:
        shard = a / "checkpoints" / "step_000001" / "__0_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    dist.barrier()
    res["all_bad"] = _user_error(restore, a, app)
    res["latest"] = latest_checkpoint(a).name

    # b: never a checkpoint from non-finite weights; rotation keeps the last good one.
    b = out / "b"
    _train(model, optimizer, 6)
    save_checkpoint(b, 1, app, _trainer_state(1), keep_last=1)
    if rank == 0:
        (b / "checkpoints" / "step_000009").mkdir()
        (b / "checkpoints" / "step_000009" / "COMPLETE").touch()  # complete, no manifest: not counted by rotation
    dist.barrier()
    _train(model, optimizer, 7)
    good = _snapshot(model, optimizer)
    save_checkpoint(b, 2, app, _trainer_state(2), keep_last=1)
    if rank == 1:  # NaN in one local shard of one rank only: the ranks must still agree
        p = next(p for p in model.parameters() if _local(p).numel())
        with torch.no_grad():
            _local(p).view(-1)[0] = float("nan")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        skipped = save_checkpoint(b, 3, app, _trainer_state(3), keep_last=1)
    res["nonfinite"] = {"returned": skipped, "err": err.getvalue(),
                        "dirs": sorted(p.name for p in (b / "checkpoints").iterdir())}  # fmt: skip
    name, err, _, state = _restore(b, app)
    res["nonfinite"] |= {"restored": name, "restore_err": err, "diff": _differences(model, optimizer, good)}

    # c, d, e: crafted checkpoints with a matching manifest; c falls back to a good older one.
    markers = out / "markers"
    for case in "cde":
        if rank == 0:
            shutil.copytree(b / "checkpoints" / "step_000002", out / case / "checkpoints" / "step_000002")
        if case == "c" and rank == 0:
            shutil.copytree(b / "checkpoints" / "step_000002", out / "c" / "checkpoints" / "step_000005")
    if rank == 0:
        markers.mkdir()
        crafted = out / "c" / "checkpoints" / "step_000005"
        (crafted / ".metadata").write_bytes(pickle.dumps(_Evil(markers / "metadata")))
        _reseal(crafted)
        res["bytes_item"] = _plant_in_distcp(out / "d" / "checkpoints" / "step_000002",
                                             _torch_evil(markers / "bytes_item"), BytesStorageMetadata)  # fmt: skip
        res["tensor_item"] = _plant_in_distcp(out / "e" / "checkpoints" / "step_000002",
                                              _torch_evil(markers / "tensor_item"), TensorStorageMetadata)  # fmt: skip
    dist.barrier()
    res["crafted_metadata_load"] = _user_error(load_checkpoint, out / "c" / "checkpoints" / "step_000005", app)
    name, err, _, _ = _restore(out / "c", app)
    res["crafted_metadata_restore"] = {"name": name, "err": err}
    for case in "de":
        res[f"crafted_{case}"] = _user_error(load_checkpoint, out / case / "checkpoints" / "step_000002", app)
    dist.barrier()
    res["markers"] = sorted(p.name for p in markers.iterdir())

    # f: the disk fills up while rank 1 writes its shard of step 4 (b holds the good step 2).
    from tests.harness import full_disk

    with full_disk(lambda path: rank == 1):
        res["disk_full"] = {"error": _user_error(save_checkpoint, b, 4, app, _trainer_state(4), 1)}
    res["disk_full"]["dirs"] = sorted(p.name for p in (b / "checkpoints").iterdir())
    name, err, _, state = _restore(b, app)
    res["disk_full"] |= {"restored": name, "state_equal": state == _trainer_state(2)}
    return res


@rank_job(2)
def _job(rank: int, world: int) -> dict:
    return _worker(rank, world, str(shared_tmpdir()))


@pytest.fixture(scope="module")
def ranks(group) -> list[dict]:
    return group(_job, 2)


def test_round_trip_is_exact(ranks: list[dict]) -> None:
    for r in ranks:
        rt = r["roundtrip"]
        assert rt["name"] == "step_000003" and rt["err"] == ""
        assert rt["diff"] == [] and rt["state_equal"]  # params, AdamW state, RNG, trainer state
    assert ranks[0]["empty"] is None
    files = ranks[0]["files"]
    assert files == sorted(["__0_0.distcp", "__1_0.distcp", ".metadata", "COMPLETE", "manifest.json", "trainer.json",
                            "rng_rank0.safetensors", "rng_rank1.safetensors"])  # fmt: skip
    listed = ranks[0]["manifest"]["files"]
    assert sorted(listed) == sorted(set(files) - {"COMPLETE", "manifest.json"})
    assert all(e["size"] > 0 and len(e["sha256"]) == 64 for e in listed.values())


def test_damaged_newest_falls_back_to_previous(ranks: list[dict]) -> None:
    for r in ranks:
        case = r["cases"]["step_000003"]
        assert case["name"] == "step_000002" and case["diff"] == [] and case["state_equal"]
    (line,) = ranks[0]["cases"]["step_000003"]["err"].splitlines()  # one warning line, on rank 0 only
    assert "step_000003 is damaged (__1_0.distcp is " in line and "falling back" in line
    assert ranks[1]["cases"]["step_000003"]["err"] == ""


def test_unparsable_manifest_falls_back(ranks: list[dict]) -> None:
    for r in ranks:
        case = r["cases"]["step_000002"]
        assert case["name"] == "step_000001" and case["diff"] == [] and case["state_equal"]
    lines = ranks[0]["cases"]["step_000002"]["err"].splitlines()
    assert len(lines) == 2 and "step_000003" in lines[0]
    assert "step_000002 is damaged (manifest.json unreadable (JSONDecodeError" in lines[1]


def test_no_checkpoint_verifies_is_a_user_error(ranks: list[dict]) -> None:
    message = ranks[0]["all_bad"]
    assert message == ranks[1]["all_bad"] and "\n" not in message
    assert message.startswith("no checkpoint in ") and "verifies (step_000003: __1_0.distcp is " in message
    assert "step_000002: manifest.json unreadable" in message
    assert "step_000001: __0_0.distcp sha256 differs from the manifest" in message
    assert ranks[0]["latest"] == "step_000003"  # latest_checkpoint: the newest COMPLETE, verified or not


def test_nonfinite_weights_write_nothing_and_keep_last_good(ranks: list[dict]) -> None:
    for r in ranks:
        nf = r["nonfinite"]
        assert nf["returned"] is None
        assert nf["dirs"] == ["step_000002", "step_000009"]  # step 1 rotated out, 3 never written
        assert nf["restored"] == "step_000002" and nf["diff"] == []
    (line,) = ranks[0]["nonfinite"]["err"].splitlines()
    assert "step 3: model parameters are not finite" in line and line.endswith("step_000002")
    assert ranks[1]["nonfinite"]["err"] == ""
    assert "step_000009 is damaged (no manifest.json" in ranks[0]["nonfinite"]["restore_err"]


def test_disk_full_at_a_checkpoint_is_one_line_on_every_rank_and_keeps_the_last_good(ranks: list[dict]) -> None:
    """ENOSPC in one rank's shard write (DCP gathers it into a CheckpointException on every rank): the same UserError
    on both ranks naming the cause and the latest complete checkpoint, the partial step removed, the last good one
    restorable."""
    lines = [r["disk_full"]["error"] for r in ranks]
    assert lines[0] == lines[1] and "\n" not in lines[0], lines
    assert (
        lines[0].startswith("checkpoint step 4: writing ")
        and "step_000004 failed (rank 1: No space left on device)" in lines[0]
    ), lines[0]
    assert lines[0].endswith("step_000002: free space (or fix the folder), then rerun with --resume"), lines[0]
    for r in ranks:
        assert r["disk_full"]["dirs"] == ["step_000002", "step_000009"]  # step 4's partial folder is gone
        assert r["disk_full"]["restored"] == "step_000002" and r["disk_full"]["state_equal"]


def test_crafted_checkpoints_run_no_code(ranks: list[dict]) -> None:
    for r in ranks:
        assert r["markers"] == []
        refused = ".metadata: not DCP metadata (UnpicklingError: refused to unpickle posix.system)"
        assert refused in r["crafted_metadata_load"]
        assert r["crafted_metadata_restore"]["name"] == "step_000002"
        assert f"checkpoint item {ranks[0]['bytes_item']}: refused to unpickle posix.system" in r["crafted_d"]
        assert "a tensor item failed torch.load(weights_only=True)" in r["crafted_e"]
    (line,) = ranks[0]["crafted_metadata_restore"]["err"].splitlines()
    assert "step_000005 is damaged" in line and "refused to unpickle posix.system" in line


def test_fallback_timing(ranks: list[dict]) -> None:
    """Detect a truncated newest checkpoint and load the previous one: well under the spawn cost."""
    case = ranks[0]["cases"]["step_000003"]
    print(f"\nround trip restore {ranks[0]['roundtrip_s']:.2f} s; fallback restore {case['seconds']:.2f} s; "
          f"save {ranks[0]['save_s_1']:.2f} s")  # fmt: skip
    assert case["seconds"] < 10
