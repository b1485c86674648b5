"""Build the embedded demo's inputs, offline: a small real media set and a tiny random-init pipeline.

    python -m train.demo --recipe recipes/demo.yaml [--set data.source=...] [--clips 16]

Everything comes from the recipe: `model.family` picks the tiny pipeline (`train.models.build_tiny_pipeline`), which
is written to `model.pretrained_path`; `data.source` gets `media/`-style mp4 clips of moving coloured shapes +
metadata.jsonl with captions that describe them, at the recipe's `data.num_frames`, `data.height`, `data.width` and
`data.fps`. launch/demo.sh then runs `train.prepare` (media → cached latents) and trains with the same recipe.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from train.config import add_recipe_args, recipe_from_args
from train.data.synthetic_media import make_media_set
from train.models import build_tiny_pipeline, get_family


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m train.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_recipe_args(parser)
    parser.add_argument("--clips", type=int, default=16, help="number of clips")
    args = parser.parse_args(argv)
    recipe = recipe_from_args(args)
    family, pipeline, data = recipe.model.family, recipe.model.pretrained_path, recipe.data
    if pipeline is None or data.source is None:
        raise SystemExit("error: the demo recipe needs model.pretrained_path and data.source (where to write them)")
    media = Path(data.source)
    if not (media / "metadata.jsonl").exists():
        videos = args.clips if get_family(family).latent_kind == "video" else 0  # image families: still images
        make_media_set(media, num_videos=videos, num_images=args.clips - videos, frames=data.num_frames,
                       height=data.height, width=data.width, fps=16.0 if data.fps is None else data.fps)  # fmt: skip
    build_tiny_pipeline(family, pipeline)  # reused when already there
    print(f"demo assets: {media} ({args.clips} clips), {pipeline} (tiny {family} pipeline)")


if __name__ == "__main__":
    main()
