"""Length-balanced data parallelism (ARCHITECTURE §4).

A batch of sequences is split into ``k × world_size`` micro-batches: sorted by length, cut into
``k`` bands (one per accumulation step), each band split over the ranks with the
Karmarkar–Karp largest-differencing method. ``k`` is the smallest count per rank that keeps every
micro-batch within the token budget (padded tokens), so every rank runs the same number of
micro-batches and DeepSpeed's accumulation boundary stays aligned; sequences of similar length
share a micro-batch, so little of the compute is padding.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass


def karmarkar_karp(costs: Sequence[float], parts: int) -> list[list[int]]:
    """Indices of ``costs`` split into ``parts`` subsets with near-equal sums (largest differencing).

    Every item starts as a ``parts``-way partition holding it alone; the two partitions whose
    spread (max - min) is largest are merged, pairing one's heaviest subset with the other's
    lightest, until one partition remains.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    heap = []
    for i, c in enumerate(costs):
        subsets = [[c, [i]]] + [[0.0, []] for _ in range(parts - 1)]
        heapq.heappush(heap, (-c, i, subsets))  # spread of a single item is its cost
    if not heap:
        return [[] for _ in range(parts)]
    tie = len(costs)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        a.sort(key=lambda s: s[0], reverse=True)
        b.sort(key=lambda s: s[0])
        merged = [[sa[0] + sb[0], sa[1] + sb[1]] for sa, sb in zip(a, b)]
        loads = [s[0] for s in merged]
        tie += 1
        heapq.heappush(heap, (-(max(loads) - min(loads)), tie, merged))
    return [sorted(s[1]) for s in heap[0][2]]


def attention_cost(length: int, hidden: int = 1024) -> float:
    """FLOP-proportional cost of a sequence: linear layers grow with length, attention with length²."""
    return length * (1 + length / (6 * hidden))


@dataclass(frozen=True)
class Plan:
    """``ranks[r]`` is rank r's list of micro-batches, each a list of sequence indices."""

    ranks: list[list[list[int]]]

    @property
    def per_rank(self) -> int:
        return len(self.ranks[0])


def plan_micro_batches(lengths: Sequence[int], world_size: int, token_budget: int,
                       costs: Sequence[float] | None = None) -> Plan:
    """Split sequences into the same number of micro-batches per rank, each within ``token_budget``
    padded tokens (count × longest: what a right-padded micro-batch computes and holds).

    The sequences, longest first, are cut into ``k`` bands of near-equal cost, one band per
    accumulation step, and each band is split over the ranks by Karmarkar–Karp. Sequences of
    similar length share a micro-batch, so little of it is padding (KK over the whole batch mixes
    long and short ones: on long-tailed lengths, 2-5x the real tokens), and the ranks' micro-batches
    of each step are balanced. ``k`` is the smallest that fits the budget. Balancing uses ``costs``
    (default: the lengths); the budget is always in tokens.
    """
    if world_size < 1 or token_budget < 1:
        raise ValueError("world_size and token_budget must be >= 1")
    if lengths and max(lengths) > token_budget:
        raise ValueError(f"a sequence of {max(lengths)} tokens exceeds the micro-batch budget of {token_budget}")
    costs = list(lengths) if costs is None else list(costs)
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    k = max(1, math.ceil(sum(lengths) / (token_budget * world_size)))
    while True:  # ends: with a band per sequence, every micro-batch is one sequence within the budget
        steps = [_split(band, world_size, costs) for band in _bands(order, costs, k)]
        if all(len(mb) * max((lengths[i] for i in mb), default=0) <= token_budget for step in steps for mb in step):
            return Plan(_deal(steps, world_size, costs))
        k += 1


def _bands(order: list[int], costs: Sequence[float], k: int) -> list[list[int]]:
    """``order`` cut into ``k`` contiguous runs of near-equal total cost."""
    total, bands, acc = sum(costs), [[] for _ in range(k)], 0.0
    b = 0
    for i in order:
        if b < k - 1 and bands[b] and acc >= total * (b + 1) / k:
            b += 1
        bands[b].append(i)
        acc += costs[i]
    return bands


def _split(band: list[int], world_size: int, costs: Sequence[float]) -> list[list[int]]:
    return [[band[j] for j in part] for part in karmarkar_karp([costs[i] for i in band], world_size)]


def _deal(steps: list[list[list[int]]], world_size: int, costs: Sequence[float]) -> list[list[list[int]]]:
    """One micro-batch of each step to every rank, balancing rank loads: heaviest to the lightest rank."""
    ranks: list[list[list[int]]] = [[] for _ in range(world_size)]
    loads = [0.0] * world_size
    for step in steps:
        free = set(range(world_size))
        for part in sorted(step, key=lambda p: sum(costs[i] for i in p), reverse=True):
            r = min(free, key=lambda r: loads[r])
            free.discard(r)
            ranks[r].append(part)
            loads[r] += sum(costs[i] for i in part)
    return ranks
