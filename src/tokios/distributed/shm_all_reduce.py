"""All-reduce over shared memory for the tensor-parallel ranks of one machine's CPU.

Gloo's all-reduce goes through TCP sockets and thread wake-ups: about a millisecond per call
between two processes here whatever the size (docs/scale-out.md), and a decode step makes two per
layer. Ranks on the same machine can instead meet in one shared mapping: each rank copies its
partial product into its own slot, raises its sequence flag, waits (spinning, yielding the CPU)
until every rank's flag has reached the same call, and sums the slots itself in rank order, so
every rank computes the same bits. Two buffers alternate between calls: a rank can only write a
buffer again after every rank has raised its flag for the call in between, which each does only
after it has read that buffer. The flag is stored after the copy; x86's store order (TSO) makes
the copy visible first, so the mapping is used on x86 only; other CPUs sum through Gloo.

The mapping is a file in /dev/shm that the first rank creates and unlinks once every rank has it
open, so nothing is left behind whatever happens to the processes. Tensors larger than a slot
(long prompt chunks) go through Gloo. A peer that stops answering raises after the group's timeout.
"""

from __future__ import annotations

import mmap
import os
import platform
import socket
import tempfile
import threading
import time

import numpy as np
import torch

FLAG_STRIDE_BYTES = 64  # one flag per cache line
DEFAULT_SLOT_BYTES = 4 << 20
# The flag protocol relies on x86's store order (TSO); elsewhere the ranks sum through Gloo.
X86_MACHINES = ("x86_64", "AMD64", "amd64")


class SharedMemoryAllReduce:
    def __init__(self, mapping: mmap.mmap, num_ranks: int, index: int, timeout_s: float, slot_bytes: int):
        self._mapping = mapping
        self.num_ranks = num_ranks
        self.index = index
        self.timeout_s = timeout_s
        self.slot_bytes = slot_bytes
        flags_bytes = num_ranks * FLAG_STRIDE_BYTES
        self.flags = np.frombuffer(mapping, dtype=np.int64, count=flags_bytes // 8)[::FLAG_STRIDE_BYTES // 8]
        self.data = torch.frombuffer(mapping, dtype=torch.uint8, offset=flags_bytes, count=2 * num_ranks * slot_bytes)
        self.sequence = 0
        self._fence = threading.Lock()

    @classmethod
    def create(cls, group, group_ranks: list[int], index: int, device: torch.device, timeout_s: float,
               slot_bytes: int = DEFAULT_SLOT_BYTES) -> "SharedMemoryAllReduce | None":
        """The group's shared mapping, or None (then Gloo sums) unless every rank is on this
        machine's x86 CPU and could map it. Collective: every rank of the group calls it."""
        import torch.distributed as dist

        num_ranks = len(group_ranks)
        here = (socket.gethostname(), device.type, platform.machine())
        hosts: list = [None] * num_ranks
        dist.all_gather_object(hosts, here, group=group)
        if any(host != hosts[0] for host in hosts) or device.type != "cpu" or here[2] not in X86_MACHINES:
            return None
        size = num_ranks * FLAG_STRIDE_BYTES + 2 * num_ranks * slot_bytes
        path = [None]
        if index == 0:
            try:
                descriptor, path[0] = tempfile.mkstemp(prefix="tokios-allreduce-", dir="/dev/shm")
                try:
                    os.posix_fallocate(descriptor, 0, size)  # a full /dev/shm fails here, not as SIGBUS later
                finally:
                    os.close(descriptor)
            except OSError:
                if path[0] is not None:
                    os.unlink(path[0])
                path[0] = None
        dist.broadcast_object_list(path, src=group_ranks[0], group=group)
        mapping = None
        try:
            if path[0] is not None:
                descriptor = os.open(path[0], os.O_RDWR)
                try:
                    mapping = mmap.mmap(descriptor, size)
                finally:
                    os.close(descriptor)
        except OSError:
            mapping = None  # another IPC namespace under the same host name: Gloo it is
        finally:
            mapped: list = [None] * num_ranks
            dist.all_gather_object(mapped, mapping is not None, group=group)
            if index == 0 and path[0] is not None:
                os.unlink(path[0])  # every rank has it mapped (or gave up): nothing is left behind
        if not all(mapped):
            return None
        return cls(mapping, num_ranks, index, timeout_s, slot_bytes)

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
        # A locked instruction (an uncontended lock's atomics) orders the copy's stores before
        # the flag's, non-temporal ones included (a large copy may use them).
        with self._fence:
            pass
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
