"""Process checks the tests share: which of some pids still run (a zombie does not)."""
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
