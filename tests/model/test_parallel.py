"""Tensor and pipeline parallel (tokios.distributed) give what one process gives.

Ranks are real processes on this machine meeting over Gloo, as a user's would. In float32 a
pipeline split changes no arithmetic and a tensor split only the order of o_proj's and down's
sums, so greedy tokens must equal the single process's. Two models: a small Llama written here
from random weights, whose 4 query and 2 KV heads split every way (TP 2 splits KV heads, TP 4
replicates them, TP 2 x PP 2 uses four ranks; all-reduces through shared memory, and once
through Gloo), and the default model, whose 9 heads and 30
layers allow PP 2 and TP 3 but not TP 2 (a clear error). The quantized default file runs PP 2
as stored (the fused decode step per stage) with the same tokens.
"""

from __future__ import annotations

import pytest
import torch

from hf_directory import write_hf_directory
from tokios.config import ModelConfig
from tokios.errors import InvalidRequestError
from tokios.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a village by the sea,"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def greedy_tokens(llm, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in llm.generate(prompts, params)]


def random_llama_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights scaled so that each layer changes the residual stream noticeably and the logits
    spread (near ties would make greedy comparisons depend on rounding)."""
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape, std):
        return torch.randn(*shape, generator=generator) * std

    hidden, inner, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    weights = {"model.embed_tokens.weight": normal(config.vocab_size, hidden, std=1.0),
               "model.norm.weight": 1 + normal(hidden, std=0.1)}
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}"
        weights.update({
            f"{prefix}.input_layernorm.weight": 1 + normal(hidden, std=0.1),
            f"{prefix}.post_attention_layernorm.weight": 1 + normal(hidden, std=0.1),
            f"{prefix}.self_attn.q_proj.weight": normal(config.num_heads * head_dim, hidden, std=hidden ** -0.5),
            f"{prefix}.self_attn.k_proj.weight": normal(config.num_kv_heads * head_dim, hidden, std=hidden ** -0.5),
            f"{prefix}.self_attn.v_proj.weight": normal(config.num_kv_heads * head_dim, hidden, std=hidden ** -0.5),
            f"{prefix}.self_attn.o_proj.weight": normal(hidden, config.num_heads * head_dim, std=hidden ** -0.5),
            f"{prefix}.mlp.gate_proj.weight": normal(inner, hidden, std=hidden ** -0.5),
            f"{prefix}.mlp.up_proj.weight": normal(inner, hidden, std=hidden ** -0.5),
            f"{prefix}.mlp.down_proj.weight": normal(hidden, inner, std=inner ** -0.5),
        })
    return weights


@pytest.fixture(scope="module")
def small_model(tmp_path_factory, engine_float32):
    tokenizer = engine_float32.tokenizer
    config = ModelConfig(architecture="llama", num_layers=4, hidden_size=128, intermediate_size=256, num_heads=4,
                         num_kv_heads=2, head_dim=32, vocab_size=engine_float32.model_config.vocab_size,
                         max_model_len=512, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
    directory = tmp_path_factory.mktemp("small-llama")
    write_hf_directory(directory, tokenizer, config, random_llama_weights(config))
    return str(directory)


@pytest.fixture(scope="module")
def small_model_tokens(small_model):
    from tokios.engine import LLM

    llm = LLM(model=small_model, dtype="float32", kv_cache_memory="8MiB", num_threads=1)
    try:
        return greedy_tokens(llm)
    finally:
        llm.close()


@pytest.mark.parametrize("tp, pp, gloo_only", [(2, 1, False), (2, 1, True), (4, 1, False), (1, 2, False),
                                                (2, 2, False)],
                         ids=["tp2-kv-split", "tp2-gloo-all-reduce", "tp4-kv-replicated", "pp2", "tp2xpp2"])
def test_small_model_parallel_greedy_equals_one_process(small_model, small_model_tokens, tp, pp, gloo_only,
                                                        monkeypatch):
    from tokios.distributed.worker import GLOO_ONLY_ENVIRONMENT_VARIABLE
    from tokios.engine import LLM

    # Ranks of one machine sum through shared memory; the Gloo path (other machines, big
    # tensors) is checked on its own.
    monkeypatch.setenv(GLOO_ONLY_ENVIRONMENT_VARIABLE, "1" if gloo_only else "0")
    llm = LLM(model=small_model, dtype="float32", kv_cache_memory="8MiB", num_threads=1,
              tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        assert greedy_tokens(llm) == small_model_tokens
        assert len(set(map(tuple, small_model_tokens))) == len(PROMPTS)  # the prompts lead somewhere different
    finally:
        llm.close()


def test_default_model_pipeline_and_tensor_parallel_in_float32(engine_float32):
    from tokios.engine import LLM

    expected = greedy_tokens(engine_float32)
    for tp, pp in [(1, 2), (3, 1)]:
        llm = LLM(dtype="float32", kv_cache_memory="32MiB", num_threads=1, tensor_parallel_size=tp,
                  pipeline_parallel_size=pp)
        try:
            assert greedy_tokens(llm) == expected, (tp, pp)
        finally:
            llm.close()


def test_default_model_stored_pipeline_parallel_and_sampling_with_copies():
    """The Q4_1 file as stored: each stage runs the fused C++ decode step over its own layers.
    n=3 seeded samples share the prompt's last partial block, so the ranks copy it on write."""
    from tokios.engine import LLM

    sampled = SamplingParams(temperature=0.8, max_tokens=12, n=3, seed=7, ignore_eos=True)
    single = LLM(kv_cache_memory="32MiB", num_threads=1)
    try:
        expected = greedy_tokens(single), [c.token_ids for c in single.generate([PROMPTS[0]], sampled)[0].outputs]
    finally:
        single.close()
    llm = LLM(kv_cache_memory="32MiB", num_threads=1, pipeline_parallel_size=2)
    copies = []
    send_copies = llm.core.model.copy_blocks
    llm.core.model.copy_blocks = lambda pairs: (copies.extend(pairs), send_copies(pairs))
    try:
        got = greedy_tokens(llm), [c.token_ids for c in llm.generate([PROMPTS[0]], sampled)[0].outputs]
        assert got == expected
        assert copies, "the n=3 request was meant to copy its shared partial block on write"
    finally:
        llm.close()


