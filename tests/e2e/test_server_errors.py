"""Every error of `tokios serve`, with its status and OpenAI's error shape, on a keyed server.

On the session's small keyed server: two keys (one by flag, one from a key file), a 256 KiB
body limit and a 2,048-token context.
"""

from __future__ import annotations

import openai
import pytest

from conftest import SMALL_SERVER_FILE_KEY as FILE_KEY
from conftest import serve
from conftest import SMALL_SERVER_FLAG_KEY as FLAG_KEY
from conftest import SMALL_SERVER_MAX_BODY_SIZE as MAX_BODY_SIZE


@pytest.fixture(scope="module")
def keyed_server(small_keyed_server):
    return small_keyed_server


@pytest.fixture(scope="module")
def http(keyed_server):
    with keyed_server.client() as client:
        yield client


@pytest.fixture(scope="module")
def model(http) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


def assert_error(response, status: int, *, param=None, code=None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]


def chat_body(model: str, **fields) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}


def test_missing_and_wrong_keys_are_401(keyed_server, model):
    import httpx

    url = f"{keyed_server.base_url}/v1/chat/completions"
    error = assert_error(httpx.post(url, json=chat_body(model)), 401, code="invalid_api_key")
    assert error["type"] == "authentication_error"
    assert_error(httpx.post(url, json=chat_body(model), headers={"Authorization": "Bearer sk-wrong"}), 401)
    assert httpx.post(url, json=chat_body(model), headers={"Authorization": f"Bearer {FILE_KEY}"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed_server.base_url}/v1", api_key="sk-wrong", max_retries=0).models.list()


def test_health_and_metrics_stay_open_without_protect_metrics(keyed_server):
    import httpx

    assert httpx.get(f"{keyed_server.base_url}/health").status_code == 200
    assert httpx.get(f"{keyed_server.base_url}/metrics").status_code == 200


def test_keys_never_reach_the_log(keyed_server, http, model):
    http.post("/v1/chat/completions", json=chat_body(model))
    log = keyed_server.log_text()
    assert FLAG_KEY not in log and FILE_KEY not in log


@pytest.mark.parametrize("content", [b"{not json", b"", b"\xff\xfe", b"[1, 2]", b'"text"', b"42", b"null"])
def test_malformed_or_non_object_bodies_are_400(http, content):
    response = http.post("/v1/chat/completions", content=content, headers={"Content-Type": "application/json"})
    assert_error(response, 400)


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": "many"}, "max_tokens"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "user"}, {"content": "no role"}]}, "messages"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"logit_bias": {"999999": 5}}, "logit_bias"),
    ({"stop": [""]}, "stop"),
    ({"presence_penalty": 9}, "presence_penalty"),
    ({"top_logprobs": 3}, "top_logprobs"),
])
def test_bad_parameters_are_400_naming_the_parameter(http, model, fields, param):
    assert_error(http.post("/v1/chat/completions", json=chat_body(model, **fields)), 400, param=param)


def test_bad_parameter_in_a_streaming_request_is_a_plain_400(http, model):
    response = http.post("/v1/chat/completions", json=chat_body(model, temperature=-2, stream=True))
    assert_error(response, 400, param="temperature")


def test_missing_messages_and_prompt(http, model):
    error = assert_error(http.post("/v1/chat/completions", json={"model": model}), 400, param="messages")
    assert "required" in error["message"]
    assert_error(http.post("/v1/completions", json={"model": model}), 400, param="prompt")


def test_prompt_too_long_names_the_limit_and_counts(http, model):
    long_prompt = "hello " * 3000
    error = assert_error(http.post("/v1/completions", json={"model": model, "prompt": long_prompt, "max_tokens": 5}),
                         400, code="context_length_exceeded")
    assert error["type"] == "invalid_request_error"
    assert "maximum context length is 2048 tokens" in error["message"]
    num_prompt_tokens = http.post("/tokenize", json={"prompt": long_prompt}).json()["count"]
    expected_counts = f"{num_prompt_tokens + 5} tokens ({num_prompt_tokens} in the prompt, 5 for the completion)"
    assert expected_counts in error["message"]
    chat_error = assert_error(
        http.post("/v1/chat/completions", json=chat_body(model, max_tokens=5000)), 400, code="context_length_exceeded")
    assert "in the messages, 5000 for the completion" in chat_error["message"]


def test_unknown_model_is_404(http):
    error = assert_error(http.post("/v1/chat/completions", json=chat_body("gpt-nonexistent")), 404,
                         param="model", code="model_not_found")
    assert "gpt-nonexistent" in error["message"]


def test_body_over_the_limit_is_413(http, model):
    huge = chat_body(model, messages=[{"role": "user", "content": "x" * (MAX_BODY_SIZE + 10)}])
    assert_error(http.post("/v1/chat/completions", json=huge), 413)

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(MAX_BODY_SIZE // 1024 + 2):
            yield b" " * 1024
    assert_error(http.post("/v1/chat/completions", content=chunks()), 413)


def test_unknown_route_and_method(http):
    assert_error(http.get("/v1/nothing-here"), 404)
    assert_error(http.get("/v1/chat/completions"), 405)


def test_openai_client_sees_typed_errors(keyed_server, model):
    client = keyed_server.openai()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], temperature=-1)
    assert info.value.status_code == 400 and info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_server_still_healthy_and_idle_after_errors(http, model):
    assert http.post("/v1/chat/completions", json=chat_body(model)).status_code == 200
    stats = http.get("/v1/engine/stats").json()
    assert stats["num_requests_in_flight"] == 0
    assert stats["num_blocks_used"] == 0 and stats["invariants_error"] is None


def test_a_chat_template_that_refuses_the_conversation_is_a_400():
    """A template's raise_exception (Gemma 2's on a system turn, llama.cpp's copy) refuses that
    request with a 400 naming messages, streamed or not, in OpenAI's and Anthropic's shapes, and
    the server serves the next conversation the template accepts."""
    import anthropic

    from tokios.model_files import llama_cpp_sources

    template = llama_cpp_sources() / "models" / "templates" / "google-gemma-2-2b-it.jinja"
    with serve("--dtype", "bfloat16", "--max-model-len", "512", "--chat-template", str(template)) as server:
        client = server.openai()
        model = client.models.list().data[0].id
        system_turn = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as error:
                client.chat.completions.create(model=model, messages=system_turn, max_tokens=4, stream=stream)
            assert error.value.status_code == 400 and error.value.body["param"] == "messages"
            assert "System role not supported" in error.value.body["message"]
        with pytest.raises(anthropic.BadRequestError) as refused:
            anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0).messages.create(
                model=model, max_tokens=4, system="Be brief.", messages=[{"role": "user", "content": "Hi"}])
        assert "System role not supported" in str(refused.value)
        answer = client.chat.completions.create(model=model, messages=system_turn[1:], max_tokens=4, temperature=0)
        assert answer.choices[0].finish_reason in ("stop", "length")
        assert "Traceback" not in server.log_text()
