"""Batch planning over waiting / running / finished requests (S3, S12).

Each step builds one batch under a token budget: one decode token per running request, plus prompt
chunks of at most `chunk_size` tokens (mixed batches), or — with `mixed_batches=False` — a batch of
only one kind, prompts first (the serial policy when `chunk_size=None` as well). Admission needs free
blocks for the whole remaining prompt; a decode that finds no free block preempts the youngest
running request (its blocks are released and it is requeued for recompute).
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from minisgl_backend.config import EngineConfig
from minisgl_backend.kvcache.block_pool import BlockPool
from minisgl_backend.scheduler.request import Request, RequestStatus
from minisgl_backend.types import TokenLogprob


class ScheduledRow(NamedTuple):
    req: Request
    start: int  # first position computed in this step (= req.num_computed at planning time)
    length: int  # tokens computed in this step
    samples: bool  # the step reaches the end of the sequence, so it draws the next token


class StepOutput(NamedTuple):
    """What one executed iteration reports back to the scheduler."""

    sampled: dict[int, int]  # id(request) -> drawn token
    logprobs: dict[int, TokenLogprob]  # id(request) -> logprob of the drawn token (when asked)
    prompt_logprobs: list[tuple[Request, int, TokenLogprob]]  # (request, prompt index, logprob)
    errors: dict[int, Exception]  # id(request) -> its logits processor's exception


class Batch(NamedTuple):
    iteration: int
    decode: list[ScheduledRow]
    prefill: list[ScheduledRow]

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(r.length for r in self.prefill)


def _blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class Scheduler:
    def __init__(self, config: EngineConfig, pool: BlockPool, max_model_len: int) -> None:
        self.cfg = config
        self.pool = pool
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []  # finished this step; blocks released, output not yet delivered
        self.next_iteration = 1
        self.last_completed = 0

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
        req.status = RequestStatus.FINISHED
        self.finished.append(req)

    def _release_blocks(self, req: Request) -> None:
        # Fence = newest submitted iteration: the last one that may still read these blocks (S18).
        self.pool.release(req.block_table, fence=self.next_iteration - 1)
        self.pool.retire(self.last_completed)
        req.block_table = []
        req.num_computed = 0
        req.num_readonly_blocks = 0

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release_blocks(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def _grow(self, req: Request, tokens: int) -> bool:
        """Make the block table cover `tokens` positions; False if the pool is short."""
        need = _blocks_for(tokens, self.cfg.block_size) - len(req.block_table)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        req.block_table.extend(self.pool.allocate(need))
        return True

    # ---- planning ----
    def schedule(self) -> Batch | None:
        self.pool.retire(self.last_completed)
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
        if not decode and not prefill:
            return None
        batch = Batch(self.next_iteration, decode, prefill)
        self.next_iteration += 1
        return batch

    def _schedule_decode(self, budget: int) -> list[ScheduledRow]:
        rows: list[ScheduledRow] = []
        for req in list(self.running):
            if len(rows) >= budget:
                break
            if req.status != RequestStatus.RUNNING or not req.is_decode:
                continue  # preempted earlier in this loop, or still prefilling
            while not self._grow(req, req.seq_len):
                victim = self.running[-1]
                if victim is not req and any(r.req is victim for r in rows):
                    rows = [r for r in rows if r.req is not victim]
                self._preempt(victim)
                self.pool.retire(self.last_completed)
                if victim is req:
                    break
            if req.status == RequestStatus.RUNNING:
                rows.append(ScheduledRow(req, req.num_computed, 1, True))
        return rows

    def _schedule_prefill(self, budget: int) -> list[ScheduledRow]:
        rows: list[ScheduledRow] = []
        chunk, bs = self.cfg.chunk_size, self.cfg.block_size
        partial = [r for r in self.running if not r.is_decode]
        # Blocks that admitted prompts will still claim: new admissions must leave them free.
        reserved = sum(_blocks_for(r.seq_len, bs) - len(r.block_table) for r in partial)
        for req in partial + list(self.waiting):
            if budget <= 0:
                break
            pending = req.seq_len - req.num_computed
            if chunk is None:  # whole-prompt prefill: never split (a lone prompt may exceed the budget)
                if pending > budget and rows:
                    break
                n = pending
            else:
                n = min(pending, chunk, budget)
            if req.status == RequestStatus.WAITING:
                need = _blocks_for(req.seq_len, bs)
                if len(self.running) >= self.cfg.max_num_seqs or need > self.pool.num_free - reserved:
                    break  # FCFS: later arrivals do not overtake the head of the queue
                self.waiting.remove(req)
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                reserved += need
            if not self._grow(req, req.num_computed + n):
                break
            reserved -= _blocks_for(req.num_computed + n, bs) - _blocks_for(req.num_computed, bs)
            rows.append(ScheduledRow(req, req.num_computed, n, req.num_computed + n == req.seq_len))
            budget -= n
        return rows

    # ---- results ----
    def complete(self, batch: Batch, out: StepOutput) -> list[tuple[Request, list[int]]]:
        """Apply a finished iteration: advance KV, record logprobs, append sampled tokens, mark
        full blocks READ_ONLY, finish requests. Returns (request, new token ids) to deliver."""
        self.last_completed = max(self.last_completed, batch.iteration)
        bs = self.cfg.block_size
        for req, index, lp in out.prompt_logprobs:
            if req.status == RequestStatus.RUNNING:
                req.prompt_logprobs[index] = lp
        updates: list[tuple[Request, list[int]]] = []
        for row in batch.decode + batch.prefill:
            req = row.req
            if req.status != RequestStatus.RUNNING:
                continue  # aborted while in flight; its blocks were already released
            req.num_computed = row.start + row.length
            full = min(req.num_computed // bs, len(req.block_table))
            for i in range(req.num_readonly_blocks, full):
                self.pool.write_completed(req.block_table[i])
            req.num_readonly_blocks = max(req.num_readonly_blocks, full)
            if id(req) in out.errors:
                req.error = out.errors[id(req)]
                req.finish_reason = "abort"
                self._finish(req)
                continue
            if row.samples:
                token = out.sampled[id(req)]
                if req.logprobs is not None:
                    req.logprobs.append(out.logprobs[id(req)])
                req.append_token(token, self.max_model_len)
                updates.append((req, [token]))
                if req.finish_reason is not None:
                    self._finish(req)
        self.pool.retire(self.last_completed)
        return updates

    def take_finished(self) -> list[Request]:
        done, self.finished = self.finished, []
        return done