def test_default_model_stored_tensor_parallel_gives_the_single_process_logprobs():
    """The Q4_1 file as stored at TP 3: each rank's o_proj and down sum their own blocks, and the
    group adds the float64 sums before rounding once (quant_matmul.h, kSumGridBits), so every
    prompt and sampled log-probability is the single process's, bit for bit. Rounding each
    rank's share to float32 first moved the 8-bit activations of the layers after it: the
    first token's log-probability was -0.289 against -0.318, and the greedy text differed."""
    from tokios.engine import LLM

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5, prompt_logprobs=5)

    def tokens_and_logprobs(tensor_parallel_size: int) -> list:
        llm = LLM(kv_cache_memory="32MiB", num_threads=1, tensor_parallel_size=tensor_parallel_size)
        try:
            outputs = llm.generate(PROMPTS, params)
        finally:
            llm.close()

        def values(steps):
            return [None if step is None else {token_id: entry.logprob for token_id, entry in step.items()}
                    for step in steps]

        return [(output.outputs[0].token_ids, values(output.prompt_logprobs), values(output.outputs[0].logprobs))
                for output in outputs]

    assert tokens_and_logprobs(3) == tokens_and_logprobs(1)


def test_sizes_that_do_not_split_the_model_are_refused_before_any_rank_starts():
    from tokios.engine import LLM

    with pytest.raises(InvalidRequestError, match="tensor_parallel_size 2 does not divide .*9 attention heads"):
        LLM(dtype="float32", kv_cache_memory="32MiB", tensor_parallel_size=2)
    with pytest.raises(InvalidRequestError, match="pipeline_parallel_size 31 is more than the model's 30 layers"):
        LLM(dtype="float32", kv_cache_memory="32MiB", pipeline_parallel_size=31)
    with pytest.raises(InvalidRequestError, match="kv_cache_disk"):
        LLM(kv_cache_memory="32MiB", pipeline_parallel_size=2, kv_cache_disk="/tmp/never-made")


