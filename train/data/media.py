"""Decode videos and images into fixed-size pixel clips, and check the clip sizes a family can take.

Why PyAV: videos are decoded with PyAV (`av` on PyPI). Its wheels bundle FFmpeg with the common decoders (H.264,
H.265, VP9, AV1, FFV1, MPEG-4, ...), so `pip install av` is all a machine needs, CPU or GPU. torchcodec (the decoder
behind `datasets`' `Video()` feature) is built against CUDA and a system FFmpeg and does not import on a plain machine
(and `datasets` still reports it as available), so media from `datasets` is kept as paths/bytes and decoded here.
Images are decoded with PIL.

One item goes through::

    probe(src)                      size, frame rate, duration (no frame decoded for videos)
    choose_bucket(info, buckets)    the (frames, height, width) it becomes: most frames it can fill, closest aspect
                                    (1-frame buckets take images; for image families, videos give their frame 0)
    load_clip(src, bucket, fps)     decode the frames the bucket needs at `fps`, resize to cover, centre crop
      -> uint8 tensor (F, 3, H, W)
    to_model_input(clip)            -> float32 (3, F, H, W) in [-1, 1], the range diffusers' VAEs take
    load_audio(src, n, rate)        (families with sound: MiniMax-H3) the first audio stream, resampled to `rate`,
                                    stereo, n samples from the time of the clip's first frame -> float32 (2, n)

Frame sampling: with a target `fps`, frame j is the source frame whose timestamp is nearest to j / fps (measured from
the first frame; ties go to the earlier frame), so a 30 fps clip resampled to 15 fps takes every other frame and the
clip must last at least (F - 1) / fps seconds (half a source frame of slack). With `fps=None` the first F frames are
taken as they are. Resizing keeps the aspect ratio: the frame is scaled (antialiased bicubic) so it covers the bucket,
then centre-cropped; a source that already has the bucket's size is passed through untouched (lossless tests rely on
it). Upscaling is refused unless asked for (`allow_upscale`).

Audio: decoded with PyAV and resampled once by FFmpeg's swresample (float planar, the target rate); a mono track is
repeated on both channels (as MiniMax-H3's own audio normalisation does), more than two channels are downmixed to
stereo. The window starts at the first video frame's timestamp (the instant `load_clip`'s frame 0 shows); a track that
starts later or ends earlier is zero-padded by at most `max_pad` samples.

Bad inputs raise `BadMediaError` with a short machine-readable `reason` (`unreadable`, `too_short`, `too_small`,
`no_audio` for a clip without an audio stream where the family needs one; `train.prepare` adds `non_finite` for an item
the encoders turn into NaN/Inf), so `train.prepare` can skip, count and list them. A setting no item could ever satisfy
(a height the VAE/patch stride does not divide, 16 frames for a family that takes 4k+1) is a `ValueError` from
`Geometry.check`, raised at startup.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "IMAGE_EXTENSIONS",
    "BadMediaError",
    "Bucket",
    "Geometry",
    "MediaInfo",
    "choose_bucket",
    "is_image",
    "load_audio",
    "load_clip",
    "load_item",
    "probe",
    "to_model_input",
]

IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff"})
VIDEO_EXTENSIONS = frozenset({".mp4", ".mov", ".mkv", ".webm", ".avi", ".m4v", ".gif", ".mpg", ".mpeg", ".ts"})

# A media source: a file path, raw bytes, or a `datasets` Image/Video cell with decode=False ({"path", "bytes"}).
MediaSource = str | os.PathLike | bytes | Mapping[str, Any]


class BadMediaError(Exception):
    """An input that cannot become a training sample; `reason` is one of the short codes listed in the module doc."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


# ------------------------------------------------------------------------------------------------------------ geometry


@dataclass(frozen=True, order=True)
class Bucket:
    """A clip shape in pixels; written "FxHxW" (frames x height x width), e.g. "17x480x832"; images have F = 1."""

    frames: int
    height: int
    width: int

    def __str__(self) -> str:
        return f"{self.frames}x{self.height}x{self.width}"

    @classmethod
    def parse(cls, text: str) -> Bucket:
        parts = text.lower().split("x")
        if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"bucket {text!r} is not FRAMESxHEIGHTxWIDTH (e.g. 17x480x832, 1x1024x1024 for images)")
        return cls(*(int(p) for p in parts))

    @property
    def aspect(self) -> float:
        return self.width / self.height


