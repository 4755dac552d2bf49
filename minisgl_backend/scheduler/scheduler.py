"""Batch planning over waiting / running / finished requests (S3, S12).

Each step builds one batch under a token budget: one decode token per running request, plus prompt
chunks of at most `chunk_size` tokens (mixed batches), or — with `mixed_batches=False` — a batch of
only one kind, prompts first (the serial policy when `chunk_size=None` as well). Admission needs a
token-table row and free blocks for the whole remaining prompt; a decode that finds no free block
preempts the running request that arrived last (blocks released, requeued for recompute).

Progress under any pool that holds one request: the victim of a preemption is always the running
request that arrived last, so the oldest one is never preempted while another runs; and admission
leaves a watermark of free blocks for every running decode's next step, so a preempted request is
not re-admitted with the very blocks the decode that preempted it is waiting for (prefill-first
planning used to do exactly that, forever). `progress` counts what moves a request forward
(committed tokens, finished requests, prompt positions computed for the first time): the engine's
watchdog fails a loop whose iterations stop moving it.

Planning uses lengths only, so with overlap it runs ahead of results: a request that drew EOS in
iteration N may still have a decode row in N+1.. (planned before N's result was processed). Those
rows compute into blocks the request still owns or that wait in PENDING_RECLAIM behind their fence,
and their results are dropped when processed — EOS is seen late, never acted on twice.

Prefix cache (`prefix_cache: sync | async`): admission starts a request at its longest cached
prefix. A request whose next uncached block is being computed right now by another running request
(a *claim*) waits for it instead of computing it twice — the in-batch sharing that makes lm-eval's
choices of one question, or many chats with one system prompt, cheap. Full blocks enter the tree as
soon as their writes complete: inline on the completion path (`sync`), or queued and inserted at
the scheduler's idle point while the device works (`async`, seed S9: a hit may come one loop later,
but planning never waits for the tree).
"""

from __future__ import annotations

import time
from collections import deque
from typing import NamedTuple

from minisgl_backend.config import EngineConfig
from minisgl_backend.kvcache.block_pool import BlockPool
from minisgl_backend.kvcache.prefix_cache import PrefixCache, prefix_hashes
from minisgl_backend.kvcache.reclaim import RowPool
from minisgl_backend.scheduler.request import Request, RequestStatus
from minisgl_backend.types import TokenLogprob


class _NoMetrics:
    def add(self, name: str, value: float = 1.0) -> None:
        pass


class ScheduledRow(NamedTuple):
    req: Request
    start: int  # first position computed in this step
    length: int  # tokens computed in this step
    samples: bool  # the step reaches the end of the sequence, so it draws the next token
    epoch: int  # req.epoch at planning time


class StepOutput(NamedTuple):
    """What one executed iteration reports back to the scheduler."""

    sampled: dict[int, int]  # id(request) -> drawn token
    logprobs: dict[int, TokenLogprob]  # id(request) -> logprob of the drawn token (when asked)
    prompt_logprobs: list[tuple[int, int, TokenLogprob]]  # (id(request), prompt index, logprob)
    errors: dict[int, Exception]  # id(request) -> why sampling / scoring it failed (RequestFailedError)


class Batch(NamedTuple):
    iteration: int
    decode: list[ScheduledRow]
    prefill: list[ScheduledRow]
    depends_on: int  # newest earlier iteration that draws a token some row here reads
    prompt_writes: tuple[tuple[int, list[int]], ...]  # rows admitted by this batch: (row, prompt ids)


