"""What travels between the front process and the ranks, one typed message at a time.

Front -> every rank: WorkerSpec (worker.py; once, after Hello), Step (once per model forward),
CopyBlocks (copy-on-write of KV blocks), GetTimings, Shutdown. Rank -> front: Hello (on
connecting), Ready (model loaded), StepResult (the output rank only: the last stage's
final-normed hidden states), RankFailed (any rank, on an exception, before it exits),
RankTimings (every rank, answering GetTimings). Tensors travel on the CPU as numpy arrays; a rank
moves them to its device.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import socket
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Hello:
    rank: int
    pid: int
    host: str
    plan: Any  # the ParallelPlan the rank was started for


@dataclass
class Ready:
    rank: int
    weight_bytes: int
    weight_summary: str
    has_decode_attention_kernel: bool
    kv_cache_bytes: int


@dataclass
class Step:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: Any  # AttentionMetadata
    num_layers: int | None  # run only the model's first layers (speculative self-draft)

    def on(self, device: torch.device) -> "Step":
        """This step with every tensor on `device` (itself when they are all on the CPU already
        and the device is the CPU: the front builds them there)."""
        if device.type == "cpu" and self.input_ids.device.type == "cpu":
            return self
        return map_tensors(self, lambda tensor: tensor.to(device))


@dataclass
class CopyBlocks:
    copies: list[tuple[int, int]]  # (source block id, destination block id)


@dataclass
class Shutdown:
    pass


@dataclass
class GetTimings:
    """Every rank answers with its RankTimings (benchmarks; between steps only)."""


@dataclass
class RankTimings:
    """Cumulative since the rank started: where its steps' time went."""

    rank: int
    num_steps: int = 0
    step_s: float = 0.0  # from the Step's arrival to the rank's last send
    all_reduce_s: float = 0.0  # inside tensor-parallel all-reduces
    num_all_reduces: int = 0
    receive_s: float = 0.0  # waiting for the previous stage's hidden states
    send_s: float = 0.0  # handing hidden states to the next stage or the front


@dataclass
class StepResult:
    hidden: torch.Tensor  # [num_tokens, hidden], final-normed


@dataclass
class RankFailed:
    rank: int
    error: str  # one line: the exception's type and message
    details: str  # the traceback, for the front's log


def _tensor_from_array(array, dtype: torch.dtype) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    return tensor.view(dtype) if dtype == torch.bfloat16 else tensor


class _Pickler(pickle.Pickler):
    # CPU tensors travel as numpy arrays: torch's own reduction costs ~50 us a tensor, and a
    # Step carries several (measured: a decode Step 0.35 ms to encode that way, 0.04 ms so).
    def reducer_override(self, value):
        if isinstance(value, torch.Tensor) and value.device.type == "cpu" and not value.requires_grad:
            plain = value.view(torch.int16) if value.dtype == torch.bfloat16 else value
            return _tensor_from_array, (plain.contiguous().numpy(), value.dtype)
        return NotImplemented


def encode(message) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
    return buffer.getvalue()


def tune_connection(connection) -> None:
    """TCP settings of a front-rank connection. Nagle off: multiprocessing writes a message over
    16 KiB as header then body, and Nagle holding the body for the peer's delayed ACK cost 40 ms
    a step (measured: a batch-8 hidden state is 18 KiB). Keepalives on: a peer whose machine
    vanishes without a reset is noticed within about 25 s instead of never."""
    sock = socket.socket(fileno=os.dup(connection.fileno()))
    try:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for option, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
                if hasattr(socket, option):
                    sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    finally:
        sock.close()


def decode(payload: bytes):
    return pickle.loads(payload)


def map_tensors(value, convert, _memo: dict | None = None):
    """`value` with every tensor inside (dataclasses, lists, tuples, dicts) replaced by
    convert(tensor); shared objects stay shared (AttentionMetadata lists itself among its groups)."""
    memo = {} if _memo is None else _memo
    if isinstance(value, torch.Tensor):
        return convert(value)
    if id(value) in memo:
        return memo[id(value)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        copy = dataclasses.replace(value)  # shallow, registered before its fields so cycles close
        memo[id(value)] = copy
        for field in dataclasses.fields(value):
            setattr(copy, field.name, map_tensors(getattr(value, field.name), convert, memo))
        return copy
    if isinstance(value, list):
        copy_list: list = []
        memo[id(value)] = copy_list
        copy_list.extend(map_tensors(item, convert, memo) for item in value)
        return copy_list
    if isinstance(value, tuple):
        return tuple(map_tensors(item, convert, memo) for item in value)
    if isinstance(value, dict):
        return {key: map_tensors(item, convert, memo) for key, item in value.items()}
    return value
