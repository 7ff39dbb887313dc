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


def test_step_ops_results_become_one_row_per_config_batch_and_temperature():
    result = {"steps": [{"config": "mcsd:4,2,2", "batch": 8, "temperature": 0.0, "device_ops": 206, "h2d": 23,
                         "forwards": 4, "reads": 1, "host_ms": 6.5, "serial_ms": 1.1, "steps": 4, "top": []},
                        {"config": "plain", "batch": 1, "temperature": 0.7, "device_ops": 21, "h2d": 4,
                         "forwards": 1, "reads": 1, "steps": 4, "top": []}],
              "forward": []}
    rows = rows_of(result)
    assert rows["mcsd:4,2,2 b=8 T=0.0"] == {"host_ms": 6.5, "serial_ms": 1.1, "device_ops": 206.0, "h2d": 23.0}
    assert rows["plain b=1 T=0.7"] == {"device_ops": 21.0, "h2d": 4.0}  # not timed: no host_ms
