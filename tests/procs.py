"""Process checks the tests share: which of some pids still run (a zombie does not), and this
process's descendants."""

from __future__ import annotations

import psutil


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def descendants() -> set[int]:
    """This process's live descendants, less multiprocessing's resource tracker (Python starts one
    with the first spawned process and keeps it, whoever spawned, until the interpreter exits)."""
    out = set()
    for c in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(c.cmdline()) and c.status() != psutil.STATUS_ZOMBIE:
                out.add(c.pid)
        except psutil.NoSuchProcess:
            pass
    return out
