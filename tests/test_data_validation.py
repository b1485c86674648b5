"""Bad data and damaged caches: each is refused with one line naming the cache, the file (and line) and the fix.

One small Wan cache is prepared for real (tiny pipeline, 3 clips of 9x32x48); each test damages its own copy. The
startup checks read sizes and headers only, so they are timed on a cache of 2000 copies of one real sample. Every
case here is in-process; `python -m train.prepare` reporting such an error as one line with exit code 2 is
tests/test_bad_inputs.py's `prepare_malformed_metadata` (launched).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from train.config import recipe_from_dict
from train.data.dataset import CachedLatentDataset, read_manifest
from train.data.synthetic_media import make_media_set
from train.errors import UserError
from train.models import cache_reads, family_module
from train.prepare import PrepareError, list_source, prepare

F, H, W, FPS = 9, 32, 48, 16.0


def _recipe(pipe: Path, source: Path, cache: Path, **data):
    d = {"cache_dir": str(cache), "source": str(source), "height": H, "width": W, "num_frames": F, "fps": FPS}
    model = {"family": "wan", "pretrained_path": str(pipe), "dtype": "float32"}
    return recipe_from_dict({"model": model, "data": d | data, "logging": {"progress_bar": False}})


def _quiet(_: str) -> None:
    pass


@pytest.fixture(scope="module")
def wan(tiny_pipeline) -> Path:
    return tiny_pipeline("wan")


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("media")
    make_media_set(root, num_videos=3, frames=F, height=H, width=W, fps=FPS, seed=5)
    return root


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, wan, media) -> Path:
    cache = tmp_path_factory.mktemp("prepared") / "wan"
    prepare(_recipe(wan, media, cache, max_text_tokens=16), log=_quiet)
    return cache


@pytest.fixture
def cache(prepared, tmp_path) -> Path:
    """A fresh copy of the prepared cache, for one test to damage."""
    return Path(shutil.copytree(prepared, tmp_path / "cache"))


def _edit_manifest(cache: Path, edit) -> None:
    m = json.loads((cache / "manifest.json").read_text())
    edit(m)
    (cache / "manifest.json").write_text(json.dumps(m))


def _rewrite(path: Path, edit) -> None:
    """Re-save a sample file with `edit` applied to its tensors (metadata kept)."""
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, str(path), metadata=meta)


def _error(fn, *args, **kwargs) -> UserError:
    with pytest.raises(UserError) as e:
        fn(*args, **kwargs)
    assert "\n" not in str(e.value), str(e.value)  # one line
    return e.value


# ------------------------------------------------------------------------------------------------------- startup


def test_prepare_records_sizes_and_a_whole_cache_opens(prepared):
    m = read_manifest(prepared)
    assert [s["bytes"] for s in m["samples"]] == [(prepared / s["file"]).stat().st_size for s in m["samples"]]
    ds = CachedLatentDataset(prepared, family="wan")
    assert len(ds) == 3 and ds[2]["latents"].shape == (4, 3, 4, 6)


def test_cache_of_another_family_is_refused_before_any_item_is_read(cache):
    e = _error(CachedLatentDataset, cache, family="flux")
    assert f"cache {cache} was prepared for model family 'wan', not 'flux'" in str(e)
    assert "point data.cache_dir at a flux cache" in str(e) and "python -m train.prepare" in str(e)
    # a manifest that claims the family but whose tensors do not fit its spec (older or hand-made caches)
    _edit_manifest(cache, lambda m: m.update(family="flux"))
    e = _error(CachedLatentDataset, cache, family=cache_reads("flux"))  # what flux reads, as the trainer checks it
    assert f"{cache}: samples/000000.safetensors (bucket {F}x{H}x{W}) lacks ['pooled_embeds']" in str(e)
    _edit_manifest(cache, lambda m: m.update(family="flux2"))
    e = _error(CachedLatentDataset, cache, family=cache_reads("flux2"))
    assert "has latents of shape (4, 3, 4, 6), but flux2 reads 3-d latents" in str(e)


def test_missing_sample_is_named_at_startup_and_prepare_restores_it(cache, wan, media):
    (cache / "samples" / "000001.safetensors").unlink()
    (cache / "samples" / "000002.safetensors").unlink()
    e = _error(CachedLatentDataset, cache, family="wan")
    assert str(e).startswith(f"cache {cache}: samples/000001.safetensors is missing (and 1 more files are missing")
    assert f"with data.cache_dir={cache} again (it re-encodes missing and damaged samples)" in str(e)
    m = prepare(_recipe(wan, media, cache, max_text_tokens=16), log=_quiet)  # the fix the message gives
    assert m["counts"]["new"] == 2 and len(CachedLatentDataset(cache, family="wan")) == 3


def test_truncated_sample_is_named_at_startup_and_prepare_rewrites_it(cache, wan, media):
    path = cache / "samples" / "000002.safetensors"
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[:-100])
    e = _error(CachedLatentDataset, cache)
    assert f"samples/000002.safetensors has {size - 100} bytes, the manifest declares {size}" in str(e)
    # a cache written before sizes were recorded: the size its own header implies
    _edit_manifest(cache, lambda m: [s.pop("bytes") for s in m["samples"]])
    e = _error(CachedLatentDataset, cache)
    assert f"samples/000002.safetensors has {size - 100} bytes where its header needs {size} (truncated)" in str(e)
    path.write_bytes(b"\x05")
    assert "is truncated or not a safetensors file (1 bytes)" in str(_error(CachedLatentDataset, cache))
    m = prepare(_recipe(wan, media, cache, max_text_tokens=16), log=_quiet)  # the fix the message gives
    assert m["counts"]["new"] == 1 and len(CachedLatentDataset(cache, family="wan")) == 3


def test_file_damaged_after_startup_is_named_at_load(cache):
    ds = CachedLatentDataset(cache, family="wan")
    path = cache / "samples" / "000001.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    e = _error(ds.__getitem__, 1)
    assert str(e).startswith(f"{path} has {path.stat().st_size} bytes where its header needs")
    assert not e.same_on_every_rank
    path.unlink()
    assert str(_error(ds.__getitem__, 1)).startswith(f"{path} is missing: run `python -m train.prepare")


def test_nan_in_one_sample_is_named_once_when_it_is_loaded(cache, capsys):
    """A NaN/Inf sample is named (once) when loaded and still delivered: the trainer skips the steps that read it
    (tests/test_guards.py runs that through the trainer)."""

    def plant(t):
        t["latents"][0, 1, 2, 3] = float("nan")
        t["prompt_embeds"][0, 0] = float("inf")

    _rewrite(cache / "samples" / "000001.safetensors", plant)
    ds = CachedLatentDataset(cache, family="wan")  # same size: startup reads no tensor data
    assert torch.isfinite(ds[0]["latents"]).all() and torch.isfinite(ds[2]["latents"]).all()
    assert capsys.readouterr().err == ""
    assert torch.isnan(ds[1]["latents"]).sum() == 1
    ds[1]
    path = cache / "samples" / "000001.safetensors"
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"warning: {path} holds NaN/Inf values (latents: 1 of 288, prompt_embeds: 1 of 256): the "
                             "steps that read it are skipped")  # fmt: skip


def test_missing_empty_and_unfinished_caches_each_have_their_message(cache, tmp_path):
    e = _error(CachedLatentDataset, tmp_path / "nowhere")
    assert str(e) == (
        f"data.cache_dir {tmp_path / 'nowhere'} does not exist: run `python -m train.prepare --recipe <recipe>` with "
        f"data.cache_dir={tmp_path / 'nowhere'} to create the cache, or fix the path"
    )
    assert isinstance(e, FileNotFoundError)
    (tmp_path / "empty").mkdir()
    assert "the folder is empty" in str(_error(CachedLatentDataset, tmp_path / "empty"))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.txt").write_text("x")
    assert "holds no manifest.json, so it is not a prepared cache" in str(
        _error(CachedLatentDataset, tmp_path / "other")
    )
    _edit_manifest(cache, lambda m: m.update(samples=[], counts=m["counts"] | {"bad": 3}))
    assert f"cache {cache} has no samples: 3 items of the source were bad" in str(_error(CachedLatentDataset, cache))
    (cache / "manifest.json").write_text('{"format": ')
    assert f"{cache / 'manifest.json'}: not valid JSON" in str(_error(CachedLatentDataset, cache))
    (cache / "manifest.json").unlink()
    assert "a prepare was started there but did not finish" in str(_error(CachedLatentDataset, cache))


def test_startup_checks_of_2000_files_take_seconds(prepared, tmp_path):
    cache = tmp_path / "big"
    (cache / "samples").mkdir(parents=True)
    shutil.copy(prepared / "empty_prompt.safetensors", cache)
    m = read_manifest(prepared)
    one = m["samples"][0]
    data = (prepared / one["file"]).read_bytes()
    for i in range(2000):
        (cache / "samples" / f"{i:06d}.safetensors").write_bytes(data)
    m["samples"] = [one | {"index": i, "file": f"samples/{i:06d}.safetensors"} for i in range(2000)]
    (cache / "manifest.json").write_text(json.dumps(m))
    t0 = time.perf_counter()
    assert len(CachedLatentDataset(cache, family="wan")) == 2000  # sizes from the manifest
    sized = time.perf_counter() - t0
    _edit_manifest(cache, lambda m: [s.pop("bytes") for s in m["samples"]])
    t0 = time.perf_counter()
    CachedLatentDataset(cache, family="wan")  # a cache without sizes: every header is read
    headers = time.perf_counter() - t0
    print(f"validated 2000 files: {sized:.3f} s with sizes, {headers:.3f} s reading headers")
    assert sized < 5 and headers < 10


# ------------------------------------------------------------------------------------------------------- prepare


def test_prepare_lists_non_finite_encoder_output_as_bad(wan, media, tmp_path, monkeypatch):
    encoder = family_module("wan").Encoder
    real = encoder.encode_media
    calls = []

    def nan_first(self, pixels, *args):
        out = real(self, pixels, *args)
        calls.append(1)
        if len(calls) == 1:
            out["latents"] = out["latents"].clone()
            out["latents"][0, 0] = float("nan")
        return out

    monkeypatch.setattr(encoder, "encode_media", nan_first)
    m = prepare(_recipe(wan, media, tmp_path / "c", max_text_tokens=16, max_bad_fraction=0.5), log=_quiet)
    assert m["counts"]["bad_by_reason"] == {"non_finite": 1} and m["counts"]["ok"] == 2 and m["counts"]["new"] == 2
    assert m["bad"][0]["index"] == 0 and "clip_000.mp4: the encoders gave NaN/Inf (latents: 24 of 288)" in str(m["bad"])
    assert not (tmp_path / "c" / "samples" / "000000.safetensors").exists()
    assert [s["index"] for s in m["samples"]] == [1, 2]
    calls.clear()
    with pytest.raises(PrepareError, match=r"1 of 3 items are bad \(non_finite: 1\), more than data.max_bad_fraction"):
        prepare(_recipe(wan, media, tmp_path / "c2", max_text_tokens=16, max_bad_fraction=0.2), log=_quiet)


def test_malformed_metadata_names_the_file_and_line(tmp_path):
    meta = tmp_path / "metadata.jsonl"
    meta.write_text('{"file_name": "a.mp4", "text": "a"}\n\n{"file_name": "b.mp4", "text": "b",}\n')
    e = _error(list_source, str(tmp_path))
    assert str(e) == (
        f"{meta}:3: not valid JSON (Expecting property name enclosed in double quotes at column 36): fix or delete "
        "that line"
    )
    meta.write_text('{"file_name": "a.mp4", "text": "a"}\n["b.mp4", "b"]\n')
    assert str(_error(list_source, str(tmp_path))).startswith(f"{meta}:2: a JSON list, not an object")
    meta.unlink()
    csv = tmp_path / "metadata.csv"
    csv.write_text('file_name,text\na.mp4,"a, quoted"\nb.mp4,a caption, with a comma\n')
    e = _error(list_source, str(csv))
    assert str(e).startswith(f"{csv}:3: 3 fields where the header has 2: quote fields that hold commas")
    csv.write_text("file_name,text\na.mp4\n")
    assert str(_error(list_source, str(csv))).startswith(f"{csv}:2: 1 field where the header has 2")


def test_metadata_with_a_bom_reads_and_other_encodings_are_named(tmp_path, capsys):
    """Spreadsheet exports start with a UTF-8 BOM: read as UTF-8 (the header is `file_name`, not `\\ufefffile_name`).
    A file in another encoding is one line naming it and the fix; a repeated row is said (a sample of its own)."""
    csv = tmp_path / "metadata.csv"
    csv.write_bytes("file_name,text\na.mp4,café\nb.mp4,b\na.mp4,café\n".encode("utf-8-sig"))
    items = list_source(str(csv))
    assert [items[i].name for i in range(len(items))] == ["a.mp4", "b.mp4", "a.mp4"] and items[0].caption == "café"
    assert "1 repeated row(s), each a sample of its own (trained twice as often): row 3 repeats row 1" in (
        capsys.readouterr().err
    )
    jsonl = tmp_path / "metadata.jsonl"
    jsonl.write_bytes('{"file_name": "a.mp4", "text": "café"}\n'.encode("utf-8-sig"))
    assert list_source(str(jsonl))[0].caption == "café"
    jsonl.write_bytes('{"file_name": "a.mp4", "text": "café"}\n'.encode("latin-1"))
    assert str(_error(list_source, str(jsonl))) == (f"{jsonl}: not UTF-8 (byte 0xe9 at offset 35): save it as UTF-8 "
                                                    "(e.g. `iconv -f latin1 -t utf-8`)")  # fmt: skip


def test_captions_that_reach_the_text_limit_are_said(prepared, wan, media, tmp_path) -> None:
    """The manifest lists the captions whose tokens fill data.max_text_tokens (the tokenizer cut any longer ones
    there, silently) and the summary says so: none in the module's cache (limit 16), one in a copy of its media whose
    second caption is long. Counted independently with the pipeline's own tokenizer on the pipeline's cleaned prompt
    (UMT5 adds one end token)."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean
    from transformers import AutoTokenizer

    from train.prepare import summary

    tokenizer = AutoTokenizer.from_pretrained(wan / "tokenizer")

    def reach(m: dict) -> list[str]:
        return [s["source"] for s in m["samples"] if len(tokenizer(prompt_clean(s["caption"]))["input_ids"]) >= 16]

    m = read_manifest(prepared)
    assert m["text"]["at_limit"] == reach(m) == [] and "token limit" not in summary(m, prepared)
    source = Path(shutil.copytree(media, tmp_path / "media"))
    rows = [json.loads(line) for line in (source / "metadata.jsonl").read_text().splitlines()]
    rows[1]["text"] = " ".join([rows[1]["text"]] * 4)  # ~40 tokens
    (source / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    m = prepare(_recipe(wan, source, tmp_path / "cache", max_text_tokens=16), log=_quiet)
    assert m["text"]["at_limit"] == reach(m) == [rows[1]["file_name"]], m["text"]
    said = summary(m, tmp_path / "cache")
    assert f"1 caption(s) reach the 16-token limit, so longer ones were cut there (e.g. {rows[1]['file_name']})" in said
