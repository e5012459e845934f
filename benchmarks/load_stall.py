"""A model load beside another model's streams: the streams' inter-token p95 before and during it.

One `tokios serve` holds the default model twice (`default`, `second`). Each run unloads `second`,
starts 4 streams of 400 tokens on `default`, and 1.5 s later asks `second` for one token, which
loads it; the streams' inter-token gaps are split into those before the load and those inside
it. The same scenario as tests/e2e/test_server_models.py's load test, which asserts only what a
stall would break (timed assertions do not belong in tests); this prints the ratio the issue's
target is about (p95 during / p95 before <= 2). p95: the value at rank 0.95 x (n - 1) of the
sorted gaps.

    python benchmarks/load_stall.py --runs 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

E2E_DIR = Path(__file__).resolve().parents[1] / "tests" / "e2e"


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[int(0.95 * (len(ordered) - 1))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    sys.path.insert(0, str(E2E_DIR))
    import ollama
    from conftest import serve
    from test_server_models import SECOND, _stream_token_times, chat, default_model_path

    path = default_model_path()
    ratios = []
    with serve("--model", f"{path}=default", "--model", f"{path}={SECOND}", "--kv-cache-memory", "128MiB") as server:
        for run in range(args.runs):
            ollama.Client(host=server.base_url).generate(model=SECOND, prompt="", keep_alive=0)
            streams = [([], threading.Event()) for _ in range(4)]
            threads = [threading.Thread(target=_stream_token_times, args=(server, "default", 400, times, started))
                       for times, started in streams]
            for thread in threads:
                thread.start()
            for _, started in streams:
                started.wait(60)
            time.sleep(1.5)
            load_started = time.monotonic()
            if chat(server, SECOND, max_tokens=1).status_code != 200:
                raise RuntimeError(f"the load failed:\n{server.log_tail()}")
            load_ended = time.monotonic()
            for thread in threads:
                thread.join()
            before, during = [], []
            for times, _ in streams:
                for previous, current in zip(times, times[1:]):
                    if current < load_started:
                        before.append(current - previous)
                    elif previous >= load_started and current <= load_ended:
                        during.append(current - previous)
            ratios.append(p95(during) / p95(before))
            print(f"run {run + 1}: inter-token p95 before {p95(before) * 1000:.1f} ms, during the load "
                  f"{p95(during) * 1000:.1f} ms, ratio {ratios[-1]:.2f}; the load took "
                  f"{load_ended - load_started:.2f} s", flush=True)
    print(f"ratios {', '.join(f'{r:.2f}' for r in ratios)}; median {statistics.median(ratios):.2f}; "
          f"within 2x in {sum(r <= 2 for r in ratios)} of {len(ratios)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
