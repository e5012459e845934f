"""What travels between the front process and the ranks, one typed message at a time.

Front -> every rank: WorkerSpec (worker.py; once, after Hello), Step (once per model forward), CopyBlocks (copy-on-write of KV blocks),
Shutdown. Rank -> front: Hello (on connecting), Ready (model loaded), StepResult (the output
rank only: the last stage's final-normed hidden states), RankFailed (any rank, on an exception,
before it exits). Tensors travel on the CPU; a rank moves them to its device.
"""

from __future__ import annotations

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
class StepResult:
    hidden: torch.Tensor  # [num_tokens, hidden], final-normed


@dataclass
class RankFailed:
    rank: int
    error: str  # one line: the exception's type and message
    details: str  # the traceback, for the front's log


def encode(message) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(payload: bytes):
    return pickle.loads(payload)
