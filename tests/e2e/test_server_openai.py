"""`tokios serve` driven by the official openai client (and raw httpx for wire details).

One server for the module (default flags, default model). Greedy (temperature 0) answers are
compared across streaming / non-streaming and chat / completions, so the checks hold whatever
the model says.
"""

from __future__ import annotations

import json
import math
import re

MESSAGES = [{"role": "user", "content": "Name three colors."}]
PROMPT = "The capital of France is"


def sse_payloads(text: str) -> list:
    payloads = []
    for block in text.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            body = block[len("data: "):]
            payloads.append(body if body == "[DONE]" else json.loads(body))
    return payloads


def test_models_lists_the_served_model(client, model):
    models = client.models.list().data
    assert [entry.id for entry in models] == [model]
    assert model


def test_chat_non_streaming_with_usage(client, model, tokios_server):
    response = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0)
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    with tokios_server.client() as http:
        num_prompt_tokens = http.post("/tokenize", json={"messages": MESSAGES}).json()["count"]
    assert response.usage.prompt_tokens == num_prompt_tokens
    assert 1 <= response.usage.completion_tokens <= 12
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion"


def test_chat_streaming_matches_non_streaming_and_reports_usage(client, model):
    expected = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == expected.choices[0].message.content
    finish_reasons = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices]
    assert finish_reasons[-1] == expected.choices[0].finish_reason
    assert all(reason is None for reason in finish_reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == expected.usage.completion_tokens
    assert all(chunk.usage is None for chunk in chunks[:-1])


def test_raw_sse_wire_format(tokios_server, model):
    body = {"model": model, "messages": MESSAGES, "max_tokens": 4, "temperature": 0, "stream": True}
    with tokios_server.client() as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    assert payloads[0]["object"] == "chat.completion.chunk"
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len({payload["id"] for payload in payloads[:-1]}) == 1


def test_completions_streaming_matches_non_streaming(client, model):
    expected = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0)
    assert expected.object == "text_completion"
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0, stream=True))
    assert "".join(chunk.choices[0].text for chunk in chunks) == expected.choices[0].text
    assert chunks[-1].choices[0].finish_reason == expected.choices[0].finish_reason
    assert expected.usage.completion_tokens >= 1


def test_stop_string_cuts_the_answer(client, model):
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True})
    full_text = full.choices[0].text
    words = re.findall(r"[A-Za-z]{3,}", full_text)
    assert words, f"need a word in {full_text!r} to stop on"
    stop = words[min(1, len(words) - 1)]
    cut = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full_text[:full_text.index(stop)]
    streamed = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                                         extra_body={"ignore_eos": True}, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == cut.choices[0].text


def test_n_2_returns_two_choices(client, model):
    response = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, n=2, temperature=1.0,
                                              seed=3)
    assert sorted(choice.index for choice in response.choices) == [0, 1]
    assert all(choice.message.content is not None for choice in response.choices)
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, n=2, temperature=1.0,
                                            seed=3, stream=True)
    index_to_text = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            index_to_text[choice.index] += choice.delta.content or ""
    assert index_to_text == {choice.index: choice.message.content for choice in response.choices}


def test_seed_reproduces_sampled_output(client, model):
    def sample():
        return client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=16, temperature=1.0,
                                              seed=1234).choices[0].message.content
    assert sample() == sample()


def test_chat_logprobs(client, model):
    response = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, temperature=0,
                                              logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0
        # greedy: the chosen token is the most likely one
        assert math.isclose(entry.logprob, entry.top_logprobs[0].logprob, abs_tol=1e-4)
        assert [top.logprob for top in entry.top_logprobs] == sorted(
            (top.logprob for top in entry.top_logprobs), reverse=True)


def test_echo_with_logprobs_scores_the_prompt_like_lm_eval(tokios_server, model):
    """lm-evaluation-harness local-completions: token-id prompts, echo, max_tokens=1, logprobs=1."""
    with tokios_server.client() as http:
        prompt_ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
        greedy = http.post("/v1/completions", json={"model": model, "prompt": prompt_ids, "max_tokens": 1,
                                                    "temperature": 0, "logprobs": 1}).json()
        next_logprob = greedy["choices"][0]["logprobs"]["token_logprobs"][0]
        extended_ids = http.post("/tokenize", json={"prompt": PROMPT + greedy["choices"][0]["text"]}).json()["tokens"]
        assert extended_ids[:len(prompt_ids)] == prompt_ids and len(extended_ids) == len(prompt_ids) + 1, (
            "the greedy next token must re-tokenize as itself for this check")
        next_token_id = extended_ids[-1]
        batch = [prompt_ids, prompt_ids + [next_token_id]]
        scored = http.post("/v1/completions", json={"model": model, "prompt": batch, "max_tokens": 1,
                                                    "temperature": 0, "logprobs": 1, "echo": True}).json()
    choices = sorted(scored["choices"], key=lambda choice: choice["index"])
    assert [choice["index"] for choice in choices] == [0, 1]
    for choice, ids in zip(choices, batch):
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(ids) + 1
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert all(value <= 0 for value in logprobs["token_logprobs"][1:])
        assert logprobs["text_offset"][0] == 0
        assert choice["text"].startswith(PROMPT)
    # The echoed prompt's last logprob is the one the model gave that token when generating it, up
    # to the two paths' precision: prompt positions are scored with bfloat16 activations (the
    # prefill path, within 0.05% of transformers' perplexity), a sampled token's logprob with the
    # decode kernel's 8-bit activations; measured apart by 0.022 on this prompt (int4).
    assert math.isclose(choices[1]["logprobs"]["token_logprobs"][len(prompt_ids)], next_logprob, abs_tol=5e-2)
    # lm-eval's greediness check: the token's logprob is the max of its top_logprobs dict.
    last = len(prompt_ids)
    assert math.isclose(max(choices[1]["logprobs"]["top_logprobs"][last].values()),
                        choices[1]["logprobs"]["token_logprobs"][last], abs_tol=2e-2)


