"""A real headless browser for page tests: Debian's chromium driven by Playwright (never a browser Playwright
downloads itself), and a screenshot command.

    python -m tests.browser URL OUT.png     # a full-page screenshot of URL
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sys

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def chromium_path() -> str | None:
    """The system's chromium (Debian's package: /usr/bin/chromium), or $WANEXP_CHROMIUM."""
    return os.environ.get("WANEXP_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


def missing() -> str | None:
    """Why no browser test can run here (chromium or playwright absent), or None."""
    if chromium_path() is None:
        return "no chromium on this machine (apt-get install chromium chromium-driver; .ci/run installs it)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (requirements.lock pins it)"
    return None


@contextlib.contextmanager
def page(width: int = 1400, height: int = 1000):
    """A fresh page of a headless chromium; closed (with its browser) on exit."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS, headless=True)
        try:
            yield browser.new_page(viewport={"width": width, "height": height})
        finally:
            browser.close()


def screenshot(url: str, out: str) -> None:
    """A full-page screenshot of the live run page once its first update is drawn."""
    with page() as p:
        p.goto(url)
        p.wait_for_function("() => document.getElementById('conn').textContent.startsWith('live')")
        p.wait_for_function("() => [...document.querySelectorAll('video')].every(v => v.readyState >= 4)",
                            timeout=30_000)  # each video loaded
        p.wait_for_timeout(3000)  # the players' loading animation fades
        p.screenshot(path=out, full_page=True)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m tests.browser URL OUT.png")
    screenshot(sys.argv[1], sys.argv[2])
