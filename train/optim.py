"""The optimizer: AdamW, with the memory levers `train.optimizer` and `train.master_weights`.

- `adamw` with fp32 weights is torch's AdamW (fp32 moments: 16 bytes per trained parameter with its weight and
  gradient). Every other choice is torchao's AdamW (pinned in requirements.txt): `adamw_8bit` / `adamw_4bit` keep the
  moments block-quantized (torchao quantizes a tensor of at least 4096 values on this rank, in blocks of 256 / 128
  with one fp32 scale each; smaller tensors keep plain moments), and `master_weights: bf16` keeps bf16 weights and
  moments and rounds each update stochastically (so small updates are not lost to bf16's 8-bit mantissa). All run on
  FSDP2's sharded DTensors (each rank quantizes its own shard) and save through DCP.
- torchao compiles its per-parameter step (one graph per shape and dtype), with AOTAutograd's cache off: torchao 0.18's
  state subclasses have no stable cache hash ("does not implement _stable_hash_for_caching"), and with torch 2.13 on
  CPU a cache that held the 8-bit step's entries handed them to the 4-bit step ("wrong number of dimensions"), and a
  second run of the same 8-bit step on FSDP2 shards died with SIGSEGV. Inductor's own graph cache stays on: a
  second run compiles in seconds, not the first run's ~25-50 s.
- Stochastic rounding draws from torch's default generator inside that compiled step: `step` seeds it per optimizer
  step (the same on every rank: data-parallel replicas of a shard round alike), so a resumed run rounds exactly as the
  uninterrupted one, and the rest of the program's random stream is left as it was.
"""

from __future__ import annotations

import torch

# train.optimizer → torchao.optim's class (`_AdamW` is its plain AdamW, used for bf16 weights).
TORCHAO = {"adamw": "_AdamW", "adamw_8bit": "AdamW8bit", "adamw_4bit": "AdamW4bit"}
# torchao's quantized moments: bits per value, values per fp32 scale, and the code table's fp32 entries (one table per
# state tensor); a tensor is quantized when this rank holds at least MIN_QUANTIZED of its values, a multiple of the
# block (torchao.optim.adam `_new_buffer`), else its moments are plain, in the weight's dtype.
QUANTIZED = {"adamw_8bit": (8, 256, 256), "adamw_4bit": (4, 128, 16)}
MIN_QUANTIZED = 4096
ROUNDING = 0x5352  # a seed component of its own: the rounding stream differs from the step's noise


def build(params: list[torch.nn.Parameter], optimizer: str, master_weights: str, **hyper) -> torch.optim.Optimizer:
    """AdamW over `params` with `hyper` (lr, betas, eps, weight_decay)."""
    if optimizer == "adamw" and master_weights == "fp32":
        return torch.optim.AdamW(params, **hyper)
    import torchao.optim  # (its import's log lines are silenced in train/__init__.py)

    cls = getattr(torchao.optim, TORCHAO[optimizer])
    if optimizer in QUANTIZED:
        cls = _fp32_appearance(cls)
    opt = cls(params, **hyper, bf16_stochastic_round=master_weights == "bf16")
    opt.torchao = True  # `step` runs it with AOTAutograd's cache off and its rounding seeded
    return opt


def describe(optimizer: str, master_weights: str) -> str:
    """One line for the run's layout print."""
    if optimizer == "adamw" and master_weights == "fp32":
        return "torch AdamW, fp32 moments"
    moments = {"adamw": f"{master_weights} moments", "adamw_8bit": "8-bit moments", "adamw_4bit": "4-bit moments"}
    rounding = ", stochastic rounding to bf16" if master_weights == "bf16" else ""
    return (f"torchao {TORCHAO[optimizer]}, {moments[optimizer]}{rounding} (its first step compiles one graph per "
            "parameter shape: tens of seconds, seconds once inductor's cache holds them)")  # fmt: skip


def _fp32_appearance(cls: type) -> type:
    """torchao's quantized AdamW whose state tensors present themselves as fp32 whatever the weights' dtype. torchao
    0.18 gives them the weight's dtype, but its `view` (which `DTensor.from_local` calls) and its collectives return
    fp32-looking ones: with bf16 weights on FSDP2 the compiled step then failed ("OptimState8bit dispatch: ...
    aten.view.dtype"). The dtype is appearance only: the moments are dequantized to fp32 in the step either way."""
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit

    state = OptimState8bit if "8bit" in cls.__name__ else OptimState4bit

    def zeros(p: torch.Tensor, signed: bool, block_size: int) -> torch.Tensor:
        return state.zeros(p.shape, signed, block_size, p.device)

    return type(cls.__name__, (cls,), {"_subclass_zeros": staticmethod(zeros)})


def state_bytes(numel: int, elem: int, optimizer: str) -> int:
    """Bytes of AdamW's two moments for a tensor of which this rank holds `numel` values of `elem` bytes each."""
    if optimizer in QUANTIZED:
        bits, block, table = QUANTIZED[optimizer]
        if numel >= MIN_QUANTIZED and numel % block == 0:
            return 2 * (numel * bits // 8 + numel // block * 4 + table * 4)
    return 2 * numel * elem


def step(optimizer: torch.optim.Optimizer, seed: int, step_index: int, device: torch.device) -> None:
    """`optimizer.step()`; torchao's without AOTAutograd's cache and with the default generator seeded for this step."""
    if not getattr(optimizer, "torchao", False):
        optimizer.step()
        return
    from torch._functorch import config as functorch_config

    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), functorch_config.patch(enable_autograd_cache=False):
        torch.manual_seed(hash((seed, step_index, ROUNDING)) & 0x7FFF_FFFF_FFFF_FFFF)  # ints: one hash everywhere
        optimizer.step()


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every group's lr and initial_lr (torchao keeps lr as a tensor, which must stay one)."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
        group["initial_lr"] = lr


def scheduler_state(scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict:
    """The scheduler's state as plain data (a checkpoint's JSON): torchao's tensor lr makes its rates tensors."""

    def plain(v):
        if isinstance(v, torch.Tensor):
            return v.item()
        if isinstance(v, list | tuple):
            return [plain(x) for x in v]
        return v

    return {k: plain(v) for k, v in scheduler.state_dict().items()}


def neutral_state(optimizer: torch.optim.Optimizer) -> None:
    """Every parameter's optimizer state created as its first step would find it (AdamW: step 0, zero moments), without
    changing any parameter: DCP's zero-gradient, lr-0 initialisation step, then each `step` counter back to 0. For runs
    where some parameters skip steps (train/experts.py: one expert per step): a checkpoint then holds the untrained
    expert's state too (resume loads every parameter's state), and the untrained expert's first real step is the one
    it would take fresh (DCP's own initialisation, run on an empty optimizer at save time, would leave step 1 behind
    and shrink that step)."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(optimizer)
    for state in optimizer.state.values():
        if "step" in state:
            state["step"] = torch.zeros_like(state["step"]) if torch.is_tensor(state["step"]) else 0
