"""One rank: joins the process group, builds its part of the model and its share of the KV cache,
then runs one forward per Step message until Shutdown (or until the front is gone).

A pipeline stage after the first receives its input hidden states from the previous stage's rank
of the same tensor-parallel index, and every stage but the last sends its output on; tensor
parallel ranks of a stage sum o_proj's and down's partial products with one all-reduce each.
Any exception is reported to the front as RankFailed (one line plus the traceback for its log),
then the rank exits non-zero; a collective whose peer died raises within the group's timeout.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing.connection import Client
from typing import Any

import torch

from tokios.distributed import messages
from tokios.distributed.plan import ParallelPlan
from tokios.distributed.shm_all_reduce import SharedMemoryAllReduce

# "1": tensor-parallel ranks of one machine sum through Gloo too (benchmarks compare the two).
GLOO_ONLY_ENVIRONMENT_VARIABLE = "TOKIOS_TP_GLOO_ONLY"
# A rank's exit status when its front went away without a word (the server was stopped or died).
FRONT_GONE_STATUS = 3


@dataclass(frozen=True)
class RankLaunch:
    """How a rank reaches its front: what a rank process is started with (on stdin, or from
    `tokios worker`'s flags). Everything else comes from the front as a WorkerSpec."""

    rank: int
    plan: ParallelPlan  # checked against the front's: both sides must mean the same group
    front_address: tuple[str, int]
    authkey: bytes
    num_threads: int
    model_path: str | None = None  # this machine's copy of the model, when not at the front's path
    connect_timeout_s: float = 300.0
    local_index: int = 0  # among this machine's ranks: its CUDA device


@dataclass(frozen=True)
class WorkerSpec:
    """What the front tells every rank after it connects."""

    model_path: str
    weight_format: str
    device: str  # "cpu" or "cuda"
    num_slots: int
    block_size: int
    kv_dtype: torch.dtype
    init_method: str  # tcp://HOST:PORT or file://PATH, the group's rendezvous
    timeout_s: float = 60.0
    model_config: Any = None  # the front's ModelConfig: every rank's file must describe the same model


class AllReducedLinear:
    """A row-parallel linear: this rank's input features times its weight columns, summed over
    the tensor-parallel group."""

    def __init__(self, linear, group, timings: messages.RankTimings, shared_memory=None):
        self.linear_shard = linear
        self.group = group
        self.timings = timings
        self.shared_memory = shared_memory  # a SharedMemoryAllReduce when the group shares a machine

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        partial_sums = getattr(self.linear_shard, "partial_sums", None)
        if partial_sums is not None:
            # A quantized o_proj or down sums its blocks exactly (exact_sums, quant_matmul.h):
            # the shards' float64 sums add exactly too, in any order, and one rounding to
            # float32 gives the single process's bits. Rounding each shard first would not: on
            # 8-bit activations a last-bit difference moves the next layer's quantization and,
            # on the default model, the greedy text.
            partial, dtype = partial_sums(x).contiguous(), torch.float32
        else:
            out = self.linear_shard(x)
            # bfloat16 partial sums are summed in float32: one rounding, as one process would have.
            partial = out.float().contiguous() if out.dtype == torch.bfloat16 else out.contiguous()
            dtype = out.dtype
        started = time.perf_counter()
        if self.shared_memory is None or not self.shared_memory(partial):
            dist.all_reduce(partial, group=self.group)
        self.timings.all_reduce_s += time.perf_counter() - started
        self.timings.num_all_reduces += 1
        return partial.to(dtype)

    def num_bytes(self) -> int:
        return self.linear_shard.num_bytes()

    @property
    def tensor_types(self):
        return getattr(self.linear_shard, "tensor_types", None)

    @property
    def weight(self):
        return self.linear_shard.weight


def connect_to_front(launch: RankLaunch):
    """The rank's connection to the front, retried while the front is not listening yet (a
    worker machine may start before the server)."""
    deadline = time.monotonic() + launch.connect_timeout_s
    while True:
        try:
            connection = Client(launch.front_address, authkey=launch.authkey)
            messages.tune_connection(connection)
            return connection
        except OSError:  # refused, unreachable for a moment: the server may not be up yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def run_worker(launch: RankLaunch) -> None:
    """A rank's process from start to exit (`python -m tokios.distributed.worker`)."""
    connection = connect_to_front(launch)
    try:
        connection.send_bytes(messages.encode(messages.Hello(launch.rank, os.getpid(), socket.gethostname(),
                                                             launch.plan)))
        spec = messages.decode(connection.recv_bytes())
        if launch.model_path is not None:
            spec = replace(spec, model_path=launch.model_path)
        Rank(launch, spec, connection).serve()
    except (EOFError, ConnectionError, BrokenPipeError):
        os._exit(FRONT_GONE_STATUS)  # nothing to report to
    except BaseException as exc:  # noqa: BLE001 - reported, then this rank exits
        try:
            connection.send_bytes(messages.encode(messages.RankFailed(
                launch.rank, f"{type(exc).__name__}: {exc}".splitlines()[0], traceback.format_exc())))
        except OSError:
            pass
        os._exit(1)
    os._exit(0)  # skip interpreter teardown: a process group torn down at exit can hang on a dead peer


def _shapes(config) -> dict:
    """What must agree between the front's model file and a rank's."""
    return {name: getattr(config, name) for name in
            ("architecture", "num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
             "head_dim", "vocab_size", "tie_word_embeddings", "layer_windows")}


class Rank:
    def __init__(self, launch: RankLaunch, spec: WorkerSpec, connection):
        import torch.distributed as dist

        from tokios.model.attention import allocate_kv_caches, distinct_cache_pairs
        from tokios.model.loader import build_model, read_model_file

        self.rank = rank = launch.rank
        self.spec = spec
        self.connection = connection
        plan = launch.plan
        torch.set_num_threads(launch.num_threads)
        if spec.device == "cuda":
            if launch.local_index >= torch.cuda.device_count():
                raise RuntimeError(f"rank {rank} is this machine's rank {launch.local_index}, but it has "
                                   f"{torch.cuda.device_count()} CUDA devices (one per rank)")
            torch.cuda.set_device(launch.local_index)
            self.device = torch.device("cuda", launch.local_index)
        else:
            self.device = torch.device("cpu")
        dist.init_process_group("nccl" if spec.device == "cuda" else "gloo", init_method=spec.init_method,
                                world_size=plan.world_size, rank=rank, timeout=timedelta(seconds=spec.timeout_s))
        tp = plan.tensor_parallel_size
        # Every rank creates every group, in the same order (torch.distributed's rule).
        groups = [dist.new_group([plan.rank_of(stage, t) for t in range(tp)]) if tp > 1 else None
                  for stage in range(plan.pipeline_parallel_size)]
        self.stage = plan.stage_of(rank)
        shared_memory = None
        if tp > 1 and os.environ.get(GLOO_ONLY_ENVIRONMENT_VARIABLE) != "1":
            # Before loading: its collectives must not wait out another rank's slower load.
            shared_memory = SharedMemoryAllReduce.create(groups[self.stage], [plan.rank_of(self.stage, t)
                                                                              for t in range(tp)],
                                                         plan.tp_rank_of(rank), self.device, spec.timeout_s)
        self.timings = messages.RankTimings(rank)
        config, weights, _ = read_model_file(spec.model_path, lambda config: plan.part_of(rank, config.num_layers),
                                             spec.model_config.max_model_len if spec.model_config else None)
        if spec.model_config is not None and _shapes(config) != _shapes(spec.model_config):
            raise RuntimeError(f"rank {rank}'s model file {spec.model_path} is not the server's model: "
                               f"{_shapes(config)} here, {_shapes(spec.model_config)} there")
        self.part = plan.part_of(rank, config.num_layers)
        weights = plan.shard_weights(weights, config, rank, spec.weight_format)
        self.local_config = plan.local_config(config)
        self.model = build_model(spec.model_path, self.local_config, weights, spec.weight_format, self.device,
                                 self.part)
        del weights
        if tp > 1:
            for layer in self.model.layers:
                layer.o_proj = AllReducedLinear(layer.o_proj, groups[self.stage], self.timings, shared_memory)
                # the dense feed-forward's down projection (Gemma's layers hold it themselves)
                feed_forward = getattr(layer, "feed_forward", layer)
                feed_forward.down = AllReducedLinear(feed_forward.down, groups[self.stage], self.timings,
                                                     shared_memory)
            self.model.can_fuse_decode = False  # the fused C++ step has no place for the all-reduces
        self.kv_caches = allocate_kv_caches(self.local_config, spec.num_slots, spec.kv_dtype, self.device,
                                            layers=self.part.layers)
        kv_bytes = sum(t.numel() * t.element_size() for pair in distinct_cache_pairs(self.kv_caches) for t in pair)
        self.previous_rank = (plan.rank_of(self.stage - 1, plan.tp_rank_of(rank)) if self.stage > 0 else None)
        self.next_rank = (plan.rank_of(self.stage + 1, plan.tp_rank_of(rank))
                          if self.stage < plan.pipeline_parallel_size - 1 else None)
        self.is_output_rank = rank == plan.output_rank
        connection.send_bytes(messages.encode(messages.Ready(
            rank, self.model.weight_bytes(), self.model.weight_summary(),
            bool(self.model.has_decode_attention_kernel), kv_bytes)))

    def serve(self) -> None:
        # No destroy_process_group() on the way out: after a peer's failure it can hang, and
        # the process ends with os._exit, which releases everything.
        while True:
            message = messages.decode(self.connection.recv_bytes())
            if isinstance(message, messages.Shutdown):
                return
            if isinstance(message, messages.CopyBlocks):
                from tokios.runner.model_runner import copy_cache_blocks

                copy_cache_blocks(self.kv_caches, message.copies, self.spec.block_size, self.device)
            elif isinstance(message, messages.Step):
                started = time.perf_counter()
                self.step(message)
                self.timings.step_s += time.perf_counter() - started
                self.timings.num_steps += 1
            elif isinstance(message, messages.GetTimings):
                self.connection.send_bytes(messages.encode(self.timings))
            else:
                raise TypeError(f"rank {self.rank} got an unknown message {type(message).__name__}")

    def step(self, message: messages.Step) -> None:
        import torch.distributed as dist

        message = message.on(self.device)
        input_ids, positions, metadata = message.input_ids, message.positions, message.metadata
        model = self.model
        if self.previous_rank is None:
            hidden = model.embed(input_ids)
        else:
            hidden = torch.empty((input_ids.shape[0], self.local_config.hidden_size), dtype=model.dtype,
                                 device=self.device)
            started = time.perf_counter()
            dist.recv(hidden, src=self.previous_rank)
            self.timings.receive_s += time.perf_counter() - started
        hidden = model.run_layers(hidden, positions, metadata, self.kv_caches, message.num_layers).contiguous()
        started = time.perf_counter()
        if self.next_rank is not None:
            dist.send(hidden, dst=self.next_rank)
        elif self.is_output_rank:
            hidden = model.ops.rms_norm(hidden, model.norm)
            self.connection.send_bytes(messages.encode(messages.StepResult(hidden.cpu())))
        self.timings.send_s += time.perf_counter() - started


if __name__ == "__main__":
    import pickle
    import signal
    import sys

    # A rank lives as long as its front says (Shutdown, or the front gone): the terminal's Ctrl-C
    # reaches the whole process group, and a rank must not die of the Ctrl-C with which
    # `tokios chat` stops a reply. The front (or `tokios worker`) stops its ranks on its own Ctrl-C.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    run_worker(pickle.loads(sys.stdin.buffer.read()))
