"""LTX-2's data encoder: video latents as LTX2Pipeline normalises them, the clip's own soundtrack as audio latents of
the pipeline's audio VAE, and the prompt after the pipeline's Gemma 3 encoder and its text connectors."""

from __future__ import annotations

import math

import torch

from train.data.media import Geometry
from train.models.encoder import FamilyEncoder, retrieve

from .spec import FRAME_RATE

# The waveform -> log-mel front end the LTX-2 audio VAE was trained on (Lightricks' ltx-core AudioProcessor; diffusers
# ships the VAE but no encoder front end): torchaudio.transforms.MelSpectrogram(n_fft=1024, win_length=1024,
# hop_length=<the VAE's mel_hop_length>, f_min=0, f_max=sample_rate / 2, n_mels=<mel_bins>, hann window, center=True,
# reflect padding, power=1, Slaney mel scale and norm), then log(clamp(mel, 1e-5)), laid out (channels, time, mel).
N_FFT = 1024
LOG_FLOOR = 1e-5


def log_mel(waveform: torch.Tensor, sample_rate: int, hop_length: int, mel_bins: int) -> torch.Tensor:
    """(channels, samples) float32 -> (channels, samples // hop + 1, mel_bins) log-mel spectrogram (see N_FFT):
    torch.stft's magnitude and diffusers' Slaney filterbank (`mel_filterbank`, librosa's and torchaudio's slaney)."""
    from diffusers.models.autoencoders.autoencoder_mmaudio import mel_filterbank

    window = torch.hann_window(N_FFT, dtype=waveform.dtype, device=waveform.device)
    spec = torch.stft(waveform, N_FFT, hop_length=hop_length, win_length=N_FFT, window=window, center=True,
                      pad_mode="reflect", return_complex=True).abs()  # fmt: skip
    basis = mel_filterbank(sample_rate, N_FFT, mel_bins, 0.0, sample_rate / 2).to(waveform.device, waveform.dtype)
    return torch.log(torch.clamp(basis @ spec, min=LOG_FLOOR)).transpose(1, 2)


