"""Trained embedding models and a cross-encoder beside a chat model in one real `tokios serve`,
through the official clients (`openai`, LangChain's OpenAIEmbeddings, `ollama`) and raw HTTP.

One server for the module: SmolLM2 (the default, a chat model whose vectors are pooled hidden
states), all-MiniLM-L6-v2 as its sentence-transformers directory, as llama.cpp's F32 GGUF and as
a copy of the directory that declares Matryoshka sizes, and a tiny seeded cross-encoder
(tests/conftest.py's `tiny_cross_encoder`). Vectors are checked against sentence-transformers'
`encode` on the same texts, relevance scores against transformers' own forward of the
cross-encoder; each route refuses a model of another kind with a 400; bad inputs get 400s naming
the field; concurrent requests get the vectors sequential ones get.
"""

from __future__ import annotations

import base64
import json
import shutil
import threading

import httpx
import numpy as np
import ollama
import openai
import pytest

from conftest import serve

CHAT = "SmolLM2-135M-Instruct"
MINILM, MINILM_GGUF, MATRYOSHKA, RERANKER = "minilm", "minilm-gguf", "minilm-matryoshka", "reranker"
MATRYOSHKA_SIZES = [384, 256, 128]
TEXTS = ["The cat sat on the mat.", "A cat was sitting on a mat.", "Stock markets fell sharply today.",
         "Der schnelle braune Fuchs springt über den faulen Hund.", "東京は日本の首都です。", "ok",
         "Héllo, wörld! ¿Qué tal?"]
# Well past MiniLM's 256 tokens (about 440 WordPiece tokens).
LONG_TEXT = " ".join(f"sentence {index} talks about retrieval, vectors and rerankers." for index in range(50))
# float32 vectors against sentence-transformers' (directory, GGUF, Matryoshka cut, truncated):
# measured cosine 1 - 7e-13 at worst.
MIN_COSINE = 0.9999
# A vector from 16 concurrent requests against the same from sequential ones: measured 1.5e-7 at most.
BATCHING_TOLERANCE = 1e-5
# Relevance scores against transformers' sigmoid(logit) on the same weights: measured 1.6e-6 at most.
SCORE_TOLERANCE = 1e-5


def unit(vectors) -> np.ndarray:
    array = np.asarray(vectors, dtype=np.float64)
    return array / np.linalg.norm(array, axis=-1, keepdims=True)


def min_cosine(a, b) -> float:
    return float(np.min(np.sum(unit(a) * unit(b), axis=-1)))


@pytest.fixture(scope="module")
def matryoshka_directory(minilm_directory, tmp_path_factory):
    """MiniLM's directory declaring the sizes its vectors may be cut to (its weights linked, not copied)."""
    directory = tmp_path_factory.mktemp("minilm-matryoshka")
    for path in minilm_directory.iterdir():
        if path.name == "model.safetensors":
            (directory / path.name).symlink_to(path)
        elif path.is_dir():
            shutil.copytree(path, directory / path.name)
        else:
            shutil.copy(path, directory / path.name)
    config = json.loads((minilm_directory / "config.json").read_text())
    config["matryoshka_dimensions"] = MATRYOSHKA_SIZES
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def server(minilm_directory, minilm_gguf, matryoshka_directory, tiny_cross_encoder):
    from tokios.model_files import default_model_path

    with serve("--model", str(default_model_path()), "--model", f"{minilm_directory}={MINILM}",
               "--model", f"{minilm_gguf}={MINILM_GGUF}", "--model", f"{matryoshka_directory}={MATRYOSHKA}",
               "--model", f"{tiny_cross_encoder[0]}={RERANKER}", "--kv-cache-memory", "128MiB") as process:
        yield process


@pytest.fixture(scope="module")
def http(server):
    with server.client() as opened:
        yield opened


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


@pytest.fixture(scope="module")
def sentence_transformer(minilm_directory):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_directory), device="cpu")


@pytest.fixture(scope="module")
def expected(sentence_transformer) -> np.ndarray:
    """sentence-transformers' vectors of TEXTS (normalised by the model's Normalize module)."""
    return sentence_transformer.encode(TEXTS, convert_to_numpy=True)


