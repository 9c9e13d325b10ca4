"""Replicas behind SGLang's model gateway (PyPI `sglang-router`): `pagedllm serve --data-parallel-size N`
and `pagedllm router --backend URL ...`.

Routing, retries, circuit breaking and health checks are the gateway's; this module only starts it
with pagedllm's settings, starts and restarts the local replicas (each its own `pagedllm serve`
process, pinned to its share of the cores), and stops them all on SIGTERM/SIGINT.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

logger = logging.getLogger(__name__)

POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
INSTALL_HINT = (
    "the gateway is SGLang's sglang-router: pip install 'pagedllm[router]' (or pip install sglang-router==0.3.2)"
)


def require_gateway() -> None:
    if importlib.util.find_spec("sglang_router") is None:
        raise RuntimeError(f"sglang-router is not installed; {INSTALL_HINT}")


@dataclass
class FaultOptions:
    """The gateway's fault handling, under pagedllm's names. The defaults take a dead replica out
    of routing within health_interval * health_failures + health_timeout seconds (about 3 s) and
    retry a request that got no answer once on another replica."""

    retries: int = 1  # tries after the first, each on a worker the policy picks again
    retry_backoff_ms: int = 50
    health_interval: int = 1  # seconds between health checks of each replica
    health_timeout: int = 2  # a /health slower than this counts as a failure
    health_failures: int = 2  # failed checks in a row before a replica is out of routing
    health_successes: int = 1  # passed checks in a row before it is back in
    breaker_failures: int = 3  # failed requests in a row that open a replica's circuit breaker
    breaker_open_s: int = 5  # how long an open breaker keeps the replica out before a trial request
    request_timeout_s: int = 1800

    def argv(self) -> list[str]:
        return [
            "--retry-max-retries",
            str(self.retries),
            "--retry-initial-backoff-ms",
            str(self.retry_backoff_ms),
            "--retry-max-backoff-ms",
            str(max(self.retry_backoff_ms, 500)),
            "--health-check-interval-secs",
            str(self.health_interval),
            "--health-check-timeout-secs",
            str(self.health_timeout),
            "--health-failure-threshold",
            str(self.health_failures),
            "--health-success-threshold",
            str(self.health_successes),
            "--health-check-endpoint",
            "/health",
            "--cb-failure-threshold",
            str(self.breaker_failures),
            "--cb-timeout-duration-secs",
            str(self.breaker_open_s),
            "--request-timeout-secs",
            str(self.request_timeout_s),
        ]


def gateway_command(
    workers: Sequence[str],
    host: str,
    port: int,
    policy: str,
    faults: FaultOptions,
    prometheus_port: int,
    log_level: str = "warn",
    api_key: str | None = None,
) -> list[str]:
    if policy not in POLICIES:
        raise ValueError(f"--routing {policy!r}: choose one of {', '.join(POLICIES)}")
    cmd = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--host",
        host,
        "--port",
        str(port),
        "--worker-urls",
        *workers,
        "--policy",
        policy,
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(prometheus_port),
        "--log-level",
        log_level,
        "--worker-startup-timeout-secs",
        "600",
        *faults.argv(),
    ]
    if api_key:
        cmd += ["--api-key", api_key]
    return cmd


def _child_setup(cores: Sequence[int] | None) -> None:
    """In the child before exec: pinned to `cores`, and sent SIGTERM if the supervising process
    dies (even by SIGKILL), so no replica or gateway outlives it."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if cores:
        os.sched_setaffinity(0, cores)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float, path: str = "/health") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url} exited with status {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + path, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} was not ready after {timeout:.0f} s")


def split_cores(n: int, cores: Sequence[int] | None = None) -> list[list[int]]:
    """The cores this process may use, split into n shares as even as they go (a share per
    replica; with fewer cores than replicas, replicas share cores round robin)."""
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if len(cores) >= n:
        k, extra = divmod(len(cores), n)
        shares, at = [], 0
        for i in range(n):
            size = k + (1 if i < extra else 0)
            shares.append(cores[at : at + size])
            at += size
        return shares
    return [[cores[i % len(cores)]] for i in range(n)]


