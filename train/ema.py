"""An exponential moving average of the trained weights, kept shard by shard.

Each rank averages exactly the parameters it holds: under FSDP2 a parameter is a DTensor and its EMA is a DTensor with
the same placements, so nothing is gathered to update it, and DCP saves and restores it sharded beside the model and
optimizer (`AppState`, train/checkpoint.py). The average is fp32 whatever the master weights' dtype.

    ema = EMA.of(recipe.ema, model)           # None when the recipe has no `ema` section
    ema.update(step)                          # after each applied optimizer step (step = its 1-based number)
    with ema.swapped():                       # the model holds the EMA weights (export, validation), then its own
        export(...)

The average starts as a copy of the weights it is built from (start_step 0: the starting weights, as diffusers'
`EMAModel`) and is overwritten by a copy of the weights at step start_step > 0: a pure function of the steps, so a
checkpoint needs nothing but the tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class EMA:
    decay: float
    start_step: int
    every_n_steps: int
    params: dict[str, torch.nn.Parameter]  # the trained parameters, by the model's names
    average: dict[str, torch.Tensor]  # same names, shapes and placements, fp32

    @classmethod
    def of(cls, config, model: torch.nn.Module) -> EMA | None:
        if config is None:
            return None
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        average = {n: p.detach().to(torch.float32, copy=True) for n, p in params.items()}
        return cls(config.decay, config.start_step, config.every_n_steps, params, average)

    def due(self, step: int) -> bool:
        return step >= self.start_step and (step - self.start_step) % self.every_n_steps == 0

    @torch.no_grad()
    def update(self, step: int) -> None:
        """After optimizer step `step` (1-based): the first due step copies the weights, later ones average them."""
        if not self.due(step):
            return
        avg = [_local(self.average[n]) for n in self.params]
        new = [_local(p).to(torch.float32) for p in self.params.values()]
        if step == self.start_step:  # start_step 0: the average starts from the weights before the first step
            torch._foreach_copy_(avg, new)
        else:
            torch._foreach_lerp_(avg, new, 1.0 - self.decay)  # ema + (1 − decay)(w − ema)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.average)

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for n, t in state.items():  # DCP loads into `average`'s own tensors: a copy only when it handed back others
            if t is not self.average[n]:
                _local(self.average[n]).copy_(_local(t))

    @contextmanager
    @torch.no_grad()
    def swapped(self) -> Iterator[None]:
        """The model holds the EMA weights inside the block (cast to each parameter's dtype), its own after. One
        parameter's copy at a time is extra memory."""
        kept = {}
        try:
            for n, p in self.params.items():
                kept[n] = _local(p).clone()
                _local(p).copy_(_local(self.average[n]))
            yield
        finally:
            for n, saved in kept.items():
                _local(self.params[n]).copy_(saved)
