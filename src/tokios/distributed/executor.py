"""The front process's side of a parallel group: starts the ranks, hands each step to them, and
turns a rank's failure into one error.

DistributedModel stands where a model stands for the runner (forward, compute_logits): forward
sends one Step to every rank and waits for the output rank's hidden states, watching every rank
while it waits, so a rank that exits, drops its connection or reports an exception ends the step
with RankFailedError instead of a hang; the engine then fails every request and the server exits
(docs/reliability.md). The output head (and so the logits, the sampler and everything after)
stays here. Ranks of this machine are spawned; ranks of other machines connect to the same
address (`tokios worker`), authenticated with the group's key.
"""

from __future__ import annotations

import logging
import os
import pickle
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Listener, wait

import torch

from tokios.config import ParallelConfig
from tokios.distributed import messages
from tokios.distributed.plan import ParallelPlan
from tokios.distributed.worker import RankLaunch, WorkerSpec
from tokios.errors import TokiosError
from tokios.model.protocol import Model
from tokios.platform import physical_core_count

logger = logging.getLogger("tokios.distributed")

KEY_ENVIRONMENT_VARIABLE = "TOKIOS_DIST_KEY"


class RankFailedError(TokiosError):
    """A rank of the parallel group died or raised: the group's state is gone."""


def lost_rank_error(why: str) -> RankFailedError:
    return RankFailedError(f"the parallel group lost a rank: {why}", code="rank_failed")


def group_key(nnodes: int) -> bytes:
    """The key every rank proves it holds when it connects: random for one machine, from
    $TOKIOS_DIST_KEY (the same on every machine) for several."""
    value = os.environ.get(KEY_ENVIRONMENT_VARIABLE)
    if value:
        return value.encode()
    if nnodes > 1:
        raise TokiosError(f"a parallel group over {nnodes} machines needs the same ${KEY_ENVIRONMENT_VARIABLE} on "
                          "each (a long random string, e.g. from `openssl rand -hex 32`): ranks authenticate to "
                          "the front with it", code="no_group_key")
    return secrets.token_bytes(32)


