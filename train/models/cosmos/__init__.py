"""Cosmos Predict 2.5 (CosmosTransformer3DModel / Cosmos2_5_PredictBasePipeline): nvidia/Cosmos-Predict2.5-2B and
-14B (the Diffusers weights on the hub revision ``diffusers/base/post-trained``), one checkpoint for text2world,
image2world and video2world.

Cache: ``latents`` (16, F, H, W) Wan 2.1 VAE latents normalised as the pipeline does (``(z - latents_mean) *
(1 / latents_std)``); ``condition_mask`` (F,) bool, True on the clip's clean conditioning latent frames, a prefix of
0 (text2world), 1 (image2world) or 2 (video2world) frames drawn per clip with the released training config's
probabilities 0.5 / 0.25 / 0.25 (train/models/cosmos/encoder.py); those frames hold the posterior mode, what the
pipeline's ``prepare_latents`` encodes from its conditioning image / video (the VAE is causal: latent frame k sees
pixel frames up to 4k only, so the clip's first 4k + 1 frames are the conditioning video); ``prompt_embeds``
(512, 100352) from ``_get_prompt_embeds``: the chat-templated prompt padded to 512 tokens, every Qwen2.5-VL
(Cosmos-Reason1-7B) layer's hidden states normalised per token and concatenated (the transformer's crossattn_proj
maps them to 1024); no text mask reaches the transformer (``prompt_mask`` is the tokenizer's, not read).

Forward kwargs, as the pipeline's denoising loop (minus CFG): ``hidden_states`` = the latents, clean on the
conditioning frames (the spec's ``condition_mask``: the trainer does not noise them and leaves them out of the loss,
where the pipeline substitutes the ground-truth velocity), ``condition_mask`` (B, 1, F, H, W) (the channel forward()
concatenates), ``timestep`` (B, 1, F, 1, 1) = sigma on the noised frames and ``conditional_frame_timestep`` 1e-4 on
the clean ones (the pipeline passes the scheduler's sigma itself), ``encoder_hidden_states``, ``padding_mask`` zeros.
The target is diffusers' flow-matching velocity ``noise - x0`` (``x_t = (1 - sigma) x0 + sigma noise``), what the
pipeline's UniPC scheduler (``prediction_type="flow_prediction"``) integrates. Training sigmas: the released training
config's static shift 5.

Context parallelism: forward() expands the per-frame timestep to per-token modulation (B, S, C) handed whole to every
block (the plan splits it), and diffusers' self-attention processor ignores CP: ``attention.py`` gives ``attn1`` one
that passes the parallel config (plan ``cp_processors``).

Not covered: Cosmos Transfer 2.5 (control branches, image context), Predict 2.5's action-conditioned and multiview
variants, the pipeline's per-sample ``num_videos_per_prompt`` and a video2world conditioning video longer than the
clip's own first frames (the pipeline takes the LAST frames of its input video). The padding-mask channel of the real
transformer is resized with torchvision (forward()); the tiny transformer leaves it out (concat_padding_mask false,
torchvision not installed here). Without ``cosmos_guardrail`` installed the encoder loads the pipeline with a
pass-through safety checker (``NoGuardrail``): validation samples are then not screened.
"""

from .encoder import CosmosEncoder as Encoder
from .spec import SPEC
from .tiny import build_tiny

__all__ = ["SPEC", "Encoder", "build_tiny"]
