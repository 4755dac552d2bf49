"""The prefix cache's part in admission and completion (`prefix_cache: sync | async`), scheduler
thread only.

Admission starts a request at its longest cached prefix (`match`, then `start`). A request whose
next uncached block is being computed right now by another running request (a *claim*) waits for
it instead of computing it twice: the in-batch sharing that makes lm-eval's choices of one
question, or many chats with one system prompt, cheap. Full blocks are offered to the tree as soon
as their writes complete (`offer`): inserted inline on the completion path (`sync`), or queued and
inserted at the loop's idle point while the device works (`async`: a hit may come one loop
later, but planning never waits for the tree).

Reference counting: a hit shares every matched block (eviction cannot take it); a queued insertion
holds one reference per block until it is inserted, so the blocks outlive the request that wrote
them. Every release carries the fence the scheduler passes in, so no block goes back
to the free list while an in-flight iteration may still read it.
"""

from __future__ import annotations

import time
from typing import Protocol

from minisgl_backend.kvcache.block_pool import BlockPool
from minisgl_backend.kvcache.prefix_cache import PrefixCache, prefix_hashes
from minisgl_backend.scheduler.request import Request


class Counters(Protocol):
    def add(self, name: str, value: float = 1.0) -> None: ...


class PrefixAdmission:
    def __init__(self, mode: str, pool: BlockPool, block_size: int, metrics: Counters) -> None:
        self.mode = mode
        self.pool = pool
        self.block_size = block_size
        self.metrics = metrics
        self.cache = PrefixCache(pool, block_size) if mode != "off" else None
        self._claims: dict[int, Request] = {}  # prefix-block hash -> the running request computing it
        self._deferred: list[tuple[list[int], list[int]]] = []  # async: (tokens, blocks) to insert

    @property
    def num_blocks(self) -> int:
        """Blocks the tree holds."""
        return self.cache.num_blocks if self.cache is not None else 0

    # ---- admission ----
    def match(self, req: Request) -> list[int] | None:
        """Cached blocks `req` can start from (each shared, so eviction cannot take them), or None
        when another running request is computing the very next block of its prefix right now."""
        if self.cache is None:
            return []
        limit = req.cacheable_blocks(self.block_size)
        hit = self.cache.match(req.prompt_ids + req.output_ids, limit)
        hashes = req.block_hashes(self.block_size)
        if len(hit) < min(limit, len(hashes)):
            claimant = self._claims.get(hashes[len(hit)])
            if claimant is not None and claimant is not req:
                return None
        for b in hit:
            self.pool.share(b)
        return hit

    def start(self, req: Request, hit: list[int]) -> None:
        """Admit `req` at the end of its cached prefix and claim the prompt blocks it will compute."""
        bs = self.block_size
        req.block_table = list(hit)
        req.num_computed = len(hit) * bs
        req.num_readonly_blocks = req.num_offered_blocks = len(hit)  # the tree holds them READ_ONLY
        self.metrics.add("prefix_queries")
        self.metrics.add("prefix_query_tokens", req.planned_len)
        if hit:
            self.metrics.add("prefix_hits")
            self.metrics.add("prefix_hit_tokens", len(hit) * bs)
        if self.cache is not None:
            # Every full prompt block it computes, also those past its own hit limit (a request
            # scoring prompt logprobs matches none, but its other samples can share them all).
            for h in req.block_hashes(bs)[len(hit) :]:
                if self._claims.setdefault(h, req) is req:
                    req.claims.append(h)

    def drop_claims(self, req: Request) -> None:
        for h in req.claims:
            if self._claims.get(h) is req:
                del self._claims[h]
        req.claims = []

    def evict(self, n: int, fence: int) -> int:
        """Evict up to `n` unshared cached blocks; they go FREE once `fence` completes."""
        if self.cache is None:
            return 0
        evicted = self.cache.evict(n, fence=fence)
        if evicted:
            self.metrics.add("prefix_evicted_blocks", evicted)
        return evicted

    # ---- completion ----
    def offer(self, req: Request) -> None:
        """Hand the request's newly completed full blocks to the tree (now, or at the idle point)."""
        n = req.num_readonly_blocks
        if self.cache is None or n <= req.num_offered_blocks:
            return
        req.num_offered_blocks = n
        tokens = (req.prompt_ids + req.output_ids)[: n * self.block_size]
        blocks = req.block_table[:n]
        if self.mode == "sync":
            self._insert(tokens, blocks)
            return
        for b in blocks:
            self.pool.share(b)  # the queued insertion keeps them alive even if the request ends
        self._deferred.append((tokens, blocks))
        # Its claims on these blocks now belong to the queued insertion, which settles them: a
        # request waiting for them keeps waiting (until the flush) rather than missing.
        offered = set(req.block_hashes(self.block_size)[:n])
        req.claims = [h for h in req.claims if h not in offered]

    def _insert(self, tokens: list[int], blocks: list[int]) -> None:
        assert self.cache is not None
        t0 = time.perf_counter()
        self.metrics.add("prefix_inserted_blocks", self.cache.insert(tokens, blocks))
        # Claims on these prefixes are settled: requests waiting for them can now hit.
        for h in prefix_hashes(tokens, self.block_size, len(blocks)):
            claimant = self._claims.pop(h, None)
            if claimant is not None and h in claimant.claims:
                claimant.claims.remove(h)
        self.metrics.add("prefix_insert_s", time.perf_counter() - t0)

    def flush_deferred(self, fence: int) -> bool:
        """async mode: insert what completed since the last call; True if there was any. Called at
        the loop's idle point (after the pipeline is full, before it waits for the device), never
        between a completion and the plan that follows it."""
        pending, self._deferred = self._deferred, []
        for tokens, blocks in pending:
            self._insert(tokens, blocks)
            self.pool.release(blocks, fence=fence)
        return bool(pending)

    def flush(self, fence: int) -> None:
        """Insert what is queued, then evict every cached block no request holds."""
        self.flush_deferred(fence)
        if self.cache is not None:
            self.cache.evict(self.cache.num_blocks, fence=fence)

    def holders(self) -> dict[int, int]:
        """Block -> references held by the tree and by queued insertions (for invariant checks)."""
        held: dict[int, int] = {}
        for b in self.cache.blocks() if self.cache is not None else []:
            held[b] = held.get(b, 0) + 1
        for _, blocks in self._deferred:
            for b in blocks:
                held[b] = held.get(b, 0) + 1
        return held
