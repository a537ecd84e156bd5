"""Length-balanced data parallelism for packed micro-batches (ARCHITECTURE §4).

A micro-batch is its sequences concatenated (``packing``), so its size is its real token count.
A batch of sequences is cut into ``k × world_size`` micro-batches of near-equal cost by the
Karmarkar–Karp largest-differencing method and dealt ``k`` to every rank, so every rank runs the
same number of micro-batches (DeepSpeed's accumulation boundary stays aligned) and the ranks'
loads are balanced. ``k`` is the smallest count that keeps every micro-batch within the token
budget. The cost is the token count, or with ``attention_cost`` a FLOP estimate (attention
grows with length²).
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
class Partition:
    """``ranks[r]`` is rank r's list of micro-batches, each a list of sequence indices."""

    ranks: list[list[list[int]]]

    @property
    def per_rank(self) -> int:
        return len(self.ranks[0])


def plan_micro_batches(lengths: Sequence[int], world_size: int, token_budget: int,
                       costs: Sequence[float] | None = None) -> Partition:
    """Split sequences into the same number of micro-batches per rank, each within ``token_budget`` real
    tokens, balancing ``costs`` (default: the lengths) over the micro-batches and the ranks."""
    if world_size < 1 or token_budget < 1:
        raise ValueError("world_size and token_budget must be >= 1")
    if lengths and max(lengths) > token_budget:
        raise ValueError(f"a sequence of {max(lengths)} tokens exceeds the micro-batch budget of {token_budget}")
    costs = list(lengths) if costs is None else list(costs)
    k = max(1, math.ceil(sum(lengths) / (token_budget * world_size)))
    while True:  # ends: with a micro-batch per sequence, every one is within the budget
        parts = karmarkar_karp(costs, k * world_size)
        if all(sum(lengths[i] for i in part) <= token_budget for part in parts):
            return Partition(_deal(parts, world_size, costs))
        k += 1


def _deal(parts: list[list[int]], world_size: int, costs: Sequence[float]) -> list[list[list[int]]]:
    """The same number of micro-batches to every rank, heaviest first to the lightest rank with room."""
    per_rank = len(parts) // world_size
    ranks: list[list[list[int]]] = [[] for _ in range(world_size)]
    loads = [0.0] * world_size
    for part in sorted(parts, key=lambda p: sum(costs[i] for i in p), reverse=True):
        r = min((r for r in range(world_size) if len(ranks[r]) < per_rank), key=lambda r: loads[r])
        ranks[r].append(part)
        loads[r] += sum(costs[i] for i in part)
    return ranks


def first_fit(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Sequences packed into as few rows of at most ``token_budget`` tokens as first-fit-decreasing finds
    (one process, no balancing: the reference's and evaluation's forwards)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True):
        r = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if r is None:
            rows.append([])
            room.append(token_budget)
            r = len(rows) - 1
        rows[r].append(i)
        room[r] -= lengths[i]
    return rows
