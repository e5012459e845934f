"""Every block type a downloaded GGUF holds runs as stored (`--dtype auto`), on whole models.

Each block type's product is checked against its dequantized weights in tests/unit/test_kernels.py;
here each kernel path runs once in a whole model. Test files are written with our own quantizers
(model/blocks), never with llama.cpp: the default model in a Q4_K_M-like mix (Q5_0 166, Q4_K 16,
Q8_0 15, Q6_K 14 tensors, as llama.cpp's own file), and a random-weight model whose rows are
multiples of 256, so that its products run real K-quants (Q4_K, Q5_K, Q6_K), which the default
model's 576-wide rows allow only in ffn_down, and the legacy types the mix lacks (Q4_0, Q5_1).
The default model itself (Q4_1 layers, a Q8_0 head) and `--dtype int8`/`int4` are the perplexity
gate's (test_perplexity.py). Between them every block type the kernels run is in a whole model.

For each file: the engine runs exactly the file's types (counted per type), its results are
those of the float32 engine on the same file (which dequantizes every block and is held to
transformers by test_parity.py and test_perplexity.py): the mix's perplexity on the ~1,000-token
text within 1%, the random model's logits within 2% (8-bit activations); and greedy tokens are
identical one by one and batched (the kernels are batch invariant, so equality is exact).
Chunked and prefix-cached runs lay a prompt out differently (decode rows or an SDPA span:
docs/architecture.md), so there they are held to test_engine_invariance's near-tie rule.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter

from reference import default_gguf, engine_perplexity, engine_prompt_logits, prompt_token_ids
from test_engine_invariance import PROMPTS, assert_parts_only_at_near_ties
from tokios.gguf_file import GGUFFile
from tokios.model.blocks.requantize import copy_metadata, mostly_q4_k_m, requantize_gguf
from tokios.sampling_params import SamplingParams

TEXT_PATH = Path(__file__).parent.parent / "data" / "perplexity_text.txt"
MAX_RELATIVE_GAP = 0.01

DEFAULT_MODEL_FILES = {
    "Q4_K_M": (mostly_q4_k_m, {T.Q5_0: 166, T.Q4_K: 16, T.Q8_0: 15, T.Q6_K: 14}),
}


@pytest.fixture(scope="session")
def block_file_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("block-formats")


def default_model_file(directory: Path, name: str) -> Path:
    path = directory / f"smollm2-{name}.gguf"
    if not path.exists():
        choose, expected = DEFAULT_MODEL_FILES[name]
        written = requantize_gguf(str(default_gguf()), str(path), choose)
        counts = Counter(t for t in written.values() if t != T.F32)
        assert counts == expected, counts
    return path


def random_k_quant_model(directory: Path) -> Path:
    """A 2-layer Llama with hidden 256, intermediate 768, 4 query and 2 KV heads of 64, the
    default model's tokenizer, random weights written in a mix of every K-quant and Q8_0, with
    the second layer's query in Q4_0 and its up projection in Q5_1."""
    path = directory / "random-k-quants.gguf"
    if path.exists():
        return path
    from tokios.model.blocks import quantize

    source = GGUFFile(default_gguf())
    writer = GGUFWriter(str(path), "llama")
    copy_metadata(source, writer, skip_prefixes=("llama.",))  # the tokenizer; new hyper-parameters below
    hidden, intermediate, heads, kv_heads, head_dim, layers = 256, 768, 4, 2, 64, 2
    writer.add_block_count(layers)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_context_length(2048)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    vocab = len(source.metadata["tokenizer.ggml.tokens"])
    rng = np.random.default_rng(0)

    def add(name, shape, ggml_type, scale):
        weight = (rng.standard_normal(shape) * scale).astype(np.float32)
        writer.add_tensor(name, quantize(weight, ggml_type).reshape(shape[0], -1), raw_dtype=ggml_type)

    add("token_embd.weight", (vocab, hidden), T.Q6_K, 1.0)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for layer in range(layers):
        prefix = f"blk.{layer}."
        writer.add_tensor(prefix + "attn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(prefix + "ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        add(prefix + "attn_q.weight", (heads * head_dim, hidden), T.Q4_0 if layer else T.Q4_K, 0.06)
        add(prefix + "attn_k.weight", (kv_heads * head_dim, hidden), T.Q5_K, 0.06)
        add(prefix + "attn_v.weight", (kv_heads * head_dim, hidden), T.Q6_K, 0.1)
        add(prefix + "attn_output.weight", (hidden, heads * head_dim), T.Q4_K, 0.05)
        add(prefix + "ffn_gate.weight", (intermediate, hidden), T.Q5_K, 0.06)
        add(prefix + "ffn_up.weight", (intermediate, hidden), T.Q5_1 if layer else T.Q4_K, 0.06)
        add(prefix + "ffn_down.weight", (hidden, intermediate), T.Q8_0 if layer else T.Q6_K, 0.05)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def engine(path: Path, **options):
    from tokios.engine import LLM

    return LLM(model=str(path), kv_cache_memory="64MiB", **options)


def runs_as_stored(llm, path: Path) -> None:
    """The engine's linear layers hold exactly the file's block types."""
    expected = Counter(tensor.ggml_type for tensor in GGUFFile(path).tensors.values() if len(tensor.shape) == 2)
    model = llm.core.model
    ran = Counter(t for linear in [model.lm_head] + model.layer_linears() for t in linear.tensor_types)
    if model.config.tie_word_embeddings:
        assert ran == expected
    assert llm.core.weight_format == "stored" and model.can_fuse_decode


PERPLEXITY_FILES = ("Q4_K_M",)


@pytest.mark.parametrize("name", PERPLEXITY_FILES)
def test_default_model_file_runs_as_stored_within_one_percent_of_float32(name, block_file_dir):
    path = default_model_file(block_file_dir, name)
    llm = engine(path)
    runs_as_stored(llm, path)
    token_ids = llm.tokenizer.encode(TEXT_PATH.read_text(encoding="utf-8"))
    ours = engine_perplexity(llm, token_ids)
    llm.check_invariants()
    del llm
    reference = engine_perplexity(engine(path, dtype="float32"), token_ids)
    gap = abs(ours - reference) / reference
    print(f"\nperplexity {name}: engine {ours:.4f}, float32 {reference:.4f}, gap {gap:.3%}")
    assert 1.5 < reference < 100 and gap <= MAX_RELATIVE_GAP


def greedy_everywhere_equal(path: Path, prompts) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    plain = engine(path, enable_prefix_caching=False)
    token_ids = [prompt_token_ids(plain.tokenizer, p) for p in prompts]
    alone = [plain.generate([t], params)[0].outputs[0] for t in token_ids]
    together = [o.outputs[0] for o in plain.generate(token_ids, params)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    chunked = engine(path, max_num_batched_tokens=32)
    assert_parts_only_at_near_ties([o.outputs[0] for o in chunked.generate(token_ids, params)], alone, path.name)
    hits = chunked.stats().prefix_cache_hits
    assert_parts_only_at_near_ties([o.outputs[0] for o in chunked.generate(token_ids, params)], alone, path.name)
    assert chunked.stats().prefix_cache_hits > hits
    for llm in (plain, chunked):
        llm.check_invariants()
        assert llm.stats().num_blocks_used == 0


@pytest.mark.parametrize("name", ["Q4_K_M"])
def test_default_model_file_greedy_is_the_same_alone_batched_chunked_and_cached(name, block_file_dir):
    greedy_everywhere_equal(default_model_file(block_file_dir, name), PROMPTS[:8])


def test_random_k_quant_model_matches_float32_and_is_batch_invariant(block_file_dir):
    path = random_k_quant_model(block_file_dir)
    llm = engine(path)
    runs_as_stored(llm, path)
    kinds = {t for linear in llm.core.model.layer_linears() for t in linear.ggml_types}
    assert kinds == {T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.Q4_0, T.Q5_1}
    token_ids = llm.tokenizer.encode(TEXT_PATH.read_text(encoding="utf-8"))[:96]
    ours = engine_prompt_logits(llm, token_ids).double()
    theirs = engine_prompt_logits(engine(path, dtype="float32"), token_ids).double()
    centred = theirs - theirs.mean(dim=-1, keepdim=True)
    relative = ((ours - theirs) - (ours - theirs).mean(dim=-1, keepdim=True)).norm() / centred.norm()
    print(f"\nrandom K-quant model: logits relative error {relative:.2e}, logit spread {centred.std():.2f}")
    assert centred.std() > 1.0  # the random model's logits are far from flat, so the check has teeth
    assert relative < 0.02  # 8-bit activations against float32
    greedy_everywhere_equal(path, PROMPTS[:4] + PROMPTS[12:13])
