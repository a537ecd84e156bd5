"""The ``hf`` engine: a transformers causal LM with continuous batching, for CPU (and GPU).

One engine thread owns the model. Between decode steps it admits waiting requests
(prefilled together, each distinct prompt once, then merged into the running batch), applies queued weight
updates, honours pause, and retires finished sequences; every running sequence
advances one token per step. The batch keeps one KV cache, left-padded, with an
attention mask and explicit positions, so sequences of any length share a forward.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from streamrl.rollout.engines.base import Completion, SamplingParams
from streamrl.rollout.sampling import sample_batch


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
                 tokenizer=None):
        self.model = model.eval()
        self.tokenizer = tokenizer  # only needed for stop strings
        self.max_batch_size = max_batch_size
        self.max_length = getattr(model.config, "max_position_embeddings", None) or 2**31
        config_eos = model.generation_config.eos_token_id if model.generation_config else None
        eos = config_eos if isinstance(config_eos, list) else [config_eos] if config_eos is not None else []
        self.eos_token_ids = tuple(eos_token_ids) or tuple(eos)
        self.version = 0
        # larger priority first, then first come first served
        self._waiting: queue.PriorityQueue[tuple[int, int, _Sequence]] = queue.PriorityQueue()
        self._arrivals = itertools.count()
        self._control: queue.Queue[Callable[[], None]] = queue.Queue()
        self._running: list[_Sequence] = []
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
        if not input_ids:
            raise ValueError("input_ids is empty")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; pass stop_token_ids instead")
        vocab = self.model.config.vocab_size
        if min(input_ids) < 0 or max(input_ids) >= vocab:
            raise ValueError(f"input_ids must be in [0, {vocab})")
        if len(input_ids) + params.max_new_tokens > self.max_length:
            raise ValueError(f"{len(input_ids)} prompt tokens + max_new_tokens {params.max_new_tokens} exceed the "
                             f"model's context of {self.max_length} tokens")
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        seq = _Sequence(rid, list(input_ids), params, Future(), generator)
        self._waiting.put((-priority, next(self._arrivals), seq))
        self._wake.set()
        return seq.future

    async def generate(self, rid: str, input_ids: list[int], params: SamplingParams,
                       priority: int = 0) -> Completion:
        return await asyncio.wrap_future(self.submit(rid, input_ids, params, priority))

    def abort(self, rid: str | None = None) -> None:
        """Finish matching requests (all when ``rid`` is None) with finish reason ``abort``."""
        self._run_between_steps(lambda: self._abort(rid))

    def pause(self) -> None:
        """Stop advancing sequences after the current step; running ones keep their place."""
        self._unpaused.clear()

    def resume(self) -> None:
        self._unpaused.set()
        self._wake.set()

    async def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]], version: int) -> None:
        await asyncio.wrap_future(self.swap_weights(named_tensors, version))

    def swap_weights(self, named_tensors: list[tuple[str, torch.Tensor]], version: int) -> Future:
        """Copy new tensors in between decode steps; tokens sampled afterwards carry ``version``."""
        def apply() -> None:
            params = dict(self.model.named_parameters())
            missing = [name for name, _ in named_tensors if name not in params]
            if missing:
                raise KeyError(f"model has no parameter {missing[0]!r}")
            with torch.no_grad():
                for name, tensor in named_tensors:
                    param = params[name]
                    if (tensor.dtype, tensor.device, tensor.shape) == (param.dtype, param.device, param.shape):
                        param.data = tensor  # adopt the received tensor: no copy
                    else:
                        param.copy_(tensor)  # converts dtype; a wrong shape raises
            self.version = version

        return self._run_between_steps(apply)

    def load(self) -> dict:
        return {"num_reqs": len(self._running), "num_waiting_reqs": self._waiting.qsize(),
                "num_tokens": int(self._mask.sum()) if self._mask is not None else 0}

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(10)

    # ------------------------------------------------------------------ engine thread

    def _run_between_steps(self, fn: Callable[[], None]) -> Future:
        done: Future = Future()

        def task() -> None:
            try:
                fn()
                done.set_result(None)
            except Exception as e:
                done.set_exception(e)

        self._control.put(task)
        self._wake.set()
        return done

    def _loop(self) -> None:
        while not self._stop:
            while not self._control.empty():  # runs while paused too: a push is pause, swap, continue
                self._control.get()()
            if self._unpaused.is_set():
                self._admit()
            if not self._running or not self._unpaused.is_set():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                with torch.no_grad():
                    self._decode_step()
            except Exception as e:  # a fault fails the batch, not the engine
                for seq in self._running:
                    if not seq.future.done():
                        seq.future.set_exception(e)
                self._running, self._cache, self._mask = [], None, None

    def _admit(self) -> None:
        """Prefill every waiting request that fits, in one left-padded forward, and join the batch."""
        joining = []
        while len(self._running) + len(joining) < self.max_batch_size:
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
        if not keep:
            return
        kept_rows = [rows[i] for i in keep]
        cache = out.past_key_values
        if kept_rows != list(range(len(distinct))):
            cache.batch_select_indices(torch.tensor(kept_rows))
            mask = mask[kept_rows]
        self._merge(cache, mask)
        self._running.extend(joining[i] for i in keep)

    def _merge(self, cache: DynamicCache, mask: torch.Tensor) -> None:
        """Append newly prefilled sequences to the batch, left-padding whichever side is shorter."""
        if self._cache is None:
            cache.layers = [_SlackLayer.of(layer.keys, layer.values) for layer in cache.layers]
            self._cache, self._mask = cache, mask
            return
        width = max(self._mask.shape[1], mask.shape[1])
        self._cache.layers = [
            _SlackLayer.of(*(torch.cat([_pad_left(mine, width), _pad_left(theirs, width)])
                             for mine, theirs in ((old.keys, new.keys), (old.values, new.values))))
            for old, new in zip(self._cache.layers, cache.layers)
        ]
        self._mask = torch.cat([_pad_left_mask(self._mask, width), _pad_left_mask(mask, width)])

    def _decode_step(self) -> None:
        last = torch.tensor([[seq.out.output_ids[-1]] for seq in self._running])
        mask = torch.cat([self._mask, torch.ones(len(self._running), 1, dtype=torch.long)], dim=1)
        positions = (mask.sum(1, keepdim=True) - 1)
        out = self.model(input_ids=last, attention_mask=mask, position_ids=positions,
                         past_key_values=self._cache, use_cache=True)
        self._cache, self._mask = out.past_key_values, mask
        live = [i for i, seq in enumerate(self._running) if not seq.aborted]
        self._emit([self._running[i] for i in live], out.logits[live, -1])
        keep = [i for i, seq in enumerate(self._running) if not self._finished(seq)]
        if len(keep) < len(self._running):
            self._retire(keep)

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

    def _retire(self, keep: list[int]) -> None:
        self._running = [self._running[i] for i in keep]
        if not keep:
            self._cache, self._mask = None, None
            return
        index = torch.tensor(keep)
        self._cache.batch_select_indices(index)
        self._mask = self._mask[index]
        # drop columns that are padding for every remaining sequence
        first_real = int((self._mask.cumsum(1) == 0).sum(1).min())
        if first_real:
            self._mask = self._mask[:, first_real:]
            for layer in self._cache.layers:
                layer.drop_left(first_real)

    def _abort(self, rid: str | None) -> None:
        for seq in self._running:
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


class _SlackLayer(DynamicLayer):
    """A KV layer kept in a buffer with room to grow along the sequence.

    transformers' DynamicLayer concatenates on every token, copying the whole cache
    each decode step; here a step writes one column in place, and the buffer
    doubles when full (amortised O(1) per token).
    """

    @classmethod
    def of(cls, keys: torch.Tensor, values: torch.Tensor, slack: int = 64) -> _SlackLayer:
        layer = cls()
        layer.dtype, layer.device, layer.is_initialized = keys.dtype, keys.device, True
        b, h, t, d = keys.shape
        layer._k = keys.new_empty(b, h, t + slack, d)
        layer._v = values.new_empty(b, h, t + slack, values.shape[-1])
        layer._k[:, :, :t], layer._v[:, :, :t] = keys, values
        layer._set_length(t)
        return layer

    def _set_length(self, n: int) -> None:
        self.length = n
        self.keys, self.values = self._k[:, :, :n], self._v[:, :, :n]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        n = key_states.shape[-2]
        end = self.length + n
        if end > self._k.shape[2]:
            grown = max(2 * self._k.shape[2], end + 64)
            self._k = torch.cat([self._k[:, :, : self.length], self._k.new_empty(*self._k.shape[:2], grown - self.length,
                                                                                 self._k.shape[3])], dim=2)
            self._v = torch.cat([self._v[:, :, : self.length], self._v.new_empty(*self._v.shape[:2], grown - self.length,
                                                                                 self._v.shape[3])], dim=2)
        self._k[:, :, self.length : end] = key_states
        self._v[:, :, self.length : end] = value_states
        self._set_length(end)
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._k, self._v = self._k[indices], self._v[indices]
        self._set_length(self.length)

    def drop_left(self, n: int) -> None:
        """Forget the first ``n`` positions (padding for every row)."""
        self._k, self._v = self._k[:, :, n:], self._v[:, :, n:]
        self._set_length(self.length - n)


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    """[B, H, T, D] -> [B, H, width, D] with zeros on the left."""
    missing = width - t.shape[2]
    return t if missing == 0 else torch.nn.functional.pad(t, (0, 0, missing, 0))


def _pad_left_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - mask.shape[1]
    return mask if missing == 0 else torch.nn.functional.pad(mask, (missing, 0))
