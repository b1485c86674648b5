"""LTX-2 (the ltx2 family) beyond the family-generic tests. CPU; the serial tests take about 10 s, the CP one (slow
tier) runs in the shared 2- and 3-rank groups.

- The cached audio latents of a clip are the pipeline's own: the clip's soundtrack decoded with PyAV directly, its
  log-mel spectrogram computed with numpy's FFT (not torch.stft), through the pipeline's audio VAE and its
  `prepare_audio_latents` (which normalises given latents), equal the encoder's cache (1e-5); the latent count is the
  pipeline's `audio_num_frames` for the clip, and the audio VAE decodes it to the spectrogram's length.
- A clip without an audio stream is a bad item (`no_audio`).
- The audio stream is live in training: the trainer's loss is the video MSE plus the audio MSE, each computed here
  from the raw outputs with the pipeline's own unpacking (1e-6); changing only the audio latents changes the loss
  and the video prediction (audio-to-video attention); the audio-only parameters get non-zero gradients.
- The released checkpoint's rope_type "split" trains exactly under CP 2 and 3 with the family's split-rope plan
  (train/models/ltx2/cp_plan_split_rope.yaml, which recipes/ltx2/ name): output, loss and every gradient vs the
  serial oracle (fp32: 1e-5 absolute output, 2e-5 relative loss and gradients, as tests/test_cp_models.py).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.harness import rank_job
from train.data.media import BadMediaError, Bucket, probe
from train.data.synthetic_media import render_tones, write_video
from train.models import build_tiny_pipeline, get_encoder
from train.tools import tiny_models as tm

FPS, FRAMES, SIDE = 24.0, 17, 32


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory):
    enc = get_encoder("ltx2")
    enc.load(str(build_tiny_pipeline("ltx2", tmp_path_factory.mktemp("ltx2") / "pipe")))
    return enc


def _clip(path: Path, audio: bool) -> Path:
    frames = np.random.default_rng(0).integers(0, 256, (FRAMES, SIDE, SIDE, 3), dtype=np.uint8)
    sound = render_tones(440.0, 660.0, FRAMES / FPS + 0.2, 16000) if audio else None
    return write_video(path, frames, fps=FPS, audio=sound, audio_rate=16000, audio_codec="flac")


def _decoded_track(path: Path, samples: int) -> np.ndarray:
    """The first `samples` of the clip's stereo track at 16 kHz, decoded with PyAV alone (the clip starts at 0)."""
    import av

    with av.open(str(path)) as container:
        chunks = [f.to_ndarray().reshape(2, -1) if f.format.is_planar else f.to_ndarray().reshape(-1, 2).T
                  for f in container.decode(audio=0)]  # fmt: skip
    wave = np.concatenate(chunks, axis=1).astype(np.float64)
    if np.abs(wave).max() > 1.5:  # integer samples (s16)
        wave = wave / 32768.0
    return wave[:, :samples]


