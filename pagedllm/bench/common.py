"""Shared pieces of the benchmarks: percentiles, medians over runs, JSON output, waiting for a
server they started."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import platform
import statistics
import time
from pathlib import Path


logger = logging.getLogger(__name__)


def percentile(xs: list[float], q: float, empty: float | None = float("nan")) -> float | None:
    """The q-th percentile of `xs`, linearly interpolated; `empty` when there is none."""
    if not xs:
        return empty
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def median_of_runs(runs: list[dict]) -> dict:
    """Field-wise median of numeric results of several runs."""
    out = {}
    for key in runs[0]:
        vals = [r[key] for r in runs]
        out[key] = statistics.median(vals) if all(isinstance(v, (int, float)) for v in vals) else vals[0]
    return out


def machine_info() -> dict:
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def write_json(path: str | os.PathLike, data: dict) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(data, indent=2, default=str))
    return p


def wait_ready(url: str, proc, timeout: float = 300, path: str = "/health") -> None:
    """Wait until the server `proc` answers `path` at `url`; an error when it exits or times out."""
    import httpx

    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}{path}", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not become ready")


def stop_server(proc) -> None:
    """End a server process: SIGTERM, then SIGKILL if it is still there after 30 s."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def pyplot():
    """matplotlib's pyplot on its file-only backend (Agg), imported only when a benchmark is asked
    to draw (`--plot PATH`), so the benchmarks run without the `plot` extra. None, after a line
    saying how to install it, where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib: pip install 'pagedllm[plot]'", flush=True)
        return None
    return plt


def save_figure(fig, path: str | os.PathLike) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(p, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    print(f"plot written to {p}", flush=True)
    return p
