"""Model-family specs (train/models) and the flow-matching objective (train/objective.py). Serial, CPU, fast.

For every family, with a tiny random-init transformer (configs of tests/tiny_models.py) and random latents:
(1) the forward kwargs equal what the family's diffusers pipeline builds with its own packing / id / layout helpers,
(2) the transformer runs on them, the prediction comes back in the latent layout, and unpack(pack(x)) == x,
(3) timestep sampling is deterministic, in (0, 1) and shifted as the family's scheduler shifts,
(4) every LoRA target matches a module of the transformer,
(5) train/ outside train/models/ has no family-name branches.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import (
    AutoencoderKLWan,
    ChronoEditPipeline,
    FlowMatchEulerDiscreteScheduler,
    Flux2Pipeline,
    FluxPipeline,
    LTXPipeline,
    MiniMaxH3Scheduler,
    QwenImagePipeline,
    UniPCMultistepScheduler,
)
from diffusers.modular_pipelines.minimax_h3.before_denoise import (
    MiniMaxH3PrepareLatentsStep,
    MiniMaxH3PrepareLayoutStep,
    MiniMaxH3SetTimestepsStep,
)
from diffusers.modular_pipelines.minimax_h3.decoders import MiniMaxH3AfterDenoiseStep
from diffusers.modular_pipelines.modular_pipeline import PipelineState
from diffusers.pipelines.flux.pipeline_flux import calculate_shift as flux_calculate_shift
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu
from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift as ltx_calculate_shift
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift as qwen_calculate_shift

from tests import tiny_models as tm
from train import objective
from train.models import FAMILIES, FamilySpec, get_family
from train.models.spec import matches_lora_target, output_tensors

NAMES = tuple(FAMILIES)
REPO = Path(__file__).resolve().parents[1]

# tiny_models configs, adjusted where a family's training inputs differ from the CP parity inputs: ChronoEdit takes
# [latents | 4 mask channels | condition latents] (I2V); MiniMax-H3's pipeline blocks (run without VAEs) assume the
# released 24 video / 32 audio latent channels.
CONFIG_OVERRIDES: dict[str, dict[str, Any]] = {
    "chronoedit": {"in_channels": 12},
    "minimax_h3": {"in_channels": 24, "audio_in_channels": 32},
}

# Per-sample cached latent shapes (primary stream first).
LATENT_SHAPES: dict[str, dict[str, tuple[int, ...]]] = {
    "flux": {"latents": (4, 6, 8)},
    "flux2": {"latents": (16, 3, 4)},
    "qwenimage": {"latents": (4, 1, 6, 8)},
    "wan": {"latents": (4, 3, 4, 6)},
    "chronoedit": {"latents": (4, 2, 2, 4)},
    "ltx": {"latents": (8, 3, 4, 5)},
    "minimax_h3": {"latents": (24, 2, 4, 6), "audio_latents": (2, 32, 5)},
}
BATCH = 2


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=gen)


def _padding_mask(batch_size: int, length: int) -> torch.Tensor:
    mask = torch.ones(batch_size, length, dtype=torch.bool)
    mask[0, -2:] = False
    return mask


def tiny_model(name: str) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = tm.MODEL_CLASSES[name](**{**tm.CONFIGS[name], **CONFIG_OVERRIDES.get(name, {})})
    return model.eval()


def tiny_wan_vae() -> AutoencoderKLWan:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        vae = AutoencoderKLWan(
            base_dim=8,
            z_dim=4,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
            latents_mean=[0.1, -0.2, 0.3, 0.0],
            latents_std=[1.5, 0.5, 2.0, 1.0],
        )
    return vae.eval()


def make_batch(name: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """A cached batch of BATCH samples (clean latents of every stream + conditioning)."""
    gen = _gen(seed)
    cfg = {**tm.CONFIGS[name], **CONFIG_OVERRIDES.get(name, {})}
    batch = {k: _randn(gen, BATCH, *shape) for k, shape in LATENT_SHAPES[name].items()}
    text_dim = tm.TEXT_DIM
    text_len = {"chronoedit": 512}.get(name, 5)
    batch["prompt_embeds"] = _randn(gen, BATCH, text_len, text_dim)
    extra: dict[str, dict[str, torch.Tensor]] = {
        "flux": {"pooled_embeds": _randn(gen, BATCH, cfg.get("pooled_projection_dim", 1))},
        "qwenimage": {"prompt_mask": _padding_mask(BATCH, text_len)},
        "ltx": {"prompt_mask": _padding_mask(BATCH, text_len)},
        "chronoedit": {
            "condition_latents": _randn(gen, BATCH, *LATENT_SHAPES[name]["latents"]),
            "image_embeds": _randn(gen, BATCH, 5, cfg.get("image_dim") or 1),
        },
    }
    batch.update(extra.get(name, {}))
    return batch


def noisy_and_sigmas(spec: FamilySpec, batch: dict[str, torch.Tensor], seed: int = 1):
    gen = _gen(seed)
    seq_len = spec.image_seq_len(batch["latents"].shape[1:])
    sigmas = objective.sample_stream_sigmas(BATCH, spec, image_seq_len=seq_len, generator=gen)
    noisy = {}
    for stream in spec.streams:
        noise = objective.sample_noise(batch[stream].shape, generator=gen)
        noisy[stream] = objective.add_noise(batch[stream], noise, sigmas[stream])
    return noisy, sigmas


def prepared(name: str, seed: int = 0, cp: bool = False):
    spec = get_family(name)
    model = tiny_model(name)
    batch = make_batch(name, seed)
    noisy, sigmas = noisy_and_sigmas(spec, batch, seed + 1)
    kwargs = spec.forward_kwargs(batch, noisy, sigmas, model_config=model.config, cp=cp)
    return spec, model, batch, noisy, sigmas, kwargs


# Registry ------------------------------------------------------------------------------------------------------------


def test_registry() -> None:
    assert NAMES == tm.MODEL_NAMES
    for name, spec in FAMILIES.items():
        assert isinstance(spec, FamilySpec) and spec.name == name
        assert get_family(name) is spec
        assert spec.transformer_class == tm.MODEL_CLASSES[name].__name__
        assert spec.streams[0] == "latents"
        assert (REPO / "cp_plans" / f"{spec.cp_plan}.yaml").is_file()
        with pytest.raises(dataclasses.FrozenInstanceError):
            spec.name = "x"
    with pytest.raises(KeyError, match="unknown model family"):
        get_family("sd3")
    assert [n for n, s in FAMILIES.items() if not s.text_mask_fed_in_cp] == ["ltx"]


# (1) Inputs equal the pipeline's --------------------------------------------------------------------------------------


def _assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert torch.equal(actual, expected)


def test_flux_inputs_match_pipeline() -> None:
    spec, _, batch, noisy, sigmas, kw = prepared("flux")
    x = noisy["latents"]
    b, c, h, w = x.shape
    _assert_same(kw["hidden_states"], FluxPipeline._pack_latents(x, b, c, h, w))
    _assert_same(kw["img_ids"], FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, x.device, x.dtype))
    _assert_same(kw["txt_ids"], torch.zeros(batch["prompt_embeds"].shape[1], 3))  # FluxPipeline.encode_prompt
    _assert_same(kw["guidance"], torch.full([1], 3.5, dtype=torch.float32).expand(b))
    _assert_same(kw["pooled_projections"], batch["pooled_embeds"])
    # FluxPipeline passes `timestep / 1000` with timestep = sigma * 1000
    torch.testing.assert_close(kw["timestep"], sigmas["latents"] * 1000 / 1000)


def test_flux2_inputs_match_pipeline() -> None:
    spec, _, batch, noisy, sigmas, kw = prepared("flux2")
    x = noisy["latents"]
    _assert_same(kw["hidden_states"], Flux2Pipeline._pack_latents(x))
    _assert_same(kw["img_ids"], Flux2Pipeline._prepare_latent_ids(x))
    _assert_same(kw["txt_ids"], Flux2Pipeline._prepare_text_ids(batch["prompt_embeds"]))
    _assert_same(kw["guidance"], torch.full([1], 4.0, dtype=torch.float32).expand(BATCH))
    torch.testing.assert_close(kw["timestep"], sigmas["latents"])


def test_qwenimage_inputs_match_pipeline() -> None:
    spec, model, batch, noisy, sigmas, kw = prepared("qwenimage")
    x = noisy["latents"]  # (B, C, 1, H, W): the training example's permute to the pipeline's (B, 1, C, H, W)
    b, c, _, h, w = x.shape
    _assert_same(kw["hidden_states"], QwenImagePipeline._pack_latents(x.permute(0, 2, 1, 3, 4), b, c, h, w))
    assert kw["img_shapes"] == [[(1, h // 2, w // 2)]] * b
    _assert_same(kw["encoder_hidden_states_mask"], batch["prompt_mask"])
    assert kw["guidance"] is None  # Qwen-Image is not guidance-distilled
    torch.testing.assert_close(kw["timestep"], sigmas["latents"])
    # encode_prompt drops an all-ones mask
    batch["prompt_mask"] = torch.ones_like(batch["prompt_mask"])
    assert spec.forward_kwargs(batch, noisy, sigmas, model_config=model.config)["encoder_hidden_states_mask"] is None


def test_wan_inputs_match_pipeline() -> None:
    spec, _, batch, noisy, sigmas, kw = prepared("wan")
    assert set(kw) == {"hidden_states", "timestep", "encoder_hidden_states"}
    _assert_same(kw["hidden_states"], noisy["latents"])
    _assert_same(kw["encoder_hidden_states"], batch["prompt_embeds"])
    # WanPipeline passes the scheduler timestep t = sigma * num_train_timesteps
    torch.testing.assert_close(kw["timestep"], sigmas["latents"] * 1000)


@torch.no_grad()
def test_chronoedit_inputs_match_pipeline() -> None:
    spec = get_family("chronoedit")
    model = tiny_model("chronoedit")
    pipe = ChronoEditPipeline(
        tokenizer=None,
        text_encoder=None,
        image_encoder=None,
        image_processor=None,
        transformer=None,
        vae=tiny_wan_vae(),
        scheduler=None,
    )
    batch = make_batch("chronoedit")
    noisy, sigmas = noisy_and_sigmas(spec, batch)
    _, channels, frames, lat_h, lat_w = noisy["latents"].shape
    height, width = lat_h * pipe.vae_scale_factor_spatial, lat_w * pipe.vae_scale_factor_spatial
    num_frames = (frames - 1) * pipe.vae_scale_factor_temporal + 1
    image = torch.rand(1, 3, height, width, generator=_gen(5)) * 2 - 1
    latents, condition = pipe.prepare_latents(
        image, BATCH, channels, height, width, num_frames, torch.float32, "cpu", None, noisy["latents"]
    )
    # The cache holds the normalised condition latents; the mask is rebuilt by the spec.
    batch["condition_latents"] = condition[:, pipe.vae_scale_factor_temporal :]
    kw = spec.forward_kwargs(batch, noisy, sigmas, model_config=model.config)
    _assert_same(kw["hidden_states"], torch.cat([latents, condition], dim=1))  # the pipeline's latent_model_input
    _assert_same(kw["encoder_hidden_states_image"], batch["image_embeds"])
    torch.testing.assert_close(kw["timestep"], sigmas["latents"] * 1000)


def test_ltx_inputs_match_pipeline() -> None:
    spec, model, batch, noisy, sigmas, kw = prepared("ltx")
    pipe = LTXPipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=model)
    x = noisy["latents"]
    _, _, f, h, w = x.shape
    p, pt = pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size
    _assert_same(kw["hidden_states"], LTXPipeline._pack_latents(x, p, pt))
    assert (kw["num_frames"], kw["height"], kw["width"]) == (f, h, w)
    frame_rate = 25  # LTXPipeline.__call__ default
    expected_scale = (
        pipe.vae_temporal_compression_ratio / frame_rate,
        pipe.vae_spatial_compression_ratio,
        pipe.vae_spatial_compression_ratio,
    )
    assert kw["rope_interpolation_scale"] == expected_scale
    _assert_same(kw["encoder_attention_mask"], batch["prompt_mask"])
    torch.testing.assert_close(kw["timestep"], sigmas["latents"] * 1000)
    batch["frame_rate"] = torch.tensor([24.0, 24.0])
    kw24 = spec.forward_kwargs(batch, noisy, sigmas, model_config=model.config)
    assert kw24["rope_interpolation_scale"][0] == pipe.vae_temporal_compression_ratio / 24


def test_ltx_text_mask_dropped_under_cp() -> None:
    spec, _, batch, _, _, kw = prepared("ltx", cp=True)
    assert kw["encoder_attention_mask"] is None
    # padding beyond the longest prompt of the batch is cut instead (sample 1 keeps all 5 tokens here)
    _assert_same(kw["encoder_hidden_states"], batch["prompt_embeds"])
    batch1 = {k: v[:1] for k, v in batch.items()}
    noisy1 = {"latents": batch1["latents"]}
    kw1 = spec.forward_kwargs(batch1, noisy1, torch.tensor([0.5]), model_config=tiny_model("ltx").config, cp=True)
    assert kw1["encoder_attention_mask"] is None
    _assert_same(kw1["encoder_hidden_states"], batch1["prompt_embeds"][:, :3])
    # Qwen-Image feeds its mask under CP
    _, _, _, _, _, kwq = prepared("qwenimage", cp=True)
    assert kwq["encoder_hidden_states_mask"] is not None


def _minimax_components():
    return MiniMaxH3PrepareLatentsStep().init_pipeline()


@torch.no_grad()
def test_minimax_h3_inputs_match_pipeline() -> None:
    spec, model, batch, noisy, sigmas, kw = prepared("minimax_h3")
    components = _minimax_components()
    assert components.patch_size == tuple(model.config.patch_size)
    video, audio = noisy["latents"], noisy["audio_latents"]
    _, _, frames, height, width = video.shape
    num_audio = audio.shape[-1]
    for i in range(BATCH):  # the pipeline packs one sample at a time (batch dim 1)
        state = PipelineState()
        for key, value in {
            "num_latent_frames": frames,
            "latent_height": height,
            "latent_width": width,
            "num_audio_latents": num_audio,
            "latents": video[i : i + 1],
            "audio_latents": audio[i],
            "generator": None,
        }.items():
            state.set(key, value)
        _, state = MiniMaxH3PrepareLatentsStep()(components, state)
        _assert_same(kw["hidden_states"][i], state.get("latents"))
        _assert_same(kw["audio_hidden_states"][i], state.get("audio_latents"))

    text_len = batch["prompt_embeds"].shape[1]
    layout = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        torch.full((text_len,), components.text_tag),
        frames,
        height,
        width,
        num_audio,
        components.patch_size,
        components.audio_channels,
        components.audio_tag,
        components.video_tag,
        (),
    )
    position_ids, token_tags, video_indices, audio_indices, text_indices, n_cond_video, n_cond_audio = layout
    for key, expected in zip(
        ("position_ids", "token_tags", "video_indices", "audio_indices", "text_indices"),
        (position_ids, token_tags, video_indices, audio_indices, text_indices),
        strict=True,
    ):
        _assert_same(kw[key], expected)

    # The pipeline's scheduler timesteps are t = 1 - sigma (MiniMaxH3Scheduler), one per modality.
    video_t, audio_t = 1.0 - float(sigmas["latents"][0]), 1.0 - float(sigmas["audio_latents"][0])
    timestep, timestep_indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        video_indices,
        audio_indices,
        n_cond_video,
        n_cond_audio,
        text_indices.numel(),
        video_t,
        audio_t,
        max(video_t, components.keyframe_noise_aug),
        1.0,
    )
    _assert_same(kw["timestep"], timestep)
    _assert_same(kw["timestep_indices"], timestep_indices)
    assert timestep.numel() == 2  # video (and text) rows, audio rows
    _assert_same(kw["encoder_hidden_states"], batch["prompt_embeds"])


@torch.no_grad()
def test_minimax_h3_unpack_matches_pipeline() -> None:
    spec, model, batch, noisy, _, kw = prepared("minimax_h3")
    components = _minimax_components()
    shapes = {k: v.shape for k, v in noisy.items()}
    raw = spec.unpack_output((kw["hidden_states"], kw["audio_hidden_states"]), shapes, model_config=model.config)
    _, _, frames, height, width = noisy["latents"].shape
    for i in range(BATCH):
        state = PipelineState()
        for key, value in {
            "latents": kw["hidden_states"][i],
            "audio_latents": kw["audio_hidden_states"][i],
            "num_latent_frames": frames,
            "latent_height": height,
            "latent_width": width,
            "num_audio_latents": noisy["audio_latents"].shape[-1],
        }.items():
            state.set(key, value)
        _, state = MiniMaxH3AfterDenoiseStep()(components, state)
        _assert_same(raw["latents"][i : i + 1], state.get("latents"))
        _assert_same(raw["audio_latents"][i], state.get("audio_latents"))


def test_minimax_h3_batch_shares_layout() -> None:
    spec, model, batch, noisy, sigmas, _ = prepared("minimax_h3")
    assert spec.shared_timestep and spec.velocity_sign == -1.0
    for stream in spec.streams:
        assert torch.equal(sigmas[stream], sigmas[stream][:1].expand(BATCH))
    assert not torch.equal(sigmas["latents"], sigmas["audio_latents"])  # shift 12 vs 3 of one base draw
    bad = {**sigmas, "latents": torch.tensor([0.3, 0.6])}
    with pytest.raises(ValueError, match="same for every sample"):
        spec.forward_kwargs(batch, noisy, bad, model_config=model.config)
    # A prompt_mask shared by the batch drops padding rows from the packed text.
    batch["prompt_mask"] = torch.tensor([[True, True, True, False, False]] * BATCH)
    kw = spec.forward_kwargs(batch, noisy, sigmas, model_config=model.config)
    _assert_same(kw["encoder_hidden_states"], batch["prompt_embeds"][:, :3])
    assert kw["text_indices"].numel() == 3


# (2) Forward runs, output in latent layout, unpack(pack(x)) == x ------------------------------------------------------

# What a "prediction" identical to the packed input looks like, per family (to check unpack is pack's inverse).
PACKED_AS_OUTPUT = {
    "flux": lambda kw: (kw["hidden_states"],),
    "flux2": lambda kw: (kw["hidden_states"],),
    "qwenimage": lambda kw: (kw["hidden_states"],),
    "wan": lambda kw: (kw["hidden_states"],),
    "ltx": lambda kw: (kw["hidden_states"],),
    "minimax_h3": lambda kw: (kw["hidden_states"], kw["audio_hidden_states"]),
}


@pytest.mark.parametrize("name", NAMES)
@torch.no_grad()
def test_forward_and_unpack(name: str) -> None:
    spec, model, batch, noisy, sigmas, kw = prepared(name)
    shapes = {k: v.shape for k, v in noisy.items()}
    out = model(**kw, return_dict=False)
    preds = spec.predictions(out, shapes, model_config=model.config)
    assert set(preds) == set(spec.streams)
    for stream, pred in preds.items():
        assert pred.shape == shapes[stream], (stream, pred.shape, shapes[stream])
        assert torch.isfinite(pred).all()
    # predictions are in the `noise - x0` convention: MiniMax-H3's raw output is negated
    raw = spec.unpack_output(out, shapes, model_config=model.config)
    torch.testing.assert_close(preds["latents"], spec.velocity_sign * raw["latents"])
    # the loss runs on them
    targets = {s: objective.flow_matching_target(batch[s], noisy[s]) for s in spec.streams}
    losses = objective.stream_losses(preds, targets)
    assert all(torch.isfinite(v) and v.ndim == 0 for v in losses.values())

    if name in PACKED_AS_OUTPUT:
        roundtrip = spec.unpack_output(PACKED_AS_OUTPUT[name](kw), shapes, model_config=model.config)
        for stream in spec.streams:
            _assert_same(roundtrip[stream], noisy[stream])


def test_forward_with_grad_reaches_lora_targets() -> None:
    spec, model, batch, noisy, sigmas, kw = prepared("flux")
    model.train()
    preds = spec.predictions(model(**kw, return_dict=False), noisy["latents"].shape, model_config=model.config)
    loss = objective.flow_matching_loss(preds["latents"], noisy["latents"], objective.loss_weight(sigmas["latents"]))
    loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if n.endswith("attn.to_q.weight")]
    assert grads and all(g is not None and torch.any(g) for g in grads)


# (3) Timestep sampling -----------------------------------------------------------------------------------------------


def _scheduler_sigmas(shift_spec, u: torch.Tensor, mu: float | None) -> torch.Tensor:
    """The family scheduler's own shift of base sigmas u."""
    config = dict(shift_spec.scheduler_config)
    if shift_spec.scheduler_class == "UniPCMultistepScheduler":
        scheduler = UniPCMultistepScheduler.from_config(config)
        scheduler.set_timesteps(sigmas=u.numpy())
        return scheduler.sigmas[:-1].float()
    if shift_spec.scheduler_class == "FlowMatchEulerDiscreteScheduler":
        config["shift_terminal"] = None  # inference-schedule stretching, not part of the per-sigma shift
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
        scheduler.set_timesteps(sigmas=u.numpy(), mu=mu)
        return scheduler.sigmas[:-1].float()
    raise AssertionError(shift_spec.scheduler_class)


