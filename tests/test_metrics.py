import json

import pytest

from streamrl.learner.metrics import MetricsSink


def test_jsonl_always_and_tensorboard_when_enabled(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install 'streamrl[tracking]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = MetricsSink(tmp_path, tensorboard=True)
    for step in (1, 2):
        sink.write({"step": step, "time": 0.0, "loss": 0.5 / step, "cursor": "1-0", "skipped": False})
    sink.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics" / "learner.jsonl").open()]
    assert [r["loss"] for r in lines] == [0.5, 0.25]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("learner/loss")] == [0.5, 0.25]
    assert "learner/cursor" not in events.Tags()["scalars"]


def test_wandb_without_the_package_is_a_clear_error(tmp_path):
    try:
        import wandb  # noqa: F401
        pytest.skip("wandb is installed")
    except ImportError:
        pass
    with pytest.raises(ValueError, match="pip install wandb"):
        MetricsSink(tmp_path, wandb_project="x")
