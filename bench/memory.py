"""Activation bytes saved for backward per rank under Ulysses CP 1, 2 and 4 (Wan and Flux, tiny and mid-size).

Every tensor autograd saves for backward during the forward (and the loss) passes through a
`torch.autograd.graph.saved_tensors_hooks` pack hook; distinct storages are counted once (by
`untyped_storage().data_ptr()`, summing the storage's `nbytes`), parameters excluded. A forward pre-hook / forward
hook pair on every transformer block switches the attribution to "blocks" while a block runs; everything else
("rest": patch embedding of the whole latent, condition/time/text embedders, RoPE tables, norm_out/proj_out, the
gathered output and the loss) is reported separately. Saved tensors are all packed during the forward, so the
forward + loss is what is measured; one backward per configuration checks that the graph is complete.

Run: python -m bench.memory
"""

from __future__ import annotations

import time

import torch

from bench._common import fmt_bytes, header, table

WORLDS = (1, 2, 4)
CASES = (("tiny", "wan"), ("tiny", "flux"), ("mid", "wan"), ("mid", "flux"))  # (size, model)

# Mid-size configs: 8 heads x 32, 4 blocks, 3072 media tokens (divisible by 2 and 4), fp32.
MID = {
    "wan": dict(
        config=dict(patch_size=(1, 2, 2), num_attention_heads=8, attention_head_dim=32, in_channels=16,
                    out_channels=16, text_dim=64, freq_dim=64, ffn_dim=1024, num_layers=4, cross_attn_norm=True,
                    qk_norm="rms_norm_across_heads"),
        latent=(1, 16, 4, 64, 48),  # (B, C, F, H, W) -> 4 x 32 x 24 = 3072 tokens
        text=64,
    ),
    "flux": dict(
        config=dict(patch_size=1, in_channels=64, num_layers=2, num_single_layers=2, attention_head_dim=32,
                    num_attention_heads=8, joint_attention_dim=64, pooled_projection_dim=64, guidance_embeds=False,
                    axes_dims_rope=(8, 12, 12)),
        grid=(48, 64),  # 3072 image tokens
        text=128,
    ),
}  # fmt: skip


def _mid_model(name: str):
    from diffusers import FluxTransformer2DModel, WanTransformer3DModel

    cls = WanTransformer3DModel if name == "wan" else FluxTransformer2DModel
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return cls(**MID[name]["config"]).train()


def _mid_inputs(name: str) -> dict:
    gen = torch.Generator().manual_seed(1)
    spec = MID[name]
    if name == "wan":
        B = spec["latent"][0]
        return {
            "hidden_states": torch.randn(spec["latent"], generator=gen),
            "encoder_hidden_states": torch.randn(B, spec["text"], spec["config"]["text_dim"], generator=gen),
            "timestep": torch.tensor([500.0]),
        }
    h, w = spec["grid"]
    cfg = spec["config"]
    img_ids = torch.zeros(h, w, 3)
    img_ids[..., 1] = torch.arange(h)[:, None]
    img_ids[..., 2] = torch.arange(w)[None, :]
    return {
        "hidden_states": torch.randn(1, h * w, cfg["in_channels"], generator=gen),
        "encoder_hidden_states": torch.randn(1, spec["text"], cfg["joint_attention_dim"], generator=gen),
        "pooled_projections": torch.randn(1, cfg["pooled_projection_dim"], generator=gen),
        "timestep": torch.tensor([0.5]),
        "img_ids": img_ids.reshape(h * w, 3),
        "txt_ids": torch.zeros(spec["text"], 3),
    }


def _blocks(model) -> list[torch.nn.Module]:
    names = ("blocks", "transformer_blocks", "single_transformer_blocks")
    return [b for n in names for b in getattr(model, n, [])]