def _pipeline_mu(name: str, image_seq_len: int) -> float | None:
    """mu as the family's pipeline computes it from its scheduler config (None: static shift)."""
    cfg = get_family(name).shift.scheduler_config
    args = (
        cfg.get("base_image_seq_len", 256),
        cfg.get("max_image_seq_len", 4096),
        cfg.get("base_shift", 0.5),
        cfg.get("max_shift", 1.15),
    )
    return {
        "flux": lambda: flux_calculate_shift(image_seq_len, *args),
        "qwenimage": lambda: qwen_calculate_shift(image_seq_len, *args),
        "ltx": lambda: ltx_calculate_shift(image_seq_len, *args),
        "flux2": lambda: compute_empirical_mu(image_seq_len=image_seq_len, num_steps=50),
    }.get(name, lambda: None)()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("scheme", objective.SAMPLING_SCHEMES)
def test_sample_timesteps_deterministic_and_in_range(name: str, scheme: str) -> None:
    spec = get_family(name)
    seq_len = spec.image_seq_len(LATENT_SHAPES[name]["latents"])
    draw = lambda seed: objective.sample_timesteps(  # noqa: E731
        64, spec, scheme=scheme, image_seq_len=seq_len, generator=_gen(seed)
    )
    a, b, c = draw(0), draw(0), draw(1)
    assert a.shape == (64,) and a.dtype == torch.float32
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert bool(((a > 0) & (a < 1)).all())
    if spec.shared_timestep:
        assert torch.equal(a, a[:1].expand(64))
    for stream in spec.streams:
        s = objective.sample_timesteps(8, spec, scheme=scheme, image_seq_len=seq_len, generator=_gen(3), stream=stream)
        assert bool(((s > 0) & (s < 1)).all())


