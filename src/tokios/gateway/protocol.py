"""The wire format between the gateway and a connector: small binary frames over one WebSocket.

Owns frame kinds, encoding and decoding; both ends (gateway/link.py and gateway/connector.py)
import it and nothing else of each other. Every frame is one WebSocket binary message:

    kind (1 byte) | stream_id (4 bytes) | payload length (4 bytes) | payload   (big endian)

A WebSocket binary message carries one or more whole frames: under load the writer packs the
frames that are waiting (up to MAX_MESSAGE_BYTES) into one message, because the per-message cost
of the WebSocket stack, not the bytes, is what a stream of tiny token deltas pays for.
Stream 0 is the control stream (hello, welcome, ping, drain). Heads, errors and control
payloads are UTF-8 JSON; body chunks are raw bytes. Bodies are cut into chunks of at most
MAX_PAYLOAD_BYTES so one large response never holds the shared connection for long and many
streams interleave fairly.
"""

from __future__ import annotations

import asyncio
import enum
import json
import struct
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterator

from tokios.errors import InvalidRequestError

PROTOCOL_VERSION = 1
MAX_PAYLOAD_BYTES = 16 * 1024
_HEADER = struct.Struct(">BII")
MAX_FRAME_BYTES = _HEADER.size + MAX_PAYLOAD_BYTES
MAX_MESSAGE_BYTES = 4 * MAX_FRAME_BYTES
CONTROL_STREAM_ID = 0
MAX_STREAM_ID = 2**32 - 1


class FrameKind(enum.IntEnum):
    HELLO = 1  # connector -> gateway: backend id, models, protocol version
    WELCOME = 2  # gateway -> connector: registration accepted, heartbeat settings
    REQUEST_HEAD = 3  # gateway -> connector: method, path, headers of a new stream
    RESPONSE_HEAD = 4  # connector -> gateway: status and headers from the backend
    BODY = 5  # either way: a chunk of the request or response body
    END = 6  # either way: this side's body is complete
    ERROR = 7  # connector -> gateway: the stream failed before END
    CANCEL = 8  # gateway -> connector: the client left, abort the backend request
    PING = 9  # either way, on stream 0: liveness
    DRAIN = 10  # connector -> gateway: route no new work here
    CACHE_EVENTS = 11  # connector -> gateway, on stream 0: prefix-cache blocks stored and dropped (--report-cache-events)


@dataclass(frozen=True)
class Frame:
    kind: FrameKind
    stream_id: int
    payload: bytes = b""

    def json(self) -> dict[str, Any]:
        """The payload as a JSON object (heads, errors, control frames)."""
        try:
            value = json.loads(self.payload) if self.payload else {}
        except ValueError as exc:
            raise InvalidRequestError(f"frame payload of {self.kind.name} is not JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise InvalidRequestError(f"frame payload of {self.kind.name} must be a JSON object")
        return value


def encode(kind: FrameKind, stream_id: int, payload: bytes = b"") -> bytes:
    if not 0 <= stream_id <= MAX_STREAM_ID:
        raise InvalidRequestError(f"stream_id must be in [0, {MAX_STREAM_ID}], got {stream_id}")
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise InvalidRequestError(
            f"frame payload must be at most {MAX_PAYLOAD_BYTES} bytes, got {len(payload)}"
        )
    return _HEADER.pack(int(kind), stream_id, len(payload)) + payload


def encode_json(kind: FrameKind, stream_id: int, value: dict[str, Any]) -> bytes:
    return encode(kind, stream_id, json.dumps(value, separators=(",", ":")).encode())


def encode_body(stream_id: int, body: bytes) -> Iterator[bytes]:
    """BODY frames for `body`, each at most MAX_PAYLOAD_BYTES of payload."""
    view = memoryview(body)
    for start in range(0, len(body), MAX_PAYLOAD_BYTES):
        yield encode(FrameKind.BODY, stream_id, bytes(view[start : start + MAX_PAYLOAD_BYTES]))


def decode(message: bytes | str) -> list[Frame]:
    """The frames of one WebSocket message, in order."""
    if isinstance(message, str):
        raise InvalidRequestError("frames must be binary WebSocket messages, got text")
    if len(message) > MAX_MESSAGE_BYTES:
        raise InvalidRequestError(f"a message must be at most {MAX_MESSAGE_BYTES} bytes, got {len(message)}")
    frames = []
    offset = 0
    while offset < len(message):
        if len(message) - offset < _HEADER.size:
            raise InvalidRequestError(f"frame header must be {_HEADER.size} bytes, got {len(message) - offset}")
        kind_value, stream_id, length = _HEADER.unpack_from(message, offset)
        offset += _HEADER.size
        if length > MAX_PAYLOAD_BYTES or offset + length > len(message):
            raise InvalidRequestError(
                f"frame payload length must be at most {MAX_PAYLOAD_BYTES} and within the message, got {length}"
            )
        try:
            kind = FrameKind(kind_value)
        except ValueError as exc:
            raise InvalidRequestError(
                f"frame kind must be one of {[k.value for k in FrameKind]}, got {kind_value}"
            ) from exc
        frames.append(Frame(kind, stream_id, bytes(message[offset : offset + length])))
        offset += length
    if not frames:
        raise InvalidRequestError("a message must hold at least one frame")
    return frames


async def write_batches(outbox: "asyncio.Queue[bytes | None]", send: Callable[[bytes], Awaitable[None]]) -> None:
    """Send queued frames until a None marker, packing whatever is already waiting into one message.

    `send` is the WebSocket's send; both ends' writers use this.
    """
    while True:
        data = await outbox.get()
        if data is None:
            return
        batch = [data]
        size = len(data)
        is_last = False
        while size < MAX_MESSAGE_BYTES - MAX_FRAME_BYTES:
            try:
                data = outbox.get_nowait()
            except asyncio.QueueEmpty:
                break
            if data is None:
                is_last = True
                break
            batch.append(data)
            size += len(data)
        await send(b"".join(batch) if len(batch) > 1 else batch[0])
        if is_last:
            return
