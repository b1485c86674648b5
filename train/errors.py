"""The one error type for user mistakes: a recipe, path, data, cache, plan, degree or shape the user can fix.

Raised before any collective, it is printed as one line with cause and fix, exit code 2, no traceback (`--debug`
shows it). `same_on_every_rank=True` (the default) when every rank sees the same input and raises the same error:
then rank 0 alone prints it; False when only this rank saw it (its own data shard, its own file): that rank prints it.
"""

from __future__ import annotations


class UserError(ValueError):
    def __init__(self, message: str, *, same_on_every_rank: bool = True) -> None:
        super().__init__(message)
        self.same_on_every_rank = same_on_every_rank
