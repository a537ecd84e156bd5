"""Async client for ``/generate``, used by rollout workers to talk to the router (or one server).

Token in, token out: it sends ``input_ids`` and returns the sampled ids with their
behaviour logprobs and the weight version of every token. Transport errors, 5xx and
429 are retried with exponential backoff; a 4xx is the caller's bug and is raised.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import time
from dataclasses import asdict

import httpx

from streamrl.rollout.engines.base import Completion, SamplingParams


class GenerateError(RuntimeError):
    """The server refused the request, or it kept failing after every retry."""


class GenerateClient:
    def __init__(self, base_url: str, *, timeout_s: float = 600.0, retries: int = 5, backoff_s: float = 0.25,
                 max_connections: int = 256):
        self.base_url = base_url.rstrip("/")
        self.retries = retries
        self.backoff_s = backoff_s
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=httpx.Timeout(timeout_s, connect=10),
                                       limits=httpx.Limits(max_connections=max_connections))

    async def generate(self, input_ids: list[int], params: SamplingParams, rid: str | None = None) -> Completion:
        sampling = asdict(params)
        sampling.update(stop_token_ids=list(params.stop_token_ids), stop=list(params.stop), n=1,
                        sampling_seed=sampling.pop("seed"))
        body = {"input_ids": list(input_ids), "sampling_params": sampling, "return_logprob": True, "stream": False}
        if rid is not None:
            body["rid"] = rid
        reply = await self._post("/generate", body)
        return _completion(reply)

    async def _post(self, path: str, body: dict) -> dict:
        last = "no attempt made"
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1) * (0.5 + random.random()))
            try:
                reply = await self._http.post(path, json=body)
            except httpx.TransportError as e:
                last = f"{type(e).__name__}: {e}"
                continue
            if reply.status_code == 200:
                return reply.json()
            last = f"HTTP {reply.status_code}: {reply.text[:500]}"
            if reply.status_code < 500 and reply.status_code != 429:
                raise GenerateError(f"{self.base_url}{path} refused the request: {last}")
        raise GenerateError(f"{self.base_url}{path} failed after {self.retries + 1} attempts: {last}")

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "GenerateClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


def _completion(reply: dict) -> Completion:
    """SGLang's response -> Completion, with per-token versions expanded from the spans."""
    try:
        meta = reply["meta_info"]
        ids = list(reply["output_ids"])
        logprobs = [float(lp) for lp, _, _ in meta["output_token_logprobs"]]
        versions = _versions(meta, len(ids))
        finish = meta["finish_reason"] or {"type": "abort"}
    except (KeyError, TypeError, ValueError) as e:
        raise GenerateError(f"malformed /generate response ({e!r}): {str(reply)[:300]}") from None
    if len(logprobs) != len(ids):
        raise GenerateError(f"response has {len(ids)} output ids but {len(logprobs)} logprobs")
    return Completion(output_ids=ids, logprobs=logprobs, versions=versions, finish_reason=finish)


def _versions(meta: dict, n: int) -> list[int]:
    spans = meta.get("weight_versions")
    if spans:
        versions = [0] * n
        for span in spans:
            versions[span["start"]:span["end"]] = [int(span["version"])] * (span["end"] - span["start"])
        return versions
    # A stock SGLang server reports one weight_version (a string) for the whole response.
    return [int(meta.get("weight_version") or 0)] * n


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout_s: float = 60.0) -> None:
    """Block until ``url/health`` answers 200; fail early if ``proc`` (the server) has exited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the process serving {url} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url}/health did not answer within {timeout_s:.0f}s")
