"""Hand-given facts for the CP sweep (train/tools/sweep.py), as data: what the rules cannot derive for a class.

Every entry says why it is needed. The sweep derives each class's tiny config from its ``__init__`` signature and its
forward inputs from its ``forward`` signature and that config; these tables only correct what that derivation gets
wrong. Nothing here is code: a class is a key, its values are plain data.

* ``CONFIG``: class -> config values set after the derivation (a hidden-width key the rules do not know, a RoPE
  section of an odd layout, a list of block indices that must fit the tiny block count).
* ``INPUTS``: class -> forward-argument values or shapes set after the synthesis. A value is a tensor spec
  ``{"shape": [...], "kind": "randn" | "ones" | "ids" | "timestep" | "fill" | "positions" | "arange" |
  "aranges" | "runs" | "masked_list"}`` (``fill``: every entry ``"value"``; ``positions``: token i has position i on
  every axis of the last dim; ``arange``: 0..n-1; ``aranges``: a tuple of one arange per size; ``runs``: a bool row
  of ``[[length, value], ...]`` runs; ``masked_list``: one (L_i, C) tensor per sample, its padded text dropped) with
  sizes written as the names in
  :data:`train.tools.sweep.SIZES` (``"B"``, ``"L"``, ...) or integers; or a plain value (int, tuple, None).
* ``LAYOUT``: class -> which hidden_states layout the forward takes, when trying the candidates in order would pick
  a wrong one that happens to run.
* ``REASONS``: class -> why it cannot train exactly under CP today, written by hand after reading the check's
  diagnosis (the sweep's own one-line diagnosis is used when a class has none here).
"""

from __future__ import annotations

from typing import Any

CONFIG: dict[str, dict[str, Any]] = {
    # Cosmos Predict 2.5: 16 latent channels + the condition-mask channel forward() concatenates, no learnable
    # position embedding, the text projected by crossattn_proj. Its padding-mask path resizes with torchvision (not
    # installed); the padding mask is one more input channel, split with the tokens like the others.
    "CosmosTransformer3DModel": {
        "concat_padding_mask": False,
        "in_channels": 17,
        "extra_pos_embed_type": None,
        "use_crossattn_projection": True,
    },
    # A UNet-style 2-D transformer: continuous inputs need in_channels (default None); groups must divide them.
    "DreamLiteTransformer2DModel": {"in_channels": 8, "norm_num_groups": 4, "cross_attention_dim": 24},
    # The text tower's width must split into its heads (5 x 8).
    "Krea2Transformer2DModel": {"text_hidden_dim": 40},
    # RoPE axes: default None means (head dim / 2) x 2 of the full-size model; 8 + 8 = the tiny head dim 16.
    "PRXTransformer2DModel": {"axes_dim": [8, 8]},
    # Rotary width: half of the full model's head dim 64; the tiny head dim is 16.
    "MiniMaxMusic3Transformer1DModel": {"rotary_dim": 16},
    # Multimodal RoPE sections (t, h, w): half the tiny head dim 16, in the full model's proportions.
    "Ideogram4Transformer2DModel": {"mrope_section": [4, 2, 2]},
    # Block indices that take the control stream: must exist in the 2-block tiny model.
    "WanVACETransformer3DModel": {"vace_layers": [0, 1], "vace_in_channels": 8},
    # HunyuanImage 2.1's second text encoder (ByT5 glyph text): a width turns on its context_embedder_2.
    "HunyuanImageTransformer2DModel": {"text_embed_2_dim": 32},
    # Bria-Fibo 2: the one cross-attention (injection) block must exist in the 2-block tiny model; the gist-token
    # schedule cut by 64 like the text lengths it maps (256..512 gist tokens, in steps of 64, for 256..2048 text
    # tokens): the 11- and 8-token prompts both get 6 gist tokens, so the main sequence is 6 + 35 = 41 tokens.
    "BriaFibo2Transformer2DModel": {
        "injection_layer_ids": [1],
        "min_num_gist_tokens": 4,
        "max_num_gist_tokens": 8,
        "gist_step": 2,
        "gist_min_text_len": 4,
        "gist_max_text_len": 32,
    },
    # Wan Animate's face path at a tiny size: the motion encoder takes 8 x 8 face crops (its conv pyramid needs a
    # channel width per power of two down to 4), small motion and face-encoder widths, the CLIP image width; a face
    # adapter after every second block, so the 2-block tiny model has one (after block 0), as the real one has one
    # after blocks 0, 5, ..., 35 of 40.
    "WanAnimateTransformer3DModel": {
        "image_dim": 32,
        "motion_encoder_size": 8,
        "motion_encoder_channel_sizes": {"4": 16, "8": 16},
        "motion_style_dim": 32,
        "motion_dim": 8,
        "motion_encoder_dim": 32,
        "face_encoder_hidden_dim": 32,
        "inject_face_latents_blocks": 2,
    },
}

