"""`tokios serve` with a pipeline parallel group (tokios.distributed; docs/scale-out.md).

- The official openai client streams from a server whose layers run in two rank processes, and
  the text is the single-process server's (the default Q4_1 file as stored: a pipeline split
  changes no arithmetic).
- The ranks of a second "machine" (`tokios worker --node-rank 1` here, over TCP with the group
  key) serve the same text; when the server stops, the worker starts its ranks again for the
  server's next load, and leaves cleanly on Ctrl-C.
- A rank killed in the middle of a stream ends every request with an error (an error event,
  then [DONE]), the server exits non-zero within seconds, and no rank process is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from conftest import serve
from tokios.distributed.executor import free_port_pair

PROMPT = [{"role": "user", "content": "Name three colours of the rainbow."}]


def rank_pids(parent_pid: int) -> list[int]:
    # A server's engine thread starts the ranks, so they are children of that task, not of the main one.
    children = [pid for task in Path(f"/proc/{parent_pid}/task").iterdir()
                for pid in (task / "children").read_text().split()]
    return [int(pid) for pid in children
            if b"tokios.distributed.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def assert_exited(pids: list[int]) -> None:
    for pid in pids:  # gone, or a zombie its parent has not reaped yet
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2], pid


def streamed_text(server) -> str:
    stream = server.openai().chat.completions.create(model="SmolLM2-135M-Instruct", messages=PROMPT, max_tokens=24,
                                                     temperature=0, stream=True)
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def test_streams_like_one_process_and_a_killed_rank_ends_requests_and_the_server(tokios_server):
    expected = streamed_text(tokios_server)
    with serve("--pipeline-parallel-size", "2", "--threads", "1") as server:
        assert streamed_text(server) == expected and expected
        ranks = rank_pids(server.popen.pid)
        assert len(ranks) == 2, server.log_tail()
        events: list[str] = []

        def long_stream():
            with server.client(timeout=120) as client, client.stream("POST", "/v1/completions", json={
                    "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "stream": True,
                    "temperature": 0}) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line)

        reader = threading.Thread(target=long_stream)
        reader.start()
        deadline = time.monotonic() + 60
        while len(events) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(events) >= 5, server.log_tail()
        os.kill(ranks[1], signal.SIGKILL)
        reader.join(30)
        assert not reader.is_alive(), "the stream hung after a rank died"
        assert events[-1] == "data: [DONE]", events[-3:]
        error = json.loads(events[-2][6:])["error"]
        assert error["code"] == "engine_failed" and "rank 1" in error["message"], error
        assert server.popen.wait(15) != 0
        time.sleep(0.5)
        assert_exited(ranks)
        assert "the parallel group lost a rank" in server.log_text()


def test_ranks_on_a_second_machine_join_with_tokios_worker(tokios_server):
    expected = streamed_text(tokios_server)
    port = free_port_pair("127.0.0.1")
    env = {**os.environ, "TOKIOS_DIST_KEY": "e2e-group-key"}
    group = ["--pipeline-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
             "--master-port", str(port), "--threads", "1"]
    worker = subprocess.Popen([sys.executable, "-m", "tokios.cli", "worker", *group, "--node-rank", "1"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with serve(*group, env={"TOKIOS_DIST_KEY": "e2e-group-key"}) as server:
            assert streamed_text(server) == expected
            assert "rank 1: layers range(15, 30)" in server.log_text()
        # The worker outlives the server: its ranks start again and wait for the next load.
        deadline = time.monotonic() + 30
        lines = []
        while time.monotonic() < deadline and not any("starting the ranks again" in line for line in lines):
            lines.append(worker.stdout.readline())
        assert any("starting the ranks again" in line for line in lines), lines
        deadline = time.monotonic() + 30
        while not (ranks := rank_pids(worker.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ranks, "the worker did not start its ranks again"
        # SIGTERM, as `kill`, systemd or `docker stop` send it, stops the worker and its ranks.
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 0
        assert_exited(ranks)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(10)
