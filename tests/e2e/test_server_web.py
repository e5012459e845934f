"""The web chat page in headless Chromium (Debian's `chromium` package), against a keyed server.

Drives the browser over the Chrome DevTools Protocol with the `websockets` client the project
already depends on: types an API key and a message with real input events, watches the answer
stream into the page, and saves a screenshot (to docs/web-chat.png when TOKIOS_UPDATE_SCREENSHOT=1).
Skips only when no Chromium binary is installed.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from conftest import SMALL_SERVER_FLAG_KEY as API_KEY

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
ANSWER_TIMEOUT_S = 180.0
SCREENSHOT_PATH = Path(__file__).resolve().parents[2] / "docs" / "web-chat.png"

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install -y chromium)")


class Browser:
    """One headless Chromium with one page, spoken to over CDP (request/response by id)."""

    def __init__(self, user_data_dir: Path):
        from websockets.sync.client import connect

        self.process = subprocess.Popen(
            [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--no-default-browser-check", "--remote-debugging-port=0",
             "--remote-allow-origins=*", f"--user-data-dir={user_data_dir}", "--window-size=1000,760",
             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)  # its own process group, so close() can reap its helpers too
        port_file = user_data_dir / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"Chromium did not start (exit code {self.process.poll()})")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
        page = next(target for target in targets if target["type"] == "page")
        self._exit_stack = contextlib.ExitStack()
        self.socket = self._exit_stack.enter_context(
            connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=30))
        self._ids = itertools.count(1)

    def call(self, method: str, **params) -> dict:
        message_id = next(self._ids)
        self.socket.send(json.dumps({"id": message_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv(timeout=60))
            if message.get("id") == message_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout_s} s for {expression}")
            time.sleep(0.05)

    def type_into(self, element_id: str, text: str) -> None:
        self.evaluate(f"document.getElementById({element_id!r}).focus()")
        self.call("Input.insertText", text=text)

    def press_enter(self) -> None:
        for event_type in ("keyDown", "keyUp"):
            text = {"text": "\r"} if event_type == "keyDown" else {}
            self.call("Input.dispatchKeyEvent", type=event_type, key="Enter", code="Enter",
                      windowsVirtualKeyCode=13, nativeVirtualKeyCode=13, **text)

    def screenshot(self) -> bytes:
        return base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])

    def close(self) -> None:
        try:
            self._exit_stack.close()
        finally:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
            try:  # renderer and zygote helpers may outlive the browser process for a moment
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture(scope="module")
def keyed_server(small_keyed_server):
    return small_keyed_server


@pytest.fixture
def browser():
    # Chromium may still be flushing its profile while the directory is removed; that is harmless.
    with tempfile.TemporaryDirectory(prefix="tokios-chromium-", ignore_cleanup_errors=True) as user_data_dir:
        browser = Browser(Path(user_data_dir))
        try:
            yield browser
        finally:
            browser.close()


def test_chat_page_streams_an_answer_with_a_key(keyed_server, browser, tmp_path):
    browser.call("Page.enable")
    browser.call("Page.navigate", url=keyed_server.base_url + "/")
    browser.wait_for("document.readyState === 'complete' && document.getElementById('server-status')"
                     ".textContent === 'ready'", 60)
    # Without the key the page says so instead of failing silently.
    browser.wait_for("document.getElementById('model-name').textContent === 'API key needed'", 30)

    browser.type_into("api-key", API_KEY)  # typed only: the header updates without the field losing focus
    model = browser.wait_for("document.getElementById('model-name').textContent !== 'API key needed' && "
                             "document.getElementById('model-name').textContent", 30)
    with keyed_server.client() as http:
        assert model == http.get("/v1/models").json()["data"][0]["id"]
    # The model picker lists what /v1/models lists.
    assert browser.evaluate("[...document.getElementById('model-picker').options].map(o => o.value).join()") == model
    # The settings a person starts from are llama-server's sampling defaults, shown in the page.
    assert browser.evaluate("['temperature', 'top-p', 'top-k', 'min-p'].map(id => document.getElementById(id).value)"
                            ".join()") == "0.8,0.95,40,0.05"
    browser.evaluate("document.getElementById('temperature').value = '0'; "
                     "document.getElementById('max-tokens').value = '48'")

    browser.type_into("message", "Write two sentences about the sea.")
    browser.press_enter()
    assert browser.wait_for("document.querySelectorAll('.message.user').length", 10) == 1
    # Streaming: the answer bubble shows text while it is still marked as streaming.
    partial = browser.wait_for(
        "(() => { const b = document.querySelector('.message.assistant.streaming');"
        " return b && b.textContent.length > 0 ? b.textContent : null; })()", ANSWER_TIMEOUT_S)
    answer = browser.wait_for(
        "document.querySelector('.message.assistant.streaming') === null && "
        "document.querySelector('.message.assistant') && "
        "document.querySelector('.message.assistant').textContent", ANSWER_TIMEOUT_S)
    assert answer.startswith(partial) and len(answer) >= len(partial)
    assert not browser.evaluate("document.querySelector('.message.error')")
    stats = browser.evaluate("document.getElementById('stats').textContent")
    assert stats.startswith("TTFT ") and "tok/s" in stats, stats
    # The key was remembered for the next visit.
    assert browser.evaluate("localStorage.getItem('tokios.api-key')") == API_KEY

    png = browser.screenshot()
    assert png.startswith(b"\x89PNG")
    (tmp_path / "web-chat.png").write_bytes(png)
    if os.environ.get("TOKIOS_UPDATE_SCREENSHOT") == "1":
        SCREENSHOT_PATH.write_bytes(png)

    # A second turn keeps the conversation: both user messages are sent.
    browser.type_into("message", "Now one more.")
    browser.press_enter()
    browser.wait_for("document.querySelectorAll('.message.assistant').length === 2 && "
                     "document.querySelector('.message.assistant.streaming') === null", ANSWER_TIMEOUT_S)
    assert browser.evaluate("document.querySelectorAll('.message.user').length") == 2
    # The second request carried the whole conversation: its prompt is longer than the first one's
    # by at least the first answer.
    prompt_sizes = [int(match) for match in re.findall(r"tokios\.requests: .*? prompt_tokens=(\d+)",
                                                        keyed_server.log_text())]
    assert len(prompt_sizes) >= 2 and prompt_sizes[-1] > prompt_sizes[-2] + 5, prompt_sizes
