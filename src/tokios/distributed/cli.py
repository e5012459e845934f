"""The parallel group's flags (`tokios serve` and `tokios worker` share them) and `tokios worker`:
the ranks of one more machine, joining a server's group.

    # machine A (node 0): the server, ranks 0-1
    TOKIOS_DIST_KEY=$KEY tokios serve --model M.gguf --tensor-parallel-size 2 --pipeline-parallel-size 2 \\
        --nnodes 2 --master-addr 10.0.0.1 --master-port 29500
    # machine B (node 1): ranks 2-3
    TOKIOS_DIST_KEY=$KEY tokios worker --tensor-parallel-size 2 --pipeline-parallel-size 2 \\
        --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500
"""

from __future__ import annotations

import argparse
import signal
import time

DEFAULT_TIMEOUT_S = 60.0


def add_parallel_arguments(parser: argparse.ArgumentParser, *, worker: bool = False) -> None:
    group = parser.add_argument_group("parallel (docs/scale-out.md)")
    group.add_argument("--tensor-parallel-size", "--tp", type=int, default=1,
                       help="ranks that split each layer: heads and feed-forward features (default 1)")
    group.add_argument("--pipeline-parallel-size", "--pp", type=int, default=1,
                       help="stages that split the layers (default 1)")
    group.add_argument("--master-addr", default="127.0.0.1",
                       help="address of node 0, where the group meets (default 127.0.0.1)")
    group.add_argument("--master-port", type=int, default=None,
                       help="rendezvous port on node 0; the server also listens one above it for its ranks "
                            "(default: a free port; needed with --nnodes > 1)")
    group.add_argument("--nnodes", type=int, default=1, help="machines the ranks are spread over (default 1)")
    if worker:
        group.add_argument("--node-rank", type=int, required=True, help="this machine's number, 1..NNODES-1")
    else:  # the workers' ranks take the server's
        group.add_argument("--dist-timeout", type=float, default=DEFAULT_TIMEOUT_S,
                           help="seconds a rank waits on a silent peer before it fails; more than the slowest "
                                f"stage's step (default {DEFAULT_TIMEOUT_S:g})")


def parallel_config(args: argparse.Namespace):
    from tokios.config import ParallelConfig

    return ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                          pipeline_parallel_size=args.pipeline_parallel_size, master_addr=args.master_addr,
                          master_port=args.master_port, nnodes=args.nnodes,
                          node_rank=getattr(args, "node_rank", 0),
                          timeout_s=getattr(args, "dist_timeout", DEFAULT_TIMEOUT_S))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_parallel_arguments(parser, worker=True)
    parser.add_argument("--model", default=None,
                        help="this machine's copy of the model, when its path is not the server's")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads of each rank here (default: the cores shared among this machine's ranks)")


def run(args: argparse.Namespace) -> int:
    """Run this machine's ranks; when the server stops them cleanly (it unloaded the model, or
    it is restarting) start them again, waiting for it; exit on a rank's failure, Ctrl-C or SIGTERM."""
    from tokios.distributed.executor import RankProcess, group_key, rank_threads
    from tokios.distributed.plan import ParallelPlan
    from tokios.distributed.worker import FRONT_GONE_STATUS, RankLaunch
    from tokios.errors import InvalidRequestError

    config = parallel_config(args)
    if config.node_rank == 0:
        raise InvalidRequestError("node_rank 0 is the server's machine (`tokios serve`); workers are 1..NNODES-1",
                                  param="node_rank")
    plan = ParallelPlan.of(config)
    key = group_key(config.nnodes)
    ranks = config.local_ranks
    threads = args.threads or rank_threads(len(ranks))
    processes: list = []
    # SIGTERM (kill, systemd, docker stop) stops the ranks like Ctrl-C does; left at its default
    # it would end this process alone and orphan them. A shell that starts us in the background
    # without job control ignores SIGINT for us, so SIGTERM is the signal that always works.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        while True:
            processes = [RankProcess.start(RankLaunch(rank, plan, (config.master_addr, config.master_port + 1), key,
                                                      threads, model_path=args.model, local_index=index))
                         for index, rank in enumerate(ranks)]
            print(f"tokios worker: ranks {ranks.start}-{ranks.stop - 1} of {plan.world_size} started, joining "
                  f"{config.master_addr}:{config.master_port}", flush=True)
            restartable = (0, FRONT_GONE_STATUS)
            while not any(process.exitcode not in (None, *restartable) for process in processes) and \
                    not all(process.exitcode in restartable for process in processes):
                time.sleep(0.2)
            failed = [process.exitcode for process in processes if process.exitcode not in (None, *restartable)]
            for process in processes:
                if process.exitcode is None:
                    process.kill()
                process.join(5)
                process.close()
            if failed:
                return failed[0]
            print("tokios worker: the server stopped or left; starting the ranks again for its next load", flush=True)
    except KeyboardInterrupt:
        return 0
    finally:
        for process in processes:
            if process.exitcode is None:
                process.kill()
            process.join(5)
            process.close()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
