import json

import pytest

from benchmarks import run_suite


@pytest.mark.slow
def test_queue_benchmark_quick_writes_table_json_and_plot(tmp_path, capsys):
    run_suite("queue", quick=True, out=tmp_path)
    data = json.loads((tmp_path / "queue.json").read_text())
    assert {"machine", "results", "repeats"} <= set(data)
    for row in data["results"]:
        assert len(row["seconds"]["ours_put"]) == len(row["seconds"]["raw_put"]) == data["repeats"]
        assert row["ratio_put"] > 0 and row["ratio_read"] > 0
    assert (tmp_path / "queue.png").stat().st_size > 10_000
    assert "Replay stream throughput" in capsys.readouterr().out


def test_partition_benchmark_quick(tmp_path):
    data = run_suite("partition", quick=True, out=tmp_path)
    for case in data["cases"]:  # KK is never worse than a random equal-count split
        assert case["median"]["KK"] <= case["median"]["equal"]
    assert (tmp_path / "partition.png").exists() and (tmp_path / "partition.json").exists()
