"""A causal embedding model (Qwen3-Embedding's kind) on the generative engine: a tiny seeded random
Qwen3 laid out as Qwen3-Embedding ships (config.json naming Qwen3ForCausalLM over the base
model's unprefixed weights; sentence-transformers' Transformer, last-token Pooling and Normalize
modules; a query prompt; a tokenizer.json whose post-processor appends <|endoftext|> to every
text), and the GGUF llama.cpp's converter makes of it (`qwen3.pooling_type` = last, the
appended token as EOS with add_eos_token; the prompts are not carried).

The engine's last-token pooling requests (what server/embeddings.py sends for such a model),
L2-normalised, equal sentence-transformers' encode on the directory, with and without the query
prompt (both put the prompt's text before the input's and tokenize the whole); and so do the
server's /v1/embeddings vectors, its prompt_name read from the directory's declaration.

Tolerance: cosine >= COSINE_MIN; the lowest measured was 1 - 1.2e-7 (float32); a vector pooled at
the wrong token (the one before the appended <|endoftext|>) scored at most 0.39.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from converted import convert_to_gguf, converted_model, vocab_tokenizer
from test_families import FAMILIES, qwen3_config
from tokios.encoder.loader import EMBEDDING, GENERATE, decoder_declaration, model_kind
from tokios.sampling_params import SamplingParams

COSINE_MIN = 0.9999
QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
TEXTS = ["What is the capital of China?", "The capital of China is Beijing.",
         "Gravity is a force that attracts two bodies towards each other.", "Kraków, Zürich, naïve café — 1234567890",
         "灯台は岬の上に立っていた。"]
# Qwen3-Embedding's tokenizer.json post-processor: byte-level offsets, then <|endoftext|> after
# each text (and after a pair).
APPEND_ENDOFTEXT = {"type": "Sequence", "processors": [
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
    {"type": "TemplateProcessing",
     "single": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}],
     "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 0}},
              {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}],
     "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [], "tokens": ["<|endoftext|>"]}}}]}


def _write_json(path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False))


@pytest.fixture(scope="module")
def qwen3_embedding(tmp_path_factory):
    """(sentence-transformers directory, its GGUF)."""
    transformers = pytest.importorskip("transformers")
    tokenizer = vocab_tokenizer("qwen2")
    config = qwen3_config(len(tokenizer))
    torch.manual_seed(0)
    model = transformers.Qwen3Model(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
    directory = tmp_path_factory.mktemp("tiny-qwen3-embedding") / "hf"
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    hf_config = json.loads((directory / "config.json").read_text())
    _write_json(directory / "config.json", {**hf_config, "architectures": ["Qwen3ForCausalLM"]})
    endoftext_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    tokenizer_json = json.loads((directory / "tokenizer.json").read_text())
    post_processor = json.loads(json.dumps(APPEND_ENDOFTEXT))
    post_processor["processors"][1]["special_tokens"]["<|endoftext|>"]["ids"] = [endoftext_id]
    _write_json(directory / "tokenizer.json", {**tokenizer_json, "post_processor": post_processor})
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    for key in ("add_bos_token", "add_eos_token", "bos_token"):
        tokenizer_config.pop(key, None)
    _write_json(directory / "tokenizer_config.json",
                {**tokenizer_config, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
    _write_json(directory / "modules.json", [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}])
    _write_json(directory / "1_Pooling" / "config.json", {
        "word_embedding_dimension": config.hidden_size, "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": True, "include_prompt": True})
    (directory / "2_Normalize").mkdir()
    _write_json(directory / "config_sentence_transformers.json", {
        "prompts": {"query": QUERY_PROMPT, "document": ""}, "default_prompt_name": None,
        "similarity_fn_name": "cosine"})
    _write_json(directory / "sentence_bert_config.json", {"max_seq_length": 512, "do_lower_case": False})
    return directory, convert_to_gguf(directory, directory.parent / "qwen3-embedding.f32.gguf")


def test_the_files_declare_an_embedding_model(qwen3_embedding, tmp_path_factory):
    from tokios.gguf_file import read_gguf_metadata

    directory, gguf = qwen3_embedding
    assert read_gguf_metadata(str(gguf))["qwen3.pooling_type"] == 3
    assert model_kind(str(directory)) == model_kind(str(gguf)) == EMBEDDING
    plain = converted_model(FAMILIES["qwen3"], tmp_path_factory)  # the chat-model families' tiny Qwen3
    assert model_kind(str(plain.gguf_path)) == model_kind(str(plain.hf_directory)) == GENERATE
    declared = decoder_declaration(str(directory))
    assert (declared.pooling, declared.normalize, declared.max_seq_length) == ("last", True, 512)
    assert declared.prompts == {"query": QUERY_PROMPT, "document": ""}


@pytest.fixture(scope="module")
def sentence_transformer(qwen3_embedding):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(qwen3_embedding[0]), device="cpu")


@pytest.mark.parametrize("source", ["hf_directory", "gguf"])
def test_last_token_vectors_equal_sentence_transformers_with_and_without_the_prompt(source, qwen3_embedding,
                                                                                    sentence_transformer):
    from tokios.engine import LLM

    directory, gguf = qwen3_embedding
    path = str(directory if source == "hf_directory" else gguf)
    declared = decoder_declaration(path)
    llm = LLM(model=path, dtype="float32", kv_cache_memory="64MiB")
    try:
        for prompt_name in (None, "query"):
            # The directory declares its prompts; the GGUF does not carry them, so its client
            # writes the instruction before the text itself.
            prompt = QUERY_PROMPT if prompt_name else ""
            if source == "hf_directory" and prompt_name:
                assert declared.prompts[prompt_name] == prompt
            ids = [llm.tokenizer.encode(prompt + text, add_special_tokens=True) for text in TEXTS]
            expected_ids = sentence_transformer.tokenize([prompt + text for text in TEXTS])["input_ids"]
            mask = sentence_transformer.tokenize([prompt + text for text in TEXTS])["attention_mask"]
            assert ids == [row[row_mask == 1].tolist() for row, row_mask in zip(expected_ids, mask)]
            assert all(each[-1] == llm.tokenizer.backend.token_to_id("<|endoftext|>") for each in ids)
            outputs = llm.generate(ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                                       pooling=declared.pooling))
            ours = torch.nn.functional.normalize(torch.tensor([output.embedding for output in outputs]), dim=-1)
            expected = sentence_transformer.encode(TEXTS, prompt_name=prompt_name, convert_to_tensor=True)
            cosines = (ours * expected.float()).sum(dim=-1)
            assert cosines.min() >= COSINE_MIN, (prompt_name, cosines.tolist())
    finally:
        llm.close()


def test_the_server_embeds_with_the_declared_prompt_on_the_generative_engine(qwen3_embedding, sentence_transformer):
    """/v1/embeddings on the directory (server/embeddings.py: the declared prompt before each
    text, last-token pooling requests, normalisation) against sentence-transformers."""
    from starlette.testclient import TestClient

    from tokios.config import EngineConfig
    from tokios.engine.async_engine import AsyncEngine
    from tokios.server.app import create_app
    from tokios.server.registry import ModelRegistry, ModelSpec
    from tokios.server.serving import ServerSettings

    path = str(qwen3_embedding[0])
    spec = ModelSpec(names=["embedder"], path=path, kind=model_kind(path), load=lambda: AsyncEngine(
        EngineConfig.from_options(model=path, dtype="float32", kv_cache_memory="64MiB")))
    with TestClient(create_app(ServerSettings(), registry=ModelRegistry([spec]))) as client:
        while client.get("/health").json()["status"] == "loading":
            time.sleep(0.05)
        for prompt_name in (None, "query"):
            body = {"model": "embedder", "input": TEXTS, **({"prompt_name": prompt_name} if prompt_name else {})}
            response = client.post("/v1/embeddings", json=body)
            assert response.status_code == 200, response.text
            ours = torch.tensor([item["embedding"] for item in response.json()["data"]])
            expected = sentence_transformer.encode(TEXTS, prompt_name=prompt_name, convert_to_tensor=True).float()
            cosines = (ours * expected).sum(dim=-1)
            assert cosines.min() >= COSINE_MIN, (prompt_name, cosines.tolist())
            assert torch.allclose(ours.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5)