def test_echo_with_max_tokens_zero_returns_only_the_prompt(tokios_server, model):
    with tokios_server.client() as http:
        body = http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 0, "echo": True,
                                                  "logprobs": 0}).json()
        num_prompt_tokens = http.post("/tokenize", json={"prompt": PROMPT}).json()["count"]
    choice = body["choices"][0]
    assert choice["text"] == PROMPT
    assert len(choice["logprobs"]["tokens"]) == num_prompt_tokens
    assert body["usage"]["completion_tokens"] == 0


def test_tokenize_detokenize_round_trip(tokios_server):
    with tokios_server.client() as http:
        tokens = http.post("/tokenize", json={"prompt": "héllo wörld"}).json()
        assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] > 0
        text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text.endswith("héllo wörld")


def test_metrics_and_request_log(tokios_server, client, model):
    secret_prompt = "zebra-umbrella-quartz"
    client.completions.create(model=model, prompt=secret_prompt, max_tokens=3, temperature=0,
                              extra_body={"ignore_eos": True})
    with tokios_server.client() as http:
        text = http.get("/metrics").text
    for name in ("tokios:time_to_first_token_seconds_count", "tokios:inter_token_latency_seconds_count",
                 "tokios:e2e_request_latency_seconds_count", "tokios:request_queue_time_seconds_count",
                 "tokios:num_requests_running", "tokios:num_requests_waiting", "tokios:kv_cache_usage_perc",
                 "tokios:prompt_tokens_total", "tokios:generation_tokens_total",
                 "tokios:prefix_cache_queries_total", "tokios:prefix_cache_hits_total",
                 "tokios:num_preemptions_total"):
        assert name in text, name
    assert re.search(r'tokios:request_success_total\{finished_reason="length",model_name="%s"\} [1-9]' % model, text)
    assert re.search(r'tokios:http_requests_total\{status="200"\} [1-9]', text)
    # A real observation, not only the series every model starts with at zero.
    assert re.search(r'^tokios:request_queue_time_seconds_count\{model_name="%s"\} [1-9]' % model, text, re.M)
    generated = float(re.search(r'^tokios:generation_tokens_total\{model_name="%s"\} (\S+)$' % model, text, re.M).group(1))
    assert generated >= 3
    # The default model as stored: every step reads its weights on the quantized kernels.
    assert re.search(r'^tokios:weight_bytes_read_total\{model_name="%s"\} [1-9]' % model, text, re.M)
    log = tokios_server.log_text()
    lines = [line for line in log.splitlines() if "tokios.requests" in line and "completion_tokens=3 " in line]
    assert lines, log[-2000:]
    assert re.search(r"request_id=cmpl-\w+-0 prompt_tokens=\d+ completion_tokens=3 ttft_s=[\d.]+ tpot_s=[\d.]+ "
                     r"finish_reason=length params=", lines[-1])
    assert secret_prompt not in log


def test_speculation_figures_reach_metrics_and_the_request_log(tokios_server, client, model):
    repetitive = "Copy exactly: one two three four five six, one two three four five six, one two three"
    client.completions.create(model=model, prompt=repetitive, max_tokens=24, temperature=0,
                              extra_body={"ignore_eos": True, "speculative": {"method": "ngram", "num_tokens": 4}})
    with tokios_server.client() as http:
        text = http.get("/metrics").text
    drafts = float(re.search(r"^tokios:spec_decode_num_drafts_total\{model_name=\"%s\"\} (\S+)$" % model, text,
                             re.M).group(1))
    drafted = float(re.search(r"^tokios:spec_decode_num_draft_tokens_total\{model_name=\"%s\"\} (\S+)$" % model,
                              text, re.M).group(1))
    assert drafts >= 1 and drafted >= drafts
    lines = [line for line in tokios_server.log_text().splitlines()
             if "tokios.requests" in line and "completion_tokens=24 " in line and "spec_drafts=" in line]
    assert lines
    match = re.search(r"spec_drafts=(\d+) spec_draft_tokens=(\d+) spec_accepted_tokens=(\d+)", lines[-1])
    assert int(match.group(1)) >= 1 and int(match.group(2)) >= int(match.group(1)) >= 1
    assert int(match.group(3)) <= int(match.group(2))
