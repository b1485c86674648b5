"""The Wan conditioning variants: Wan 2.1 image-to-video (`wan_i2v`), Wan 2.2 TI2V-5B (`wan22_ti2v`: clean first
frame, per-token timesteps) and Wan 2.2 A14B's two experts (`wan22`).

What the family-generic tests (test_families, test_tiny_models, test_cp_models, test_real_models, test_families_e2e)
do not cover:
(1) the data encoders' cache tensors equal WanImageToVideoPipeline's own computation for the same pixels,
(2) TI2V's per-token timestep under CP is split exactly like the tokens (uneven splits, frame 0's tokens at 0),
(3) each A14B expert's sigmas fall in the range the pipeline routes to it (the shipped boundary_ratio, the real shift).
Each variant's prepared cache trains through the launcher (TI2V under CP 4) with the serial oracle's first step, and
its LoRA export loads into the family's diffusers pipeline (A14B: its low-noise expert, from and into transformer_2),
in tests/test_families_e2e.py.
"""

from __future__ import annotations

from pathlib import Path

import diffusers
import pytest
import torch

from tests.harness import rank_job
from train import objective
from train.config import load_recipe
from train.cp.layout import split_sizes
from train.errors import UserError
from train.models import expert_sigma_range, get_encoder, get_family, pipeline_boundary_ratio

REPO = Path(__file__).resolve().parents[1]
A14B = "Wan-AI/Wan2.2-T2V-A14B-Diffusers"


