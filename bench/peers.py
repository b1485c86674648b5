"""train.estimate against GPU memory that peers published for the same setting: numbers nobody here wrote.

    python -m bench.peers

Each row is one published measurement (its source, the setting as the peer states it) and the recipe overrides that
reproduce that setting here on one GPU (no CP, no FSDP sharding: what the peers ran). Printed: their figure, our
predicted peak, the ratio, and what could not be matched. The peers' figures are `max_memory_reserved` (the caching
allocator's reserve included) in GiB as their scripts print it (`/ 2**30`), or the GB their docs state. No test
holds the ratios to a band: the settings match only as far as each row's last column says (docs/performance.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LORA_QKVO = "finetune.lora_targets=[to_q, to_k, to_v, to_out.0]"


@dataclass(frozen=True)
class Peer:
    name: str
    source: str
    setting: str
    published_gib: float
    recipe: str
    sets: tuple[str, ...] = field(default_factory=tuple)
    unmatched: str = ""


FT = "finetrainers docs/training/{}.md (read at zqh0253/finetrainers {}): its memory table, with precomputation"
PEERS = [
    Peer(
        name="finetrainers: HunyuanVideo LoRA",
        source=FT.format("hunyuan_video", "7b569da") + ", max_memory_reserved after epoch 1",
        setting="13B, LoRA r128 on to_q/k/v/out, 49×512×768, batch 1, gradient checkpointing, AdamW, bf16, 1 GPU",
        published_gib=42.387,
        recipe="recipes/hunyuan_video/13b_lora.yaml",
        sets=("parallel.cp=1", "finetune.lora_rank=128", "finetune.lora_alpha=128", LORA_QKVO, "data.num_frames=49",
              "data.height=512", "data.width=768", "train.gradient_checkpointing=true", "train.batch_size=1"),
        unmatched="their text encoders freed after precomputation; no validation",
    ),
    Peer(
        name="finetrainers: LTX-Video LoRA",
        source=FT.format("ltx_video", "6716ccf") + ", max_memory_reserved after epoch 1",
        setting="2B, LoRA r128 on to_q/k/v/out, 49×512×768, batch 1, gradient checkpointing, AdamW, bf16, 1 GPU",
        published_gib=10.916,
        recipe="recipes/ltx/2b_full.yaml",
        sets=("parallel.cp=1", "finetune.method=lora", "finetune.lora_rank=128", "finetune.lora_alpha=128",
              LORA_QKVO, "checkpoint.export=auto", "data.num_frames=49", "data.height=512", "data.width=768",
              "train.gradient_checkpointing=true", "train.batch_size=1"),
        unmatched="no validation",
    ),
    Peer(
        name="musubi-tuner: Qwen-Image LoRA",
        source="kohya-ss/musubi-tuner docs/qwen_image.md, bf16 training VRAM, as issue 21 quotes it",
        setting="20B, LoRA, 1024×1024, batch 1, gradient checkpointing, bf16 base, 1 GPU",
        published_gib=42.0 * 1e9 / 2**30,
        recipe="recipes/qwenimage/20b_lora.yaml",
        sets=("parallel.cp=1", "data.height=1024", "data.width=1024", "train.gradient_checkpointing=true",
              "train.batch_size=1"),
        unmatched="their LoRA rank and targets are musubi's defaults (ours: the recipe's); GB read as 10^9 bytes",
    ),
]  # fmt: skip


def predicted_gib(peer: Peer) -> float:
    from train.config import load_recipe
    from train.estimate import GIB, estimate

    return estimate(load_recipe(REPO / peer.recipe, peer.sets), 1, "cuda").peak / GIB


def main() -> None:
    print("| peer measurement | setting | published (GiB) | ours (GiB) | ours / published | not matched |")
    print("|---|---|---|---|---|---|")
    for peer in PEERS:
        ours = predicted_gib(peer)
        print(f"| {peer.name} ({peer.source}) | {peer.setting} | {peer.published_gib:.1f} | {ours:.1f} | "
              f"{ours / peer.published_gib:.2f} | {peer.unmatched} |")  # fmt: skip


if __name__ == "__main__":
    main()
