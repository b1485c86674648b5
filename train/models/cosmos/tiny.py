"""Cosmos Predict 2.5's tiny Cosmos2_5_PredictBasePipeline (a 2-layer Qwen2.5-VL text encoder of width 16 with a
Qwen-style chat template, AutoencoderKLWan with 4 latent channels, the converted checkpoint's UniPC scheduler) around
the tiny transformer of recipes/tiny/cosmos.yaml."""

from __future__ import annotations

from pathlib import Path

from train.models import tiny_config
from train.models.qwenimage.tiny import tiny_qwen25vl
from train.models.tiny import wan_vae

TEXT_WIDTH = 16  # 2 layers x 16: the tiny transformer's crossattn_proj_in_channels (all layers, concatenated)
# The Qwen2.5-VL chat layout for text-only messages (what _get_prompt_embeds renders, add_generation_prompt False)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% for content in message['content'] %}{{ content['text'] }}{% endfor %}<|im_end|>\n{% endfor %}"
)


def build_tiny(path: Path) -> None:
    from diffusers import Cosmos2_5_PredictBasePipeline, CosmosTransformer3DModel, UniPCMultistepScheduler

    from train.models.cosmos.encoder import NoGuardrail

    config = tiny_config("cosmos")
    tokenizer, text_encoder = tiny_qwen25vl(TEXT_WIDTH)
    tokenizer.chat_template = CHAT_TEMPLATE
    scheduler = UniPCMultistepScheduler(use_karras_sigmas=True, use_flow_sigmas=True, prediction_type="flow_prediction",
                                        sigma_max=200.0, sigma_min=0.01)  # fmt: skip
    pipe = Cosmos2_5_PredictBasePipeline(
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=CosmosTransformer3DModel(**config),
        vae=wan_vae(config["out_channels"]),
        scheduler=scheduler,
        safety_checker=NoGuardrail(),
    )
    pipe.save_pretrained(path)
