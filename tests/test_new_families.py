"""Issue 22's families, what the family-generic tests do not cover (those pick every family up: the pipeline-step
driver in test_families.py, model-level CP parity at every layout in test_cp_models.py, prepare + trainer CP run +
LoRA reload in test_families_e2e.py, the real configs and recipes in test_real_models.py).

Chroma (`chroma`): (1) the pipeline's float joint mask is live (the output depends on it, so the CP parity runs test
a mask that matters), and its plan's `joint_key_mask` is what makes it exact: without it the first CP forward is
refused on every rank with one line naming the plan key.
Wan 2.2 I2V A14B (`wan22_i2v`): (2) the cache's condition latents are WanImageToVideoPipeline's own for the same
image, with no image embeddings; (3) each expert's sigmas fall on its side of the shipped boundary_ratio 0.9.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import diffusers
import torch

from tests.harness import rank_job
from train import objective
from train.config import load_recipe
from train.models import expert_sigma_range, get_encoder, get_family, pipeline_boundary_ratio
from train.tools.tiny_models import build_model, family_case

REPO = Path(__file__).resolve().parents[1]
I2V_A14B = "Wan-AI/Wan2.2-I2V-A14B-Diffusers"


# (1) Chroma's mask ----------------------------------------------------------------------------------------------------


@torch.no_grad()
def test_chroma_mask_is_live() -> None:
    case = family_case("chroma", seed=1, batch_size=2)
    mask = case.kwargs["attention_mask"]
    text = case.kwargs["encoder_hidden_states"].shape[1]
    assert mask.dtype == torch.float32 and mask.shape == (2, text + case.kwargs["hidden_states"].shape[1])
    assert not mask[:, :text].all() and mask[:, text:].all()  # padded text, then the image's ones
    model = build_model("chroma").eval()
    masked = model(**case.kwargs, return_dict=False)[0]
    unmasked = model(**{**case.kwargs, "attention_mask": None}, return_dict=False)[0]
    assert (masked - unmasked).abs().max() > 1e-3


@rank_job(2)
def _chroma_without_joint_mask(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    from train.cp import enable_context_parallel
    from train.cp.masks import MaskPlacementError
    from train.cp.plans import plan_for
    from train.tools.oracle import run_step

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("ring", "ulysses"))
    plan = dataclasses.replace(plan_for("ChromaTransformer2DModel"), joint_key_mask=())
    model = build_model("chroma")
    enable_context_parallel(model, mesh=mesh, plan=plan)
    try:
        run_step(model, family_case("chroma", seed=1, batch_size=2))
    except MaskPlacementError as e:
        return str(e)
    return ""


def test_chroma_joint_mask_without_its_declaration_is_refused(group) -> None:
    for rank, said in enumerate(group(_chroma_without_joint_mask, 2)):
        assert "joint_key_mask" in said and "would mask the wrong keys" in said, (rank, said)
        assert "\n" not in said


# (2) Wan 2.2 I2V A14B: the cache is the pipeline's condition ----------------------------------------------------------


@torch.no_grad()
def test_wan22_i2v_cache_is_the_pipelines_condition(tiny_pipeline) -> None:
    from PIL import Image

    path = tiny_pipeline("wan22_i2v")
    encoder = get_encoder("wan22_i2v")
    encoder.load(str(path))
    clip = torch.rand(3, 9, 32, 48, generator=torch.Generator().manual_seed(7)) * 2 - 1
    pixels = ((clip[:, 0].permute(1, 2, 0) + 1) * 127.5).round().byte()
    clip[:, 0] = pixels.permute(2, 0, 1) / 127.5 - 1  # an 8-bit frame 0: the image the pipeline is given
    cached = encoder.encode_media(clip, None, "mode", None)
    assert set(cached) == {"latents", "condition_latents"}  # no image encoder, no image embeddings
    pipe = diffusers.WanImageToVideoPipeline.from_pretrained(path)
    assert pipe.image_encoder is None and pipe.transformer.config.image_dim is None
    pre = pipe.video_processor.preprocess(Image.fromarray(pixels.numpy()), height=32, width=48).float()
    _, condition = pipe.prepare_latents(pre, 1, pipe.vae.config.z_dim, 32, 48, 9, torch.float32, "cpu", None,
                                        torch.zeros(1, *cached["latents"].shape))  # fmt: skip
    torch.testing.assert_close(cached["condition_latents"], condition[0, 4:], rtol=1e-5, atol=1e-5)
    assert encoder.text_tokens(None) == 512 and encoder.text_tokens(16) == 16  # no image context: any text length


# (3) Wan 2.2 I2V A14B: each expert's sigmas --------------------------------------------------------------------------


def test_wan22_i2v_expert_sigmas_fall_in_their_range() -> None:
    spec = get_family("wan22_i2v")
    assert spec.experts == ("transformer", "transformer_2") and spec.shift.shift == 5.0
    assert pipeline_boundary_ratio("wan22_i2v", I2V_A14B) == 0.9  # the shipped model_index.json
    model = load_recipe(REPO / "recipes/wan22_i2v/a14b_high_noise_lora.yaml").model
    for subfolder, high in (("transformer", True), ("transformer_2", False)):
        lo, hi = expert_sigma_range(spec, model.model_copy(update={"subfolder": subfolder}))
        assert (lo, hi) == ((0.9, 1.0) if high else (0.0, 0.9))
        s = objective.sample_stream_sigmas(4096, spec, sigma_range=(lo, hi),
                                           generator=torch.Generator().manual_seed(0))["latents"]  # fmt: skip
        t = s.double() * 1000  # WanImageToVideoPipeline: transformer while t >= boundary_ratio * 1000
        assert bool(((t >= 900) if high else (t < 900)).all()), (subfolder, s.min(), s.max())
