"""The encoder architectures without shipped weights, nomic-bert and EmbeddingGemma, against
sentence-transformers on the same tiny seeded random weights: each tiny model is made with
transformers' own class (NomicBertModel; Gemma3TextModel with use_bidirectional_attention),
wrapped in sentence-transformers' own modules (mean Pooling; for EmbeddingGemma its two bias-free
Dense projections; Normalize) and saved by sentence-transformers as users get such a directory,
then converted to GGUF by llama.cpp's own convert_hf_to_gguf.py (for EmbeddingGemma with
--sentence-transformers-dense-modules, which carries the Dense layers into the file).

The engine's vectors, from the directory and from the F32 GGUF, equal sentence-transformers' on
the same token ids (given directly, so that these tests do not depend on the tokenizers), for
several inputs of different lengths packed into one batch, each also alone; EmbeddingGemma's
longest input crosses its sliding window in both directions. Then from text through each file's
own tokenizer, with the query prompt the directory declares, against sentence-transformers'
encode(prompt_name="query").

Tolerance: float32 both sides, different summation orders. Largest measured difference, packed
or alone, directory or GGUF: nomic-bert cosine 1 - 6e-8 (max abs 2.2e-7 on unit vectors),
EmbeddingGemma cosine 1.0 (max abs 2.7e-7); COSINE_MIN is the issue's bound, MAX_ABS_DIFF about
ten times the worst measured. Each of these breaks them: the sliding window one position wider
or narrower, Gemma's norms without their 1 + w, the sliding layers on the global RoPE base,
nomic's gate and up swapped, nomic's RoPE base not read from the GGUF.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from converted import convert_to_gguf, vocab_tokenizer

COSINE_MIN = 0.9999
MAX_ABS_DIFF = 3e-6
GEMMA_WINDOW = 16  # the file's sliding_window: a sliding layer sees 8 positions on either side
LENGTHS = (7, 40, 1, 19)  # packed together; 40 > GEMMA_WINDOW
NOMIC_ROPE_THETA = 2000.0  # not nomic's 1000, so that a base not read from the file shows
PROMPTS = {"query": "task: search result | query: ", "document": "title: none | text: "}


@dataclass
class TinyEncoder:
    hf_directory: Path
    gguf_path: Path
    reference: object  # the sentence-transformers model read back from hf_directory
    vocab_size: int


def _transformers():
    return pytest.importorskip("transformers")


def nomic_model(minilm_directory: Path):
    """nomic-embed's shape in small, with BERT's uncased WordPiece vocabulary (all-MiniLM-L6-v2's)."""
    transformers = _transformers()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(minilm_directory))
    config = transformers.NomicBertConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=2048, rope_parameters={"rope_type": "default", "rope_theta": NOMIC_ROPE_THETA},
        initializer_range=0.2)
    return transformers.NomicBertModel(config), tokenizer, (0.5, 1.5)


# What nomic-embed-text's own config.json says beside transformers' keys (llama.cpp's converter
# reads these): its trained length, SwiGLU, post-norm, full non-interleaved rotary, no biases.
def nomic_config_keys(config: dict) -> dict:
    return {"n_embd": config["hidden_size"], "n_layer": config["num_hidden_layers"],
            "n_head": config["num_attention_heads"], "n_inner": config["intermediate_size"], "n_positions": 8192,
            "max_trained_positions": 2048, "activation_function": "swiglu", "causal": False, "prenorm": False,
            "qkv_proj_bias": False, "mlp_fc1_bias": False, "mlp_fc2_bias": False, "rotary_emb_base": NOMIC_ROPE_THETA,
            "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False, "rotary_emb_scale_base": None,
            "rotary_scaling_factor": None, "layer_norm_epsilon": config["layer_norm_eps"]}


