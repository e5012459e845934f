"""A short soak in the suite (the 2,000-request run is `tokios soak`, docs/reliability.md).

200 mixed requests (chat and completions, streamed and not, n > 1, logprobs, stop strings,
streams dropped mid-way, malformed bodies) through tools/soak.py against the shared server:
every well-formed request succeeds, every malformed one gets a 4xx, and afterwards no KV block,
request, descriptor or asyncio task is left over. The RSS ceiling needs the long run to mean
anything (warm-up dominates 200 requests), so it is checked there.
"""

from __future__ import annotations

import asyncio

import pytest

from tokios.tools.soak import format_report, run_soak


@pytest.mark.slow
def test_a_short_soak_leaves_nothing_behind(tokios_server):
    report = asyncio.run(run_soak(tokios_server.base_url, num_requests=200, concurrency=12, seed=16,
                                  api_key=tokios_server.api_key, check_rss=False))
    print(format_report(report))
    assert not report.failures, format_report(report)
    assert report.outcomes.get("stream_cancelled", 0) > 0 and report.outcomes.get("malformed_4xx", 0) > 0