def _numpy_log_mel(wave: np.ndarray, rate: int, hop: int, mel_bins: int) -> torch.Tensor:
    """LTX-2's front end (train/models/ltx2/encoder.py N_FFT) with numpy: centred frames (reflect padding), a
    periodic Hann window, |rfft|, diffusers' Slaney filterbank, log(max(., 1e-5)); (2, T, mel_bins)."""
    from diffusers.models.autoencoders.autoencoder_mmaudio import mel_filterbank

    n_fft = 1024
    padded = np.pad(wave, ((0, 0), (n_fft // 2, n_fft // 2)), mode="reflect")
    count = 1 + (padded.shape[1] - n_fft) // hop
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)
    frames = np.stack([padded[:, i * hop : i * hop + n_fft] * window for i in range(count)], axis=1)
    magnitude = np.abs(np.fft.rfft(frames, axis=-1))  # (2, T, n_fft / 2 + 1)
    basis = mel_filterbank(rate, n_fft, mel_bins, 0.0, rate / 2).double().numpy()
    return torch.from_numpy(np.log(np.maximum(magnitude @ basis.T, 1e-5))).float()


def test_audio_cache_is_the_pipelines_audio_latents(encoder, tmp_path: Path) -> None:
    start = time.perf_counter()
    pipe = encoder.pipe
    path = _clip(tmp_path / "clip.mkv", audio=True)
    bucket = Bucket(FRAMES, SIDE, SIDE)
    waveform = encoder.load_extra(str(path), probe(str(path)), bucket, FPS)
    ours = encoder.encode_extra(waveform, None, "mode", FPS)["audio_latents"]

    vae, rate, hop = pipe.audio_vae, pipe.audio_sampling_rate, pipe.audio_hop_length
    n = round(FRAMES / FPS * rate / hop / pipe.audio_vae_temporal_compression_ratio)  # LTX2Pipeline's audio_num_frames
    mel = _numpy_log_mel(_decoded_track(path, encoder.audio_window(FRAMES, FPS)), rate, hop, vae.config.mel_bins)
    assert mel.shape[1] == 4 * n - 3  # what the audio VAE decodes n latents to
    with torch.no_grad():
        z = vae.encode(mel[None]).latent_dist.mode()
        assert z.shape[2] == n and vae.decode(z).sample.shape[2] == mel.shape[1]
        theirs = pipe.prepare_audio_latents(1, vae.config.latent_channels, n, vae.config.mel_bins, 0.0,
                                            torch.float32, "cpu", None, latents=z)  # fmt: skip
    assert ours.shape == (vae.config.latent_channels, n, vae.config.mel_bins // 4)
    packed = pipe._pack_audio_latents(ours[None])
    torch.testing.assert_close(packed, theirs, rtol=1e-5, atol=1e-5)
    print(f"\naudio latents vs the pipeline's: max abs {(packed - theirs).abs().max():.2e} "
          f"({time.perf_counter() - start:.2f} s)")  # fmt: skip


def test_clip_without_audio_is_a_bad_item(encoder, tmp_path: Path) -> None:
    path = _clip(tmp_path / "silent.mkv", audio=False)
    with pytest.raises(BadMediaError) as e:
        encoder.load_extra(str(path), probe(str(path)), Bucket(FRAMES, SIDE, SIDE), FPS)
    assert e.value.reason == "no_audio"


def _loss_and_grads(case, model) -> tuple[float, dict[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    model.zero_grad()
    out = model(**case.kwargs, return_dict=False)
    loss = tm.family_loss(case, out, model.config)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss), grads, tuple(o.detach() for o in out)


def test_audio_stream_is_live_in_the_loss_and_the_gradients() -> None:
    from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline

    start = time.perf_counter()
    case, model = tm.family_case("ltx2"), tm.build_model("ltx2")
    loss, grads, (video, audio) = _loss_and_grads(case, model)
    # the loss is the video MSE plus the audio MSE against noise - x0, unpacked as the pipeline unpacks
    _, _, f, h, w = case.x0["latents"].shape
    _, _, length, mel = case.x0["audio_latents"].shape
    video_pred = LTX2Pipeline._unpack_latents(video, f, h, w)
    audio_pred = LTX2Pipeline._unpack_audio_latents(audio, length, mel)
    video_mse = (video_pred - (case.noise["latents"] - case.x0["latents"])).pow(2).mean()
    audio_mse = (audio_pred - (case.noise["audio_latents"] - case.x0["audio_latents"])).pow(2).mean()
    assert float(audio_mse) > 0.1 * float(video_mse)  # a term of the same order, not a rounding
    assert abs(loss - float(video_mse + audio_mse)) <= 1e-6 * abs(loss), (loss, float(video_mse), float(audio_mse))
    # audio-only parameters train
    audio_only = [n for n in grads if n.startswith(("audio_proj_in", "audio_proj_out", "audio_caption_projection"))
                  or ".audio_attn1." in n or ".audio_ff." in n]  # fmt: skip
    assert audio_only and all(grads[n].abs().max() > 0 for n in audio_only), audio_only
    # another audio clip, the same video: another loss, another video prediction, other video-path gradients
    other = tm.family_case("ltx2")
    other.x0["audio_latents"] = other.x0["audio_latents"].flip(2) + 0.5
    other.noisy["audio_latents"] = (1 - other.sigmas["audio_latents"]).view(-1, 1, 1, 1) * other.x0[
        "audio_latents"] + other.sigmas["audio_latents"].view(-1, 1, 1, 1) * other.noise["audio_latents"]  # fmt: skip
    other.kwargs["audio_hidden_states"] = LTX2Pipeline._pack_audio_latents(other.noisy["audio_latents"])
    loss2, grads2, (video2, _) = _loss_and_grads(other, model)
    assert abs(loss2 - loss) > 1e-3 * abs(loss), (loss, loss2)
    assert (video2 - video).abs().max() > 1e-4  # the audio reaches the video stream (audio-to-video attention)
    assert (grads2["proj_in.weight"] - grads["proj_in.weight"]).abs().max() > 1e-6
    print(
        f"\nloss {loss:.4f} = video {float(video_mse):.4f} + audio {float(audio_mse):.4f}; other audio: {loss2:.4f}; "
        f"video prediction moved by {(video2 - video).abs().max():.2e} ({time.perf_counter() - start:.2f} s)"
    )


# The released checkpoint's rope_type "split": the family's split-rope plan (model.cp_plan of recipes/ltx2/) -------

SPLIT_PLAN = Path(__file__).resolve().parents[1] / "train" / "models" / "ltx2" / "cp_plan_split_rope.yaml"
SPLIT_WORLDS = (2, 3)


def _split_rope_model(config: dict):
    import diffusers

    from train.tools.probe import init_weights

    with torch.random.fork_rng(devices=[]):  # as tm.build_model: the tables drawn at construction seeded too
        torch.manual_seed(0)
        model = diffusers.LTX2VideoTransformer3DModel(**config)
    return init_weights(model, 0).train()


def _split_rope_parity(rank: int, world: int) -> dict:
    """The tiny transformer with rope_type "split" (the released one's (B, heads, S, D/2) RoPE tables) at CP `world`
    (Ulysses) under train/models/ltx2/cp_plan_split_rope.yaml vs the serial oracle on the same step (fp32): output,
    loss and every gradient (SUM over CP). cp_plans/ltx2.yaml (interleaved (B, S, D) tables, expected_dims 3) would
    leave these 4-D tables whole, each rank rotating its shard with the whole sequence's table."""
    from torch.distributed.device_mesh import init_device_mesh

    from train.cp import GradReduction, enable_context_parallel
    from train.cp.plans import load_plan_file
    from train.tools.oracle import compare, run_step

    config = tm.tiny_config("ltx2") | {"rope_type": "split"}
    case = tm.family_case("ltx2", seed=1, batch_size=2, model_config=config)
    serial = run_step(_split_rope_model(config), case)
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("ring", "ulysses"))
    model = _split_rope_model(config)
    state = enable_context_parallel(model, mesh=mesh, plan=load_plan_file(SPLIT_PLAN))
    cp = run_step(model, case, reduce=GradReduction("allreduce", cp_group=state.cp_group).reduce_gradients)
    errors = compare(cp, serial)
    return {"out": errors.out, "loss": errors.loss, "grad": errors.grad, "worst": errors.worst,
            "params": len(errors.grads)}  # fmt: skip


rank_job(*SPLIT_WORLDS)(_split_rope_parity)


@pytest.mark.slow
@pytest.mark.parametrize("world", SPLIT_WORLDS)
def test_split_rope_checkpoint_trains_exactly_under_cp(group, world: int) -> None:
    for rank, r in enumerate(group(_split_rope_parity, world)):
        print(f"\nsplit rope CP {world} rank {rank}: out {r['out']:.2e}, loss rel {r['loss']:.2e}, grad rel "
              f"{r['grad']:.2e} ({r['worst']}, {r['params']} parameters)")  # fmt: skip
        assert r["out"] <= 1e-5 and r["loss"] <= 2e-5 and r["grad"] <= 2e-5, r  # tests/test_cp_models.py's fp32
