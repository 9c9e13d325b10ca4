"""Kernel routes and tuning knobs (pagedllm/tuning.py): out of the environment, one parser for
Python and the native library, set by benchmarks' `--tune` and carried to worker processes."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm import settings, tuning
from pagedllm.quant import kernels as qk

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "pagedllm"


def test_no_knob_is_an_environment_variable():
    knob_vars = set(tuning.RETIRED)
    setting_vars = {settings.env_name(f) for f in settings.Settings.__dataclass_fields__}
    assert not knob_vars & setting_vars
    used = {
        m
        for p in [*PKG.rglob("*.py"), *(PKG / "native" / "csrc").iterdir(), ROOT / "setup.py"]
        if p.suffix in (".py", ".cpp", ".h") and p.name != "tuning.py"
        for m in re.findall(r"PAGEDLLM_[A-Z0-9_]+", p.read_text())
    }
    assert not used & knob_vars, f"still named in the package: {sorted(used & knob_vars)}"


def test_the_docs_table_lists_the_knobs():
    text = (ROOT / "docs" / "benchmarks" / "tuning.md").read_text()
    assert tuning.table() in text


def test_a_knob_takes_effect_at_its_next_use_and_comes_back(tune):
    tune(quant_wide="int", quant_int_rows="7")
    assert qk.wide_mode() == "int" and qk.int_rows() == 7
    with tuning.tuned(quant_wide="gemm"):
        assert qk.wide_mode() == "gemm" and qk.int_rows() == 7
    assert qk.wide_mode() == "int"


def test_bad_knobs_and_values_are_refused_by_name(tune):
    with pytest.raises(ValueError, match="quant_act='int4' is not one of auto, int8, int8x2"):
        tune(quant_act="int4")
    with pytest.raises(ValueError, match="quant_head_recheck='many' is not an integer"):
        tune(quant_head_recheck="many")
    with pytest.raises(ValueError, match="'quant_fast' is not a tuning knob; the knobs: amx, "):
        tune(quant_fast=True)
    with pytest.raises(ValueError, match="amx='maybe' is not a boolean"):
        tune(amx="maybe")
    assert tuning.current() == tuning.Tuning()  # nothing half-set


def test_the_native_library_takes_its_knobs_from_python(tune):
    from pagedllm.quant.weight_memory import weight_memory

    if weight_memory() is None:
        pytest.skip("no native kernels here")
    tune(prefetch_bytes="512")
    assert weight_memory().prefetch == 512
    tune(prefetch_bytes=None)
    assert weight_memory().prefetch != 512
    if qk.amx_rows() == 0:
        pytest.skip("no AMX-BF16 on this CPU: the AMX knobs have nothing to switch")
    tune(amx_rows=8)
    assert qk.amx_rows() == 8
    tune(amx="false")
    assert qk.amx_rows() == 0


def test_a_retired_variable_is_named_in_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="pagedllm.tuning"):
        found = tuning.warn_retired({"PAGEDLLM_QUANT_WIDE": "gemm", "PAGEDLLM_TP_TIMEOUT_S": "5"})
    assert found == ["PAGEDLLM_QUANT_WIDE"]
    assert "--tune quant_wide=VALUE" in caplog.text


def test_a_worker_spec_carries_rank_0s_tuning(tune):
    from pagedllm.distributed.worker import WorkerSpec

    tune(quant_wide="gemm")
    spec = WorkerSpec(None, None, "cpu", None, False, None, None, 1)
    assert spec.tuning["quant_wide"] == "gemm"


def test_bench_tune_flag_is_checked_before_anything_loads():
    out = subprocess.run(
        [sys.executable, "-m", "pagedllm", "bench", "quality", "--tune", "quant_wide=fast"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "quant_wide='fast' is not one of auto, gemm, int" in out.stderr, out.stderr
