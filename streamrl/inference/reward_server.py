"""``streamrl serve-reward``: a sequence-classification reward model behind ``POST /score``.

Requests that arrive together are scored together: a batcher collects pairs for up
to ``max_wait_ms`` (or ``max_batch_size`` of them) and runs one padded forward.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import torch
from fastapi import FastAPI, HTTPException, Response
from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger("streamrl.reward")


class Pair(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str | list[dict[str, str]]
    response: str


class ScoreIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pairs: list[Pair] = Field(min_length=1, max_length=4096)


class RewardModel:
    """The model and how a (prompt, response) pair becomes its input text."""

    def __init__(self, model: Any, tokenizer: Any, max_length: int = 2048):
        self.model, self.tokenizer, self.max_length = model.eval(), tokenizer, max_length
        self.tokenizer.truncation_side = "left"  # keep the response, cut the oldest context

    @classmethod
    def from_pretrained(cls, path: str, **kw) -> RewardModel:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        return cls(AutoModelForSequenceClassification.from_pretrained(path), AutoTokenizer.from_pretrained(path), **kw)

    def text(self, pair: Pair) -> str:
        messages = pair.prompt if isinstance(pair.prompt, list) else [{"role": "user", "content": pair.prompt}]
        if self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template(
                [*messages, {"role": "assistant", "content": pair.response}], tokenize=False)
        return "".join(m["content"] for m in messages) + pair.response

    @torch.no_grad()
    def score(self, pairs: list[Pair]) -> list[float]:
        batch = self.tokenizer([self.text(p) for p in pairs], return_tensors="pt", padding=True, truncation=True,
                               max_length=self.max_length, add_special_tokens=False)
        return self.model(**batch).logits[:, 0].float().tolist()


class Batcher:
    def __init__(self, model: RewardModel, max_batch_size: int, max_wait_ms: float):
        self.model, self.max_batch_size, self.max_wait_s = model, max_batch_size, max_wait_ms / 1000
        self.queue: asyncio.Queue[tuple[Pair, asyncio.Future]] = asyncio.Queue()

    async def score(self, pairs: list[Pair]) -> list[float]:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in pairs]
        for pair, future in zip(pairs, futures):
            self.queue.put_nowait((pair, future))
        return list(await asyncio.gather(*futures))

    async def run(self) -> None:
        while True:
            batch = [await self.queue.get()]
            deadline = asyncio.get_running_loop().time() + self.max_wait_s
            while len(batch) < self.max_batch_size:
                timeout = deadline - asyncio.get_running_loop().time()
                try:
                    batch.append(await asyncio.wait_for(self.queue.get(), max(timeout, 0)))
                except asyncio.TimeoutError:
                    break
            try:
                scores = await asyncio.to_thread(self.model.score, [pair for pair, _ in batch])
            except Exception as e:  # fail this batch's requests, keep serving
                log.exception("reward model failed")
                for _, future in batch:
                    future.set_exception(e)
                continue
            for (_, future), score in zip(batch, scores):
                future.set_result(score)


def create_reward_app(model: RewardModel, *, max_batch_size: int = 32, max_wait_ms: float = 5.0) -> FastAPI:
    batcher = Batcher(model, max_batch_size, max_wait_ms)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        task = asyncio.create_task(batcher.run())
        yield
        task.cancel()

    app = FastAPI(title="streamrl reward server", lifespan=lifespan)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.post("/score")
    async def score(req: ScoreIn) -> dict:
        try:
            return {"scores": await batcher.score(req.pairs)}
        except Exception as e:
            raise HTTPException(500, f"reward model error: {e}") from None

    return app


def serve_reward(cfg) -> None:
    import uvicorn

    if not cfg.reward.model_path:
        raise ValueError("reward.model_path is not set: give a local sequence-classification model directory")
    model = RewardModel.from_pretrained(cfg.reward.model_path, max_length=cfg.reward.max_length)
    app = create_reward_app(model, max_batch_size=cfg.reward.max_batch_size, max_wait_ms=cfg.reward.max_wait_ms)
    uvicorn.run(app, host=cfg.reward.host, port=cfg.reward.port, log_level="warning")
