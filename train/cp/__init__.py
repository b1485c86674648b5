"""The CP core: trainable Ulysses-Anything attention, CP plans, enabling CP, gradient reduction and startup guards.

Public contract: `install_ulysses_anything_backward()` and `enable_context_parallel(model, *, mesh, degree, plan)`.
"""

from .enable import enable_context_parallel
from .reduce import GradReduction
from .ulysses import install_ulysses_anything_backward

__all__ = ["GradReduction", "enable_context_parallel", "install_ulysses_anything_backward"]
