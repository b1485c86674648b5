"""`finetune.init_lora`: a run starts from someone else's adapter, read as diffusers reads it.

The adapter is a musubi-tuner / kohya Wan LoRA (`lora_unet_blocks_0_self_attn_q.lora_down.weight`, alpha tensors,
rank 3 and alpha 1.5, unlike the recipe's 4 / 8), written here key by key in that tool's layout. The proof: step 1's
loss and gradient norm of the trainer at CP 2 (FSDP2, sharded start) equal the serial reference whose model is the
WanPipeline transformer with that same file loaded by `load_lora_weights` (diffusers' musubi converter), trained on
the same batch, noise and sigmas (tests/harness.py `first_step`). Bad files: another family's keys, another model
size's shapes, one line naming the first bad key; through the trainer, exit 2 before any collective.
"""

from __future__ import annotations

from pathlib import Path

import diffusers
import pytest
import torch
import yaml
from safetensors.torch import save_file

from tests.harness import MUSUBI_WAN, REL_TOL, REPO, first_step, musubi_wan_lora, train
from train.config import load_recipe
from train.errors import UserError
from train.modeling import _random_init, family_spec, meta_transformer, read_init_lora

TINY = REPO / "recipes/tiny/wan.yaml"
RANK, ALPHA = 3, 1.5


def _recipe(tmp: Path) -> Path:
    """The tiny Wan recipe without its own lora_rank / lora_alpha (init_lora brings them)."""
    raw = yaml.safe_load(TINY.read_text())
    raw["finetune"] = {"method": "lora"}
    path = tmp / "wan_init.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("init_lora")
    recipe = load_recipe(TINY)
    model = _random_init(recipe.model, family_spec(recipe.model), seed=0)
    return {
        "recipe": _recipe(tmp),
        "musubi": musubi_wan_lora(tmp / "musubi_wan.safetensors", model, RANK, ALPHA),
        "tmp": tmp,
    }


def _meta(recipe: Path):
    r = load_recipe(recipe)
    return meta_transformer(r.model, family_spec(r.model)), family_spec(r.model)


def test_reads_a_musubi_adapter_with_its_rank_and_alpha(files) -> None:
    model, spec = _meta(files["recipe"])
    adapter = read_init_lora(str(files["musubi"]), spec, model)
    assert adapter.config.r == RANK and len(adapter.values) == 2 * len(MUSUBI_WAN) * len(model.blocks)
    # the musubi converter folds alpha / rank into the tensors: diffusers loads it with alpha = rank
    assert adapter.config.lora_alpha == RANK


@pytest.mark.slow
def test_step_one_at_cp2_equals_the_pipeline_transformer_with_the_file_loaded(files, tmp_path: Path) -> None:
    run = train(tmp_path / "run", files["recipe"], f"finetune.init_lora={files['musubi']}", "train.max_steps=1",
                "parallel.cp=2", nproc=2)  # fmt: skip
    r = load_recipe(files["recipe"])
    transformer = _random_init(r.model, family_spec(r.model), seed=r.train.seed)
    pipe = diffusers.WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=None, transformer=transformer)
    pipe.load_lora_weights(files["musubi"])  # diffusers' own reading of the file
    transformer.requires_grad_(False)
    for name, p in transformer.named_parameters():
        p.requires_grad_(".lora_" in name)
    serial = first_step(files["recipe"], f"finetune.init_lora={files['musubi']}", model=transformer.train())
    step = run.metrics[0]
    for key in ("loss", "grad_norm"):
        assert abs(step[key] - serial[key]) <= REL_TOL * abs(serial[key]), (key, step[key], serial[key])
    # the trained adapter differs from a run from scratch: the file was used
    scratch = first_step(files["recipe"])
    assert abs(scratch["loss"] - serial["loss"]) > 1e-3 * abs(serial["loss"])


def test_another_familys_file_is_one_line(files) -> None:
    model, spec = _meta(files["recipe"])
    flux = files["tmp"] / "flux.safetensors"
    save_file({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(2, 8),
               "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(8, 2)}, str(flux))  # fmt: skip
    with pytest.raises(UserError, match=r"first bad key is transformer\.transformer_blocks\.0\.attn\.to_q\.lora_A"):
        read_init_lora(str(flux), spec, model)
    kohya_flux = files["tmp"] / "kohya_flux.safetensors"
    save_file({"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.zeros(2, 8)}, str(kohya_flux))
    with pytest.raises(UserError, match="is not a LoRA WanPipeline reads"):
        read_init_lora(str(kohya_flux), spec, model)


def test_shapes_of_another_model_size_are_one_line(files) -> None:
    model, spec = _meta(files["recipe"])
    r = load_recipe(files["recipe"])
    wider = _random_init(r.model.model_copy(update={"init_config": {**r.model.init_config, "attention_head_dim": 16}}),
                         spec, seed=0)  # fmt: skip
    bad = musubi_wan_lora(files["tmp"] / "wide.safetensors", wider, RANK, ALPHA)
    with pytest.raises(UserError, match=r"first bad key is transformer\.blocks\.0\.attn1\.to_q\.lora_A\.weight: shape"):
        read_init_lora(str(bad), spec, model)


@pytest.mark.slow
def test_trainer_refuses_a_bad_file_before_any_collective(files, tmp_path: Path) -> None:
    bad = files["tmp"] / "kohya_flux.safetensors"
    if not bad.exists():
        save_file({"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.zeros(2, 8)}, str(bad))
    run = train(tmp_path / "run", files["recipe"], f"finetune.init_lora={bad}", nproc=2, check=False)
    assert run.rc == 2 and len(run.errors) == 1 and "is not a LoRA WanPipeline reads" in run.errors[0], run.log[-2000:]


def test_init_lora_with_own_rank_is_refused() -> None:
    with pytest.raises(Exception, match="finetune.lora_rank.*init_lora"):
        load_recipe(TINY, ["finetune.init_lora=x.safetensors"])
