"""The web chat page in headless Chromium (Debian's `chromium` package), against a keyed server.

Drives the browser over the Chrome DevTools Protocol with the `websockets` client the project
already depends on, with real input events: the key asked for once, a reply streamed and rendered
with its stats, a reload that keeps the conversation, edit / regenerate / stop, the sidebar's
rename / delete / export / import, model output that tries to run script (rendered as text, runs
nothing), a server error shown in the page, the layout on a phone (390x844: the sidebar as a
drawer, a header that wraps, Settings' Done in view) and on a desktop with no console error, and
sampling left to the server's defaults unless set. Screenshots light and dark go to docs/ when
TOKIOS_UPDATE_SCREENSHOT=1. Skips only when no Chromium binary is installed.
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

from conftest import serve

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
ANSWER_TIMEOUT_S = 180.0
DOCS_DIR = Path(__file__).resolve().parents[2] / "docs"

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
        self.events: list[dict] = []  # the CDP events read so far (of the domains enabled)

    def call(self, method: str, **params) -> dict:
        message_id = next(self._ids)
        self.socket.send(json.dumps({"id": message_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv(timeout=60))
            if "method" in message:
                self.events.append(message)
            elif message.get("id") == message_id:
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

    def press_escape(self) -> None:
        for event_type in ("keyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", type=event_type, key="Escape", code="Escape",
                      windowsVirtualKeyCode=27, nativeVirtualKeyCode=27)

    def click_at(self, x: float, y: float) -> None:
        for event_type in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=event_type, x=x, y=y, button="left", clickCount=1)

    def click(self, selector: str) -> None:
        """A real mouse click in the middle of the element (scrolled into view first)."""
        box = self.evaluate(f"""(() => {{ const e = document.querySelector({selector!r});
            if (!e) return null; e.scrollIntoView({{block: 'center'}}); const r = e.getBoundingClientRect();
            return [r.x + r.width / 2, r.y + r.height / 2]; }})()""")
        if box is None:
            raise LookupError(f"no element matches {selector}")
        for event_type in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=event_type, x=box[0], y=box[1], button="left", clickCount=1)

    def set_files(self, selector: str, paths: list[Path]) -> None:
        root = self.call("DOM.getDocument")["root"]["nodeId"]
        node = self.call("DOM.querySelector", nodeId=root, selector=selector)["nodeId"]
        self.call("DOM.setFileInputFiles", nodeId=node, files=[str(path) for path in paths])

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


API_KEY = "sk-web-7f3e"
# What a hostile reply may contain; alert() is replaced by a flag setter before any of it renders.
HOSTILE_MARKDOWN = """Here you go:

<script>alert('script tag')</script>

<img src=x onerror=alert(1)> and <iframe src="javascript:alert(2)"></iframe>

[click me](javascript:alert(3)) and <a href="javascript:alert(4)">raw link</a> ![pic](javascript:alert(5))

