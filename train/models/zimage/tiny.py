"""Z-Image's tiny ZImagePipeline (a 2-layer Qwen3 text encoder of width 16 with a byte-level tokenizer and Qwen3's
chat template, FLUX.1's tiny AutoencoderKL with 4 latent channels) around the tiny transformer of
recipes/tiny/zimage.yaml."""

from __future__ import annotations

from pathlib import Path

from train.models import tiny_config
from train.models.flux.tiny import flux_vae
from train.models.tiny import decoder_sizes, qwen_tokenizer

# Qwen3's chat template for one user turn (what _encode_prompt renders): the generation prompt, and the empty think
# block only when thinking is switched off (ZImagePipeline passes enable_thinking=True: none).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def tiny_qwen3(d: int):
    """(tokenizer, text encoder): a byte-level Qwen2 tokenizer with Qwen3's chat template and a 2-layer Qwen3Model of
    width ``d`` (the transformer's ``cap_feat_dim``; the pipeline reads hidden_states[-2])."""
    from transformers import Qwen3Config, Qwen3Model

    tok = qwen_tokenizer(("<|im_start|>", "<|im_end|>"))
    tok.chat_template = CHAT_TEMPLATE
    end = tok.convert_tokens_to_ids("<|im_end|>")
    sizes = decoder_sizes(tok, d, 2, head_dim=8, bos_token_id=end, eos_token_id=end)
    return tok, Qwen3Model(Qwen3Config(**sizes))


def build_tiny(path: Path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

    cfg = tiny_config("zimage")
    tok, text_encoder = tiny_qwen3(cfg["cap_feat_dim"])
    ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=6.0),  # Tongyi-MAI/Z-Image's
        vae=flux_vae(cfg["in_channels"]),
        text_encoder=text_encoder,
        tokenizer=tok,
        transformer=ZImageTransformer2DModel(**cfg),
    ).save_pretrained(path)