class SavedBytes:
    """Distinct storages saved for backward, attributed to "blocks" or "rest" (first region that saved them)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.region = "rest"
        self.seen: dict[int, tuple[int, str]] = {}
        self.keep: list[torch.Tensor] = []  # saved tensors stay alive anyway; keeping them rules out pointer reuse
        self.handles = []
        for block in _blocks(model):
            self.handles.append(block.register_forward_pre_hook(lambda *_: setattr(self, "region", "blocks")))
            self.handles.append(block.register_forward_hook(lambda *_: setattr(self, "region", "rest")))

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in self.params and ptr not in self.seen:
            self.seen[ptr] = (storage.nbytes(), self.region)
            self.keep.append(t)
        return t

    def totals(self) -> dict[str, int]:
        out = {"blocks": 0, "rest": 0}
        for nbytes, region in self.seen.values():
            out[region] += nbytes
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.keep.clear()


def _rank_fn(rank: int, world: int, cases: tuple[tuple[str, str], ...] = CASES, backward: bool = True) -> dict:
    """Saved bytes per (size, model) on this rank; world 1 is the serial run (no process group needed). The bytes
    are counted in the forward; `backward` (for the step time the table reports) adds nothing to them."""
    from torch.distributed.device_mesh import init_device_mesh

    from train.cp import enable_context_parallel
    from train.tools.tiny_models import build_inputs, build_model, make_loss, output_tensors

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("ring", "ulysses")) if world > 1 else None
    results = {}
    for size, name in cases:
        model = build_model(name) if size == "tiny" else _mid_model(name)
        inputs = build_inputs(name, seed=1) if size == "tiny" else _mid_inputs(name)
        if world > 1:
            enable_context_parallel(model, mesh=mesh)
        counter = SavedBytes(model)
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
            out = output_tensors(name, model(**inputs, return_dict=False))
            loss = make_loss(name, out)
        t_fwd = time.perf_counter() - t0
        totals = counter.totals()
        counter.close()
        if backward:
            loss.backward()
        results[(size, name)] = dict(totals, fwd_s=t_fwd, total_s=time.perf_counter() - t0)
        del model, out, loss
    return results


def _shape(size: str, name: str) -> str:
    if size == "tiny":
        from train.tools.tiny_models import tiny_config, token_counts

        cfg = tiny_config(name)
        layers = cfg["num_layers"] + cfg.get("num_single_layers", 0)
        toks = token_counts(name)
        media = toks.get("video", toks.get("image"))
        return f"{layers} blocks, 7x8 heads, {media} media + {toks['text']} text tokens, B=2"
    spec, cfg = MID[name], MID[name]["config"]
    layers = cfg["num_layers"] + cfg.get("num_single_layers", 0)
    return f"{layers} blocks, 8x32 heads, 3072 media + {spec['text']} text tokens, B=1"


def main() -> None:
    from train.tools.spawn import run_distributed

    t0 = time.perf_counter()
    print(header("Activation bytes saved for backward, per rank"))
    print("fp32, no gradient checkpointing. Max over ranks. 'blocks' = saved while a transformer block runs; 'rest' = "
          "everything else (embeddings of the whole input, text/time embedders, RoPE, norm_out/proj_out, gathered "
          "output, loss). Ratio = CP N / CP 1.\n")  # fmt: skip
    per_world = {w: run_distributed(_rank_fn, w) for w in WORLDS}
    rows = []
    for key in per_world[1][0]:
        base = per_world[1][0][key]
        for w in WORLDS:
            res = per_world[w]
            blocks = max(r[key]["blocks"] for r in res)
            rest = max(r[key]["rest"] for r in res)
            total = max(r[key]["blocks"] + r[key]["rest"] for r in res)
            secs = max(r[key]["total_s"] for r in res)
            rows.append([
                key[1], key[0], _shape(*key), w,
                fmt_bytes(blocks), f"{blocks / base['blocks']:.3f}",
                fmt_bytes(rest), f"{rest / base['rest']:.3f}",
                fmt_bytes(total), f"{total / (base['blocks'] + base['rest']):.3f}", f"{1 / w:.3f}", f"{secs:.2f}",
            ])  # fmt: skip
    print(table(["model", "size", "shape", "CP", "blocks", "blocks ratio", "rest", "rest ratio", "total",
                 "total ratio", "ideal 1/N", "fwd+bwd s (max rank)"], rows))  # fmt: skip
    print(f"\n(run time {time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    import bench.memory as _self  # so spawned ranks unpickle `bench.memory._rank_fn`

    _self.main()
