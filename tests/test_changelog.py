"""CHANGELOG.md is in Keep a Changelog's form, and its latest version is the one
`pagedllm --version` prints (pagedllm/_version.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VERSION = re.compile(r"^## \[(\d+\.\d+\.\d+(?:[-.]?\w+)*)\] - (\d{4}-\d{2}-\d{2})$", flags=re.M)


def _versions() -> list[tuple[str, str]]:
    return VERSION.findall((ROOT / "CHANGELOG.md").read_text())


def test_the_changelog_has_keep_a_changelogs_shape():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert text.startswith("# Changelog\n")
    assert "keepachangelog.com" in text
    assert re.search(r"^## \[Unreleased\]$", text, flags=re.M)
    versions = _versions()
    assert versions, "no released version heading such as '## [0.1.0] - 2026-12-06'"
    dates = [d for _, d in versions]
    assert dates == sorted(dates, reverse=True), "versions must be newest first"
    # Each section's entries sit under Keep a Changelog's own headings.
    for kind in re.findall(r"^### (.+)$", text, flags=re.M):
        assert kind in {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}, kind


def test_pagedllm_version_matches_the_latest_changelog_version():
    latest = _versions()[0][0]
    r = subprocess.run([sys.executable, "-m", "pagedllm", "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"pagedllm {latest}", (r.stdout, latest)
    from pagedllm import __version__

    assert __version__ == latest
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(rf'^version = "{re.escape(latest)}"$', pyproject, flags=re.M), "pyproject.toml's version differs"
