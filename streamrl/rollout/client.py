"""Async client for ``/generate``, used by rollout workers to talk to the router (or one server).

Token in, token out: it sends ``input_ids`` and returns the sampled ids with their
behaviour logprobs and the weight version of every token; ``n`` samples of one
context go out as one request (SGLang's ``n``). Transport errors, 5xx and 429 are
retried with exponential backoff; a 4xx is the caller's bug and is raised.

aiohttp, not httpx, carries this hot path: httpx's connection pool scans every
connection per request, which cost 8x the requests/s at 64 requests in flight
(measured on the quickstart; httpx stays for the low-rate control calls).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import subprocess
import time
from collections.abc import Coroutine
from dataclasses import asdict

import aiohttp
import httpx

from streamrl.buffer import Namespace, RouterAddress
from streamrl.config import Config
from streamrl.generation import Completion, SamplingParams

log = logging.getLogger("streamrl.client")


def run_event_loop(main: Coroutine) -> None:
    """Run a rollout process's event loop on uvloop where it is installed (Linux and macOS): a worker
    schedules a few dozen callbacks per episode, and uvloop's cost a fraction of asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


class GenerateError(RuntimeError):
    """The server refused the request (``status``: its 4xx), or it kept failing after every retry."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class GenerateClient:
    def __init__(self, base_url: str, *, timeout_s: float = 600.0, retries: int = 5, backoff_s: float = 0.25,
                 max_connections: int = 256):
        self.base_url = base_url.rstrip("/")
        self.retries = retries
        self.backoff_s = backoff_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, connect=10)
        self._limit = max_connections
        self._http: aiohttp.ClientSession | None = None

    async def generate(self, input_ids: list[int], params: SamplingParams, rid: str | None = None,
                       priority: int = 0) -> Completion:
        return (await self.generate_n(input_ids, params, 1, rid, priority))[0]

    async def generate_n(self, input_ids: list[int], params: SamplingParams, n: int,
                         rid: str | None = None, priority: int = 0) -> list[Completion]:
        """``n`` independent samples continuing ``input_ids``, in one request; larger ``priority`` is
        served sooner by a busy server."""
        sampling = asdict(params)
        sampling.update(stop_token_ids=list(params.stop_token_ids), stop=list(params.stop), n=n,
                        sampling_seed=sampling.pop("seed"))
        body = {"input_ids": list(input_ids), "sampling_params": sampling, "return_logprob": True, "stream": False}
        if rid is not None:
            body["rid"] = rid
        if priority:
            body["priority"] = priority
        reply = await self._post("/generate", body)
        replies = reply if isinstance(reply, list) else [reply]
        if len(replies) != n:
            raise GenerateError(f"asked for {n} samples, the server returned {len(replies)}")
        return [_completion(r) for r in replies]

    async def _post(self, path: str, body: dict):
        if self._http is None:  # created lazily: a session belongs to the running event loop
            self._http = aiohttp.ClientSession(timeout=self._timeout, connector=aiohttp.TCPConnector(limit=self._limit),
                                               json_serialize=json.dumps)
        last = "no attempt made"
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1) * (0.5 + random.random()))
            try:
                async with self._http.post(self.base_url + path, json=body) as reply:
                    status, text = reply.status, await reply.text()
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                last = f"{type(e).__name__}: {e}"
                continue
            if status == 200:
                try:
                    return json.loads(text)
                except ValueError:
                    raise GenerateError(f"{self.base_url}{path} answered with invalid JSON: {text[:300]}") from None
            last = f"HTTP {status}: {text[:500]}"
            if status < 500 and status != 429:
                raise GenerateError(f"{self.base_url}{path} refused the request: {last}", status)
        raise GenerateError(f"{self.base_url}{path} failed after {self.retries + 1} attempts: {last}")

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def __aenter__(self) -> GenerateClient:
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
    # A stock SGLang server reports one weight_version label for the whole response: "default" for the weights
    # it started with (version 0), else the label of its last update (streamrl's pushes label them with numbers).
    label = meta.get("weight_version") or 0
    return [0 if label == "default" else int(label)] * n


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


class RouterLocator:
    """Where a rollout worker or the evaluator sends ``/generate``: the configured router, else the one that
    announced itself in Redis, followed when a restart on another node announces a new address."""

    def __init__(self, cfg: Config, ns: Namespace):
        host = cfg.router.host
        self.fixed = cfg.rollout.router_url or (f"http://{host}:{cfg.router.port}" if host else None)
        self.address = RouterAddress(ns, ttl_s=cfg.server.registry_ttl_s)

    async def url(self, every_s: float = 0.5) -> str:
        """The router's URL; waits for its announcement (the router may start after us, or move)."""
        said = False
        while (url := self.fixed or await asyncio.to_thread(self.address.get)) is None:
            if not said:
                log.info("waiting for the router to announce itself in Redis (router.host or rollout.router_url "
                         "would name it)")
                said = True
            await asyncio.sleep(every_s)
        return url

    async def follow(self, client, every_s: float = 1.0) -> None:
        """Point ``client`` at the router's newest announced URL, until cancelled. Requests already sent to the
        old address fail and are retried by the client, now against the new one."""
        if self.fixed:
            return
        while True:
            await asyncio.sleep(every_s)
            try:
                url = await asyncio.to_thread(self.address.get)
            except Exception as e:  # Redis away for a moment: keep the address we have
                log.warning("could not look up the router: %s", e)
                continue
            if url and url != client.base_url:
                log.info("the router moved: %s -> %s", client.base_url, url)
                client.base_url = url
