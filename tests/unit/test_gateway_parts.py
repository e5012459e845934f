"""Unit tests of the gateway's pure parts: frames, key store, limits, routing, backoff."""

from __future__ import annotations

import asyncio
import random
import sqlite3
from dataclasses import dataclass

import pytest

from tokios.errors import InvalidRequestError, OverloadedError
from tokios.gateway import protocol
from tokios.gateway.connector import backoff_delay_s, gateway_connect_url
from tokios.gateway.keys import KIND_CLIENT, KIND_CONNECTOR, KeyStore
from tokios.gateway.limits import KeyLimiter
from tokios.gateway.protocol import FrameKind
from tokios.gateway.router import BackendRouter

# ---- frames --------------------------------------------------------------------------------


def test_frames_round_trip_and_pack_into_one_message():
    head = protocol.encode_json(FrameKind.REQUEST_HEAD, 7, {"method": "POST", "path": "/v1/completions"})
    body = bytes(range(256)) * 200  # 51,200 bytes -> 4 chunks
    chunks = list(protocol.encode_body(7, body))
    assert [len(c) - 9 for c in chunks] == [16384, 16384, 16384, 2048]
    frames = protocol.decode(head + chunks[0]) + [f for c in chunks[1:] for f in protocol.decode(c)]
    assert frames[0].kind is FrameKind.REQUEST_HEAD and frames[0].stream_id == 7
    assert frames[0].json() == {"method": "POST", "path": "/v1/completions"}
    assert b"".join(f.payload for f in frames[1:]) == body


@pytest.mark.parametrize(
    "message",
    [b"", b"\x05\x00", b"\x63" + b"\x00" * 8, b"\x05\x00\x00\x00\x01\x00\x00\x00\x09abc", "text"],
)
def test_malformed_messages_are_refused(message):
    with pytest.raises(InvalidRequestError):
        protocol.decode(message)


def test_oversized_payload_is_refused_at_encode():
    with pytest.raises(InvalidRequestError, match="at most 16384"):
        protocol.encode(FrameKind.BODY, 1, b"x" * (protocol.MAX_PAYLOAD_BYTES + 1))


def test_writer_packs_waiting_frames_and_stops_at_marker():
    async def scenario():
        outbox: asyncio.Queue = asyncio.Queue()
        frames = [protocol.encode(FrameKind.BODY, i, b"x" * 10) for i in range(1, 6)]
        for frame in frames:
            outbox.put_nowait(frame)
        outbox.put_nowait(None)
        outbox.put_nowait(protocol.encode(FrameKind.BODY, 99))  # after the marker: never sent
        sent: list[bytes] = []

        async def send(data: bytes) -> None:
            sent.append(data)

        await protocol.write_batches(outbox, send)
        return sent

    sent = asyncio.run(scenario())
    assert len(sent) == 1
    assert [f.stream_id for f in protocol.decode(sent[0])] == [1, 2, 3, 4, 5]


# ---- keys ----------------------------------------------------------------------------------


def test_keys_are_stored_as_digests_and_verified(tmp_path):
    store = KeyStore(tmp_path / "keys.db")
    record, secret = store.create(KIND_CLIENT, "app", models=["m1"], max_requests_per_minute=5)
    assert secret.startswith("tk-" + record.key_id + ".")
    assert store.verify(secret, KIND_CLIENT) == record
    assert store.verify(secret, KIND_CONNECTOR) is None  # a client key is not a connector token
    assert store.verify(secret[:-1] + ("A" if secret[-1] != "A" else "B"), KIND_CLIENT) is None
    assert store.verify("tk-000000000000.nope", KIND_CLIENT) is None
    assert store.verify(None, KIND_CLIENT) is None
    assert record.can_use_model("m1") and not record.can_use_model("m2")
    rows = sqlite3.connect(tmp_path / "keys.db").execute("SELECT * FROM keys").fetchall()
    assert secret not in repr(rows) and secret.split(".")[1] not in (tmp_path / "keys.db").read_bytes().decode("latin-1")


def test_revoked_key_stops_verifying_in_another_connection(tmp_path):
    gateway_view = KeyStore(tmp_path / "keys.db")
    cli_view = KeyStore(tmp_path / "keys.db")
    record, secret = cli_view.create(KIND_CONNECTOR)
    assert gateway_view.verify(secret, KIND_CONNECTOR) is not None
    assert cli_view.revoke(record.key_id) is True
    assert cli_view.revoke(record.key_id) is False
    assert gateway_view.verify(secret, KIND_CONNECTOR) is None
    assert [r.is_revoked for r in gateway_view.list()] == [True]


@pytest.mark.parametrize("field", ["max_requests_per_minute", "max_tokens_per_minute", "max_concurrent"])
def test_key_limits_must_be_positive(tmp_path, field):
    with pytest.raises(InvalidRequestError, match=field):
        KeyStore(tmp_path / "keys.db").create(KIND_CLIENT, **{field: 0})