```python
def greet(name):
    return f"<b>{name}</b>"
```
"""


@pytest.fixture(scope="module")
def web_server():
    with serve("--max-num-seqs", "4", api_key=API_KEY) as server:
        yield server


@pytest.fixture
def browser():
    # Chromium may still be flushing its profile while the directory is removed; that is harmless.
    with tempfile.TemporaryDirectory(prefix="tokios-chromium-", ignore_cleanup_errors=True) as user_data_dir:
        browser = Browser(Path(user_data_dir))
        try:
            browser.call("Page.enable")
            browser.call("DOM.enable")
            yield browser
        finally:
            browser.close()


def open_page(browser: Browser, server, *, with_key: bool = True) -> None:
    browser.call("Page.navigate", url=server.base_url + "/")
    browser.wait_for("document.readyState === 'complete' && document.getElementById('server-status')"
                     ".textContent === 'ready'", 60)
    # Replaced before anything is rendered, so that script run by a reply would leave a mark.
    browser.evaluate("window.alert = (what) => { window.__alerts = (window.__alerts || []).concat([String(what)]); }")
    if with_key:
        browser.wait_for("document.getElementById('key-banner').offsetParent !== null", 30)
        browser.type_into("key-banner-input", API_KEY)
        browser.press_enter()
        browser.wait_for("document.getElementById('key-banner').offsetParent === null && "
                         "document.getElementById('model-picker').options.length > 0", 30)


def is_shown(browser: Browser, element_id: str) -> bool:
    """Whether the element is displayed (its `hidden` property alone can be overridden by CSS)."""
    return browser.evaluate(f"document.getElementById({json.dumps(element_id)}).offsetParent !== null")


def set_setting(browser: Browser, element_id: str, value: str) -> None:
    """Sets a settings field as typing would (its input event saves it)."""
    browser.evaluate(f"(() => {{ const e = document.getElementById({json.dumps(element_id)});"
                     f" e.value = {json.dumps(value)}; e.dispatchEvent(new Event('input')); }})()")


def send_message(browser: Browser, text: str) -> None:
    browser.type_into("message", text)
    browser.press_enter()


def wait_idle(browser: Browser) -> None:
    browser.wait_for("!document.body.classList.contains('busy') && "
                     "document.querySelector('.message.streaming') === null", ANSWER_TIMEOUT_S)


def messages(browser: Browser) -> list[dict]:
    """The shown messages: role, text, stats line and error line."""
    return browser.evaluate("""[...document.querySelectorAll('#messages .message')].map(m => ({
        role: m.classList.contains('user') ? 'user' : 'assistant',
        text: m.querySelector('.content').textContent,
        stats: m.querySelector('.stats').textContent,
        error: m.querySelector('.error-text').hidden ? '' : m.querySelector('.error-text').textContent}))""")


def num_chat_requests(server) -> int:
    return len(re.findall(r"tokios\.requests: .*? prompt_tokens=", server.log_text()))


def prompt_sizes(server) -> list[int]:
    return [int(size) for size in re.findall(r"tokios\.requests: .*? prompt_tokens=(\d+)", server.log_text())]


def save_screenshot(browser: Browser, tmp_path: Path, name: str) -> None:
    png = browser.screenshot()
    assert png.startswith(b"\x89PNG")
    (tmp_path / name).write_bytes(png)
    if os.environ.get("TOKIOS_UPDATE_SCREENSHOT") == "1":
        (DOCS_DIR / name).write_bytes(png)


PHONE = {"width": 390, "height": 844, "deviceScaleFactor": 3, "mobile": True}
DESKTOP = {"width": 1280, "height": 800, "deviceScaleFactor": 1, "mobile": False}
# Every control in the header, as the user sees it: what is not displayed is left out.
HEADER_CONTROLS = "header button, header select, header .badge, header #model-name"
# Records the header's (badge, model name) each time either changes, from the page's first paint.
RECORD_HEADER_STATES = """document.addEventListener('DOMContentLoaded', () => {
    const header = document.querySelector('header');
    const record = () => (window.__headerStates = window.__headerStates || []).push(
        [document.getElementById('server-status').textContent, document.getElementById('model-name').textContent]);
    record();
    new MutationObserver(record).observe(header, {subtree: true, childList: true, characterData: true});
});"""


def placement(browser: Browser, selector: str) -> dict:
    """Where an element is: its box, whether it is displayed, whether its box lies inside the
    viewport, and whether a tap at its centre reaches it (nothing covers it)."""
    return browser.evaluate(f"""(() => {{ const e = document.querySelector({selector!r});
        if (!e) return null;
        const r = e.getBoundingClientRect(); const x = r.x + r.width / 2, y = r.y + r.height / 2;
        const top = document.elementFromPoint(x, y);
        return {{selector: {selector!r}, left: r.left, top: r.top, right: r.right, bottom: r.bottom, x, y,
                 shown: e.checkVisibility() && r.width > 0 && r.height > 0,
                 inside: r.left >= 0 && r.top >= 0 && r.right <= innerWidth && r.bottom <= innerHeight,
                 reachable: top !== null && (top === e || e.contains(top))}}; }})()""")


def tap(browser: Browser, selector: str) -> None:
    """A click where the element is now, without scrolling: it must be shown, inside the
    viewport and not covered, as a person's tap needs."""
    where = placement(browser, selector)
    assert where and where["shown"] and where["inside"] and where["reachable"], where
    browser.click_at(where["x"], where["y"])


def header_placements(browser: Browser) -> list[dict]:
    selectors = browser.evaluate(f"[...document.querySelectorAll({HEADER_CONTROLS!r})].filter(e => e.checkVisibility())"
                                 ".map(e => '#' + e.id)")
    return [placement(browser, selector) for selector in selectors]


def console_errors(browser: Browser) -> list[str]:
    """The page's console errors so far: failed loads (a 404 favicon), console.error, exceptions."""
    browser.evaluate("0")  # reads every event sent before it
    errors = []
    for event in browser.events:
        params = event.get("params", {})
        if event["method"] == "Log.entryAdded" and params["entry"]["level"] == "error":
            errors.append(f"{params['entry'].get('url', '')} {params['entry']['text']}")
        elif event["method"] == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
            errors.append(" ".join(str(arg.get("value", arg.get("description"))) for arg in params["args"]))
        elif event["method"] == "Runtime.exceptionThrown":
            errors.append(json.dumps(params["exceptionDetails"]))
    return errors


