"""A small, real media set for tests and demos: clips of moving coloured shapes, still images, captions that say what
they show, and (on request) deliberately bad items.

    items = make_media_set("demo_media", num_videos=8, num_images=2, frames=17, height=64, width=96)
    # demo_media/clip_000.mp4, ..., demo_media/image_000.png, ..., demo_media/metadata.jsonl

`metadata.jsonl` follows the `datasets` imagefolder/videofolder convention: one JSON object per line with
`file_name` (relative to the folder) and the caption column (`text` by default). Captions are exact descriptions
("a red square moving left on a black background"), generated from a seeded RNG, so a set is reproducible.

Codecs: `libx264rgb` (CRF 0, RGB) is lossless and the default; `libx264` (yuv420p, CRF 18) is what real clips look
like (about 1.7/255 mean round-trip error from chroma subsampling); `ffv1` in `.mkv` is lossless too (its container
header carries no frame count, a useful edge case).

Sound (`audio=True`, off by default): each clip gets a stereo track as long as the clip, a sine tone per channel whose
pitch says what the clip shows (left: the colour, `COLOR_TONES`; right: the shape, `SHAPE_TONES`), encoded as AAC
(`audio_codec="aac"`, what real clips carry) or FLAC (lossless) in the same container. Tones stay below 2 kHz, so any
audio VAE rate from 4 kHz up keeps them.

Bad items (`bad=`) for the prepare tests, each with the reason `train.prepare` must report:
    corrupt      random bytes with a .mp4 name                        -> unreadable
    missing      a metadata line whose file does not exist            -> unreadable
    short        a 3-frame clip                                       -> too_short
    no_caption   a good clip whose caption is missing / empty         -> no_caption
    small        a 16x16 image                                        -> too_small
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "BAD_KINDS",
    "COLORS",
    "COLOR_TONES",
    "SHAPE_TONES",
    "caption_for",
    "make_media_set",
    "render_clip",
    "render_tones",
    "write_image",
    "write_video",
]

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 200, 60),
    "blue": (40, 80, 230),
    "yellow": (235, 220, 40),
    "white": (245, 245, 245),
    "purple": (150, 50, 200),
    "orange": (245, 140, 30),
}
BACKGROUNDS: dict[str, tuple[int, int, int]] = {"black": (10, 10, 10), "gray": (110, 110, 110)}
SHAPES = ("square", "circle", "triangle")
# Pitch (Hz) of the left channel by colour and of the right channel by shape, in clips written with audio=True.
COLOR_TONES: dict[str, float] = {"red": 250.0, "green": 375.0, "blue": 500.0, "yellow": 625.0, "white": 750.0,
                                 "purple": 875.0, "orange": 1000.0}  # fmt: skip
SHAPE_TONES: dict[str, float] = {"square": 1250.0, "circle": 1500.0, "triangle": 1750.0}
DIRECTIONS: dict[str, tuple[int, int]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
BAD_KINDS: dict[str, str] = {
    "corrupt": "unreadable",
    "missing": "unreadable",
    "short": "too_short",
    "no_caption": "no_caption",
    "small": "too_small",
}


def caption_for(shape: str, color: str, direction: str | None, background: str) -> str:
    motion = f" moving {direction}" if direction else ""
    return f"a {color} {shape}{motion} on a {background} background"


def _draw(canvas: np.ndarray, shape: str, color: tuple[int, int, int], cx: float, cy: float, r: float) -> None:
    h, w = canvas.shape[:2]
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32) + 0.5
    if shape == "square":
        mask = (np.abs(xx - cx) <= r) & (np.abs(yy - cy) <= r)
    elif shape == "circle":
        mask = (xx - cx) ** 2 + (yy - cy) ** 2 <= r * r
    elif shape == "triangle":  # apex up: inside when below the apex and within the widening sides
        dy = yy - (cy - r)
        mask = (dy >= 0) & (yy <= cy + r) & (np.abs(xx - cx) <= dy / 2)
    else:
        raise ValueError(f"unknown shape {shape!r}; choose from {SHAPES}")
    canvas[mask] = color


def render_clip(
    shape: str,
    color: str,
    direction: str | None,
    background: str = "black",
    *,
    frames: int = 17,
    height: int = 64,
    width: int = 96,
    speed: float = 2.0,
) -> np.ndarray:
    """uint8 (frames, height, width, 3): the shape moving `speed` pixels per frame in `direction` (None = still)."""
    r = max(2.0, min(height, width) / 6)
    dx, dy = DIRECTIONS[direction] if direction else (0, 0)
    # start so that the whole path stays in view
    span = speed * (frames - 1)
    cx0 = width / 2 - dx * span / 2
    cy0 = height / 2 - dy * span / 2
    out = np.empty((frames, height, width, 3), dtype=np.uint8)
    for t in range(frames):
        out[t] = BACKGROUNDS[background]
        _draw(out[t], shape, COLORS[color], cx0 + dx * speed * t, cy0 + dy * speed * t, r)
    return out


def render_tones(left_hz: float, right_hz: float, seconds: float, sample_rate: int = 16000) -> np.ndarray:
    """float32 (2, round(seconds * sample_rate)): a sine of amplitude 0.3 per channel."""
    t = np.arange(round(seconds * sample_rate)) / sample_rate
    return (0.3 * np.sin(2 * np.pi * np.array([[left_hz], [right_hz]]) * t)).astype(np.float32)


def write_video(
    path: str | Path,
    frames: np.ndarray,
    fps: float = 16,
    codec: str = "libx264rgb",
    audio: np.ndarray | None = None,
    audio_rate: int = 16000,
    audio_codec: str = "aac",
) -> Path:
    """Encode uint8 (F, H, W, 3) frames with PyAV. codec: libx264rgb (lossless), libx264 (yuv420p), ffv1 (.mkv).

    `audio`, when given, is a float (channels, samples) waveform at `audio_rate` in [-1, 1], muxed as a second stream
    (audio_codec: aac, or flac for a lossless track).
    """
    import av

    path = Path(path)
    options, pix_fmt = {}, "yuv420p"
    if codec == "libx264rgb":
        options, pix_fmt = {"crf": "0"}, "rgb24"
    elif codec == "libx264":
        options = {"crf": "18"}
    elif codec == "ffv1":
        pix_fmt = "bgr0"
    elif codec == "libx264-444":
        codec, options, pix_fmt = "libx264", {"crf": "0"}, "yuv444p"
    from fractions import Fraction

    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=Fraction(fps).limit_denominator(1001))
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = pix_fmt
        stream.options = options
        sound = None
        if audio is not None:
            layout = {1: "mono", 2: "stereo"}[audio.shape[0]]
            sound = container.add_stream(audio_codec, rate=audio_rate, layout=layout)
        for f in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")))
        container.mux(stream.encode())
        if sound is not None:
            # the codec's own sample format and frame size, converted by swresample from float planar
            resampler = av.AudioResampler(format=sound.codec_context.format.name, layout=layout, rate=audio_rate)
            step = sound.codec_context.frame_size or 1024
            wave = np.asarray(audio, dtype=np.float32)
            for s in range(0, wave.shape[1], step):
                frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(wave[:, s : s + step]), format="fltp",
                                                   layout=layout)  # fmt: skip
                frame.sample_rate, frame.pts, frame.time_base = audio_rate, s, Fraction(1, audio_rate)
                for converted in resampler.resample(frame):
                    container.mux(sound.encode(converted))
            for converted in resampler.resample(None):
                container.mux(sound.encode(converted))
            container.mux(sound.encode())
    return path


def write_image(path: str | Path, image: np.ndarray) -> Path:
    from PIL import Image

    path = Path(path)
    Image.fromarray(image).save(path)
    return path


@dataclass
class _MediaWriter:
    """What make_media_set writes with: the folder, the item sizes and codecs, and the one random stream."""

    root: Path
    rng: np.random.Generator
    frames: int
    height: int
    width: int
    fps: float
    codec: str
    audio: bool
    audio_rate: int
    audio_codec: str

    @property
    def ext(self) -> str:
        return ".mkv" if self.codec == "ffv1" else ".mp4"

    def pick(self) -> tuple[str, str, str, str]:
        rng = self.rng
        return (
            str(rng.choice(SHAPES)),
            str(rng.choice(list(COLORS))),
            str(rng.choice(list(DIRECTIONS))),
            str(rng.choice(list(BACKGROUNDS))),
        )

    def video(self, name: str, shape: str, color: str, direction: str, bg: str, frames: int, h: int, w: int) -> None:
        """A clip, with a stereo track of its pitches when audio is on (see the module doc)."""
        clip = render_clip(shape, color, direction, bg, frames=frames, height=h, width=w)
        sound = ()
        if self.audio:
            tones = render_tones(COLOR_TONES[color], SHAPE_TONES[shape], frames / self.fps, self.audio_rate)
            sound = (tones, self.audio_rate, self.audio_codec)
        write_video(self.root / name, clip, self.fps, self.codec, *sound)

    def good(self, name: str, is_video: bool, h: int, w: int) -> str:
        """Write a good clip (or image) and return its caption."""
        shape, color, direction, bg = self.pick()
        if not is_video:
            write_image(self.root / name, render_clip(shape, color, None, bg, frames=1, height=h, width=w)[0])
            return caption_for(shape, color, None, bg)
        self.video(name, shape, color, direction, bg, self.frames, h, w)
        return caption_for(shape, color, direction, bg)

    def bad(self, j: int, kind: str, caption_column: str) -> dict:
        """Write the j-th bad item of `kind` and return its metadata row."""
        if kind not in BAD_KINDS:
            raise ValueError(f"unknown bad item kind {kind!r}; choose from {sorted(BAD_KINDS)}")
        shape, color, direction, bg = self.pick()
        text = caption_for(shape, color, direction, bg)
        name = f"bad_{j:02d}_{kind}{self.ext}"
        if kind == "corrupt":
            (self.root / name).write_bytes(self.rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
        elif kind == "short":
            self.video(name, shape, color, direction, bg, 3, self.height, self.width)
        elif kind == "no_caption":
            self.video(name, shape, color, direction, bg, self.frames, self.height, self.width)
            text = ""
        elif kind == "small":
            name = f"bad_{j:02d}_small.png"
            write_image(self.root / name, render_clip(shape, color, None, bg, frames=1, height=16, width=16)[0])
        row = {"file_name": name, caption_column: text, "expect": BAD_KINDS[kind]}
        if kind == "no_caption" and j % 2 == 0:
            del row[caption_column]  # missing key and empty string are both "no caption"
        return row


def _write_metadata(root: Path, rows: list[dict], caption_column: str, metadata: str) -> None:
    if metadata == "jsonl":
        with open(root / "metadata.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    elif metadata == "csv":
        import csv

        with open(root / "metadata.csv", "w", newline="") as f:
            fields = ["file_name", caption_column, "expect"]
            fields += [k for k in rows[0] if k not in fields]  # reference, conditioning media
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)
    else:
        raise ValueError(f"metadata must be 'jsonl' or 'csv', got {metadata!r}")


def make_media_set(
    root: str | Path,
    *,
    num_videos: int = 8,
    num_images: int = 0,
    frames: int = 17,
    height: int = 64,
    width: int = 96,
    fps: float = 16,
    codec: str = "libx264rgb",
    bad: Iterable[str] = (),
    caption_column: str = "text",
    metadata: str = "jsonl",
    seed: int = 0,
    sizes: Sequence[tuple[int, int]] | None = None,
    audio: bool = False,
    audio_rate: int = 16000,
    audio_codec: str = "aac",
    references: bool = False,
    conditions: Sequence[str] = (),
) -> list[dict]:
    """Write clips, images, bad items and metadata.jsonl (or .csv) under `root`; return the metadata rows.

    Good rows come first (videos, then images), bad rows after them in the order given. `sizes`, when set, cycles
    (height, width) over the good items (for bucketing tests). Each row also carries `expect` (the reason prepare
    should report, or "ok"), which the prepare code ignores. `audio=True` gives every clip (good or bad) a stereo
    track of its pitches (see the module doc), at `audio_rate` Hz in `audio_codec`. `references=True` gives every row a
    `reference` column (editing families' input image): a still PNG of its own shape on another background, 3/4 the
    item's size. `conditions` gives every row a column of each name (a family's named conditioning media): a clip of
    the media's frame count and rate, of its own shape and motion, at the item's size.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    writer = _MediaWriter(root, np.random.default_rng(seed), frames, height, width, fps, codec, audio, audio_rate,
                          audio_codec)  # fmt: skip
    rows: list[dict] = []
    for i in range(num_videos + num_images):
        h, w = sizes[i % len(sizes)] if sizes else (height, width)
        is_video = i < num_videos
        name = f"clip_{i:03d}{writer.ext}" if is_video else f"image_{i - num_videos:03d}.png"
        rows.append({"file_name": name, caption_column: writer.good(name, is_video, h, w), "expect": "ok"})
    rows += [writer.bad(j, kind, caption_column) for j, kind in enumerate(bad)]
    if references:
        for j, row in enumerate(rows):
            shape, color, _, bg = writer.pick()
            row["reference"] = f"reference_{j:03d}.png"
            image = render_clip(shape, color, None, bg, frames=1, height=height * 3 // 4, width=width * 3 // 4)[0]
            write_image(root / row["reference"], image)
    for name in conditions:
        for j, row in enumerate(rows):
            row[name] = f"{name}_{j:03d}{writer.ext}"
            writer.video(row[name], *writer.pick(), writer.frames, height, width)
    _write_metadata(root, rows, caption_column, metadata)
    return rows
