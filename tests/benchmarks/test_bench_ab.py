"""bench_ab.py reads the results of the benchmarks it compares."""

import pytest

from benchmarks.bench_ab import rows_of


def test_forward_results_become_one_row_per_block_size():
    result = {"forward": [{"variant": "ours", "rows_1_ms": 60.0, "rows_8_ms": 150.0, "prefill_ms": 5000.0,
                           "prefill_tok_s": 60.0, "top_over_one": 2.5}]}
    rows = rows_of(result)
    assert rows == {"ours rows 1": {"ms": 60.0}, "ours rows 8": {"ms": 150.0}, "ours prefill": {"ms": 5000.0}}


def test_serving_results_and_unknown_formats():
    result = {"results": [{"mode": "spec", "concurrency": 4, "output_throughput_tok_s": 12.5,
                           "ttft_ms": {"p50": 900.0}, "e2e_ms": {"mean": 5000.0}}]}
    row = rows_of(result)["spec c=4"]
    assert row["output_throughput_tok_s"] == 12.5 and row["ttft_ms.p50"] == 900.0
    assert row["mean_accepted_length"] != row["mean_accepted_length"]  # absent: NaN, never a made-up value
    with pytest.raises(ValueError, match="unknown result format"):
        rows_of({"something": []})
