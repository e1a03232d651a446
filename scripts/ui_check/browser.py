"""Headless Chromium (Debian's, through playwright) as a person uses it: open a page, wait for its text, shoot it."""

from __future__ import annotations

import os
import re
from pathlib import Path

from scripts.ui_check.checks import SCREENSHOTS, Shot

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
VIEWPORT = {"width": 1400, "height": 900}
MAX_PNG_BYTES = 400_000


class Browser:
    """One page of headless Chromium at VIEWPORT, in the light theme; screenshots go into `out`. `credentials`
    ({"username", "password", "origin"}): what the browser answers a site's own sign-in prompt (HTTP basic
    auth, which headless Chromium cannot show) with, for that origin only."""

    def __init__(self, out: Path, credentials: dict[str, str] | None = None) -> None:
        from playwright.sync_api import sync_playwright

        self.out = out
        self._playwright = sync_playwright().start()
        self._browser = self._playwright.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"]
        )
        self.context = self.new_context(credentials)
        self.context.set_default_timeout(30_000)
        self.page = self.context.new_page()
        self.console: list[str] = []
        self.page.on("console", lambda msg: msg.type == "error" and self.console.append(msg.text))

    def new_context(self, credentials: dict[str, str] | None = None):
        return self._browser.new_context(
            viewport=VIEWPORT, device_scale_factor=1, color_scheme="light", http_credentials=credentials
        )

    def close(self) -> None:
        try:
            self._browser.close()
        finally:
            self._playwright.stop()

    def goto(self, url: str, *, wait_for: str | None = None, settle: float = 1.0) -> None:
        """Opens `url` and waits until the page shows `wait_for` (a regex on its visible text), then settles."""
        self.page.goto(url, wait_until="domcontentloaded")
        self.idle()
        if wait_for:
            self.wait_text(wait_for)
        self.page.wait_for_timeout(settle * 1000)

    def wait_text(self, pattern: str, timeout: float = 45.0) -> None:
        """Waits until the page's visible text matches `pattern` (spinners and skeletons never do)."""
        self.page.wait_for_function(
            "([source, flags]) => new RegExp(source, flags).test(document.body.innerText)",
            arg=js_regex(pattern),
            timeout=timeout * 1000,
        )
        self.idle(2.0)

    def idle(self, timeout: float = 5.0) -> None:
        """Waits (a little) for the network to settle; pages that poll (both UIs do) never quite go idle."""
        try:
            self.page.wait_for_load_state("networkidle", timeout=timeout * 1000)
        except Exception:  # The text waits decide whether a page is ready.
            pass

    def text(self) -> str:
        return self.page.inner_text("body")

    def shoot(self, key: str, *, full_page: bool = False) -> Shot:
        self.page.evaluate("() => document.activeElement && document.activeElement.blur()")  # No focus rings.
        self.page.mouse.move(0, VIEWPORT["height"] - 1)  # No hover cards.
        path = self.out / SCREENSHOTS[key]
        self.page.screenshot(path=str(path), full_page=full_page)
        shrink_png(path)
        return Shot(text=f"{self.text()}\n--- url\nurl: {self.page.url}", path=path)


def js_regex(pattern: str) -> list[str]:
    """A Python regex with leading inline flags ((?m), (?i)) as [source, flags] for JavaScript's RegExp."""
    match = re.match(r"\(\?([im]+)\)", pattern)
    return [pattern[match.end() :], match.group(1)] if match else [pattern, ""]


def shrink_png(path: Path) -> None:
    """Keeps a screenshot under MAX_PNG_BYTES: fewer colours (visually the same for UI pages)."""
    if path.stat().st_size <= MAX_PNG_BYTES:
        return
    from PIL import Image

    with Image.open(path) as image:
        for colors in (256, 128, 64):
            image.convert("RGB").quantize(colors=colors, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
            if path.stat().st_size <= MAX_PNG_BYTES:
                return
