"""The model registry: several models behind one server, loaded on demand, unloaded when idle.

Owns the models a server may serve (`--model PATH[=NAME]`, repeatable, and `--models-dir`), their
state (unloaded -> loading -> loaded) and the rules of their lives:

- A request naming a model that is not loaded loads it. The load runs in a worker thread (the
  event loop keeps serving the other models' streams); every request that arrives meanwhile
  waits for the same load, so eight first requests start one load. A load that fails is an error
  for the requests that waited for it; the next request tries again.
- A lease (`acquire` ... `release`) pins a model while a request uses it: a pinned model is never
  unloaded or evicted.
- Idle unload: a model unused for its keep-alive (`--keep-alive`, or per request in the Ollama
  API; 0 unloads as soon as it is idle, a negative value never) is unloaded: its engine stops and
  its weights and KV cache are freed (and the allocator is asked to give the pages back).
- Room: before a load, `--max-loaded-models` and `--max-model-memory` evict the least recently
  used idle models; the sizes are the plan's arithmetic (tools/plan/formulas.py: the file's weight
  bytes plus the configured KV cache memory). A load that cannot get room because every loaded
  model is busy is a 503.

Each loaded model is its own AsyncEngine with its own Serving (server/serving.py). server/app.py
holds one registry; server/cli.py builds the specs.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokios.errors import ModelLoadError, OverloadedError
from tokios.sampling_defaults import TOKIOS as TOKIOS_SAMPLING, SamplingDefaults
from tokios.server.errors import model_not_found

logger = logging.getLogger("tokios.server")

UNLOADED, LOADING, LOADED = "unloaded", "loading", "loaded"
# How often the idle sweep looks (it also runs at once when a lease with keep-alive 0 ends).
SWEEP_INTERVAL_S = 1.0


@dataclass
class ModelSpec:
    """One servable model: its names (the first is its id), where it lives, how to load it."""

    names: list[str]
    path: str
    # Builds a ready AsyncEngine; blocking (it runs in a worker thread).
    load: Callable[[], Any]
    # Weights + KV cache, for the memory budget; None when the file cannot be measured.
    estimated_bytes: int | None = None
    # What the model serves (encoder/loader.py model_kind): "generate", "embedding" or "rerank".
    kind: str = "generate"
    # What a request that leaves a sampling field unset gets (tokios/sampling_defaults.py).
    sampling_defaults: SamplingDefaults = TOKIOS_SAMPLING

    @property
    def name(self) -> str:
        return self.names[0]


@dataclass
class ModelEntry:
    spec: ModelSpec
    state: str = UNLOADED
    engine: Any = None
    serving: Any = None
    load_task: asyncio.Task | None = None
    num_leases: int = 0
    last_used: float = 0.0
    # Per-model keep-alive set by a request (Ollama's keep_alive); None: the registry default.
    keep_alive_s: float | None = None
    load_seconds: float | None = None
    last_error: str | None = None

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass
class ModelLease:
    """A model held for one request; `release()` is idempotent."""

    registry: ModelRegistry
    entry: ModelEntry
    load_seconds: float = 0.0  # how long this request waited for a load (0 when it was loaded)
    _is_released: bool = field(default=False, repr=False)

    @property
    def serving(self) -> Any:
        return self.entry.serving

    def release(self) -> None:
        if not self._is_released:
            self._is_released = True
            self.registry._release(self.entry)


def release_memory_to_os() -> None:
    """Unloading frees tensors into glibc's heap, which keeps the pages; malloc_trim returns
    them, so that RSS (what `--max-model-memory` and the user's `top` see) really drops."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the pages come back when the allocator decides
        pass


# A load must not stall the other models' streams (measured with four streams decoding on one
# model while a copy loads on this 2-core machine: their inter-token p95 went from 24 to 148 ms).
# Two causes, two remedies, both only while a load runs:
# - The GIL: loading runs long pure-Python and numpy stretches (GGUF string arrays, the tokenizer,
#   weight repacking); each time a decode thread releases the GIL for a kernel it waited up to
#   Python's 5 ms switch interval to get it back. The interval drops to 0.5 ms.
# - The cores: the loading threads (the loader and the new engine's thread with its OpenMP team,
#   which inherit its priority) run at nice 19, so they take only what serving leaves idle. On an
#   idle machine a load runs at full speed; under load it runs slower (measured 1.4 s -> 2.9-6 s)
#   while the streams keep their pace. The threads get their priority back after the load
#   (lowering niceness needs CAP_SYS_NICE; without it they stay at 19, logged once).
LOAD_SWITCH_INTERVAL_S = 0.0005
LOAD_NICENESS = 19


def _thread_niceness() -> dict[int, int]:
    """Linux thread id -> nice value of this process's threads."""
    niceness = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            niceness[int(tid)] = os.getpriority(os.PRIO_PROCESS, int(tid))
        except (OSError, ValueError):  # the thread ended meanwhile
            pass
    return niceness


def load_in_background(load: Callable[[], Any]) -> Any:
    """Runs `load` (in a worker thread) with short GIL slices and at low CPU priority."""
    previous_interval = sys.getswitchinterval()
    sys.setswitchinterval(min(previous_interval, LOAD_SWITCH_INTERVAL_S))
    can_renice = sys.platform.startswith("linux")
    before = _thread_niceness() if can_renice else {}
    own_niceness = before.get(threading.get_native_id(), 0)
    try:
        if can_renice:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOAD_NICENESS)
        engine = load()
        asyncio.run(_warm_up(engine))
        return engine
    finally:
        sys.setswitchinterval(previous_interval)
        if can_renice:
            _restore_niceness(before, own_niceness)


