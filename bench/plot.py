"""Plot the activation-memory table of docs/performance.md (written by `python -m bench.memory`).

    python -m bench.plot            # → docs/memory_vs_cp.png

Reads the markdown table back rather than re-measuring, so the plot shows exactly the numbers in the document.
"""

from __future__ import annotations

from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "performance.md"


def memory_rows(doc: Path = DOC) -> list[dict[str, str]]:
    lines = doc.read_text().splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("| model | size | shape | CP | blocks |"))
    cols = [c.strip() for c in lines[head].strip("|").split("|")]
    rows = []
    for ln in lines[head + 2 :]:
        if not ln.startswith("|"):
            break
        rows.append(dict(zip(cols, (c.strip() for c in ln.strip("|").split("|")))))
    return rows


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = memory_rows()
    fig, ax = plt.subplots(figsize=(6, 4))
    degrees = sorted({int(r["CP"]) for r in rows})
    ax.plot(degrees, [1 / d for d in degrees], "k--", label="ideal 1/N")
    for model, size in sorted({(r["model"], r["size"]) for r in rows}):
        sel = sorted((int(r["CP"]), float(r["blocks ratio"])) for r in rows if (r["model"], r["size"]) == (model, size))
        ax.plot([d for d, _ in sel], [v for _, v in sel], "o-", label=f"{model} {size}: blocks")
    ax.set_xlabel("CP degree (ranks)")
    ax.set_ylabel("activation bytes per rank / CP 1")
    ax.set_xticks(degrees)
    ax.set_title("Activations saved for backward, per rank (bench.memory)")
    ax.grid(alpha=0.3)
    ax.legend()
    out = DOC.parent / "memory_vs_cp.png"
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