def gemma_model(_):
    transformers = _transformers()
    tokenizer = vocab_tokenizer("qwen2")
    # Six layers so that llama.cpp's fixed 5:1 sliding/global pattern has its global layer;
    # query_pre_attn_scalar = head_dim, as llama.cpp assumes.
    config = transformers.Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=GEMMA_WINDOW,
        query_pre_attn_scalar=16, use_bidirectional_attention=True,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    return transformers.Gemma3TextModel(config), tokenizer, (-0.5, 0.5)  # Gemma's norms multiply by 1 + w


def build_tiny(name: str, make_model, tmp_path_factory, minilm_directory: Path) -> TinyEncoder:
    """The seeded random model, with sentence-transformers' modules, saved and converted."""
    st = pytest.importorskip("sentence_transformers")
    from sentence_transformers.sentence_transformer import modules

    directory = tmp_path_factory.mktemp(f"tiny-{name}") / "hf"
    directory.mkdir()
    torch.manual_seed(0)
    model, tokenizer, norm_range = make_model(minilm_directory)
    model = model.float().eval()
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            # transformers makes norm weights constant and biases zeros: drawn, so that a
            # misplaced one (Gemma's 1 + w) shows.
            if parameter_name.endswith(("norm.weight", "LayerNorm.weight")):
                parameter.uniform_(*norm_range)
            elif parameter_name.endswith(".bias"):
                parameter.normal_(0.0, 0.2)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    # The borrowed qwen2 vocabulary's chat template would make sentence-transformers wrap each
    # text as a chat message; an embedding model's tokenizer has none.
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    hidden = model.config.hidden_size
    stack = [modules.Transformer(str(directory)), modules.Pooling(hidden, pooling_mode="mean")]
    if name == "gemma-embedding":
        stack += [modules.Dense(hidden, 2 * hidden, bias=False, activation_function=torch.nn.Identity()),
                  modules.Dense(2 * hidden, hidden, bias=False, activation_function=torch.nn.Identity())]
    stack.append(modules.Normalize())
    st.SentenceTransformer(modules=stack, prompts=PROMPTS, device="cpu").save(str(directory))
    if name == "nomic-bert":
        config_path = directory / "config.json"
        config = json.loads(config_path.read_text())
        config_path.write_text(json.dumps({**config, **nomic_config_keys(config)}, indent=2))
    options = ("--sentence-transformers-dense-modules",) if name == "gemma-embedding" else ()
    gguf_path = convert_to_gguf(directory, directory.parent / f"{name}.f32.gguf", options=options)
    reference = st.SentenceTransformer(str(directory), device="cpu")
    return TinyEncoder(directory, gguf_path, reference, len(tokenizer))


@pytest.fixture(scope="module", params=["nomic-bert", "gemma-embedding"])
def tiny(request, tmp_path_factory, minilm_directory):
    makers = {"nomic-bert": nomic_model, "gemma-embedding": gemma_model}
    return request.param, build_tiny(request.param, makers[request.param], tmp_path_factory, minilm_directory)


@pytest.fixture(scope="module")
def token_ids(tiny):
    _, model = tiny
    generator = torch.Generator().manual_seed(1)
    # Ids past the special tokens, which neither model treats differently here.
    return [torch.randint(1000, model.vocab_size, (length,), generator=generator).tolist() for length in LENGTHS]


def reference_vectors(model: TinyEncoder, inputs: list[list[int]]) -> torch.Tensor:
    """sentence-transformers' embeddings of each input alone (no padding involved)."""
    vectors = []
    with torch.no_grad():
        for ids in inputs:
            features = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
            vectors.append(model.reference(features)["sentence_embedding"][0])
    return torch.stack(vectors)


def engine_vectors(encoder, inputs: list[list[int]]) -> torch.Tensor:
    from tokios.encoder.batch import EncoderBatch

    batch = EncoderBatch.pack(inputs)
    with torch.no_grad():
        return encoder.head(encoder.model.forward(batch), batch)