def reload_at(browser: Browser, metrics: dict) -> None:
    """The page loaded afresh in a window of `metrics`, its key already stored, console events
    counted from this load on."""
    browser.call("Emulation.setDeviceMetricsOverride", **metrics)
    browser.events.clear()
    browser.call("Page.reload")
    browser.wait_for("document.readyState === 'complete' && document.getElementById('server-status')"
                     ".textContent === 'ready' && document.getElementById('model-picker').options.length > 0", 60)


def test_a_reply_streams_renders_and_survives_a_reload(web_server, browser, tmp_path):
    open_page(browser, web_server, with_key=False)
    # Without the key the page asks for it once, in a banner, and says so in the header.
    browser.wait_for("document.getElementById('key-banner').offsetParent !== null", 30)
    assert browser.evaluate("document.getElementById('model-name').textContent") == "API key needed"
    browser.type_into("key-banner-input", API_KEY)
    browser.press_enter()
    model = browser.wait_for("document.getElementById('key-banner').offsetParent === null && "
                             "document.getElementById('model-picker').value", 30)
    with web_server.client() as http:
        assert [card["id"] for card in http.get("/v1/models").json()["data"]] == browser.evaluate(
            "[...document.getElementById('model-picker').options].map(o => o.value)")
    assert model == browser.evaluate("document.getElementById('model-name').textContent")
    # The page's own files are served, the npm tree behind them is not, and the page is locked
    # to its own origin by its content security policy.
    with web_server.client() as http:
        assert http.get("/static/vendor/marked.js").status_code == 200
        for path in ("/static/node_modules/marked/package.json", "/static/package-lock.json",
                     "/static/vendor/../../web_assets.py", "/static/vendor/nothing.js"):
            assert http.get(path).status_code == 404, path
        assert "default-src 'self'" in http.get("/").headers["content-security-policy"]
    # Every asset came from this server (the page works offline), and the libraries loaded.
    origins = browser.evaluate("[...new Set(performance.getEntriesByType('resource').map(e => new URL(e.name).origin))]")
    assert origins == [web_server.base_url], origins
    assert browser.evaluate("[typeof marked, typeof DOMPurify, typeof hljs].join()") == "object,function,object"
    assert not is_shown(browser, "notice")
    # Sampling starts empty: the server's defaults apply (tested below, with the placeholders).
    assert browser.evaluate("['temperature', 'top-p', 'top-k', 'min-p'].map(id => document.getElementById(id).value)"
                            ".join()") == ",,,"
    browser.click("#open-settings")
    assert browser.evaluate("document.getElementById('settings-dialog').open")
    set_setting(browser, "temperature", "0")
    set_setting(browser, "max-tokens", "80")
    browser.click("#close-settings")
    assert not browser.evaluate("document.getElementById('settings-dialog').open")

    send_message(browser, "Write a short Python function that adds two numbers.")
    assert browser.wait_for("document.querySelectorAll('.message.user').length", 10) == 1
    # Streaming: the reply shows text while it is still marked as streaming.
    partial = browser.wait_for(
        "(() => { const b = document.querySelector('.message.assistant.streaming .content');"
        " return b && b.textContent.length > 0 ? b.textContent : null; })()", ANSWER_TIMEOUT_S)
    wait_idle(browser)
    [question, answer] = messages(browser)
    assert question["text"] == "Write a short Python function that adds two numbers."
    assert len(answer["text"]) >= len(partial) > 0 and not answer["error"]
    assert re.fullmatch(r"TTFT \d+\.\d\d s · \d+\.\d tok/s · \d+ tokens · (stop|length) · " + re.escape(model),
                        answer["stats"]), answer["stats"]
    # The sidebar lists the conversation under its first message (cut to 48 characters).
    assert browser.evaluate("document.querySelector('.conversation.active .title').textContent") == \
        "Write a short Python function that adds two num…"
    save_screenshot(browser, tmp_path, "web-chat-light.png")

    # A reload keeps the key (no banner), the settings and the conversation.
    browser.call("Page.reload")
    browser.wait_for("document.readyState === 'complete' && document.querySelectorAll('.message').length === 2", 30)
    browser.wait_for("document.getElementById('model-picker').options.length > 0", 30)
    assert not is_shown(browser, "key-banner")
    assert messages(browser) == [question, answer]
    assert browser.evaluate("document.getElementById('temperature').value") == "0"

    # The dark theme follows the system.
    browser.call("Emulation.setEmulatedMedia", features=[{"name": "prefers-color-scheme", "value": "dark"}])
    browser.wait_for("document.documentElement.dataset.theme === 'dark'", 10)
    assert browser.evaluate("document.getElementById('highlight-dark').disabled") is False
    save_screenshot(browser, tmp_path, "web-chat-dark.png")

    # A second turn carries the whole conversation: its prompt is longer by at least the answer.
    send_message(browser, "Now one more.")
    wait_idle(browser)
    assert [message["role"] for message in messages(browser)] == ["user", "assistant"] * 2
    sizes = prompt_sizes(web_server)
    assert len(sizes) >= 2 and sizes[-1] > sizes[-2] + 5, sizes


