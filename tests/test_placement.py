"""Placing a run on a Ray cluster: what no cluster can hold is refused before anything starts, and a learner's
ranks get the variables torchrun would set. (The placing itself runs on real multi-node clusters in
tests/test_ray_nodes.py.)"""

import pytest

from streamrl.config import load_config
from streamrl.config.sections import Placement
from streamrl.launch.ray import Node, asked, rank_env, unplaceable


def _nodes() -> list[Node]:
    return [Node("10.0.0.1", {"CPU": 2.0}), Node("10.0.0.2", {"CPU": 4.0, "GPU": 1.0}, {"gpu": "a100"}),
            Node("10.0.0.3", {"CPU": 4.0, "GPU": 1.0, "inference": 1.0})]


def test_a_run_that_some_packing_holds_is_never_refused():
    requests = {"server": (2, Placement(cpus=1, gpus=1)), "learner": (2, Placement(cpus=2, strategy="STRICT_SPREAD")),
                "rollout": (4, Placement(cpus=0.1)), "router": (1, Placement(cpus=0.1, labels={"gpu": "a100"}))}
    assert unplaceable(requests, _nodes()) == []


@pytest.mark.parametrize(("requests", "says"), [
    ({"server": (1, Placement(gpus=2))}, "ray.server: each of 1 asks {CPU: 1, GPU: 2}, which no node has"),
    ({"server": (1, Placement(labels={"gpu": "h100"}))}, "on a node labelled {'gpu': 'h100'}, which no node has"),
    ({"server": (1, Placement(resources={"inference": 2}))}, "asks {CPU: 1, inference: 2}, which no node has"),
    ({"learner": (3, Placement(cpus=2, strategy="STRICT_PACK"))}, "STRICT_PACK puts all 3 on one node"),
    ({"learner": (4, Placement(cpus=2, strategy="STRICT_SPREAD"))}, "but only 3 node(s) have {CPU: 2}"),
    ({"server": (2, Placement(cpus=1, gpus=1)), "learner": (1, Placement(gpus=1))},
     "the run asks {CPU: 3, GPU: 3} in all; the cluster has {CPU: 10, GPU: 2}"),
])
def test_what_no_node_or_packing_can_hold_is_refused_naming_the_ask_and_the_cluster(requests, says):
    problems = unplaceable(requests, _nodes())
    assert any(says in p for p in problems), problems
    assert problems[-1].startswith("the cluster: 10.0.0.1 {CPU: 2}, 10.0.0.2 {CPU: 4, GPU: 1} labels {'gpu': 'a100'}")


def test_a_run_asks_a_bundle_per_part_and_per_learner_rank(tmp_path):
    cfg = load_config("configs/quickstart.yaml", [f"run.dir={tmp_path}", "server.count=3", "learner.nproc=2",
                                                  "rollout.workers=2"])
    assert asked(cfg) == {"server": 3, "learner": 2, "rollout": 2, "router": 1, "evaluator": 0}
    cfg.eval.dataset = "held_out.jsonl"
    assert asked(cfg)["evaluator"] == 1


def test_ranks_meet_at_rank_0s_node_numbered_as_torchrun_numbers_them():
    env = rank_env(["10.0.0.2", "10.0.0.3", "10.0.0.2"], 29500)
    assert [(e["RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) for e in env] == [("0", "0", "2"), ("1", "0", "1"),
                                                                                  ("2", "1", "2")]
    assert {(e["WORLD_SIZE"], e["MASTER_ADDR"], e["MASTER_PORT"]) for e in env} == {("3", "10.0.0.2", "29500")}
    # each rank given GPUs of its own by Ray sees them from device 0 (DeepSpeed sets the device from LOCAL_RANK)
    assert {e["LOCAL_RANK"] for e in rank_env(["10.0.0.2", "10.0.0.2"], 29500, own_gpus=True)} == {"0"}


def test_scale_takes_counts_and_refuses_what_it_cannot_do(tmp_path, ns, redis_server):
    import json

    import yaml

    from streamrl.launch import scale

    assert scale.parse(["servers=3", "workers=2"]) == {"servers": 3, "workers": 2}
    for bad in (["servers=-1"], ["learners=2"], ["servers"], []):
        with pytest.raises(ValueError, match="servers=N"):
            scale.parse(bad)
    with pytest.raises(FileNotFoundError, match="config.yaml does not exist"):
        scale.request(tmp_path, {"servers": 2})
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"run": {"name": ns.run}, "redis": {"url": redis_server.url}}))
    (tmp_path / "parts.json").write_text(json.dumps({"server-0": {"kind": "server"}, "server-1": {"kind": "server"},
                                                     "rollout-0": {"kind": "rollout"}}))
    with pytest.raises(ValueError, match=r"counts only grow .*: servers=1 \(the run has or was asked for 2\)"):
        scale.request(tmp_path, {"servers": 1, "workers": 1})
    scale.request(tmp_path, {"servers": 4})
    assert scale.wanted(ns) == {"server": 4}
    # asked for but not started yet: a smaller request is still refused, and would not undo the first
    with pytest.raises(ValueError, match=r"servers=3 \(the run has or was asked for 4\)"):
        scale.request(tmp_path, {"servers": 3})
    scale.request(tmp_path, {"workers": 2})
    assert scale.wanted(ns) == {"server": 4, "rollout": 2}


@pytest.mark.parametrize(("value", "selector", "selected"), [
    ("a100", "a100", True), ("a100", "h100", False), (None, "a100", False), ("a100", "!h100", True),
    ("a100", "!a100", False), (None, "!a100", True), ("a100", "in(h100,a100)", True), ("a100", "!in(h100,a100)", False),
    ("a100", "in(h100, a100)", False),  # as Ray reads it: " a100" is another value
])
def test_label_selectors_read_as_ray_reads_them(value, selector, selected):
    from streamrl.launch.ray import _selects

    assert _selects(value, selector) == selected
