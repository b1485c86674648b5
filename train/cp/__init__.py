"""The CP core: trainable Ulysses-Anything attention, CP plans, enabling CP, gradient reduction and startup guards.

Public contract: `install_ulysses_anything_backward()` and `enable_context_parallel(model, *, mesh, degree, plan)`,
which returns the model's `ContextParallelState` (a diffusers `ParallelConfig` holding everything CP keeps for that
model: plan, layout registry, transport and its stats). Nothing is kept per process.
"""

from .enable import enable_context_parallel
from .reduce import GradReduction
from .state import ContextParallelState
from .ulysses import install_ulysses_anything_backward

__all__ = ["ContextParallelState", "GradReduction", "enable_context_parallel", "install_ulysses_anything_backward"]
