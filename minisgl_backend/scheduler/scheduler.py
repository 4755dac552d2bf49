"""Batch planning over waiting / running / finished requests, and applying results.

Each iteration is one batch under a token budget: one decode token per running request, plus
prompt chunks of at most `chunk_size` tokens (mixed batches), or — with `mixed_batches=False` — a
batch of only one kind, prompts first (the serial policy when `chunk_size=None` as well). Admission
needs a token-table row and free blocks for the whole remaining prompt; a decode that finds no free
block preempts the running request that arrived last (blocks released, requeued for recompute).

Progress under any pool that holds one request: the victim of a preemption is always the running
request that arrived last, so the oldest one is never preempted while another runs; and admission
leaves a watermark of free blocks for every running decode's next iteration, so a preempted request is
not re-admitted with the very blocks the decode that preempted it is waiting for (a prefill-first
planner would do exactly that, forever). `progress` counts what moves a request forward
(committed tokens, finished requests, prompt positions computed for the first time): the loop's
watchdog fails an engine whose iterations stop moving it.

Planning uses lengths only, so with overlap it runs ahead of results: a request that drew EOS in
iteration N may still have a decode entry in N+1.. (planned before N's result was processed). Those
entries compute into blocks the request still owns or that wait in PENDING_RECLAIM behind their
fence, and their results are dropped when processed: EOS is seen late, never acted on twice.

The prefix cache's part (longest-prefix admission, claims, deferred inserts) is
`scheduler/prefix_admission.py`.
"""

from __future__ import annotations

import time
from collections import deque
from typing import NamedTuple

from minisgl_backend.arith import cdiv
from minisgl_backend.config import EngineConfig
from minisgl_backend.errors import InvariantError
from minisgl_backend.executor.token_table import RowPool
from minisgl_backend.iteration import IterationOutput
from minisgl_backend.kvcache.block_pool import BlockPool
from minisgl_backend.scheduler.prefix_admission import Counters, PrefixAdmission
from minisgl_backend.scheduler.request import Request, RequestStatus
from minisgl_backend.types import FinishReason


class BatchEntry(NamedTuple):
    """One request's part of an iteration: positions [start, start+length) of its sequence."""

    req: Request
    start: int  # first position computed in this iteration
    length: int  # tokens computed in this iteration
    samples: bool  # the iteration reaches the end of the sequence, so it draws the next token
    epoch: int  # req.epoch at planning time