@pytest.mark.parametrize("name", NAMES)
def test_shift_matches_scheduler(name: str) -> None:
    spec = get_family(name)
    u = torch.tensor([0.02, 0.1, 0.25, 0.5, 0.75, 0.9, 0.98])
    for seq_len in (256, 1024, 4608, 9000):
        mu = _pipeline_mu(name, seq_len)
        for stream in spec.streams:
            shift_spec = spec.stream_shift(stream)
            ours = objective.shift_sigmas(u, shift_spec, seq_len)
            if shift_spec.scheduler_class == "MiniMaxH3Scheduler":
                base = torch.linspace(1.0, 0.0, 9)
                scheduler = MiniMaxH3Scheduler(**shift_spec.scheduler_config)
                scheduler.set_timesteps(9)
                torch.testing.assert_close(objective.shift_sigmas(base, shift_spec), scheduler.sigmas)
                continue
            if mu is not None:
                assert shift_spec.kind == "dynamic"
                assert shift_spec.mu(seq_len) == pytest.approx(mu, rel=1e-12)
            torch.testing.assert_close(ours, _scheduler_sigmas(shift_spec, u, mu), rtol=1e-6, atol=1e-6)
    # sample_timesteps = the shifted base draw
    seq_len = spec.image_seq_len(LATENT_SHAPES[name]["latents"])
    u = objective.sample_base(1 if spec.shared_timestep else 16, generator=_gen(7)).expand(16)
    expected = objective.shift_sigmas(u, spec.shift, seq_len).clamp(objective.SIGMA_EPS, 1 - objective.SIGMA_EPS)
    _assert_same(objective.sample_timesteps(16, spec, image_seq_len=seq_len, generator=_gen(7)), expected)


