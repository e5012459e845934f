"""EncoderEngine: one encoder model served, its inputs packed into forwards by a step thread.

Embedding and scoring requests are prefill only: no KV cache, no decode. Each request's inputs
wait in its own queue; each step takes inputs from the requests in turn, one at a time, until the
token budget is reached (at least one input, so an input longer than the budget still runs),
packs them end to end (encoder/batch.py: no padding in the matrix products), runs the model and
its head, and hands each input's row to its request, which finishes when its last input has.

The step thread is a background engine of engine/cpu_turns.py: each forward runs inside a turn,
and while a generative engine of the same process is decoding, a forward is cut to the tokens
that fit a fraction of that engine's step (from this engine's own measured tokens per second),
so the decoding streams keep their pace and the embeddings take the rest of the CPU.

Like AsyncEngine, the model loads in the step thread (one thread pool for all of torch's work),
a failed step fails every request in flight and stops the engine (`on_failure`), and
`stall_report` is the watchdog's view.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokios.config import AUTO_DTYPE_BY_DEVICE, EngineConfig
from tokios.engine.async_engine import EngineDeadError, stall_report
from tokios.engine.core import EngineStats
from tokios.engine.cpu_turns import CPU_TURNS
from tokios.encoder.batch import EncoderBatch
from tokios.encoder.loader import LoadedEncoder, load_encoder
from tokios.errors import InvalidRequestError
from tokios.model_files import resolve_model_path
from tokios.platform import physical_core_count, resolve_device

logger = logging.getLogger("tokios.engine")

# Tokens one forward packs at most (when no generative engine is busy): past about this many a
# bigger matrix product gains little, and a request arriving meanwhile waits for the whole step.
DEFAULT_MAX_BATCH_TOKENS = 2048
# A forward cut for a busy generative engine still takes at least this many tokens.
MIN_SLICE_TOKENS = 16
# Smoothing of the measured seconds per token (weight of a new forward).
RATE_EMA_WEIGHT = 0.3


@dataclass
class _Input:
    request: _EncodeRequest
    index: int
    token_ids: list[int]
    token_type_ids: list[int] | None


@dataclass
class _EncodeRequest:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    rows: list[torch.Tensor | None]
    num_left: int
    is_cancelled: bool = False


class EncoderEngine:
    """The registry's engine for an encoder model (the same lifecycle as AsyncEngine)."""

    is_encoder = True

    def __init__(self, config: EngineConfig, max_batch_tokens: int | None = None):
        self.config = config
        self.max_batch_tokens = max_batch_tokens or max(DEFAULT_MAX_BATCH_TOKENS,
                                                        config.scheduler.max_num_batched_tokens)
        # One queue of inputs per request, taken from in turn (a request of 2,048 inputs does not
        # hold back the short ones that arrive after it).
        self._queue: deque[deque[_Input]] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._is_shut_down = False
        self.failure: EngineDeadError | None = None
        self.on_failure: Callable[[EngineDeadError], None] | None = None
        self._last_progress = time.monotonic()
        self._activity = "loading the model"
        self._seconds_per_token: float | None = None
        self._num_steps = 0
        self._num_prompt_tokens = 0
        self._num_in_flight = 0
        self._loaded = threading.Event()
        self._load_error: BaseException | None = None
        self._thread: threading.Thread | None = threading.Thread(target=self._load_and_run, name="tokios-encoder",
                                                                 daemon=True)
        self._thread.start()
        self._loaded.wait()
        if self._load_error is not None:
            raise self._load_error
        encoder = self.encoder
        self.tokenizer = encoder.tokenizer
        self.vocab_size = encoder.config.vocab_size
        self.max_model_len = encoder.max_input_tokens
        self.model_name = encoder.config.name

    def _load_and_run(self) -> None:
        try:
            device = resolve_device(self.config.load.device)
            if device.type == "cpu":
                torch.set_num_threads(self.config.load.num_threads or physical_core_count())
            weight_format = self.config.load.dtype
            if weight_format == "auto":
                weight_format = AUTO_DTYPE_BY_DEVICE[device.type]
            self.device = device
            self.encoder: LoadedEncoder = load_encoder(resolve_model_path(self.config.load.model), weight_format,
                                                       device)
        except BaseException as exc:  # reported by __init__ in the caller's thread
            self._load_error = exc
            return
        finally:
            self._loaded.set()
        self._run()

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        if self.failure is not None:
            raise self.failure
        if self._is_shut_down:  # unloaded: a request that raced the unload must not restart it
            raise EngineDeadError("this model was unloaded; load it again", code="engine_closed")
        if self._thread is not None and self._thread.is_alive():
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="tokios-encoder", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        self._is_shut_down = True
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10)
            self._thread = None
        self._fail_queued(EngineDeadError("the model was unloaded", code="engine_closed"))

    def abort(self, request_id: str) -> None:
        """Nothing to do by id: an encode request ends when its caller is cancelled (the server's
        drain cancels its handlers), and its inputs still queued are dropped then."""

    def cache_events(self, since_seq: int, log_id: str) -> dict:
        """An encoder has no prefix cache: never anything stored (gateway/prefix_index.py)."""
        return {"log_id": "", "next": 0, "reset": True, "block_size": 0, "root_hash": "", "stored": [], "removed": []}

    def forget_warm_up(self) -> None:
        self._num_steps = self._num_prompt_tokens = 0

    @property
    def is_alive(self) -> bool:
        if self.failure is not None:
            return False
        return self._stopping or (self._thread is not None and self._thread.is_alive())

    @property
    def num_unfinished_requests(self) -> int:
        return self._num_in_flight

    # ---- requests -------------------------------------------------------------------------------
    async def encode(self, inputs: list[list[int]], token_type_ids: list[list[int]] | None = None) -> torch.Tensor:
        """One row per input: the model's vector (an embedding model) or its class logits (a
        cross-encoder), float32 on the CPU. Cancelling the caller drops its inputs not yet run."""
        if not inputs:
            raise InvalidRequestError("no input to encode", param="input")
        for index, ids in enumerate(inputs):
            # Checked here, not in the step: a bad id or length in a step would fail every request.
            if not 0 < len(ids) <= self.max_model_len:
                raise InvalidRequestError(f"input[{index}] has {len(ids)} tokens; this model takes 1 to "
                                          f"{self.max_model_len}", param="input")
            if min(ids) < 0 or max(ids) >= self.vocab_size:
                raise InvalidRequestError(f"input[{index}] has a token id outside the vocabulary [0, "
                                          f"{self.vocab_size})", param="input")
        self.start()
        loop = asyncio.get_running_loop()
        request = _EncodeRequest(loop, loop.create_future(), [None] * len(inputs), len(inputs))
        items = [_Input(request, index, list(ids), None if token_type_ids is None else list(token_type_ids[index]))
                 for index, ids in enumerate(inputs)]
        with self._lock:
            if self.failure is not None:
                raise self.failure
            self._queue.append(deque(items))
            self._num_in_flight += 1
        self._wake.set()
        try:
            return await request.future
        finally:
            request.is_cancelled = True  # a cancelled caller: its inputs still queued are skipped
            with self._lock:
                self._num_in_flight -= 1

    # ---- the step loop (encoder thread) -----------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            self._last_progress = time.monotonic()
            self._activity = "idle"
            batch_items = self._take_batch()
            if not batch_items:
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            self._activity = f"in step {self._num_steps + 1} ({len(batch_items)} inputs)"
            try:
                rows = self._forward(batch_items)
            except Exception as exc:
                logger.exception("encoder step failed; failing every request in flight and stopping the engine")
                self._fail(EngineDeadError(f"engine step failed: {type(exc).__name__}: {exc}", code="engine_failed"),
                           batch_items)
                return
            for item, row in zip(batch_items, rows):
                self._deliver(item, row)

    def _take_batch(self) -> list[_Input]:
        budget = self.max_batch_tokens
        slice_s = CPU_TURNS.background_slice_s()
        if slice_s is not None and self._seconds_per_token:
            budget = max(MIN_SLICE_TOKENS, min(budget, int(slice_s / self._seconds_per_token)))
        taken: list[_Input] = []
        num_tokens = 0
        with self._lock:
            while self._queue:
                inputs = self._queue[0]
                item = inputs[0]
                if item.request.is_cancelled:
                    self._queue.popleft()
                    continue
                if taken and num_tokens + len(item.token_ids) > budget:
                    break
                taken.append(inputs.popleft())
                num_tokens += len(item.token_ids)
                if inputs:
                    self._queue.rotate(-1)  # this request's next input waits for the others' turn
                else:
                    self._queue.popleft()
        return taken

    def _forward(self, items: list[_Input]) -> torch.Tensor:
        has_types = any(item.token_type_ids is not None for item in items)
        token_types = ([item.token_type_ids or [0] * len(item.token_ids) for item in items] if has_types else None)
        batch = EncoderBatch.pack([item.token_ids for item in items], token_types, self.device)
        with CPU_TURNS.turn(foreground=False):
            started = time.perf_counter()
            with torch.inference_mode():
                rows = self.encoder.head(self.encoder.model.forward(batch), batch).cpu()
            elapsed = time.perf_counter() - started
        per_token = elapsed / batch.num_tokens
        previous = self._seconds_per_token
        self._seconds_per_token = per_token if previous is None else previous + RATE_EMA_WEIGHT * (per_token - previous)
        self._num_steps += 1
        self._num_prompt_tokens += batch.num_tokens
        return rows

    def _deliver(self, item: _Input, row: torch.Tensor) -> None:
        request = item.request
        request.rows[item.index] = row
        request.num_left -= 1
        if request.num_left == 0:
            result = torch.stack(request.rows)
            request.loop.call_soon_threadsafe(_resolve, request.future, result)

    def _fail(self, error: EngineDeadError, running: list[_Input]) -> None:
        self.failure = error
        self._stopping = True
        self._activity = "stopped after a failed step"
        for item in running:
            item.request.loop.call_soon_threadsafe(_reject, item.request.future, error)
        self._fail_queued(error)
        if self.on_failure is not None:
            self.on_failure(error)

    def _fail_queued(self, error: Exception) -> None:
        with self._lock:
            queued = [item for inputs in self._queue for item in inputs]
            self._queue = deque()
        for item in queued:
            item.request.loop.call_soon_threadsafe(_reject, item.request.future, error)

    # ---- reporting --------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        with self._lock:
            num_waiting = sum(len(inputs) for inputs in self._queue)
        return EngineStats(num_running=self._num_in_flight, num_waiting=num_waiting, num_blocks_total=0,
                           num_blocks_used=0, num_blocks_free=0, num_blocks_cached=0, kv_cache_usage=0.0,
                           prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0,
                           num_prompt_tokens=self._num_prompt_tokens, num_generation_tokens=0,
                           num_steps=self._num_steps)

    def check_invariants(self) -> None:
        """With no request in flight, nothing may wait in the queue but inputs of cancelled
        requests (dropped at the next step); /v1/engine/stats reports a breach."""
        with self._lock:
            num_live = sum(not inputs[0].request.is_cancelled for inputs in self._queue for _ in inputs)
            if self._num_in_flight == 0 and num_live:
                raise AssertionError(f"{num_live} queued inputs belong to no request in flight")

    def stall_report(self, timeout_s: float) -> tuple[str, str] | None:
        return stall_report(self._thread, self._last_progress, self._num_in_flight, self._activity, timeout_s)


def _resolve(future: asyncio.Future, result) -> None:
    if not future.done():
        future.set_result(result)


def _reject(future: asyncio.Future, error: Exception) -> None:
    if not future.done():
        future.set_exception(error)
