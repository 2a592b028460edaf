"""A real browser for the tests: Debian's headless `chromium`, driven through `chromedriver`'s W3C WebDriver
endpoints over HTTP on 127.0.0.1 — the protocol selenium speaks, a handful of calls, no client package.

`.ci/run` installs both (`apt-get install chromium chromium-driver`); where either is absent, `browser()` says so
and the test that needs it skips with that reason."""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

from gaeq.runtime.dist import free_port
from tests.processes import running

ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
        "--window-size=1600,1100"]  # fmt: skip
"""As root, without a display or a GPU (WebGL draws nothing there: a page is asked for its SVG rendering)."""


def missing() -> str | None:
    """Why no browser can run here, or None."""
    absent = [name for name in ("chromium", "chromedriver") if shutil.which(name) is None]
    return f"{' and '.join(absent)} not installed (apt-get install chromium chromium-driver)" if absent else None


class Page:
    """One browser session: where it is, what its script returns, a screenshot."""

    def __init__(self, endpoint: str, session: str) -> None:
        self._at = f"{endpoint}/session/{session}"

    def _call(self, method: str, path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self._at + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return json.loads(response.read())["value"]
        except urllib.error.HTTPError as exc:  # the driver's own words: what failed in the page
            raise AssertionError(f"{method} {path}: {json.loads(exc.read()).get('value', {}).get('message')}") from exc

    def open(self, url: str) -> None:
        self._call("POST", "/url", {"url": url})

    def run(self, script: str, *args):
        """The value of `script` (a function body: `return …`) run in the page."""
        return self._call("POST", "/execute/sync", {"script": script, "args": list(args)})

    def until(self, script: str, *, seconds: float = 60.0):
        """`script`'s value once it is truthy; its last value when `seconds` have passed."""
        deadline, value = time.monotonic() + seconds, None
        while time.monotonic() < deadline:
            if value := self.run(script):
                return value
            time.sleep(0.5)
        return value

    def screenshot(self) -> bytes:
        return base64.b64decode(self._call("GET", "/screenshot"))


@contextlib.contextmanager
def browser() -> Iterator[Page]:
    """A headless chromium session, its driver stopped however the test ends."""
    port = free_port()
    with running(["chromedriver", f"--port={port}"], stdout=subprocess.DEVNULL) as driver:
        endpoint = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            assert driver.poll() is None, "chromedriver exited"
            try:
                urllib.request.urlopen(f"{endpoint}/status", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "chromedriver did not answer in 30 s"
                time.sleep(0.2)
        options = {"binary": shutil.which("chromium"), "args": ARGS}
        body = {"capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": options}}}
        request = urllib.request.Request(f"{endpoint}/session", data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=60) as response:
            session = json.loads(response.read())["value"]["sessionId"]
        page = Page(endpoint, session)
        try:
            yield page
        finally:
            with contextlib.suppress(OSError):
                page._call("DELETE", "")
