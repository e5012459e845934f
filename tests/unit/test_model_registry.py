"""The model registry's rules with stand-in engines: one load for many waiters, a failed load
fails its waiters only, LRU eviction under --max-loaded-models and --max-model-memory, pinned
models never evicted, keep-alive unloads (0 at once, negative never)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tokios.errors import OverloadedError, TokiosError
from tokios.server.registry import LOADED, UNLOADED, ModelRegistry, ModelSpec


class StandInEngine:
    max_model_len = 128

    def __init__(self, name: str):
        self.name = name
        self.is_shut_down = False

    def start(self) -> None:
        pass

    async def shutdown(self) -> None:
        self.is_shut_down = True


class Loader:
    """Counts loads; can be slow (to let requests pile up) or fail."""

    def __init__(self, name: str, delay_s: float = 0.0, failures: int = 0):
        self.name = name
        self.delay_s = delay_s
        self.failures = failures
        self.num_loads = 0
        self._lock = threading.Lock()

    def __call__(self) -> StandInEngine:
        with self._lock:
            self.num_loads += 1
        time.sleep(self.delay_s)
        if self.failures:
            self.failures -= 1
            raise TokiosError(f"{self.name}: the file is broken")
        return StandInEngine(self.name)


def registry_of(*loaders: Loader, sizes: list[int] | None = None, **limits) -> ModelRegistry:
    specs = [ModelSpec(names=[loader.name], path=f"/models/{loader.name}.gguf", load=loader,
                       estimated_bytes=sizes[index] if sizes else None) for index, loader in enumerate(loaders)]
    registry = ModelRegistry(specs, **limits)
    registry.make_serving = lambda engine, spec: engine  # the stand-in is its own "serving"
    return registry


def test_eight_first_requests_share_one_load():
    loader = Loader("a", delay_s=0.2)

    async def main():
        registry = registry_of(loader, Loader("b"))
        leases = await asyncio.gather(*(registry.acquire("a") for _ in range(8)))
        assert {id(lease.serving) for lease in leases} == {id(leases[0].serving)}
        assert registry.entry("a").num_leases == 8
        for lease in leases:
            lease.release()
            lease.release()  # idempotent
        assert registry.entry("a").num_leases == 0
    asyncio.run(main())
    assert loader.num_loads == 1


def test_a_failed_load_fails_its_waiters_and_the_next_request_tries_again():
    broken = Loader("broken", delay_s=0.1, failures=1)

    async def main():
        registry = registry_of(Loader("a"), broken)
        results = await asyncio.gather(*(registry.acquire("broken") for _ in range(3)), return_exceptions=True)
        assert all(isinstance(result, TokiosError) and "broken" in str(result) for result in results)
        entry = registry.entry("broken")
        assert entry.state == UNLOADED and entry.num_leases == 0 and "the file is broken" in entry.last_error
        other = await registry.acquire("a")  # the other model is untouched
        other.release()
        lease = await registry.acquire("broken")
        assert lease.entry.state == LOADED
        lease.release()
    asyncio.run(main())
    assert broken.num_loads == 2


def test_an_unknown_name_is_a_404_naming_the_served_models():
    async def main():
        registry = registry_of(Loader("a"), Loader("b"))
        with pytest.raises(TokiosError) as error:
            await registry.acquire("c")
        assert error.value.status == 404 and "'a', 'b'" in error.value.message
        assert registry.entry("a:latest") is registry.entry("a")  # Ollama clients add :latest
    asyncio.run(main())


def test_the_least_recently_used_idle_model_is_evicted_and_a_busy_one_never():
    async def main():
        registry = registry_of(Loader("a"), Loader("b"), Loader("c"), max_loaded_models=2)
        for name in ("a", "b"):
            (await registry.acquire(name)).release()
        (await registry.acquire("a")).release()  # b is now the least recently used
        engine_b = registry.entry("b").engine
        (await registry.acquire("c")).release()
        assert [entry.state for entry in registry.entries] == [LOADED, UNLOADED, LOADED]
        assert engine_b.is_shut_down
        busy_a = await registry.acquire("a")
        busy_c = await registry.acquire("c")
        with pytest.raises(OverloadedError) as error:
            await registry.acquire("b")
        assert error.value.status == 503 and "--max-loaded-models" in error.value.message
        assert registry.entry("b").num_leases == 0
        busy_c.release()
        lease_b = await registry.acquire("b")  # c is idle now: it goes
        assert registry.entry("c").state == UNLOADED and registry.entry("a").state == LOADED
        lease_b.release()
        busy_a.release()
    asyncio.run(main())


def test_the_memory_budget_evicts_until_the_new_model_fits():
    async def main():
        registry = registry_of(Loader("a"), Loader("b"), Loader("big"), sizes=[300, 300, 500],
                               max_memory_bytes=1000)
        for name in ("a", "b"):
            (await registry.acquire(name)).release()
        (await registry.acquire("big")).release()  # 300 + 300 + 500 > 1000: a (oldest) goes
        assert [entry.state for entry in registry.entries] == [UNLOADED, LOADED, LOADED]
    asyncio.run(main())


def test_keep_alive_zero_unloads_when_idle_and_negative_never():
    async def main():
        registry = registry_of(Loader("a"), Loader("b"), keep_alive_s=-1)
        lease = await registry.acquire("a", keep_alive_s=0)
        assert registry.expires_at(lease.entry) is None  # in use
        lease.release()
        await asyncio.sleep(0.05)  # the release schedules the sweep
        assert registry.entry("a").state == UNLOADED
        (await registry.acquire("b")).release()
        await registry.sweep()
        assert registry.entry("b").state == LOADED and registry.expires_at(registry.entry("b")) is None
        (await registry.acquire("b", keep_alive_s=0.05)).release()
        await asyncio.sleep(0.1)
        await registry.sweep()
        assert registry.entry("b").state == UNLOADED
    asyncio.run(main())


def test_the_default_keep_alive_is_forever_for_one_model_and_five_minutes_for_several():
    assert registry_of(Loader("a")).keep_alive_s == -1
    assert registry_of(Loader("a"), Loader("b")).keep_alive_s == 300


def test_model_cards_list_every_name_with_its_state():
    async def main():
        specs = [ModelSpec(names=["a", "alias"], path="", load=Loader("a")), ModelSpec(names=["b"], path="",
                                                                                        load=Loader("b"))]
        registry = ModelRegistry(specs)
        registry.make_serving = lambda engine, spec: engine
        (await registry.acquire("alias")).release()
        cards = registry.model_cards(created=1)
        assert [(card["id"], card["state"]) for card in cards] == [("a", LOADED), ("alias", LOADED), ("b", UNLOADED)]
        assert cards[0]["max_model_len"] == 128
    asyncio.run(main())
