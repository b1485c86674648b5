"""Files the user reads: written with the permissions the user's umask gives (as `open`, `mkdir` and `cp` would).

Some writers create their files 0600 whatever the umask (safetensors' `save_file`, `tempfile.mkstemp`), so a cache or
export written on a shared machine is unreadable to the user's group. `match_umask(path)` after such a write gives a
file `0o666 & ~umask`, and a folder `0o777 & ~umask` and everything in it the same. The umask is read once
(`read_umask`, at an entry point's startup): reading it means setting it, which would race with a thread creating
files.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["match_umask", "read_umask"]

_umask: int | None = None


def read_umask() -> int:
    """This process's umask, read now (call it once at startup, before any thread writes files) and remembered for
    `match_umask`."""
    global _umask
    old = os.umask(0)  # the only portable way to read it is to set it...
    os.umask(old)  # ...and put it back
    _umask = old
    return old


def match_umask(path: str | Path) -> None:
    """Give `path` the mode a plain `open(path, "w")` (a file) or `mkdir` (a folder, and then everything under it)
    would have: 0o666, or 0o777 for a folder, less the umask. Links are left alone (chmod would follow them)."""
    umask = read_umask() if _umask is None else _umask
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        return
    if not stat.S_ISDIR(mode):
        os.chmod(path, 0o666 & ~umask)
        return
    os.chmod(path, 0o777 & ~umask)
    for root, dirs, files in os.walk(path):  # top-down: each folder is chmod-ed before it is listed
        for name in dirs:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), 0o777 & ~umask)
        for name in files:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), 0o666 & ~umask)