def test_edit_regenerate_and_stop(web_server, browser):
    open_page(browser, web_server)
    set_setting(browser, "temperature", "0")
    set_setting(browser, "max-tokens", "16")
    send_message(browser, "Say hello.")
    wait_idle(browser)
    first = messages(browser)
    assert [message["role"] for message in first] == ["user", "assistant"]

    # Regenerate: a new request, the reply replaced in place (greedy, so the same text).
    num_requests = num_chat_requests(web_server)
    browser.click(".message.assistant .regenerate")
    wait_idle(browser)
    assert num_chat_requests(web_server) == num_requests + 1
    assert messages(browser)[1]["text"] == first[1]["text"]
    assert len(messages(browser)) == 2

    # Edit the question and resend: the conversation after it is answered again.
    browser.click(".message.user .edit")
    browser.wait_for("document.querySelector('.message.user .edit-input') !== null", 10)
    browser.evaluate("document.querySelector('.message.user .edit-input').value = 'Name three colours.'")
    browser.click(".message.user .save-edit")
    wait_idle(browser)
    edited = messages(browser)
    assert [message["role"] for message in edited] == ["user", "assistant"]
    assert edited[0]["text"] == "Name three colours."
    assert num_chat_requests(web_server) == num_requests + 2

    # Stop: the partial reply stays, marked stopped, and the server ends the request.
    set_setting(browser, "max-tokens", "2000")
    set_setting(browser, "temperature", "0.8")
    send_message(browser, "Write a long story about a lighthouse keeper.")
    browser.wait_for("(() => { const b = document.querySelector('.message.assistant.streaming .content');"
                     " return b && b.textContent.length > 20; })()", ANSWER_TIMEOUT_S)
    browser.click("#stop")
    wait_idle(browser)
    stopped = messages(browser)[-1]
    assert stopped["text"] and stopped["stats"].split(" · ")[-2] == "stopped", stopped
    assert not browser.evaluate("document.getElementById('send').disabled")
    with web_server.client() as http:
        deadline = time.monotonic() + 30
        while http.get("/v1/engine/stats").json()["num_running"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert http.get("/v1/engine/stats").json()["num_running"] == 0


def test_model_output_renders_as_text_and_runs_nothing(web_server, browser, tmp_path):
    open_page(browser, web_server)
    chat = {"format": "tokios-conversations", "version": 1, "conversations": [
        {"title": "hostile", "messages": [{"role": "user", "content": "<b>bold?</b> <img src=x onerror=alert(9)>"},
                                          {"role": "assistant", "content": HOSTILE_MARKDOWN,
                                           "stats": {"ttft_s": "<b>x</b>", "num_tokens": 7}}]},
        # Input the markdown renderer cannot take must not break the page (it shows as text).
        {"title": "deep", "messages": [{"role": "user", "content": "quote"},
                                       {"role": "assistant", "content": ">" * 5000 + " deep"}]}]}
    chat_file = tmp_path / "hostile.json"
    chat_file.write_text(json.dumps(chat))
    browser.set_files("#import-file", [chat_file])
    browser.wait_for("document.querySelectorAll('.conversation').length === 2", 10)
    browser.click(".conversation:not(.active) .title")  # the deep one is shown first; it rendered
    assert "deep" in browser.evaluate("document.querySelector('.message.assistant .content').textContent")
    browser.click(".conversation:not(.active) .title")
    browser.wait_for("document.querySelectorAll('.message').length === 2 && "
                     "document.querySelector('.message.user .content').textContent.startsWith('<b>')", 10)
    # Imported stats are kept only with the types they are shown as.
    assert browser.evaluate("document.querySelector('.message.assistant .stats').textContent") == "7 tokens"
    reply = "document.querySelector('.message.assistant .content')"
    # Raw HTML shows as its characters; nothing of it became an element or ran.
    text = browser.evaluate(f"{reply}.textContent")
    for fragment in ("<script>alert('script tag')</script>", "<img src=x onerror=alert(1)>",
                     '<a href="javascript:alert(4)">raw link</a>'):
        assert fragment in text, text
    assert browser.evaluate("document.querySelector('.message.user .content').textContent") == \
        "<b>bold?</b> <img src=x onerror=alert(9)>"
    assert browser.evaluate("document.querySelectorAll('#messages script, #messages img, #messages iframe, "
                            "#messages b').length") == 0
    hrefs = browser.evaluate(f"[...{reply}.querySelectorAll('a')].map(a => a.getAttribute('href'))")
    assert not any(href and href.strip().lower().startswith("javascript") for href in hrefs), hrefs
    # Links open elsewhere, without handing over this page.
    assert browser.evaluate(f"[...{reply}.querySelectorAll('a[href]')].every(a => a.rel === 'noopener noreferrer')")
    for index in range(len(hrefs)):
        browser.evaluate(f"{reply}.querySelectorAll('a')[{index}].click()")
    # The code block is highlighted (escaped spans) and has a copy button that copies its text.
    assert browser.evaluate(f"{reply}.querySelector('pre code.hljs.language-python') !== null")
    assert browser.evaluate(f"{reply}.querySelectorAll('pre code span').length") > 0
    browser.evaluate("window.__copied = []; navigator.clipboard.writeText = async (t) => { window.__copied.push(t); };")
    browser.click(".message.assistant pre .copy")
    assert browser.wait_for("window.__copied.length && window.__copied[0]", 5).startswith("def greet(name):")

    # The same through a live stream: a schema forces the model to write an HTML payload.
    payload = "<img src=x onerror=alert(7)><script>alert(8)</script>"
    set_setting(browser, "response-format", "json_schema")
    set_setting(browser, "json-schema", json.dumps({"type": "string", "enum": [payload]}))
    set_setting(browser, "temperature", "0")
    browser.click("#new-chat")
    send_message(browser, "Reply with the payload.")
    wait_idle(browser)
    [_, streamed] = messages(browser)
    assert not streamed["error"], streamed
    assert json.loads(streamed["text"]) == payload
    assert browser.evaluate("document.querySelectorAll('#messages script, #messages img').length") == 0
    assert browser.evaluate("window.__alerts || []") == []


def test_sidebar_renames_deletes_exports_and_imports(web_server, browser, tmp_path):
    open_page(browser, web_server)
    conversations = [{"title": f"chat {number}", "messages": [
        {"role": "user", "content": f"question {number}"}, {"role": "assistant", "content": f"**answer** {number}"}]}
        for number in (1, 2)]
    source = tmp_path / "two.json"
    source.write_text(json.dumps(conversations))
    browser.set_files("#import-file", [source])
    browser.wait_for("document.querySelectorAll('.conversation').length === 2", 10)
    assert is_shown(browser, "notice")
    assert "Imported 2 conversations" in browser.evaluate("document.getElementById('notice').textContent")
    titles = "[...document.querySelectorAll('.conversation .title')].map(t => t.textContent).sort()"
    assert browser.evaluate(titles) == ["chat 1", "chat 2"]
    # Markdown of imported replies is rendered.
    assert browser.evaluate("document.querySelector('.message.assistant .content strong').textContent") == "answer"

    # Switch, then rename the active one in place.
    browser.click(".conversation:not(.active) .title")
    active_title = browser.evaluate("document.querySelector('.conversation.active .title').textContent")
    browser.click(".conversation.active .rename")
    browser.wait_for("document.querySelector('.rename-input') !== null", 5)
    # The field opens focused with its title selected: typing replaces it, Enter keeps it.
    assert browser.evaluate("document.activeElement.className") == "rename-input"
    browser.call("Input.insertText", text="Renamed chat")
    browser.press_enter()
    other_title = "chat 1" if active_title == "chat 2" else "chat 2"
    assert browser.evaluate(titles) == sorted(["Renamed chat", other_title])

    # Export everything to a file, as a download.
    download_dir = tmp_path / "downloads"
    download_dir.mkdir()
    browser.call("Browser.setDownloadBehavior", behavior="allow", downloadPath=str(download_dir))
    browser.click("#export-all")
    deadline = time.monotonic() + 15
    while not list(download_dir.glob("*.json")) and time.monotonic() < deadline:
        time.sleep(0.1)
    exported = json.loads(next(download_dir.glob("*.json")).read_text())
    assert exported["format"] == "tokios-conversations"
    assert sorted(item["title"] for item in exported["conversations"]) == sorted(["Renamed chat", other_title])

    # Delete takes two clicks; the second removes it, and a reload agrees.
    browser.click(".conversation.active .delete")
    assert browser.evaluate("document.querySelectorAll('.conversation').length") == 2
    browser.click(".conversation.active .delete")
    assert browser.evaluate(titles) == [other_title]
    browser.call("Page.reload")
    browser.wait_for("document.readyState === 'complete' && document.querySelectorAll('.conversation').length", 30)
    assert browser.evaluate(titles) == [other_title]

    # The exported file imports back whole.
    browser.set_files("#import-file", [next(download_dir.glob("*.json"))])
    browser.wait_for("document.querySelectorAll('.conversation').length === 3", 10)
    assert browser.evaluate(titles) == sorted(["Renamed chat", other_title, other_title])

    # A file that is not a conversation is refused with the field that is wrong, and adds nothing.
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"conversations": [{"messages": [{"role": "robot", "content": "hi"}]}]}))
    browser.set_files("#import-file", [bad])
    notice = browser.wait_for("document.getElementById('notice').textContent.startsWith('Import failed') && "
                              "document.getElementById('notice').textContent", 10)
    assert "conversations[0].messages[0].role" in notice
    assert browser.evaluate("document.querySelectorAll('.conversation').length") == 3