@pytest.fixture(scope="module")
def encoders(tiny):
    from tokios.encoder.loader import load_encoder

    _, model = tiny
    return {source: load_encoder(str(path)) for source, path in
            (("hf_directory", model.hf_directory), ("gguf", model.gguf_path))}


@pytest.mark.parametrize("source", ["hf_directory", "gguf"])
def test_vectors_equal_sentence_transformers_packed_and_alone(tiny, encoders, token_ids, source):
    name, model = tiny
    expected = reference_vectors(model, token_ids)
    # The inputs differ: equal vectors everywhere would make the comparison empty.
    assert torch.nn.functional.cosine_similarity(expected[0], expected[1], dim=0) < 0.99
    packed = engine_vectors(encoders[source], token_ids)
    alone = torch.cat([engine_vectors(encoders[source], [ids]) for ids in token_ids])
    for ours in (packed, alone):
        cosine = torch.nn.functional.cosine_similarity(ours, expected, dim=-1)
        difference = (ours - expected).abs().max().item()
        assert cosine.min().item() >= COSINE_MIN, f"{name} {source}: cosines {cosine.tolist()}"
        assert difference <= MAX_ABS_DIFF, f"{name} {source}: max abs difference {difference:.3g}"


def test_the_files_declare_mean_pooling_normalisation_and_dense(tiny, encoders):
    from tokios.encoder.declared import MEAN

    name, model = tiny
    for source, encoder in encoders.items():
        declaration = encoder.declaration
        assert (declaration.pooling, declaration.normalize) == (MEAN, True), source
        expected_dense = [(64, 128), (128, 64)] if name == "gemma-embedding" else []
        assert [(dense.in_features, dense.out_features) for dense in declaration.dense] == expected_dense, source
        assert encoder.dimensions == 64
    # Prompts live in the directory's config_sentence_transformers.json only.
    assert dict(encoders["hf_directory"].declaration.prompts) == PROMPTS


def test_a_causal_gemma3_text_model_is_refused_by_name(tmp_path):
    from tokios.encoder.loader import load_encoder
    from tokios.errors import UnsupportedError

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Gemma3TextModel"],
                                                      "use_bidirectional_attention": False}))
    with pytest.raises(UnsupportedError, match="use_bidirectional_attention"):
        load_encoder(str(tmp_path))


def test_text_with_the_declared_query_prompt_equals_sentence_transformers_encode(tiny, encoders):
    """Through each file's own tokenizer: the directory's prompt before the text, as
    sentence-transformers' encode(prompt_name="query") puts it."""
    name, model = tiny
    texts = ["What is the capital of France?", "Kraków, Zürich, naïve café — 1234567890"]
    expected = torch.from_numpy(model.reference.encode(texts, prompt_name="query"))
    for source, encoder in encoders.items():
        prompt = encoders["hf_directory"].declaration.prompts["query"]
        ids = [encoder.tokenizer.encode(prompt + text) for text in texts]
        cosine = torch.nn.functional.cosine_similarity(engine_vectors(encoder, ids), expected, dim=-1)
        assert cosine.min().item() >= COSINE_MIN, f"{name} {source}: cosines {cosine.tolist()}"


def test_the_encoder_engine_serves_the_gguf(tiny, token_ids):
    """The server's path: EncoderEngine loads the file by path and encodes the inputs."""
    import asyncio

    from tokios.config import EngineConfig, LoadConfig
    from tokios.encoder.engine import EncoderEngine

    name, model = tiny
    engine = EncoderEngine(EngineConfig(load=LoadConfig(model=str(model.gguf_path))))

    async def encode() -> torch.Tensor:
        try:
            return await engine.encode(token_ids)
        finally:
            await engine.shutdown()

    assert engine.vocab_size == model.vocab_size
    cosine = torch.nn.functional.cosine_similarity(asyncio.run(encode()), reference_vectors(model, token_ids), dim=-1)
    assert cosine.min().item() >= COSINE_MIN, f"{name}: cosines {cosine.tolist()}"
