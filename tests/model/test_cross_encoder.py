"""A BERT cross-encoder (BertForSequenceClassification, one label) as users get it: a tiny seeded
random model with all-MiniLM-L6-v2's WordPiece vocabulary, saved as a Hugging Face directory
(tests/conftest.py's `tiny_cross_encoder`, which the server tests serve too) and converted by
llama.cpp's convert_hf_to_gguf.py.

The two files do not hold the same model. The converter drops BERT's pooler (dense + tanh on the
[CLS] state, which transformers applies before the classifier), and llama.cpp's graph then puts
the classifier straight on the [CLS] state (llama-graph.cpp build_pooling, RANK with no `cls`
tensor). So: the directory's scores equal transformers' logits and sentence-transformers'
CrossEncoder.predict (a sigmoid over the one logit); the GGUF's equal the classifier applied to
the base model's [CLS] state, which is what llama.cpp computes from that file (with the document's
token types; llama.cpp's runtime reads every token as type 0, its limitation, not the file's).

Tolerance: the logits spread over three units; the largest differences measured were 4.3e-6
(directory), 1.9e-6 (GGUF) and 6.6e-7 (the server's sigmoid scores), float32 in other summation
orders. SCORE_ATOL leaves twenty times that, far below what the pooler changes (11 units here).
"""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch

from tokios.encoder.batch import EncoderBatch
from tokios.encoder.loader import EMBEDDING, RERANK, load_encoder, model_kind

SCORE_ATOL = 1e-4
QUERY = "how do lighthouses warn ships at night?"
DOCUMENTS = [
    "A lighthouse sends a beam of light from its lamp, turning so that ships see it flash.",
    "Der Leuchtturm stand auf einer Klippe.",
    "Stock markets fell sharply today after the announcement.",
    "Lighthouse keepers climbed the stairs every evening to light the lamp.",
    "café naïve Zürich — 1234567890",
]
LONG_DOCUMENT = "the keeper counted one hundred and twelve steps every evening " * 20


def _transformers():
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def cross_encoder(tiny_cross_encoder):
    """(HF directory, converted F32 GGUF, the transformers model) of the tiny seeded cross-encoder
    (tests/conftest.py)."""
    from tokios.tools.bench.peers import convert_hf_directory

    directory, model = tiny_cross_encoder
    gguf = convert_hf_directory(directory, directory.parent / "cross-encoder-f32.gguf", "f32")
    return directory, gguf, model


def _tokios_logits(encoder, query: str, documents: list[str]) -> torch.Tensor:
    """The documents' pairs with the query packed into one forward: [num_documents] logits."""
    pairs = [encoder.tokenizer.encode_pair(query, document) for document in documents]
    batch = EncoderBatch.pack([ids for ids, _ in pairs], [types for _, types in pairs])
    with torch.inference_mode():
        logits = encoder.head(encoder.model.forward(batch), batch)
    assert logits.shape == (len(documents), 1)
    return logits[:, 0]


def _transformers_inputs(directory, query: str, documents: list[str]):
    tokenizer = _transformers().AutoTokenizer.from_pretrained(str(directory))
    return tokenizer([query] * len(documents), documents, padding=True, return_tensors="pt")


def test_the_directory_scores_as_transformers_and_sentence_transformers(cross_encoder):
    from sentence_transformers import CrossEncoder

    directory, _, model = cross_encoder
    encoder = load_encoder(str(directory))
    ours = _tokios_logits(encoder, QUERY, DOCUMENTS)
    inputs = _transformers_inputs(directory, QUERY, DOCUMENTS)
    for index, document in enumerate(DOCUMENTS):
        ids, types = encoder.tokenizer.encode_pair(QUERY, document)
        assert ids == inputs.input_ids[index][inputs.attention_mask[index] == 1].tolist()
        assert types == inputs.token_type_ids[index][inputs.attention_mask[index] == 1].tolist()
    with torch.no_grad():
        expected = model(**inputs).logits[:, 0]
    assert expected.max() - expected.min() > 1.0, "the tiny model's scores barely differ: too weak a test"
    assert torch.allclose(ours, expected, atol=SCORE_ATOL), (ours - expected).abs().max()
    predicted = CrossEncoder(str(directory), device="cpu").predict([(QUERY, document) for document in DOCUMENTS],
                                                                   convert_to_tensor=True)
    assert torch.allclose(torch.sigmoid(ours), predicted.float(), atol=SCORE_ATOL)


