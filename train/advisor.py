"""Which layout is fastest? Every valid layout of a recipe on N GPUs (M nodes), ranked by predicted step time, with
train.estimate's memory per rank beside it.

    python -m train.estimate --recipe recipes/wan/14b_lora.yaml --gpus 64 --nodes 8 --layouts [--device h100]
    python -m train.advisor --calibrate-cpu    # re-measure the CPU/gloo profile (train/advisor_cpu.json)
    python -m train.advisor --cpu-check        # the CPU row: predicted vs measured CP step at 2/3/4 gloo ranks
    python -m train.advisor --sheet            # the scaling sheet of docs/performance.md (Wan 14B, HunyuanVideo 13B)

Layouts: every dp_replicate × dp_shard × cp_ring × Ulysses (cp = ring × Ulysses) whose product is the world size, with
Ulysses ≤ heads (ParallelConfig, train/config.py). A layout that train.estimate predicts over the device memory gets
the cheapest levers that fit (checkpointing every 2 / every block, activation offload, FSDP2 CPU offload); one that
fits no way is listed as not fitting. Layouts train different samples per step (batch_size per CP group × dp), so
the ranking key is the step time per sample; for one sample per step (dp = 1) that is the step time itself.

Time model, per rank and optimizer step (all ranks alike):
- compute: forward FLOPs of one sample = c + a·T + b·T² (T the tokens CP splits). a, b, c are counted by torch's
  FlopCounterMode on the family's calibration instance (its calibration.json, on the meta device) at three token
  counts and scaled to the real config (a, c by the blocks' matmul weights, b by heads × head dim × blocks): the
  matmuls and attention products the MFU formula of bench/gpu_h200.py counts (tests/test_advisor.py checks it
  against `wan_forward_flops` at the Wan 1.3B shape). Training = (1 + backward + recomputed) forwards, backward = 2
  forwards for full fine-tuning and 1 for LoRA (the frozen weights get no weight gradient: bench/gpu_trainer.py's
  3× / 2×). Split over cp (text/conditioning work c is not split), at the device's dense bf16 peak × SUSTAINED.
- Ulysses (u > 1): 4 all-to-alls per block and pass (q, k, v in, attention out back; the backward's 4 again), each
  sending (u-1)/u of b·T/cp·hidden·elem bytes. They do NOT overlap compute (the attention waits for them).
- ring (r > 1): per block, r-1 hops of the K/V chunk (2·b·T/r·hidden/u·elem bytes) forward, K/V + dK/dV backward;
  each hop overlaps the block attention on the chunk already there (train/cp/ring.py), so only max(0, hop -
  attention) is exposed. Ring attention runs at RING_EFFICIENCY of one kernel call, and its backward re-runs each
  block's forward (train/cp/ring.py: the op's context is filled per uneven block).
- FSDP2 (fsdp, shard group dp_shard × cp): all-gather of the parameters (compute dtype) in forward and again in
  backward (reshard_after_forward), reduce-scatter of the trained gradients, all-reduce over dp_replicate. These run
  on their own stream with one block prefetched and DO overlap compute: max(compute, FSDP traffic), plus one block's
  all-gather that nothing hides. fsdp false: the gradients all-reduced over the world, overlapped alike.
- levers: checkpointing recomputes its blocks' forward (and their Ulysses traffic); activation offload moves the saved
  block tensors over PCIe and back, overlapped with compute; FSDP2 CPU offload copies each gather's shards and the
  gradients over PCIe and runs AdamW on the host (not overlapped: conservative).
Placement: the mesh is ("dp_replicate", "dp_shard", "ring", "ulysses"), outermost first (train/parallel.py), so the
Ulysses group is u consecutive ranks, the ring strides by u, the FSDP group is dp_shard·cp consecutive ranks and the
replicas stride by dp_shard·cp; nodes hold gpus/nodes consecutive ranks. A collective whose peers share a node runs at
NVLink bandwidth; one that crosses nodes sends its off-node share at InfiniBand bandwidth per GPU (all-to-all, ring
hops), or, for FSDP's ring collectives, at min(NVLink, IB × members per node) (every GPU's NIC carries a channel).

Not modelled: kernel launch and Python overhead (small steps on a GPU are launch-bound: predictions are optimistic
there), the optimizer step on the GPU, the VAE/text encoders (not in a training step), network contention between
jobs, NCCL's algorithm switches at small messages (a fixed LATENCY per collective instead).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

GIB = 2**30
CPU_PROFILE = Path(__file__).resolve().parent / "advisor_cpu.json"

# Sustained fraction of the dense bf16 peak a training step's compute reaches: our own H200 measurement of a
# Wan-1.3B-size step without checkpointing, 37.0% (14040 tokens) and 40.9% (32760 tokens) MFU
# (docs/performance.md section 4, bench.gpu_h200).
SUSTAINED = 0.40
# Ring attention against one kernel call on the whole sequence, comm overlapped: zhuzilin/ring-flash-attention's
# balanced (zigzag) ring on 8×H800, 93.6% forward and 85.9% forward + backward (feifeibear/long-context-attention
# README, benchmark/benchmark_qkvpacked_func.py): the per-hop kernel split and the online-softmax merges.
RING_EFFICIENCY = {"forward": 0.936, "train": 0.859}
# One collective's fixed cost: nccl-tests' small-message times are ~10-30 us intra-node (NVIDIA/nccl-tests runs
# quoted on docs.alayanew.com); intra-node 20 us, crossing nodes 30 us.
LATENCY = 20e-6
LATENCY_INTER = 30e-6
# Host-side AdamW under FSDP2 CPU offload: fp32 parameter, gradient and two moments read, three written (28 bytes a
# parameter) at the host memory bandwidth a GPU's share of a node gets (below).
ADAM_HOST_BYTES = 28


@dataclasses.dataclass(frozen=True)
class Device:
    """A device and its links, each a constant with its source (the DEVICES table)."""

    name: str
    peak: float  # dense bf16 FLOP/s (no sparsity)
    nvlink: float  # per-GPU bytes/s inside a node (one direction)
    ib: float  # per-GPU bytes/s across nodes (its NIC)
    pcie: float  # host <-> device bytes/s
    host_bw: float  # host memory bytes/s available to one GPU's share of the node
    memory_gib: float
    sustained: float = SUSTAINED
    latency: float = LATENCY
    latency_inter: float = LATENCY_INTER
    cores: int = 0  # CPU profile only: ranks beyond the cores share them

    @property
    def rate(self) -> float:
        return self.peak * self.sustained


# Data sheets: H100/H200 SXM dense BF16 989.4 TFLOP/s (1,979 with sparsity), NVLink 4 900 GB/s bidirectional = 450 GB/s
# a direction (nccl-tests all_reduce busbw 460-480 GB/s on 8×H100 SXM, docs.alayanew.com's reference table), PCIe Gen5
# x16 64 GB/s a direction; A100 SXM 312 TFLOP/s, NVLink 3 600 GB/s bidirectional (busbw 230-250 GB/s measured: 235),
# PCIe Gen4 32 GB/s; H20 148 TFLOP/s BF16, NVLink 900 GB/s. InfiniBand: one ConnectX-7 NDR 400 Gb/s NIC per GPU
# (DGX H100/H200) = 50 GB/s; HDR 200 Gb/s = 25 GB/s on DGX A100. Host memory: 2 sockets × 8 channels DDR5-4800
# (38.4 GB/s each) shared by 8 GPUs = 77 GB/s a GPU (DDR4-3200 on DGX A100: 51 GB/s).
DEVICES: dict[str, Device] = {
    "h100": Device("H100 SXM", 989.4e12, 450e9, 50e9, 64e9, 77e9, 80.0),
    "h200": Device("H200 SXM", 989.4e12, 450e9, 50e9, 64e9, 77e9, 141.0),
    "a100": Device("A100 SXM 80GB", 312e12, 235e9, 25e9, 32e9, 51e9, 80.0),
    "h20": Device("H20", 148e12, 450e9, 50e9, 64e9, 77e9, 96.0),
}


def cpu_device() -> Device:
    """This machine as a device: the FLOP rate and gloo bandwidth `calibrate_cpu` measured (train/advisor_cpu.json)."""
    if not CPU_PROFILE.is_file():
        from train.errors import UserError

        raise UserError(f"{CPU_PROFILE} is missing: run `python -m train.advisor --calibrate-cpu` once")
    p = json.loads(CPU_PROFILE.read_text())
    bw = p["gloo_bytes_per_s"]
    return Device("CPU (gloo)", p["flops_per_s"], bw, bw, bw, bw, 0.0, sustained=1.0, latency=p["gloo_latency_s"],
                  latency_inter=p["gloo_latency_s"], cores=p["cores"])  # fmt: skip


# --------------------------------------------------------------------------------------------------- the work


@dataclasses.dataclass(frozen=True)
class Work:
    """What one optimizer step does, independent of the layout (one sample's FLOPs are c + a·T + b·T²)."""

    tokens: int
    a: float
    b: float
    blocks: int
    hidden: int  # attention width: heads × head dim
    heads: int
    c: float = 0.0
    batch: float = 1.0  # samples per CP group per micro-step
    grad_accum: int = 1
    backward: float = 2.0  # forwards' worth of backward compute: 2 full, 1 LoRA, 0 inference
    recompute: float = 0.0  # fraction of the blocks whose forward is recomputed
    elem: int = 2  # activation bytes per element
    gathered_bytes: float = 0.0  # whole-model parameter bytes one FSDP all-gather pass moves
    grad_bytes: float = 0.0  # whole-model trained gradient bytes reduced per step
    trainable: float = 0.0  # trained parameters (host AdamW under CPU offload)
    fsdp: bool = True
    reshard: bool = True
    offload_bytes: float = 0.0  # saved activations moved to host and back per micro-step (offload_activations)
    cpu_offload: bool = False

    @property
    def forward_flops(self) -> float:
        return self.c + self.a * self.tokens + self.b * self.tokens**2


@dataclasses.dataclass(frozen=True)
class Layout:
    replicate: int
    shard: int
    ring: int
    ulysses: int

    @property
    def cp(self) -> int:
        return self.ring * self.ulysses

    @property
    def world(self) -> int:
        return self.replicate * self.shard * self.cp

    @property
    def dp(self) -> int:
        return self.replicate * self.shard

    def __str__(self) -> str:
        return f"rep {self.replicate} × shard {self.shard} × ring {self.ring} × ulysses {self.ulysses}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(gpus: int, heads: int, tokens: int) -> list[Layout]:
    """Every layout of `gpus` ranks ParallelConfig accepts, with Ulysses ≤ heads and cp ≤ tokens."""
    out = []
    for cp in _divisors(gpus):
        for ring in _divisors(cp):
            u = cp // ring
            if u > heads or cp > tokens:
                continue
            for rep in _divisors(gpus // cp):
                out.append(Layout(rep, gpus // cp // rep, ring, u))
    return out


# ---------------------------------------------------------------------------------------------------- placement


def _members(stride: int, size: int, per_node: int) -> tuple[int, int]:
    """(peers on rank 0's node, peers off it) of the group of `size` ranks `stride` apart that rank 0 belongs to."""
    on = sum(1 for k in range(1, size) if (k * stride) // per_node == 0)
    return on, size - 1 - on


def _all_to_all(dev: Device, nbytes: float, stride: int, size: int, per_node: int) -> float:
    """One all-to-all of `nbytes` per rank: each peer gets nbytes/size; the on- and off-node shares go at once."""
    if size <= 1:
        return 0.0
    on, off = _members(stride, size, per_node)
    share = nbytes / size
    wire = max(share * on / dev.nvlink, share * off / dev.ib)
    return wire + (dev.latency_inter if off else dev.latency)


def _hop(dev: Device, nbytes: float, stride: int, size: int, per_node: int) -> float:
    """One ring shift of `nbytes`: the slowest hop (a node boundary when the ring crosses one) sets the pace."""
    _, off = _members(stride, size, per_node)
    return nbytes / (dev.ib if off else dev.nvlink) + (dev.latency_inter if off else dev.latency)


def _ring_collective(dev: Device, nbytes: float, stride: int, size: int, per_node: int) -> float:
    """An all-gather or reduce-scatter (NCCL's ring algorithm) of `nbytes` in total: (n-1)/n of it through the
    slowest link; across nodes every member's NIC carries a channel, min(NVLink, IB × members per node)."""
    if size <= 1:
        return 0.0
    on, off = _members(stride, size, per_node)
    bw = dev.nvlink if not off else min(dev.nvlink, dev.ib * (on + 1))
    return nbytes * (size - 1) / size / bw + (dev.latency_inter if off else dev.latency)


# ---------------------------------------------------------------------------------------------------- time model


def step_time(w: Work, lay: Layout, dev: Device, per_node: int) -> dict[str, float]:
    """Predicted seconds of one optimizer step per rank, by part; "step" is the total."""
    r, u, cp = lay.ring, lay.ulysses, lay.cp
    train = w.backward > 0
    rate = dev.rate
    if dev.cores:  # CPU: ranks beyond the cores share them
        rate *= min(1.0, dev.cores / lay.world)
    mode = "train" if train else "forward"
    eff = RING_EFFICIENCY[mode] if r > 1 else 1.0
    passes = 1 + w.backward + w.recompute  # forwards' worth of compute
    att = w.batch * w.b * w.tokens**2 / cp  # one forward's attention FLOPs on this rank
    lin = w.batch * (w.a * w.tokens / cp + w.c)
    rerun = 1.0 if (r > 1 and train) else 0.0  # the ring backward re-runs each block's forward
    compute = (lin * passes + att * (passes + rerun) / eff) / rate
    t: dict[str, float] = {"compute": compute}

    # Ulysses: 4 all-to-alls per block and pass, not overlapped
    comm_passes = 1 + (1 if train else 0) + w.recompute
    buf = w.batch * w.tokens / cp * w.hidden * w.elem
    t["ulysses a2a"] = w.blocks * comm_passes * 4 * _all_to_all(dev, buf, 1, u, per_node) if u > 1 else 0.0

    # ring: r-1 hops per block and pass, each hidden behind the attention on the chunk already here
    exposed = 0.0
    if r > 1:
        kv = 2 * w.batch * (w.tokens / r) * (w.hidden / u) * w.elem
        step_att = w.batch * (w.b / w.blocks) * (w.tokens / r) ** 2 / u / eff / rate
        fwd = (r - 1) * max(0.0, _hop(dev, kv, u, r, per_node) - step_att)
        bwd = (r - 1) * max(0.0, _hop(dev, 2 * kv, u, r, per_node) - (2 + rerun) * step_att) if train else 0.0
        exposed = w.blocks * (fwd * (1 + w.recompute) + bwd)
    t["ring exposed"] = exposed

    # FSDP2 (overlapped with compute) and the gradient reductions
    group = lay.shard * cp
    hidden_comm, first = 0.0, 0.0
    if w.fsdp and (group > 1 or lay.replicate > 1):
        gather = _ring_collective(dev, w.gathered_bytes, 1, group, per_node)
        gathers = 2 if (train and w.reshard) else 1
        hidden_comm = w.grad_accum * gathers * gather
        first = w.grad_accum * gather / max(w.blocks, 1)
        if train:
            hidden_comm += _ring_collective(dev, w.grad_bytes, 1, group, per_node)
            hidden_comm += 2 * _ring_collective(dev, w.grad_bytes / group, group, lay.replicate, per_node)
    elif train and lay.world > 1:  # replicated parameters: gradients all-reduced over the world
        hidden_comm = 2 * _ring_collective(dev, w.grad_bytes, 1, lay.world, per_node)
    t["FSDP / grads (overlapped)"] = hidden_comm
    t["FSDP first gather"] = first

    busy = w.grad_accum * (compute + exposed)
    if w.offload_bytes:  # saved activations out and back over PCIe on their own stream
        busy = max(busy, w.grad_accum * 2 * w.offload_bytes / dev.pcie)
    offload = 0.0
    if w.cpu_offload and w.fsdp:
        shard = w.gathered_bytes / max(group, 1)
        offload = (w.grad_accum * (2 if train and w.reshard else 1) * shard + w.grad_bytes / max(group, 1)) / dev.pcie
        offload += w.trainable / max(group, 1) * ADAM_HOST_BYTES / dev.host_bw
    t["CPU offload"] = offload
    t["step"] = max(busy, hidden_comm) + w.grad_accum * t["ulysses a2a"] + first + offload
    return t


# ------------------------------------------------------------------------------------------------ from a recipe


@functools.cache
def _instance_flops(family: str) -> tuple[float, float, float, float, float, int, int]:
    """(c, a, b) of the family's calibration instance's forward, counted by FlopCounterMode on the meta device at
    three token counts, with what they are scaled by: its blocks' matmul weights, heads × head dim × blocks, text."""
    import diffusers
    from torch.utils.flop_counter import FlopCounterMode

    from train.estimate import _forward_kwargs, _heads_and_inner_dim, _scaled_shapes, load_calibration
    from train.models import get_family
    from train.parallel import repeated_blocks

    instance = load_calibration(family)["instance"]
    spec = get_family(family)
    with torch.device("meta"):
        model = getattr(diffusers, spec.transformer_class).from_config(instance["config"])
    model.set_attention_backend("native")
    points = []
    for grid in (1, 2, 3):
        kwargs, tokens = _forward_kwargs(family, model, _scaled_shapes(instance, grid, 1), torch.float32)
        kwargs = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(**kwargs, return_dict=False)
        points.append((float(tokens), float(counter.get_total_flops())))
    (t1, f1), (t2, f2), (t3, f3) = points
    # exact quadratic through the three points
    b = ((f3 - f2) / (t3 - t2) - (f2 - f1) / (t2 - t1)) / (t3 - t1)
    a = (f2 - f1) / (t2 - t1) - b * (t1 + t2)
    c = f1 - a * t1 - b * t1 * t1
    blocks = repeated_blocks(model)
    weights = sum(p.numel() for blk in blocks for p in blk.parameters() if p.dim() >= 2)
    _, inner = _heads_and_inner_dim(spec, model.config)
    return c, a, b, float(weights), float(inner * len(blocks)), instance["shapes"]["prompt_embeds"][0], len(blocks)


def _block_weights(shape: Any) -> float:
    return float(sum(math.prod(s) for b in range(shape.n_blocks) for s, _, _ in shape.select(None, b) if len(s) >= 2))


def work_from_recipe(recipe: Any, shape: Any, offloaded: float = 0.0, device_type: str = "cuda") -> Work:
    """The step of `recipe` as the time model sees it (layout-independent); `offloaded`: the saved activation bytes
    train.estimate puts in host memory (offload_activations)."""
    from train.estimate import _block_activations, _precision, sample_tokens

    t, p = recipe.train, recipe.parallel
    tokens, text = sample_tokens(recipe)
    c, a, b, weights, width, inst_text, _ = _instance_flops(recipe.model.family)
    scale = _block_weights(shape) / weights
    cuda = device_type == "cuda"
    compute_elem = 2 if cuda and t.mixed_precision != "no" else None
    gathered = sum(math.prod(s) * (compute_elem if compute_elem and f else e) for s, e, f in shape.select(None))
    grads = sum(math.prod(s) * (compute_elem or e) for s, e, _ in shape.select(True))
    _, recomputed = _block_activations(t, shape.n_blocks, 0.0, 0.0, 0.0)
    batch = t.batch_size if t.batch_tokens is None else max(1.0, t.batch_tokens / tokens)
    return Work(
        tokens=tokens, a=a * scale, b=b * shape.inner_dim * shape.n_blocks / width, c=c * scale * text / inst_text,
        blocks=shape.n_blocks, hidden=shape.inner_dim, heads=shape.heads, batch=batch, grad_accum=t.grad_accum,
        backward=2.0 if recipe.finetune.method == "full" else 1.0, recompute=recomputed / max(shape.n_blocks, 1),
        elem=2 if _precision(recipe, device_type) == "bf16" else 4, gathered_bytes=gathered, grad_bytes=grads,
        trainable=float(shape.numel(True)), fsdp=p.fsdp, reshard=p.reshard_after_forward, offload_bytes=offloaded,
        cpu_offload=p.cpu_offload and cuda,
    )  # fmt: skip


# The levers tried, cheapest first, on a layout predicted over the device memory.
LEVERS: list[dict[str, Any]] = [
    {},
    {"train.gradient_checkpointing": True, "train.checkpoint_every": 2},
    {"train.gradient_checkpointing": True, "train.checkpoint_every": 1},
    {"train.gradient_checkpointing": True, "train.checkpoint_every": 1, "train.offload_activations": True},
    {"parallel.cpu_offload": True},
    {"train.gradient_checkpointing": True, "train.checkpoint_every": 1, "parallel.cpu_offload": True},
    {"train.gradient_checkpointing": True, "train.checkpoint_every": 1, "train.offload_activations": True,
     "parallel.cpu_offload": True},
]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Row:
    layout: Layout
    levers: dict[str, Any]
    time: dict[str, float]
    peak: float  # bytes per rank (train.estimate)
    fits: bool
    per_sample: float  # step seconds / samples the step trains


def _candidate(recipe: Any, lay: Layout, changes: dict[str, Any]) -> Any:
    from train.config import recipe_from_dict, recipe_to_dict

    data = recipe_to_dict(recipe)
    data["parallel"].update(cp=lay.cp, cp_ring=lay.ring, dp_shard=lay.shard, dp_replicate=lay.replicate)
    for key, value in changes.items():
        section, name = key.split(".")
        data[section][name] = value
    return recipe_from_dict(data)


def advise(recipe: Any, gpus: int, nodes: int = 1, device: Device | None = None, gib: float | None = None) -> list[Row]:
    """Every layout of `recipe` on `gpus` GPUs over `nodes` nodes, fastest (per sample) first; the ones that fit no
    way last. Memory per rank from train.estimate.estimate() on the exact candidate recipe."""
    from train.config import recipe_to_dict
    from train.errors import UserError
    from train.estimate import estimate, model_shape

    device = device or DEVICES["h100"]
    if gpus < 1 or nodes < 1 or gpus % nodes:
        raise UserError(f"--gpus {gpus} over --nodes {nodes}: the GPUs must split evenly over the nodes")
    per_node = gpus // nodes
    gib = gib if gib is not None else device.memory_gib
    kind = "cpu" if device.cores else "cuda"  # the CPU profile: its memory and precision as on a CPU run
    shapes: dict[tuple, Any] = {}
    base = model_shape(recipe)
    shapes[(recipe.train.master_weights, recipe.finetune.fp8_base)] = base
    now = recipe_to_dict(recipe)
    # each lever set as the changes it makes to this recipe (a lever the recipe already has is no change)
    levers = [{k: v for k, v in c.items() if now[k.split(".")[0]][k.split(".")[1]] != v} for c in LEVERS]
    rows = []
    for lay in layouts(gpus, base.heads, max(1, _tokens(recipe))):
        best: Row | None = None
        for changes in levers:
            try:
                cand = _candidate(recipe, lay, changes)
            except ValueError:
                continue
            key = (cand.train.master_weights, cand.finetune.fp8_base)
            shape = shapes.setdefault(key, base)
            e = estimate(cand, gpus, kind, shape)
            fits = gib <= 0 or e.peak <= gib * GIB
            if not fits and changes is not levers[-1]:
                continue
            work = work_from_recipe(cand, shape, e.host.get("offloaded activations", 0.0), kind)
            times = step_time(work, lay, device, per_node)
            samples = lay.dp * cand.train.batch_size * cand.train.grad_accum
            best = Row(lay, changes, times, e.peak, fits, times["step"] / samples)
            break
        if best is not None:
            rows.append(best)
    # ties (within 0.1%): fewer levers first
    return sorted(rows, key=lambda r: (not r.fits, round(math.log(r.per_sample), 3), len(r.levers)))


def _tokens(recipe: Any) -> int:
    from train.estimate import sample_tokens

    return sample_tokens(recipe)[0]


def _lever_text(changes: dict[str, Any]) -> str:
    if not changes:
        return "as is"
    parts = []
    if changes.get("train.gradient_checkpointing"):
        parts.append(f"ckpt every {changes['train.checkpoint_every']}")
    if changes.get("train.offload_activations"):
        parts.append("offload activations")
    if changes.get("parallel.cpu_offload"):
        parts.append("CPU offload")
    return ", ".join(parts)


def table(rows: Sequence[Row], top: int | None = None, gib: float | None = None) -> str:
    lines = ["| # | ring | ulysses | dp_shard | dp_replicate | levers | step s | s / sample | compute | ulysses a2a | "
             "ring exposed | FSDP (overlapped) | memory / rank GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for i, r in enumerate(rows[:top] if top else rows, 1):
        t = r.time
        fit = "" if r.fits else " (does NOT fit)"
        lines.append(f"| {i} | {r.layout.ring} | {r.layout.ulysses} | {r.layout.shard} | {r.layout.replicate} | "
                     f"{_lever_text(r.levers)} | {t['step']:.3f} | {r.per_sample:.3f} | {t['compute']:.3f} | "
                     f"{t['ulysses a2a']:.3f} | {t['ring exposed']:.3f} | {t['FSDP / grads (overlapped)']:.3f} | "
                     f"{r.peak / GIB:.1f}{fit} |")  # fmt: skip
    return "\n".join(lines)


def layouts_main(recipe: Any, gpus: int, nodes: int, device_name: str, gib: float | None, top: int = 20) -> None:
    """`python -m train.estimate ... --layouts`: the ranked table."""
    from train.errors import UserError

    if device_name not in DEVICES and device_name != "cpu":
        raise UserError(f"--device {device_name!r}: expected one of {', '.join([*DEVICES, 'cpu'])}")
    device = cpu_device() if device_name == "cpu" else DEVICES[device_name]
    rows = advise(recipe, gpus, nodes, device, gib)
    print(f"{len(rows)} layouts of {gpus} GPUs on {nodes} node(s) of {gpus // nodes}, {device.name} "
          f"({device.peak / 1e12:.0f} TFLOP/s × {device.sustained:.2f} sustained); predicted, fastest per sample "
          f"first; memory from train.estimate (fits {device.memory_gib if gib is None else gib:.0f} GiB)")  # fmt: skip
    print(table(rows, top))
    if rows:
        best = rows[0]
        sets = [f"--set parallel.cp={best.layout.cp}", f"--set parallel.cp_ring={best.layout.ring}",
                f"--set parallel.dp_replicate={best.layout.replicate}"]  # fmt: skip
        sets += [f"--set {k}={str(v).lower()}" for k, v in best.levers.items()]
        print(f"best: {best.layout}; {' '.join(sets)}")


# ---------------------------------------------------------------------------------------------------- CPU profile

# The mid-size CPU case (bench/step_time.py's model case): Wan, 2 blocks, 8 heads × 32, ffn 1024, 3072 video tokens.
CPU_WAN = dict(patch_size=(1, 2, 2), num_attention_heads=8, attention_head_dim=32, in_channels=16, out_channels=16,
               text_dim=64, freq_dim=64, ffn_dim=1024, num_layers=2, cross_attn_norm=True,
               qk_norm="rms_norm_across_heads")  # fmt: skip
CPU_LATENT = (1, 16, 4, 64, 48)
CPU_TEXT = 64


def _cpu_model_flops() -> tuple[float, int]:
    """(forward FLOPs, tokens) of the CPU case, counted by FlopCounterMode on the meta device."""
    from diffusers import WanTransformer3DModel
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = WanTransformer3DModel(**CPU_WAN)
        inputs = dict(hidden_states=torch.empty(CPU_LATENT), encoder_hidden_states=torch.empty(1, CPU_TEXT, 64),
                      timestep=torch.tensor([500.0]))  # fmt: skip
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(**inputs, return_dict=False)
    return float(counter.get_total_flops()), CPU_LATENT[2] * CPU_LATENT[3] * CPU_LATENT[4] // 4


def _cpu_rank(rank: int, world: int, steps: int) -> dict[str, float]:
    """Rank body: the CPU case's CP step (forward, loss, backward: Ulysses over all ranks) timed, and at 2+ ranks the
    gloo all-to-all at the size one Ulysses call moves and at 4 bytes."""
    import statistics
    import warnings

    import torch.distributed as dist
    from diffusers import WanTransformer3DModel
    from diffusers.utils import logging

    logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.manual_seed(0)
    model = WanTransformer3DModel(**CPU_WAN).train()
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        from train.cp import enable_context_parallel

        enable_context_parallel(model, mesh=init_device_mesh("cpu", (1, world), mesh_dim_names=("ring", "ulysses")))
    gen = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(CPU_LATENT, generator=gen),
        encoder_hidden_states=torch.randn(1, CPU_TEXT, 64, generator=gen),
        timestep=torch.tensor([500.0]),
    )
    target = torch.randn(CPU_LATENT, generator=gen)  # fmt: skip

    def step() -> float:
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(**inputs, return_dict=False)[0], target).backward()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        if world > 1:
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        return dt.item()

    step()
    out = {"step_s": statistics.median(step() for _ in range(steps))}
    if world > 1:
        tokens = CPU_LATENT[2] * CPU_LATENT[3] * CPU_LATENT[4] // 4
        n = math.ceil(tokens / world) * 8 * 32 * world  # one rank's q (fp32), in world equal splits
        # 16x that for the bandwidth: well above the latency, which a loaded machine makes noisy
        for label, numel in (("big", 16 * n), ("small", world)):
            x, y = torch.randn(numel), torch.empty(numel)
            dist.all_to_all_single(y, x)
            times = []
            for _ in range(10):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_to_all_single(y, x)
                times.append(time.perf_counter() - t0)
            out[label] = min(times)  # the least disturbed: the link's own cost
            out[label + "_bytes"] = numel * 4
    return out


def calibrate_cpu(log: Any = print) -> dict[str, Any]:
    """Measure this machine once: the FLOP rate of one rank (1 thread) on the CPU case's step, and gloo's all-to-all
    bandwidth and latency between 2 ranks; saved to train/advisor_cpu.json."""
    from train.tools.spawn import run_distributed

    flops, _ = _cpu_model_flops()
    one = run_distributed(_cpu_rank, 1, 7)[0]
    two = run_distributed(_cpu_rank, 2, 3)[0]
    latency = two["small"]
    # an all-to-all of B bytes per rank sends B/2 to the other rank (2 ranks); the latency is only subtracted when
    # it is well below the transfer (else noise would make the bandwidth unbounded)
    wire = two["big"] - latency if two["big"] > 2 * latency else two["big"]
    bw = two["big_bytes"] / 2 / wire
    profile = {
        "what": "CPU device profile for train.advisor: flops_per_s = 3 x forward FLOPs (FlopCounterMode) of the CPU "
                "case (train.advisor.CPU_WAN) / its median 1-rank step (1 thread); gloo all-to-all between 2 ranks",
        "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
        "load_average": round(os.getloadavg()[0], 1), "cores": os.cpu_count() or 1,
        "flops_per_s": 3 * flops / one["step_s"], "one_rank_step_s": one["step_s"], "gloo_bytes_per_s": bw,
        "gloo_latency_s": latency,
    }  # fmt: skip
    CPU_PROFILE.write_text(json.dumps(profile, indent=1) + "\n")
    log(json.dumps(profile, indent=1))
    return profile


def cpu_work() -> Work:
    """The CPU case as the time model sees it: fp32, full backward, no FSDP (the measured step has none)."""
    flops, tokens = _cpu_model_flops()
    hidden = CPU_WAN["num_attention_heads"] * CPU_WAN["attention_head_dim"]
    attention = 4 * tokens**2 * hidden * CPU_WAN["num_layers"]  # the self-attention products
    return Work(tokens=tokens, a=(flops - attention) / tokens, b=attention / tokens**2, blocks=CPU_WAN["num_layers"],
                hidden=hidden, heads=CPU_WAN["num_attention_heads"], elem=4, fsdp=False)  # fmt: skip


def cpu_check(worlds: Iterable[int] = (2, 3, 4), steps: int = 5) -> list[tuple[int, float, float]]:
    """(ranks, predicted s, measured s) of the CPU case's CP step on this machine."""
    from train.tools.spawn import run_distributed

    dev, w = cpu_device(), cpu_work()
    rows = []
    for world in worlds:
        measured = run_distributed(_cpu_rank, world, steps)[0]["step_s"]
        predicted = step_time(dataclasses.replace(w, backward=2.0), Layout(1, 1, 1, world), dev, world)["step"]
        rows.append((world, predicted, measured))
    return rows


# --------------------------------------------------------------------------------------------------- scaling sheet

SHEET_RECIPES = {"Wan 2.1 14B (recipes/wan/14b_lora.yaml)": ("recipes/wan/14b_lora.yaml", 720, 1280, 3600),
                 "HunyuanVideo 13B (recipes/hunyuan_video/13b_lora.yaml)": ("recipes/hunyuan_video/13b_lora.yaml",
                                                                            544, 960, 2040)}  # fmt: skip
SHEET_TOKENS = (8_192, 32_768, 65_536, 131_072, 262_144)
SHEET_GPUS = (8, 32, 128, 1024)


def _cell(r: Row) -> str:
    lay = r.layout
    return (f"{lay.ring}×{lay.ulysses}×{lay.shard}×{lay.replicate} {_lever_text(r.levers)}: {r.time['step']:.2f} s, "
            f"{r.per_sample:.2f} s/sample, {r.peak / GIB:.1f} GiB" + ("" if r.fits else " (no fit)"))  # fmt: skip


def sheet(device_name: str = "h100") -> str:
    """Predicted step time and memory per rank under the best layout, per model, tokens and GPUs (8 per node): the
    advisor's best (time per sample: throughput) and the layout with the shortest step (one sample's latency)."""
    from train.config import load_recipe, recipe_from_dict, recipe_to_dict

    device = DEVICES[device_name]
    out = []
    for title, (path, height, width, per_frame) in SHEET_RECIPES.items():
        base = recipe_to_dict(load_recipe(path))
        tables: dict[str, list[str]] = {"fastest per sample (the advisor's best)": [], "shortest step": []}
        for tokens in SHEET_TOKENS:
            frames = max(1, round(tokens / per_frame))
            data = json.loads(json.dumps(base))
            data["data"].update(height=height, width=width, num_frames=4 * (frames - 1) + 1)
            recipe = recipe_from_dict(data)
            real = _tokens(recipe)
            best, short = [], []
            for gpus in SHEET_GPUS:
                rows = advise(recipe, gpus, max(1, gpus // 8), device)
                fitting = [r for r in rows if r.fits] or rows
                best.append(_cell(rows[0]))
                short.append(_cell(min(fitting, key=lambda r: (r.time["step"], r.per_sample))))
            for name, cells in zip(tables, (best, short)):
                tables[name].append(f"| {real:,} | " + " | ".join(cells) + " |")
        for name, lines in tables.items():
            out += [f"\n**{title}**, {device.name}, 8 GPUs a node, {name}; cell: ring × Ulysses × dp_shard × "
                    "dp_replicate and levers, predicted step s, s per sample, memory per rank GiB\n",
                    "| tokens | " + " | ".join(f"{g} GPUs" for g in SHEET_GPUS) + " |",
                    "|---|" + "---|" * len(SHEET_GPUS), *lines]  # fmt: skip
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m train.advisor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--calibrate-cpu", action="store_true", help="measure this machine's CPU/gloo profile")
    parser.add_argument("--cpu-check", action="store_true", help="predicted vs measured CP step at 2/3/4 ranks")
    parser.add_argument("--sheet", action="store_true", help="print the scaling sheet (Wan 14B, HunyuanVideo 13B)")
    args = parser.parse_args(argv)
    if args.calibrate_cpu:
        calibrate_cpu()
    if args.cpu_check:
        print("| gloo ranks | predicted s | measured s | predicted / measured |\n|---|---|---|---|")
        for world, pred, meas in cpu_check():
            print(f"| {world} | {pred:.3f} | {meas:.3f} | {pred / meas:.2f} |")
    if args.sheet:
        print(sheet())


if __name__ == "__main__":
    try:
        main()
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
