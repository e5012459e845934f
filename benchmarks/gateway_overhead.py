"""Gateway overhead on loopback: start a backend, a gateway and a connector, then run
`tokios gateway bench` (same streamed load direct and through the gateway, alternating rounds).

The backend is the deterministic stand-in of tests/e2e/gateway_backend.py by default (its pace is
set with --token-delay-ms), or the real server with --serve-model PATH (`tokios serve`).
Every process is started here and stopped at the end.

    python benchmarks/gateway_overhead.py --token-delay-ms 20 --concurrency 16
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
TOKIOS = [sys.executable, "-m", "tokios.cli"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{url}: process exited with {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} not healthy after {timeout_s} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--token-delay-ms", type=float, default=20.0, help="stand-in backend pace per token")
    parser.add_argument("--serve-model", default=None, help="use `tokios serve --model PATH` as the backend")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    work_dir = Path(tempfile.mkdtemp(prefix="tokios-gw-bench-"))
    env = {**os.environ, "TOKIOS_GATEWAY_DB": str(work_dir / "gateway.db")}
    backend_port, gateway_port = free_port(), free_port()
    backend_url, gateway_url = f"http://127.0.0.1:{backend_port}", f"http://127.0.0.1:{gateway_port}"
    if args.serve_model:
        backend_argv = [*TOKIOS, "serve", "--port", str(backend_port), "--model", args.serve_model]
        model = None
    else:
        backend_argv = [sys.executable, str(ROOT / "tests/e2e/gateway_backend.py"), "--port", str(backend_port),
                        "--model-name", "stand-in", "--token-delay-ms", str(args.token_delay_ms)]
        model = "stand-in"
    processes: list[subprocess.Popen] = []
    log = open(work_dir / "processes.log", "wb")

    def start(argv: list[str], extra_env: dict[str, str] | None = None) -> subprocess.Popen:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**env, **(extra_env or {})})
        processes.append(process)
        return process

    def new_secret(kind: str) -> str:
        out = subprocess.run([*TOKIOS, "keys", "create", "--kind", kind, "--json"], env=env,
                             capture_output=True, text=True, check=True).stdout
        return __import__("json").loads(out)["secret"]

    try:
        client_key, connector_token = new_secret("client"), new_secret("connector")
        backend = start(backend_argv)
        gateway = start([*TOKIOS, "gateway", "--port", str(gateway_port), "--log-level", "warning"])
        wait_healthy(backend_url, backend)
        wait_healthy(gateway_url, gateway)
        if model is None:
            model = httpx.get(backend_url + "/v1/models").json()["data"][0]["id"]
        start([*TOKIOS, "connect", gateway_url, "--backend-url", backend_url, "--backend-id", "bench",
               "--log-level", "warning"], {"TOKIOS_CONNECTOR_TOKEN": connector_token})
        deadline = time.monotonic() + 60
        while not httpx.get(gateway_url + "/health").json()["num_backends"]:
            if time.monotonic() > deadline:
                raise SystemExit("connector did not register within 60 s")
            time.sleep(0.2)
        bench_argv = [*TOKIOS, "gateway", "bench", "--direct-url", backend_url, "--gateway-url", gateway_url,
                      "--model", model, "--concurrency", str(args.concurrency), "--num-requests",
                      str(args.num_requests), "--max-tokens", str(args.max_tokens), "--num-rounds",
                      str(args.num_rounds)] + (["--json"] if args.json else [])
        backend_label = f"tokios serve --model {args.serve_model}" if args.serve_model else (
            f"stand-in backend, {args.token_delay_ms:g} ms/token")
        print(f"backend: {backend_label}", flush=True)
        return subprocess.run(bench_argv, env={**env, "TOKIOS_API_KEY": client_key}).returncode
    finally:
        for process in reversed(processes):
            process.terminate()
        for process in processes:
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
        log.close()


if __name__ == "__main__":
    sys.exit(main())