def test_errors_are_shown_in_the_page(web_server, browser):
    open_page(browser, web_server)
    # The server refuses the request: its message is shown on the reply, and the question stays.
    set_setting(browser, "max-tokens", "100000")
    send_message(browser, "Hello?")
    wait_idle(browser)
    [question, reply] = messages(browser)
    assert question["text"] == "Hello?"
    assert reply["error"].startswith("Error: ") and "maximum context length" in reply["error"], reply
    # A setting that cannot be read is named, in the panel and on the reply; nothing is sent.
    set_setting(browser, "max-tokens", "8")
    set_setting(browser, "logit-bias", "{not json")
    assert "logit-bias is not valid JSON" in browser.evaluate("document.getElementById('settings-error').textContent")
    num_requests = num_chat_requests(web_server)
    browser.click(".message.assistant .regenerate")
    browser.wait_for("document.querySelector('.message.assistant .error-text').textContent.includes('logit-bias')", 10)
    assert num_chat_requests(web_server) == num_requests
    # Once mended, regenerate answers the same question.
    set_setting(browser, "logit-bias", "")
    browser.click(".message.assistant .regenerate")
    wait_idle(browser)
    [question, reply] = messages(browser)
    assert question["text"] == "Hello?" and reply["text"] and not reply["error"], reply