class Replica:
    """One `pagedllm serve` process on 127.0.0.1:port, pinned to `cores`."""

    def __init__(self, index: int, serve_args: Sequence[str], port: int, cores: Sequence[int], log_dir: Path) -> None:
        self.index, self.port, self.cores = index, port, list(cores)
        self.url = f"http://127.0.0.1:{port}"
        self.cmd = [sys.executable, "-m", "pagedllm", "serve", *serve_args, "--host", "127.0.0.1", "--port", str(port)]
        self.log_path = log_dir / f"replica-{index}.log"
        self.proc: subprocess.Popen | None = None
        self.restarts = 0

    def start(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=str(len(self.cores)))
        cores = self.cores
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=env,
                preexec_fn=lambda: _child_setup(cores),
            )

    def died(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None


class Fleet:
    """The gateway and, for `serve --data-parallel-size`, the local replicas it routes to."""

    def __init__(
        self,
        replicas: list[Replica],
        remote: Sequence[str],
        host: str,
        port: int,
        policy: str,
        faults: FaultOptions,
        log_dir: Path,
        api_key: str | None = None,
        log_level: str = "warn",
    ) -> None:
        require_gateway()
        self.replicas, self.host, self.port = replicas, host, port
        self.workers = [r.url for r in replicas] + list(remote)
        self.prometheus_port = free_port()
        self.gateway_cmd = gateway_command(
            self.workers, host, port, policy, faults, self.prometheus_port, log_level, api_key
        )
        self.gateway_log = log_dir / "gateway.log"
        self.gateway: subprocess.Popen | None = None
        self.stopping = False

    @property
    def url(self) -> str:
        return f"http://{'127.0.0.1' if self.host in ('0.0.0.0', '::') else self.host}:{self.port}"

    def start(self, timeout: float = 600) -> None:
        for r in self.replicas:
            r.start()
        for r in self.replicas:
            wait_healthy(r.url, r.proc, timeout)
        with open(self.gateway_log, "ab") as log:
            self.gateway = subprocess.Popen(
                self.gateway_cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                preexec_fn=lambda: _child_setup(None),
            )
        wait_healthy(self.url, self.gateway, 120, path="/readiness")

    def watch(self, poll_s: float = 0.5) -> None:
        """Until stop(): a replica that died is started again (the gateway's health checks put it
        back into routing once it answers); the gateway dying ends the fleet."""
        while not self.stopping:
            if self.gateway is not None and self.gateway.poll() is not None and not self.stopping:
                raise RuntimeError(f"the gateway exited with status {self.gateway.returncode}; see {self.gateway_log}")
            for r in self.replicas:
                if r.died() and not self.stopping:
                    r.restarts += 1
                    logger.warning(
                        "replica %d (%s) exited with status %s: restarting it (restart %d)",
                        r.index,
                        r.url,
                        r.proc.returncode,
                        r.restarts,
                    )
                    r.start()
            time.sleep(poll_s)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to the gateway, then to every replica (each drains as `pagedllm serve` does);
        whatever is still running after grace_s gets SIGKILL."""
        self.stopping = True
        procs = [p for p in [self.gateway, *(r.proc for r in self.replicas)] if p is not None]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def read_backends(values: Sequence[str]) -> list[str]:
    """--backend values: URLs, or @FILE / a file path holding one URL a line (# comments)."""
    urls: list[str] = []
    for v in values:
        path = Path(v[1:] if v.startswith("@") else v)
        if not v.startswith(("http://", "https://")) and path.is_file():
            for line in path.read_text().splitlines():
                line = line.split("#", 1)[0].strip()
                if line:
                    urls.append(line)
        else:
            urls.append(v)
    for u in urls:
        if not u.startswith(("http://", "https://")):
            raise ValueError(f"--backend {u!r}: give a URL such as http://10.0.0.2:8000 or a file of URLs")
    if not urls:
        raise ValueError("no backends: give --backend URL (repeatable) or --backend FILE")
    return [u.rstrip("/") for u in urls]


def run_until_signal(fleet: Fleet) -> int:
    """Start the fleet, watch it, stop everything on SIGTERM/SIGINT."""

    def on_signal(sig: int, _frame: object) -> None:
        fleet.stopping = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        fleet.start()
        local = ", ".join(f"{r.url} (cores {r.cores})" for r in fleet.replicas)
        print(
            f"gateway on {fleet.url}/v1 (metrics on http://127.0.0.1:{fleet.prometheus_port}/metrics) "
            f"routing to {', '.join(fleet.workers)}" + (f"; replicas: {local}" if local else ""),
            file=sys.stderr,
            flush=True,
        )
        fleet.watch()
        return 0
    except RuntimeError as e:
        if fleet.stopping:
            return 0
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        fleet.stop()
        for s, h in old.items():
            signal.signal(s, h)
