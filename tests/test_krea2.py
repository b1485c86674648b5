"""Krea 2 (`krea2`), what the family-generic tests do not cover (those pick it up: the pipeline-step driver in
test_families.py, model-level CP parity at every layout in test_cp_models.py, prepare + trainer CP 3 run + LoRA
reload in test_families_e2e.py, the real config and recipe in test_real_models.py).

(1) Each caption's cache is Krea2Pipeline.encode_prompt's tensors for it in a batch of prompts of different lengths
(one longer than the block, which the pipeline truncates, and the empty caption of caption dropout): the stack of
tapped layers over the fixed-length block, its mask False exactly on the padding in the block's middle; the tiny
tokenizer counts the template as the real one does (34 prefix tokens dropped, 5 suffix tokens), so the block is
``max_sequence_length`` tokens; and the trainer's forward kwargs of the collated cache carry the batch's encode_prompt
text and mask exactly.
(2) A validation sample rendered in process (1-rank gloo group, the training transformer in train mode, CFG with the
pipeline's empty negative prompt) is Krea2Pipeline's own output of the same call.

Not here: a Krea 2 edit family. diffusers 0.42.1 has no Krea 2 edit pipeline and Krea2Transformer2DModel takes no
reference-image input, so there is no diffusers oracle to build one against.
"""

from __future__ import annotations

from pathlib import Path

import diffusers
import numpy as np
import torch

from train.models import get_encoder, get_family, tiny_config

REPO = Path(__file__).resolve().parents[1]
CAPTIONS = ["a red square", "a blue circle moving up on a white background, slowly, then faster and faster", ""]
BLOCK = 24  # max_sequence_length: the second caption's 76 byte tokens do not fit, the others are padded


# (1) the cache is encode_prompt's ----------------------------------------------------------------------------------


@torch.no_grad()
def test_cache_text_is_the_pipelines_encode_prompt(tiny_pipeline) -> None:
    """~3 s. Per caption, the cache equals encode_prompt of the three captions as one batch (rtol/atol 1e-5: a batch
    of 1 vs 3 in float32), at the block length and at the pipeline's default 512."""
    from train.data.dataset import collate

    path = tiny_pipeline("krea2")
    encoder = get_encoder("krea2")
    encoder.load(str(path))
    pipe = diffusers.Krea2Pipeline.from_pretrained(path)
    tok = pipe.tokenizer
    assert len(tok(pipe.prompt_template_encode_prefix).input_ids) == pipe.prompt_template_encode_start_idx == 34
    assert len(tok(pipe.prompt_template_encode_suffix).input_ids) == pipe.prompt_template_encode_num_suffix_tokens
    layers = tiny_config("krea2")["num_text_layers"]
    for block in (BLOCK, encoder.text_tokens(None)):
        cached = [encoder.encode_text(c, block) for c in CAPTIONS]
        embeds, mask = pipe.encode_prompt(CAPTIONS, device="cpu", max_sequence_length=block)
        assert embeds.shape == (3, block, layers, tiny_config("krea2")["text_hidden_dim"]) and mask.dtype == torch.bool
        for i, (item, caption) in enumerate(zip(cached, CAPTIONS)):
            assert item["prompt_embeds"].shape == embeds.shape[1:] and torch.equal(item["prompt_mask"], mask[i])
            torch.testing.assert_close(item["prompt_embeds"], embeds[i], rtol=1e-5, atol=1e-5)
            # [caption | PAD | suffix]: the caption's tokens (truncated to fit), padding, the 5 suffix tokens
            kept = min(len(tok(caption).input_ids), block - 5)
            expected = torch.cat([torch.ones(kept), torch.zeros(block - 5 - kept), torch.ones(5)]).bool()
            assert torch.equal(item["prompt_mask"], expected), (caption, item["prompt_mask"])
        assert not mask[0].all() and not mask[2, :-5].any()  # padded; the empty caption all padding
        assert mask[1, :-5].all() == (block == BLOCK)  # the long caption truncated to fill the short block
    # the trainer's kwargs of the collated cache: the batch's encode_prompt text and bool mask
    batch = collate(cached)
    kwargs = get_family("krea2").forward_kwargs(batch, {"latents": torch.zeros(3, 4, 1, 2, 4)}, torch.full((3,), 0.5),
                                                model_config=tiny_config("krea2"))  # fmt: skip
    torch.testing.assert_close(kwargs["encoder_hidden_states"], embeds, rtol=1e-5, atol=1e-5)
    assert torch.equal(kwargs["encoder_attention_mask"], mask)
    assert torch.equal(kwargs["position_ids"], pipe.prepare_position_ids(embeds.shape[1], 1, 2, "cpu"))


# (2) validation in process -----------------------------------------------------------------------------------------


def test_in_process_sample_is_the_pipelines_own_output(tiny_pipeline, tmp_path: Path) -> None:
    """~10 s. The sample png equals a fresh Krea2Pipeline's own output of the same call (8-bit levels within 1; the
    saved float tensor within 1e-5), and the training transformer is back in train mode."""
    import torch.distributed as dist
    from PIL import Image

    from train.config import load_recipe
    from train.metrics import MetricsLogger
    from train.validation import Validation

    spec, pipeline = get_family("krea2"), tiny_pipeline("krea2")
    recipe = load_recipe(REPO / "recipes/tiny/krea2.yaml", [
        f"model.pretrained_path={pipeline}", f"output_dir={tmp_path / 'run'}", "train.max_steps=3",
        "logging.wandb_mode=disabled", "validation={prompts: [{prompt: a green triangle}], every_n_steps: 3, "
        "num_inference_steps: 2, height: 32, width: 48, save_tensors: true}"])  # fmt: skip
    model = diffusers.Krea2Transformer2DModel.from_pretrained(pipeline, subfolder="transformer").train()
    metrics = MetricsLogger(type("Main", (), {"is_main_process": True})(), tmp_path, {}, recipe.logging, "test")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        (path,) = Validation(recipe, spec, model, torch.device("cpu"), None, metrics).at_step(3)
    finally:
        dist.destroy_process_group()
    assert path == tmp_path / "run" / "samples" / "step_3" / "0.png" and model.training
    pipe = diffusers.Krea2Pipeline.from_pretrained(pipeline)  # its own transformer
    pipe.set_progress_bar_config(disable=True)
    ref = pipe(prompt="a green triangle", height=32, width=48, num_inference_steps=2, output_type="np",
               generator=torch.Generator().manual_seed(0))[0][0]  # fmt: skip
    png = np.asarray(Image.open(path)).astype(int)
    assert png.shape == (32, 48, 3)
    assert np.abs(png - (np.clip(ref, 0, 1) * 255).round().astype(int)).max() <= 1
    assert np.abs(torch.load(path.with_suffix(".pt")).numpy() - ref).max() <= 1e-5
