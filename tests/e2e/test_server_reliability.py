"""Failure modes of a real `tokios serve` (issue 16; docs/reliability.md has the table).

- One request's bad numbers end that request only: the value that used to crash the step
  (repetition_penalty 5e-324) now answers 200, and a request whose settings leave no token to
  sample gets its own 400 while a concurrent stream completes.
- An exception inside a step (injected with TOKIOS_INJECT_FAULT, engine/faults.py) ends every
  request in flight with an error within seconds (non-streamed: 500 in OpenAI's shape;
  streamed: an error event, then [DONE]), and the process exits non-zero: never a hang.
- A step that hangs past --stall-timeout turns /health 503 and the log names what the loop was
  doing; when it recovers, /health is 200 again. /health?generate=1 proves generation.
"""

from __future__ import annotations

import datetime
import json
import re
import subprocess
import sys
import threading
import time

import httpx

from conftest import serve

LONG_REQUEST = {"max_tokens": 400, "ignore_eos": True, "temperature": 0}
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ERROR tokios.engine: engine step failed", re.M)


def fault_time(log_text: str) -> float:
    """When the server logged the failed step, as a time.time() value (same machine clock)."""
    stamp = LOG_TIME.search(log_text).group(1)
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def test_a_denormal_repetition_penalty_answers_200(tokios_server):
    with tokios_server.client() as client:
        response = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Say hello hello hello"}], "max_tokens": 5,
            "repetition_penalty": 5e-324, "temperature": 0.7})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_a_request_with_nothing_to_sample_fails_alone_while_a_stream_completes(tokios_server):
    stream_result = {}

    def stream_innocent():
        with tokios_server.client() as client, client.stream("POST", "/v1/completions", json={
                "prompt": "Once upon a time", "stream": True, **{**LONG_REQUEST, "max_tokens": 40}}) as response:
            stream_result["events"] = [line for line in response.iter_lines() if line.startswith("data: ")]

    innocent = threading.Thread(target=stream_innocent)
    innocent.start()
    time.sleep(0.3)
    with tokios_server.client() as client:
        doomed = client.post("/v1/completions", json={
            "prompt": "Hi", "max_tokens": 3, "min_tokens": 2, "stop_token_ids": list(range(49152))})
    innocent.join(60)
    assert doomed.status_code == 400, doomed.text
    assert doomed.json()["error"]["code"] == "no_token_to_sample"
    events = stream_result["events"]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_health_generate_runs_one_token(tokios_server):
    response = httpx.get(f"{tokios_server.base_url}/health", params={"generate": "1"}, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "ok" and response.json()["generated_tokens"] == 1


def test_a_failed_step_ends_every_request_with_an_error_and_the_server_exits_non_zero():
    with serve(env={"TOKIOS_INJECT_FAULT": "raise:15"}) as server:
        results: dict[str, object] = {}
        ended_at: dict[str, float] = {}

        def non_streamed(name: str):
            with server.client(timeout=120) as client:
                results[name] = client.post("/v1/completions", json={"prompt": f"Story {name}:", **LONG_REQUEST})
            ended_at[name] = time.time()

        def streamed(name: str):
            with server.client(timeout=120) as client, client.stream("POST", "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": f"Tell story {name}"}], "stream": True,
                    **LONG_REQUEST}) as response:
                results[name] = [line for line in response.iter_lines() if line.startswith("data: ")]
            ended_at[name] = time.time()

        threads = [threading.Thread(target=non_streamed, args=(f"plain{i}",)) for i in range(2)]
        threads += [threading.Thread(target=streamed, args=(f"stream{i}",)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert len(ended_at) == 4, f"requests hung after the fault\n{server.log_tail()}"
        slowest_s = max(ended_at.values()) - fault_time(server.log_text())
        assert slowest_s < 5, f"the last request ended {slowest_s:.1f} s after the fault\n{server.log_tail()}"
        for name in ("plain0", "plain1"):
            response = results[name]
            assert response.status_code == 500, response.text
            error = response.json()["error"]
            assert error["code"] == "engine_failed" and "fault injected at step 15" in error["message"]
        for name in ("stream0", "stream1"):
            events = results[name]
            assert events[-1] == "data: [DONE]", events[-3:]
            assert json.loads(events[-2][6:])["error"]["code"] == "engine_failed"
        try:
            health = httpx.get(f"{server.base_url}/health", timeout=5)
            assert health.status_code == 503 and health.json()["status"] == "failed"
        except httpx.TransportError:
            pass  # already gone: also right
        server.popen.wait(10)
        assert server.popen.returncode not in (0, None), server.log_tail()
        assert "the engine failed" in server.log_text()


def test_a_hung_step_turns_health_503_and_the_log_says_what_the_loop_was_doing():
    with serve("--stall-timeout", "1", env={"TOKIOS_INJECT_FAULT": "sleep:3:4"}) as server:
        result = {}

        def request():
            with server.client(timeout=60) as client:
                result["response"] = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 8})

        thread = threading.Thread(target=request)
        thread.start()
        statuses = []
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            health = httpx.get(f"{server.base_url}/health", timeout=5)
            statuses.append(health.json()["status"])
            if health.status_code == 503:
                assert health.json()["status"] == "stalled"
                assert "has not advanced" in health.json()["error"]
                break
            time.sleep(0.2)
        assert statuses[-1] == "stalled", statuses
        thread.join(30)
        assert result["response"].status_code == 200  # the step recovered and finished the request
        assert httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200
        log = server.log_text()
        assert "step loop has not advanced" in log and "Engine thread stack" in log and "before_step" in log


