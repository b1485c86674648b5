"""Run a function on N real gloo processes (CPU) and collect what each rank returns: `run_distributed`.

The helper lives in train/cp/spawn.py (the plan checker, `python -m train.cp.check_plan`, spawns with it too); the
tests import it from here.
"""

from train.cp.spawn import COLLECTIVE_TIMEOUT_S, RankError, run_distributed

__all__ = ["COLLECTIVE_TIMEOUT_S", "RankError", "run_distributed"]
