"""lm-evaluation-harness against the real server: `local-completions` with
`tokenizer_backend=remote` (GET /tokenizer_info, /tokenize, /detokenize) scores a small local
multiple-choice task through /v1/completions with echo and logprobs, and the accuracy and the
per-choice log-likelihoods it reports match the engine's own scoring of the same text."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

DATA = Path(__file__).parent.parent / "data" / "lm_eval" / "capitals.jsonl"


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("lm_eval_tasks")
    (directory / "tokios_capitals.yaml").write_text(f"""task: tokios_capitals
dataset_path: json
dataset_kwargs:
  data_files:
    test: {DATA}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    return directory


def test_lm_eval_scores_a_local_task_through_the_server(tokios_server, model, task_dir, client, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    results = simple_evaluate(
        model="local-completions",
        model_args=f"model={model},base_url={tokios_server.base_url}/v1/completions,tokenizer_backend=remote,"
                   "num_concurrent=2,max_retries=1,tokenized_requests=True",
        tasks=["tokios_capitals"], task_manager=TaskManager(include_path=str(task_dir)), log_samples=True,
        apply_chat_template=False)
    accuracy = results["results"]["tokios_capitals"]["acc,none"]
    documents = [json.loads(line) for line in DATA.read_text().splitlines()]
    assert accuracy >= 0.75, results["results"]
    # The log-likelihoods lm-eval got equal the server's scores of the same token ids, asked
    # directly (lm-eval joins context and choice with a space and tokenizes through /tokenize).
    sample = results["samples"]["tokios_capitals"][0]
    document = documents[sample["doc_id"]]
    with tokios_server.client() as http:
        def token_ids(text: str) -> list[int]:
            return http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
        num_context = len(token_ids(document["question"]))
        for choice, (loglikelihood, _) in zip(document["choices"], sample["filtered_resps"]):
            scored = client.completions.create(model=model, prompt=token_ids(f"{document['question']} {choice}"),
                                               max_tokens=1, echo=True, logprobs=0, temperature=0)
            own = sum(scored.choices[0].logprobs.token_logprobs[num_context:-1])
            assert math.isclose(loglikelihood, own, abs_tol=1e-4), (choice, loglikelihood, own)
