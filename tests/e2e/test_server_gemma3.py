"""`tokios serve` on the second architecture, Gemma 3 270M (pretrained: its file has no chat
template), through the official openai client: completions work; chat without a template is a
400 naming --chat-template, before the model loads when it loads on demand; with
`--chat-template gemma` chat renders Gemma's turns and stops at <end_of_turn>. The model is given
by its bare file name, as the README shows."""

from __future__ import annotations

import re

import openai
import pytest

from conftest import serve
from tokios.load_progress import DELAY_ENVIRONMENT_VARIABLE
from tokios.model_files import GEMMA3_MODEL_FILE_NAME, default_model_path


@pytest.fixture(scope="module")
def gemma_server():
    with serve("--model", GEMMA3_MODEL_FILE_NAME, "--max-model-len", "4096") as server:
        yield server


def test_completion_and_the_missing_template_error(gemma_server):
    client = gemma_server.openai()
    completion = client.completions.create(model="gemma-3-270m", prompt="The capital of France is", max_tokens=8,
                                           temperature=0)
    assert completion.choices[0].text.strip()
    assert completion.usage.prompt_tokens == 6  # <bos> and five pieces, as transformers counts them
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="gemma-3-270m", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert "--chat-template" in str(error.value)
    assert "KV cache" in gemma_server.log_text() and "sliding" in gemma_server.log_text()


def test_a_lazily_loaded_model_without_a_template_refuses_chat_without_loading():
    """The default model loads at start (its phases logged when every load shows them); Gemma 3
    waits for its first request. A chat with it, in each API that renders chat messages, is the
    template's 400 at once, read from the file's metadata: the model is never loaded."""
    default = str(default_model_path())
    with serve("--model", f"{default}=smol", "--model", f"{GEMMA3_MODEL_FILE_NAME}=gemma",
               env={DELAY_ENVIRONMENT_VARIABLE: "0"}) as server:
        assert re.search(r"loading model smol: reading weights: \d+ / \d+ MiB", server.log_text())
        with server.client() as http:
            messages = [{"role": "user", "content": "Hi"}]
            for path, body in [("/v1/chat/completions", {"messages": messages}),
                               ("/v1/messages", {"messages": messages, "max_tokens": 4}),
                               ("/v1/responses", {"input": "Hi"}),
                               ("/api/chat", {"messages": messages, "stream": False})]:
                response = http.post(path, json={"model": "gemma", **body})
                assert response.status_code == 400, (path, response.text)
                assert "this model has no chat template" in response.text and "--chat-template" in response.text
            states = {card["id"]: card["state"] for card in http.get("/v1/models").json()["data"]}
        assert states == {"smol": "loaded", "gemma": "unloaded"}
        assert "loading model gemma" not in server.log_text()


def test_chat_with_the_builtin_gemma_template():
    with serve("--model", GEMMA3_MODEL_FILE_NAME, "--chat-template", "gemma", "--max-model-len", "4096") as server:
        client = server.openai()
        chat = client.chat.completions.create(
            model="gemma-3-270m", messages=[{"role": "user", "content": "Name a primary colour."}], max_tokens=24,
            temperature=0)
        # <bos><start_of_turn>user\n ... <end_of_turn>\n<start_of_turn>model\n
        assert chat.usage.prompt_tokens == 14
        assert chat.choices[0].message.content
        assert "<end_of_turn>" not in chat.choices[0].message.content


def test_a_bad_chat_template_fails_at_start_naming_it(tmp_path):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m['content'] }")
    with pytest.raises((RuntimeError, TimeoutError), match="chat_template"):
        with serve("--model", GEMMA3_MODEL_FILE_NAME, "--chat-template", str(broken)):
            pass