def error_of(response: httpx.Response, param: str) -> str:
    """The message of a 400 naming `param`."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


# ---- the official clients ------------------------------------------------------------------------

@pytest.mark.parametrize("model", [MINILM, MINILM_GGUF])
def test_openai_client_vectors_equal_sentence_transformers(client, expected, sentence_transformer, model):
    # Without an encoding_format the client asks for base64 and decodes it itself.
    by_default = [item.embedding for item in client.embeddings.create(model=model, input=TEXTS).data]
    as_floats = client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    as_base64 = client.embeddings.create(model=model, input=TEXTS, encoding_format="base64")
    decoded = [np.frombuffer(base64.b64decode(item.embedding), dtype="<f4") for item in as_base64.data]
    floats = [item.embedding for item in as_floats.data]
    for vectors in (by_default, floats, decoded):
        assert np.asarray(vectors).shape == (len(TEXTS), 384)
        assert min_cosine(vectors, expected) >= MIN_COSINE
        assert np.allclose(np.linalg.norm(vectors, axis=-1), 1.0, atol=1e-5)
    # Three requests, each packed with whatever else was queued: float32 products over differently
    # composed batches may differ in the last bits, never more.
    assert np.allclose(np.asarray(by_default, dtype=np.float32), np.asarray(decoded), atol=1e-6)
    assert np.allclose(np.asarray(floats, dtype=np.float32), np.asarray(decoded), atol=1e-6)
    assert [item.index for item in as_floats.data] == list(range(len(TEXTS)))
    num_tokens = sum(len(sentence_transformer.tokenizer(text)["input_ids"]) for text in TEXTS)
    assert as_floats.usage.prompt_tokens == num_tokens


def test_token_id_inputs_equal_their_texts(client, expected, sentence_transformer):
    ids_list = [sentence_transformer.tokenizer(text)["input_ids"] for text in TEXTS[:3]]
    answer = client.embeddings.create(model=MINILM, input=ids_list, encoding_format="float")
    assert min_cosine([item.embedding for item in answer.data], expected[:3]) >= MIN_COSINE
    for bad in ([[101, 30522, 102]], [[101, -1, 102]]):  # past the vocabulary (30,522 tokens), negative
        with pytest.raises(openai.BadRequestError) as raised:
            client.embeddings.create(model=MINILM, input=bad)
        assert raised.value.status_code == 400 and "out of range" in raised.value.message


def test_dimensions_cut_a_matryoshka_model_and_are_refused_elsewhere(client, expected):
    for size in MATRYOSHKA_SIZES[1:]:
        answer = client.embeddings.create(model=MATRYOSHKA, input=TEXTS, dimensions=size, encoding_format="float")
        vectors = np.asarray([item.embedding for item in answer.data])
        assert vectors.shape == (len(TEXTS), size)
        assert np.allclose(np.linalg.norm(vectors, axis=-1), 1.0, atol=1e-5)  # renormalised after the cut
        assert min_cosine(vectors, expected[:, :size]) >= MIN_COSINE
    for model, size, words in ((MINILM, 256, "declares no shorter"), (MATRYOSHKA, 200, "one of the sizes"),
                               (MINILM, 1000, "384 dimensions"), (MATRYOSHKA, 1000, "384 dimensions")):
        with pytest.raises(openai.BadRequestError) as raised:
            client.embeddings.create(model=model, input="a text", dimensions=size)
        assert raised.value.body["param"] == "dimensions" and words in raised.value.message


def test_langchain_openai_embeddings(server, expected):
    from langchain_openai import OpenAIEmbeddings

    # Its default (check_embedding_ctx_length) sends tiktoken's ids, whose table is a download.
    embeddings = OpenAIEmbeddings(model=MINILM, base_url=f"{server.base_url}/v1", api_key="unused",
                                  check_embedding_ctx_length=False, max_retries=0)
    assert min_cosine(embeddings.embed_documents(TEXTS), expected) >= MIN_COSINE
    assert min_cosine([embeddings.embed_query(TEXTS[2])], expected[2:3]) >= MIN_COSINE


def test_ollama_client_and_the_legacy_route(server, http, expected, sentence_transformer):
    ollama_client = ollama.Client(host=server.base_url, timeout=120)
    assert ollama_client.show(MINILM).capabilities == ["embedding"]
    assert ollama_client.show(RERANKER).capabilities == []
    assert min_cosine(ollama_client.embed(model=MINILM, input=TEXTS).embeddings, expected) >= MIN_COSINE
    single = ollama_client.embed(model=MINILM_GGUF, input=TEXTS[0])
    assert len(single.embeddings) == 1 and min_cosine(single.embeddings, expected[:1]) >= MIN_COSINE
    legacy = http.post("/api/embeddings", json={"model": MINILM, "prompt": TEXTS[1]})
    assert min_cosine([legacy.json()["embedding"]], expected[1:2]) >= MIN_COSINE
    # Ollama truncates a long input by default, keeping the first tokens, as sentence-transformers does.
    truncated = ollama_client.embed(model=MINILM, input=LONG_TEXT).embeddings
    assert min_cosine(truncated, sentence_transformer.encode([LONG_TEXT])) >= MIN_COSINE
    with pytest.raises(ollama.ResponseError) as raised:
        ollama_client.embed(model=MINILM, input=LONG_TEXT, truncate=False)
    assert raised.value.status_code == 400 and "256" in raised.value.error


# ---- rerank ----------------------------------------------------------------------------------------

def test_rerank_scores_equal_transformers_sorted_and_cut(http, tiny_cross_encoder):
    import torch
    from transformers import AutoTokenizer

    query = "Where do cats like to sit?"
    documents = ["Cats sit on mats and warm laptops.", "The stock market fell today.", "Dogs chase cats.",
                 "A mat is a flat piece of fabric.", "Quarterly revenue grew by four percent."]
    directory, model = tiny_cross_encoder
    tokenizer = AutoTokenizer.from_pretrained(directory)
    with torch.no_grad():
        batch = tokenizer([query] * len(documents), documents, padding=True, return_tensors="pt")
        reference = torch.sigmoid(model(**batch).logits[:, 0]).tolist()
    order = sorted(range(len(documents)), key=lambda index: -reference[index])
    assert min(abs(a - b) for a, b in zip(sorted(reference), sorted(reference)[1:])) > 10 * SCORE_TOLERANCE

    # Documents as strings and as Jina's / Cohere's {"text": ...} objects.
    sent = [document if index % 2 else {"text": document} for index, document in enumerate(documents)]
    answer = http.post("/v1/rerank", json={"model": RERANKER, "query": query, "documents": sent}).json()
    assert [result["index"] for result in answer["results"]] == order
    for result in answer["results"]:
        assert abs(result["relevance_score"] - reference[result["index"]]) <= SCORE_TOLERANCE
        assert "document" not in result
    scores = [result["relevance_score"] for result in answer["results"]]
    assert scores == sorted(scores, reverse=True)
    assert answer["usage"]["prompt_tokens"] == int(batch["attention_mask"].sum())

    top = http.post("/rerank", json={"model": RERANKER, "query": query, "documents": documents, "top_n": 2,
                                     "return_documents": True}).json()
    assert [result["index"] for result in top["results"]] == order[:2]
    assert [result["document"]["text"] for result in top["results"]] == [documents[index] for index in order[:2]]


def test_each_route_refuses_a_model_of_another_kind(http):
    rerank = {"query": "a question", "documents": ["a document"]}
    for model, kind in ((CHAT, "generative"), (MINILM, "embedding model")):
        message = error_of(http.post("/v1/rerank", json={"model": model, **rerank}), "model")
        assert kind in message and "cross-encoder" in message
    message = error_of(http.post("/v1/embeddings", json={"model": RERANKER, "input": "a text"}), "model")
    assert "cross-encoder" in message and "embeddings" in message
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    message = error_of(http.post("/v1/chat/completions", json={"model": RERANKER, **chat}), "model")
    assert "cross-encoder" in message and "text generation" in message
    message = error_of(http.post("/v1/chat/completions", json={"model": MINILM, **chat}), "model")
    assert "embedding model" in message and "text generation" in message


# ---- model cards -----------------------------------------------------------------------------------

def test_model_cards_say_what_each_model_is(http, client):
    chat_vectors = client.embeddings.create(model=CHAT, input=TEXTS[:2], encoding_format="float")
    assert len(chat_vectors.data[0].embedding) == 576  # a chat model still embeds (pooled hidden states)
    for model in (MINILM, MINILM_GGUF, MATRYOSHKA):  # loads each, so its card is complete
        client.embeddings.create(model=model, input="x")
    http.post("/v1/rerank", json={"model": RERANKER, "query": "q", "documents": ["d"]}).raise_for_status()
    cards = {card["id"]: card for card in http.get("/v1/models").json()["data"]}
    assert cards[CHAT]["kind"] == "generate"
    assert cards[CHAT]["embedding"]["source"] == "pooled_hidden_states"
    assert cards[CHAT]["embedding"]["dimensions"] == 576
    for model, max_input_tokens in ((MINILM, 256), (MINILM_GGUF, 512), (MATRYOSHKA, 256)):
        card = cards[model]
        assert card["kind"] == "embedding", card
        assert card["embedding"]["source"] == "trained" and card["embedding"]["dimensions"] == 384
        assert card["embedding"]["pooling"] == "mean" and card["embedding"]["normalized"] is True
        assert card["embedding"]["max_input_tokens"] == max_input_tokens
    assert cards[MATRYOSHKA]["embedding"]["matryoshka_dimensions"] == MATRYOSHKA_SIZES
    assert "matryoshka_dimensions" not in cards[MINILM]["embedding"]
    assert cards[RERANKER]["kind"] == "rerank" and "embedding" not in cards[RERANKER]


# ---- bad inputs ------------------------------------------------------------------------------------

def test_bad_inputs_get_clear_400s(http, sentence_transformer):
    def post(**body):
        return http.post("/v1/embeddings", json={"model": MINILM, "encoding_format": "float", **body})

    assert "empty" in error_of(post(input=[]), "input")
    assert "10000 items" in error_of(post(input=["word"] * 10_000), "input")
    assert "mixes texts and token ids" in error_of(post(input=["a text", [101, 102]]), "input")
    assert "empty string" in error_of(post(input=""), "input")
    assert "input[1] is an empty string" in error_of(post(input=["a text", ""]), "input")
    message = error_of(post(input=["a text", LONG_TEXT]), "input")
    assert "input[1]" in message and "256" in message and "truncate" in message
    truncated = post(input=[LONG_TEXT], truncate=True).json()
    assert truncated["usage"]["prompt_tokens"] == 256
    # sentence-transformers cuts at its max_seq_length (256) and keeps the closing [SEP].
    assert min_cosine([truncated["data"][0]["embedding"]], sentence_transformer.encode([LONG_TEXT])) >= MIN_COSINE
    assert "384 dimensions, got 385" in error_of(post(input="a text", dimensions=385), "dimensions")
    assert "declares no prompt 'query'" in error_of(post(input="a text", prompt_name="query"), "prompt_name")


# ---- concurrency -----------------------------------------------------------------------------------

def test_concurrent_requests_get_the_vectors_sequential_ones_get(server, http):
    # 16 requests of 20 inputs of different lengths (3 to about 60 tokens): packed across requests.
    words = "retrieval augmented generation needs an embedding model and a reranker beside the chat model".split()
    requests = [[" ".join(words[(request + item) % len(words):] + words[:(request * item) % len(words)])
                 for item in range(20)] for request in range(16)]

    def embed(texts: list[str]) -> np.ndarray:
        response = httpx.post(f"{server.base_url}/v1/embeddings", timeout=120,
                              json={"model": MINILM, "input": texts, "encoding_format": "float"})
        response.raise_for_status()
        return np.asarray([item["embedding"] for item in response.json()["data"]])

    sequential = [embed(texts) for texts in requests]
    concurrent: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            concurrent[index] = embed(requests[index])
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    difference = max(float(np.max(np.abs(concurrent[index] - sequential[index]))) for index in range(len(requests)))
    assert difference <= BATCHING_TOLERANCE
    stats = http.get("/v1/engine/stats", params={"model": MINILM}).json()
    assert stats["num_unfinished_requests"] == 0 and stats["num_requests_in_flight"] == 0
    assert stats["num_waiting"] == 0 and stats["invariants_error"] is None
    metrics = http.get("/metrics").text
    assert f'tokios:num_requests_running{{model_name="{MINILM}"}} 0.0' in metrics
