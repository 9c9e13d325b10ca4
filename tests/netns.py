"""Two "nodes" on one machine: two Linux network namespaces joined by a veth pair, each with
its own address (10.231.N.1 and .2, which exist only inside them: no traffic leaves). For the
multi-node tests; `skip_reason()` says why they cannot run here (not root, no `ip`, a kernel
or container that refuses namespaces)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Iterator


@dataclass
class Node:
    netns: str
    dev: str
    addr: str

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run inside this node's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def counter(self, which: str) -> int:
        """The veth's rx_bytes / tx_bytes as this node's stack counts them."""
        out = subprocess.run(
            self.command(["cat", f"/sys/class/net/{self.dev}/statistics/{which}"]),
            capture_output=True,
            text=True,
            check=True,
        )
        return int(out.stdout)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def skip_reason() -> str | None:
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed: cannot make network namespaces"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); run as root to test two nodes"
    probe = f"pllm-probe-{os.getpid()}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"this kernel or container refuses network namespaces: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@contextlib.contextmanager
def two_nodes() -> Iterator[tuple[Node, Node]]:
    """Two namespaces joined by a veth pair, removed (with their interfaces) on exit."""
    tag = f"{os.getpid() % 100000}"
    subnet = 10 + os.getpid() % 200
    a = Node(f"pllm-a-{tag}", f"pva{tag}", f"10.231.{subnet}.1")
    b = Node(f"pllm-b-{tag}", f"pvb{tag}", f"10.231.{subnet}.2")
    made: list[str] = []
    try:
        for n in (a, b):
            _ip("netns", "add", n.netns)
            made.append(n.netns)
        _ip("link", "add", a.dev, "netns", a.netns, "type", "veth", "peer", "name", b.dev, "netns", b.netns)
        for n in (a, b):
            _ip("-n", n.netns, "addr", "add", f"{n.addr}/24", "dev", n.dev)
            _ip("-n", n.netns, "link", "set", n.dev, "up")
            _ip("-n", n.netns, "link", "set", "lo", "up")
        yield a, b
    finally:
        for ns in made:  # deleting a namespace removes its end of the pair, and so the pair
            _ip("netns", "del", ns, check=False)


def stop(procs: list[subprocess.Popen], grace: float = 10.0) -> list[int]:
    """SIGTERM each process's group (they were started with start_new_session), then SIGKILL
    what is left after `grace` seconds; returns the pids SIGTERM did not end."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    lingered = [p.pid for p in procs if p.poll() is None]
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=5)
    return lingered
