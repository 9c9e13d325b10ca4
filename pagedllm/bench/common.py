"""Shared pieces of the benchmarks: percentiles, medians over runs, JSON output."""
from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import time
from pathlib import Path


logger = logging.getLogger(__name__)


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
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

    return {"python": platform.python_version(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "machine": platform.machine(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def write_json(path: str | os.PathLike, data: dict) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(data, indent=2, default=str))
    return p
