"""HunyuanVideo (no diffusers CP plan: cp_plans/hunyuan_video.yaml): the cache is what HunyuanVideoPipeline computes
(its own `encode_prompt` with the template crop counted for the tokenizer, the VAE's scaling). Elsewhere: model-level
parity at every CP layout, and the refusal of a plan without its `joint_key_mask`, in tests/test_cp_models.py; the
forward kwargs vs one pipeline step in tests/test_families.py; the trainer's full fine-tune under CP 2, 3, 4 and
ring 2 x Ulysses 2 equal to the serial launch (and step 1 to the fp64 oracle), the LoRA run and its reload into
HunyuanVideoPipeline, in tests/test_families_e2e.py."""

from __future__ import annotations

import torch

from train.models import get_encoder, tiny_config
from train.models.hunyuan_video.encoder import prompt_template

NAME = "hunyuan_video"
CAPTIONS = ("a red square", "a blue circle moving up on a white background")


@torch.no_grad()
def test_cache_is_the_pipelines(tiny_pipeline) -> None:
    from diffusers import HunyuanVideoPipeline

    pipeline_path = tiny_pipeline(NAME)
    pipe = HunyuanVideoPipeline.from_pretrained(pipeline_path)
    encoder = get_encoder(NAME)
    encoder.load(str(pipeline_path))
    template = prompt_template(pipe.tokenizer)
    for caption in CAPTIONS:
        ours = encoder.encode_text(caption, 64)
        embeds, pooled, mask = pipe.encode_prompt(prompt=caption, prompt_template=template, max_sequence_length=64)
        torch.testing.assert_close(ours["prompt_embeds"], embeds[0], rtol=0, atol=0)
        torch.testing.assert_close(ours["pooled_embeds"], pooled[0], rtol=0, atol=0)
        assert torch.equal(ours["prompt_mask"], mask[0].bool())
        # The crop lands on the prompt: what is kept starts with the caption's own tokens, then <|eot_id|>, padding.
        ids = pipe.tokenizer(template["template"].format(caption))["input_ids"][template["crop_start"] :]
        own = pipe.tokenizer(caption, add_special_tokens=False)["input_ids"]
        assert ids == [*own, pipe.tokenizer.convert_tokens_to_ids("<|eot_id|>")]
        assert int(ours["prompt_mask"].sum()) == len(ids) < 64

    # Latents: the VAE posterior's mean times scaling_factor, what the pipeline's decode divides back out.
    clip = torch.rand(3, 9, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = encoder.encode_media(clip, None, "mode", 24.0)["latents"]
    expected = pipe.vae.encode(clip[None]).latent_dist.mode()[0] * pipe.vae.config.scaling_factor
    assert pipe.vae.config.scaling_factor != 1.0
    torch.testing.assert_close(latents, expected, rtol=0, atol=0)
    assert latents.shape == (tiny_config(NAME)["in_channels"], 3, 4, 6)  # 4k + 1 frames -> k + 1, x8 spatial
