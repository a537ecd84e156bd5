"""The how-to in docs/envs.md runs as written."""

import asyncio
import re
import sys
from pathlib import Path

from streamrl.envs import Action, env_class

DOC = Path(__file__).parent.parent / "docs" / "envs.md"


def test_the_write_your_own_env_example_is_short_and_works(tmp_path, monkeypatch):
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    assert len(code.strip().splitlines()) <= 40
    (tmp_path / "my_envs.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_envs", None)
    cls = env_class("my_envs:ReverseWord")  # found by path, as the config names it

    env = cls()
    item = next(env.items(seed=0))
    obs = asyncio.run(env.reset(item))
    assert item["word"] in obs.messages[0]["content"]
    miss = asyncio.run(env.step(Action(text="wrong", token_ids=[])))
    assert not miss.done and "starts with" in miss.observation.messages[0]["content"]
    hit = asyncio.run(env.step(Action(text=item["word"][::-1], token_ids=[])))
    assert hit.done and hit.reward == 0.5
