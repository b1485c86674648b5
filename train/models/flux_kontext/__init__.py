"""FLUX.1 Kontext (FluxTransformer2DModel / FluxKontextPipeline): FLUX.1 with the input image's latents in the
sequence.

Cache: FLUX.1's (``latents`` (C, H, W) the edited (target) image, ``prompt_embeds``, ``pooled_embeds``,
``prompt_mask``, optional ``guidance``) plus ``reference_latents`` (C, H', W'): the input image as
``FluxKontextPipeline.__call__`` prepares it (``_auto_resize``: the ``PREFERRED_KONTEXT_RESOLUTIONS`` entry closest in
aspect ratio, floored to multiples of 16, whatever the target size), VAE posterior mode (``_encode_vae_image``: argmax,
not sampled), ``(z - shift_factor) * scaling_factor``. The prompt is encoded as FLUX.1's (no image). Reference images
come from ``data.reference_column``; an item without a readable one is bad (``no_reference`` / ``bad_reference``).

Forward kwargs, as the Kontext pipeline's denoising loop: ``hidden_states = cat([target packed 2x2, reference packed
2x2], dim=1)``, ``img_ids = cat([latent ids, image ids], dim=0)`` where the image ids are the reference grid's latent
ids with coordinate 0 set to 1, ``txt_ids``, ``pooled_projections``, ``guidance`` (3.5 unless the cache has one),
``timestep = sigma``. The output is cut to the first ``H/2 * W/2`` tokens (``noise_pred[:, :latents.size(1)]``): the
loss covers the target only; the dynamic shift's ``image_seq_len`` is the target's token count, as in the pipeline.

Under CP the FLUX.1 plan (cp_plans/flux.yaml) shards the concatenated sequence and its position ids alike and gathers
the whole sequence before the cut.

Not covered: ``_auto_resize=False`` (the input image at its own size), IP-Adapter inputs.
"""

from .encoder import FluxKontextEncoder as Encoder
from .spec import SPEC
from .tiny import build_tiny

__all__ = ["SPEC", "Encoder", "build_tiny"]
