"""Prefix-affinity routing over engine replicas: prompts that share a stem go to one replica, whose
prefix cache then computes the stem once, as long as the load stays balanced.

Two policies, for the two ways work arrives:

- `route`, a whole batch known up front (lm-eval's `data_parallel_size=N`): prompts are grouped by
  their first K tokens (K = one KV block), and a group that holds more than one replica's fair share
  of the work is split again by a longer prefix (2K, 4K, ...). Groups go to replicas greedily,
  largest first, onto the least loaded one. So the choices of one question and prompts with a long
  common stem land on one replica; only a stem shared by more than 1/N of the work is prefilled
  once per replica.
- `PrefixRouter`, one request at a time (`minisgl serve --replicas N`): a prompt with at least one
  full KV block goes to the replica that rendezvous hashing picks for that first block (a replica
  that dies moves only its own keys), unless that replica already has more than `balance` requests
  in flight beyond the least loaded one; shorter prompts and overflow go to the least loaded replica
  (in-flight requests, ties by fewest routed so far).
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Sequence

from minisgl_backend.errors import EngineDeadError
from minisgl_backend.types import SamplingParams


def prefix_groups(
    prompts: Sequence[Sequence[int]], weights: Sequence[float], block_size: int, cap: float
) -> list[list[int]]:
    """Indices grouped by a shared prefix: first by their first `block_size` tokens; a group heavier
    than `cap` is split again by twice as many tokens, until it fits or its prompts cannot be told
    apart. Groups come out in order of their first index, members in input order."""
    groups: list[list[int]] = []
    todo: list[tuple[list[int], int]] = [(list(range(len(prompts))), block_size)]
    while todo:
        members, k = todo.pop()
        buckets: dict[tuple[int, ...], list[int]] = {}
        for i in members:
            buckets.setdefault(tuple(prompts[i][:k]), []).append(i)
        for bucket in buckets.values():
            heavy = sum(weights[i] for i in bucket) > cap
            if heavy and len(bucket) > 1 and any(len(prompts[i]) > k for i in bucket):
                todo.append((bucket, 2 * k))
            else:
                groups.append(bucket)
    return sorted(groups, key=lambda g: g[0])


def route(
    prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams], n: int, block_size: int
) -> list[list[int]]:
    """Split request indices over `n` replicas: prefix groups (see `prefix_groups`), placed largest
    first on the least loaded replica (weight: prompt tokens + generation budget). Each replica's
    indices are in input order."""
    weights = [len(p) + sp.max_tokens for p, sp in zip(prompts, params)]
    groups = prefix_groups(prompts, weights, block_size, cap=sum(weights) / n)
    loads = [(0.0, r) for r in range(n)]
    shares: list[list[int]] = [[] for _ in range(n)]
    for group in sorted(groups, key=lambda g: (-sum(weights[i] for i in g), g[0])):
        load, r = heapq.heappop(loads)
        shares[r].extend(group)
        heapq.heappush(loads, (load + sum(weights[i] for i in group), r))
    return [sorted(s) for s in shares]


class PrefixRouter:
    """Chooses a replica per prompt (see the module doc); counts the requests in flight on each."""

    def __init__(self, n: int, block_size: int, balance: int) -> None:
        self.n, self.block_size, self.balance = n, block_size, balance
        self.load = [0] * n
        self.routed = [0] * n

    def pick(self, prompt_ids: Sequence[int] | None, alive: Sequence[int]) -> int:
        if not alive:
            raise EngineDeadError("every engine replica is dead")
        least = min(alive, key=lambda r: (self.load[r], self.routed[r], r))
        choice = least
        if prompt_ids is not None and len(prompt_ids) >= self.block_size:
            # Any ints hash (ids are validated only on the replica): no fixed-width packing.
            key = ",".join(map(str, prompt_ids[: self.block_size])).encode()
            preferred = max(alive, key=lambda r: hashlib.blake2b(key + r.to_bytes(4, "little")).digest())
            if self.load[preferred] - self.load[least] <= self.balance:
                choice = preferred
        self.load[choice] += 1
        self.routed[choice] += 1
        return choice

    def release(self, r: int) -> None:
        self.load[r] -= 1
