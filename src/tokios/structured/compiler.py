"""GrammarCompiler: turns a StructuredOutput into a compiled llguidance grammar, off the step loop.

One per engine. Owns the llguidance tokenizer of the model (built from our `tokenizers` pipeline
on first use: 0.4 s for SmolLM2's 49k vocabulary, 5 s for Gemma 3's 262k, so a server that never
sees a constrained request never pays it), a worker thread that compiles (AsyncEngine awaits it,
so a slow grammar delays only its own request), and an LRU cache of compiled grammars keyed by
the constraint's content: the second request with the same schema starts at once. A grammar that
does not compile raises InvalidRequestError naming the request field and llguidance's reason,
before the request is queued. Also the timing histograms for /metrics.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tokios.errors import InvalidRequestError
from tokios.structured.matcher import GrammarMatcher
from tokios.structured.spec import StructuredOutput

logger = logging.getLogger("tokios.structured")

COMPILE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
MASK_BUCKETS_S = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02,
                  0.025, 0.05, 0.1)


@dataclass
class SecondsHistogram:
    """Bucket counts, for a Prometheus histogram read at scrape time (server/metrics.py) and for
    /v1/engine/stats (a dataclass, so it serialises). One thread observes each histogram."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, then +Inf
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.buckets) + 1)

    def observe(self, seconds: float) -> None:
        index = next((i for i, bound in enumerate(self.buckets) if seconds <= bound), len(self.buckets))
        self.counts[index] += 1
        self.sum += seconds
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        total, result = 0, []
        for bound, count in zip((*map(str, self.buckets), "+Inf"), self.counts):
            total += count
            result.append((bound, total))
        return result


class CompiledGrammar:
    """A compiled grammar; every sequence that uses it gets its own matcher, a copy of this one."""

    def __init__(self, spec: StructuredOutput, pristine_matcher):
        self.spec = spec
        self._pristine = pristine_matcher

    def new_matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._pristine.deep_copy(), self.spec.kind)


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, cache_size: int = 256):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._lltokenizer = None
        self._lock = threading.Lock()  # guards the tokenizer build and the cache
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._executor: ThreadPoolExecutor | None = None
        self.compile_seconds = SecondsHistogram(COMPILE_BUCKETS_S)
        self.num_cache_hits = 0

    def _llguidance_tokenizer(self):
        import llguidance

        if self._lltokenizer is None:
            started = time.perf_counter()
            self._lltokenizer = llguidance.LLTokenizer(
                self._tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                eos_token=sorted(self._tokenizer.eos_token_ids))
            logger.info("structured output: llguidance tokenizer of %d tokens built in %.2f s", self.vocab_size,
                        time.perf_counter() - started)
        return self._lltokenizer

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """The compiled grammar of `spec`, from the cache or compiled now (in the caller's thread)."""
        import llguidance

        key = (spec.kind, spec.source)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return cached
            lltokenizer = self._llguidance_tokenizer()
        started = time.perf_counter()
        grammar = spec.grammar_text()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, lltokenizer)
        if is_error:
            raise InvalidRequestError(f"{spec.param}: {_first_line(messages)}", param=spec.param,
                                      code="invalid_grammar")
        matcher = llguidance.LLMatcher(lltokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"{spec.param}: {matcher.get_error()}", param=spec.param,
                                      code="invalid_grammar")
        if messages:
            logger.info("grammar warnings for %s: %s", spec.param, "; ".join(messages))
        seconds = time.perf_counter() - started
        self.compile_seconds.observe(seconds)
        logger.info("compiled the %s grammar of %s (%d chars) in %.1f ms", spec.kind, spec.param, len(spec.source),
                    seconds * 1e3)
        compiled = CompiledGrammar(spec, matcher)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    async def compile_async(self, spec: StructuredOutput) -> CompiledGrammar:
        """compile() in the compiler's worker thread: the event loop and the step loop go on."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="tokios-grammar")
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.compile, spec)


def _first_line(messages: list[str]) -> str:
    text = messages[0] if messages else "the grammar does not compile"
    return text.strip().splitlines()[0] if text.strip() else text
