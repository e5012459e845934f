"""One engine request as the server sees it, and a job of several of them.

EngineStream wraps `AsyncEngine.generate` for one prompt: it records inter-token latencies,
accumulates logprobs deltas, writes the request log line and the per-request metrics when the
request ends, and aborts the engine request when the consumer stops early (client gone, error,
shutdown). Job groups the streams of one HTTP request (one per prompt), holds its admission
ticket, merges the streams, and `close()` releases everything on every exit path. Also here:
`run_watching_disconnect`, which cancels work when the HTTP client goes away, and
`StreamedResponse`, the HTTP answer of a streamed job (SSE or NDJSON), which closes the job.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tokios.errors import TokiosError
from tokios.outputs import CompletionOutput, RequestOutput, TokenLogprobs

if TYPE_CHECKING:
    from tokios.server.admission import Admission, Ticket
    from tokios.server.metrics import ServerMetrics
    from tokios.server.registry import ModelLease

request_logger = logging.getLogger("tokios.requests")
T = TypeVar("T")


class RequestLogSettings(Protocol):
    log_requests: bool


class StreamOwner(Protocol):
    """What an EngineStream reads from the Serving that starts it (server/serving.py). Named here
    so that serving.py imports this module and this module never imports serving.py."""

    engine: Any  # tokios.engine.AsyncEngine
    admission: Admission
    metrics: ServerMetrics
    model_name: str
    settings: RequestLogSettings


class ClientDisconnectedError(TokiosError):
    """The client closed the connection; nobody reads the answer (nginx's 499)."""

    status = 499
    error_type = "client_closed_request"


async def _wait_for_disconnect(request: Request) -> None:
    # After the body has been read, the next ASGI receive() returns only on disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_watching_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work`, cancelling it (so its engine requests abort) if the client disconnects."""
    work_task = asyncio.ensure_future(work)
    disconnect_task = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, disconnect_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work_task.done():
            work_task.cancel()
        disconnect_task.cancel()
    if work_task.cancelled() or not work_task.done():
        await asyncio.gather(work_task, return_exceptions=True)
        raise ClientDisconnectedError("The client closed the connection before the answer was ready.")
    return work_task.result()


class EngineStream:
    def __init__(self, serving: StreamOwner, request_id: str, prompt_ids: list[int], sampling_params: Any,
                 params_summary: dict[str, Any]):
        self.serving = serving
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.sampling_params = sampling_params
        self.params_summary = params_summary
        self.last_output: RequestOutput | None = None
        self.index_to_logprobs: dict[int, list[TokenLogprobs]] = {}
        self._start_time = time.monotonic()
        self._first_token_time: float | None = None
        self._last_token_time: float | None = None
        self._is_started = False
        self._iterator = self._run()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterator

    async def next_output(self) -> RequestOutput | None:
        """The next output, or None when the request has finished."""
        try:
            return await self._iterator.__anext__()
        except StopAsyncIteration:
            return None

    async def aclose(self) -> None:
        await self._iterator.aclose()
        if not self._is_started:
            # Cancelled before it ran (the client left while its job was being started): closing an
            # unstarted generator runs none of its body, so the request would vanish from the log
            # and the metrics. It never reached the engine; it still arrived, and was abandoned.
            self._is_started = True
            self._record()

    @property
    def is_finished(self) -> bool:
        return self.last_output is not None and self.last_output.finished

    @property
    def start_time(self) -> float:
        return self._start_time

    @property
    def first_token_time(self) -> float | None:
        return self._first_token_time

    @property
    def last_token_time(self) -> float | None:
        return self._last_token_time

    @property
    def num_cached_prompt_tokens(self) -> int:
        """Prompt tokens the engine took from its prefix cache for this request (not computed)."""
        metrics = self.last_output.metrics if self.last_output is not None else None
        return 0 if metrics is None else metrics.num_cached_prompt_tokens

    def logprobs_of(self, output: CompletionOutput) -> list[TokenLogprobs] | None:
        return self.index_to_logprobs.get(output.index) or output.logprobs

    async def _run(self) -> AsyncIterator[RequestOutput]:
        engine = self.serving.engine
        self._is_started = True
        in_flight = self.serving.admission.request_ids_in_flight
        in_flight.add(self.request_id)
        iterator = engine.generate(None, self.sampling_params, self.request_id, prompt_token_ids=self.prompt_ids)
        is_refused = False
        try:
            async for output in iterator:
                self._observe(output)
                self.last_output = output
                yield output
        except Exception:
            # Refused before its first output (bad input): the HTTP error says it; nothing ran.
            is_refused = self.last_output is None
            raise
        finally:
            in_flight.discard(self.request_id)
            if not self.is_finished:
                engine.abort(self.request_id)
            await iterator.aclose()
            if not is_refused:
                self._record()

    def _observe(self, output: RequestOutput) -> None:
        now = time.monotonic()
        num_new_tokens = max((len(choice.token_ids_delta) for choice in output.outputs), default=0)
        for choice in output.outputs:
            if choice.logprobs_delta:
                self.index_to_logprobs.setdefault(choice.index, []).extend(choice.logprobs_delta)
        if not num_new_tokens:
            return
        if self._last_token_time is not None:
            # Several tokens in one step (speculation) share the gap evenly.
            gap_s = (now - self._last_token_time) / num_new_tokens
            self.serving.metrics.observe_inter_token(self.serving.model_name, gap_s, num_new_tokens)
        if self._first_token_time is None:
            self._first_token_time = now
        self._last_token_time = now

    def _record(self) -> None:
        """Metrics and the request log line; a request left before any output counts as aborted."""
        output = self.last_output
        if output is None:
            finish_reasons = ["abort"] * self.sampling_params.n
            num_completion_tokens = 0
        else:
            finish_reasons = [choice.finish_reason or "abort" for choice in output.outputs]
            num_completion_tokens = sum(len(choice.token_ids) for choice in output.outputs)
        ttft_s = None if self._first_token_time is None else self._first_token_time - self._start_time
        e2e_s = (self._last_token_time or time.monotonic()) - self._start_time
        queue_s = None
        engine_metrics = output.metrics if output is not None else None
        if engine_metrics is not None and engine_metrics.first_scheduled_time is not None:
            queue_s = max(0.0, engine_metrics.first_scheduled_time - engine_metrics.arrival_time)
        self.serving.metrics.observe_finished(self.serving.model_name, ttft_s=ttft_s, e2e_s=e2e_s, queue_s=queue_s,
                                              finish_reasons=finish_reasons)
        if not self.serving.settings.log_requests:
            return
        num_tokens_per_choice = num_completion_tokens / max(1, len(finish_reasons))
        tpot_s = None
        if self._first_token_time is not None and num_tokens_per_choice > 1:
            tpot_s = (self._last_token_time - self._first_token_time) / (num_tokens_per_choice - 1)
        spec = ""
        if engine_metrics is not None and engine_metrics.spec_num_drafts:
            spec = (f" spec_drafts={engine_metrics.spec_num_drafts}"
                    f" spec_draft_tokens={engine_metrics.spec_num_draft_tokens}"
                    f" spec_accepted_tokens={engine_metrics.spec_num_accepted_tokens}")
        request_logger.info(
            "request_id=%s prompt_tokens=%d completion_tokens=%d ttft_s=%s tpot_s=%s finish_reason=%s%s params=%s",
            self.request_id, len(self.prompt_ids), num_completion_tokens, _seconds(ttft_s), _seconds(tpot_s),
            ",".join(finish_reasons), spec, self.params_summary)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


class Job:
    """The engine streams of one HTTP request (one per prompt) and its admission ticket."""

    def __init__(self, ticket: Ticket, streams: list[EngineStream], lease: ModelLease | None = None):
        self.ticket = ticket
        self.streams = streams
        self.lease = lease
        self._tasks: list[asyncio.Task] = []
        self._is_closed = False

    async def first_outputs(self) -> list[RequestOutput | None]:
        """Starts every stream; engine errors for bad input surface here, before any byte is sent."""
        return await self._all(stream.next_output() for stream in self.streams)

    async def final_outputs(self) -> list[RequestOutput | None]:
        async def drain(stream: EngineStream) -> RequestOutput | None:
            async for _ in stream:
                pass
            return stream.last_output
        return await self._all(drain(stream) for stream in self.streams)

    async def _all(self, coroutines) -> list:
        self._tasks = [asyncio.ensure_future(coroutine) for coroutine in coroutines]
        try:
            await asyncio.wait(self._tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in self._tasks:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise task.exception()
            return [task.result() for task in self._tasks]
        finally:
            await self._cancel_tasks()

    async def rest(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(stream index, output) for every output after the first ones, interleaved as they come."""
        if len(self.streams) == 1:
            async for output in self.streams[0]:
                yield 0, output
            return
        queue: asyncio.Queue = asyncio.Queue()
        end = object()

        async def pump(index: int, stream: EngineStream) -> None:
            try:
                async for output in stream:
                    await queue.put((index, output))
                await queue.put((index, end))
            except Exception as exc:  # handed to the consumer, which turns it into an SSE error event
                await queue.put((index, exc))

        self._tasks = [asyncio.ensure_future(pump(index, stream)) for index, stream in enumerate(self.streams)]
        try:
            num_open = len(self.streams)
            while num_open:
                index, item = await queue.get()
                if item is end:
                    num_open -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield index, item
        finally:
            await self._cancel_tasks()

    async def _cancel_tasks(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def close(self) -> None:
        """Aborts unfinished engine requests and frees the admission slot; safe to call twice."""
        if self._is_closed:
            return
        self._is_closed = True
        try:
            await self._cancel_tasks()
            for stream in self.streams:
                await stream.aclose()
        finally:
            self.ticket.release()
            if self.lease is not None:
                self.lease.release()


class StreamedResponse(StreamingResponse):
    """A streamed answer (SSE, or Ollama's NDJSON) that always closes its job (aborting engine
    work and releasing its model), even if never iterated."""

    def __init__(self, content: AsyncIterator[str], job: Job, media_type: str = "text/event-stream"):
        super().__init__(content, media_type=media_type,
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._job = job

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self._job.close()