def _closed_within(sock, timeout_s: float) -> bool:
    """Whether the server closes `sock` (recv gives b'') within timeout_s."""
    sock.settimeout(timeout_s)
    try:
        return sock.recv(1024) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def _read_until_closed(sock, timeout_s: float) -> bytes:
    """Everything the server sends on `sock` until it closes it (headers and body may come apart)."""
    sock.settimeout(timeout_s)
    received = b""
    try:
        while chunk := sock.recv(4096):
            received += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return received


def test_connections_that_hold_without_sending_are_timed_out_and_the_count_is_bounded():
    import socket
    from urllib.parse import urlsplit

    with serve("--dtype", "bfloat16", "--request-header-timeout", "1", "--request-body-timeout", "1",
               "--max-connections", "4") as server:
        address = urlsplit(server.base_url)
        host_port = (address.hostname, address.port)
        silent = socket.create_connection(host_port)
        trickling = socket.create_connection(host_port)
        trickling.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        # Three held sockets and this request make four connections: at the bound, so a 503.
        extra = [socket.create_connection(host_port) for _ in range(1)]
        over_limit = httpx.get(f"{server.base_url}/v1/models", timeout=5)
        assert over_limit.status_code == 503
        assert _closed_within(silent, 4) and _closed_within(trickling, 4)
        for sock in extra:
            assert _closed_within(sock, 4)
        assert httpx.get(f"{server.base_url}/v1/models", timeout=5).status_code == 200  # room again

        slow_body = socket.create_connection(host_port)
        slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        answer = _read_until_closed(slow_body, 5).decode()
        assert answer.startswith("HTTP/1.1 408"), answer
        assert "request-body-timeout" in answer
        for sock in (silent, trickling, slow_body, *extra):
            sock.close()


# ---- cancellation during a long prefill, direct and through the gateway ------------------------

LONG_PROMPT_TOKENS = 6000