class LTX2Encoder(FamilyEncoder):
    """LTX-2 text-to-video+audio, through LTX2Pipeline's own components and helpers.

    - `latents` (128, F', H/32, W/32): `_normalize_latents` of the video VAE's posterior (the pipeline's
      prepare_latents normalisation of given 5-D latents).
    - `audio_latents` (8, N, 16): N = the pipeline's `audio_num_frames` for the clip (round(frames / fps * sample_rate
      / hop / 4)); the soundtrack from the first video frame (`train.data.media.load_audio`, stereo at the audio VAE's
      rate), `4 (N - 1)` hops of it, whose log-mel spectrogram (`log_mel`) has 4N - 3 frames: the length the audio
      VAE decodes N latents to, and N latents after its x4 causal time compression. Encoded by the audio VAE (the
      item's generator / `mode`, as the video), packed, `_normalize_audio_latents`, unpacked: what prepare_audio_latents
      makes of given latents. A clip without an audio stream is a bad item (`no_audio`): the pipeline has no
      convention for a video without sound (it always generates both streams), and a made-up silent track would
      train the model to render silence for that caption.
    - `prompt_embeds` / `audio_prompt_embeds` (L, caption_channels) and `prompt_mask` (L,): the outputs of the
      pipeline's `connectors` (LTX2TextConnectors) on `encode_prompt`'s stacked Gemma 3 hidden states, exactly what
      the denoising loop hands the transformer (its text inputs are the connectors', which are a pipeline component
      and not part of the transformer). L = `max_sequence_length` (1024 by default, left-padded by the tokenizer);
      with learnable registers the connectors fill the padding and their mask is all ones.
    - `frame_rate`: the clip's frame rate (the transformer's `fps`, its video rope's time scale).
    """

    name = "ltx2"
    default_text_tokens = 1024  # LTX2Pipeline.__call__(max_sequence_length=1024)
    default_geometry = Geometry("ltx2", "video", 32, 8, 1)
    latent_strides = (128, 8, 32)

    def _geometry(self, vae_config, tr_config):
        kinds = vae_config.get("downsample_type", ("spatial", "temporal", "spatiotemporal", "spatiotemporal"))
        spatial = vae_config.get("spatial_compression_ratio") or vae_config.get("patch_size", 4) * 2 ** sum(
            k in ("spatial", "spatiotemporal") for k in kinds
        )
        temporal = vae_config.get("temporal_compression_ratio") or vae_config.get("patch_size_t", 1) * 2 ** sum(
            k in ("temporal", "spatiotemporal") for k in kinds
        )
        return self._patched_geometry(spatial, temporal, tr_config)

    def latent_shapes(self, frames, height, width, fps):
        shapes = super().latent_shapes(frames, height, width, fps)
        # the released audio VAE: 16 kHz, hop 160, x4 time: 25 latents/s of 8 channels x 16 latent mel bins
        return shapes | {"audio_latents": (8, self.num_audio_latents(frames, fps or FRAME_RATE, 16000 / 160 / 4), 16)}

    @staticmethod
    def num_audio_latents(frames: int, fps: float, latents_per_second: float) -> int:
        """LTX2Pipeline.__call__: audio_num_frames = round(num_frames / frame_rate * latents per second)."""
        return round(frames / fps * latents_per_second)

    def _audio_rates(self) -> tuple[int, int, float]:
        pipe = self.pipe
        per_second = pipe.audio_sampling_rate / pipe.audio_hop_length / float(pipe.audio_vae_temporal_compression_ratio)
        return pipe.audio_sampling_rate, pipe.audio_hop_length, per_second

    # -------------------------------------------------------------------------------------------------- encoding

    def encode_text(self, caption, max_tokens):
        pipe = self.pipe
        embeds, mask, _, _ = pipe.encode_prompt(prompt=caption, do_classifier_free_guidance=False,
                                                max_sequence_length=max_tokens, device=self.device)  # fmt: skip
        side = getattr(pipe.tokenizer, "padding_side", "left")
        video, audio, connector_mask = pipe.connectors(embeds, mask, padding_side=side)
        return {"prompt_embeds": video[0], "audio_prompt_embeds": audio[0], "prompt_mask": connector_mask[0].bool()}

    def encode_media(self, pixels, generator, mode, fps):
        vae = self.pipe.vae
        z = self._vae_encode(pixels.unsqueeze(0), generator, mode)
        z = self.pipe._normalize_latents(z, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        rate = fps if fps and pixels.shape[1] > 1 else FRAME_RATE
        return {"latents": z[0], "frame_rate": torch.tensor(float(rate))}

    def audio_window(self, frames: int, fps: float) -> int:
        """Samples of the soundtrack a clip of `frames` at `fps` is cached from: 4 (N - 1) hops (see the class)."""
        _, hop, per_second = self._audio_rates()
        n = self.num_audio_latents(frames, fps, per_second)
        return (self.pipe.audio_vae_temporal_compression_ratio * (n - 1)) * hop

    def load_extra(self, src, info, bucket, fps, reference=None):
        from train.data.media import load_audio

        fps = fps or info.fps or FRAME_RATE
        rate, hop, _ = self._audio_rates()
        # slack for a track that ends up to a frame (+ a hop) before the window does; more is `too_short`
        return load_audio(src, self.audio_window(bucket.frames, fps), rate, max_pad=math.ceil(rate / fps) + hop)

    def encode_audio(self, waveform: torch.Tensor, generator: torch.Generator | None, mode) -> torch.Tensor:
        """(2, samples) at the audio VAE's rate -> the cached (C, N, M) audio latents (see the class)."""
        pipe, vae = self.pipe, self.pipe.audio_vae
        rate, hop, _ = self._audio_rates()
        # in float64: float32's STFT rounding moves the logs of quiet mel bins by up to ~1e-3
        mel = log_mel(waveform.to(self.device, torch.float64), rate, hop, vae.config.mel_bins)
        z = retrieve(vae.encode(mel[None].to(vae.dtype)), generator, mode).float()  # (1, C, N, M)
        packed = pipe._normalize_audio_latents(pipe._pack_audio_latents(z), vae.latents_mean, vae.latents_std)
        return pipe._unpack_audio_latents(packed, z.shape[2], z.shape[3])[0]

    def encode_extra(self, extra, generator, mode, fps):
        return {"audio_latents": self.encode_audio(extra, generator, mode)}
