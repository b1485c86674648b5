"""A run's plots and summary: `python -m train.report <output_dir>`.

    python -m train.report outputs/tiny-wan      # → outputs/tiny-wan/report.md + outputs/tiny-wan/report/*.png

Reads only what the trainer wrote in output_dir: `metrics.jsonl` (one line per logged optimizer step,
train/metrics.py), `recipe.yaml` (the resolved recipe), `layout.json` (mesh, CP plan, gradient reduction, weights) and
`memory.json` (train.estimate's prediction at startup, with the world size; written by `record_memory`). Writes one PNG
per chart (loss raw and smoothed, grad norm, lr, transformer tokens/s, peak memory against step) and `report.md`: the
recipe, the parallel layout and degrees, the data (batch size per bucket; a mixture's datasets and what each
contributed), the predicted vs measured peak memory, throughput, and where the weights are.

The trainer writes the report at the end of every run (rank 0, after export) through `report_at_end`, which never
raises: the report is derived from files already on disk, so a plotting failure must not turn a trained, exported run
into a failed job (its exit code is what schedulers and `train.launch` act on); the command above rewrites it later.
A report that fails replaces the output_dir's previous report.md (an earlier process's or run's: stale) with a short
one saying why and how to retry, and removes its charts; one that cannot even write that removes report.md.

A damaged input (a metrics line that is not one the trainer writes, metrics.jsonl a folder, a damaged memory.json or
layout.json) is one line from the command (`error: <file>, line N: ...`, exit code 2) naming the file and the fix.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from train.config import Recipe, load_recipe
from train.errors import UserError, report

SMOOTHING = 0.9  # EMA weight of the smoothed loss (as wandb / TensorBoard "smoothing"), debiased at the start
# (metrics.jsonl key, file stem, y label, scale): one chart each; the loss chart also draws the smoothed curve
CHARTS = (
    ("loss", "loss", "loss", 1.0),
    ("val_loss", "val_loss", "held-out loss (fixed noise and timesteps)", 1.0),
    ("preservation_loss", "preservation_loss", "preservation term (adapted vs base, unweighted)", 1.0),
    ("grad_norm", "grad_norm", "gradient norm (before clipping)", 1.0),
    ("lr", "lr", "learning rate", 1.0),
    ("transformer_tokens_per_s", "tokens_per_s", "transformer tokens / s (whole job)", 1.0),
    ("peak_mem_bytes", "peak_memory", "peak memory, rank 0 (GiB)", 2.0**-30),
)
GIB = 2**30


@dataclass
class Run:
    """What the trainer left in an output_dir."""

    out: Path
    metrics: list[dict]
    recipe: Recipe
    layout: dict
    memory: dict | None  # memory.json; None for a run that did not record it


def record_memory(out_dir: Path, recipe: Recipe, world_size: int, device_type: str, line: str) -> None:
    """Write `memory.json`: the trainer's startup line (`memory: ...`) and train.estimate's predicted peak per rank in
    bytes for this layout (the same call startup_check makes; cheap after it), for the report. Rank 0 calls it."""
    from train.estimate import estimate

    record: dict = {"startup_check": line, "world_size": world_size, "device_type": device_type}
    try:
        e = estimate(recipe, world_size, device_type)
        record |= {"predicted_peak_bytes": e.peak, "components_bytes": e.components, "layout": e.layout}
    except Exception as err:  # noqa: BLE001 — e.g. memory_check: off for a model the estimator cannot build
        record["predicted_peak_bytes"] = None
        record["why_no_prediction"] = f"{type(err).__name__}: {err}"
    (out_dir / "memory.json").write_text(json.dumps(record, indent=1))


# Every training step's line holds these (train/finetune.py `train_step`); the report reads each of them.
STEP_KEYS = ("loss", "grad_norm", "lr", "transformer_tokens_per_s", "step_time_s", "peak_mem_bytes")
# numbers when present (val_loss may be null), as are samples/<name>
NUMBERS = (*STEP_KEYS, "val_loss", "bad_steps", "preservation_loss")
DAMAGED = "the file was edited or damaged: restore it, or delete that line"


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _problem(line: object) -> str | None:
    """Why a parsed metrics line is not one the trainer writes; None when it is. What resume needs (a step number) and
    the types of the values the report reads; `report_keys` adds the keys the report needs."""
    if not isinstance(line, dict):
        return f"a JSON {type(line).__name__}, not an object"
    if "step" not in line:
        return 'no "step" key'
    step = line["step"]
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f'"step" is {json.dumps(step)}, not a step number'
    for key, v in line.items():
        if (key in NUMBERS or key.startswith("samples/")) and not (_number(v) or (v is None and key == "val_loss")):
            return f'"{key}" is {json.dumps(v)}, not a number'
    return None


def _report_problem(line: dict) -> str | None:
    """What the report needs beyond `_problem`: a training step's keys (step 0's line holds only val_loss)."""
    if "loss" not in line and "val_loss" not in line:
        return 'neither "loss" nor "val_loss"'
    missing = [k for k in STEP_KEYS if k not in line] if "loss" in line else []
    if not missing:
        return None
    return f"no {', '.join(repr(k) for k in missing)} (a training step's line holds {', '.join(STEP_KEYS)})"


def read_metrics(path: Path, report_keys: bool = False) -> tuple[list[dict], str | None]:
    """metrics.jsonl's lines, and a note when its last line was torn (a run killed while writing it: dropped). A
    damaged line (not JSON before the last line; anywhere, JSON that is not a metrics line: `_problem`, and with
    `report_keys` `_report_problem`), or a file that cannot be read, is a UserError naming it and the fix."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except IsADirectoryError:
        raise UserError(f"{path} is a folder, not the run's metrics file (one JSON line per logged step): move it "
                        "away, or restore the file") from None  # fmt: skip
    except OSError as e:
        raise UserError(f"cannot read {path} ({e.strerror or e}): fix its permissions, or restore it") from None
    raw = [(i + 1, ln) for i, ln in enumerate(text.splitlines()) if ln.strip()]
    lines, note = [], None
    for k, (number, ln) in enumerate(raw):
        try:
            line = json.loads(ln)
        except ValueError as e:  # not JSON: a torn last line (the write cut short), or damage before it
            if k == len(raw) - 1:
                note = f"{path}: its last line ({number}) is torn (a run stopped while writing it): left out"
                continue
            raise UserError(f"{path}, line {number}: not a metrics line ({e}); {DAMAGED}") from None
        problem = _problem(line) or (_report_problem(line) if report_keys else None)
        if problem:  # whole JSON, the wrong shape: not a torn write, wherever it is
            raise UserError(f"{path}, line {number}: not a metrics line ({problem}); {DAMAGED}")
        lines.append(line)
    return lines, note


