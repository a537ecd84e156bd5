from pathlib import Path

import pytest

from streamrl.config import Config, ConfigError, dump_config, load_config

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


def test_there_are_shipped_configs():
    assert any(p.name == "quickstart.yaml" for p in CONFIGS)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads_and_round_trips(path, tmp_path):
    config = load_config(path)
    assert isinstance(config, Config)
    dumped = tmp_path / "resolved.yaml"
    dumped.write_text(dump_config(config))
    assert load_config(dumped) == config


def test_defaults_without_a_file():
    config = load_config()
    assert config.redis.url is None and config.router.host is None  # found: loopback, or the node under Ray
    assert config.run.path == Path("runs/default")


def test_overrides_take_natural_types():
    config = load_config(None, ["learner.lr=3e-6", "rollout.sampling.n=4", "mode=sync",
                                "redis.url=redis://:pw@10.0.0.1:6379/0", "rollout.env_args={digits: 3}",
                                "server.token=", "learner.clip_eps_high=0.28"])
    assert config.learner.lr == 3e-6
    assert config.rollout.sampling.n == 4
    assert config.mode == "sync"
    assert config.redis.url == "redis://:pw@10.0.0.1:6379/0"
    assert config.rollout.env_args == {"digits": 3}
    assert config.server.token is None
    assert config.learner.clip_eps_high == 0.28


def test_override_beats_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learner:\n  lr: 0.1\n  max_steps: 7\n")
    config = load_config(path, ["learner.lr=0.2"])
    assert (config.learner.lr, config.learner.max_steps) == (0.2, 7)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["learner.lr=fast"], r"learner\.lr: .*(number|float).*got 'fast'"),
        (["learner.lr=-1"], r"learner\.lr: Input should be greater than 0 \(got -1\)"),
        (["learner.algorithm=dpo"], r"learner\.algorithm: Input should be 'rloo', 'grpo' or 'ppo' \(got 'dpo'\)"),
        (["learner.lrr=1"], r"learner\.lrr: unknown key \(did you mean 'learner\.lr'\?\)"),
        (["lerner.lr=1"], r"lerner: unknown key \(did you mean 'learner'\?\)"),
        (["learner.lr.x=1"], r"learner\.lr is a value, not a section"),
        (["learner"], r"must look like section\.field=value"),
        (["redis.url=http://x"], r"url must start with redis://"),
        (["run.name=a/b"], r"run\.name: String should match pattern"),
        (["learner.balance=flop"], r"learner\.balance: Input should be 'tokens' or 'flops'"),
    ],
)
def test_bad_overrides_name_the_field_the_value_and_the_expectation(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


@pytest.mark.parametrize(
    "text, message",
    [
        ("learner:\n  lr: [1, 2]\n", r"learner\.lr: .* \(got \[1, 2\]\)"),
        ("learner:\n  warmup: 3\n", r"learner\.warmup: unknown key \(did you mean 'learner\.warmup_steps'\?\)"),
        ("- a\n- b\n", "must be a mapping at the top level, got list"),
        ("learner: [\n", "not valid YAML"),
        ("learner: 3\n", r"learner: Input should be a valid dictionary"),
    ],
)
def test_bad_files_name_the_problem(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as info:
        load_config(path)
    assert "bad.yaml" in str(info.value)


def test_missing_file():
    with pytest.raises(ConfigError, match="config file not found: nope.yaml"):
        load_config("nope.yaml")


def test_empty_file_gives_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(path) == Config()




def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key != "env_args":
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_the_agentic_config_is_the_quickstart_with_its_env_and_learner_tuned():
    """bench e2e and bench ablation run both configs as the same task: nothing else may drift apart."""
    quickstart, agentic = (_flat(load_config(f"configs/{n}.yaml").model_dump(mode="json")) for n in ("quickstart", "agentic"))
    changed = {key for key in quickstart if quickstart[key] != agentic[key]}
    assert changed == {"run.name", "rollout.env", "rollout.env_args", "rollout.concurrency", "rollout.env_concurrency",
                       "off_policy.max_staleness", "learner.lr", "learner.minibatches", "learner.credit",
                       "learner.turn_lam"}


def test_the_agentic_smollm2_recipe_prepares_the_wrapped_tasks_questions(tmp_path):
    """Its env is the retry loop, whose settings are not the arithmetic task's: prepare takes the task's own."""
    import json

    from streamrl.config import load_config
    from streamrl.recipes.smollm2 import prepare

    cfg = load_config("configs/smollm2-agentic.yaml", [f"run.dir={tmp_path}"])
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # a converted model is there: prepare makes only the questions
    made = prepare(cfg, **{**cfg.prepare.args, "model_dir": str(model), "eval_size": 8, "train_size": 16})
    rows = [json.loads(x) for x in open(made["rollout.dataset"])]
    held_out = [json.loads(x) for x in open(made["eval.dataset"])]
    assert len(rows) == 16 and len(held_out) == 8
    assert all(" + " in r["question"] and int(r["answer"]) < 200 for r in rows + held_out)  # two-digit additions
    assert not {r["question"] for r in rows} & {r["question"] for r in held_out}
