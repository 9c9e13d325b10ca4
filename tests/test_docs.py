"""The documentation site (issue 70): `mkdocs build --strict` succeeds on docs/ as it is, fails
when one internal link is broken, and two built pages render their navigation, a table and a
plot in headless Chromium."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# slow: a site build, and a browser; `make test-fast` leaves it out
pytestmark = pytest.mark.slow

try:
    import material  # noqa: F401  (mkdocs-material)
    import mkdocs  # noqa: F401
    import mkdocstrings  # noqa: F401

    HAVE_MKDOCS = True
except ImportError:
    HAVE_MKDOCS = False
needs_mkdocs = pytest.mark.skipif(
    not HAVE_MKDOCS,
    reason="mkdocs, mkdocs-material and mkdocstrings are not installed: "
    "pip install -e '.[docs]' (make docs and make test install them)",
)


def _build(project: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(project / "mkdocs.yml"), "-d", str(site)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=project,
        env={"PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1", "HOME": str(site.parent)},
    )


def _copy_project(dst: Path) -> Path:
    """The parts of the repository the build reads: mkdocs.yml, docs/ and the package (the API
    reference's docstrings)."""
    shutil.copy(ROOT / "mkdocs.yml", dst / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", dst / "docs")
    (dst / "tools").mkdir()
    shutil.copy(ROOT / "tools" / "mkdocs_hooks.py", dst / "tools" / "mkdocs_hooks.py")
    shutil.copytree(ROOT / "pagedllm", dst / "pagedllm", ignore=shutil.ignore_patterns("__pycache__", "*.so", "csrc"))
    return dst


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    if not HAVE_MKDOCS:
        pytest.skip("mkdocs is not installed: pip install -e '.[docs]'")
    out = tmp_path_factory.mktemp("site") / "site"
    r = _build(ROOT, out)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return out


@needs_mkdocs
def test_the_site_builds_in_strict_mode(site):
    for page in (
        "index.html",
        "installation/index.html",
        "server/index.html",
        "configuration/index.html",
        "reference/index.html",
        "design/activation-rounding/index.html",
        "benchmarks/compare-llamacpp/index.html",
    ):
        assert (site / page).is_file(), page
    # Every plot under docs/figures is shown on a page, and was copied into the site.
    pages = " ".join(p.read_text() for p in (ROOT / "docs").rglob("*.md"))
    for png in (ROOT / "docs" / "figures").glob("*.png"):
        assert f"figures/{png.name}" in pages, f"{png.name} is on no page"
        assert (site / "figures" / png.name).is_file(), png.name
    # The API reference is generated from the docstrings: LLM.generate's signature is there.
    ref = (site / "reference" / "index.html").read_text()
    assert "pagedllm.llm.LLM" in ref and "generate" in ref and "SamplingParams" in ref
    # Every variable of the configuration table made it into the page.
    from dataclasses import fields

    from pagedllm.settings import Settings

    page = (site / "configuration" / "index.html").read_text()
    for f in fields(Settings):
        assert f.metadata["env"] in page, f.metadata["env"]


@needs_mkdocs
def test_the_readmes_links_into_docs_resolve(site):
    """README.md is not part of the site, so the build does not check its links: here each
    `docs/PAGE.md#anchor` it names must be a built page with that anchor, and every other
    relative link a file of the repository."""
    import re

    links = re.findall(r"\]\(([^)#\s]+)(?:#([^)\s]+))?\)", (ROOT / "README.md").read_text())
    assert links
    for target, anchor in links:
        if "://" in target:
            continue
        assert (ROOT / target).exists(), target
        if target.startswith("docs/") and target.endswith(".md"):
            rel = target[len("docs/") : -len(".md")]
            html = site / (rel[: -len("index")] if rel.endswith("index") else rel + "/") / "index.html"
            assert html.is_file(), target
            if anchor:
                assert f'id="{anchor}"' in html.read_text(), f"{target}#{anchor}: no such anchor"


@needs_mkdocs
@pytest.mark.parametrize("broken", ["page", "anchor"])
def test_a_broken_internal_link_fails_the_build(tmp_path, broken):
    (tmp_path / "project").mkdir()
    project = _copy_project(tmp_path / "project")
    page = project / "docs" / "quickstart.md"
    text = page.read_text()
    if broken == "page":
        bad = text.replace("(python-api.md)", "(python-apix.md)", 1)
    else:
        bad = text.replace("(cli.md)", "(cli.md#no-such-heading)", 1)
    assert bad != text
    page.write_text(bad)
    r = _build(project, tmp_path / "site")
    assert r.returncode != 0, "a broken link built without an error"
    out = r.stdout + r.stderr
    assert "quickstart.md" in out and ("python-apix.md" in out if broken == "page" else "no-such-heading" in out), out


from browser import CHROMIUM, DRIVER, headless  # noqa: E402


@pytest.fixture(scope="module")
def browser():
    pytest.importorskip("selenium.webdriver")
    if not (CHROMIUM and DRIVER):
        pytest.skip(
            "Debian's chromium and chromium-driver are not installed (make test installs them as root); "
            "playwright's browsers come from its own download server, not the package registry"
        )
    with headless("--allow-file-access-from-files") as drv:
        yield drv


@needs_mkdocs
@pytest.mark.parametrize(
    "page,plot",
    [("benchmarks/index.html", "bench-serve.png"), ("benchmarks/speculative/index.html", "bench-speculative.png")],
)
def test_built_pages_render_navigation_a_table_and_a_plot(site, browser, page, plot):
    from selenium.webdriver.common.by import By

    browser.get((site / page).as_uri())
    # The navigation: the theme's sidebar links every page of the user guide.
    nav = browser.find_elements(By.CSS_SELECTOR, "nav.md-nav--primary a.md-nav__link")
    labels = {a.get_attribute("textContent").strip() for a in nav}
    assert {"Installation", "Server", "Configuration"} <= labels, labels
    # A table with rows that have cells.
    rows = browser.find_elements(By.CSS_SELECTOR, "article table tbody tr")
    assert rows and rows[0].find_elements(By.TAG_NAME, "td"), "no table rendered"
    # The plot: the image loaded (a broken image has naturalWidth 0) and is laid out on the page.
    img = next(
        i for i in browser.find_elements(By.CSS_SELECTOR, "article img") if i.get_attribute("src").endswith(plot)
    )
    loaded = browser.execute_script("return arguments[0].complete && arguments[0].naturalWidth", img)
    assert loaded and loaded > 300, f"{plot} did not load"
    assert img.size["width"] > 100 and img.size["height"] > 50, img.size


def test_the_configuration_page_lists_every_engine_option_as_declared(site):
    # The table is made at build from the declarations (tools/mkdocs_hooks.py): an option added
    # to pagedllm/config/engine.py appears here with its flags, and the marker never shows.
    from pagedllm.config import engine_options

    page = (site / "configuration" / "index.html").read_text()
    assert "<!-- engine-options -->" not in page
    for o in engine_options():
        assert f"<code>{o.name}</code>" in page, o.name
        if o.cli and not (o.type is bool and o.default):
            assert f"<code>{o.flag}</code>" in page, o.flag