INPUTS: dict[str, dict[str, Any]] = {
    # ZImagePipeline hands the transformer one caption tensor per prompt, its padding dropped
    # (`prompt_embeds[i][prompt_masks[i]]`): captions of different lengths, which the unified sequence pads and masks.
    "ZImageTransformer2DModel": {"cap_feats": {"shape": ["B", "L", 24], "kind": "masked_list"}},
    # Frame-major latents (B, F, C, H, W).
    "AnyFlowTransformer3DModel": {
        "hidden_states": {"shape": ["B", "F", 16, 2, 14]},
        "timestep": {"shape": ["B", "F"], "kind": "timestep"},  # one timestep per frame
        "r_timestep": {"shape": ["B", "F"], "kind": "timestep"},
    },
    # As AnyFlow, in one chunk of all F frames (per-chunk frame counts).
    "AnyFlowFARTransformer3DModel": {
        "hidden_states": {"shape": ["B", "F", 16, 2, 14]},
        "timestep": {"shape": ["B", "F"], "kind": "timestep"},
        "r_timestep": {"shape": ["B", "F"], "kind": "timestep"},
        "chunk_partition": [5],
    },
    # Prior (AR-model) token ids per image token, none dropped; SDXL-style target size and crop (B, 2).
    "GlmImageTransformer2DModel": {
        "prior_token_id": {"shape": ["B", "S"], "kind": "ids"},
        "prior_token_drop": {"shape": ["B"], "kind": "false"},
        "target_size": {"shape": ["B", 2]},
        "crop_coords": {"shape": ["B", 2]},
    },
    # Patchified latents (B, patches, C, pt, ph, pw) and each sample's (t, h, w) grid of its one component.
    "JoyImageEditPlusTransformer3DModel": {
        "hidden_states": {"shape": ["B", "S", 16, 1, 2, 2]},
        "shape_list": [[(5, 1, 7)], [(5, 1, 7)]],
    },
    # One hidden-state tensor per text-encoder layer the model mixes in.
    "BriaFiboTransformer2DModel": {"text_encoder_layers": {"shape": [4, "B", "L", 24], "list": True}},
    # BriaFibo2Pipeline's call: the text features as bundles (B, 1 + len(injection_layer_ids), L, C) (the Perceiver's
    # first, then one per injection block), the text mask boolean, the noise level in [0, 1].
    "BriaFibo2Transformer2DModel": {
        "encoder_hidden_states": {"shape": ["B", 2, "L", 24]},
        "encoder_attention_mask": {"shape": ["B", "L"], "kind": "bool_mask"},
        "timestep": {"shape": ["B"], "kind": "timestep", "scale": 1.0},
    },
    # Channels-last video latents (B, F, H, W, C); its masks are boolean (the processor hands them to SDPA as they are).
    "Kandinsky6Transformer3DModel": {
        "hidden_states": {"shape": ["B", "F", 2, 14, 33]},  # latents, condition latents and their mask: 16 + 16 + 1
        "encoder_attention_mask": {"shape": ["B", "L"], "kind": "bool_mask"},
    },
    # Channels-last video latents (B, F, H, W, C): the low-resolution latents, the noisy ones and a mask, 64 + 64 + 1.
    # NABLA sparse attention groups 8 x 8 tiles of tokens, so the token grid is one 8 x 8 frame (64 tokens).
    "Kandinsky6SRTransformer3DModel": {"hidden_states": {"shape": ["B", 1, 8, 8, 129]}},
    # Channels-last video latents (B, F, H, W, C); RoPE position indices per axis of the patched grid, and per text
    # token.
    "Kandinsky5Transformer3DModel": {
        "hidden_states": {"shape": ["B", "F", 2, 14, 4]},
        "visual_rope_pos": {"shape": ["F", "H", "W"], "kind": "aranges"},
        "text_rope_pos": {"shape": ["L"], "kind": "arange"},
    },
    # Channels-first audio latents (B, C, T), and frame-aligned conditioning (B, T, C).
    "MiniMaxMusic3Transformer1DModel": {
        "hidden_states": {"shape": ["B", 128, "S"]},
        "encoder_hidden_states": {"shape": ["B", "S", 24]},
    },
    # Position ids (t, h, w) of the packed [text | image] sequence, one row per token.
    # Its text is the stack of the LLM's hidden states (B, L, num_text_layers, C).
    "Krea2Transformer2DModel": {
        "position_ids": {"shape": ["LS", 3], "kind": "positions"},
        "encoder_hidden_states": {"shape": ["B", "L", 1, 40]},
        "encoder_attention_mask": {"shape": ["B", "L"], "kind": "bool_mask"},  # handed to SDPA as it is
    },
    # One packed sequence: text features ride on the same tokens as the image (B, S, C_text); per-token role tags
    # (2: output image), one segment (every token attends to every other), (t, h, w) positions.
    "Ideogram4Transformer2DModel": {
        "encoder_hidden_states": {"shape": ["B", "S", 24]},
        "position_ids": {"shape": ["B", "S", 3], "kind": "positions"},
        "segment_ids": {"shape": ["B", "S"], "kind": "ids"},
        "indicator": {"shape": ["B", "S"], "kind": "fill", "value": 2},
    },
    # The global duration embedding (B, global_cond_dim).
    "StableAudio3DiTModel": {
        "hidden_states": {"shape": ["B", 256, "S"]},  # channels-first audio latents (B, io_channels, T)
        "global_hidden_states": {"shape": ["B", 24]},
    },
    # A second timestep, and context latents concatenated to the latents on channels: 64 + 128 = in_channels 192.
    "AceStepTransformer1DModel": {
        "hidden_states": {"shape": ["B", "S", 64]},
        "encoder_hidden_states": {"shape": ["B", "L", 80]},  # already at the model width
        "timestep_r": {"shape": ["B"], "kind": "timestep"},
        "context_latents": {"shape": ["B", "S", 128]},
    },
    # QwenImage21Pipeline's text-to-image call: packed latents (B, h * w, 64) of a (1, 4, 8) latent grid (the
    # transformer takes them unpatched; each VLM image slot stands for 2 x 2 latent tokens, so h * w is a multiple of
    # 4), img_mask over the VLM sequence with the pipeline's appended target slots (11 text tokens, then 32 / 4 = 8
    # slots: the joint sequence is 11 + 32 = 43 tokens), the timestep in [0, 1] (t / 1000). img_mask needs a bool
    # row of runs ([length, value] each: the `runs` kind, which sweep._from_spec does not have yet).
    "QwenImage21Transformer2DModel": {
        "hidden_states": {"shape": ["B", 32, 64]},
        "img_shapes": [[(1, 4, 8)], [(1, 4, 8)]],
        "img_mask": {"shape": ["B", 19], "kind": "runs", "runs": [["L", False], [8, True]]},
        "timestep": {"shape": ["B"], "kind": "timestep", "scale": 1.0},
    },
    # The control latents (B, vace_in_channels, F, H, W).
    "WanVACETransformer3DModel": {"control_hidden_states": {"shape": ["B", 8, "F", 2, 14]}},
    # Cosmos Predict 2.5 as its pipeline calls it: latents and the condition mask (B, 1, F, H, W) apart, and one
    # timestep (sigma) per latent frame (B, 1, F, 1, 1), which forward() expands to a per-token modulation.
    "CosmosTransformer3DModel": {
        "hidden_states": {"shape": ["B", 16, "F", 2, 14]},
        "condition_mask": {"shape": ["B", 1, "F", 2, 14]},
        "timestep": {"shape": ["B", 1, "F", 1, 1], "kind": "timestep", "scale": 1.0},
    },
    # PRX's text padding mask is named attention_mask (B, L_txt); the pipeline passes it.
    "PRXTransformer2DModel": {"attention_mask": {"shape": ["B", "L"], "kind": "bool_mask"}},
    # HunyuanImage 2.1's ByT5 text and its padded mask: forward() reorders the two texts (kept tokens first) into one
    # text sequence and its key mask before the blocks.
    "HunyuanImageTransformer2DModel": {
        "encoder_hidden_states_2": {"shape": ["B", "L", 32]},
        "encoder_attention_mask_2": {"shape": ["B", "L"], "kind": "bool_mask"},
    },
    # The SANA-WM refiner over one AR block, as its pipeline calls it less the KV cache: packed tokens (B, S, C), one
    # timestep per token (B, S), and the caller's interleaved video RoPE, a (cos, sin) pair of (B, S, heads x head
    # dim) (build_rotary_emb_for_absolute_positions; random tables serve the check). No KV cache: its sliding-window
    # modes are not covered (cp_plans/sanawmltx2refiner.yaml).
    "SanaWMLTX2RefinerTransformer3DModel": {
        "hidden_states": {"shape": ["B", "S", 128]},
        "timestep": {"shape": ["B", "S"], "kind": "timestep"},
        "video_rotary_emb": ({"shape": ["B", "S", 80]}, {"shape": ["B", "S", 80]}),
    },
    # SANA-WM as its pipeline calls it: one timestep per latent frame (B, 1, T) (LTX style), the text with a singleton
    # dim (B, 1, L, C).
    "SanaWMTransformer3DModel": {
        "timestep": {"shape": ["B", 1, "F"], "kind": "timestep"},
        "encoder_hidden_states": {"shape": ["B", 1, "L", 24]},
    },
    # WanAnimatePipeline's call: hidden_states are the noisy latents and the reference latents (mask + reference
    # image + previous-segment frames) on channels, 16 + 20 = 36, over F = T + 1 frames (the reference frame first);
    # the pose latents (B, 16, T, H, W) cover the T frames after it; the face video in pixels, 4 (T - 1) + 1 = 13
    # frames of 8 x 8 crops, which the face encoder's two stride-2 convs bring to T frames (+ 1 zero frame = F, one
    # motion frame per latent frame); CLIP features of the reference image (B, tokens, image_dim).
    "WanAnimateTransformer3DModel": {
        "pose_hidden_states": {"shape": ["B", 16, 4, 2, 14]},
        "face_pixel_values": {"shape": ["B", 3, 13, 8, 8]},
        "encoder_hidden_states_image": {"shape": ["B", 4, 32]},
    },
}