def test_the_page_fits_a_phone_and_a_desktop(web_server, browser):
    open_page(browser, web_server)  # stores the key: a load without it has the 401 in its console
    browser.call("Page.addScriptToEvaluateOnNewDocument", source=RECORD_HEADER_STATES)
    browser.call("Log.enable")
    browser.call("Runtime.enable")
    reload_at(browser, PHONE)
    assert browser.evaluate("[innerWidth, innerHeight]") == [390, 844]
    # The header wraps: every control inside the viewport, nothing scrolls sideways.
    for where in header_placements(browser):
        assert where["inside"], where
    assert browser.evaluate("document.documentElement.scrollWidth <= innerWidth")
    # The sidebar is a drawer behind the menu button.
    assert not placement(browser, "#sidebar")["shown"]
    tap(browser, "#open-menu")
    assert placement(browser, "#sidebar")["shown"]
    assert browser.evaluate("document.getElementById('open-menu').getAttribute('aria-expanded')") == "true"
    tap(browser, "#new-chat")  # starts a conversation and closes the drawer
    assert not placement(browser, "#sidebar")["shown"]
    tap(browser, "#open-menu")
    assert placement(browser, "#conversation-list")["shown"]
    assert browser.evaluate("document.querySelectorAll('#conversation-list .conversation').length") == 1
    for selector in ("#new-chat", ".conversation .title", "#export-chat", "#export-all", "#import-chat"):
        where = placement(browser, selector)
        assert where["shown"] and where["inside"] and where["reachable"], where
    # It closes on Escape, on a tap beside it, and on choosing a conversation.
    browser.press_escape()
    assert not placement(browser, "#sidebar")["shown"]
    tap(browser, "#open-menu")
    browser.click_at(380, 500)  # the backdrop, right of the drawer
    assert not placement(browser, "#sidebar")["shown"]
    tap(browser, "#open-menu")
    tap(browser, ".conversation .title")
    assert not placement(browser, "#sidebar")["shown"]
    assert browser.evaluate("document.getElementById('open-menu').getAttribute('aria-expanded')") == "false"
    # Settings fits the screen: its body scrolls, Done stays in view and answers a tap.
    tap(browser, "#open-settings")
    assert browser.evaluate("document.getElementById('settings-dialog').open")
    assert browser.evaluate("(() => { const b = document.querySelector('.dialog-body');"
                            " return b.scrollHeight > b.clientHeight; })()")  # the fields do not fit at once
    tap(browser, "#close-settings")
    assert not browser.evaluate("document.getElementById('settings-dialog').open")
    # The page links its icon, and /favicon.ico answers too: no failed load at any width.
    assert browser.evaluate("fetch(document.querySelector('link[rel=icon]').href).then(r => r.status)") == 200
    with web_server.client() as http:
        favicon = http.get("/favicon.ico")
        assert favicon.status_code == 200 and favicon.headers["content-type"].startswith("image/svg+xml")
    assert console_errors(browser) == []

    # A 400 px desktop window (no phone viewport) wraps the same way.
    reload_at(browser, {"width": 400, "height": 700, "deviceScaleFactor": 1, "mobile": False})
    assert placement(browser, "#open-menu")["shown"]
    for where in header_placements(browser):
        assert where["inside"], where

    reload_at(browser, DESKTOP)
    assert not placement(browser, "#open-menu")["shown"]
    sidebar = placement(browser, "#sidebar")
    assert sidebar["shown"] and sidebar["inside"] and sidebar["left"] == 0, sidebar
    for selector in ("#new-chat", "#export-chat", "#export-all", "#import-chat"):
        assert placement(browser, selector)["reachable"], selector
    for where in header_placements(browser):
        assert where["inside"], where
    assert console_errors(browser) == []
    # At no moment did the header show a ready server beside a model name it had not filled in.
    model = browser.evaluate("document.getElementById('model-picker').value")
    states = browser.evaluate("window.__headerStates")
    assert states[-1] == ["ready", model], states
    assert all(name == model for badge, name in states if badge == "ready"), states
    assert all(badge in ("connecting…", "ready") and name in ("", model) for badge, name in states), states


