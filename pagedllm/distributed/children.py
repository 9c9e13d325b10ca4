"""Rank 0's wait for the ranks it spawned on this machine (tensor-parallel workers, pipeline
stages): each reports over its pipe that it started or loaded, or the error it met; a rank
that exits or stays silent past the timeout ends the wait with `error`, naming the rank."""

from __future__ import annotations

import time


def wait_for_ranks(
    procs: list, conns: list, what: str, timeout: float, who: str, size_arg: str, error: type[Exception]
) -> None:
    """`who`: what a rank is called in messages ("tensor-parallel worker"); `size_arg`: the LLM
    argument that spawns them, named in the hint for scripts without a main guard."""
    deadline = time.monotonic() + timeout
    for rank, (p, conn) in enumerate(zip(procs, conns), start=1):
        msg = None
        while msg is None:
            try:
                if conn.poll(0.2):
                    msg = conn.recv()
                    continue
            except (EOFError, OSError):  # the rank is gone: wait for its exit status
                p.join(timeout=5)
            if not p.is_alive():
                hint = (
                    (
                        f"; a script that starts an LLM with {size_arg} > 1 must do so under "
                        '`if __name__ == "__main__":` (the ranks are started with spawn, which '
                        "imports the main script again)"
                    )
                    if what == "started"
                    else ""
                )
                raise error(
                    f"{who} rank {rank} exited before it {what} (exit code {p.exitcode}); see its log above{hint}"
                )
            if time.monotonic() > deadline:
                raise error(f"{who} rank {rank} has not {what} after {timeout:g} s (PAGEDLLM_TP_LOAD_TIMEOUT_S)")
        kind, value = msg
        if kind == "error":
            raise ValueError(f"{who} rank {rank} failed: {value}")
