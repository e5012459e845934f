"""all-MiniLM-L6-v2, the real embedding model, against sentence-transformers' `encode` on the same
texts: from its sentence-transformers directory and from the GGUF files llama.cpp's converter
writes (F32 and Q8_0), through the encoder engine's packed forwards.

Texts: short, one at the model's 256-token limit (its directory's max_seq_length; the GGUF
carries no such limit, its position table is 512), multilingual, and near-empty ones. Measured
(this file's texts): directory and F32 cosine 1 - 1e-7; Q8_0 min 0.9993 ("." and " "; q, k, v and
the up projection on precise activations, the rest 8-bit: encoder/bert.py), where llama.cpp's own
Q8_0 gives 0.9988 on other texts. And the
retrieval order of a small labelled set: each query's documents ranked as sentence-transformers
ranks them.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from tokios.encoder.batch import EncoderBatch
from tokios.encoder.loader import load_encoder

TEXTS = [
    "The cat sat on the mat.",
    "A man is playing a guitar on stage.",
    "Stock markets fell sharply today after the announcement.",
    "Zażółć gęślą jaźń.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "東京は日本の首都です。",
    "Привет, как дела?",
    "café naïve résumé",
    ".",
    "a",
    " ",
    "🙂",
]

# Queries and documents (three relevant to each query among them).
QUERIES = ["How do I bake bread at home?", "What causes earthquakes?", "Best way to learn the guitar"]
DOCUMENTS = [
    "Knead the dough, let it rise for an hour, then bake it at 220 degrees.",
    "Tectonic plates slip past each other and release energy as seismic waves.",
    "Practice chords every day and learn simple songs before scales.",
    "Sourdough needs a starter fed with flour and water.",
    "Faults in the Earth's crust store stress until it is released suddenly.",
    "A teacher can correct your fingering and strumming early on.",
    "The stock market closed higher on Friday.",
    "Penguins live mostly in the Southern Hemisphere.",
    "Yeast turns sugar into carbon dioxide, which makes the loaf rise.",
    "Seismometers measure the shaking of the ground.",
    "Guitar tabs show which fret to press on which string.",
]


@pytest.fixture(scope="module")
def sentence_transformer(minilm_directory):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    return sentence_transformers.SentenceTransformer(str(minilm_directory), device="cpu")


@pytest.fixture(scope="module")
def long_text(sentence_transformer) -> str:
    """A text of well over 256 tokens: sentence-transformers cuts it at its max_seq_length."""
    return " ".join(f"word{index} is followed by another word" for index in range(80))


def encode(encoder, texts: list[str], max_tokens: int) -> torch.Tensor:
    """The encoder's vectors, every text packed in one forward; a text longer than max_tokens
    keeps its first tokens and its closing [SEP] (as sentence-transformers truncates)."""
    inputs = []
    for text in texts:
        ids = encoder.tokenizer.encode(text, add_special_tokens=True)
        inputs.append(ids if len(ids) <= max_tokens else ids[:max_tokens - 1] + ids[-1:])
    batch = EncoderBatch.pack(inputs)
    with torch.inference_mode():
        return encoder.head(encoder.model.forward(batch), batch)


@pytest.fixture(scope="module", params=["directory", "f32", "q8_0"])
def source(request, minilm_directory, minilm_gguf):
    from tokios.model_files import minilm_gguf_path

    path = {"directory": minilm_directory, "f32": minilm_gguf, "q8_0": minilm_gguf_path("q8_0")}[request.param]
    return request.param, load_encoder(str(path))


MIN_COSINE = {"directory": 0.9999, "f32": 0.9999, "q8_0": 0.999}


def test_vectors_equal_sentence_transformers(source, sentence_transformer, long_text):
    name, encoder = source
    texts = TEXTS + [long_text]
    expected = sentence_transformer.encode(texts, convert_to_tensor=True)
    vectors = encode(encoder, texts, sentence_transformer.max_seq_length)
    assert vectors.shape == expected.shape == (len(texts), 384)
    cosines = torch.nn.functional.cosine_similarity(vectors, expected)
    assert cosines.min() >= MIN_COSINE[name], list(zip(texts, cosines.tolist()))
    assert torch.allclose(vectors.norm(dim=-1), torch.ones(len(texts)), atol=1e-5)


def test_the_declared_limits(source, long_text):
    """The directory declares max_seq_length 256 (the GGUF does not carry it: its position table's
    512 is the limit there); the long text is over both."""
    name, encoder = source
    assert encoder.max_input_tokens == (256 if name == "directory" else 512)
    assert len(encoder.tokenizer.encode(long_text)) > 512


def test_retrieval_order_equals_sentence_transformers(source, sentence_transformer):
    name, encoder = source
    expected = sentence_transformer.encode(QUERIES + DOCUMENTS, convert_to_tensor=True)
    vectors = encode(encoder, QUERIES + DOCUMENTS, 256)
    for which, (ours, theirs) in enumerate(zip(vectors[:len(QUERIES)], expected[:len(QUERIES)])):
        our_order = (vectors[len(QUERIES):] @ ours).argsort(descending=True).tolist()
        their_order = (expected[len(QUERIES):] @ theirs).argsort(descending=True).tolist()
        # Each query's three relevant documents come first, in sentence-transformers' order.
        assert our_order[:3] == their_order[:3], (QUERIES[which], our_order, their_order)
        assert sorted(our_order[:3]) == [which, which + 3, which + 8], (QUERIES[which], our_order)


def test_the_engine_packs_concurrent_requests_to_the_same_vectors(minilm_gguf):
    """Two requests at once through EncoderEngine (their inputs share forwards) give each text
    the vector it gets alone."""
    from tokios.config import EngineConfig
    from tokios.encoder.engine import EncoderEngine

    engine = EncoderEngine(EngineConfig.from_options(model=str(minilm_gguf)))
    tokenizer = engine.tokenizer
    first = [tokenizer.encode(text) for text in TEXTS[:6]]
    second = [tokenizer.encode(text) for text in DOCUMENTS]

    async def both():
        return await asyncio.gather(engine.encode(first), engine.encode(second))

    async def alone(inputs):
        return torch.cat([await engine.encode([ids]) for ids in inputs])

    try:
        together = asyncio.run(both())
        assert torch.allclose(together[0], asyncio.run(alone(first)), atol=1e-5)
        assert torch.allclose(together[1], asyncio.run(alone(second)), atol=1e-5)
    finally:
        asyncio.run(engine.shutdown())


def test_cancelled_requests_leave_nothing_queued_and_an_unloaded_engine_refuses_work(minilm_gguf):
    """A caller that gives up (its task cancelled: a client gone) takes its queued inputs with it;
    shutdown fails what is still queued, and the engine does not start again afterwards."""
    from tokios.config import EngineConfig
    from tokios.encoder.engine import EncoderEngine
    from tokios.engine.async_engine import EngineDeadError

    engine = EncoderEngine(EngineConfig.from_options(model=str(minilm_gguf)), max_batch_tokens=64)
    ids = [engine.tokenizer.encode(text) for text in DOCUMENTS * 20]

    async def cancel_one_and_finish_another() -> torch.Tensor:
        doomed = asyncio.ensure_future(engine.encode(ids))
        await asyncio.sleep(0.05)  # some of its forwards have run, most of its inputs still wait
        doomed.cancel()
        survivor = await engine.encode(ids[:3])
        await asyncio.gather(doomed, return_exceptions=True)
        return survivor

    async def shut_down_with_work_queued() -> BaseException | None:
        pending = asyncio.ensure_future(engine.encode(ids))
        await asyncio.sleep(0.02)
        await engine.shutdown()
        results = await asyncio.gather(pending, return_exceptions=True)
        return results[0] if isinstance(results[0], BaseException) else None

    try:
        survivor = asyncio.run(cancel_one_and_finish_another())
        assert survivor.shape == (3, 384)
        assert engine.stats().num_waiting == 0 and engine.num_unfinished_requests == 0
        engine.check_invariants()
        error = asyncio.run(shut_down_with_work_queued())
        assert isinstance(error, EngineDeadError), error
        with pytest.raises(EngineDeadError):
            asyncio.run(engine.encode(ids[:1]))
    finally:
        asyncio.run(engine.shutdown())
