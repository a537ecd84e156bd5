"""The ``vllm`` engine: vLLM's ``AsyncLLM`` behind the interface the ``hf`` engine implements.

GPU only, and unverified on the CPU machines this project is developed on: it is written
against vLLM's v1 API as read from vLLM's source, and its tests (tests/test_vllm_engine.py)
run only where CUDA and vllm are installed (``pip install streamrl[gpu]``).

Behaviour logprobs. The engine runs with ``logprobs_mode="processed_logprobs"`` and asks for
``logprobs=0`` (the sampled token only). vLLM has no mode for what streamrl's learner computes
(the tempered distribution *before* top-k/top-p, see ``streamrl.rollout.sampling``):
``processed_logprobs`` is the log-softmax after temperature *and* truncation, renormalised over
the kept tokens; ``raw_logprobs`` is before temperature. So the logprobs are exact when
``top_k == -1 and top_p == 1``; with truncation each is higher by ``-log(mass kept)``. Greedy
(temperature 0) reports temperature-1 logprobs, as the hf engine does.

Versions. Tokens stream back as deltas and each delta is stamped with ``self.version`` as it
arrives. ``update_weights`` pauses with ``mode="keep"`` (in-flight requests freeze, then carry
on), loads the tensors, preempts the frozen requests so their KV cache is recomputed under the
new weights, resets the prefix cache, bumps the version and resumes.

Weights. ``update_weights`` gets CPU tensors (``(name, tensor)`` in checkpoint naming). They go
as plain bytes through ``AsyncLLM.collective_rpc`` to ``VLLMWorkerExtension`` (vLLM's
``worker_extension_cls`` hook) in each worker, which calls ``model.load_weights``. Bytes, not
tensors, because vLLM decodes utility-call arguments untyped, so a tensor would not survive
the trip. Unquantized checkpoints only (no ``process_weights_after_loading``).

Threads. ``AsyncLLM`` is bound to the event loop it first runs on, so the engine owns one
private loop thread and every vLLM call runs there. ``generate`` and ``update_weights`` can be
awaited from any loop, and the sync controls (abort, pause, resume) can be called from any
thread except that one.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine, Iterable, Iterator
from types import SimpleNamespace
from typing import Any

import torch

from streamrl.rollout.engines.base import Completion, SamplingParams

GPU_HINT = "the vllm engine needs `pip install streamrl[gpu]` on a CUDA machine"
CHUNK_BYTES = 1 << 30  # weights travel in collective_rpc calls of about 1 GiB each

log = logging.getLogger(__name__)


def _import_vllm() -> SimpleNamespace:
    try:
        import vllm
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError as e:
        raise ImportError(GPU_HINT) from e
    return SimpleNamespace(AsyncLLM=AsyncLLM, AsyncEngineArgs=AsyncEngineArgs,
                           SamplingParams=vllm.SamplingParams, TokensPrompt=vllm.TokensPrompt,
                           DELTA=RequestOutputKind.DELTA)


class VLLMEngine:
    def __init__(self, model_path: str, *, dtype: str = "bfloat16", max_batch_size: int = 256,
                 **engine_kwargs: Any):
        self._v = _import_vllm()
        self.version = 0
        self._tokens: dict[str, int] = {}  # rid -> prompt + generated tokens, for load() and abort
        self._aborting: set[str] = set()
        self._user_paused = False
        self._swap_lock = asyncio.Lock()  # one weight update at a time
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-engine",
                                        daemon=True)
        self._thread.start()
        args = {"model": model_path, "dtype": dtype, "max_num_seqs": max_batch_size,
                "logprobs_mode": "processed_logprobs", "scheduling_policy": "priority",
                "worker_extension_cls": f"{__name__}.VLLMWorkerExtension", **engine_kwargs}
        try:
            self._llm = self._call(self._start(args))
        except BaseException:
            self._stop_loop()
            raise
        self._vocab = self._llm.model_config.get_vocab_size()

    async def _start(self, args: dict) -> Any:
        # Built on the engine loop, so AsyncLLM starts its output handler there.
        return self._v.AsyncLLM.from_engine_args(self._v.AsyncEngineArgs(**args))

    # ------------------------------------------------------------------ Engine protocol

    async def generate(self, rid: str, input_ids: list[int], params: SamplingParams,
                       priority: int = 0) -> Completion:
        if not input_ids:
            raise ValueError("input_ids is empty")
        if min(input_ids) < 0 or max(input_ids) >= self._vocab:
            raise ValueError(f"input_ids must be in [0, {self._vocab})")
        return await self._on_loop(self._generate(rid, list(input_ids), params, priority))

    def abort(self, rid: str | None = None) -> None:
        """Finish matching requests (every tracked one when ``rid`` is None) as ``abort``."""
        self._call(self._abort(rid), timeout=60)

    def pause(self) -> None:
        self._user_paused = True
        self._call(self._llm.pause_generation(mode="keep", clear_cache=False), timeout=300)

    def resume(self) -> None:
        self._user_paused = False
        self._call(self._llm.resume_generation(), timeout=60)

    async def update_weights(self, named_tensors: list, version: int) -> None:
        await self._on_loop(self._update_weights(named_tensors, version))

    def load(self) -> dict:
        # vLLM queues every request in its own scheduler; from here all tracked ones are running.
        tokens = list(self._tokens.values())
        return {"num_reqs": len(tokens), "num_waiting_reqs": 0, "num_tokens": sum(tokens)}

    def shutdown(self) -> None:
        if not self._thread.is_alive():
            return
        try:
            self._call(self._close(), timeout=120)
        finally:
            self._stop_loop()

    # ------------------------------------------------------------------ engine loop

    async def _generate(self, rid: str, input_ids: list[int], params: SamplingParams, priority: int) -> Completion:
        out = Completion()
        self._tokens[rid] = len(input_ids)
        prompt = self._v.TokensPrompt(prompt_token_ids=input_ids)
        try:
            # vLLM's priority policy serves smaller values first: ours is SGLang's order, larger first
            async for step in self._llm.generate(prompt, self._sampling(params), rid, priority=-priority):
                delta = step.outputs[0]
                ids = list(delta.token_ids)
                # DELTA mode slices logprobs to the new tokens, except that [-0:] is everything
                logprobs = (delta.logprobs or [])[-len(ids):] if ids else []
                out.output_ids += ids
                out.logprobs += [lp[t].logprob for t, lp in zip(ids, logprobs, strict=True)]
                out.versions += [self.version] * len(ids)
                self._tokens[rid] += len(ids)
                if step.finished:
                    out.finish_reason = finish_reason(delta.finish_reason, delta.stop_reason,
                                                      out.output_ids)
                elif rid in self._aborting:  # abort() ran before vLLM had registered the request
                    await self._llm.abort(rid)
        finally:
            self._tokens.pop(rid, None)
            self._aborting.discard(rid)
        return out

    async def _abort(self, rid: str | None) -> None:
        rids = [r for r in self._tokens if rid is None or r == rid]
        if rids:  # vLLM answers each aborted generate() with a final finish_reason "abort"
            self._aborting.update(rids)
            await self._llm.abort(rids)

    def _sampling(self, p: SamplingParams) -> Any:
        return self._v.SamplingParams(
            max_tokens=p.max_new_tokens, temperature=p.temperature, top_p=p.top_p,
            top_k=p.top_k,  # vLLM reads -1 (and 0) as "no limit"
            stop_token_ids=list(p.stop_token_ids), stop=list(p.stop) or None,
            ignore_eos=p.ignore_eos, seed=p.seed,
            logprobs=0,  # just the sampled token's logprob
            detokenize=bool(p.stop),  # text is only needed to match stop strings
            output_kind=self._v.DELTA,  # each output carries only the new tokens
        )

    async def _update_weights(self, named_tensors: list, version: int) -> None:
        async with self._swap_lock:
            # "keep": running requests freeze in the scheduler and go on after the resume.
            await self._llm.pause_generation(mode="keep", clear_cache=False)
            try:
                for chunk in _chunks(named_tensors):
                    results = await self._llm.collective_rpc("streamrl_load_weights",
                                                             args=(chunk,))
                    if errors := [e for e in results if e]:
                        raise RuntimeError(f"vllm could not load the weights: {errors[0]}")
                # The frozen requests hold KV computed by the old weights: preempt them so it is
                # recomputed on resume, and drop cached prefixes for the same reason.
                if not await self._llm.reset_prefix_cache(reset_running_requests=True):
                    log.warning("vllm refused to reset its prefix cache; stale KV may be reused")
                self.version = version
            finally:
                if not self._user_paused:
                    await self._llm.resume_generation()

    async def _close(self) -> None:
        self._llm.shutdown()

    # ------------------------------------------------------------------ plumbing

    def _call(self, coro: Coroutine, timeout: float | None = None) -> Any:
        """Run ``coro`` on the engine loop and wait for it; not from the engine thread itself."""
        if threading.current_thread() is self._thread or not self._thread.is_alive():
            coro.close()
            raise RuntimeError("the vllm engine is shut down or was called from its own thread")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _on_loop(self, coro: Coroutine) -> Any:
        """Await ``coro`` on the engine loop from whatever loop the caller runs."""
        if not self._thread.is_alive():
            coro.close()
            raise RuntimeError("the vllm engine is shut down")
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)


def finish_reason(reason: str | None, stop_reason: int | str | None, output_ids: list[int]) -> dict:
    """vLLM's finish/stop reasons in SGLang's shape."""
    if reason == "length":
        return {"type": "length", "length": len(output_ids)}
    if reason == "stop":  # stop_reason: the stop token id or string; None means EOS, the last token
        if stop_reason is None:
            stop_reason = output_ids[-1] if output_ids else None
        return {"type": "stop", "matched": stop_reason}
    return {"type": "abort", "message": "aborted" if reason == "abort" else f"vllm: {reason}"}


# ---------------------------------------------------------------------- weights over collective_rpc


def _chunks(named_tensors: Iterable[tuple[str, torch.Tensor]],
            limit: int = CHUNK_BYTES) -> Iterator[list[tuple[str, str, list[int], bytes]]]:
    """Pack tensors as ``(name, dtype, shape, bytes)``, in lists of about ``limit`` bytes.

    Plain msgpack types, so they cross vLLM's untyped utility-call decoding intact.
    """
    chunk: list = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and size + nbytes > limit:
            yield chunk
            chunk, size = [], 0
        t = tensor.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        chunk.append((name, str(t.dtype).removeprefix("torch."), list(t.shape), raw))
        size += nbytes
    if chunk:
        yield chunk


def _unpack(dtype: str, shape: list[int], raw: bytes) -> torch.Tensor:
    if not raw:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)  # bytearray: writable, no warning
    return flat.view(getattr(torch, dtype)).reshape(shape)


class VLLMWorkerExtension:
    """Mixed into every vLLM worker (``worker_extension_cls``): the far end of update_weights."""

    def streamrl_load_weights(self, packed: list) -> str | None:
        """Load one chunk from ``_chunks``; returns an error message instead of raising one."""
        model = self.get_model() if hasattr(self, "get_model") else self.model_runner.model
        weights = ((name, _unpack(dtype, shape, raw)) for name, dtype, shape, raw in packed)
        try:
            model.load_weights(weights=weights)  # in place, so CUDA graphs stay valid
        except (KeyError, ValueError, AssertionError, RuntimeError) as e:
            return f"{type(e).__name__}: {e}"
        torch.cuda.synchronize()
        return None