def _blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class Scheduler:
    def __init__(
        self, config: EngineConfig, pool: BlockPool, rows: RowPool, max_model_len: int, metrics=None
    ) -> None:
        self.cfg = config
        self.pool = pool
        self.rows = rows
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []  # finished; blocks released, output not yet delivered
        self.next_iteration = 1
        self.last_completed = 0
        self._admitted: list[tuple[int, list[int]]] = []
        self.metrics = metrics or _NoMetrics()
        self.cache = PrefixCache(pool, config.block_size) if config.prefix_cache != "off" else None
        self._claims: dict[int, Request] = {}  # prefix-block hash -> the running request computing it
        # async mode: (tokens, blocks) waiting for the idle point; each block holds one reference here
        self._deferred_inserts: list[tuple[list[int], list[int]]] = []
        self.progress = 0  # grows with committed tokens, finishes and first-time prompt positions

    @property
    def newest_submitted(self) -> int:
        return self.next_iteration - 1

    # ---- queue events (scheduler thread) ----
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Request | None:
        for queue_ in (self.waiting, self.running):
            for req in queue_:
                if req.request_id == request_id:
                    req.finish_reason = "abort"
                    self._finish(req)
                    return req
        return None

    def _finish(self, req: Request) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        self._release_blocks(req)
        if req.row is not None:
            self.rows.release(req.row, fence=self.newest_submitted)
            req.row = None
        req.status = RequestStatus.FINISHED
        self.finished.append(req)
        self.progress += 1

    def _release_blocks(self, req: Request) -> None:
        # Fence = newest submitted iteration: the last one that may still read these blocks (S18).
        self.pool.release(req.block_table, fence=self.newest_submitted)
        self.retire()
        req.block_table = []
        req.num_computed = 0
        req.num_readonly_blocks = 0
        req.num_cached_blocks = 0
        self._drop_claims(req)

    def retire(self) -> None:
        self.pool.retire(self.last_completed)
        self.rows.retire(self.last_completed)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release_blocks(req)
        req.epoch += 1  # in-flight results of the old epoch are dropped; the row keeps committed tokens
        req.pending_samples = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def _ensure_free(self, need: int) -> bool:
        """Whether `need` blocks are FREE, evicting cached prefixes first. Evicted blocks wait behind
        their fence, so they may become free only when in-flight iterations complete."""
        if need > self.pool.num_free and self.cache is not None:
            evicted = self.cache.evict(need - self.pool.num_free, fence=self.newest_submitted)
            if evicted:
                self.metrics.add("prefix_evicted_blocks", evicted)
                self.retire()
        return need <= self.pool.num_free

    def _grow(self, req: Request, tokens: int) -> bool:
        """Make the block table cover `tokens` positions; False if the pool is short."""
        need = _blocks_for(tokens, self.cfg.block_size) - len(req.block_table)
        if need <= 0:
            return True
        if not self._ensure_free(need):
            return False
        req.block_table.extend(self.pool.allocate(need))
        return True

    # ---- planning ----
    def schedule(self) -> Batch | None:
        self.retire()
        budget = self.cfg.max_num_batched_tokens
        decode: list[ScheduledRow] = []
        prefill: list[ScheduledRow] = []
        if self.cfg.mixed_batches:
            decode = self._schedule_decode(budget)
            prefill = self._schedule_prefill(budget - len(decode))
        else:  # one kind per batch, prompts first
            prefill = self._schedule_prefill(budget)
            if not prefill:
                decode = self._schedule_decode(budget)
        admitted, self._admitted = tuple(self._admitted), []
        if not decode and not prefill:
            return None
        it = self.next_iteration
        self.next_iteration += 1
        depends_on = max((r.req.last_sample_iteration for r in decode + prefill), default=0)
        for r in decode + prefill:
            r.req.num_computed = r.start + r.length
            if r.samples:
                r.req.pending_samples += 1
                r.req.last_sample_iteration = it
        return Batch(it, decode, prefill, depends_on, admitted)

    def _wants_decode(self, req: Request) -> bool:
        drawn = req.planned_len - len(req.prompt_ids)
        # KV of the newest token goes to position planned_len - 1, which must stay < max_model_len.
        return req.is_decode and drawn < req.params.max_tokens and req.planned_len <= self.max_model_len

    def _schedule_decode(self, budget: int) -> list[ScheduledRow]:
        rows: list[ScheduledRow] = []
        for req in list(self.running):
            if len(rows) >= budget:
                break
            if req.status != RequestStatus.RUNNING or not self._wants_decode(req):
                continue  # preempted earlier in this loop, still prefilling, or has all its tokens planned
            while not self._grow(req, req.planned_len):
                if self.pool.num_pending:
                    break  # blocks come back when in-flight iterations complete: wait, don't preempt
                # The newest arrival goes: the oldest request always keeps its blocks and finishes.
                victim = max(self.running, key=lambda r: r.arrival)
                rows = [r for r in rows if r.req is not victim]
                self._preempt(victim)
                if victim is req:
                    break
            if (
                req.status == RequestStatus.RUNNING
                and len(req.block_table) * self.cfg.block_size >= req.planned_len
            ):
                rows.append(ScheduledRow(req, req.num_computed, 1, True, req.epoch))
        return rows

    def _schedule_prefill(self, budget: int) -> list[ScheduledRow]:
        rows: list[ScheduledRow] = []
        chunk, bs = self.cfg.chunk_size, self.cfg.block_size
        partial = [r for r in self.running if not r.is_decode]  # admitted, prompt not fully planned
        # Blocks that admitted prompts will still claim: new admissions must leave them free.
        reserved = sum(_blocks_for(r.planned_len, bs) - len(r.block_table) for r in partial)
        # The watermark: room for the next decode step of every running decode. Without it a
        # preempted request is re-admitted with the blocks its preemptor waits for (a livelock).
        watermark = sum(
            max(0, _blocks_for(r.planned_len + 1, bs) - len(r.block_table))
            for r in self.running
            if r.is_decode and self._wants_decode(r)
        )
        for req in partial + list(self.waiting):
            if budget <= 0:
                break
            pending = req.planned_len - req.num_computed
            if chunk is None:  # whole-prompt prefill: never split (a lone prompt may exceed the budget)
                if pending > budget and rows:
                    break
                n = pending
            else:
                n = min(pending, chunk, budget)
            if req.status == RequestStatus.WAITING:
                if len(self.running) >= self.cfg.max_num_seqs or (req.row is None and not self.rows.num_free):
                    break
                hit = self._match_prefix(req)
                if hit is None:
                    continue  # its next prefix block is being computed by another request: wait for it
                need = _blocks_for(req.planned_len, bs) - len(hit)
                if not self._ensure_free(need + reserved + watermark):
                    self.pool.release(hit, fence=self.newest_submitted)  # the tree still holds them
                    break  # FCFS: later arrivals do not overtake the head of the queue
                if req.row is None:
                    req.row = self.rows.allocate()
                    self._admitted.append((req.row, req.prompt_ids))
                self.waiting.remove(req)
                req.status = RequestStatus.RUNNING
                if req.scheduled_time is None:
                    req.scheduled_time = time.perf_counter()
                self.running.append(req)
                self._start_from_prefix(req, hit)
                n = min(n, req.planned_len - req.num_computed)
                reserved += need
            if not self._grow(req, req.num_computed + n):
                break
            reserved -= _blocks_for(req.num_computed + n, bs) - _blocks_for(req.num_computed, bs)
            rows.append(
                ScheduledRow(req, req.num_computed, n, req.num_computed + n == req.planned_len, req.epoch)
            )
            budget -= n
        return rows

    # ---- prefix cache (scheduler thread only) ----
    def _match_prefix(self, req: Request) -> list[int] | None:
        """Cached blocks `req` can start from (each shared, so eviction cannot take them), or None
        when another running request is computing the very next block of its prefix right now."""
        if self.cache is None:
            return []
        bs = self.cfg.block_size
        limit = req.cacheable_blocks(bs)
        hit = self.cache.match(req.prompt_ids + req.output_ids, limit)
        hashes = req.block_hashes(bs)
        if len(hit) < min(limit, len(hashes)):
            claimant = self._claims.get(hashes[len(hit)])
            if claimant is not None and claimant is not req:
                return None
        for b in hit:
            self.pool.share(b)
        return hit

    def _start_from_prefix(self, req: Request, hit: list[int]) -> None:
        """Admit `req` at the end of its cached prefix and claim the prompt blocks it will compute."""
        bs = self.cfg.block_size
        req.block_table = list(hit)
        req.num_computed = len(hit) * bs
        req.num_readonly_blocks = req.num_cached_blocks = len(hit)  # the tree holds them READ_ONLY
        self.metrics.add("prefix_queries")
        self.metrics.add("prefix_query_tokens", req.planned_len)
        if hit:
            self.metrics.add("prefix_hits")
            self.metrics.add("prefix_hit_tokens", len(hit) * bs)
        if self.cache is not None:
            for h in req.block_hashes(bs)[len(hit) : req.cacheable_blocks(bs)]:
                if self._claims.setdefault(h, req) is req:
                    req.claims.append(h)

    def _drop_claims(self, req: Request) -> None:
        for h in req.claims:
            if self._claims.get(h) is req:
                del self._claims[h]
        req.claims = []

    def _offer_to_cache(self, req: Request) -> None:
        """Hand the request's newly completed full blocks to the tree (now, or at the idle point)."""
        n = req.num_readonly_blocks
        if self.cache is None or n <= req.num_cached_blocks:
            return
        req.num_cached_blocks = n
        tokens = (req.prompt_ids + req.output_ids)[: n * self.cfg.block_size]
        blocks = req.block_table[:n]
        if self.cfg.prefix_cache == "sync":
            self._insert(tokens, blocks)
        else:
            for b in blocks:
                self.pool.share(b)  # the queued insertion keeps them alive even if the request ends
            self._deferred_inserts.append((tokens, blocks))
            # Its claims on these blocks now belong to the queued insertion, which settles them: a
            # request waiting for them keeps waiting (until the flush) rather than missing.
            offered = set(req.block_hashes(self.cfg.block_size)[:n])
            req.claims = [h for h in req.claims if h not in offered]

    def _insert(self, tokens: list[int], blocks: list[int]) -> None:
        t0 = time.perf_counter()
        self.metrics.add("prefix_cached_blocks", self.cache.insert(tokens, blocks))
        # Claims on these prefixes are settled: requests waiting for them can now hit.
        for h in prefix_hashes(tokens, self.cfg.block_size, len(blocks)):
            claimant = self._claims.pop(h, None)
            if claimant is not None and h in claimant.claims:
                claimant.claims.remove(h)
        self.metrics.add("prefix_insert_s", time.perf_counter() - t0)

    def flush_deferred_inserts(self) -> bool:
        """async mode: insert what completed since the last call; True if there was any. The engine
        calls this at its idle point — after the pipeline is full, before it waits for the device —
        never between a completion and the plan that follows it."""
        pending, self._deferred_inserts = self._deferred_inserts, []
        for tokens, blocks in pending:
            self._insert(tokens, blocks)
            self.pool.release(blocks, fence=self.newest_submitted)
        return bool(pending)

    def cache_holders(self) -> dict[int, int]:
        """Block -> references held by the prefix cache and queued insertions (for invariant checks)."""
        held: dict[int, int] = {}
        for b in self.cache.blocks() if self.cache is not None else []:
            held[b] = held.get(b, 0) + 1
        for _, blocks in self._deferred_inserts:
            for b in blocks:
                held[b] = held.get(b, 0) + 1
        return held

    def flush_cache(self) -> int:
        """Evict every cached block no request holds (they go FREE once in-flight work completes)."""
        self.flush_deferred_inserts()
        if self.cache is None:
            return 0
        n = self.cache.evict(self.cache.num_blocks, fence=self.newest_submitted)
        self.retire()
        return n

    # ---- results ----
    def complete(self, batch: Batch, out: StepOutput) -> list[tuple[Request, list[int]]]:
        """Apply a finished iteration (iterations complete in order): mark written blocks READ_ONLY,
        record logprobs, append drawn tokens, finish requests. Returns (request, new ids) to deliver."""
        self.last_completed = batch.iteration
        bs = self.cfg.block_size
        by_key = {id(r.req): r.req for r in batch.decode + batch.prefill}
        for key, index, lp in out.prompt_logprobs:
            req = by_key[key]
            if req.status == RequestStatus.RUNNING:
                req.prompt_logprobs[index] = lp
        updates: list[tuple[Request, list[int]]] = []
        for row in batch.decode + batch.prefill:
            req = row.req
            if req.status != RequestStatus.RUNNING or row.epoch != req.epoch:
                continue  # finished, aborted or preempted after planning: a late result, dropped
            end = row.start + row.length
            if end > req.high_water:  # positions recomputed after a preemption are no progress
                self.progress += 1
                req.high_water = end
            full = min(end // bs, len(req.block_table))
            for i in range(req.num_readonly_blocks, full):
                self.pool.write_completed(req.block_table[i])
            req.num_readonly_blocks = max(req.num_readonly_blocks, full)
            self._offer_to_cache(req)
            if row.samples:
                req.pending_samples -= 1
            if id(req) in out.errors:  # sampling or scoring this request failed: it alone ends
                req.error = out.errors[id(req)]
                req.finish_reason = "abort"
                self._finish(req)  # blocks and row go back behind the fence, like an abort
                continue
            if not row.samples:
                continue
            token = out.sampled[id(req)]
            if req.logprobs is not None:
                req.logprobs.append(out.logprobs[id(req)])
            req.append_token(token, self.max_model_len)
            updates.append((req, [token]))
            self.progress += 1
            if req.finish_reason is not None:
                self._finish(req)
        self.retire()
        return updates

    def take_finished(self) -> list[Request]:
        done, self.finished = self.finished, []
        return done