@dataclass(frozen=True)
class Geometry:
    """The clip sizes a family's pipeline accepts, read from its VAE (and transformer patch) config.

    height and width must be multiples of `spatial_multiple` (VAE downsampling x transformer patch size); video
    frames must satisfy frames % frame_period == frame_offset (Wan: 4k+1, LTX: 8k+1); image families take 1 frame.
    """

    family: str
    latent_kind: Literal["image", "video"]
    spatial_multiple: int
    frame_period: int = 1
    frame_offset: int = 0
    source: str = "defaults"
    """Where the numbers came from (the pipeline folder, or the family defaults), for error messages."""

    @property
    def frames_rule(self) -> str:
        if self.latent_kind == "image":
            return "1 (image family)"
        if self.frame_period == 1:
            return "any"
        return f"{self.frame_period}k+{self.frame_offset}"

    def problems(self, bucket: Bucket) -> list[str]:
        out = []
        for name, value in (("height", bucket.height), ("width", bucket.width)):
            if value < 1 or value % self.spatial_multiple:
                lo = max(self.spatial_multiple, value // self.spatial_multiple * self.spatial_multiple)
                out.append(
                    f"{name} {value} is not a multiple of {self.spatial_multiple} (VAE stride x patch size for "
                    f"{self.family}); use {lo} or {lo + self.spatial_multiple}"
                )
        f = bucket.frames
        if self.latent_kind == "image":
            if f != 1:
                out.append(f"num_frames {f}: {self.family} is an image family and takes 1 frame")
        elif f < 1 or f % self.frame_period != self.frame_offset % self.frame_period or f < self.frame_offset:
            below = max(
                self.frame_offset, (f - self.frame_offset) // self.frame_period * self.frame_period + self.frame_offset
            )
            out.append(
                f"num_frames {f} is not of the form {self.frames_rule} (VAE temporal compression of {self.family}); "
                f"use {below} or {below + self.frame_period}"
            )
        return out

    def check(self, buckets: Sequence[Bucket]) -> None:
        """Raise one ValueError listing every bucket the family cannot take."""
        lines = [f"bucket {b}: {p}" for b in buckets for p in self.problems(b)]
        if lines:
            raise ValueError(
                f"impossible data size for {self.family} (rules from {self.source}):\n  " + "\n  ".join(lines)
            )


# --------------------------------------------------------------------------------------------------------------- probe


@dataclass(frozen=True)
class MediaInfo:
    kind: Literal["image", "video"]
    height: int
    width: int
    fps: float | None = None
    num_frames: int | None = None
    """Frame count from the container header (None when it does not say)."""
    duration: float | None = None
    """Seconds, from the container header (None when it does not say)."""
    name: str = "<bytes>"

    def frames_available(self, fps: float | None) -> int | None:
        """Frames a clip sampled at `fps` can have (an estimate from the header; decoding has the last word)."""
        if self.kind == "image":
            return 1
        if fps is None or self.fps is None:
            if self.num_frames:
                return self.num_frames
            if self.duration is not None and self.fps:
                return int(self.duration * self.fps + 1e-6)
            return None
        duration = self.duration
        if duration is None and self.num_frames:
            duration = self.num_frames / self.fps
        if duration is None:
            return None
        # sample j sits at j / fps and needs a source frame within half a frame: j / fps <= duration - 0.5 / src_fps
        return int(math.floor((duration - 0.5 / self.fps) * fps + 1e-6)) + 1


def _split_source(src: MediaSource) -> tuple[Any, str]:
    """(what PIL/PyAV open, a display name) for a path, bytes or a {"path", "bytes"} cell."""
    if isinstance(src, Mapping):
        data, path = src.get("bytes"), src.get("path")
        if data:
            return io.BytesIO(data), str(path or "<bytes>")
        if path:
            return str(path), str(path)
        raise BadMediaError("unreadable", f"media cell has neither bytes nor path: {sorted(src)}")
    if isinstance(src, (bytes, bytearray)):
        return io.BytesIO(bytes(src)), "<bytes>"
    return os.fspath(src), os.fspath(src)


def is_image(src: MediaSource) -> bool:
    """True for a still image: by file extension, else (raw bytes) by magic number."""
    handle, name = _split_source(src)
    ext = Path(name).suffix.lower()
    if ext in IMAGE_EXTENSIONS:
        return True
    if ext in VIDEO_EXTENSIONS:
        return False
    if isinstance(handle, io.BytesIO):
        head = handle.getvalue()[:12]
    else:
        try:
            with open(handle, "rb") as f:
                head = f.read(12)
        except OSError:
            return False
    return (
        head.startswith(b"\x89PNG")
        or head.startswith(b"\xff\xd8\xff")
        or head.startswith(b"BM")
        or (head[:4] == b"RIFF" and head[8:12] == b"WEBP")
        or head[:4] in (b"II*\x00", b"MM\x00*")
    )


def _open_image(src: MediaSource):
    from PIL import Image, ImageOps

    handle, name = _split_source(src)
    try:
        img = Image.open(handle)
        img = ImageOps.exif_transpose(img)
        return img.convert("RGB")
    except Exception as e:  # PIL raises many types for bad files
        raise BadMediaError("unreadable", f"{name}: {type(e).__name__}: {e}") from e


def probe(src: MediaSource) -> MediaInfo:
    """Size, frame rate, frame count and duration of a video (from the header) or an image."""
    if is_image(src):
        img = _open_image(src)
        return MediaInfo("image", img.height, img.width, name=_split_source(src)[1])
    import av

    handle, name = _split_source(src)
    try:
        with av.open(handle) as container:
            if not container.streams.video:
                raise BadMediaError("unreadable", f"{name}: no video stream")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            duration = None
            if stream.duration is not None and stream.time_base is not None:
                duration = float(stream.duration * stream.time_base)
            elif container.duration is not None:
                duration = container.duration / av.time_base
            height, width = stream.codec_context.height, stream.codec_context.width
            if not height or not width:
                raise BadMediaError("unreadable", f"{name}: video stream has no size")
            return MediaInfo(
                "video", height, width, float(rate) if rate else None, stream.frames or None, duration, name
            )
    except BadMediaError:
        raise
    except Exception as e:  # av.error.* and OSError for corrupt or truncated files
        raise BadMediaError("unreadable", f"{name}: {type(e).__name__}: {e}") from e


def choose_bucket(info: MediaInfo, buckets: Sequence[Bucket], fps: float | None = None) -> Bucket:
    """The bucket an item goes to: the most frames it can fill, then the aspect ratio closest to the source's.

    1-frame buckets take images (and videos only when no bucket has more frames: image families use frame 0), so a
    clip too short for every video bucket is reported as too short rather than trained on as a still.
    """
    available = info.frames_available(fps)
    if info.kind == "video" and any(b.frames > 1 for b in buckets):
        buckets = [b for b in buckets if b.frames > 1]
    fits = [b for b in buckets if available is None or b.frames <= available]
    if not fits:
        need = min(b.frames for b in buckets)
        at = f" at {fps:g} fps" if fps else ""
        have = "an image (1 frame)" if info.kind == "image" else f"about {available} frames{at}"
        raise BadMediaError("too_short", f"{info.name}: {have}, the shortest bucket needs {need}")
    most = max(b.frames for b in fits)
    aspect = info.width / info.height
    return min((b for b in fits if b.frames == most), key=lambda b: (abs(math.log(b.aspect / aspect)), b))


# -------------------------------------------------------------------------------------------------------------- decode


def _decode_video(src: MediaSource, num_frames: int, fps: float | None) -> list[np.ndarray]:
    """`num_frames` RGB frames (H, W, 3 uint8): the first ones (fps None) or those nearest to j / fps."""
    import av

    handle, name = _split_source(src)
    chosen: list[np.ndarray] = []
    last_t = None
    try:
        with av.open(handle) as container:
            if not container.streams.video:
                raise BadMediaError("unreadable", f"{name}: no video stream")
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            rate = stream.average_rate or stream.guessed_rate
            src_fps = float(rate) if rate else None
            prev: tuple[float, Any] | None = None
            t0 = None
            for i, frame in enumerate(container.decode(stream)):
                if fps is None:
                    chosen.append(frame.to_ndarray(format="rgb24"))
                    if len(chosen) == num_frames:
                        break
                    continue
                t = frame.time if frame.time is not None else i / (src_fps or fps)
                t0 = t if t0 is None else t0
                t -= t0
                while len(chosen) < num_frames and t >= len(chosen) / fps:
                    target = len(chosen) / fps
                    use_prev = prev is not None and target - prev[0] <= t - target
                    chosen.append((prev[1] if use_prev else frame).to_ndarray(format="rgb24"))
                if len(chosen) == num_frames:
                    break
                prev, last_t = (t, frame), t
            if fps is not None and len(chosen) < num_frames and prev is not None:
                # the last targets may fall after the last frame's timestamp but within half a source frame of it
                slack = 0.5 / (src_fps or fps)
                while len(chosen) < num_frames and len(chosen) / fps - prev[0] <= slack + 1e-6:
                    chosen.append(prev[1].to_ndarray(format="rgb24"))
    except BadMediaError:
        raise
    except Exception as e:
        raise BadMediaError("unreadable", f"{name}: {type(e).__name__}: {e}") from e
    if not chosen and last_t is None:
        raise BadMediaError("unreadable", f"{name}: no frame could be decoded")
    if len(chosen) < num_frames:
        at = f" at {fps:g} fps" if fps else ""
        raise BadMediaError("too_short", f"{name}: gives {len(chosen)} frames{at}, {num_frames} needed")
    return chosen


def _resize_cover_crop(frames: torch.Tensor, height: int, width: int, chunk: int = 16) -> torch.Tensor:
    """uint8 (F, 3, h, w) -> uint8 (F, 3, height, width): scale to cover (aspect kept), then centre crop."""
    h, w = frames.shape[-2:]
    if (h, w) == (height, width):
        return frames
    scale = max(height / h, width / w)
    nh, nw = max(height, round(h * scale)), max(width, round(w * scale))
    top, left = (nh - height) // 2, (nw - width) // 2
    out = torch.empty(frames.shape[0], 3, height, width, dtype=torch.uint8)
    for s in range(0, frames.shape[0], chunk):  # bounded memory for long, large clips
        x = frames[s : s + chunk].float()
        if (nh, nw) != (h, w):
            x = F.interpolate(x, size=(nh, nw), mode="bicubic", antialias=True, align_corners=False)
        out[s : s + chunk] = x[..., top : top + height, left : left + width].clamp(0, 255).round().to(torch.uint8)
    return out


def load_clip(
    src: MediaSource,
    bucket: Bucket,
    fps: float | None = None,
    *,
    allow_upscale: bool = False,
    info: MediaInfo | None = None,
) -> torch.Tensor:
    """The clip for `bucket` as uint8 (F, 3, H, W): frames sampled at `fps`, resized to cover, centre-cropped.

    Raises BadMediaError: `unreadable`, `too_short` (fewer frames than the bucket at `fps`; an image for a bucket
    of more than one frame), `too_small` (smaller than the bucket on either side and `allow_upscale` is false).
    """
    info = info or probe(src)
    if not allow_upscale and (info.height < bucket.height or info.width < bucket.width):
        raise BadMediaError(
            "too_small",
            f"{info.name}: {info.width}x{info.height} (WxH) is smaller than the {bucket.width}x{bucket.height} "
            f"target; upscaling is off (data.allow_upscale)",
        )
    if info.kind == "image":
        if bucket.frames != 1:
            raise BadMediaError("too_short", f"{info.name}: an image gives 1 frame, {bucket.frames} needed")
        arrays = [np.asarray(_open_image(src))]
    else:
        arrays = _decode_video(src, bucket.frames, fps)
    frames = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()
    return _resize_cover_crop(frames, bucket.height, bucket.width)


def load_item(
    src: MediaSource,
    buckets: Sequence[Bucket],
    fps: float | None = None,
    *,
    allow_upscale: bool = False,
) -> tuple[Bucket, torch.Tensor]:
    """probe -> choose_bucket -> load_clip, for one item: (bucket, uint8 (F, 3, H, W))."""
    info = probe(src)
    bucket = choose_bucket(info, buckets, fps)
    return bucket, load_clip(src, bucket, fps, allow_upscale=allow_upscale, info=info)


def load_audio(
    src: MediaSource,
    num_samples: int,
    sample_rate: int,
    *,
    start: float | None = None,
    max_pad: int = 0,
) -> torch.Tensor:
    """float32 (2, num_samples): the first audio stream at `sample_rate`, stereo, from `start` seconds (None: the
    timestamp of the first video frame, 0 without a video stream).

    Raises BadMediaError: `no_audio` (no audio stream), `unreadable`, `too_short` (the track covers the window but for
    more than `max_pad` samples, which are otherwise zero-filled).
    """
    import av

    handle, name = _split_source(src)
    chunks: list[np.ndarray] = []
    first_time: float | None = None  # timestamp of the first decoded audio sample
    try:
        with av.open(handle) as container:
            if not container.streams.audio:
                raise BadMediaError("no_audio", f"{name}: no audio stream")
            astream = container.streams.audio[0]
            streams = [astream]
            if start is None and container.streams.video:
                streams.append(container.streams.video[0])  # only its first frame's time is read
            elif start is None:
                start = 0.0
            mono = (astream.codec_context.channels or 2) == 1
            resampler = av.AudioResampler(format="fltp", layout="mono" if mono else "stereo", rate=sample_rate)
            have = 0
            for packet in container.demux(*streams):
                if packet.stream.type == "video":
                    if start is None:
                        start = next((f.time for f in packet.decode() if f.time is not None), None)
                    continue
                for frame in packet.decode():
                    if first_time is None:
                        first_time = frame.time if frame.time is not None else 0.0
                    for out in resampler.resample(frame):
                        chunks.append(out.to_ndarray().reshape(-1, out.samples))
                        have += out.samples
                if start is not None and first_time is not None:
                    end = start + (num_samples + max_pad) / sample_rate + 0.05  # + the resampler's delay
                    if first_time + have / sample_rate > end:
                        break  # the window is decoded
            else:
                for out in resampler.resample(None):  # flush what the resampler holds back
                    chunks.append(out.to_ndarray().reshape(-1, out.samples))
    except BadMediaError:
        raise
    except Exception as e:
        raise BadMediaError("unreadable", f"{name}: {type(e).__name__}: {e}") from e
    if not chunks or first_time is None:
        raise BadMediaError("no_audio", f"{name}: the audio stream has no decodable samples")
    wave = np.concatenate(chunks, axis=1).astype(np.float32, copy=False)
    offset = round(((start or 0.0) - first_time) * sample_rate)  # samples of the track before the window
    front = max(0, -offset)  # the track starts after the first frame: silence before it
    if front:
        wave = np.concatenate([np.zeros((wave.shape[0], front), np.float32), wave], axis=1)
    wave = wave[:, max(0, offset) : max(0, offset) + num_samples]
    missing = min(front, num_samples) + num_samples - wave.shape[1]
    if missing > max_pad:
        covered = (num_samples - missing) / sample_rate
        raise BadMediaError(
            "too_short",
            f"{name}: the audio track covers {covered:.3f} s of the {num_samples / sample_rate:.3f} s window",
        )
    if wave.shape[1] < num_samples:
        wave = np.pad(wave, ((0, 0), (0, num_samples - wave.shape[1])))
    out = torch.from_numpy(np.ascontiguousarray(wave))
    return out.expand(2, -1).contiguous() if out.shape[0] == 1 else out


def to_model_input(clip: torch.Tensor) -> torch.Tensor:
    """uint8 (F, 3, H, W) -> float32 (3, F, H, W) in [-1, 1] (x / 127.5 - 1, as diffusers' video processor)."""
    return clip.permute(1, 0, 2, 3).float().div(127.5).sub(1.0)
