"""Whether a process of this host still runs: a DDP job's ranks (core/ranks.py) and a job followed by its id
(core/jobs.py) ask it. Standard library only."""

from __future__ import annotations

import os


def alive(pid: int) -> bool:
    """A process that has not exited (a killed one its launcher has not reaped yet, a zombie, has)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc here: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
