"""train.prepare under faults the user cannot fix in the recipe: a caption that is not text, a full disk, Ctrl-C, and
the files' permissions under the user's umask.

A caption holding a lone surrogate (JSON's "\\ud800") is a bad item like corrupt media (`bad_caption`), the rest is
prepared; a full disk (ENOSPC from the write of a sample or of the manifest, simulated below the write helper: the
module's `open`) is one `error:` line, exit code 2, saying what the cache keeps, and leaves no half-written file under a
sample's name; Ctrl-C is one line, exit code 130, and a rerun completes the cache. The read-only cache_dir cases are in
tests/test_bad_inputs.py (`prepare_cache_dir_read_only*`). Shared setup: the session's tiny wan pipeline, CLIPS demo
clips, and a copy of them whose second caption is a lone surrogate.
"""

from __future__ import annotations

import builtins
import errno
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import REPO, env

CLIPS = 12  # enough that Ctrl-C after the first sample lands well before the last


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tiny_pipeline) -> dict[str, Path]:
    from train import demo

    tmp = tmp_path_factory.mktemp("prepare_faults")
    pipe, media = tiny_pipeline("wan"), tmp / "media"
    demo.main(["--recipe", "recipes/demo.yaml", f"--set=model.pretrained_path={pipe}", f"--set=data.source={media}",
               f"--set=data.cache_dir={tmp}/unused", "--clips", str(CLIPS)])  # fmt: skip
    surrogate = tmp / "surrogate"
    shutil.copytree(media, surrogate)
    meta = surrogate / "metadata.jsonl"
    rows = [json.loads(line) for line in meta.read_text().splitlines()]
    rows[1]["text"] = "\ud800"
    # json.dumps writes it as the escape "\ud800": valid JSON (and UTF-8), which json.loads turns into a lone surrogate
    meta.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert '"text": "\\ud800"' in meta.read_text()
    return {"tmp": tmp, "pipe": pipe, "media": media, "surrogate": surrogate}


def _argv(assets: dict[str, Path], cache: Path, *sets: str, source: str = "media") -> list[str]:
    sets = ("logging.progress_bar=false", f"model.pretrained_path={assets['pipe']}", f"data.source={assets[source]}",
            f"data.cache_dir={cache}", *sets)  # fmt: skip
    return ["--recipe", "recipes/demo.yaml", *(a for s in sets for a in ("--set", s))]


def _prepare(argv: list[str]) -> int:
    """train.prepare's main in this process: its exit code (0 when it returns)."""
    from train import prepare

    try:
        prepare.main(argv)
    except SystemExit as e:
        return int(e.code)
    return 0


def _whole(cache: Path) -> list[str]:
    from train.data.dataset import safetensors_problem

    return sorted(p.name for p in (cache / "samples").glob("*") if safetensors_problem(p) is None)


def _error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    return lines[0]


def test_surrogate_caption_is_a_bad_item(assets, capsys) -> None:
    """The lone surrogate raised UnicodeEncodeError (tokenizer / safetensors metadata) and aborted the whole run: now
    that item is counted and listed as bad_caption, the other items are prepared, the run succeeds."""
    cache = assets["tmp"] / "cache_surrogate"
    code = _prepare(_argv(assets, cache, "data.max_bad_fraction=0.5", source="surrogate"))
    out = capsys.readouterr()
    assert code == 0, out.err
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["counts"]["ok"] == CLIPS - 1 and manifest["counts"]["bad"] == 1, manifest["counts"]
    assert manifest["counts"]["bad_by_reason"] == {"bad_caption": 1}
    (bad,) = manifest["bad"]
    assert bad["index"] == 1 and bad["source"] == "clip_001.mp4" and "lone surrogate (U+D800" in bad["detail"]
    assert "000001.safetensors" not in _whole(cache) and len(_whole(cache)) == CLIPS - 1
    assert "bad      bad_caption: clip_001.mp4: caption (text) holds a lone surrogate" in out.out  # the summary


class _FullDisk:
    """`open` for train.prepare: a write of a temp file whose name holds `target` writes half of its bytes, then raises
    ENOSPC (what a full disk does); everything else is the real open."""

    def __init__(self, target: str) -> None:
        self.target, self.hits = target, 0

    def __call__(self, file, mode="r", *args, **kwargs):
        f = builtins.open(file, mode, *args, **kwargs)
        if "w" not in mode or self.target not in Path(file).name:
            return f
        self.hits += 1
        return _Filling(f)