# The request fields that the server fills with its defaults when a request leaves them out.
SAMPLING_FIELDS = {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "min_tokens"}
# The settings whose empty field shows the server's default, by the card's name for each.
PARAM_TO_SETTING = {"temperature": "temperature", "top_p": "top-p", "top_k": "top-k", "min_p": "min-p",
                    "repetition_penalty": "repetition-penalty"}


def capture_request_bodies(browser: Browser) -> None:
    browser.evaluate("window.__bodies = []; const send = window.fetch; window.fetch = (url, options) => {"
                     " if (options && options.body) window.__bodies.push(JSON.parse(options.body));"
                     " return send(url, options); }")


def test_settings_reach_the_request_and_unset_sampling_is_left_to_the_server(web_server, browser):
    open_page(browser, web_server)
    capture_request_bodies(browser)
    # Nothing set: the request carries no sampling field, so the server's defaults apply.
    set_setting(browser, "max-tokens", "4")
    send_message(browser, "Hi.")
    wait_idle(browser)
    body = browser.evaluate("window.__bodies[window.__bodies.length - 1]")
    assert body["max_tokens"] == 4 and not SAMPLING_FIELDS & body.keys(), body
    # One field set: that one is sent, and only that one.
    set_setting(browser, "temperature", "0.5")
    browser.click(".message.assistant .regenerate")
    wait_idle(browser)
    body = browser.evaluate("window.__bodies[window.__bodies.length - 1]")
    assert {name: body[name] for name in SAMPLING_FIELDS & body.keys()} == {"temperature": 0.5}, body

    browser.click("#new-chat")
    settings = {"system-prompt": "Be brief.", "temperature": "0.7", "top-p": "0.9", "top-k": "20", "min-p": "0.1",
                "max-tokens": "12", "min-tokens": "2", "presence-penalty": "0.5", "frequency-penalty": "0.25",
                "repetition-penalty": "1.1", "seed": "7", "stop-strings": "END\nSTOP", "logit-bias": '{"42": -5}',
                "response-format": "json_object", "speculative": "ngram"}
    for element_id, value in settings.items():
        set_setting(browser, element_id, value)
    send_message(browser, "Give me a JSON object.")
    wait_idle(browser)
    [_, reply] = messages(browser)
    assert not reply["error"], reply
    body = browser.evaluate("window.__bodies[window.__bodies.length - 1]")
    assert body["messages"][0] == {"role": "system", "content": "Be brief."}
    expected = {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.1, "max_tokens": 12, "min_tokens": 2,
                "presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 1.1, "seed": 7,
                "stop": ["END", "STOP"], "logit_bias": {"42": -5}, "response_format": {"type": "json_object"},
                "speculative": {"method": "ngram"}, "stream": True}
    assert {name: body.get(name) for name in expected} == expected
    # The settings are kept per browser: a reload shows them, and Reset empties the sampling again.
    browser.call("Page.reload")
    browser.wait_for("document.readyState === 'complete' && document.getElementById('seed').value === '7'", 30)
    browser.click("#open-settings")
    browser.click("#reset-settings")
    assert browser.evaluate("['temperature', 'seed', 'speculative'].map(id => document.getElementById(id).value)"
                            ".join()") == ",,default"
    assert browser.evaluate("localStorage.getItem('tokios.api-key')") == API_KEY  # the key survives a reset

    # Storage from before sampling started empty held the page's old defaults as values: those
    # are forgotten once, a value the user chose is kept, and so is one typed in afterwards.
    browser.evaluate("localStorage.removeItem('tokios.settings-version');"
                     " localStorage.setItem('tokios.temperature', '0.8'); localStorage.setItem('tokios.top-k', '20');"
                     " localStorage.setItem('tokios.repetition-penalty', '1')")
    browser.call("Page.reload")
    browser.wait_for("document.readyState === 'complete' && document.getElementById('model-picker').options.length", 30)
    sampling = "['temperature', 'top-k', 'repetition-penalty'].map(id => document.getElementById(id).value).join()"
    assert browser.evaluate(sampling) == ",20,"
    set_setting(browser, "temperature", "0.8")
    browser.call("Page.reload")
    browser.wait_for("document.readyState === 'complete' && document.getElementById('model-picker').options.length", 30)
    assert browser.evaluate(sampling) == "0.8,20,"

    # Each empty sampling field shows the selected model's default from its card. This needs the
    # server's one set of sampling defaults in /v1/models (`sampling_defaults`).
    model = browser.evaluate("document.getElementById('model-picker').value")
    with web_server.client() as http:
        [card] = [card for card in http.get("/v1/models").json()["data"] if card["id"] == model]
    assert "sampling_defaults" in card, f"the /v1/models card has no sampling_defaults: {card}"
    placeholders = browser.evaluate(f"Object.fromEntries(Object.entries({json.dumps(PARAM_TO_SETTING)})"
                                    ".map(([param, id]) => [param, document.getElementById(id).placeholder]))")
    assert {param: float(text) for param, text in placeholders.items()} == \
        {param: float(card["sampling_defaults"][param]) for param in PARAM_TO_SETTING}, placeholders


