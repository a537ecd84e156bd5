"""What every engine takes and returns: one request in, one finished sequence out."""

from __future__ import annotations

from collections import deque
from typing import Protocol

from streamrl.adapters import AdapterSpec
from streamrl.generation import Completion, PromptScores, SamplingParams
from streamrl.weightsync import Probe


class Engine(Protocol):
    """What the HTTP server needs from an inference engine (hf, vllm)."""

    version: int

    pauses: deque[tuple[float, float]]
    """The wall-clock spans (``time.time()``) of the latest weight changes during which the engine generated
    nothing: a swap between decode steps and its probe (hf), or vLLM's pause around a reload."""

    adapter_name: str | None
    """A LoRA server's adapter name (version N is served as NAME-vN); None: the server serves no adapters."""

    async def generate(self, rid: str, input_ids: list[int], params: SamplingParams,
                       priority: int = 0, adapter: str | None = None) -> Completion:
        """Larger ``priority`` is served sooner when requests wait for room in the batch (SGLang's order).
        ``adapter``: a LoRA server's adapter version by its served name (default: the newest); a name the
        server does not hold is a ``ValueError``."""
        ...

    async def score_prompt(self, rid: str, input_ids: list[int], top_logprobs_num: int = 0,
                           adapter: str | None = None) -> PromptScores:
        """Teacher-forced logprobs of every prompt token after the first, and the ``top_logprobs_num``
        likeliest tokens at each position; generates nothing (SGLang's ``max_new_tokens: 0``)."""
        ...

    def abort(self, rid: str | None = None) -> None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    async def load_adapter(self, tensors: list, spec: AdapterSpec, version: int, probe: Probe | None = None
                           ) -> float | None:
        """A LoRA server: serve the adapter ``(name, tensor)`` pairs (checked already) as version ``version``,
        verified by ``probe`` as ``update_weights`` does, with the adapter applied. The tensors are the caller's
        again once this returns (the receiver reuses their buffers): copy what is kept."""

    async def update_weights(self, named_tensors: list, version: int, probe: Probe | None = None) -> float | None:
        """Swap in ``(name, tensor)`` pairs; later tokens carry ``version``. The tensors are the
        engine's to keep (it may adopt them as its weights): the caller does not write them again.

        With a ``probe``, ``version`` is served only once the new weights reproduce the learner's logprobs of
        it; otherwise the weights served before are put back and ``weightsync.ProbeMismatch`` raised, and no
        token ever carries ``version``. Returns the probe's gap (None without one)."""

    def load(self) -> dict: ...

    def healthy(self) -> bool:
        """False once the engine can no longer serve (its thread or worker died)."""

    def weight_receiver(self) -> WeightReceiver:
        """The server's end of the learner's weight push for this engine."""

    def shutdown(self) -> None: ...


class WeightReceiver(Protocol):
    """SGLang's weight endpoints, for one engine: who joins the learner's group and how tensors land.

    A bad tensor (a name, shape or dtype the model does not have) raises ``ValueError`` or ``KeyError``.
    """

    async def init(self, master_address: str, master_port: int, rank: int, world_size: int, backend: str,
                   group_name: str, timeout_s: float) -> None:
        """Join the learner's group as ``rank``; returns once every member has joined."""

    probe_gap: float | None
    """The gap between the server's and the learner's logprobs in the last probe that passed."""

    async def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]], version: int,
                      lora: AdapterSpec | None = None, digest: str | None = None, probe: Probe | None = None) -> int:
        """Take the bucket the learner is broadcasting; returns how many tensors it held. A bucket whose bytes do
        not hash to ``digest`` is refused (``weightsync.CorruptBucket``) and its push dropped: the weights stay.
        ``probe`` comes with a push's last bucket: the whole version is served only if it passes
        (``weightsync.ProbeMismatch`` otherwise, and the weights served before stay)."""

    async def load_from_disk(self, path: str, version: int) -> int:
        """Load a checkpoint directory's safetensors; returns how many tensors it held."""

    def destroy(self) -> None: ...