class _Filling:
    """A file on a disk that fills up halfway through the write."""

    def __init__(self, f) -> None:
        self.f = f

    def write(self, data: bytes) -> int:
        self.f.write(data[: len(data) // 2])
        self.f.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.f.name)

    def __enter__(self) -> _Filling:
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()


def test_no_space_writing_a_sample(assets, monkeypatch, capsys) -> None:
    """ENOSPC while writing the third sample: one line naming it, what is kept (the 2 whole samples), the fix; no file
    under that sample's name and no temp file left; a rerun reuses the 2 and finishes."""
    from train import prepare

    cache, full = assets["tmp"] / "cache_enospc", _FullDisk(".000002.safetensors.")
    monkeypatch.setattr(prepare, "open", full, raising=False)  # below _atomic_write: the lowest write prepare makes
    t0 = time.perf_counter()
    code = _prepare(_argv(assets, cache))
    seconds = time.perf_counter() - t0
    line = _error_line(capsys.readouterr().err)
    print(f"\nenospc_sample in-process exit {code} {seconds:.1f} s: {line}")
    assert code == 2 and full.hits == 1
    sample = cache / "samples" / "000002.safetensors"
    assert line == (f"error: no space left on device writing {sample}: 2 of {CLIPS} samples are complete in {cache} "
                    "and kept (prepare resumes from them); free space on its disk (or choose another data.cache_dir), "
                    "then rerun the same command to continue")  # fmt: skip
    assert sorted(p.name for p in (cache / "samples").iterdir()) == ["000000.safetensors", "000001.safetensors"]
    assert _whole(cache) == ["000000.safetensors", "000001.safetensors"]
    assert not (cache / "manifest.json").exists()

    monkeypatch.undo()
    assert _prepare(_argv(assets, cache)) == 0
    counts = json.loads((cache / "manifest.json").read_text())["counts"]
    assert (counts["ok"], counts["reused"], counts["new"]) == (CLIPS, 2, CLIPS - 2)


def test_no_space_writing_the_manifest(assets, monkeypatch, capsys) -> None:
    """ENOSPC while writing the manifest: every sample is kept (and said so), no manifest marks the cache complete."""
    from train import prepare

    cache, full = assets["tmp"] / "cache_enospc_manifest", _FullDisk(".manifest.json.")
    monkeypatch.setattr(prepare, "open", full, raising=False)
    code = _prepare(_argv(assets, cache))
    line = _error_line(capsys.readouterr().err)
    print(f"\nenospc_manifest in-process exit {code}: {line}")
    assert code == 2 and full.hits == 1
    assert line.startswith(f"error: no space left on device writing {cache / 'manifest.json'}: {CLIPS} of {CLIPS} "
                           f"samples are complete in {cache} and kept")  # fmt: skip
    assert not (cache / "manifest.json").exists() and not list(cache.glob(".manifest*"))
    assert len(_whole(cache)) == CLIPS

    monkeypatch.undo()
    assert _prepare(_argv(assets, cache)) == 0
    assert json.loads((cache / "manifest.json").read_text())["counts"]["reused"] == CLIPS


def test_files_follow_the_umask(assets) -> None:
    """safetensors' save_file made every sample 0600 whatever the umask: now each cached file is 0o666 & ~umask."""
    from train.files import match_umask

    cache = assets["tmp"] / "cache_umask"
    old = os.umask(0o027)
    try:
        assert _prepare(_argv(assets, cache)) == 0
        loose = assets["tmp"] / "loose"
        loose.mkdir()
        (loose / "a").write_text("x")
        os.chmod(loose / "a", 0o600)
        os.chmod(loose, 0o700)
        match_umask(loose)  # a folder: it and everything in it (train/export.py publishes one)
    finally:
        os.umask(old)
    files = [p for p in cache.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"manifest.json", "prepare_config.json", "empty_prompt.safetensors",
                                       "000000.safetensors"}  # fmt: skip
    modes = {p.relative_to(cache).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in files}
    assert set(modes.values()) == {0o640}, modes
    assert stat.S_IMODE(loose.stat().st_mode) == 0o750 and stat.S_IMODE((loose / "a").stat().st_mode) == 0o640


def _run(argv: list[str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "train.prepare", *argv], cwd=REPO, env=env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)  # fmt: skip


@pytest.mark.slow
def test_ctrl_c_is_one_line_and_resumes(assets) -> None:
    """SIGINT once the first sample is written: one line saying how many samples are cached, exit 130, no traceback;
    the same command again completes the cache, reusing them."""
    cache = assets["tmp"] / "cache_sigint"
    argv = _argv(assets, cache)
    proc = _run(argv)
    samples, deadline = cache / "samples", time.monotonic() + 300
    while not list(samples.glob("0*.safetensors")):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no sample written"
        time.sleep(0.005)
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    seconds = time.perf_counter() - t0
    print(f"\nctrl_c launched exit {proc.returncode} {seconds:.1f} s after SIGINT: {err.strip()}")
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in out + err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    m = re.fullmatch(rf"interrupted: (\d+) of {CLIPS} samples are cached in (.+); rerun the same command to continue",
                     lines[0])  # fmt: skip
    assert m and m.group(2) == str(cache), lines[0]
    kept = len(_whole(cache))
    assert int(m.group(1)) == kept and 1 <= kept < CLIPS, (lines[0], kept)
    assert not (cache / "manifest.json").exists()

    rerun = _run(argv)
    out, err = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, err
    counts = json.loads((cache / "manifest.json").read_text())["counts"]
    assert (counts["ok"], counts["reused"], counts["new"]) == (CLIPS, kept, CLIPS - kept)
    assert not list(samples.glob(".*.tmp"))  # the interrupted write's temp file, if any, is gone
