"""The prefix cache's disk tier through a real `tokios serve`: a server stopped with SIGTERM
writes its cache to --kv-cache-disk, a new server over the same directory answers the same prompt
from it with the same greedy text; a directory that cannot be written leaves the server serving
from memory, with one warning in its log."""

from __future__ import annotations

from conftest import serve

PROMPT = ("A long shared preamble about the harbour, the lighthouse and the ferries that cross the bay "
          "every morning. " * 16) + "Summarize it in one sentence."


def complete(server) -> tuple[str, dict]:
    with server.client() as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        response = http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 12,
                                                      "temperature": 0.0})
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"], http.get("/v1/engine/stats").json()


def test_a_restarted_server_answers_from_the_disk_tier_with_the_same_text(tmp_path):
    with serve("--kv-cache-disk", str(tmp_path)) as first:
        text, stats = complete(first)
        assert stats["disk_cache_hit_tokens"] == 0
        assert first.stop() == 0
    assert "wrote" in first.log_text() and list(tmp_path.rglob("*.kvb"))
    with serve("--kv-cache-disk", str(tmp_path)) as restarted:
        again, stats = complete(restarted)
        assert again == text
        assert stats["disk_cache_hit_tokens"] >= 16 * 16 and stats["disk_cache_rejected"] == 0
        with restarted.client() as http:
            metrics = http.get("/metrics").text
        assert "tokios:prefix_cache_disk_hits" in metrics


def test_an_unwritable_directory_leaves_the_server_serving_from_memory_with_one_warning(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("a file where the directory would be")
    with serve("--kv-cache-disk", str(blocker / "kv")) as server:
        first, _ = complete(server)
        second, stats = complete(server)
        assert first == second and stats["prefix_cache_hits"] > 0  # the memory cache still serves
        assert server.stop() == 0
    log = server.log_text()
    assert log.count("serving from the memory cache only") == 1, log[-2000:]
