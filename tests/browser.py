"""Headless Debian chromium through selenium, for the tests that look at a page as a reader
would (the chat page, the docs site). `make test` installs chromium as root where it can."""

from __future__ import annotations

import shutil
from contextlib import contextmanager
from typing import Iterator

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")


@contextmanager
def headless(*extra_args: str) -> Iterator:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", *extra_args):
        opts.add_argument(arg)
    drv = webdriver.Chrome(service=Service(DRIVER), options=opts)
    try:
        yield drv
    finally:
        drv.quit()