def test_dynamic_shift_needs_seq_len_and_depends_on_it() -> None:
    spec = get_family("flux")
    with pytest.raises(ValueError, match="image_seq_len"):
        objective.sample_timesteps(4, spec, generator=_gen(0))
    small = objective.sample_timesteps(256, spec, image_seq_len=256, generator=_gen(0))
    large = objective.sample_timesteps(256, spec, image_seq_len=4096, generator=_gen(0))
    assert bool((large >= small).all()) and large.mean() > small.mean()  # larger images -> noisier


def test_objective_pieces() -> None:
    gen = _gen(0)
    x0 = torch.randn(3, 4, 5, generator=gen)
    noise = objective.sample_noise(x0.shape, generator=gen)
    sigmas = torch.tensor([0.1, 0.5, 0.9])
    noisy = objective.add_noise(x0, noise, sigmas)
    torch.testing.assert_close(noisy[1], 0.5 * x0[1] + 0.5 * noise[1])
    target = objective.flow_matching_target(x0, noise)
    _assert_same(target, noise - x0)
    # x0 = noisy - sigma * v, for the v = noise - x0 velocity
    torch.testing.assert_close(noisy - sigmas[:, None, None] * target, x0)

    assert torch.equal(objective.loss_weight(sigmas, "none"), torch.ones(3))
    torch.testing.assert_close(objective.loss_weight(sigmas, "sigma_sqrt"), sigmas**-2)
    torch.testing.assert_close(objective.loss_weight(sigmas, "cosmap"), 2 / (np.pi * (1 - 2 * sigmas + 2 * sigmas**2)))
    with pytest.raises(ValueError):
        objective.loss_weight(sigmas, "bogus")
    with pytest.raises(ValueError):
        objective.sample_base(2, scheme="bogus", generator=gen)

    pred = target + torch.randn(target.shape, generator=gen)
    weights = torch.tensor([1.0, 2.0, 0.0])
    per_sample = ((pred - target) ** 2).reshape(3, -1).mean(dim=1)
    torch.testing.assert_close(objective.flow_matching_loss(pred, target, weights), (per_sample * weights).mean())
    torch.testing.assert_close(objective.flow_matching_loss(pred, target), per_sample.mean())
    assert objective.flow_matching_loss(target, target) == 0
    with pytest.raises(ValueError):
        objective.flow_matching_loss(pred, target[:2])


