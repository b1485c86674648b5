"""Hand-given facts for the CP sweep (train/tools/sweep.py), as data: what the rules cannot derive for a class.

Every entry says why it is needed. The sweep derives each class's tiny config from its ``__init__`` signature and its
forward inputs from its ``forward`` signature and that config; these tables only correct what that derivation gets
wrong. Nothing here is code: a class is a key, its values are plain data.

* ``CONFIG``: class -> config values set after the derivation (a hidden-width key the rules do not know, a RoPE
  section of an odd layout, a list of block indices that must fit the tiny block count).
* ``INPUTS``: class -> forward-argument values or shapes set after the synthesis. A value is a tensor spec
  ``{"shape": [...], "kind": "randn" | "ones" | "ids" | "timestep" | "fill" | "positions" | "arange" |
  "aranges"}`` (``fill``: every entry ``"value"``; ``positions``: token i has position i on every axis of the last
  dim; ``arange``: 0..n-1; ``aranges``: a tuple of one arange per size) with sizes written as the names in
  :data:`train.tools.sweep.SIZES` (``"B"``, ``"L"``, ...) or integers; or a plain value (int, tuple, None).
* ``LAYOUT``: class -> which hidden_states layout the forward takes, when trying the candidates in order would pick
  a wrong one that happens to run.
* ``REASONS``: class -> why it cannot train exactly under CP today, written by hand after reading the check's
  diagnosis (the sweep's own one-line diagnosis is used when a class has none here).
"""

from __future__ import annotations

from typing import Any

CONFIG: dict[str, dict[str, Any]] = {
    # Its padding-mask path resizes with torchvision (not installed); the mask is optional input.
    "CosmosTransformer3DModel": {"concat_padding_mask": False},
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
}

INPUTS: dict[str, dict[str, Any]] = {
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
    # Channels-last video latents (B, F, H, W, C); its masks are boolean (the processor hands them to SDPA as they are).
    "Kandinsky6Transformer3DModel": {
        "hidden_states": {"shape": ["B", "F", 2, 14, 33]},  # latents, condition latents and their mask: 16 + 16 + 1
        "encoder_attention_mask": {"shape": ["B", "L"], "kind": "bool_mask"},
    },
    # Channels-last video latents (B, F, H, W, C): the low-resolution latents, the noisy ones and a mask, 64 + 64 + 1.
    "Kandinsky6SRTransformer3DModel": {"hidden_states": {"shape": ["B", "F", 1, 7, 129]}},
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
    # Which VLM tokens are image slots: none in a text-only prompt.
    "QwenImage21Transformer2DModel": {"img_mask": {"shape": ["B", "L"], "kind": "false"}},
    # The control latents (B, vace_in_channels, F, H, W).
    "WanVACETransformer3DModel": {"control_hidden_states": {"shape": ["B", 8, "F", 2, 14]}},
}

LAYOUT: dict[str, str] = {
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
    "DreamLiteTransformer2DModel": "forward() reshapes the blocks' output to an image grid before its Conv2d proj_out, "
    "so no module after the blocks outputs the token sequence: a gather at the last block is a gather inside a "
    "repeated block, and leaves proj_out replicated (its gradient CP x too large)",
    "Ideogram4Transformer2DModel": "forward() builds a pairwise (B, 1, S, S) attention mask from segment_ids over "
    "the packed sequence and hands it to every block: a split along one dim cannot serve a mask with a query and a key "
    "dim, and the draft left it whole, so the ranks disagreed on a collective's sizes (gloo aborted a rank)",
    "MiniMaxMusic3Transformer1DModel": "forward() prepends a time token to the sequence and slices it off between the "
    "last block and proj_out: gathering the last block's output leaves proj_out replicated (measured: its gradient "
    "CP x too large), and the core has no split form for 'the sequence less its first token' to split proj_out's "
    "input again",
    "SanaVideoTransformer3DModel": "every block's feed-forward (GLUMBConv) reshapes the tokens to the (frames, height, "
    "width) grid from forward()'s sizes and convolves over it: a sequence shard is not a grid (a halo exchange the "
    "core does not have)",
}