def _read_json(path: Path) -> dict | None:
    """memory.json or layout.json as a dict; None when absent; a UserError when damaged (the run wrote them)."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path} cannot be read ({type(e).__name__}: {e}): restore it, or delete it (the report "
                        "then leaves its rows out)") from None  # fmt: skip
    if not isinstance(data, dict):
        raise UserError(f"{path} holds a JSON {type(data).__name__}, not an object: restore it, or delete it (the "
                        "report then leaves its rows out)")  # fmt: skip
    return data


def load_run(out: Path) -> Run:
    metrics_path = out / "metrics.jsonl"
    if not metrics_path.exists():
        raise UserError(f"{metrics_path} does not exist: is {out} a training run's output_dir?")
    if not (out / "recipe.yaml").exists():
        raise UserError(f"{out} has no recipe.yaml (a run writes it at its start): is it a training run's output_dir?")
    lines, note = read_metrics(metrics_path, report_keys=True)
    if note:
        print(f"report: {note}")
    memory, layout = _read_json(out / "memory.json"), _read_json(out / "layout.json") or {}
    try:  # (load_recipe's own errors are UserErrors; not text, or not a file, are not)
        recipe = load_recipe(out / "recipe.yaml")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{out / 'recipe.yaml'} cannot be read ({type(e).__name__}: {e}): restore it (the run wrote "
                        "its resolved recipe there)") from None  # fmt: skip
    return Run(out, lines, recipe, layout, memory)


def smooth(values: list[float], weight: float = SMOOTHING) -> list[float]:
    """Debiased exponential moving average (TensorBoard's smoothing); non-finite values (skipped steps) are passed
    through as NaN and leave the average unchanged."""
    out, avg, n = [], 0.0, 0
    for v in values:
        if not math.isfinite(v):
            out.append(math.nan)
            continue
        n += 1
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight**n))
    return out


def plot(run: Run, folder: Path) -> list[Path]:
    """One PNG per chart in `folder`; returns their paths (charts whose key no line holds are left out)."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global figure state, a faster import
    from matplotlib.ticker import MaxNLocator

    folder.mkdir(parents=True, exist_ok=True)

    memory = run.memory or {}
    # The prediction is drawn against what it predicts: GPU tensor memory. On CPU the measurement is the process's
    # resident set (interpreter and libraries included), another quantity; report.md gives both.
    predicted = memory.get("predicted_peak_bytes") if memory.get("device_type") == "cuda" else None
    paths = []
    for key, stem, label, scale in CHARTS:
        points = [(m["step"], m[key] * scale) for m in run.metrics if m.get(key) is not None]
        if not points:
            continue
        steps, values = [p[0] for p in points], [p[1] for p in points]
        fig = Figure(figsize=(6.4, 3.6))
        ax = fig.subplots()
        ax.plot(steps, values, "-" if len(steps) > 30 else "o-", lw=1, ms=3, alpha=0.45 if key == "loss" else 1.0,
                label="raw" if key == "loss" else None)  # fmt: skip
        if key == "loss":
            ax.plot(steps, smooth(values), "-", lw=2, label=f"smoothed (EMA {SMOOTHING})")
        if key == "peak_mem_bytes" and predicted:
            ax.axhline(predicted * scale, ls="--", color="k", lw=1, label="train.estimate prediction per rank")
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(label)
        ax.set_title(f"{run.recipe.name}: {label}")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = folder / f"{stem}.png"
        fig.savefig(path, dpi=100)
        paths.append(path)
    return paths


def _size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= 0.1 * GIB else f"{n / 2**20:.1f} MiB"


def _table(rows: list[tuple[str, object]]) -> list[str]:
    return ["| | |", "|---|---|"] + [f"| {k} | {str(v).replace('|', '/')} |" for k, v in rows]


def summary(run: Run, charts: list[Path]) -> str:
    """The markdown report: one section per question a reader of the run asks, each a table."""
    out, p = run.out, run.recipe.parallel
    world = (run.memory or {}).get("world_size")
    rep, shard, cp = p.resolve(world) if world else (p.dp_replicate, p.dp_shard, p.cp)
    lines = [f"# Run report: {run.recipe.name}", "",
             f"`{out}`; written by `python -m train.report {out}` (the trainer writes it at the end of every run) from "
             "metrics.jsonl, recipe.yaml, layout.json and memory.json.", ""]  # fmt: skip
    lines += ["## Result", ""] + _result(run)
    lines += ["", "## Recipe", ""] + _recipe(run, rep * shard)
    lines += ["", "## Parallel layout", ""] + _table([
        ("world size", world if world else "not recorded"),
        ("dp_replicate × dp_shard × cp", f"{rep} × {shard} × {cp}"),
        *[(k.replace("_", " "), v) for k, v in run.layout.items() if k != "data"],
    ])  # fmt: skip
    if run.layout.get("data"):
        lines += ["", "## Data", ""] + _table(_data_rows(run))
    lines += ["", "## Memory and throughput", ""] + _table(_memory_rows(run))
    lines += ["", "## Outputs", ""] + _table(_outputs(run))
    lines += ["", "## Charts", ""] + [f"![{c.stem}]({c.relative_to(out).as_posix()})" for c in charts]
    return "\n".join(lines) + "\n"


def _result(run: Run) -> list[str]:
    """How the loss went: the steps logged, first, final and lowest loss, and how many steps were skipped."""
    r, m = run.recipe, [x for x in run.metrics if "loss" in x]  # (step 0's line holds only the held-out loss)
    held = [x for x in run.metrics if x.get("val_loss") is not None]
    kept = [x for x in m if "preservation_loss" in x]  # train.preservation
    if not m:
        return ["No metrics lines (the run logged no step)."]
    finite = [x for x in m if math.isfinite(x["loss"])]
    best = min(finite, key=lambda x: x["loss"]) if finite else None
    return _table([
        ("steps logged", f"{len(m)} (steps {m[0]['step']}-{m[-1]['step']} of max_steps {r.train.max_steps}, every "
                         f"{r.logging.every_n_steps})"),
        (f"final loss (step {m[-1]['step']})", f"{m[-1]['loss']:.6g}"),
        (f"first loss (step {m[0]['step']})", f"{m[0]['loss']:.6g}"),
        ("lowest loss", f"{best['loss']:.6g} (step {best['step']})" if best else "none finite"),
        (f"final grad norm (step {m[-1]['step']})", f"{m[-1]['grad_norm']:.6g}"),
        ("skipped steps (non-finite loss or grad norm)", m[-1].get("bad_steps", 0)),
        *([(f"held-out loss (step {held[0]['step']} → {held[-1]['step']})",
            f"{held[0]['val_loss']:.6g} → {held[-1]['val_loss']:.6g} (lowest {min(x['val_loss'] for x in held):.6g})")]
          if held else []),
        *([(f"preservation term (step {kept[0]['step']} → {kept[-1]['step']}, weight {r.train.preservation.weight:g})",
            f"{kept[0]['preservation_loss']:.6g} → {kept[-1]['preservation_loss']:.6g}")]
          if kept and r.train.preservation is not None else []),
    ])  # fmt: skip


def _recipe(run: Run, dp: int) -> list[str]:
    """What was trained, and how: model, method, samples per optimizer step over the `dp` data-parallel ranks, lr,
    precision, activation levers, data."""
    r, out = run.recipe, run.out
    t, ft = r.train, r.finetune
    model = f"`{r.model.pretrained_path}` ({r.model.subfolder})" if r.model.pretrained_path else "random init"
    kind = {"lora": "DoRA" if ft.dora else "LoRA", "lokr": "LoKr", "loha": "LoHa"}[ft.adapter]
    method = f"{kind} (rank {ft.lora_rank}, alpha {ft.lora_alpha:g})" if ft.method == "lora" else "full fine-tuning"
    levers = [
        f"gradient checkpointing (every {t.checkpoint_every} block, {t.checkpoint_policy})"
        if t.gradient_checkpointing
        else None,
        "activation offload" if t.offload_activations else None,
        "torch.compile" if t.compile else None,
    ]
    data = f"synthetic ({r.data.synthetic.num_samples} samples)" if r.data.synthetic else f"`{r.data.cache_dir}`"
    if r.data.datasets is not None:
        data = f"{len(r.data.datasets)} caches mixed (data.datasets: see Data)"
    batch = (f"batch_size {t.batch_size} × grad_accum {t.grad_accum} × dp {dp} = {t.batch_size * t.grad_accum * dp} "
             "samples" if t.batch_tokens is None else f"batch_tokens {t.batch_tokens} (a batch size per bucket: see "
             f"Data) × grad_accum {t.grad_accum} × dp {dp}")  # fmt: skip
    return _table([
        ("family", r.model.family), ("transformer", f"{model}, {r.model.dtype}"), ("method", method),
        ("batch per step", batch),
        ("lr", f"{t.lr:g}, {t.lr_schedule}, warmup {t.warmup_steps}, max_grad_norm {t.max_grad_norm}"),
        ("precision", run.layout.get("mixed_precision", t.mixed_precision)),
        ("activation levers", ", ".join(x for x in levers if x) or "none"), ("data", data),
        *([("preservation", f"differential output preservation: '{t.preservation.trigger}' → "
            f"'{t.preservation.class_word}', weight {t.preservation.weight:g}")] if t.preservation else []),
        ("recipe", f"`{out / 'recipe.yaml'}`"),
    ])  # fmt: skip


def _data_rows(run: Run) -> list[tuple[str, object]]:
    """What the run trained on (layout.json's `data`, train/data/batches.py `Batches.describe`): each bucket's batch
    size (and tokens per sample, under train.batch_tokens) and samples per epoch; a mixture's datasets: their settings,
    their planned share of an epoch and what each contributed (the last metrics line's `samples/<name>`: the samples
    of it the whole job trained on)."""
    d = run.layout["data"]
    rows: list[tuple[str, object]] = []
    for bucket, b in d["buckets"].items():
        tokens = f", {b['tokens_per_sample']} tokens per sample" if "tokens_per_sample" in b else ""
        rows.append((f"bucket {bucket}", f"batch size {b['batch_size']}{tokens}; {b['samples_per_epoch']} samples "
                     "per epoch"))  # fmt: skip
    rows.append(("batches per epoch (each data-parallel group)", d["batches_per_epoch"]))
    datasets = d.get("datasets", [])
    last = next((x for x in reversed(run.metrics) if f"samples/{datasets[0]['name']}" in x), None) if datasets else None
    planned = sum(x["samples_per_epoch"] for x in datasets)
    trained = sum(last[f"samples/{x['name']}"] for x in datasets) if last else 0
    for x in datasets:
        drawn = f"weight {x['weight']:g}" if x["weight"] is not None else f"repeats {x['repeats']}"
        if x.get("loss_weight") is not None:  # data.datasets[].loss_weight (prior preservation)
            drawn += f", loss weight {x['loss_weight']:g}"
        said = (f"`{x['cache_dir']}`: {x['samples']} samples, {drawn}, caption dropout {x['caption_dropout']:g}; "
                f"{x['samples_per_epoch']} per epoch ({x['samples_per_epoch'] / planned:.1%})")  # fmt: skip
        if last:
            n = last[f"samples/{x['name']}"]
            said += f"; trained on {n} by step {last['step']} ({n / max(trained, 1):.1%})"
        rows.append((f"dataset {x['name']}", said))
    return rows


def _memory_rows(run: Run) -> list[tuple[str, object]]:
    """Predicted vs measured peak memory and throughput. The ratio is given on CUDA only: on CPU the measurement is
    the process's resident set, not the tensor bytes the estimate predicts. The first step is left out of the
    throughput when there are others (it includes warm-up)."""
    m, mem = [x for x in run.metrics if "loss" in x], run.memory or {}
    predicted = mem.get("predicted_peak_bytes")
    device = mem.get("device_type", "cuda")
    rows = [("predicted peak per rank (train.estimate at startup)",
             _size(predicted) if predicted else mem.get("why_no_prediction", "not recorded"))]  # fmt: skip
    if not m:
        return rows
    peak = max(x["peak_mem_bytes"] for x in m)
    what = ("torch.cuda.max_memory_allocated" if device == "cuda" else
            "the process's peak resident set: Python, torch and the imports included, so not comparable with the "
            "prediction of tensor bytes")  # fmt: skip
    rows.append(("measured peak, rank 0", f"{_size(peak)} ({what})"))
    if predicted and device == "cuda":
        rows.append(("measured / predicted", f"{peak / predicted:.2f}"))
    steady = m[1:] or m  # the first step includes warm-up (allocations, compile)
    tps = statistics.fmean(x["transformer_tokens_per_s"] for x in steady)
    rows += [(f"transformer tokens/s, whole job (mean of steps {steady[0]['step']}-{steady[-1]['step']})",
              f"{tps:.6g}"),
             ("step time (median)", f"{statistics.median(x['step_time_s'] for x in steady):.4g} s")]  # fmt: skip
    return rows


def _outputs(run: Run) -> list[tuple[str, object]]:
    """Where the run's files are, and how to use them: metrics, the exported weights (with the call that loads
    them), the latest checkpoint, and the wandb runs (with the sync command when offline)."""
    r, out = run.recipe, run.out
    kind = r.exported
    lokr = r.finetune.adapter == "lokr"  # diffusers' LoKr loader: the transformer's, not the pipeline's
    load = ('`pipe.transformer.load_lora_adapter(path, prefix="transformer")`' if lokr
            else "`<Pipeline>.load_lora_weights(path)`")  # fmt: skip
    weights = {"lora": (out / "lora", load),
               "full": (out / "transformer", "`<Transformer>.from_pretrained(path)`")}.get(kind)  # fmt: skip
    if kind == "none":
        exported = "none (checkpoint.export: none)"
    else:
        exported = f"`{weights[0]}` ({kind}; load with {weights[1]})" if weights[0].exists() else "not written"
        ema = weights[0].with_name(f"{weights[0].name}_ema")
        if r.ema is not None:
            exported += f"; its EMA (decay {r.ema.decay:g}): `{ema}`" if ema.exists() else "; its EMA: not written"
        second = weights[0].with_name(f"{weights[0].name}_2")  # model.both_experts: transformer_2's
        if r.model.both_experts:
            exported += f"; transformer_2's: `{second}` (`load_into_transformer_2=True`)" if second.exists() else ""
        original = weights[0].with_name(f"{weights[0].name}_original")  # checkpoint.export_format original / both
        if original.exists():
            exported += f"; original keys (ComfyUI): `{original / 'lora.safetensors'}`"
    checkpoints = sorted((out / "checkpoints").glob("step_*")) if (out / "checkpoints").is_dir() else []
    wandb_runs = sorted((out / "wandb").glob("offline-run-*")) + sorted((out / "wandb").glob("run-*"))
    wandb = ", ".join(f"`{w}`" for w in wandb_runs) or "none"
    if any(w.name.startswith("offline") for w in wandb_runs):
        wandb += " (upload: `wandb sync <dir>`)"
    return [("metrics", f"`{out / 'metrics.jsonl'}`"), ("exported weights", exported),
            ("latest checkpoint", f"`{checkpoints[-1]}` ({len(checkpoints)} kept)" if checkpoints else "none"),
            ("wandb", wandb)]  # fmt: skip


def write_report(out: Path) -> list[Path]:
    """Write `out/report/*.png` and `out/report.md`; returns the PNG paths. Charts of an earlier report that this
    one has no data for are removed (they would be another run's, or an older state's)."""
    run = load_run(out)
    charts = plot(run, out / "report")
    _remove_charts(out, keep=charts)
    _write_atomic(out / "report.md", summary(run, charts))
    return charts


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")  # a failed write (a full disk) leaves no half report
    try:
        tmp.write_text(text)
        tmp.rename(path)
    finally:
        tmp.unlink(missing_ok=True)


def _remove_charts(out: Path, keep: list[Path] | tuple[()] = ()) -> None:
    for _, stem, _, _ in CHARTS:
        path = out / "report" / f"{stem}.png"
        if path not in keep:
            path.unlink(missing_ok=True)


def report_at_end(out: Path) -> list[Path]:
    """The trainer's end-of-run report: `write_report`, or one printed line on failure (never raises; see above).
    A failed report replaces the previous report.md (another run's or an earlier process's: stale) with a short one
    saying why and how to retry, and removes its charts; if even that cannot be written, report.md is removed."""
    try:
        charts = write_report(out)
    except Exception as err:  # noqa: BLE001 — the run's weights and metrics are written; the report is optional
        why = f"{type(err).__name__}: {err}"
        retry = f"`python -m train.report {out}`"
        try:
            _remove_charts(out)
            _write_atomic(out / "report.md", f"# Run report: not written\n\nThe end-of-run report failed ({why}).\n"
                          f"\nFix the cause, then write it with {retry}.\n")  # fmt: skip
            said = f"{out / 'report.md'} says why"
        except Exception:  # noqa: BLE001 — a full disk: no stale report stays either
            with contextlib.suppress(OSError):
                (out / "report.md").unlink(missing_ok=True)
            said = "the previous report.md removed"
        print(f"report: not written ({why}); {said}; retry with {retry}")
        return []
    print(f"report: {out / 'report.md'} ({len(charts)} charts in {out / 'report'})")
    return charts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("output_dir", type=Path, help="a training run's output_dir (holds metrics.jsonl)")
    args = parser.parse_args(argv)
    try:
        charts = write_report(args.output_dir)
    except UserError as err:
        return report(err)
    print(f"wrote {args.output_dir / 'report.md'} and {len(charts)} charts in {args.output_dir / 'report'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
