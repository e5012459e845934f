"""EngineCore: model + KV cache + scheduler + runner, stepped by LLM or AsyncEngine.

Works on token ids only. add_requests() validates a request against the context and the KV
cache before it is queued (so an impossible request fails at once and never deadlocks the
queue); step() schedules, runs the model once, folds the sampled tokens back and reports
EngineOutputs. Not thread-safe: one thread steps it (AsyncEngine funnels other threads'
commands into its step loop).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from tokios import load_progress
from tokios.config import AUTO_DTYPE_BY_DEVICE, EngineConfig
from tokios.engine.output_processor import EngineOutput, sequence_ids
from tokios.errors import ContextLengthExceededError, InvalidRequestError
from tokios.kv_cache.dtypes import kv_bytes_per_element
from tokios.kv_cache.layout import KVCacheLayout
from tokios.kv_cache.manager import KVCacheManager
from tokios.distributed.plan import ParallelPlan
from tokios.model.attention import kv_block_bytes
from tokios.model.decoder import ModelPart
from tokios.model.dtypes import kv_cache_dtype
from tokios.model.loader import load_model
from tokios.model.protocol import Model
from tokios.model_files import resolve_model_path
from tokios.platform import physical_core_count, resolve_device
from tokios.request import Request, RequestStatus
from tokios.runner.model_runner import ModelRunner
from tokios.sampling_params import SamplingParams
from tokios.scheduler.scheduler import Scheduler
from tokios.speculative.draft_model import load_draft_proposer
from tokios.speculative.proposers import ModelDraftProposer, NgramProposer
from tokios.speculative.speculator import Speculator
from tokios.reasoning.budget import BudgetMatcher
from tokios.structured.compiler import CompiledGrammar, GrammarCompiler
from tokios.tokenizer import tokenizer_for_loaded_model
from tokios.tokenizer.chat_template import resolve_chat_template

logger = logging.getLogger("tokios.engine")


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_blocks_total: int
    num_blocks_used: int
    num_blocks_free: int
    num_blocks_cached: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int
    # Steps run since start: how much work a request got before it was aborted, without a clock.
    num_steps: int = 0
    # Speculative decoding (docs/speculative.md): verifications with proposals, proposed and
    # accepted tokens, and per position j the drafts that reached j / whose token j was accepted.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_drafts_per_position: list[int] | None = None
    spec_accepted_per_position: list[int] | None = None
    # Structured output (docs/structured.md): requests under a grammar, and the compiler's and
    # the mask worker's timing histograms (tokios.structured.compiler.SecondsHistogram).
    num_constrained_requests: int = 0
    grammar_compile_seconds: object | None = None
    grammar_mask_seconds: object | None = None
    # The prefix cache's disk tier (kv_cache/disk_tier.py): prompt tokens loaded from it, blocks
    # written, files rejected (corrupt, truncated, foreign), and what it holds now.
    disk_cache_hit_tokens: int = 0
    disk_cache_writes: int = 0
    disk_cache_rejected: int = 0
    disk_cache_files: int = 0
    disk_cache_bytes: int = 0
    # Weight bytes the quantized kernels have read since start (a mixture of experts: its chosen
    # experts' only); 0 where the weights run off the kernels (float formats, a GPU).
    weight_bytes_read: int = 0


class EngineCore:
    def __init__(self, config: EngineConfig):
        started = time.perf_counter()
        self.config = config
        self.device = resolve_device(config.load.device)
        if self.device.type == "cpu":
            # In a parallel group the ranks take the cores (--threads is theirs); this process only
            # runs the output head and the sampler (and a draft model, if any, which keeps the
            # threads), and idle OpenMP workers of its own spinning between steps would take time
            # from the ranks.
            front_only = config.parallel.world_size > 1 and not config.speculative.draft_model
            torch.set_num_threads(1 if front_only else config.load.num_threads or physical_core_count())
        self.weight_format = config.load.dtype
        if self.weight_format == "auto":
            self.weight_format = AUTO_DTYPE_BY_DEVICE[self.device.type]
        path = resolve_model_path(config.load.model)
        # A bad --chat-template fails before the model is read.
        chat_template = None if config.load.chat_template is None else resolve_chat_template(config.load.chat_template)
        parallel = ParallelPlan.of(config.parallel)
        # In a parallel group the ranks hold the layers; this process keeps the output head.
        loaded = load_model(path, self.weight_format, self.device,
                            ModelPart(range(0), embed=False, head=True) if parallel.is_parallel else None,
                            config.scheduler.max_model_len)
        self.model_path = path
        self.model: Model = loaded.model
        self.model_config = loaded.config
        self.load_seconds = loaded.load_seconds
        with load_progress.phase("building the tokenizer"):
            self.tokenizer = tokenizer_for_loaded_model(loaded.tokenizer_source, path)
        if chat_template is not None:
            self.tokenizer = self.tokenizer.with_chat_template(chat_template)
        self.max_model_len = min(config.scheduler.max_model_len or self.model_config.max_model_len,
                                 self.model_config.max_model_len)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)

        kv_dtype = kv_cache_dtype(self.weight_format, config.cache.kv_cache_dtype)
        self.kv_dtype = kv_dtype
        block_size = config.cache.block_size
        self.kv_bytes_per_token = self.model_config.kv_bytes_per_token(
            kv_bytes_per_element(kv_dtype, self.model_config.head_dim))
        layout = KVCacheLayout.for_config(self.model_config)
        # A block id is block_size tokens of one KV group's layers (kv_cache/layout.py).
        block_bytes = kv_block_bytes(self.model_config, kv_dtype, block_size)
        num_blocks = config.cache.kv_cache_memory_bytes // block_bytes
        if num_blocks < len(layout.groups):
            raise InvalidRequestError(
                f"kv_cache_memory {config.cache.kv_cache_memory_bytes} bytes holds no block of {block_size} tokens "
                f"({block_bytes * len(layout.groups)} bytes)", param="kv_cache_memory")
        cache_salt = f"{path}|{self.weight_format}|{self.tokenizer.chat_template_fingerprint}"
        self.disk_cache = self._open_disk_cache(config.cache, cache_salt, path, kv_dtype, layout)
        self.kv = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching, cache_salt=cache_salt,
                                 layout=layout, disk=self.disk_cache, block_payload_bytes=block_bytes)
        max_chunk = config.scheduler.max_num_batched_tokens
        self.kv_max_request_tokens = self.kv.max_request_tokens(max_chunk)
        if layout.has_windows:
            sliding = [g.window for g in layout.groups if g.window is not None]
            logger.info("KV cache: %s, %d bytes per token in all %d layers; %d groups of %d layers (%d sliding over "
                        "%s tokens); %d blocks of %d tokens; capacity %d tokens of short contexts, %d in one request",
                        str(kv_dtype).removeprefix("torch."), self.kv_bytes_per_token, self.model_config.num_layers,
                        len(layout.groups), layout.num_tensor_pairs, len(sliding),
                        "/".join(map(str, sorted(set(sliding)))), num_blocks, block_size,
                        num_blocks // len(layout.groups) * block_size, self.kv_max_request_tokens)
        else:
            logger.info("KV cache: %s, %d bytes per token, %d blocks of %d tokens, capacity %d tokens",
                        str(kv_dtype).removeprefix("torch."), self.kv_bytes_per_token, num_blocks, block_size,
                        num_blocks * block_size)
        if parallel.is_parallel:
            from tokios.distributed.executor import DistributedModel

            with load_progress.phase(f"starting the {parallel.world_size} ranks of the parallel group"):
                self.model = DistributedModel(
                    self.model, self.model_config, model_path=path, weight_format=self.weight_format,
                    device=self.device, num_threads=config.load.num_threads, num_slots=num_blocks * block_size,
                    block_size=block_size, kv_dtype=kv_dtype, group=config.parallel)
            self.load_seconds = time.perf_counter() - started
        try:
            self._finish_setup(config, num_blocks, block_size, kv_dtype)
        except BaseException:
            self.close()  # a parallel group's ranks must not outlive a failed start
            raise

    def _finish_setup(self, config: EngineConfig, num_blocks: int, block_size: int, kv_dtype) -> None:
        logger.info("weights (--dtype %s): %s", self.weight_format, self.model.weight_summary())
        max_step_ms = config.scheduler.max_step_ms
        can_slice = config.scheduler.prefill_layer_slices and self.model.supports_layer_slices
        self.scheduler = Scheduler(self.kv, config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens,
                                   self.max_model_len,
                                   max_step_s=max_step_ms / 1000 if isinstance(max_step_ms, (int, float)) else max_step_ms,
                                   num_sliceable_layers=self.model_config.num_layers if can_slice else None)
        with load_progress.phase(f"preparing the KV cache ({config.cache.kv_cache_memory_bytes / 2**20:.0f} MiB)"):
            self.runner = ModelRunner(self.model, self.model_config, num_blocks, block_size, self.device, kv_dtype,
                                      seed=config.seed)
        if self.disk_cache is not None:
            self.runner.block_sink = self.disk_cache.write_async
        self.speculator = Speculator(config.speculative, self._make_proposers(num_blocks, block_size))
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_steps = 0
        self.num_constrained_requests = 0

    def _open_disk_cache(self, cache, cache_salt: str, path: str, kv_dtype, layout):
        if cache.kv_cache_disk is None:
            return None
        from tokios.kv_cache.disk_tier import DiskPrefixCache, fingerprint

        try:
            stat = os.stat(path) if os.path.isfile(path) else None
        except OSError:
            stat = None
        config = self.model_config
        identity = fingerprint(cache_salt, stat and (stat.st_size, stat.st_mtime_ns), str(kv_dtype), cache.block_size,
                               config.num_layers, config.num_kv_heads, config.head_dim, layout.windows)
        disk = DiskPrefixCache(cache.kv_cache_disk, cache.kv_cache_disk_bytes, identity)
        logger.info("KV cache disk tier: %s, %d blocks (%.1f MiB) of this model there, limit %.1f MiB%s",
                    disk.directory, disk.num_files, disk.total_bytes / 2**20, cache.kv_cache_disk_bytes / 2**20,
                    "" if disk.is_writable else " (not writable: read only)")
        return disk

    def close(self) -> None:
        """Stop what the engine started outside this process (a parallel group's ranks); such
        an engine cannot step after this (`closed`)."""
        self.model.close()

    @property
    def closed(self) -> bool:
        return self.model.is_closed

    def save_prefix_cache(self) -> int:
        """Write every block of the memory prefix cache to the disk tier and wait for the writes
        (at shutdown; a restart then starts warm). Returns the blocks handed to the tier."""
        if self.disk_cache is None:
            return 0
        blocks = [(block_id, key) for block_id, key in self.kv.cached_block_keys() if key not in self.disk_cache]
        for (_, key), payload in zip(blocks, self.runner.block_payloads(blocks)):
            self.disk_cache.write_async(key, payload)
        self.disk_cache.flush()
        logger.info("KV cache disk tier: wrote %d blocks at shutdown (%d on disk, %.1f MiB)", len(blocks),
                    self.disk_cache.num_files, self.disk_cache.total_bytes / 2**20)
        return len(blocks)

    def _make_proposers(self, num_blocks: int, block_size: int) -> dict:
        spec = self.config.speculative
        proposers = {
            "ngram": NgramProposer(spec.ngram_min_n, spec.ngram_max_n),
            "self_draft": ModelDraftProposer(
                "self_draft", self.model, self.runner.kv_caches, min(spec.self_draft_num_layers, self.model_config.num_layers),
                self.runner.build_batch, block_size, shares_target_cache=True),
        }
        if spec.draft_model:
            proposers["draft_model"] = load_draft_proposer(spec, self, num_blocks, block_size)
        return proposers

    # ---- requests ------------------------------------------------------------------------------
    def make_requests(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      grammar: CompiledGrammar | None = None) -> list[Request]:
        """Validate and build the n sequences of one request, each a Request (tokios.request),
        without touching engine state. A request with a structured output gets its compiled
        grammar as `grammar` (AsyncEngine compiles it off the loop) or compiles it here."""
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty; give at least one token", param="prompt")
        vocab_size = self.model_config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size})", param="prompt")
        params.validate_for_vocab(vocab_size)
        self.speculator.resolve(params)
        num_prompt = len(prompt_token_ids)
        limit = self.max_model_len
        if params.max_tokens is None:
            max_tokens = limit - num_prompt
        else:
            max_tokens = params.max_tokens
        if num_prompt + max_tokens > limit or max_tokens < 1:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} for the completion). "
                "Please reduce the length of the prompt or the completion.")
        if num_prompt + max_tokens > self.kv_max_request_tokens:
            capacity = self.kv_max_request_tokens
            raise ContextLengthExceededError(
                f"The KV cache holds {capacity} tokens for one request; this request needs up to "
                f"{num_prompt + max_tokens} ({num_prompt} in the prompt, {max_tokens} for the completion). "
                "Please reduce the length of the prompt or the completion.")
        if params.structured_output is not None and grammar is None:
            grammar = self.grammars.compile(params.structured_output)
        eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        sequences = []
        for index, sequence_id in enumerate(sequence_ids(request_id, params.n)):
            child_params = params.for_child(index) if params.n > 1 else params
            sequences.append(Request(sequence_id, prompt_token_ids, child_params, max_tokens, eos_token_ids,
                                     sample_index=index, parent=sequences[0] if index else None))
            matcher = grammar.new_matcher() if grammar is not None else None
            if params.thinking_budget is not None:
                matcher = BudgetMatcher(params.thinking_budget, matcher)
            sequences[-1].grammar = matcher
        return sequences

    def add_requests(self, sequences: list[Request]) -> None:
        """Queue the sequences of one request (make_requests) in the scheduler."""
        for sequence in sequences:
            if sequence.request_id in self.scheduler.requests:
                raise InvalidRequestError(f"request id {sequence.request_id!r} is already running", param="request_id")
        for sequence in sequences:
            self.speculator.admit(sequence)
        for sequence in sequences:
            self.scheduler.add_request(sequence)
        self.num_prompt_tokens += sequences[0].num_prompt_tokens if sequences else 0
        self.num_constrained_requests += bool(sequences and sequences[0].grammar is not None)

    def abort(self, sequence_ids_to_abort: list[str]) -> list[str]:
        aborted = []
        for sequence_id in sequence_ids_to_abort:
            if self.scheduler.finish(sequence_id, RequestStatus.FINISHED_ABORTED) is not None:
                aborted.append(sequence_id)
        return aborted

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        self.num_steps += 1
        scheduler_output = self.scheduler.schedule()
        self.speculator.propose(scheduler_output)
        started = time.perf_counter()
        runner_output = self.runner.execute(scheduler_output)
        self.scheduler.observe_step(scheduler_output, time.perf_counter() - started, runner_output.layer_slice_seconds)
        finished = self.scheduler.update(scheduler_output, runner_output.sampled_token_ids)
        self.speculator.observe(scheduler_output, runner_output.sampled_token_ids, time.perf_counter() - started)
        for sequence_id, error in runner_output.failed.items():
            # A row with nothing to sample ends its own request only; the batch goes on.
            logger.warning("request %s failed in the sampler: %s", sequence_id, error.message)
            self.scheduler.finish(sequence_id, RequestStatus.FINISHED_ABORTED)
        finish_by_id = {f.request.request_id: f for f in finished}
        outputs = []
        for scheduled in scheduler_output.scheduled:
            request = scheduled.request
            sequence_id = request.request_id
            new_token_ids = runner_output.sampled_token_ids.get(sequence_id, [])
            prompt_logprobs = runner_output.prompt_logprobs.get(sequence_id)
            embedding = runner_output.embeddings.get(sequence_id)
            done = finish_by_id.get(sequence_id)
            self.num_generation_tokens += len(new_token_ids)
            if (error := runner_output.failed.get(sequence_id)) is not None:
                outputs.append(EngineOutput(sequence_id=sequence_id, new_token_ids=[], finish_reason="abort",
                                            error=error))
                continue
            if not new_token_ids and not prompt_logprobs and embedding is None and done is None:
                continue
            outputs.append(EngineOutput(
                sequence_id=sequence_id, new_token_ids=new_token_ids,
                new_logprobs=runner_output.logprobs.get(sequence_id),
                new_prompt_logprobs=prompt_logprobs, embedding=embedding,
                finish_reason=done.status.value if done else None,
                stop_reason=request.stop_reason if done else None,
                num_cached_tokens=request.num_cached_tokens, num_preemptions=request.num_preemptions,
                first_scheduled_time=request.first_scheduled_time,
                spec_counts=(spec.num_verifications, spec.num_draft_tokens, spec.num_accepted_tokens)
                if (spec := request.spec_state) is not None else (0, 0, 0)))
        return outputs

    def stats(self) -> EngineStats:
        pool = self.kv.pool
        spec = self.speculator.stats
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_blocks_total=pool.num_blocks, num_blocks_used=pool.num_used_blocks,
            num_blocks_free=pool.num_free_blocks, num_blocks_cached=pool.num_cached_blocks,
            kv_cache_usage=pool.num_used_blocks / pool.num_blocks,
            prefix_cache_queries=self.kv.prefix_cache_queries, prefix_cache_hits=self.kv.prefix_cache_hits,
            disk_cache_hit_tokens=self.kv.disk_hits,
            disk_cache_writes=self.disk_cache.num_writes if self.disk_cache else 0,
            disk_cache_rejected=self.disk_cache.num_rejected if self.disk_cache else 0,
            disk_cache_files=self.disk_cache.num_files if self.disk_cache else 0,
            disk_cache_bytes=self.disk_cache.total_bytes if self.disk_cache else 0,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens, num_generation_tokens=self.num_generation_tokens,
            num_steps=self.num_steps,
            spec_num_drafts=spec.num_drafts, spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            spec_drafts_per_position=list(spec.drafts_per_position),
            spec_accepted_per_position=list(spec.accepted_per_position),
            num_constrained_requests=self.num_constrained_requests,
            grammar_compile_seconds=self.grammars.compile_seconds,
            grammar_mask_seconds=self.runner.grammar_bitmask.mask_seconds,
            weight_bytes_read=self.weight_bytes_read() or 0)

    def weight_bytes_read(self) -> int | None:
        """The weight bytes this process's quantized kernels have read so far (None: some product
        runs off them, or the model counts none, as a parallel group's front)."""
        counter = getattr(self.model, "weight_bytes_read", None)
        return None if counter is None else counter()

    def reset_counters(self) -> None:
        """Cumulative request counters back to zero (the KV cache and its contents stay)."""
        self.num_prompt_tokens = self.num_generation_tokens = self.num_steps = self.num_constrained_requests = 0
        self.kv.prefix_cache_queries = self.kv.prefix_cache_hits = self.kv.disk_hits = 0
        self.scheduler.num_preemptions = 0

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()
