"""`tokios serve` on the second architecture, Gemma 3 270M (pretrained: its file has no chat
template), through the official openai client: completions work; chat without a template is a
400 naming --chat-template; with `--chat-template gemma` chat renders Gemma's turns and stops at
<end_of_turn>. The model is given by its bare file name, as the README shows."""

from __future__ import annotations

import openai
import pytest

from conftest import serve
from tokios.model_files import GEMMA3_MODEL_FILE_NAME


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
