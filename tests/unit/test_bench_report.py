"""tools/bench/report.py and the table builders of the offline/prefix/compare commands, on hand-made figures."""

import pytest

from tokios.errors import InvalidRequestError
from tokios.tools.bench import compare, offline, prefix
from tokios.tools.bench.report import command_line, serve_table, update_docs_section
from tokios.tools.bench.stats import RepeatedFigure, RequestRecord, summarize_serve
from tokios.tools.bench.peers import default_model_path


def test_update_docs_section_replaces_only_its_own_section(tmp_path):
    path = tmp_path / "benchmarks.md"
    update_docs_section(str(path), "Serving", "first version")
    assert path.read_text() == "# Benchmarks\n\n## Serving\n\nfirst version\n"
    # Someone else adds sections around ours.
    path.write_text(path.read_text().replace("## Serving", "## Roofline\n\ntheirs, keep me\n\n## Serving")
                    + "\n## Gateway\n\nalso theirs\n")
    update_docs_section(str(path), "Serving", "second version\n\n| a |\n|---|")
    update_docs_section(str(path), "Prefix caching", "new section")
    text = path.read_text()
    assert "first version" not in text and "second version\n\n| a |\n|---|\n" in text
    assert "## Roofline\n\ntheirs, keep me\n" in text and "## Gateway\n\nalso theirs\n" in text
    assert text.index("## Roofline") < text.index("## Serving") < text.index("## Gateway") < text.index(
        "## Prefix caching")
    assert text.count("## Serving") == 1 and text.startswith("# Benchmarks\n")


def test_update_docs_section_does_not_match_a_longer_heading(tmp_path):
    path = tmp_path / "b.md"
    path.write_text("# Benchmarks\n\n## Serving at scale\n\nkeep\n")
    update_docs_section(str(path), "Serving", "ours")
    assert "## Serving at scale\n\nkeep\n" in path.read_text() and "## Serving\n\nours\n" in path.read_text()


def test_serve_table_lists_every_vllm_metric_and_errors():
    ok = RequestRecord(0.0, 1.0, is_success=True, chunk_times=[0.1, 0.5, 1.0], num_prompt_tokens=4,
                       num_output_tokens=3)
    summary = summarize_serve("c=1", [ok, RequestRecord(0.0, 0.1, error="HTTP 503: busy")], 1.0)
    text = serve_table([summary, summary], title="t")
    for metric in ("TTFT", "TPOT", "ITL", "E2E latency"):
        for stat in ("mean", "p50", "p90", "p95", "p99"):
            assert f"| {metric} {stat} (ms) |" in text
    assert "| completed / failed | 1 / 1 | 1 / 1 |" in text
    assert "| TTFT p50 (ms) | 100.0 | 100.0 |" in text
    assert "- c=1: HTTP 503: busy" in text


def test_offline_tables_put_paired_ratios_against_llama_cpp():
    samples = {"tokios (int8)": {"decode": {1: 100.0, 2: 10.0, 3: 50.0}, "prefill": {1: 1000.0, 2: 100.0, 3: 500.0}},
               "llama.cpp (x)": {"decode": {1: 200.0, 2: 20.0, 3: 100.0}, "prefill": {1: 500.0, 2: 50.0, 3: 250.0}},
               "transformers (bfloat16)": {"decode": {1: 10.0}, "prefill": {1: 100.0}}}
    text = offline.single_stream_table(samples)
    # The load changed 10x between reps 1 and 2; the per-rep ratios stay 0.5 and 2.
    assert ("| tokios (int8) | 50.0 [14.0, 95.0] | 500.0 [140.0, 950.0] | 3 | 0.50x [0.50x, 0.50x] "
            "| 2.00x [2.00x, 2.00x] | 10.00x [10.00x, 10.00x] |") in text
    paired = offline.paired_ratio({1: 3.0, 2: 8.0, 3: 1.0}, {2: 4.0, 3: 1.0})
    assert (paired.median, paired.num_reps) == (1.5, 2)  # rep 1 has no partner and is left out
    throughput = {"tokios (int8)": {"num_prompts": 2, "input_tokens": 10, "output_tokens": 20, "wall_s": 2.0,
                                    "input_tok_s": 5.0, "output_tok_s": 10.0},
                  "llama.cpp (x)": {"num_prompts": 2, "input_tokens": 10, "output_tokens": 20, "wall_s": 4.0,
                                    "input_tok_s": 2.5, "output_tok_s": 5.0}}
    assert "| 10.0 | 2.00x |" in offline.throughput_table(throughput)
    assert offline.parse_systems("tokios, llama.cpp") == ["tokios", "llama.cpp"]
    with pytest.raises(InvalidRequestError, match="systems"):
        offline.parse_systems("tokios,vllm")