def _clip(frames: int, height: int, width: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.rand(3, frames, height, width, generator=gen) * 2 - 1


# (1) Cache tensors = the pipeline's own computation ------------------------------------------------------------------


@torch.no_grad()
def test_wan_i2v_cache_is_the_pipelines_condition(tiny_pipeline) -> None:
    from PIL import Image

    path = tiny_pipeline("wan_i2v")
    encoder = get_encoder("wan_i2v")
    encoder.load(str(path))
    clip = _clip(9, 32, 48)
    pixels = ((clip[:, 0].permute(1, 2, 0) + 1) * 127.5).round().byte()
    clip[:, 0] = pixels.permute(2, 0, 1) / 127.5 - 1  # an 8-bit frame 0: the image the pipeline is given
    cached = encoder.encode_media(clip, None, "mode", None)
    pipe = diffusers.WanImageToVideoPipeline.from_pretrained(path)
    # the pipeline's path from that image: video_processor.preprocess, prepare_latents, encode_image
    image = Image.fromarray(pixels.numpy())
    pre = pipe.video_processor.preprocess(image, height=32, width=48).float()
    _, condition = pipe.prepare_latents(pre, 1, pipe.vae.config.z_dim, 32, 48, 9, torch.float32, "cpu", None,
                                        torch.zeros(1, *cached["latents"].shape))  # fmt: skip
    torch.testing.assert_close(cached["condition_latents"], condition[0, 4:], rtol=1e-5, atol=1e-5)
    assert torch.equal(condition[0, :4, 0], torch.ones_like(condition[0, :4, 0]))  # the mask the spec rebuilds
    assert not condition[0, :4, 1:].any()
    torch.testing.assert_close(cached["image_embeds"], pipe.encode_image(image, "cpu")[0])
    assert cached["image_embeds"].shape == (17, 12)  # CLIP hidden_states[-2]: 16 patches + class token


@torch.no_grad()
def test_wan22_ti2v_first_latent_frame_is_the_pipelines_condition(tiny_pipeline) -> None:
    from diffusers.pipelines.wan.pipeline_wan_i2v import retrieve_latents

    path = tiny_pipeline("wan22_ti2v")
    encoder = get_encoder("wan22_ti2v")
    encoder.load(str(path))
    clip = _clip(9, 32, 64)
    cached = encoder.encode_media(clip, None, "mode", None)["latents"]
    pipe = diffusers.WanImageToVideoPipeline.from_pretrained(path)  # a WanPipeline folder with expand_timesteps
    assert pipe.config.expand_timesteps and pipe.vae_scale_factor_spatial == 16
    assert cached.shape == (4, 3, 2, 4)  # 9 frames -> 3 latent frames, x16 spatial
    vae, cfg = pipe.vae, pipe.vae.config
    mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1)
    image = retrieve_latents(vae.encode(clip[:, :1][None]), sample_mode="argmax")  # the first frame alone
    video = retrieve_latents(vae.encode(clip[None]), sample_mode="argmax")
    torch.testing.assert_close(cached[:, :1], ((image - mean) / std)[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cached[:, 1:], ((video - mean) / std)[0, :, 1:], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="expand_timesteps"):  # a Wan 2.1 folder is no TI2V pipeline
        get_encoder("wan22_ti2v").load(str(tiny_pipeline("wan")))


# (2) TI2V: the per-token timestep, and its CP split ------------------------------------------------------------------


def test_ti2v_token_timesteps_are_the_pipelines() -> None:
    spec = get_family("wan22_ti2v")
    latents = torch.zeros(2, 4, 3, 4, 6)
    sigmas = torch.tensor([0.3, 0.8])
    mask = spec.conditioning({}, latents)
    element = objective.condition_sigmas(sigmas, mask)
    kwargs = spec.forward_kwargs({"prompt_embeds": torch.zeros(2, 5, 16)}, latents, element,
                                 model_config={"patch_size": (1, 2, 2)})  # fmt: skip
    # WanImageToVideoPipeline: first_frame_mask (0 on frame 0) [:, ::2, ::2] * t, flattened, per sample
    ffm = torch.ones(1, 1, 3, 4, 6)
    ffm[:, :, 0] = 0
    expected = torch.stack([(ffm[0][0][:, ::2, ::2] * (s * 1000)).flatten() for s in sigmas])
    torch.testing.assert_close(kwargs["timestep"], expected)
    assert kwargs["timestep"].shape == (2, 3 * 2 * 3)
    with pytest.raises(ValueError, match="per-element"):
        spec.forward_kwargs(
            {"prompt_embeds": torch.zeros(2, 5, 16)}, latents, sigmas, model_config={"patch_size": (1, 2, 2)}
        )


@rank_job(3)
def _ti2v_split(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from train.cp import enable_context_parallel
    from train.tools.tiny_models import build_model, family_case

    case = family_case("wan22_ti2v", seed=1)
    model = build_model("wan22_ti2v").eval()
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("ring", "ulysses"))
    enable_context_parallel(model, mesh=mesh)
    seen: dict[str, torch.Tensor] = {}

    def record(key: str):
        def hook(_, args) -> None:  # a pre-hook returning nothing leaves the inputs as they are
            seen.setdefault(key, args[0].clone())

        return hook

    # CP's splits are diffusers hooks that wrap forward: hook modules the wrapped forwards call, which see the
    # rank-local tensors (the time embedder gets the flattened (B * S_local,) timestep, norm1 the local tokens)
    model.condition_embedder.timesteps_proj.register_forward_pre_hook(record("timestep"))
    model.blocks[0].norm1.register_forward_pre_hook(record("tokens"))
    with torch.no_grad():
        model(**case.kwargs, return_dict=False)
    full = case.kwargs["timestep"]
    return {"timestep": seen["timestep"].view(full.shape[0], -1), "tokens": seen["tokens"].shape[1], "full": full}


def test_ti2v_timestep_splits_like_the_tokens(group) -> None:
    """Uneven CP 3 (35 tokens: 12, 12, 11): each rank's per-token timestep is its own tokens' slice of the whole."""
    world = 3
    results = group(_ti2v_split, world)
    full = results[0]["full"]
    sizes = split_sizes(full.shape[1], world)
    assert len(set(sizes)) > 1, sizes  # uneven
    start = 0
    for rank, (res, size) in enumerate(zip(results, sizes, strict=True)):
        assert res["tokens"] == size and res["timestep"].shape == (full.shape[0], size), (rank, res, sizes)
        assert torch.equal(res["timestep"], full[:, start : start + size]), rank
        start += size
    assert not full[:, :7].any() and full[:, 7:].all()  # frame 0's 1 x 7 tokens at 0, the others at sigma * 1000


# (3) A14B experts: sigmas in the range the pipeline routes to each --------------------------------------------------


def test_a14b_expert_sigmas_fall_in_their_range() -> None:
    spec = get_family("wan22")
    assert spec.experts == ("transformer", "transformer_2") and spec.shift.shift == 3.0
    assert pipeline_boundary_ratio("wan22", A14B) == 0.875  # the shipped model_index.json
    model = load_recipe(REPO / "recipes/wan22/a14b_low_noise_lora.yaml").model
    boundary = 0.875 * 1000  # WanPipeline: transformer while t >= boundary_ratio * num_train_timesteps
    for subfolder, high in (("transformer", True), ("transformer_2", False)):
        cfg = model.model_copy(update={"subfolder": subfolder})
        lo, hi = expert_sigma_range(spec, cfg)
        assert (lo, hi) == ((0.875, 1.0) if high else (0.0, 0.875))
        for scheme in ("logit_normal", "uniform"):
            s = objective.sample_stream_sigmas(4096, spec, scheme=scheme, sigma_range=(lo, hi),
                                               generator=torch.Generator().manual_seed(0))["latents"]  # fmt: skip
            t = s.double() * 1000  # the timestep the pipeline compares with the boundary
            assert bool(((t >= boundary) if high else (t < boundary)).all()), (subfolder, s.min(), s.max())
            # the draws fill the range (the density keeps its shape inside it)
            assert s.min() < lo + 0.05 * (hi - lo) and s.max() > hi - 0.05 * (hi - lo)
    with pytest.raises(UserError, match="model.subfolder"):
        expert_sigma_range(spec, model.model_copy(update={"subfolder": "transformer_3"}))
    with pytest.raises(UserError, match="model.boundary_ratio"):
        expert_sigma_range(spec, model.model_copy(update={"pretrained_path": "Wan-AI/Other"}))
    assert expert_sigma_range(get_family("wan"), model) is None
