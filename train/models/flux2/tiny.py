"""FLUX.2's tiny Flux2Pipeline (a 30-layer Mistral3 of width 8, AutoencoderKLFlux2 with 4 latent channels) around the
tiny transformer of recipes/tiny/flux2.yaml."""

from __future__ import annotations

from pathlib import Path

import torch

from train.models import tiny_config
from train.models.tiny import CHARS, WORDS, decoder_sizes


def flux2_tokenizer(max_length: int = 512):
    """A word-level tokenizer with a Mistral-style chat template (system prompt + [INST] user [/INST]).

    The real FLUX.2 checkpoint's tokenizer is a PixtralProcessor, which transformers 5.24 refuses to build without
    torchvision (not a dependency here); Flux2Pipeline only calls `apply_chat_template` on it for text-to-image, which
    a tokenizer with a chat template answers the same way. Words: the pipeline's system message + WORDS.
    """
    import re

    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]"]
    words = sorted(set(re.findall(r"\w+|[^\w\s]", SYSTEM_MESSAGE)) | set(WORDS) | set(CHARS))
    backend = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(specials + words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    template = (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{% else %}[INST]{% endif %}"
        "{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% else %}[IMG]{% endif %}{% endfor %}"
        "{% if m['role'] == 'system' %}[/SYSTEM_PROMPT]{% else %}[/INST]{% endif %}{% endfor %}"
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=specials[4:],
        chat_template=template,
    )
    tok.model_max_length = max_length
    return tok


def build_tiny(path: Path) -> None:
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    hidden = 8
    # Flux2Pipeline stacks hidden states 10, 20 and 30 of the Mistral text model: 30 layers, text width 3 x hidden
    cfg = {**tiny_config("flux2"), "joint_attention_dim": 3 * hidden}
    z = cfg["in_channels"] // 4  # latents are 2x2-patchified into channels
    tok = flux2_tokenizer()
    vision = dict(model_type="pixtral", hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                  head_dim=4, patch_size=4, image_size=32)  # fmt: skip
    text_encoder = Mistral3ForConditionalGeneration(
        Mistral3Config(
            vision_config=vision,
            text_config=decoder_sizes(
                tok, hidden, 30, model_type="mistral", intermediate_size=16, head_dim=4, max_position_embeddings=1024
            ),
            image_token_index=tok.convert_tokens_to_ids("[IMG]"),
            spatial_merge_size=1,
        )
    )
    vae = AutoencoderKLFlux2(block_out_channels=(4, 4, 4, 4), layers_per_block=1, latent_channels=z, norm_num_groups=2)
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.linspace(-0.2, 0.2, 4 * z))
        vae.bn.running_var.copy_(torch.linspace(0.5, 2.0, 4 * z))
    pipe = Flux2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tok,
        transformer=Flux2Transformer2DModel(**cfg),
    )
    pipe.save_pretrained(path)
