"""Build the embedded demo's inputs, offline: a small real media set and a tiny random-init Wan pipeline.

    python -m train.demo --out outputs/demo/assets

writes `media/` (mp4 clips of moving coloured shapes + metadata.jsonl with captions that describe them) and
`pipeline/` (a WanPipeline folder: tiny UMT5 text encoder, tiny AutoencoderKLWan, tokenizer, scheduler, transformer),
which `recipes/demo.yaml` points at. launch/demo.sh then runs `train.prepare` (media → cached latents) and trains.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from train.data.synthetic_media import make_media_set
from train.tiny.pipelines import build_tiny_pipeline


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m train.demo", description=__doc__)
    parser.add_argument("--out", default="outputs/demo/assets", help="folder for media/ and pipeline/")
    parser.add_argument("--clips", type=int, default=16, help="number of clips")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if not (out / "media" / "metadata.jsonl").exists():
        make_media_set(out / "media", num_videos=args.clips, frames=17, height=48, width=80, fps=16)
    if not (out / "pipeline" / "model_index.json").exists():
        build_tiny_pipeline("wan", out / "pipeline")
    print(f"demo assets: {out / 'media'} ({args.clips} clips), {out / 'pipeline'} (tiny WanPipeline)")


if __name__ == "__main__":
    main()
