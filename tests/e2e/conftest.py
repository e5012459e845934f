"""Shared e2e fixtures: a real `tokios serve` subprocess on a free loopback port.

`serve(*flags)` starts `python -m tokios.cli serve --host 127.0.0.1 --port 0 ...`, reads the
port from the server's "listening on" line, waits for `/health` to answer 200 (the model loads in
a few seconds), yields a ServerProcess, and stops it with SIGTERM (then SIGKILL if it hangs).
The output goes to a log file that failing tests print. `tokios_server` (default flags),
`small_keyed_server` and `thinking_server` (a chat template that opens a reasoning block) are
shared by the session, as are `client` (its openai client) and `model`; tests needing other flags
call `serve`.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

STARTUP_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 60.0
LISTENING_LINE = re.compile(r"tokios serve: listening on (http://\S+)")


class ServerProcess:
    def __init__(self, popen: subprocess.Popen, log_path: Path, api_key: str | None):
        self.popen = popen
        self.log_path = log_path
        self.api_key = api_key
        self.base_url = ""

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_text()[-num_chars:]

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=self.headers, timeout=kwargs.pop("timeout", 120.0),
                            **kwargs)

    def openai(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key or "unused",
                             max_retries=kwargs.pop("max_retries", 0), timeout=kwargs.pop("timeout", 120.0), **kwargs)

    def wait_until_listening(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            match = LISTENING_LINE.search(self.log_text())
            if match:
                self.base_url = match.group(1)
                return
            self._fail_if_exited("before listening")
            time.sleep(0.05)
        raise TimeoutError(f"tokios serve did not start listening:\n{self.log_tail()}")

    def wait_until_healthy(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            self._fail_if_exited("while loading")
            try:
                if httpx.get(f"{self.base_url}/health", headers=self.headers, timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"tokios serve did not become healthy:\n{self.log_tail()}")

    def _fail_if_exited(self, when: str) -> None:
        if self.popen.poll() is not None:
            raise RuntimeError(f"tokios serve exited {when} with code {self.popen.returncode}:\n{self.log_tail()}")

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, then SIGKILL after timeout_s; returns the exit code. Idempotent."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        return self.popen.returncode


@contextlib.contextmanager
def serve(*flags: str, api_key: str | None = None, env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """A running `tokios serve` with `flags`; `api_key` is added as --api-key and used by helpers."""
    log_dir = Path(tempfile.mkdtemp(prefix="tokios-serve-"))
    log_path = log_dir / "server.log"
    # TOKIOS_E2E_SERVE_FLAGS adds flags to every server (e.g. "--dtype bfloat16" to run the suite
    # on another weight format or device).
    extra_flags = shlex.split(os.environ.get("TOKIOS_E2E_SERVE_FLAGS", ""))
    argv = [sys.executable, "-m", "tokios.cli", "serve", "--host", "127.0.0.1", "--port", "0", *extra_flags, *flags]
    if api_key:
        argv += ["--api-key", api_key]
    with open(log_path, "wb") as log_file:
        popen = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    server = ServerProcess(popen, log_path, api_key)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        server.wait_until_listening(deadline)
        server.wait_until_healthy(deadline)
        yield server
    finally:
        server.stop()


# Loading the model is the slow part of starting a server, so two servers are shared by the
# whole session: the default one, and a small keyed one (two keys, one from a key file; a small
# body limit and context; one running request and one queued, so the queue bound is reachable;
# bfloat16 weights, which load several times faster than the default int8 and change nothing
# that its tests look at).
SMALL_SERVER_FLAG_KEY = "sk-e2e-flag-7c1d"
SMALL_SERVER_FILE_KEY = "sk-e2e-file-93ab"
SMALL_SERVER_MAX_BODY_SIZE = 256 * 1024
SMALL_SERVER_MAX_MODEL_LEN = 2048


@pytest.fixture(scope="session")
def tokios_server() -> Iterator[ServerProcess]:
    with serve() as server:
        yield server


@pytest.fixture(scope="session")
def client(tokios_server):
    """The official openai client of `tokios_server`."""
    return tokios_server.openai()


@pytest.fixture(scope="session")
def model(client) -> str:
    """The id `tokios_server` serves (a test module may define its own `model`)."""
    return client.models.list().data[0].id


@pytest.fixture(scope="session")
def small_keyed_server(tmp_path_factory) -> Iterator[ServerProcess]:
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text(f"# e2e keys\n{SMALL_SERVER_FILE_KEY}\n")
    with serve("--dtype", "bfloat16", "--api-key-file", str(key_file),
               "--max-body-size", str(SMALL_SERVER_MAX_BODY_SIZE),
               "--max-model-len", str(SMALL_SERVER_MAX_MODEL_LEN), "--max-num-seqs", "1",
               "--max-queued-requests", "1", api_key=SMALL_SERVER_FLAG_KEY) as server:
        yield server


@pytest.fixture(scope="session")
def thinking_server() -> Iterator[ServerProcess]:
    """SmolLM2 served with llama.cpp's copy of QwQ-32B's chat template, whose generation prompt
    opens `<think>`: the output starts inside the thinking, and since SmolLM2 never writes
    `</think>` itself, a thinking budget (or max_tokens) is what ends it. bfloat16 weights load
    fastest."""
    from tokios.model_files import llama_cpp_sources

    template = llama_cpp_sources() / "models" / "templates" / "Qwen-QwQ-32B.jinja"
    with serve("--dtype", "bfloat16", "--chat-template", str(template)) as server:
        yield server