def test_prefix_table_shows_ratio_and_hits():
    results = {"tokios": {"cold_ttft_ms": RepeatedFigure.of([500.0]), "warm_ttft_ms": RepeatedFigure.of([50.0]),
                          "warm_hit_tokens": [992, 992]},
               "llama.cpp": {"cold_ttft_ms": RepeatedFigure.of([400.0]), "warm_ttft_ms": RepeatedFigure.of([0.0]),
                             "warm_hit_tokens": []}}
    text = prefix.table(results)
    assert "| tokios | 500.0 [500.0, 500.0] | 50.0 [50.0, 50.0] | 10.00x | 992..992 |" in text
    assert "| - | - |" in text  # a zero warm TTFT gives no ratio rather than a division error


def test_compare_commands_give_both_servers_the_same_slots_and_context():
    class Args:
        ctx_per_slot, threads, dtype, tokios_args, llama_server_args = 1024, 2, "int8", "--seed 3", "--mlock"

    model = default_model_path()
    tokios = compare.tokios_command(Args, model, 9000, 4)
    llama = compare.llama_server_command(Args, "/bin/llama-server", model, 9001, 4)
    assert tokios[tokios.index("--max-num-seqs") + 1] == "4" and tokios[-2:] == ["--seed", "3"]
    assert tokios[tokios.index("--max-model-len") + 1] == "1024"
    # SmolLM2-135M: 2 x 30 layers x 3 KV heads x 64 x 2 bytes (bfloat16, as llama.cpp's f16) per
    # token, for 4 slots of 1024.
    assert tokios[tokios.index("--kv-cache-memory") + 1] == str(4 * 1024 * 2 * 30 * 3 * 64 * 2)
    assert tokios[tokios.index("--kv-cache-dtype") + 1] == "bfloat16"
    assert llama[llama.index("--parallel") + 1] == "4" and llama[llama.index("-c") + 1] == "4096"
    assert llama[-1] == "--mlock" and llama[llama.index("-t") + 1] == "2"


def test_command_line_quotes_arguments():
    assert command_line(["bench", "serve", "--input-len", "a b"]) == "tokios bench serve --input-len 'a b'"


def test_compare_rounds_report_each_levels_median_round_and_every_ratio():
    def level(label: str, duration_s: float):
        record = RequestRecord(0.0, 1.0, is_success=True, chunk_times=[0.1, 1.0], num_prompt_tokens=4,
                               num_output_tokens=10)
        return summarize_serve(label, [record], duration_s)  # 10 output tokens / duration

    # tokios: 10, 5, 20 tok/s at c=1 over three rounds; llama.cpp: 5 tok/s every round.
    tokios_rounds = [[level("c=1", 1.0)], [level("c=1", 2.0)], [level("c=1", 0.5)]]
    llama_rounds = [[level("c=1", 2.0)] for _ in range(3)]
    (median,) = compare.median_round(tokios_rounds)
    assert median.output_throughput == 10.0
    text = compare.round_ratio_table(tokios_rounds, llama_rounds)
    assert "| load | round 1 | round 2 | round 3 | median |" in text
    assert "| c=1 | 2.00x | 1.00x | 4.00x | 2.00x |" in text
