"""A real headless Chromium driven over the DevTools protocol on a pipe (--remote-debugging-pipe).

Why the pipe and not Selenium: no driver process whose version must match the browser, no
WebSocket client, no port to find; the protocol's own Network events show every request the
page makes. Chromium reads commands on fd 3 and writes replies and events on fd 4, each message
one JSON object ended by a NUL byte.

Also runnable: `python tests/support/browser.py demo-screenshot docs/dashboard.png` runs
`supervisor demo --dashboard` and photographs the dashboard once the demo's jobs are done.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import itertools
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# The flags that work on this machine's Debian chromium, headless, as root, offline.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio", "--remote-debugging-pipe")
CANDIDATES = ("chromium", "chromium-browser", "google-chrome")
COMMAND_TIMEOUT = 30.0


class BrowserError(RuntimeError):
    pass


def chromium_binary() -> str | None:
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """One headless Chromium with a fresh profile; close() leaves no process and no directory."""

    def __init__(self, binary: str):
        self.profile = Path(tempfile.mkdtemp(prefix="dash-chromium-"))
        self.log_path = self.profile / "chromium.log"
        cmd_r, self._cmd_w = os.pipe()
        self._resp_r, resp_w = os.pipe()

        def place_pipes() -> None:          # in the child: the protocol fds must be exactly 3 and 4
            a = fcntl.fcntl(cmd_r, fcntl.F_DUPFD, 10)
            b = fcntl.fcntl(resp_w, fcntl.F_DUPFD, 10)
            os.dup2(a, 3)
            os.dup2(b, 4)

        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [binary, *FLAGS, f"--user-data-dir={self.profile / 'profile'}", "about:blank"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, pass_fds=(3, 4),
                preexec_fn=place_pipes, start_new_session=True)
        os.close(cmd_r)
        os.close(resp_w)
        self._ids = itertools.count(1)
        self._replies: dict[int, queue.Queue] = {}
        self._lock = threading.Lock()
        self.events: queue.Queue[dict] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name="cdp-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(self._resp_r, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                self.events.put({"method": "_closed"})
                return
            buf += chunk
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                msg = json.loads(raw)
                if "id" in msg:
                    with self._lock:
                        box = self._replies.get(msg["id"])
                    if box is not None:
                        box.put(msg)
                else:
                    self.events.put(msg)

    def send(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = COMMAND_TIMEOUT) -> dict:
        msg_id = next(self._ids)
        box: queue.Queue = queue.Queue()
        with self._lock:
            self._replies[msg_id] = box
        msg: dict[str, Any] = {"id": msg_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        try:
            reply = box.get(timeout=timeout)
        except queue.Empty:
            raise BrowserError(f"{method}: no reply from chromium in {timeout:g}s; log:\n{self.log()}") from None
        finally:
            with self._lock:
                self._replies.pop(msg_id, None)
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def new_page(self, width: int = 1000, height: int = 1200) -> Page:
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, session)
        page.resize(width, height)
        for domain in ("Page", "Runtime", "Network"):
            page.send(f"{domain}.enable")
        return page

    def log(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-3000:]
        return ""

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(BrowserError, OSError):
                self.send("Browser.close", timeout=5.0)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)    # its zygote and renderers: the session we started
        self._reader.join(5.0)              # it sees the pipe close; then its fd can go
        for fd in (self._cmd_w, self._resp_r):
            with contextlib.suppress(OSError):
                os.close(fd)
        shutil.rmtree(self.profile, ignore_errors=True)


class Page:
    def __init__(self, browser: Browser, session: str):
        self.browser, self.session = browser, session
        self.requests: list[str] = []          # every URL the page asked for, in order

    def send(self, method: str, params: dict | None = None) -> dict:
        return self.browser.send(method, params, self.session)

    def resize(self, width: int, height: int) -> None:
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})

    def collect(self) -> None:
        """Take the events so far; keep the URL of every request this page made."""
        while True:
            try:
                ev = self.browser.events.get_nowait()
            except queue.Empty:
                return
            if ev.get("sessionId") == self.session and ev.get("method") == "Network.requestWillBeSent":
                self.requests.append(ev["params"]["request"]["url"])

    def goto(self, url: str, timeout: float = 20.0) -> None:
        """Navigate and wait until the new document has loaded (its scripts have started)."""
        reply = self.send("Page.navigate", {"url": url})
        if reply.get("errorText"):
            raise BrowserError(f"navigating to {url}: {reply['errorText']}")
        self.wait_for(f"location.href === {json.dumps(url)} && document.readyState === 'complete'", timeout,
                      f"{url} to load")

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True})
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 20.0, what: str = "") -> Any:
        """Poll a JS expression until truthy (the page updates itself; nothing to sleep on)."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            self.collect()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:g}s waiting for {what or expression}")
            time.sleep(0.05)

    def screenshot(self, path: Path) -> None:
        data = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})["data"]
        Path(path).write_bytes(base64.b64decode(data))


# ---------------------------------------------------------------- the README's picture

def demo_screenshot(out: Path, width: int = 900, jobs: int = 150) -> None:
    """Run the demo with the dashboard held open and photograph it mid-story: the crash is in
    the ledger, its job came back and was acked, and the queue is still draining."""
    binary = chromium_binary()
    if binary is None:
        raise SystemExit("chromium is not installed")
    demo = subprocess.Popen([sys.executable, "-m", "supervisor", "demo", "--jobs", str(jobs), "--dashboard", "30"],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    browser = None
    try:
        url = None
        for line in demo.stdout:
            sys.stdout.write(line)
            m = re.search(r"dashboard: (http://\S+)", line)
            if m:
                url = m.group(1)
                break
        if url is None:
            raise SystemExit("the demo printed no dashboard URL")
        holding = threading.Event()

        def echo() -> None:             # keep reading, or the demo blocks on a full pipe
            for line in demo.stdout:
                sys.stdout.write(line)
                if "dashboard stays up" in line:
                    holding.set()
        threading.Thread(target=echo, daemon=True).start()
        browser = Browser(binary)
        page = browser.new_page(width, 1000)
        page.goto(url)
        page.wait_for(f"""(() => {{ const s = window.dashboard.last().status;
            return s && s.crosscheck.held_jobs_acked_after_crash >= 1 && s.consumer.num_pending > 0
                   && s.consumer.num_pending < {jobs} * 0.5; }})()""", 60, "the crash told, still draining")
        page.resize(width, int(page.evaluate("document.documentElement.scrollHeight")))
        page.screenshot(out)
        print(f"wrote {out} ({out.stat().st_size} bytes)")
        holding.wait(60)                # let the demo finish its story before ending it
    finally:
        if browser:
            browser.close()
        if demo.poll() is None:
            demo.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            demo.wait(60)


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4) or sys.argv[1] != "demo-screenshot":
        raise SystemExit("usage: python tests/support/browser.py demo-screenshot OUT.png [WIDTH]")
    demo_screenshot(Path(sys.argv[2]), *(int(a) for a in sys.argv[3:]))
