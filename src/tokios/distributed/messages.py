"""What travels between the front process and the ranks, one typed message at a time.

Front -> every rank: WorkerSpec (worker.py; once, after Hello), Step (once per model forward), CopyBlocks (copy-on-write of KV blocks),
Shutdown. Rank -> front: Hello (on connecting), Ready (model loaded), StepResult (the output
rank only: the last stage's final-normed hidden states), RankFailed (any rank, on an exception,
before it exits), RankTimings (every rank, answering GetTimings). Tensors travel on the CPU; a rank moves them to its device.
"""

from __future__ import annotations

import io
import os
import pickle
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
    metadata: Any  # AttentionMetadata, its tensors on the CPU
    num_layers: int | None  # run only the model's first layers (speculative self-draft)


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


def no_delay(connection) -> None:
    """Turn Nagle's algorithm off on a connection's TCP socket: multiprocessing writes a message
    over 16 KiB as header then body, and Nagle holding the body for the peer's delayed ACK cost
    40 ms a step (measured: a batch-8 hidden state is 18 KiB)."""
    import socket

    sock = socket.socket(fileno=os.dup(connection.fileno()))
    try:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    finally:
        sock.close()


def decode(payload: bytes):
    return pickle.loads(payload)
