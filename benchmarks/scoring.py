"""Held-out scores of a run's final weights, off the clock: greedy episodes of the run's own env, each reply
scored by the env itself (the same verdict the run trained on), every episode played to its end."""

from __future__ import annotations

import asyncio
from pathlib import Path

from streamrl.envs.base import Action
from streamrl.envs.registry import env_factory


def greedy_replies(model, tokenizer, conversations: list[list[dict]], max_new_tokens: int,
                   batch: int = 64) -> list[str]:
    """Each conversation's greedy reply (chat template, up to ``max_new_tokens``), ``batch`` at a time."""
    import torch

    was_training, side = model.training, tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"
    replies = []
    for i in range(0, len(conversations), batch):
        text = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                for c in conversations[i: i + batch]]
        enc = tokenizer(text, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        replies += tokenizer.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
    model.train(was_training)
    tokenizer.padding_side = side
    return [r.strip() for r in replies]


def play_episodes(cfg, items: list[dict], reply) -> dict[str, float]:
    """First-try accuracy and mean reward of ``reply(conversations) -> texts`` in the env's episodes on ``items``.
    The episodes still running answer together, turn by turn: a multi-turn env (a retry after feedback) gets
    its later turns, and its checker's wall time passes once per turn for all of them."""
    make = env_factory(cfg.rollout.env, cfg.rollout.env_args)
    envs = [make() for _ in items]
    ended: dict[int, object] = {}
    with asyncio.Runner() as loop:
        firsts = loop.run(_gather(env.reset(item) for env, item in zip(envs, items)))
        if any(o.token_ids is not None for o in firsts):
            raise ValueError(f"env {cfg.rollout.env!r} observes in token ids: greedy episodes need chat messages")
        conversations = [list(o.messages) for o in firsts]
        running = list(range(len(items)))
        while running:
            texts = reply([conversations[i] for i in running])
            results = loop.run(_gather(envs[i].step(Action(text=t, token_ids=[])) for i, t in zip(running, texts)))
            for i, text, result in zip(running, texts, results):
                if result.done:
                    ended[i] = result
                else:
                    conversations[i] += [{"role": "assistant", "content": text}, *result.observation.messages]
            running = [i for i in running if i not in ended]
        loop.run(_gather(env.close() for env in envs))
    right_first = sum(bool(r.info.get("correct", r.reward >= 1.0)) and r.info.get("tries", 1) == 1
                      for r in ended.values())
    return {"accuracy": right_first / len(items), "reward": sum(r.reward for r in ended.values()) / len(items)}


async def _gather(coroutines):
    return await asyncio.gather(*coroutines)


def held_out(cfg, model_dir: Path, items: list[dict]) -> dict[str, float]:
    """``play_episodes`` of the weights saved in ``model_dir`` (an export: weights and tokenizer), loaded in fp32
    whatever they trained in."""
    import torch
    from transformers import AutoModelForCausalLM

    from streamrl.models import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = load_tokenizer(model_dir)
    return play_episodes(cfg, items, lambda conversations: greedy_replies(
        model, tokenizer, conversations, cfg.rollout.sampling.max_new_tokens))
