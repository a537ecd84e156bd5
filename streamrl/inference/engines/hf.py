"""The ``hf`` engine: a transformers causal LM with continuous batching, for CPU (and GPU).

One engine thread owns the model. Between decode steps it admits waiting requests
(prefilled together, each distinct prompt once, then merged into the running batch), applies queued weight
updates, honours pause, and retires finished sequences; every running sequence
advances one token per step. The batch keeps one KV cache, left-padded, with an
attention mask and explicit positions, so sequences of any length share a forward.

LoRA: the engine merges each adapter version into the served weights as it arrives (``load_adapter``), the
route that keeps its in-flight swaps and exact per-token versions; the push still carries the adapter alone.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from streamrl import adapters
from streamrl.adapters import AdapterSpec, LoraServing
from streamrl.generation import Completion, PromptScores, SamplingParams
from streamrl.inference.engines.hf_cache import SlackLayer
from streamrl.inference.engines.hf_weights import Weights
from streamrl.inference.engines.sampling import sample_batch
from streamrl.inference.engines.weight_receiver import AdapterReceiver, HostReceiver
from streamrl.weightsync import Probe


@dataclass
class _Sequence:
    rid: str
    prompt: list[int]
    params: SamplingParams
    future: Future
    generator: torch.Generator | None
    out: Completion = field(default_factory=Completion)
    aborted: bool = False


class HFEngine:
    def __init__(self, model: PreTrainedModel, *, max_batch_size: int = 64, eos_token_ids: tuple[int, ...] = (),
                 tokenizer=None, lora: LoraServing | None = None):
        self.model = model.eval()
        self.lora = lora
        self.adapter_name = lora.name if lora else None
        self.weights = Weights(self.model)
        self.tokenizer = tokenizer  # only needed for stop strings
        self.max_batch_size = max_batch_size
        self.max_length = getattr(model.config, "max_position_embeddings", None) or 2**31
        config_eos = model.generation_config.eos_token_id if model.generation_config else None
        eos = config_eos if isinstance(config_eos, list) else [config_eos] if config_eos is not None else []
        self.eos_token_ids = tuple(eos_token_ids) or tuple(eos)
        self.version = 0
        self.pauses: deque[tuple[float, float]] = deque(maxlen=32)
        self.busy_s = 0.0  # time spent prefilling and decoding: generated tokens / busy_s is its speed with work
        # larger priority first, then first come first served
        self._waiting: queue.PriorityQueue[tuple[int, int, _Sequence]] = queue.PriorityQueue()
        self._arrivals = itertools.count()
        self._control: queue.Queue[Callable[[], None]] = queue.Queue()
        self._rows: list[_Sequence] = []  # the running sequences, row i of the batch's KV cache
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None  # [B, T]: 1 on real tokens, 0 on left padding
        self._unpaused = threading.Event()
        self._unpaused.set()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="hf-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(cls, path: str, *, dtype: str = "float32", tokenizer=None, **kw) -> HFEngine:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
        return cls(model, tokenizer=tokenizer, **kw)

    # ------------------------------------------------------------------ public, any thread

    def submit(self, rid: str, input_ids: list[int], params: SamplingParams, priority: int = 0) -> Future:
        """Queue a request; the future resolves to its ``Completion``. While requests wait for room in the
        batch, larger ``priority`` joins first."""
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; pass stop_token_ids instead")
        self._check_prompt(input_ids, params.max_new_tokens)
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        seq = _Sequence(rid, list(input_ids), params, Future(), generator)
        self._waiting.put((-priority, next(self._arrivals), seq))
        self._wake.set()
        return seq.future

    async def generate(self, rid: str, input_ids: list[int], params: SamplingParams,
                       priority: int = 0, adapter: str | None = None) -> Completion:
        self._check_adapter(adapter)
        future = self.submit(rid, input_ids, params, priority)
        try:  # shielded: a cancelled future would fail the engine's set_result, and with it the whole batch
            return await asyncio.shield(asyncio.wrap_future(future))
        except asyncio.CancelledError:
            self.abort(rid)  # the caller is gone: free its row
            raise

    def _check_adapter(self, adapter: str | None) -> None:
        """An adapter named in a request must be the one served: the engine merges each version into its
        weights as it arrives, so it holds the newest alone."""
        if adapter is None:
            return
        if self.lora is None:
            raise ValueError(f"lora_path {adapter!r}: this server serves no adapters (started without learner.lora)")
        if adapter != f"{self.lora.name}-v{self.version}":
            raise ValueError(f"lora_path {adapter!r}: this server holds {self.lora.name}-v{self.version} alone (the "
                             "hf engine merges each adapter version into its weights as it arrives)")

    def _check_prompt(self, input_ids: list[int], max_new_tokens: int) -> None:
        if not input_ids:
            raise ValueError("input_ids is empty")
        vocab = self.model.config.vocab_size
        if min(input_ids) < 0 or max(input_ids) >= vocab:
            raise ValueError(f"input_ids must be in [0, {vocab})")
        if len(input_ids) + max_new_tokens > self.max_length:
            raise ValueError(f"{len(input_ids)} prompt tokens + max_new_tokens {max_new_tokens} exceed the "
                             f"model's context of {self.max_length} tokens")

    async def score_prompt(self, rid: str, input_ids: list[int], top_logprobs_num: int = 0,
                           adapter: str | None = None) -> PromptScores:
        """Teacher-forced logprobs of the prompt; one forward between decode steps, outside the batch."""
        self._check_adapter(adapter)
        self._check_prompt(input_ids, 0)
        vocab = self.model.config.vocab_size
        if not 0 <= top_logprobs_num <= vocab:
            raise ValueError(f"top_logprobs_num must be in [0, {vocab}], got {top_logprobs_num}")
        return await asyncio.wrap_future(self._run_between_steps(lambda: self._score(input_ids, top_logprobs_num)))

    def abort(self, rid: str | None = None) -> None:
        """Finish matching requests (all when ``rid`` is None) with finish reason ``abort``."""
        self._run_between_steps(lambda: self._abort(rid))

    def pause(self) -> None:
        """Stop advancing sequences after the current step; running ones keep their place."""
        self._unpaused.clear()

    def resume(self) -> None:
        self._unpaused.set()
        self._wake.set()

    async def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]], version: int,
                             probe: Probe | None = None) -> float | None:
        return await asyncio.wrap_future(self.swap_weights(named_tensors, version, probe))

    def swap_weights(self, named_tensors: list[tuple[str, torch.Tensor]], version: int,
                     probe: Probe | None = None) -> Future:
        """Copy new tensors in between decode steps; tokens sampled afterwards carry ``version``. With a ``probe``
        the new weights score it before a decode step runs on them: a mismatch puts the old weights back and
        raises ``ProbeMismatch`` (no token ever carries a version that failed); the future holds the probe's gap."""
        def apply() -> float | None:
            started = time.time()
            try:
                gap = self.weights.swap(named_tensors, version, probe, lambda ids: self._score(ids, 0).logprobs)
                self.version = version
                return gap
            finally:
                self.pauses.append((started, time.time()))

        return self._run_between_steps(apply)

    async def load_adapter(self, tensors: list[tuple[str, torch.Tensor]], spec: AdapterSpec, version: int,
                           probe: Probe | None = None) -> float | None:
        """Serve an adapter version by merging it into the weights, swapped in between two decode steps like a
        whole push (and probed the same way, with the adapter merged): running requests go on, each token keeps
        its version."""
        merged = await asyncio.to_thread(self.weights.merged, adapters.pairs(tensors), spec.scale)  # loop stays free
        return await self.update_weights(merged, version, probe)

    def load(self) -> dict:
        running = list(self._rows)  # a snapshot: the engine thread changes the list between steps
        return {"num_reqs": len(running), "num_waiting_reqs": self._waiting.qsize(),
                "num_tokens": sum(len(seq.prompt) + len(seq.out.output_ids) for seq in running)}

    def healthy(self) -> bool:
        return self._thread.is_alive()

    def weight_receiver(self) -> HostReceiver:
        if self.lora is not None:
            return AdapterReceiver(self, adapters.linear_shapes(self.model), self.lora.max_rank)
        return HostReceiver(self, self.model)

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(10)

    # ------------------------------------------------------------------ engine thread

    def _run_between_steps(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the engine thread before the next decode step; the future holds what it returns."""
        done: Future = Future()

        def task() -> None:
            try:
                done.set_result(fn())
            except Exception as e:
                done.set_exception(e)

        self._control.put(task)
        self._wake.set()
        return done

    def _loop(self) -> None:
        while not self._stop:
            while not self._control.empty():  # runs while paused too: a push is pause, swap, continue
                self._control.get()()
            t0 = time.perf_counter()
            if self._unpaused.is_set():
                self._admit()
            if not self._rows or not self._unpaused.is_set():
                self.busy_s += time.perf_counter() - t0
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                with torch.no_grad():
                    self._decode_step()
            except Exception as e:  # a fault fails the batch, not the engine
                for seq in self._rows:
                    if not seq.future.done():
                        seq.future.set_exception(e)
                self._rows, self._cache, self._mask = [], None, None
            self.busy_s += time.perf_counter() - t0

    def _score(self, input_ids: list[int], k: int) -> PromptScores:
        """One unbatched forward of the prompt: position i's distribution predicts token i + 1."""
        with torch.no_grad():
            logits = self.model(input_ids=torch.tensor([input_ids])).logits[0, :-1]
        logprobs = torch.log_softmax(logits.float(), -1)
        chosen = logprobs.gather(1, torch.tensor(input_ids[1:]).unsqueeze(1)).squeeze(1)
        top: list[list[tuple[float, int]]] = [[] for _ in input_ids[1:]]
        if k:
            values, ids = logprobs.topk(k, -1)  # sorted, likeliest first
            top = [list(zip(v, i)) for v, i in zip(values.tolist(), ids.tolist())]
        return PromptScores(chosen.tolist(), top, self.version)

    def _admit(self) -> None:
        """Prefill every waiting request that fits, in one left-padded forward, and join the batch."""
        joining = []
        while len(self._rows) + len(joining) < self.max_batch_size:
            try:
                joining.append(self._waiting.get_nowait()[-1])
            except queue.Empty:
                break
        if not joining:
            return
        try:
            with torch.no_grad():
                self._prefill(joining)
        except Exception as e:
            for seq in joining:
                if not seq.future.done():
                    seq.future.set_exception(e)

    def _prefill(self, joining: list[_Sequence]) -> None:
        # The n samples of a group share their prompt: each distinct prompt is prefilled once and
        # its KV rows are copied to every sequence that asked for it.
        distinct: dict[tuple[int, ...], int] = {}
        rows = [distinct.setdefault(tuple(seq.prompt), len(distinct)) for seq in joining]
        width = max(map(len, distinct))
        ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in distinct])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in distinct])
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        self._emit(joining, out.logits[rows, -1])
        keep = [i for i, seq in enumerate(joining) if not self._finished(seq)]
        if keep:
            self._place(out.past_key_values, mask, [joining[i] for i in keep], [rows[i] for i in keep])

    def _place(self, prefill: DynamicCache, mask: torch.Tensor, seqs: list[_Sequence], rows: list[int]) -> None:
        """Append newly prefilled sequences to the batch, in place: the KV buffers keep spare rows, so only
        the new rows are written (the whole batch is copied only when a prompt is wider than it, to pad it)."""
        index = torch.tensor(rows)
        if self._cache is None:  # an empty batch, which the first rows size
            self._cache, self._mask, self._rows = DynamicCache(), mask.new_zeros(0, 0), []
            self._cache.layers = [SlackLayer.empty_like(layer.keys, layer.values, self.max_batch_size)
                                  for layer in prefill.layers]
        width = max(self._mask.shape[1], mask.shape[1])
        self._mask = torch.cat([_pad_left_mask(self._mask, width), _pad_left_mask(mask[index], width)])
        self._rows.extend(seqs)
        for mine, theirs in zip(self._cache.layers, prefill.layers):
            mine.append_rows(theirs.keys[index], theirs.values[index])

    def _decode_step(self) -> None:
        last = torch.tensor([[seq.out.output_ids[-1]] for seq in self._rows])
        mask = torch.cat([self._mask, torch.ones(len(self._rows), 1, dtype=torch.long)], dim=1)
        positions = (mask.sum(1, keepdim=True) - 1)
        out = self.model(input_ids=last, attention_mask=mask, position_ids=positions,
                         past_key_values=self._cache, use_cache=True)
        self._cache, self._mask = out.past_key_values, mask
        live = [i for i, seq in enumerate(self._rows) if not seq.aborted]
        self._emit([self._rows[i] for i in live], out.logits[live, -1])
        finished = [i for i, seq in enumerate(self._rows) if self._finished(seq)]
        if finished:
            self._retire(finished)

    def _emit(self, seqs: list[_Sequence], logits: torch.Tensor) -> None:
        if not seqs:
            return
        tokens, logprobs = sample_batch(logits, [s.params for s in seqs], [s.generator for s in seqs])
        for seq, token, logprob in zip(seqs, tokens, logprobs):
            seq.out.output_ids.append(token)
            seq.out.logprobs.append(logprob)
            seq.out.versions.append(self.version)

    def _finished(self, seq: _Sequence) -> bool:
        """Resolve the future when the sequence is done; True if it was."""
        if seq.future.done():
            return True
        out, params = seq.out, seq.params
        token = out.output_ids[-1] if out.output_ids else None
        if seq.aborted:
            out.finish_reason = {"type": "abort", "message": "aborted"}
        elif token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            out.finish_reason = {"type": "stop", "matched": token}
        elif params.stop and (matched := self._stop_string(out.output_ids, params.stop)):
            out.finish_reason = {"type": "stop", "matched": matched}
        elif len(out.output_ids) >= params.max_new_tokens:
            out.finish_reason = {"type": "length", "length": len(out.output_ids)}
        else:
            return False
        seq.future.set_result(out)
        return True

    def _stop_string(self, output_ids: list[int], stops: tuple[str, ...]) -> str | None:
        # Only the tail can newly contain a stop string: decode a window, not the whole output.
        window = max(map(len, stops)) + 8
        tail = self.tokenizer.decode(output_ids[-window:])
        return next((s for s in stops if s in tail), None)

    def _retire(self, finished: list[int]) -> None:
        """Drop finished rows: running rows from the end of the batch move into their places, so the copy
        is of those rows only, and the batch is cut short."""
        if len(finished) == len(self._rows):
            self._rows, self._cache, self._mask = [], None, None
            return
        n = len(self._rows) - len(finished)
        done = set(finished)
        holes = [i for i in finished if i < n]
        movers = [i for i in range(n, len(self._rows)) if i not in done]
        for hole, mover in zip(holes, movers):
            self._rows[hole] = self._rows[mover]
        del self._rows[n:]
        self._mask[holes] = self._mask[movers]
        self._mask = self._mask[:n]
        for layer in self._cache.layers:
            layer.move_rows(movers, holes, n)
        # drop columns that are padding for every row
        first_real = int((self._mask.cumsum(1) == 0).sum(1).min())
        if first_real:
            self._mask = self._mask[:, first_real:]
            for layer in self._cache.layers:
                layer.drop_left(first_real)

    def _abort(self, rid: str | None) -> None:
        for seq in self._rows:
            if rid is None or seq.rid == rid:
                seq.aborted = True
                self._finished(seq)
        pending = []
        while not self._waiting.empty():
            entry = self._waiting.get_nowait()
            if rid is None or entry[-1].rid == rid:
                entry[-1].aborted = True
                self._finished(entry[-1])
            else:
                pending.append(entry)  # with its place in the order
        for entry in pending:
            self._waiting.put(entry)


def _pad_left_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - mask.shape[1]
    return mask if missing == 0 else torch.nn.functional.pad(mask, (missing, 0))