# ---- limits --------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _key(tmp_path, **limits):
    return KeyStore(tmp_path / "keys.db").create(KIND_CLIENT, **limits)[0]


def test_requests_per_minute_refuses_the_next_one_with_retry_after(tmp_path):
    clock = FakeClock()
    limiter = KeyLimiter(clock)
    key = _key(tmp_path, max_requests_per_minute=3)
    for _ in range(3):
        limiter.admit(key)
        limiter.release(key, 0)
        clock.now += 10
    with pytest.raises(OverloadedError) as refused:
        limiter.admit(key)
    assert refused.value.status == 429 and refused.value.retry_after_s == 30.0  # first request + 60 s
    clock.now += 30
    limiter.admit(key)  # the first request left the window


def test_concurrency_and_tokens_per_minute(tmp_path):
    clock = FakeClock()
    limiter = KeyLimiter(clock)
    key = _key(tmp_path, max_concurrent=2, max_tokens_per_minute=100)
    limiter.admit(key)
    limiter.admit(key)
    with pytest.raises(OverloadedError, match="2 concurrent"):
        limiter.admit(key)
    limiter.release(key, 60)
    limiter.release(key, 50)
    with pytest.raises(OverloadedError, match="100 tokens per minute"):
        limiter.admit(key)
    clock.now += 61
    limiter.admit(key)


# ---- routing -------------------------------------------------------------------------------


@dataclass
class FakeBackend:
    backend_id: str
    models: tuple[str, ...] = ("m",)
    num_in_flight: int = 0
    is_draining: bool = False


def test_least_in_flight_then_exclude_then_draining():
    router = BackendRouter()
    a, b, c = FakeBackend("a", num_in_flight=3), FakeBackend("b", num_in_flight=1), FakeBackend("c", ("other",))
    for backend in (a, b, c):
        router.add(backend)
    assert router.pick("m") is b
    assert router.pick("m", exclude=["b"]) is a
    assert router.pick("missing") is None
    b.is_draining = True
    assert router.pick("m") is a
    assert router.models() == ["m", "other"]


def test_session_affinity_sticks_until_the_backend_is_gone():
    router = BackendRouter()
    a, b = FakeBackend("a"), FakeBackend("b", num_in_flight=5)
    router.add(a)
    router.add(b)
    assert router.pick("m", session_id="s1") is a
    a.num_in_flight = 10  # busier now, but the session stays
    assert router.pick("m", session_id="s1") is a
    router.remove(a)
    assert router.pick("m", session_id="s1") is b


def test_a_pinned_key_routes_to_its_backend_and_forgets_the_oldest_past_the_bound():
    router = BackendRouter(max_sessions=2)
    a, b = FakeBackend("a", num_in_flight=9), FakeBackend("b")
    router.add(a)
    router.add(b)
    router.pin("response:r1", "a")
    assert router.pinned_backend("response:r1") is a
    assert router.pick("m", session_id="response:r1") is a  # busier, but it holds the response
    router.pin("response:r2", "b")
    router.pin("response:r3", "b")
    assert router.pinned_backend("response:r1") is None  # the least recently used key went
    router.remove(b)
    assert router.pinned_backend("response:r3") is None  # its backend left


def test_repeated_failures_set_a_backend_aside_for_the_cool_down():
    clock = FakeClock()
    router = BackendRouter(max_consecutive_failures=3, cool_down_s=30, clock=clock)
    a, b = FakeBackend("a"), FakeBackend("b", num_in_flight=4)
    router.add(a)
    router.add(b)
    for _ in range(3):
        router.record_failure("a")
    assert router.is_cooling("a") and router.pick("m") is b
    router.remove(b)
    assert router.pick("m") is a  # cooling beats nothing at all
    router.add(b)
    clock.now += 31
    assert router.pick("m") is a


def test_reregistered_backend_is_not_removed_by_its_stale_link():
    router = BackendRouter()
    old, new = FakeBackend("a"), FakeBackend("a")
    router.add(old)
    assert router.add(new) is old
    router.remove(old)
    assert router.backends == [new]


# ---- connector helpers ---------------------------------------------------------------------


def test_backoff_grows_to_the_cap_with_jitter():
    rng = random.Random(0)
    delays = [backoff_delay_s(n, 0.5, 8.0, rng) for n in range(12)]
    assert all(0.25 <= d <= 8.0 for d in delays)
    assert delays[0] <= 0.5 and min(delays[6:]) >= 4.0
    assert len({round(d, 6) for d in delays[6:]}) == 6  # jittered, not lockstep


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://127.0.0.1:8080", "ws://127.0.0.1:8080/v1/connect"),
        ("https://gw.example.com/", "wss://gw.example.com/v1/connect"),
        ("wss://gw.example.com/v1/connect", "wss://gw.example.com/v1/connect"),
    ],
)
def test_gateway_connect_url(url, expected):
    assert gateway_connect_url(url) == expected


def test_gateway_connect_url_refuses_other_schemes():
    with pytest.raises(InvalidRequestError, match="gateway URL"):
        gateway_connect_url("ftp://x")