def long_prompt(seed: int) -> list[int]:
    """6,000 token ids that share no prefix with another seed's (so no prefix-cache hit)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(LONG_PROMPT_TOKENS)]


def engine_stats(server) -> dict:
    return httpx.get(f"{server.base_url}/v1/engine/stats", timeout=5).json()


def engine_busy(server) -> int:
    stats = engine_stats(server)
    return stats["num_running"] + stats["num_waiting"]


def seconds_until_idle(server, since: float, timeout_s: float = 60) -> float:
    deadline = time.monotonic() + timeout_s
    while engine_busy(server) and time.monotonic() < deadline:
        time.sleep(0.02)
    return time.monotonic() - since


def leave_once_running(url: str, body: dict, headers: dict, server) -> bool:
    """Sends `body` on a raw socket, waits until the engine holds the request, stays 100 ms more
    and closes the connection. Returns whether the engine was seen holding it (a client that
    leaves even earlier may cancel it before it reaches the engine, which would prove nothing)."""
    import socket
    from urllib.parse import urlsplit

    address = urlsplit(url)
    payload = json.dumps(body).encode()
    head = "".join(f"{name}: {value}\r\n" for name, value in {
        "Host": address.netloc, "Content-Type": "application/json", "Content-Length": str(len(payload)),
        **headers}.items())
    sock = socket.create_connection((address.hostname, address.port))
    try:
        sock.sendall(f"POST {address.path} HTTP/1.1\r\n{head}\r\n".encode() + payload)
        deadline = time.monotonic() + 30
        while not engine_busy(server) and time.monotonic() < deadline:
            time.sleep(0.01)
        was_seen = bool(engine_busy(server))
        time.sleep(0.1)
    finally:
        sock.close()
    return was_seen


def start_gateway(tmp_path) -> tuple[subprocess.Popen, str, str, str]:
    """A `tokios gateway` subprocess with a fresh key store: (process, url, client key, connector token)."""
    import socket

    from tokios.gateway.keys import KIND_CLIENT, KIND_CONNECTOR, KeyStore

    store = KeyStore(tmp_path / "gateway.db")
    client_key = store.create(KIND_CLIENT, "tests")[1]
    connector_token = store.create(KIND_CONNECTOR, "tests")[1]
    store.close()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = open(tmp_path / "gateway.log", "wb")
    process = subprocess.Popen([sys.executable, "-m", "tokios.cli", "gateway", "--port", str(port), "--db",
                                str(tmp_path / "gateway.db"), "--log-level", "warning"],
                               stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url, client_key, connector_token
        except httpx.TransportError:
            time.sleep(0.1)
    process.kill()
    raise TimeoutError("the gateway did not start")


def test_a_client_gone_during_a_long_prefill_frees_it_before_the_prefill_ends(tmp_path):
    gateway, gateway_url, client_key, connector_token = start_gateway(tmp_path)
    try:
        with serve("--connect", gateway_url, "--max-num-batched-tokens", "256",
                   env={"TOKIOS_CONNECTOR_TOKEN": connector_token}) as server:
            gateway_headers = {"Authorization": f"Bearer {client_key}"}
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # the connector registers once the model is ready
                status = httpx.get(f"{gateway_url}/status", headers=gateway_headers, timeout=5).json()
                if status["backends"]:
                    break
                time.sleep(0.1)
            assert status["backends"], "the connector never registered with the gateway"
            model = httpx.get(f"{server.base_url}/v1/models", timeout=5).json()["data"][0]["id"]
            # 6,000 tokens in chunks of --max-num-batched-tokens (256): the prefill takes 24 steps.
            # A request freed before its prefill ended ran fewer; counting steps, not seconds,
            # keeps the test independent of the machine's speed.
            num_prefill_steps = -(-LONG_PROMPT_TOKENS // 256)
            routes = {"direct": (f"{server.base_url}/v1/completions", {}),
                      "gateway": (f"{gateway_url}/v1/completions", gateway_headers)}
            steps_run = {}
            for seed, (route, stream) in enumerate([(r, s) for r in routes for s in (False, True)], start=1):
                url, headers = routes[route]
                steps_before = engine_stats(server)["num_steps"]
                body = {"model": model, "prompt": long_prompt(seed), "max_tokens": 1, "stream": stream}
                assert leave_once_running(url, body, headers, server), (route, stream, "never reached the engine")
                seconds_until_idle(server, time.monotonic())
                steps_run[(route, "stream" if stream else "whole")] = engine_stats(server)["num_steps"] - steps_before
            print(f"steps run before the request was freed (of {num_prefill_steps}): {steps_run}")
            for key, num_steps in steps_run.items():
                assert num_steps <= num_prefill_steps // 3, (key, num_steps)
            stats = engine_stats(server)
            assert (stats["num_running"], stats["num_waiting"], stats["num_blocks_used"]) == (0, 0, 0), stats
    finally:
        gateway.terminate()
        gateway.wait(10)


