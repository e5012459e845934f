"""The gateway's end of one connector's WebSocket: many request streams over one connection.

Owns stream ids, the per-stream event queues, the single writer that serializes frames onto the
socket, heartbeats and the silence deadline. The gateway app (gateway/app.py) opens a stream per
client request and reads its events; the router (gateway/router.py) sees a link as a backend.
When the connection ends every open stream gets an ERROR event, so no reader waits forever.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from starlette.websockets import WebSocket

from tokios.errors import InvalidRequestError
from tokios.gateway import protocol
from tokios.gateway.protocol import Frame, FrameKind

logger = logging.getLogger("tokios.gateway")

_LOST_PAYLOAD = b'{"message":"the backend connection was lost","code":"backend_disconnected"}'


class LinkClosedError(Exception):
    """The link ended before the stream could be opened."""


class LinkStream:
    """One request's view of the link: send once, then read response events in order."""

    def __init__(self, link: "BackendLink", stream_id: int):
        self.link = link
        self.stream_id = stream_id
        self._events: asyncio.Queue[Frame] = asyncio.Queue()
        self.is_finished = False

    def deliver(self, frame: Frame) -> None:
        self._events.put_nowait(frame)

    async def next_event(self) -> Frame:
        """RESPONSE_HEAD, BODY, END or ERROR (ERROR also when the connection was lost)."""
        return await self._events.get()

    def next_event_nowait(self) -> Frame | None:
        """The next event if one has already arrived, else None."""
        try:
            return self._events.get_nowait()
        except asyncio.QueueEmpty:
            return None

    def cancel(self) -> None:
        """Tell the connector to abort this request. Synchronous: safe in `finally` of a cancelled task."""
        self.link.cancel(self)


class BackendLink:
    def __init__(
        self,
        websocket: WebSocket,
        backend_id: str,
        models: tuple[str, ...],
        *,
        heartbeat_s: float,
        dead_after_s: float,
        on_cache_events: Callable[["BackendLink", dict[str, Any]], None] = lambda link, payload: None,
    ):
        self.websocket = websocket
        self.on_cache_events = on_cache_events  # CACHE_EVENTS frames: (this link, payload)
        self.backend_id = backend_id
        self.models = models
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self.is_draining = False
        self.connected_at = time.time()
        self._is_closed = False
        self._next_stream_id = 1
        self._stream_id_to_stream: dict[int, LinkStream] = {}
        self._outbox: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._last_heard = time.monotonic()

    @property
    def num_in_flight(self) -> int:
        return len(self._stream_id_to_stream)

    def describe(self) -> dict[str, Any]:
        return {
            "backend_id": self.backend_id,
            "models": list(self.models),
            "num_in_flight": self.num_in_flight,
            "is_draining": self.is_draining,
            "connected_at": self.connected_at,
        }

    def open_stream(self, method: str, path: str, headers: dict[str, str], body: bytes) -> LinkStream:
        if self._is_closed:
            raise LinkClosedError(f"backend {self.backend_id} is disconnected")
        stream_id = self._next_stream_id
        self._next_stream_id = self._next_stream_id % protocol.MAX_STREAM_ID + 1
        stream = LinkStream(self, stream_id)
        self._stream_id_to_stream[stream_id] = stream
        self._outbox.put_nowait(
            protocol.encode_json(FrameKind.REQUEST_HEAD, stream_id, {"method": method, "path": path, "headers": headers})
        )
        for frame in protocol.encode_body(stream_id, body):
            self._outbox.put_nowait(frame)
        self._outbox.put_nowait(protocol.encode(FrameKind.END, stream_id))
        return stream

    def cancel(self, stream: LinkStream) -> None:
        if self._stream_id_to_stream.pop(stream.stream_id, None) is not None and not self._is_closed:
            self._outbox.put_nowait(protocol.encode(FrameKind.CANCEL, stream.stream_id))

    def close(self) -> None:
        """End the link from the gateway side (replaced by a re-register, or shutting down)."""
        self._outbox.put_nowait(None)

    async def run(self) -> None:
        """Serve the connection until it ends; then fail every open stream."""
        tasks = [
            asyncio.create_task(self._read_loop()),
            asyncio.create_task(self._write_loop()),
            asyncio.create_task(self._heartbeat_loop()),
        ]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._is_closed = True
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for stream in self._stream_id_to_stream.values():
                stream.deliver(Frame(FrameKind.ERROR, stream.stream_id, _LOST_PAYLOAD))
            self._stream_id_to_stream.clear()
            try:
                await self.websocket.close(code=1001)
            except Exception:  # already closed by the peer; nothing left to tell it
                pass

    async def _read_loop(self) -> None:
        while True:
            message = await self.websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            self._last_heard = time.monotonic()
            data = message.get("bytes")
            try:
                frames = protocol.decode(data if data is not None else message.get("text", ""))
            except Exception as exc:
                logger.warning("backend %s sent a bad frame (%s); closing its link", self.backend_id, exc)
                return
            for frame in frames:
                self._dispatch(frame)

    def _dispatch(self, frame: Frame) -> None:
        if frame.stream_id == protocol.CONTROL_STREAM_ID:
            if frame.kind is FrameKind.DRAIN:
                logger.info("backend %s is draining", self.backend_id)
                self.is_draining = True
            elif frame.kind is FrameKind.CACHE_EVENTS:
                try:
                    self.on_cache_events(self, frame.json())
                except InvalidRequestError as exc:  # a routing hint lost, not the link
                    logger.warning("backend %s sent bad cache events: %s", self.backend_id, exc.message)
            return
        stream = self._stream_id_to_stream.get(frame.stream_id)
        if stream is None:
            return  # a stream this side already cancelled; its late frames are dropped
        if frame.kind in (FrameKind.END, FrameKind.ERROR):
            del self._stream_id_to_stream[frame.stream_id]
            stream.is_finished = True
        if frame.kind in (FrameKind.RESPONSE_HEAD, FrameKind.BODY, FrameKind.END, FrameKind.ERROR):
            stream.deliver(frame)

    async def _write_loop(self) -> None:
        await protocol.write_batches(self._outbox, self.websocket.send_bytes)

    async def _heartbeat_loop(self) -> None:
        ping = protocol.encode(FrameKind.PING, protocol.CONTROL_STREAM_ID)
        while True:
            await asyncio.sleep(min(self.heartbeat_s, self.dead_after_s / 2))
            silent_s = time.monotonic() - self._last_heard
            if silent_s > self.dead_after_s:
                logger.warning("backend %s silent for %.0f s; closing its link", self.backend_id, silent_s)
                return
            self._outbox.put_nowait(ping)
