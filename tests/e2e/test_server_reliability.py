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
    with serve("--stall-timeout", "1", env={"TOKIOS_INJECT_FAULT": "sleep:3:6"}) as server:
        result = {}

        def request():
            with server.client(timeout=60) as client:
                result["response"] = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 8})

        thread = threading.Thread(target=request)
        thread.start()
        statuses = []
        deadline = time.monotonic() + 6
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
