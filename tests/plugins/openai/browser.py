"""Headless Chromium for the page tests, driven by Selenium through Debian's chromedriver.

``make browser`` (a prerequisite of ``make test``) installs ``chromium`` and
``chromium-driver`` with apt when it can; where they are missing the tests that
need them skip and say so. Screenshots go to ``test-artifacts/web/`` at the
repository root (ignored by git), one per page.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

ARTIFACTS = Path(__file__).parents[3] / "test-artifacts" / "web"
#: Flags that work in a container as root, with no network beyond 127.0.0.1.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1280,860",
)

#: Seconds one WebDriver command may wait for the browser (selenium waits for ever by default).
COMMAND_TIMEOUT = 60


def missing_browser() -> str | None:
    """Why the browser tests cannot run here (None: they can)."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -r requirements-dev.txt)"
    for tool, package in (("chromium", "chromium"), ("chromedriver", "chromium-driver")):
        if shutil.which(tool) is None:
            return (
                f"{tool} is not installed: `make browser` installs Debian's chromium and "
                f"chromium-driver (as root, with apt-get), or apt-get install {package}"
            )
    return None


@contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium WebDriver with a fresh profile (skips the test where there is none)."""
    reason = missing_browser()
    if reason is not None:
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    with tempfile.TemporaryDirectory(prefix="baton-chromium-") as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = shutil.which("chromium") or "chromium"
        for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
            options.add_argument(flag)
        service = Service(shutil.which("chromedriver"))
        driver = webdriver.Chrome(options=options, service=service)
        # a page that hangs fails the command that waits on it, not the whole test's time
        driver.command_executor.client_config.timeout = COMMAND_TIMEOUT
        try:
            yield driver
        finally:
            driver.quit()


def wait_until(driver: Any, condition: Callable[[Any], Any], what: str, timeout: float = 30) -> Any:
    """``condition(driver)``'s first truthy value; fails naming ``what`` after ``timeout`` s."""
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(
        condition, message=f"timed out waiting for {what}"
    )


def text_of(driver: Any, selector: str) -> str:
    """The text of the first element ``selector`` matches ('' when none does)."""
    return str(
        driver.execute_script(
            "const n = document.querySelector(arguments[0]); return n ? n.textContent : '';",
            selector,
        )
    )


def screenshot(driver: Any, name: str) -> Path:
    """Save the whole page as ``test-artifacts/web/<name>.png`` and print where."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    size = driver.get_window_size()
    # the pages scroll inside <main>, under a fixed header
    height = driver.execute_script(
        "const main = document.querySelector('main'), top = document.querySelector('header');"
        "return (main ? main.scrollHeight : 0) + (top ? top.offsetHeight : 0);"
    )
    driver.set_window_size(size["width"], max(size["height"], height + 100))
    try:
        driver.save_screenshot(str(path))
    finally:
        driver.set_window_size(size["width"], size["height"])
    print(f"screenshot: {path}")
    return path


def browser_errors(driver: Any) -> list[str]:
    """Console errors the page logged (a CSP violation included), but the 401s by which a page
    learns that the server wants an API key."""
    return [
        e["message"]
        for e in driver.get_log("browser")
        if e.get("level") == "SEVERE" and "status of 401" not in e["message"]
    ]
