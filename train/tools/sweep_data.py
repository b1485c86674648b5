"""Hand-given facts for the CP sweep (train/tools/sweep.py), as data: what the rules cannot derive for a class.

Every entry says why it is needed. The sweep derives each class's tiny config from its ``__init__`` signature and its
forward inputs from its ``forward`` signature and that config; these tables only correct what that derivation gets
wrong. Nothing here is code: a class is a key, its values are plain data.

* ``CONFIG``: class -> config values set after the derivation (a hidden-width key the rules do not know, a RoPE
  section of an odd layout, a list of block indices that must fit the tiny block count).
* ``INPUTS``: class -> forward-argument values or shapes set after the synthesis. A value is a tensor spec
  ``{"shape": [...], "kind": "randn" | "ones" | "ids" | "timestep"}`` with sizes written as the names in
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
    # One hidden-state tensor per text-encoder layer the model mixes in.
    "BriaFiboTransformer2DModel": {"text_encoder_layers": {"shape": [4, "B", "L", 24], "list": True}},
    # Its masks are boolean (the processor hands them to SDPA as they are).
    "Kandinsky6Transformer3DModel": {"encoder_attention_mask": {"shape": ["B", "L"], "kind": "bool_mask"}},
    # Channels-first audio latents (B, C, T), and frame-aligned conditioning (B, T, C).
    "MiniMaxMusic3Transformer1DModel": {
        "hidden_states": {"shape": ["B", 128, "S"]},
        "encoder_hidden_states": {"shape": ["B", "S", 24]},
    },
    # Which VLM tokens are image slots: none in a text-only prompt.
    "QwenImage21Transformer2DModel": {"img_mask": {"shape": ["B", "L"], "kind": "false"}},
    # The control latents (B, vace_in_channels, F, H, W).
    "WanVACETransformer3DModel": {"control_hidden_states": {"shape": ["B", 8, "F", 2, 14]}},
}

LAYOUT: dict[str, str] = {"AnyFlowTransformer3DModel": "video", "MiniMaxMusic3Transformer1DModel": "packed"}

REASONS: dict[str, str] = {
    "DreamLiteTransformer2DModel": "forward() reshapes the blocks' output to an image grid before its Conv2d proj_out, "
    "so no module after the blocks outputs the token sequence: a gather at the last block is a gather inside a "
    "repeated block, and leaves proj_out replicated (its gradient CP x too large)",
    "Flux3Transformer2DModel": "the drafter takes the first repeated block as the sequence, but Flux3 runs text-mode "
    "blocks (txt_mode_blocks) before it forms the image sequence in mode_blocks.image: needs a hand-written plan, "
    "not written yet",
    "MiniMaxMusic3Transformer1DModel": "forward() prepends a time token to the sequence and slices it off between the "
    "last block and proj_out: gathering the last block's output leaves proj_out replicated (measured: its gradient "
    "CP x too large), and the core has no split form for 'the sequence less its first token' to split proj_out's "
    "input again",
    "SanaVideoTransformer3DModel": "every block's feed-forward (GLUMBConv) reshapes the tokens to the (frames, height, "
    "width) grid from forward()'s sizes and convolves over it: a sequence shard is not a grid (a halo exchange the "
    "core does not have)",
}
