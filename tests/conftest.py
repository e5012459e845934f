"""Session-wide options, markers and test order.

`--fast` (./scripts/test --fast, the inner loop) runs the unit tier and SMOKE_TESTS: the engine
against the golden transformers results, the engine's sampling paths, and the OpenAI API of a
real server. The tier folders' other files are not even collected.

Tests marked `builds_kernels` check kernels compiled for an older instruction set (a compiler
run of about a minute each, cached afterwards under ~/.cache/tokios/kernels). Their builds start
in the background as soon as the session has collected them, and the tests themselves run last,
so the compiling overlaps the rest of the suite instead of holding up the unit tier. `--fast`
leaves them out.

all-MiniLM-L6-v2 (the embedding model the model and server tiers both use) is a session fixture
here: its sentence-transformers directory, and the F32 GGUF llama.cpp's converter makes of it,
both kept in the models directory by the set-up (tokios.model_files).
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).parent
UNIT_TIER = TESTS / "unit"
SMOKE_TESTS = (
    "model/test_parity.py::test_greedy_continuation_matches_transformers",
    "model/test_parity.py::test_logits_at_every_position_match_transformers",
    "model/test_sampling_engine.py",
    "e2e/test_server_openai.py",
)
SMOKE_FILES = {TESTS / test.split("::")[0] for test in SMOKE_TESTS}


def pytest_addoption(parser):
    parser.addoption("--fast", action="store_true",
                     help="only the unit tier (less the kernel-variant builds) and the model and server smoke")


def pytest_configure(config):
    config.addinivalue_line("markers", "builds_kernels: compiles kernel variants; runs last, not in --fast")


def pytest_ignore_collect(collection_path, config):
    if not config.getoption("--fast") or collection_path.suffix != ".py" or UNIT_TIER in collection_path.parents:
        return None
    return True if collection_path.name.startswith("test_") and collection_path not in SMOKE_FILES else None


def is_fast(item) -> bool:
    if item.get_closest_marker("builds_kernels"):
        return False
    path = Path(item.path)
    if UNIT_TIER in path.parents:
        return True
    node_id = f"{path.relative_to(TESTS).as_posix()}::{item.name}"
    return any(node_id.startswith(test if "::" in test else test + "::") for test in SMOKE_TESTS)


def pytest_collection_modifyitems(session, config, items):
    if config.getoption("--fast"):
        dropped = [item for item in items if not is_fast(item)]
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if is_fast(item)]
    building = [item for item in items if item.get_closest_marker("builds_kernels")]
    items[:] = [item for item in items if not item.get_closest_marker("builds_kernels")] + building


def pytest_collection_finish(session):
    """Start the builds once deselection (-m, -k, --fast) has settled which tests run."""
    for item in session.items:
        if item.get_closest_marker("builds_kernels"):
            start = getattr(item.module, "start_older_builds", None)
            if start is not None:
                start()


@pytest.fixture(scope="session")
def minilm_directory() -> Path:
    """all-MiniLM-L6-v2's sentence-transformers directory, as the set-up unpacked it into the
    models directory (unpacked there now if the set-up did not). Read only: a test that changes
    a file works on a copy."""
    from tokios.model_files import minilm_directory

    return minilm_directory()


@pytest.fixture(scope="session")
def minilm_gguf() -> Path:
    """all-MiniLM-L6-v2 as llama.cpp's convert_hf_to_gguf.py writes it in F32 (converted by the
    set-up, or now, once)."""
    from tokios.model_files import minilm_gguf_path

    return minilm_gguf_path("f32")


@pytest.fixture(scope="session")
def tiny_cross_encoder(minilm_directory, tmp_path_factory):
    """(Hugging Face directory, the transformers model) of a tiny seeded random one-label
    BertForSequenceClassification with all-MiniLM-L6-v2's WordPiece vocabulary and a position
    table of 96, saved as users get such a directory; the model and server tiers both score it."""
    import shutil

    import torch

    transformers = pytest.importorskip("transformers")

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(minilm_directory))
    config = transformers.BertConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=96, type_vocab_size=2, num_labels=1, initializer_range=0.2,
        architectures=["BertForSequenceClassification"])
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            # transformers makes norm weights ones and biases zeros: drawn here so that a
            # misplaced one shows, and the document's token type row differs from the query's.
            if "LayerNorm.weight" in name:
                parameter.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                parameter.normal_(0.0, 0.2)
        # The classifier reads a tanh-bounded pooler output: a larger weight spreads the scores
        # over several units (the pairs' sigmoids then differ clearly).
        model.classifier.weight.mul_(4.0)
    directory = tmp_path_factory.mktemp("tiny-cross-encoder") / "hf"
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(minilm_directory / name, directory / name)
    return directory, model