def reply_fold(browser: Browser, index: int) -> dict:
    """The thinking fold of message `index` and the message's answer and stats, as shown."""
    return browser.evaluate(f"""(() => {{ const m = document.querySelectorAll('#messages .message')[{index}];
        const fold = m.querySelector('.thinking');
        return {{hidden: fold.hidden, open: fold.open, summary: fold.querySelector('summary').textContent,
                 thinking: fold.querySelector('.thinking-text').textContent,
                 content: m.querySelector('.content').textContent,
                 stats: m.querySelector('.stats').textContent}}; }})()""")


def test_a_reasoning_models_thinking_shows_in_a_fold_above_its_answer(thinking_server, browser):
    # SmolLM2 under QwQ's template thinks from the first token and never closes the thinking
    # itself: with 12 tokens, the reply is all thinking, and the page shows it in the fold, the
    # answer empty, the finish reason length.
    open_page(browser, thinking_server, with_key=False)
    set_setting(browser, "max-tokens", "12")
    send_message(browser, "What is 2 + 2?")
    wait_idle(browser)
    shown = reply_fold(browser, 1)
    assert not shown["hidden"] and shown["open"] and shown["summary"] == "Thinking"
    assert shown["thinking"].strip() and shown["content"] == ""
    assert "length" in shown["stats"]
    # The conversation keeps the thinking: after a reload the fold shows it again, open (the
    # reply has no answer to show instead).
    browser.call("Page.reload")
    browser.wait_for("document.querySelectorAll('#messages .message').length === 2", 60)
    reloaded = reply_fold(browser, 1)
    assert (reloaded["hidden"], reloaded["open"], reloaded["thinking"]) == (False, True, shown["thinking"])
    # With a thinking budget an answer follows: the fold closes once it comes, and the next
    # request sends the thinking back with its turn (the template keeps or drops it).
    capture_request_bodies(browser)
    set_setting(browser, "max-thinking-tokens", "4")
    set_setting(browser, "max-tokens", "16")
    send_message(browser, "And 3 + 3?")
    wait_idle(browser)
    answered = reply_fold(browser, 3)
    assert not answered["hidden"] and not answered["open"] and answered["thinking"] and answered["content"]
    assert browser.evaluate("window.__bodies[0].max_thinking_tokens") == 4
    send_message(browser, "Thanks.")
    wait_idle(browser)
    history = browser.evaluate("window.__bodies[1].messages")
    assert history[-2]["role"] == "assistant" and history[-2]["reasoning_content"] == answered["thinking"]
    assert history[-2]["content"].strip() == answered["content"].strip()  # as rendered: markdown's line end
