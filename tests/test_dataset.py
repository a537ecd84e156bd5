import json
from dataclasses import replace

import httpx
import numpy as np
import pytest

from streamrl.buffer.redis_server import free_port
from streamrl.dataset import DatasetError, Prompts, load_rows
from streamrl.protocol import Sample
from streamrl.rollout.worker import EnvFault, WorkerMetrics


def test_jsonl_and_parquet_rows_repeat_by_epoch(tmp_path):
    rows = [{"question": f"q{i}", "answer": i} for i in range(3)]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    for path in (jsonl, parquet):
        prompts = Prompts(rows=load_rows(path))
        assert [prompts[i]["answer"] for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_a_seed_reads_each_epoch_in_its_own_order_the_same_in_every_process():
    rows = [{"answer": i} for i in range(50)]
    read = [Prompts(rows=rows, seed=7)[i]["answer"] for i in range(150)]
    epochs = [read[:50], read[50:100], read[100:]]
    assert all(sorted(e) == list(range(50)) for e in epochs)  # every row once an epoch
    assert epochs[0] != epochs[1] and epochs[0] != list(range(50))
    again = Prompts(rows=rows, seed=7)  # another worker, or a restarted one, asking out of order
    assert [again[i]["answer"] for i in (120, 3, 77, 3)] == [read[120], read[3], read[77], read[3]]
    assert [Prompts(rows=rows, seed=8)[i]["answer"] for i in range(50)] != epochs[0]
    assert [Prompts(rows=rows, seed=-1)[i]["answer"] for i in range(50)] != epochs[0]


def test_a_saved_hugging_face_dataset(tmp_path):
    datasets = pytest.importorskip("datasets", reason="datasets is not installed (pip install 'streamrl[data]')")
    rows = [{"prompt": "a", "answer": 1}, {"prompt": "b", "answer": 2}]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(tmp_path / "hf")
    assert load_rows(tmp_path / "hf") == rows
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="not a dataset saved with save_to_disk"):
        load_rows(tmp_path / "empty")


def test_a_generator_is_indexed_deterministically():
    prompts = Prompts(generator=lambda: iter(range(100, 200)))
    assert prompts[5] == 105 and prompts[2] == 102 and prompts[50] == 150


@pytest.mark.parametrize("content, message", [
    ('{"a": 1}\nnot json\n', r"d.jsonl:2: not valid JSON"),
    ('[1, 2]\n', r"d.jsonl:1: each line must be a JSON object, got list"),
    ("", "the dataset has no rows"),
])
def test_bad_dataset_files_name_the_line(tmp_path, content, message):
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    with pytest.raises(DatasetError, match=message):
        Prompts(rows=load_rows(path))


def test_unknown_format_and_missing_file(tmp_path):
    with pytest.raises(DatasetError, match="dataset file not found"):
        load_rows(tmp_path / "nope.jsonl")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match="unsupported dataset format '.csv'"):
        load_rows(tmp_path / "d.csv")


def test_worker_metrics_go_to_jsonl_and_prometheus(tmp_path):
    port = free_port()
    metrics = WorkerMetrics(tmp_path / "m.jsonl", prometheus_port=port)
    metrics.failure(EnvFault("boom"))
    metrics.pushed(staleness=1, seconds=0.5)
    metrics.pushed(staleness=3, seconds=1.5)
    one_turn = Sample(tokens=np.arange(4), loss_mask=np.array([0, 0, 1, 1]), logprobs=np.zeros(4),
                      versions=np.array([-1, -1, 5, 5]), reward=1.0, env_info={"turns": 1})
    # two turns, the second generated after a weight update (versions 5 then 7)
    two_turns = replace(one_turn, versions=np.array([-1, 5, -1, 7]), loss_mask=np.array([0, 1, 0, 1]),
                        reward=0.0, env_info={"turns": 2})
    metrics.episode(one_turn)
    metrics.episode(two_turns)
    metrics.write({"accepted": 2})
    metrics.write({"accepted": 2})  # a report covers only what happened since the last one
    first, second = map(json.loads, (tmp_path / "m.jsonl").read_text().splitlines())
    assert first["failed_env"] == 1 and first["groups_pushed"] == 2 and first["ledger"] == {"accepted": 2}
    assert first["group_s_mean"] == 1.0 and first["group_s_std"] == 0.5 and first["staleness_mean"] == 2.0 and first["staleness_max"] == 3
    assert first["episodes"] == 2 and first["reward_mean"] == 0.5 and first["tokens_per_s"] > 0
    assert first["turns_mean"] == 1.5 and first["version_span_mean"] == 1.0
    assert second["group_s_mean"] is None and "groups_pushed" not in second and second["turns_mean"] is None
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    assert 'streamrl_rollout_events_total{event="failed_env"} 1.0' in text