class Batch(NamedTuple):
    """One planned iteration."""

    iteration: int
    decode: list[BatchEntry]
    prefill: list[BatchEntry]
    depends_on: int  # newest earlier iteration that draws a token some entry here reads
    prompt_writes: tuple[tuple[int, list[int]], ...]  # admitted by this batch: (table row, prompt ids)


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        pool: BlockPool,
        row_pool: RowPool,
        max_model_len: int,
        metrics: Counters,
    ) -> None:
        self.cfg = config
        self.block_size = config.block_size
        self.pool = pool
        self.row_pool = row_pool
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []  # finished; blocks released, output not yet delivered
        self.next_iteration = 1
        self.last_completed = 0
        self._admitted: list[tuple[int, list[int]]] = []
        self.metrics = metrics
        self.prefix = PrefixAdmission(config.prefix_cache, pool, config.block_size, self.metrics)
        self.progress = 0  # grows with committed tokens, finishes and first-time prompt positions
        self._admissions = 0  # admissions so far: the fair policy's clock
        self._owner_admitted: dict[str, int] = {}  # waiting owners -> when one of theirs was last admitted

    @property
    def newest_submitted(self) -> int:
        """The fence of anything released now: the newest iteration that may still read it."""
        return self.next_iteration - 1

    # ---- queue events ----
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> None:
        """Finish the request with that id (each of its n samples), waiting or running; an unknown
        id is ignored."""
        for queue_ in (self.waiting, self.running):
            for req in [r for r in queue_ if r.request_id == request_id]:
                self.finish(req, "abort")

    def finish(self, req: Request, reason: FinishReason, error: Exception | None = None) -> None:
        """The one place a request ends: its blocks and row go back behind the fence."""
        req.finish_reason = reason
        req.error = error
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        self._release_blocks(req)
        if req.table_row is not None:
            self.row_pool.release(req.table_row, fence=self.newest_submitted)
            req.table_row = None
        req.status = RequestStatus.FINISHED
        self.finished.append(req)
        self.progress += 1

    def take_finished(self) -> list[Request]:
        done, self.finished = self.finished, []
        return done

    def _release_blocks(self, req: Request) -> None:
        self.pool.release(req.block_table, fence=self.newest_submitted)
        self.retire()
        req.block_table = []
        req.num_computed = 0
        req.num_readonly_blocks = 0
        req.num_offered_blocks = 0
        self.prefix.drop_claims(req)

    def retire(self) -> None:
        self.pool.retire(self.last_completed)
        self.row_pool.retire(self.last_completed)

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
        if need > self.pool.num_free and self.prefix.evict(need - self.pool.num_free, self.newest_submitted):
            self.retire()
        return need <= self.pool.num_free

    def _grow(self, req: Request, tokens: int) -> bool:
        """Make the block table cover `tokens` positions; False if the pool is short."""
        need = cdiv(tokens, self.block_size) - len(req.block_table)
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
        decode: list[BatchEntry] = []
        prefill: list[BatchEntry] = []
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
        depends_on = max((e.req.last_sample_iteration for e in decode + prefill), default=0)
        for e in decode + prefill:
            e.req.num_computed = e.start + e.length
            if e.samples:
                e.req.pending_samples += 1
                e.req.last_sample_iteration = it
        return Batch(it, decode, prefill, depends_on, admitted)

    def _wants_decode(self, req: Request) -> bool:
        drawn = req.planned_len - len(req.prompt_ids)
        # KV of the newest token goes to position planned_len - 1, which must stay < max_model_len.
        return req.is_decode and drawn < req.params.max_tokens and req.planned_len <= self.max_model_len

    def _schedule_decode(self, budget: int) -> list[BatchEntry]:
        entries: list[BatchEntry] = []
        for req in list(self.running):
            if len(entries) >= budget:
                break
            if req.status != RequestStatus.RUNNING or not self._wants_decode(req):
                continue  # preempted earlier in this loop, still prefilling, or has all its tokens planned
            while not self._grow(req, req.planned_len):
                if self.pool.num_pending:
                    break  # blocks come back when in-flight iterations complete: wait, don't preempt
                # The newest arrival goes: the oldest request always keeps its blocks and finishes.
                victim = max(self.running, key=lambda r: r.arrival)
                entries = [e for e in entries if e.req is not victim]
                self._preempt(victim)
                if victim is req:
                    break
            covered = len(req.block_table) * self.block_size >= req.planned_len
            if req.status == RequestStatus.RUNNING and covered:
                entries.append(BatchEntry(req, req.num_computed, 1, True, req.epoch))
        return entries

    def _schedule_prefill(self, budget: int) -> list[BatchEntry]:
        entries: list[BatchEntry] = []
        chunk, bs = self.cfg.chunk_size, self.block_size
        partial = [r for r in self.running if not r.is_decode]  # admitted, prompt not fully planned
        # Blocks that admitted prompts will still claim: new admissions must leave them free.
        reserved = sum(cdiv(r.planned_len, bs) - len(r.block_table) for r in partial)
        # The watermark: room for the next decode iteration of every running decode. Without it a
        # preempted request is re-admitted with the blocks its preemptor waits for (a livelock).
        watermark = sum(
            max(0, cdiv(r.planned_len + 1, bs) - len(r.block_table))
            for r in self.running
            if r.is_decode and self._wants_decode(r)
        )
        # A waiting request is admitted only while a running slot is free: skip ordering them otherwise.
        waiting = self._admission_order() if len(self.running) < self.cfg.max_num_seqs else []
        for req in partial + waiting:
            if budget <= 0:
                break
            pending = req.planned_len - req.num_computed
            if chunk is None:  # whole-prompt prefill: never split (a lone prompt may exceed the budget)
                if pending > budget and entries:
                    break
                n = pending
            else:
                n = min(pending, chunk, budget)
            if req.status == RequestStatus.WAITING:
                no_row = req.table_row is None and not self.row_pool.num_free
                if len(self.running) >= self.cfg.max_num_seqs or no_row:
                    break
                hit = self.prefix.match(req)
                if hit is None:
                    continue  # its next prefix block is being computed by another request: wait for it
                need = cdiv(req.planned_len, bs) - len(hit)
                if not self._ensure_free(need + reserved + watermark):
                    self.pool.release(hit, fence=self.newest_submitted)  # the tree still holds them
                    break  # later candidates do not overtake the head of the admission order
                self._admit(req, hit)
                n = min(n, req.planned_len - req.num_computed)
                reserved += need
            if not self._grow(req, req.num_computed + n):
                break
            reserved -= cdiv(req.num_computed + n, bs) - cdiv(req.num_computed, bs)
            samples = req.num_computed + n == req.planned_len
            entries.append(BatchEntry(req, req.num_computed, n, samples, req.epoch))
            budget -= n
        return entries

    def _admission_order(self) -> list[Request]:
        """The waiting requests in the order admission considers them. fcfs: arrival order. fair:
        owners take turns, one request each per round, the owner admitted least recently first
        (never: first; ties: whose request waits longest), each owner's requests in arrival order;
        so one submission of many prompts or n samples cannot hold every free slot against a
        request that arrives after it, however few slots there are. Under both, preempted requests
        come first (they went back to the head of the queue with their committed tokens, and the
        oldest must finish)."""
        if self.cfg.scheduling_policy == "fcfs":
            return list(self.waiting)
        first = [r for r in self.waiting if r.num_preemptions]
        queues: dict[str, list[Request]] = {}
        for req in self.waiting:
            if not req.num_preemptions:
                queues.setdefault(req.owner, []).append(req)
        last = self._owner_admitted
        self._owner_admitted = {o: last[o] for o in queues if o in last}  # only owners that still wait
        if len(queues) <= 1:
            return list(self.waiting)
        owners = sorted(queues.values(), key=lambda q: last.get(q[0].owner, -1))  # stable on ties
        longest = max(map(len, owners))
        return first + [q[i] for i in range(longest) for q in owners if i < len(q)]

    def _admit(self, req: Request, hit: list[int]) -> None:
        if req.table_row is None:  # a preempted request keeps its row (and its committed tokens)
            req.table_row = self.row_pool.allocate()
            self._admitted.append((req.table_row, req.prompt_ids))
        self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        self._admissions += 1
        self._owner_admitted[req.owner] = self._admissions  # its next request waits for the others
        if req.scheduled_time is None:
            req.scheduled_time = time.perf_counter()
        self.running.append(req)
        self.prefix.start(req, hit)

    # ---- results ----
    def complete(self, batch: Batch, out: IterationOutput) -> list[tuple[Request, list[int]]]:
        """Apply a finished iteration (iterations complete in order): mark written blocks READ_ONLY,
        record logprobs, append drawn tokens, finish requests. Returns (request, new ids) to deliver."""
        self.last_completed = batch.iteration
        by_key = {id(e.req): e.req for e in batch.decode + batch.prefill}
        for key, index, lp in out.prompt_logprobs:
            req = by_key[key]
            if req.status == RequestStatus.RUNNING:
                assert req.prompt_logprobs is not None  # only a request that scores its prompt gets these
                req.prompt_logprobs[index] = lp
        updates: list[tuple[Request, list[int]]] = []
        for entry in batch.decode + batch.prefill:
            req = entry.req
            if req.status != RequestStatus.RUNNING or entry.epoch != req.epoch:
                continue  # finished, aborted or preempted after planning: a late result, dropped
            end = entry.start + entry.length
            if end > req.high_water:  # positions recomputed after a preemption are no progress
                self.progress += 1
                req.high_water = end
            full = min(end // self.block_size, len(req.block_table))
            for i in range(req.num_readonly_blocks, full):
                self.pool.write_completed(req.block_table[i])
            req.num_readonly_blocks = max(req.num_readonly_blocks, full)
            self.prefix.offer(req)
            if entry.samples:
                req.pending_samples -= 1
            if id(req) in out.errors:  # sampling or scoring this request failed: it alone ends
                self.finish(req, "abort", out.errors[id(req)])
                continue
            if not entry.samples:
                continue
            token = out.sampled[id(req)]
            if req.logprobs is not None:
                req.logprobs.append(out.logprobs[id(req)])
            reason = req.append_token(token, self.max_model_len)
            updates.append((req, [token]))
            self.progress += 1
            if reason is not None:
                self.finish(req, reason)
        self.retire()
        return updates

    # ---- the prefix cache at the loop's idle point, and on drain ----
    def flush_deferred_inserts(self) -> bool:
        return self.prefix.flush_deferred(self.newest_submitted)

    def flush_cache(self) -> None:
        """Evict every cached block no request holds (they go FREE once in-flight work completes)."""
        self.prefix.flush(self.newest_submitted)
        self.retire()

    # ---- invariants ----
    def check_invariants(self) -> dict[str, int]:
        """Verify the KV and row accounting against every holder: running requests' block tables,
        the prefix tree and queued insertions. Returns block counts per state plus 'cached',
        'running', 'waiting' and 'rows_free'; raises InvariantError when anything is inconsistent."""
        counts = self.pool.check_invariants()
        rows = self.row_pool
        holders = [r for r in list(self.running) + list(self.waiting) if r.table_row is not None]
        if len(holders) + rows.num_free + rows.num_pending() != rows.num_rows:
            raise InvariantError("token-table rows leaked or double-counted")
        if any(r.block_table for r in self.waiting):
            raise InvariantError("a waiting request holds blocks")
        refs = self.prefix.holders()
        for r in self.running:
            for b in r.block_table:
                refs[b] = refs.get(b, 0) + 1
        for b, rc in enumerate(self.pool.refcount):
            if rc != refs.get(b, 0):
                raise InvariantError(
                    f"block {b} ({self.pool.state[b].name}) has refcount {rc} but {refs.get(b, 0)} holders"
                )
        return {
            **counts,
            "cached": self.prefix.num_blocks,
            "running": len(self.running),
            "waiting": len(self.waiting),
            "rows_free": rows.num_free,
        }
