"""Headless Chromium (Debian's ``chromium``) for tests that look at a real web page.

One Chromium process per page: it loads the URL, lets the page's scripts and
fetches settle (``--virtual-time-budget``; virtual time stands still while a fetch
is pending, so a slow server only makes it slower), then writes the rendered DOM to
stdout and a PNG screenshot, and exits. No driver package and no browser download:
``make test`` installs the Debian package (see the Makefile's ``$(CHROMIUM)`` rule).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

from gpu_runtime.proc.processes import spawn, stop_pid

CHROMIUM = os.environ.get("MILESTONE_CHROMIUM", "/usr/bin/chromium")

# The background-networking flags matter here: without them Chromium dials out
# (component updates, sync, QUIC probes), and this machine refuses the connections.
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--hide-scrollbars", "--disable-dev-shm-usage",
]


@dataclass(frozen=True)
class RenderedPage:
    url: str
    dom: str
    text: str  # the visible text, whitespace collapsed to single spaces
    screenshot: Path


class _Text(HTMLParser):
    """The text of a DOM without its <script> and <style> bodies."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag in ("script", "style"):
            self._skip += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style") and self._skip:
            self._skip -= 1

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self.parts.append(data)


def visible_text(dom: str) -> str:
    parser = _Text()
    parser.feed(dom)
    return " ".join(" ".join(parser.parts).split())


def render(url: str, screenshot: Path, workdir: Path, *, size: tuple[int, int] = (1400, 1000),
           budget_ms: int = 15_000, timeout_s: float = 120.0) -> RenderedPage:
    """Load ``url`` in a fresh headless Chromium profile; the DOM, its text and a screenshot.
    The process (and its renderer / zygote children, one process group) is stopped by pid."""
    if not os.access(CHROMIUM, os.X_OK):
        raise FileNotFoundError(
            f"{CHROMIUM} not found: `make test` installs it (apt-get install chromium), "
            "or point MILESTONE_CHROMIUM at a Chromium binary"
        )
    workdir.mkdir(parents=True, exist_ok=True)
    profile = tempfile.mkdtemp(prefix="profile-", dir=workdir)  # a fresh profile for every page
    cmd = [
        CHROMIUM, *FLAGS, f"--user-data-dir={profile}", f"--window-size={size[0]},{size[1]}",
        f"--virtual-time-budget={budget_ms}", f"--screenshot={screenshot}", "--dump-dom", url,
    ]
    proc = spawn(cmd, workdir / f"chromium-{screenshot.stem}.log", stdout_pipe=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired as err:
        raise TimeoutError(f"chromium did not finish {url} within {timeout_s}s") from err
    finally:
        stop_pid(proc.pid, proc)  # the browser's helper processes share its process group
    if proc.returncode != 0:
        raise RuntimeError(f"chromium exited {proc.returncode} on {url}: see {workdir}")
    dom = out.decode("utf-8", "replace")
    return RenderedPage(url=url, dom=dom, text=visible_text(dom), screenshot=screenshot)