def free_port_pair(host: str) -> int:
    """A port p with p and p + 1 both free here (rendezvous, listener)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
        if port < 65535:
            try:
                with socket.socket() as second:
                    second.bind((host, port + 1))
                return port
            except OSError:
                continue
    raise TokiosError("no free pair of ports for the parallel group's rendezvous", code="no_free_port")


def rank_threads(ranks_here: int) -> int:
    """CPU threads of each of this machine's ranks: its physical cores, shared."""
    return max(1, physical_core_count() // ranks_here)


# How long a broken connection or a failed rank waits for a local rank's exit to show: a death is
# seen first as closed sockets and as its peers' failed collectives, the exit status a moment later.
RANK_EXIT_SETTLE_SECONDS = 2.0


class RankProcess:
    """A rank of this machine: `python -m tokios.distributed.worker`, its RankLaunch on stdin.
    A process of its own, not a multiprocessing child: spawning would re-import the caller's
    main module, which a script without a main guard cannot survive. `sentinel` (a pidfd) turns
    readable when the process exits, so waits can watch it next to the ranks' connections."""

    def __init__(self, popen: subprocess.Popen):
        self.popen = popen
        self.pid = popen.pid
        self.sentinel = os.pidfd_open(popen.pid)

    @classmethod
    def start(cls, launch: RankLaunch, loopback_only: bool = False) -> "RankProcess":
        environment = dict(os.environ)
        if loopback_only and os.path.exists("/sys/class/net/lo"):
            environment["GLOO_SOCKET_IFNAME"] = "lo"
        popen = subprocess.Popen([sys.executable, "-m", "tokios.distributed.worker"], stdin=subprocess.PIPE,
                                 close_fds=True, env=environment)
        try:
            popen.stdin.write(pickle.dumps(launch))
            popen.stdin.close()
            return cls(popen)
        except BaseException:
            popen.kill()
            popen.wait()
            raise

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def kill(self) -> None:
        self.popen.kill()

    def close(self) -> None:
        """Release the pidfd (after the process has exited and nobody waits on it)."""
        if self.sentinel is not None:
            os.close(self.sentinel)
            self.sentinel = None

    def join(self, timeout: float) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


class DistributedModel(Model):
    holds_kv_cache = True  # the runner allocates no cache: the ranks hold it

    def __init__(self, head_model, config, *, model_path: str, weight_format: str,
                 device: torch.device, num_threads: int | None, num_slots: int, block_size: int,
                 kv_dtype: torch.dtype, group: ParallelConfig, start_timeout_s: float = 600.0):
        """group: the sizes, where the group meets (the rendezvous at master_addr:master_port, this
        front's listener one port above) and this machine's place in it."""
        self.plan = plan = ParallelPlan.of(group)
        plan.check(config)
        self.head = head_model
        self.device = device
        self._closed = self._terminated = False
        self._watcher: threading.Thread | None = None
        self._stop_watch = os.pipe()  # written at the end, so the watcher thread leaves
        self.failure: RankFailedError | None = None
        self.send_s = 0.0  # cumulative: encoding and sending Step messages (benchmarks)
        port = group.master_port or free_port_pair(group.master_addr)
        key = group_key(group.nnodes)
        try:
            self._listener = Listener((group.master_addr, port + 1), authkey=key)
        except OSError as exc:
            raise TokiosError(f"the parallel group's front cannot listen on {group.master_addr}:{port + 1} "
                              f"(--master-port + 1): {exc.strerror}", code="bad_parallel_layout") from None
        self._store_directory = None
        if group.nnodes == 1:
            # One machine: the rendezvous is a file only this user can reach (torch's TCP store
            # would listen on every interface), and the ranks' Gloo sockets stay on loopback.
            self._store_directory = tempfile.mkdtemp(prefix="tokios-group-")
            init_method = f"file://{self._store_directory}/store"
        else:
            init_method = f"tcp://{group.master_addr}:{port}"
        local_ranks = group.local_ranks
        threads = num_threads or rank_threads(len(local_ranks))
        self.processes: dict[int, RankProcess] = {}
        self.connections: dict[int, object] = {}
        self._spec = WorkerSpec(model_path=model_path, weight_format=weight_format, device=device.type,
                                num_slots=num_slots, block_size=block_size, kv_dtype=kv_dtype,
                                init_method=init_method, timeout_s=group.timeout_s, model_config=config)
        try:
            for index, rank in enumerate(local_ranks):
                self.processes[rank] = RankProcess.start(
                    RankLaunch(rank, plan, (group.master_addr, port + 1), key, threads, local_index=index),
                    loopback_only=group.nnodes == 1)
            logger.info("parallel group: tensor %d x pipeline %d = %d ranks, %d here (pids %s); rendezvous %s",
                        plan.tensor_parallel_size, plan.pipeline_parallel_size, plan.world_size, len(local_ranks),
                        ", ".join(str(p.pid) for p in self.processes.values()), init_method)
            self.connections = self._accept_ranks(start_timeout_s)
            self._listener.close()  # every rank is in; nobody else may connect
            ready = self._await_ready(start_timeout_s)
        except BaseException:
            self._terminate()
            raise
        self._ready = ready
        self.has_decode_attention_kernel = all(r.has_decode_attention_kernel for r in ready.values())
        self._output = self.connections[plan.output_rank]
        for rank in sorted(ready):
            logger.info("rank %d: layers %s, %s; KV cache %.1f MiB", rank,
                        plan.part_of(rank, config.num_layers).layers, ready[rank].weight_summary,
                        ready[rank].kv_cache_bytes / 2**20)

    # ---- start ---------------------------------------------------------------------------------
    def _accept_ranks(self, timeout_s: float) -> dict:
        connections: dict[int, object] = {}
        accepted: list = []

        def accept_all():
            while len(accepted) < self.plan.world_size:
                try:
                    connection = self._listener.accept()
                except (AuthenticationError, EOFError) as exc:
                    # A stray or misconfigured client must not end the wait for the real ranks.
                    logger.warning("a connection to the parallel group's front failed to authenticate (%s); "
                                   "check that every machine has the same $%s", exc, KEY_ENVIRONMENT_VARIABLE)
                    continue
                except OSError:
                    return
                messages.tune_connection(connection)
                accepted.append(connection)

        acceptor = threading.Thread(target=accept_all, daemon=True)
        acceptor.start()
        deadline = time.monotonic() + timeout_s
        while acceptor.is_alive() and time.monotonic() < deadline:
            self._check_local_processes()  # a rank that failed to start ends the wait at once
            acceptor.join(0.2)
        for connection in accepted:
            hello = messages.decode(connection.recv_bytes())
            problem = ("it was started for another group" if hello.plan != self.plan
                       else "another rank already has that number" if hello.rank in connections
                       else "" if 0 <= hello.rank < self.plan.world_size else "the group has no such rank")
            if problem:
                connection.close()
                raise RankFailedError(f"a rank from {hello.host} (pid {hello.pid}) joined as rank {hello.rank} of "
                                      f"tensor {hello.plan.tensor_parallel_size} x pipeline "
                                      f"{hello.plan.pipeline_parallel_size}, but {problem} (this group: tensor "
                                      f"{self.plan.tensor_parallel_size} x pipeline "
                                      f"{self.plan.pipeline_parallel_size}; check --nnodes and --node-rank)",
                                      code="rank_failed")
            connections[hello.rank] = connection
            connection.send_bytes(messages.encode(self._spec))
        if len(connections) < self.plan.world_size:
            missing = sorted(set(range(self.plan.world_size)) - set(connections))
            self._check_local_processes()
            raise RankFailedError(f"ranks {missing} did not connect within {timeout_s:g} s", code="rank_failed")
        return connections

    def _await_ready(self, timeout_s: float) -> dict:
        ready: dict[int, messages.Ready] = {}
        pending = dict(self.connections)
        while pending:
            sentinels = {p.sentinel: rank for rank, p in self.processes.items()}
            events = wait(list(pending.values()) + list(sentinels), timeout=timeout_s)
            if not events:
                raise RankFailedError(f"ranks {sorted(pending)} did not load within {timeout_s:g} s",
                                      code="rank_failed")
            for event in events:
                if event in sentinels:
                    self._check_local_processes()
                    continue
                rank = next(r for r, c in pending.items() if c is event)
                message = self._receive(rank, event)
                if not isinstance(message, messages.Ready):
                    raise RankFailedError(f"rank {rank} sent {type(message).__name__} before it was ready",
                                          code="rank_failed")
                ready[rank] = message
                del pending[rank]
        return ready

    # ---- the model interface (tokios.model.protocol.Model) -------------------------------------
    @property
    def is_closed(self) -> bool:
        return self._closed

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata, kv_caches,
                num_layers: int | None = None) -> torch.Tensor:
        step = messages.Step(input_ids, positions, metadata, num_layers).on(torch.device("cpu"))
        started = time.perf_counter()
        self._broadcast(step)
        self.send_s += time.perf_counter() - started
        return self._await_output().hidden.to(self.device)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.compute_logits(hidden)

    def rank_timings(self) -> list[messages.RankTimings]:
        """Every rank's cumulative timings (call between steps)."""
        self._broadcast(messages.GetTimings())
        timings = []
        for rank, connection in sorted(self.connections.items()):
            message = self._receive(rank, connection)
            if not isinstance(message, messages.RankTimings):
                self._fail(f"rank {rank} answered GetTimings with {type(message).__name__}")
            timings.append(message)
        return timings

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self._broadcast(messages.CopyBlocks(copies))

    def weight_bytes(self) -> int:
        return self.head.weight_bytes() + sum(r.weight_bytes for r in self._ready.values())

    def weight_summary(self) -> str:
        return (f"{self.plan.world_size} ranks (tensor {self.plan.tensor_parallel_size} x pipeline "
                f"{self.plan.pipeline_parallel_size}); output head here: {self.head.weight_summary()}")

    # ---- messages ------------------------------------------------------------------------------
    def _broadcast(self, message) -> None:
        if self.failure is not None:
            raise self.failure
        payload = messages.encode(message)
        for rank, connection in self.connections.items():
            try:
                connection.send_bytes(payload)
            except OSError as exc:
                self._check_local_processes(settle=rank)  # its exit status says more than the socket
                self._fail(f"rank {rank} is gone: its connection failed ({exc})")

    def _await_output(self) -> messages.StepResult:
        """The output rank's result, watching every rank (and every local process) meanwhile."""
        by_connection = {id(c): rank for rank, c in self.connections.items()}
        sentinels = {p.sentinel: rank for rank, p in self.processes.items()}
        while True:
            for event in wait(list(self.connections.values()) + list(sentinels)):
                if event in sentinels:
                    self._check_local_processes()
                    continue
                rank = by_connection[id(event)]
                message = self._receive(rank, event)
                if isinstance(message, messages.StepResult) and event is self._output:
                    return message
                self._fail(f"rank {rank} sent an unexpected {type(message).__name__}")

    def _receive(self, rank: int, connection):
        try:
            message = messages.decode(connection.recv_bytes())
        except (EOFError, OSError):
            self._check_local_processes(settle=rank)
            self._fail(f"rank {rank} closed its connection (the process or its machine is gone)")
        if isinstance(message, messages.RankFailed):
            logger.error("rank %d failed:\n%s", rank, message.details)
            # A rank whose peer died fails in its collective (a reset connection), often before the
            # dead rank's exit is visible here; the death is the cause to report.
            self._fail(self._exit_of_another_rank(rank) or f"rank {rank} failed: {message.error}")
        return message

    def _lost_local_rank(self, besides: int | None = None) -> str | None:
        """Why the group is broken, if a rank of this machine (other than `besides`) has exited
        (any exit: ranks only leave when told to)."""
        for rank, process in self.processes.items():
            if rank != besides and process.exitcode is not None:
                return f"rank {rank} (pid {process.pid}) exited with status {process.exitcode}"
        return None

    def _exit_of_another_rank(self, reporter: int) -> str | None:
        """The exit of a local rank other than `reporter`, waiting a moment for one to show."""
        others = [p for r, p in self.processes.items() if r != reporter]
        if others and all(p.exitcode is None for p in others):
            wait([p.sentinel for p in others], timeout=RANK_EXIT_SETTLE_SECONDS)
        return self._lost_local_rank(besides=reporter)

    def _check_local_processes(self, settle: int | None = None) -> None:
        """Fail if a local rank has exited. `settle` names a rank whose connection just broke: the
        kernel closes a dying process's sockets before it becomes reapable, so give that process a
        moment to finish exiting and report its status rather than a bare closed connection."""
        if settle in self.processes:
            self.processes[settle].join(RANK_EXIT_SETTLE_SECONDS)
        why = self._lost_local_rank()
        if why is not None and not self._closed:
            self._fail(why)

    def _fail(self, why: str):
        if self.failure is None:
            self.failure = lost_rank_error(why)
            logger.error("%s; stopping the other ranks", self.failure.message)
            self._terminate()
        raise self.failure

    # ---- stop ----------------------------------------------------------------------------------
    def watch(self, on_failure) -> None:
        """Call on_failure(RankFailedError) from a thread when a local rank exits while no step is
        running (between steps nobody else would notice until the next request)."""
        sentinels = [p.sentinel for p in self.processes.values()]

        def watcher():
            wait(sentinels + [self._stop_watch[0]])
            why = self._lost_local_rank()
            # Only report: the engine thread may be using the connections; it stops the group.
            if why is not None and not self._closed and self.failure is None:
                on_failure(lost_rank_error(why))

        self._watcher = threading.Thread(target=watcher, name="tokios-rank-watch", daemon=True)
        self._watcher.start()

    def close(self) -> None:
        """Ask every rank to exit, wait a little, then end the stragglers."""
        if self._closed:
            return
        self._closed = True
        if self.failure is None:
            payload = messages.encode(messages.Shutdown())
            for connection in self.connections.values():
                try:
                    connection.send_bytes(payload)
                except OSError:
                    pass
            for process in self.processes.values():
                process.join(10)
        self._terminate()

    def _terminate(self) -> None:
        if self._terminated:
            return
        self._terminated = self._closed = True
        for process in self.processes.values():
            if process.exitcode is None:
                process.kill()
        for process in self.processes.values():
            process.join(5)
        os.write(self._stop_watch[1], b"x")
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(5)
        for process in self.processes.values():
            process.close()
        for descriptor in self._stop_watch:
            os.close(descriptor)
        for connection in self.connections.values():
            connection.close()
        self._listener.close()
        if self._store_directory is not None:
            shutil.rmtree(self._store_directory, ignore_errors=True)
