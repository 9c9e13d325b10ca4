"""The heap policy the engine sets after loading (device.keep_freed_buffers): large buffers a
step frees are reused by the next steps instead of coming back as new zeroed pages, and what
the heap keeps stays bounded."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from pagedllm.device import keep_freed_buffers

glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="a glibc heap policy"
)

# slow: whole models, servers or builds; `make test-fast` leaves it out
pytestmark = pytest.mark.slow

# A fresh process (the policy is process-wide): rounds of a 48 MB buffer and a third of one,
# written and freed as a prefill's activations are; after 20 rounds, the page faults and the
# growth of the resident set over 40 more.
_ROUNDS = """
import json, resource, psutil, torch
from pagedllm.device import keep_freed_buffers

kept = keep_freed_buffers()
def round_(i):
    n = (48 << 20) + (i % 3) * 28672
    t = torch.empty(n, dtype=torch.uint8); t.fill_(1)
    u = torch.empty(n // 3, dtype=torch.uint8); u.fill_(1)
    del t, u
for i in range(20):
    round_(i)
faults, rss = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, psutil.Process().memory_info().rss
for i in range(40):
    round_(i)
print(json.dumps({"kept": kept, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
                  "growth_mb": (psutil.Process().memory_info().rss - rss) / 2**20}))
"""


def _rounds(keep: str) -> dict:
    env = dict(os.environ, PAGEDLLM_KEEP_BUFFERS=keep)
    out = subprocess.run([sys.executable, "-c", _ROUNDS], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc
def test_freed_large_buffers_are_reused_and_the_heap_stays_bounded():
    pages = (48 << 20) // 4096
    kept, default = _rounds("1"), _rounds("0")
    assert kept["kept"] and not default["kept"]
    # glibc's default maps a buffer this large anew each time (its mmap threshold stops at 32 MB)
    assert default["faults"] > 30 * pages, default
    assert kept["faults"] < 8 * pages, kept
    assert kept["growth_mb"] < 64, kept  # no creep: the heap reuses what it keeps


@glibc
def test_the_policy_can_be_left_off(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_KEEP_BUFFERS", "0")
    assert keep_freed_buffers() is False
