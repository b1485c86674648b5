"""ChronoEdit's training spec: Wan 2.1 image-to-video's (first-frame mask and condition latents concatenated in
channels), with ChronoEdit's classes and flow shift."""

from __future__ import annotations

from train.models.spec import FamilySpec, ShiftSpec, frozen, sigma_times_1000
from train.models.wan.spec import count_tokens, unpack_output  # the same output layout as Wan
from train.models.wan_i2v.spec import build_inputs  # Wan I2V's inputs: ChronoEdit is Wan2.1-I2V-14B

# UniPC with flow sigmas like Wan; the official ChronoEdit inference (nv-tlabs/ChronoEdit
# scripts/run_inference_diffusers.py) sets `flow_shift=5.0` (720p).
SCHEDULER_CONFIG = frozen(
    num_train_timesteps=1000,
    prediction_type="flow_prediction",
    use_flow_sigmas=True,
    flow_shift=5.0,
)

SPEC = FamilySpec(
    name="chronoedit",
    transformer_class="ChronoEditTransformer3DModel",
    pipeline_class="ChronoEditPipeline",
    vae_class="AutoencoderKLWan",
    latent_kind="video",
    # Wan attention projections; `attn2.add_k_proj` / `add_v_proj` (image K/V) stay frozen, as in the Wan I2V recipes.
    lora_targets=("to_q", "to_k", "to_v", "to_out.0"),
    shift=ShiftSpec(
        kind="static",
        scheduler_class="UniPCMultistepScheduler",
        scheduler_config=SCHEDULER_CONFIG,
        shift=SCHEDULER_CONFIG["flow_shift"],
    ),
    build_inputs=build_inputs,
    unpack_output=unpack_output,
    timestep_from_sigma=sigma_times_1000,
    count_tokens=count_tokens,  # the noised latents' tokens (the condition channels ride along in the same tokens)
    batch_keys=("latents", "prompt_embeds", "condition_latents", "image_embeds"),
)
