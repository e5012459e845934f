"""API keys, admission (queue bound, draining) and the app's guard before the model is ready."""

from __future__ import annotations

import asyncio
import threading

import pytest
from starlette.testclient import TestClient

from tokios.errors import AuthenticationError, ModelLoadError, OverloadedError
from tokios.server.admission import Admission
from tokios.server.app import create_app
from tokios.server.auth import ApiKeyChecker, key_digest
from tokios.server.serving import ServerSettings


def test_keys_are_kept_as_digests_only():
    checker = ApiKeyChecker(["sk-one", "sk-two"])
    assert checker.is_enabled
    assert "sk-one" not in repr(vars(checker))
    assert key_digest("sk-one") in checker._key_digests
    assert checker.is_valid("sk-two") and not checker.is_valid("sk-three") and not checker.is_valid("")


@pytest.mark.parametrize("authorization, x_api_key, is_ok", [
    ("Bearer sk-one", None, True),
    ("bearer   sk-one  ", None, True),
    (None, "sk-one", True),
    ("Bearer wrong", None, False),
    ("Basic sk-one", None, False),
    ("Bearer ", None, False),
    (None, None, False),
])
def test_header_forms(authorization, x_api_key, is_ok):
    checker = ApiKeyChecker(["sk-one"])
    if is_ok:
        checker.check_headers(authorization, x_api_key)
    else:
        with pytest.raises(AuthenticationError) as info:
            checker.check_headers(authorization, x_api_key)
        assert info.value.status == 401 and "sk-one" not in info.value.message


def test_no_keys_means_open():
    ApiKeyChecker().check_headers(None, None)


def test_key_file_skips_comments_and_blank_lines(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# team keys\nsk-file-1\n\n  sk-file-2  \n")
    checker = ApiKeyChecker.from_sources(["sk-flag"], str(path))
    assert all(checker.is_valid(key) for key in ("sk-flag", "sk-file-1", "sk-file-2"))
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    with pytest.raises(Exception, match="holds no key"):
        ApiKeyChecker.from_sources(None, str(empty))
    with pytest.raises(Exception, match="cannot read"):
        ApiKeyChecker.from_sources(None, str(tmp_path / "missing"))


def test_admission_bounds_in_flight_and_drains():
    async def scenario():
        admission = Admission(max_num_running=2, max_queued_requests=1, retry_after_s=2)
        tickets = [admission.admit() for _ in range(3)]
        with pytest.raises(OverloadedError) as info:
            admission.admit()
        assert info.value.status == 429 and info.value.retry_after_s == 2
        tickets[0].release()
        tickets[0].release()  # idempotent: one slot freed, not two
        tickets.append(admission.admit())
        with pytest.raises(OverloadedError):
            admission.admit()
        admission.start_draining()
        with pytest.raises(OverloadedError) as info:
            admission.admit()
        assert info.value.status == 503
        assert not await admission.wait_idle(0.05)
        for ticket in tickets:
            ticket.release()
        assert await admission.wait_idle(0.05)
        assert admission.num_in_flight == 0

    asyncio.run(scenario())


def test_app_answers_health_auth_and_size_limits_while_loading():
    """The loader blocks until released, then fails: /health goes loading -> failed."""
    release_loader = threading.Event()

    def failing_loader():
        release_loader.wait(10)
        raise ModelLoadError("no such model file: /nowhere.gguf")

    settings = ServerSettings(max_body_size=64)
    app = create_app(settings, engine_loader=failing_loader, api_keys=ApiKeyChecker(["sk-test"]))
    with TestClient(app) as client:
        health = client.get("/health")
        assert health.status_code == 503 and health.json() == {"status": "loading"}
        assert health.headers["Retry-After"] == "1"
        unauthorized = client.post("/v1/chat/completions", json={})
        assert unauthorized.status_code == 401
        assert unauthorized.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        too_large = client.post("/v1/completions", content=b"x" * 65,
                                headers={"Authorization": "Bearer sk-test"})
        assert too_large.status_code == 413
        assert too_large.json()["error"]["type"] == "invalid_request_error"
        loading = client.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer sk-test"})
        assert loading.status_code == 503 and "loading" in loading.json()["error"]["message"]
        unknown = client.get("/v1/nothing", headers={"Authorization": "Bearer sk-test"})
        assert unknown.status_code == 404 and "error" in unknown.json()
        assert client.get("/").status_code == 200  # the page itself needs no key
        assert client.get("/static/app.js").status_code == 200
        metrics = client.get("/metrics")
        assert metrics.status_code == 200 and "tokios:http_requests_total" in metrics.text
        assert 'status="401"' in metrics.text
        release_loader.set()
        for _ in range(100):
            if client.get("/health").json()["status"] == "failed":
                break
            threading.Event().wait(0.05)
        assert client.get("/health").json() == {"status": "failed"}
    assert isinstance(app.state.tokios.load_error, ModelLoadError)


def test_protect_metrics_requires_a_key_for_health_and_metrics():
    release_loader = threading.Event()

    def failing_loader():
        release_loader.wait(10)
        raise ModelLoadError("not loaded in this test")

    app = create_app(ServerSettings(protect_metrics=True), engine_loader=failing_loader,
                     api_keys=ApiKeyChecker(["sk-test"]))
    with TestClient(app) as client:
        assert client.get("/metrics").status_code == 401
        assert client.get("/health").status_code == 401
        assert client.get("/metrics", headers={"Authorization": "Bearer sk-test"}).status_code == 200
        release_loader.set()


def test_every_api_route_asks_for_the_key():
    """Each dialect's every route (the rerank API's /rerank and /v2/rerank among them) answers 401
    without the key; only the page, its files and the health routes are open."""
    from tokios.server.dialects import DIALECTS

    release_loader = threading.Event()

    def blocked_loader():
        release_loader.wait(10)
        raise ModelLoadError("released")

    app = create_app(ServerSettings(), engine_loader=blocked_loader, api_keys=ApiKeyChecker(["sk-test"]))
    with TestClient(app) as client:
        try:
            for dialect in DIALECTS:
                for route in dialect.routes:
                    path = route.path.replace("{", "").replace("}", "")
                    response = client.request(route.method.upper(), path, json={})
                    assert response.status_code == 401, (route.method, route.path, response.status_code)
            # The page's icon is open, as the page is: a browser asks for it without the key.
            favicon = client.get("/favicon.ico")
            assert favicon.status_code == 200 and favicon.headers["content-type"].startswith("image/svg+xml")
        finally:
            release_loader.set()
