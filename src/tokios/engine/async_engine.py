"""AsyncEngine: the engine core stepped by a background thread, with one async stream per request.

The step loop runs in its own thread (the model's matrix products release the GIL, so the
server's event loop stays responsive). Other threads never touch the core: generate() and
abort() send typed commands (engine/commands.py) to a queue that the loop drains before each
step, dispatching them by type, and the loop hands RequestOutputs back to each request's
asyncio.Queue with call_soon_threadsafe. A consumer that stops iterating (client gone, task
cancelled) aborts its request, which frees its KV blocks.

Failure is loud and short (docs/reliability.md): an exception inside a step fails every request
in flight with EngineDeadError, stops the loop for good, and calls `on_failure` (the server
turns /health 503 and exits non-zero); later generate() calls fail at once. `stall_report()` is
the watchdog's view: with work waiting and no loop progress for longer than a timeout, it says
what the loop was doing, with the engine thread's stack.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import AsyncIterator

from tokios.config import EngineConfig
from tokios.engine.commands import AbortRequest, AddRequest, CommandQueue, FailEngine, ResetCounters
from tokios.engine.core import EngineCore, EngineStats
from tokios.engine.cpu_turns import CPU_TURNS
from tokios.engine.faults import FaultInjector
from tokios.engine.output_processor import OutputProcessor, sequence_ids
from tokios.errors import InvalidRequestError, TokiosError
from tokios.outputs import RequestOutput
from tokios.sampling_params import SamplingParams

logger = logging.getLogger("tokios.engine")


def served_model_name(path: str) -> str:
    """A clean model id from the file or directory name: '.../SmolLM2-135M-Instruct.Q4_1.gguf'
    -> 'SmolLM2-135M-Instruct' (the quantization suffix names the file, not the model)."""
    name = os.path.basename(os.path.normpath(path))
    if name.endswith(".gguf"):
        name = re.sub(r"[.-](I?Q\d\w*|F16|F32|BF16)$", "", name[:-5], flags=re.IGNORECASE)
    return name or "tokios"


def stall_report(thread: threading.Thread | None, last_progress: float, num_waiting: int, activity: str,
                 timeout_s: float) -> tuple[str, str] | None:
    """A step loop's watchdog view (every engine's): None while it advances or nothing waits;
    otherwise (what it has been doing for longer than `timeout_s`, its thread's current stack)."""
    if not num_waiting:
        return None
    stalled_s = time.monotonic() - last_progress
    if stalled_s <= timeout_s:
        return None
    frame = sys._current_frames().get(thread.ident) if thread is not None and thread.ident else None
    stack = "".join(traceback.format_stack(frame)) if frame is not None else "(the loop's thread is not running)\n"
    return (f"the step loop has not advanced for {stalled_s:.1f} s with {num_waiting} requests waiting; it is "
            f"{activity}", stack)


class EngineDeadError(TokiosError):
    status = 500
    error_type = "engine_error"


class AsyncEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self._commands = CommandQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self._ids = itertools.count()
        self._faults = FaultInjector.from_environment()
        # Set once, by the engine thread, when a step raised; from then on nothing runs.
        self.failure: EngineDeadError | None = None
        # Called in the engine thread after a failure has been delivered to every stream.
        self.on_failure: Callable[[EngineDeadError], None] | None = None
        # The watchdog's view: when the loop last went round, and what it is doing now.
        self._last_progress = time.monotonic()
        self._activity = "loading the model"
        # The engine thread loads the model itself and then steps it: all of torch's parallel work
        # then happens in one thread. Loading in the caller's thread and stepping in another gives
        # each thread its own OpenMP team, whose idle workers spin against each other (measured:
        # 13.9-14.8 ms per decode step instead of 7.3 ms).
        self._loaded = threading.Event()
        self._load_error: BaseException | None = None
        # In a copy of the caller's context: the load's progress reporter (load_progress.py) is there.
        self._thread: threading.Thread | None = threading.Thread(target=contextvars.copy_context().run,
                                                                 args=(self._load_and_run,), name="tokios-engine",
                                                                 daemon=True)
        self._thread.start()
        self._loaded.wait()
        if self._load_error is not None:
            raise self._load_error
        self.tokenizer = self.core.tokenizer
        self.model_config = self.core.model_config
        self.vocab_size = self.model_config.vocab_size
        self.max_model_len = self.core.max_model_len
        self.model_name = served_model_name(self.core.model_path)

    def _load_and_run(self) -> None:
        try:
            self.core = EngineCore(self.config)
            self.output_processor = OutputProcessor(self.core.tokenizer)
        except BaseException as exc:  # reported by __init__ in the caller's thread
            self._load_error = exc
            return
        finally:
            self._loaded.set()
        self.core.model.watch(self._on_lost_part)  # a parallel group's rank that dies between steps
        self._run()

    def _on_lost_part(self, error: TokiosError) -> None:
        self._commands.send(FailEngine(error))

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Idempotent: the step loop runs from construction; after shutdown() this starts it again.
        A failed engine never starts again."""
        if self.failure is not None:
            raise self.failure
        if self._thread is not None and self._thread.is_alive():
            return
        if self.core.closed:
            raise EngineDeadError("this engine was shut down and its parallel group stopped; load it again",
                                  code="engine_closed")
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="tokios-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        self._stopping = True
        self._commands.wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10)
            self._thread = None
        if hasattr(self, "core"):
            await asyncio.get_running_loop().run_in_executor(None, self.core.close)

    # ---- requests -------------------------------------------------------------------------------
    async def generate(self, prompt: str | None, sampling_params: SamplingParams, request_id: str | None = None,
                       prompt_token_ids: list[int] | None = None) -> AsyncIterator[RequestOutput]:
        self.start()
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        if prompt_token_ids is None:
            if prompt is None:
                raise InvalidRequestError("give a prompt or prompt_token_ids", param="prompt")
            prompt_token_ids = self.tokenizer.encode(prompt)
        grammar = None
        if sampling_params.structured_output is not None:
            # Compiled in the compiler's worker thread (cached by content): neither this event loop
            # nor the step loop waits for a slow grammar; a bad one is a 400 here, before queueing.
            grammar = await self.core.grammars.compile_async(sampling_params.structured_output)
        sequences = self.core.make_requests(request_id, list(prompt_token_ids), sampling_params, grammar)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        if self.failure is not None:  # failed after the check in start(): the loop will not serve it
            self._streams.pop(request_id, None)
            raise self.failure
        self._commands.send(AddRequest(request_id, prompt, tuple(prompt_token_ids), sampling_params, tuple(sequences)))
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Thread-safe and idempotent."""
        self._commands.send(AbortRequest(request_id))

    def forget_warm_up(self) -> None:
        """Zeroes the cumulative counters (after a warm-up run, so that they count only real
        requests); runs in the engine thread before its next step."""
        self._commands.send(ResetCounters())

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._streams)

    def stats(self) -> EngineStats:
        return self.core.stats()

    def cache_events(self, since_seq: int, log_id: str) -> dict:
        """The prefix cache's stored and dropped block hashes since a reader's last call (any
        thread; kv_cache/events.py), with what a router needs to hash prompts the same way."""
        kv = self.core.kv
        events = kv.pool.cache_events.read(since_seq, log_id)
        return {"log_id": kv.pool.cache_events.log_id, "next": events.next_seq, "reset": events.is_reset,
                "block_size": kv.block_size, "root_hash": f"{kv.root_hash:032x}",
                "stored": [f"{key:032x}" for key in events.stored_hashes],
                "removed": [f"{key:032x}" for key in events.removed_hashes]}

    def check_invariants(self) -> None:
        self.core.check_invariants()

    # ---- health (any thread) ----------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        """False once the engine failed, or if its thread is gone without a shutdown."""
        if self.failure is not None:
            return False
        return self._stopping or (self._thread is not None and self._thread.is_alive())

    def stall_report(self, timeout_s: float) -> tuple[str, str] | None:
        """None while healthy; otherwise (what the loop has been doing for longer than `timeout_s`
        while requests wait, the engine thread's current stack)."""
        return stall_report(self._thread, self._last_progress, len(self._streams), self._activity, timeout_s)

    # ---- the step loop (engine thread) ------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            self._last_progress = time.monotonic()
            self._activity = "idle"
            self._commands.wake.clear()
            self._drain_commands()
            if self._stopping:
                break
            if not self.core.has_unfinished:
                self._commands.wake.wait(timeout=1.0)
                continue
            try:
                scheduler = self.core.scheduler
                self._activity = (f"in step {self.core.num_steps + 1} ({len(scheduler.running)} running, "
                                  f"{len(scheduler.waiting)} waiting)")
                self._faults.before_step()
                with CPU_TURNS.turn(foreground=True):
                    engine_outputs = self.core.step()
                outputs, stopped = self.output_processor.process(engine_outputs)
                self.core.abort(stopped)
                for request_id, error in self.output_processor.take_failures():
                    self._deliver_error(request_id, error)
            except Exception as exc:  # a bug or device failure: the engine's state is suspect
                logger.exception("engine step failed; failing every request in flight and stopping the engine")
                self._fail(EngineDeadError(f"engine step failed: {type(exc).__name__}: {exc}",
                                           code="engine_failed"))
                return
            for output in outputs:
                self._deliver(output)
        if self.failure is None:
            try:
                self.core.save_prefix_cache()
            except Exception:  # the disk tier is a cache: a failure to fill it loses nothing
                logger.exception("could not write the prefix cache to its disk tier")

    def _drain_commands(self) -> None:
        for command in self._commands.drain():
            self._COMMAND_HANDLERS[type(command)](self, command)
            if self.failure is not None:
                return  # the loop stops: what is still queued is never served

    def _add_now(self, command: AddRequest) -> None:
        if command.request_id not in self._streams:
            return  # the consumer left before its request reached the engine
        self.output_processor.add_request(command.request_id, command.prompt, list(command.prompt_token_ids),
                                          command.sampling_params, arrival_time=command.sequences[0].arrival_time)
        self.core.add_requests(list(command.sequences))

    def _abort_now(self, command: AbortRequest) -> None:
        state = self.output_processor.requests.get(command.request_id)
        if state is None:
            return
        self.core.abort(sequence_ids(command.request_id, state.params.n))
        output = self.output_processor.abort_outputs(command.request_id)
        if output is not None:
            self._deliver(output)

    def _reset_counters_now(self, command: ResetCounters) -> None:
        self.core.reset_counters()

    def _fail_now(self, command: FailEngine) -> None:
        logger.error("engine failed between steps: %s", command.error.message)
        self._fail(EngineDeadError(f"engine failed: {command.error.message}", code="engine_failed"))

    # One handler per command type (engine/commands.py); CommandQueue.send admits no other type.
    _COMMAND_HANDLERS = {AddRequest: _add_now, AbortRequest: _abort_now, ResetCounters: _reset_counters_now,
                         FailEngine: _fail_now}

    def _fail(self, error: EngineDeadError) -> None:
        """Every stream gets `error`, including those whose add command never reached the core."""
        self.failure = error  # first: generate() checks it after registering its stream
        self._stopping = True
        self._activity = "stopped after a failed step"
        for request_id in list(self._streams):
            self._deliver_error(request_id, error)
        if self.on_failure is not None:
            self.on_failure(error)

    def _deliver(self, output: RequestOutput) -> None:
        entry = self._streams.get(output.request_id)
        if entry is not None:
            loop, stream = entry
            loop.call_soon_threadsafe(stream.put_nowait, output)

    def _deliver_error(self, request_id: str, error: Exception) -> None:
        entry = self._streams.get(request_id)
        if entry is not None:
            loop, stream = entry
            loop.call_soon_threadsafe(stream.put_nowait, error)