def test_the_gguf_scores_as_llama_cpp_computes_without_the_pooler_the_converter_dropped(cross_encoder, caplog):
    from tokios.gguf_file import GGUFFile

    directory, gguf, model = cross_encoder
    assert not any(name.startswith("cls.weight") for name in GGUFFile(str(gguf)).tensors)  # the pooler is gone
    with caplog.at_level(logging.WARNING, logger="tokios.engine"):
        encoder = load_encoder(str(gguf))
    assert any("pooler" in record.getMessage() for record in caplog.records)
    ours = _tokios_logits(encoder, QUERY, DOCUMENTS)
    inputs = _transformers_inputs(directory, QUERY, DOCUMENTS)
    with torch.no_grad():
        cls_state = model.bert(**inputs).last_hidden_state[:, 0]
        llama_cpp = model.classifier(cls_state)[:, 0]
        with_pooler = model(**inputs).logits[:, 0]
    assert torch.allclose(ours, llama_cpp, atol=SCORE_ATOL), (ours - llama_cpp).abs().max()
    assert (llama_cpp - with_pooler).abs().max() > 100 * SCORE_ATOL  # the two computations are told apart


def test_model_kind_is_read_from_the_files(cross_encoder, minilm_directory, minilm_gguf):
    directory, gguf, _ = cross_encoder
    assert model_kind(str(directory)) == model_kind(str(gguf)) == RERANK
    assert model_kind(str(minilm_directory)) == model_kind(str(minilm_gguf)) == EMBEDDING


@pytest.fixture(scope="module")
def rerank_client(cross_encoder):
    """A TestClient of the server with the directory's cross-encoder on the encoder engine."""
    from starlette.testclient import TestClient

    from tokios.config import EngineConfig
    from tokios.encoder.engine import EncoderEngine
    from tokios.server.app import create_app
    from tokios.server.registry import ModelRegistry, ModelSpec
    from tokios.server.serving import ServerSettings

    path = str(cross_encoder[0])
    spec = ModelSpec(names=["reranker"], path=path, kind=model_kind(path),
                     load=lambda: EncoderEngine(EngineConfig.from_options(model=path, dtype="float32")))
    with TestClient(create_app(ServerSettings(), registry=ModelRegistry([spec]))) as client:
        while client.get("/health").json()["status"] == "loading":
            time.sleep(0.05)
        yield client


def test_rerank_orders_by_sentence_transformers_scores_and_truncates_a_long_document(cross_encoder, rerank_client):
    from sentence_transformers import CrossEncoder

    documents = [*DOCUMENTS, LONG_DOCUMENT]
    max_positions = cross_encoder[2].config.max_position_embeddings  # LONG_DOCUMENT crosses it
    response = rerank_client.post("/v1/rerank", json={"model": "reranker", "query": QUERY, "documents": documents})
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    # The long document loses its end, its closing [SEP] kept: sentence-transformers' truncation
    # to the same length (longest first, which cuts the document).
    expected = CrossEncoder(str(cross_encoder[0]), device="cpu", max_length=max_positions).predict(
        [(QUERY, document) for document in documents], convert_to_tensor=True).float()
    assert [result["index"] for result in results] == torch.argsort(expected, descending=True).tolist()
    scores = torch.tensor([result["relevance_score"] for result in sorted(results, key=lambda r: r["index"])])
    assert torch.allclose(scores, expected, atol=SCORE_ATOL), (scores - expected).abs().max()

    refused = rerank_client.post("/v1/rerank", json={"model": "reranker", "query": QUERY, "documents": documents,
                                                     "truncation": False})
    assert refused.status_code == 400
    assert json.dumps(refused.json()).count(f"limit of {max_positions}") == 1


@pytest.mark.parametrize("declared, expected", [(None, "sigmoid"), ("torch.nn.modules.linear.Identity", "identity"),
                                                ("torch.nn.modules.activation.Tanh", "tanh")])
def test_the_score_activation_is_the_one_the_directory_declares(cross_encoder, tmp_path, declared, expected):
    """sentence-transformers' CrossEncoder keeps its activation in config.json (ms-marco-MiniLM
    declares Identity: raw logits); without one, its default for one label, the sigmoid."""
    import json
    import shutil

    from tokios.encoder.declared import declaration_from_directory

    directory = tmp_path / "cross-encoder"
    shutil.copytree(cross_encoder[0], directory)
    if declared is not None:
        config = json.loads((directory / "config.json").read_text())
        config["sentence_transformers"] = {"activation_fn": declared}
        (directory / "config.json").write_text(json.dumps(config))
    declaration = declaration_from_directory(str(directory), default_pooling="cls", is_cross_encoder=True)
    assert declaration.is_rerank and declaration.score_activation == expected
