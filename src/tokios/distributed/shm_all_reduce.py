"""All-reduce over shared memory for the tensor-parallel ranks of one machine's CPU.

Gloo's all-reduce goes through TCP sockets and thread wake-ups: about a millisecond per call
between two processes here whatever the size (docs/scale-out.md), and a decode step makes two per
layer. Ranks on the same machine can instead meet in one shared mapping: each rank copies its
partial product into its own slot, raises its sequence flag, waits (spinning, yielding the CPU)
until every rank's flag has reached the same call, and sums the slots itself in rank order, so
every rank computes the same bits. Two buffers alternate between calls: a rank can only write a
buffer again after every rank has raised its flag for the call in between, which each does only
after it has read that buffer. The flag is stored after the copy; x86's store order makes the
copy visible first (the CPU ranks of this engine run on x86 and, in CI, nowhere else).

The mapping is a file in /dev/shm that the first rank creates and unlinks once every rank has it
open, so nothing is left behind whatever happens to the processes. Tensors larger than a slot
(long prompt chunks) go through Gloo. A peer that stops answering raises after the group's timeout.
"""

from __future__ import annotations

import mmap
import os
import socket
import tempfile
import time

import numpy as np
import torch

FLAG_STRIDE_BYTES = 64  # one flag per cache line
DEFAULT_SLOT_BYTES = 4 << 20


class SharedMemoryAllReduce:
    def __init__(self, group, group_ranks: list[int], index: int, timeout_s: float,
                 slot_bytes: int = DEFAULT_SLOT_BYTES):
        import torch.distributed as dist

        self.num_ranks = len(group_ranks)
        self.index = index
        self.timeout_s = timeout_s
        self.slot_bytes = slot_bytes
        flags_bytes = self.num_ranks * FLAG_STRIDE_BYTES
        size = flags_bytes + 2 * self.num_ranks * slot_bytes
        path = [None]
        if index == 0:
            descriptor, path[0] = tempfile.mkstemp(prefix="tokios-allreduce-", dir="/dev/shm")
            os.ftruncate(descriptor, size)
            os.close(descriptor)
        dist.broadcast_object_list(path, src=group_ranks[0], group=group)
        descriptor = os.open(path[0], os.O_RDWR)
        try:
            self._mapping = mmap.mmap(descriptor, size)
        finally:
            os.close(descriptor)
        dist.barrier(group=group)
        if index == 0:
            os.unlink(path[0])
        self.flags = np.frombuffer(self._mapping, dtype=np.int64, count=flags_bytes // 8)[::FLAG_STRIDE_BYTES // 8]
        self.data = torch.frombuffer(self._mapping, dtype=torch.uint8, offset=flags_bytes,
                                     count=2 * self.num_ranks * slot_bytes)
        self.sequence = 0

    @staticmethod
    def usable(group, group_ranks: list[int], device: torch.device) -> bool:
        """Whether every rank of the group is on this machine's CPU and /dev/shm is there."""
        import torch.distributed as dist

        hosts: list = [None] * len(group_ranks)
        dist.all_gather_object(hosts, (socket.gethostname(), device.type, os.path.isdir("/dev/shm")), group=group)
        return all(host == hosts[0] for host in hosts) and hosts[0][1] == "cpu" and hosts[0][2]

    def _slot(self, buffer: int, rank: int, like: torch.Tensor) -> torch.Tensor:
        start = (buffer * self.num_ranks + rank) * self.slot_bytes
        nbytes = like.numel() * like.element_size()
        return self.data[start:start + nbytes].view(like.dtype).view(like.shape)

    def __call__(self, tensor: torch.Tensor) -> bool:
        """Sums `tensor` (contiguous) over the group in place; False (nothing done) when it does
        not fit a slot."""
        if tensor.numel() * tensor.element_size() > self.slot_bytes:
            return False
        self.sequence += 1
        sequence = self.sequence
        buffer = sequence & 1
        self._slot(buffer, self.index, tensor).copy_(tensor)
        self.flags[self.index] = sequence
        self._wait_for(sequence)
        tensor.copy_(self._slot(buffer, 0, tensor))
        for rank in range(1, self.num_ranks):
            tensor.add_(self._slot(buffer, rank, tensor))
        return True

    def _wait_for(self, sequence: int) -> None:
        flags = self.flags
        spins = 0
        deadline = None
        while (flags < sequence).any():
            spins += 1
            if spins & 63 == 0:
                os.sched_yield()
            if spins & 4095 == 0:
                now = time.monotonic()
                deadline = deadline or now + self.timeout_s
                if now > deadline:
                    raise TimeoutError(f"a tensor-parallel peer did not reach all-reduce {sequence} within "
                                       f"{self.timeout_s:g} s")