# (4) LoRA targets ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_lora_targets_match_modules(name: str) -> None:
    spec = get_family(name)
    modules = dict(tiny_model(name).named_modules())
    assert spec.lora_targets
    for target in spec.lora_targets:
        hits = [n for n in modules if n and matches_lora_target(n, target)]
        assert hits, f"{name}: LoRA target {target!r} matches no module"
        assert all(isinstance(modules[n], torch.nn.Linear) for n in hits)


# (5) No family-name branches outside train/models/ --------------------------------------------------------------------

_FAMILY_WORDS = "|".join(sorted({*NAMES, *tm.ALL_MODEL_NAMES, "qwen", "qwen_image", "minimax"}, key=len, reverse=True))
_BRANCH_PATTERNS = [
    re.compile(rf"(==|!=)\s*['\"]({_FAMILY_WORDS})['\"]"),
    re.compile(rf"['\"]({_FAMILY_WORDS})['\"]\s*(==|!=)"),
    re.compile(rf"\b(not\s+)?in\s*[\(\[\{{][^\)\]\}}]*['\"]({_FAMILY_WORDS})['\"]"),
    re.compile(rf"\b(startswith|endswith)\(\s*['\"]({_FAMILY_WORDS})"),
    re.compile(rf"\bcase\s+['\"]({_FAMILY_WORDS})['\"]"),
]


def family_branches(root: Path) -> list[str]:
    hits = []
    for path in sorted(root.rglob("*.py")):
        if "models" in path.relative_to(root).parts[:1]:
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if any(p.search(line) for p in _BRANCH_PATTERNS):
                hits.append(f"{path.relative_to(root.parent)}:{lineno}: {line.strip()}")
    return hits


def test_no_family_name_branches_outside_models(tmp_path: Path) -> None:
    assert family_branches(REPO / "train") == []
    # the scan does catch them
    fake = tmp_path / "train"
    (fake / "models").mkdir(parents=True)
    (fake / "trainer.py").write_text('if model == "flux":\n    pass\nif name in ("wan", "ltx"):\n    pass\n')
    (fake / "models" / "flux.py").write_text('if name == "flux":\n    pass\n')
    assert len(family_branches(fake)) == 2


def test_output_tensors() -> None:
    t = torch.zeros(1)
    assert output_tensors(t) == (t,)
    assert output_tensors((t, t)) == (t, t)