async def _warm_up(engine: Any) -> None:
    """One short generation, still at low priority: a fresh engine's first steps pay one-time
    costs (scratch buffers, first-touch pages, first calls into the kernels) that would otherwise
    land at full priority on the request that asked for the model (measured: 130-300 ms stalls of
    the other model's streams right after the load)."""
    from tokios.sampling_params import SamplingParams

    if getattr(engine, "is_encoder", False):  # an embedding model or a cross-encoder: one forward
        await engine.encode([engine.tokenizer.encode("Hello, world", add_special_tokens=True)])
        engine.forget_warm_up()
        return
    generate = getattr(engine, "generate", None)
    if generate is None:  # stand-in engines in the unit tests
        return
    prompt_ids = engine.tokenizer.encode("Hello, world", add_special_tokens=True)
    async for _ in generate(None, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                            "tokios-warm-up", prompt_token_ids=prompt_ids):
        pass
    engine.forget_warm_up()


_is_renice_warned = False


def _restore_niceness(before: dict[int, int], default: int) -> None:
    global _is_renice_warned
    for tid, niceness in _thread_niceness().items():
        wanted = before.get(tid, default)
        if niceness == LOAD_NICENESS and wanted != LOAD_NICENESS:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, wanted)
            except PermissionError:
                if not _is_renice_warned:
                    logger.warning("the threads of a model loaded at nice %d keep it: raising a thread's priority "
                                   "needs CAP_SYS_NICE", LOAD_NICENESS)
                    _is_renice_warned = True
                return
            except OSError:  # the thread ended meanwhile
                pass