def test_speculative_self_draft_runs_the_first_layers_across_stages():
    """The self-draft asks for the model's first 20 layers: stage 0 runs its 15, stage 1 five of
    its own, and the verified tokens are plain greedy decoding's."""
    from tokios.engine import LLM
    from tokios.config import SpeculativeConfig

    single = LLM(kv_cache_memory="32MiB", num_threads=1)
    try:
        expected = greedy_tokens(single)
    finally:
        single.close()
    llm = LLM(kv_cache_memory="32MiB", num_threads=1, pipeline_parallel_size=2,
              speculative_config=SpeculativeConfig(method="self_draft", self_draft_num_layers=20))
    try:
        assert greedy_tokens(llm) == expected
        assert llm.stats().spec_num_draft_tokens > 0 and llm.stats().spec_num_accepted_tokens > 0
    finally:
        llm.close()


def test_gemma3_tensor_and_pipeline_parallel():
    """Gemma 3: sliding-window KV groups (each layer reads its group's metadata by its model layer
    number, and its own RoPE table), per-head norms, and 1 KV head, which TP 2 replicates. In
    float32 at TP 2, transformers' greedy tokens (the golden file, which the single process
    matches in test_gemma3.py); as stored at PP 2 (each stage's fused step over its own layers and
    KV groups) and at TP 2 (its Q4_K o_proj and Q4_K / Q6_K down summed exactly over the ranks),
    the single process's greedy tokens."""
    from golden import load_golden
    from tokios.engine import LLM
    from tokios.model_files import gemma3_model_path

    path = str(gemma3_model_path())
    golden = load_golden("gemma3", gemma3_model_path())["sequences"]
    prompts = [golden[str(index)]["prompt_ids"] for index in range(3)]
    expected_float32 = [golden[str(index)]["greedy_ids"][:GREEDY.max_tokens] for index in range(3)]
    llm = LLM(model=path, dtype="float32", kv_cache_memory="32MiB", num_threads=1, tensor_parallel_size=2)
    try:
        assert greedy_tokens(llm, prompts) == expected_float32
    finally:
        llm.close()
    single = LLM(model=path, kv_cache_memory="32MiB", num_threads=1)
    try:
        expected = greedy_tokens(single)
    finally:
        single.close()
    for tp, pp in [(1, 2), (2, 1)]:
        llm = LLM(model=path, kv_cache_memory="32MiB", num_threads=1, tensor_parallel_size=tp,
                  pipeline_parallel_size=pp)
        try:
            assert greedy_tokens(llm) == expected, (tp, pp)
        finally:
            llm.close()


def test_a_rank_that_dies_between_steps_fails_the_next_step_at_once():
    import os
    import signal
    import time

    from tokios.distributed.executor import RankFailedError
    from tokios.engine import LLM

    llm = LLM(kv_cache_memory="32MiB", num_threads=1, pipeline_parallel_size=2)
    try:
        greedy_tokens(llm, PROMPTS[:1])
        first_stage = llm.core.model.processes[0]
        os.kill(first_stage.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(RankFailedError, match="rank 0 .* exited with status -9"):
            greedy_tokens(llm, PROMPTS[:1])
        assert time.monotonic() - started < 10
        assert all(process.exitcode is not None for process in llm.core.model.processes.values())
    finally:
        llm.close()


def test_mixture_of_experts_pipeline_parallel(tmp_path_factory):
    """The tiny Qwen3-MoE requantized as Q4_K_M, as stored, in two stages: each stage's fused step
    runs its own layers' packed experts, and the tokens are the single process's. (Tensor
    parallel over experts is refused by name: test_moe_families.py.)"""
    from converted import quantized_model
    from test_families import FAMILIES
    from tokios.engine import LLM

    path = str(quantized_model(FAMILIES["qwen3moe"], tmp_path_factory))
    single = LLM(model=path, kv_cache_memory="32MiB", num_threads=1)
    try:
        prompts = [single.tokenizer.encode(text) for text in ("The lighthouse keeper", "Zürich, naïve café")]
        expected = greedy_tokens(single, prompts)
    finally:
        single.close()
    llm = LLM(model=path, kv_cache_memory="32MiB", num_threads=1, pipeline_parallel_size=2)
    try:
        assert greedy_tokens(llm, prompts) == expected
    finally:
        llm.close()
