"""SIGTERM: in-flight requests finish, new ones get 503 with Retry-After, the process exits.

Each test starts its own server (it is the thing being stopped), with bfloat16 weights: they load
faster than the default int8 (no quantization at load), and shutdown does not depend on the format.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx

from conftest import serve

IN_FLIGHT_TOKENS = 100
FAST_LOADING = ("--dtype", "bfloat16")
FIRST_CHUNK_TIMEOUT_S = 120.0


class StreamReader(threading.Thread):
    """Streams one completion and records what arrived; `first_chunk` is set on the first token."""

    def __init__(self, base_url: str, body: dict):
        super().__init__(daemon=True)
        self.base_url = base_url
        self.body = body
        self.first_chunk = threading.Event()
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.saw_done = False
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.base_url, timeout=300) as http:
                with http.stream("POST", "/v1/completions", json=self.body) as response:
                    assert response.status_code == 200, response.read()
                    for line in response.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        payload = line[len("data: "):]
                        if payload == "[DONE]":
                            self.saw_done = True
                            continue
                        chunk = json.loads(payload)
                        self.usage = chunk.get("usage") or self.usage
                        for choice in chunk.get("choices", []):
                            self.first_chunk.set()
                            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.first_chunk.set()


def start_readers(server, max_tokens: int, count: int) -> list[StreamReader]:
    with server.client() as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
    readers = [StreamReader(server.base_url, {
        "model": model, "prompt": f"Story number {index}:", "max_tokens": max_tokens, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}}) for index in range(count)]
    for reader in readers:
        reader.start()
    for reader in readers:
        assert reader.first_chunk.wait(FIRST_CHUNK_TIMEOUT_S), "no first token"
        assert reader.error is None, reader.error
    return readers


def wait_for_draining(server) -> httpx.Response:
    deadline = time.monotonic() + 30
    while True:
        health = httpx.get(f"{server.base_url}/health", timeout=10)
        if health.status_code == 503 or time.monotonic() > deadline:
            return health
        time.sleep(0.05)


def test_sigterm_lets_in_flight_requests_finish_and_refuses_new_ones():
    with serve(*FAST_LOADING, "--shutdown-timeout", "120") as server:
        readers = start_readers(server, IN_FLIGHT_TOKENS, 3)
        server.popen.send_signal(signal.SIGTERM)
        health = wait_for_draining(server)
        assert health.status_code == 503 and health.json() == {"status": "draining"}
        assert "Retry-After" in health.headers
        refused = httpx.post(f"{server.base_url}/v1/completions", timeout=10,
                             json={"prompt": "late", "max_tokens": 2})
        assert refused.status_code == 503, refused.text
        assert int(refused.headers["Retry-After"]) >= 1
        assert refused.json()["error"]["code"] == "overloaded"
        assert any(reader.is_alive() for reader in readers), "requests finished before the checks; raise tokens"
        for reader in readers:
            reader.join(300)
            assert reader.error is None, reader.error
            assert reader.finish_reason == "length" and reader.saw_done
            assert reader.usage["completion_tokens"] == IN_FLIGHT_TOKENS
        assert server.popen.wait(60) == 0
        log = server.log_text()
        assert "draining: 3 requests in flight" in log


def test_sigterm_aborts_what_is_left_after_the_shutdown_timeout():
    shutdown_timeout_s = 2.0
    with serve(*FAST_LOADING, "--shutdown-timeout", str(shutdown_timeout_s)) as server:
        readers = start_readers(server, 8000, 1)
        signalled = time.monotonic()
        server.popen.send_signal(signal.SIGTERM)
        assert server.popen.wait(120) == 0
        exit_after_s = time.monotonic() - signalled
        readers[0].join(30)
        assert readers[0].finish_reason == "abort" and readers[0].saw_done
        assert readers[0].usage["completion_tokens"] < 8000
        # the timeout, the 2 s grace for the aborted streams to end, and process teardown
        assert exit_after_s < shutdown_timeout_s + 30, exit_after_s
        assert "shutdown timeout reached: aborting 1 requests" in server.log_text()