class ModelRegistry:
    def __init__(self, specs: list[ModelSpec], *, keep_alive_s: float | None = None,
                 max_loaded_models: int | None = None, max_memory_bytes: int | None = None):
        if not specs:
            raise ValueError("a registry needs at least one model")
        self.entries: list[ModelEntry] = [ModelEntry(spec) for spec in specs]
        self._name_to_entry: dict[str, ModelEntry] = {}
        for entry in self.entries:
            for name in entry.spec.names:
                if name in self._name_to_entry:
                    raise ValueError(f"model name {name!r} is given twice")
                self._name_to_entry[name] = entry
        # With one model, the default is to keep it loaded (a single-model server should not make
        # its next user wait for a load); with several, Ollama's 5 minutes.
        if keep_alive_s is None:
            keep_alive_s = -1.0 if len(specs) == 1 else 300.0
        self.keep_alive_s = keep_alive_s
        self.max_loaded_models = max_loaded_models
        self.max_memory_bytes = max_memory_bytes
        # Builds the Serving of a freshly loaded engine (server/app.py supplies it).
        self.make_serving: Callable[[Any, ModelSpec], Any] = lambda engine, spec: None
        # What a loaded model's /v1/models card adds (server/app.py supplies it: its vectors).
        self.describe_serving: Callable[[Any], dict[str, Any]] = lambda serving: {}
        # Called with every engine once it is loaded (the app hooks engine failure here).
        self.on_loaded: Callable[[ModelEntry], None] = lambda entry: None
        self._room_lock = asyncio.Lock()
        self._sweep_task: asyncio.Task | None = None

    # ---- lookup ---------------------------------------------------------------------------
    @property
    def default(self) -> ModelEntry:
        return self.entries[0]

    @property
    def names(self) -> list[str]:
        return [entry.name for entry in self.entries]

    @property
    def accepted_names(self) -> list[str]:
        """Every name `entry()` takes: each model's names and aliases, and their ":latest" forms."""
        names = [name for entry in self.entries for name in entry.spec.names]
        return names + [f"{name}:latest" for name in names if not name.endswith(":latest")]

    def entry(self, name: str | None) -> ModelEntry:
        if name is None or name == "":
            return self.default
        entry = self._name_to_entry.get(name)
        if entry is None:
            # Ollama clients add ":latest" to a bare name.
            entry = self._name_to_entry.get(name.removesuffix(":latest"))
        if entry is None:
            raise model_not_found(name, self.names)
        return entry

    def loaded_entries(self) -> list[ModelEntry]:
        return [entry for entry in self.entries if entry.state == LOADED]

    # ---- leases -----------------------------------------------------------------------------
    async def acquire(self, name: str | None, keep_alive_s: float | None = None) -> ModelLease:
        """The model, loaded (waiting for its load if need be) and pinned until release()."""
        entry = self.entry(name)
        entry.num_leases += 1  # pinned while it waits too: a model being waited for is not evicted
        started = time.monotonic()
        try:
            while entry.state != LOADED:
                if entry.load_task is None:
                    entry.load_task = asyncio.create_task(self._load(entry))
                # A waiter that gives up (client gone) must not cancel the load others wait for.
                await asyncio.shield(entry.load_task)
        except BaseException:
            self._release(entry)
            raise
        if keep_alive_s is not None:
            entry.keep_alive_s = keep_alive_s
        entry.last_used = time.monotonic()
        waited_s = time.monotonic() - started
        return ModelLease(self, entry, load_seconds=waited_s if waited_s > 0.001 else 0.0)

    def _release(self, entry: ModelEntry) -> None:
        entry.num_leases -= 1
        entry.last_used = time.monotonic()
        if entry.num_leases == 0 and self._keep_alive_of(entry) == 0:
            asyncio.get_running_loop().create_task(self.sweep())

    def _keep_alive_of(self, entry: ModelEntry) -> float:
        return self.keep_alive_s if entry.keep_alive_s is None else entry.keep_alive_s

    def expires_at(self, entry: ModelEntry) -> float | None:
        """Monotonic time at which an idle model unloads; None for never (or while in use)."""
        keep_alive_s = self._keep_alive_of(entry)
        if entry.state != LOADED or keep_alive_s < 0 or entry.num_leases:
            return None
        return entry.last_used + keep_alive_s

    # ---- loading and unloading ----------------------------------------------------------------
    async def _load(self, entry: ModelEntry) -> None:
        try:
            async with self._room_lock:
                await self._make_room(entry)
                entry.state = LOADING
                logger.info("loading model %s from %s", entry.name, entry.spec.path)
                started = time.monotonic()
                engine = await asyncio.to_thread(load_in_background, entry.spec.load)
                engine.start()
                entry.engine = engine
                entry.serving = self.make_serving(engine, entry.spec)
                entry.load_seconds = time.monotonic() - started
                entry.last_error = None
                entry.last_used = time.monotonic()
                entry.state = LOADED
                self.on_loaded(entry)
                logger.info("model %s loaded in %.2f s", entry.name, entry.load_seconds)
        except BaseException as exc:
            entry.state = UNLOADED
            entry.engine = entry.serving = None
            entry.last_error = str(getattr(exc, "message", exc))
            logger.error("loading model %s failed: %s", entry.name, entry.last_error)
            if isinstance(exc, Exception) and not isinstance(exc, OverloadedError):
                raise ModelLoadError(f"The model {entry.name!r} could not be loaded: {entry.last_error}",
                                     param="model") from exc
            raise
        finally:
            entry.load_task = None

    async def _make_room(self, entry: ModelEntry) -> None:
        """Unloads least recently used idle models until `entry` fits both limits."""
        while (reason := self._room_shortage(entry)) is not None:
            idle = [other for other in self.loaded_entries() if other is not entry and other.num_leases == 0]
            if not idle:
                raise OverloadedError(f"Cannot load model {entry.name!r}: {reason}, and every loaded model is "
                                      "serving requests. Retry later.", status=503, retry_after_s=1.0)
            victim = min(idle, key=lambda other: other.last_used)
            logger.info("unloading model %s (least recently used) to load %s: %s", victim.name, entry.name, reason)
            await self.unload(victim)

    def _room_shortage(self, entry: ModelEntry) -> str | None:
        others = [other for other in self.entries if other is not entry and other.state in (LOADED, LOADING)]
        if self.max_loaded_models is not None and len(others) + 1 > self.max_loaded_models:
            return f"{len(others)} models are loaded and --max-loaded-models is {self.max_loaded_models}"
        if self.max_memory_bytes is not None and entry.spec.estimated_bytes is not None:
            used = sum(other.spec.estimated_bytes or 0 for other in others)
            if used + entry.spec.estimated_bytes > self.max_memory_bytes and others:
                return (f"it needs about {_mib(entry.spec.estimated_bytes)} beside the {_mib(used)} loaded, "
                        f"over --max-model-memory {_mib(self.max_memory_bytes)}")
        return None

    async def unload(self, entry: ModelEntry) -> bool:
        """Stops the model's engine and frees its memory; False if it is in use (or not loaded)."""
        if entry.state != LOADED or entry.num_leases:
            return False
        engine = entry.engine
        entry.state = UNLOADED
        entry.engine = entry.serving = None
        entry.keep_alive_s = None
        await engine.shutdown()
        del engine
        release_memory_to_os()
        logger.info("model %s unloaded", entry.name)
        return True

    async def sweep(self) -> None:
        """Unloads every model whose keep-alive has run out."""
        now = time.monotonic()
        for entry in self.loaded_entries():
            expires_at = self.expires_at(entry)
            if expires_at is not None and now >= expires_at:
                await self.unload(entry)

    async def run_sweeper(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            try:
                await self.sweep()
            except Exception:  # a failed unload is logged; the server keeps serving
                logger.exception("idle unload failed")

    def start_sweeper(self) -> None:
        if self._sweep_task is None and (self.keep_alive_s >= 0 or len(self.entries) > 1):
            self._sweep_task = asyncio.get_running_loop().create_task(self.run_sweeper())

    async def shutdown(self) -> None:
        if self._sweep_task is not None:
            self._sweep_task.cancel()
            await asyncio.gather(self._sweep_task, return_exceptions=True)
        for entry in self.entries:
            if entry.load_task is not None:
                await asyncio.gather(entry.load_task, return_exceptions=True)
            if entry.engine is not None:
                await entry.engine.shutdown()

    # ---- reporting --------------------------------------------------------------------------
    def model_cards(self, created: int) -> list[dict[str, Any]]:
        """/v1/models entries: every name of every model (aliases included), with its state."""
        return [self.model_card(entry, name, created) for entry in self.entries for name in entry.spec.names]

    def model_card(self, entry: ModelEntry, name: str, created: int) -> dict[str, Any]:
        """One /v1/models entry (GET /v1/models/{id} answers it alone)."""
        card: dict[str, Any] = {"id": name, "object": "model", "created": created, "owned_by": "tokios",
                                "state": entry.state, "kind": entry.spec.kind}
        if entry.spec.kind == "generate":
            card["sampling_defaults"] = entry.spec.sampling_defaults.card()
        if entry.serving is not None:
            card["max_model_len"] = entry.serving.max_model_len
            card.update(self.describe_serving(entry.serving))
        return card


def _mib(num_bytes: float) -> str:
    return f"{math.ceil(num_bytes / 2**20)} MiB"