LAYOUT: dict[str, str] = {
    "SanaWMLTX2RefinerTransformer3DModel": "packed",
    "AnyFlowTransformer3DModel": "video",
    "AnyFlowFARTransformer3DModel": "video",
    "GlmImageTransformer2DModel": "image",
    "BriaFibo2Transformer2DModel": "image",
    "MiniMaxMusic3Transformer1DModel": "packed",
    "Krea2Transformer2DModel": "packed",
    "Ideogram4Transformer2DModel": "packed",
    "AceStepTransformer1DModel": "packed",
    "StableAudio3DiTModel": "packed",
    "QwenImage21Transformer2DModel": "packed",
    "Kandinsky5Transformer3DModel": "video",
    "Kandinsky6Transformer3DModel": "video",
    "Kandinsky6SRTransformer3DModel": "video",
}

REASONS: dict[str, str] = {
    "AnyFlowFARTransformer3DModel": "its attention is FlexAttention with a chunk-causal block mask over the frames, "
    "and torch runs no FlexAttention backward on CPU: the serial training step of the check fails before any CP "
    "(NotImplementedError), so the plan cannot be verified here; refused until it is checked on a GPU",
    "DreamLiteTransformer2DModel": "every block adds a sinusoidal position embedding (its pos_embed, "
    "SinusoidalPositionalEmbedding) to its tokens by their index in the tensor it receives: a rank's shard gets "
    "positions 0 .. S/CP instead of its own (measured: the first block's output differs, rel 0.5); the core has no "
    "offset-aware position embedding. (Its output tail, a reshape to the image grid before a Conv2d proj_out, is "
    "what replicated_tail serves.)",
    "NucleusMoEImageTransformer2DModel": "its attention's keys are [image | text] built inside the processor, and "
    "forward() builds the joint key mask [ones(local image) | whole text mask] inline and hands it to every block "
    "inside attention_kwargs, which no split reaches: with the text whole (the draft's local attention) each rank "
    "attends to its own image shard only (measured: proj_out gather differs, rel 3e-1); with the text split per block "
    "the mask's columns do not match the keys. And its MoE layers route by expert choice (each expert takes its "
    "top-capacity tokens over the whole sequence), which a sequence shard cannot reproduce",
    "Ideogram4Transformer2DModel": "forward() builds a pairwise (B, 1, S, S) attention mask from segment_ids over "
    "the packed sequence and hands it to every block: a split along one dim cannot serve a mask with a query and a key "
    "dim, and the draft left it whole, so the ranks disagreed on a collective's sizes (gloo aborted a rank)",
    "Kandinsky6SRTransformer3DModel": "its video self-attention is NABLA sparse attention: a flex BlockMask the "
    "processor picks per call from the pooled queries and keys of the whole sequence (a cumulative-attention "
    "threshold over 8 x 8 token tiles, plus a sliding-tile window), and torch runs no FlexAttention backward on CPU: "
    "the serial training step of the check fails before any CP (NotImplementedError), so no plan can be verified "
    "here; refused until it is checked on a GPU",
    "Cosmos3OmniTransformer": "one packed, unbatched joint sequence of text, vision, sound and action tokens placed "
    "by index tensors, with a causal understanding prefix (is_causal=True, which the CP attention kernels refuse) "
    "next to the bidirectional generation pathway and grouped-query attention; the class carries its own CP seams "
    "(_cp_shard_fn / _cp_gather_fn and a CP attention processor outside the model), and its ten required index "
    "inputs have no spec here",
    "MiniMaxMusic3RVQDepthDecoder": "not a sequence to split: a causal language model over the residual RVQ "
    "codebooks within one audio frame (at most max_position_embeddings = 16 steps, absolute positions by index), "
    "with causal attention, which the CP attention kernels refuse; its forward() takes only inputs_embeds (no "
    "return_dict), so the sweep's call fails before any check",
    "RFD4ProteinaTransformer": "pair-biased attention: a (B, N, N, C) pair representation biases every attention's "
    "logits and is updated between layers by triangular multiplications over both token dims, which a split of one "
    "token dim cannot serve (as Ideogram 4's pairwise mask); its topology features come as a dict of tensors "
    "(conditioning, with is_in_context_conditioning required), which has no spec here",
    "SanaWMTransformer3DModel": "its blocks read the tokens as a (frames, tokens per frame) grid: per-frame "
    "modulation reshapes them to (B, T, -1, C) (the first block fails on a shard: its tokens are not whole frames), "
    "the self-attention is a chunked bidirectional Gated DeltaNet recurrence over the frames (a softmax attention "
    "every 4th block; neither calls dispatch_attention_fn, only the text cross-attention does), and the feed-forward "
    "(GLUMBConvTemp) convolves over the (T, H, W) grid: a sequence shard is not a grid",
    "SanaVideoTransformer3DModel": "every block's feed-forward (GLUMBConv) reshapes the tokens to the (frames, height, "
    "width) grid from forward()'s sizes and convolves over it: a sequence shard is not a grid (a halo exchange the "
    "core does not have)",
}
