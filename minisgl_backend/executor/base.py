"""What both executor back-ends share: a compute worker and a copy worker, the wait that keeps an
iteration from reading a token before the iteration that samples it has written it, and results
handed to the scheduler through the in-flight tracker (bounded in-flight count, bulk completions).

    scheduler --submit--> [compute worker]  wait sampled(depends_on) -> gather ids -> _launch (back-end)
                                 | logits, via the back-end's hand-off
                                 v
                          [copy worker]     float32 host logits -> sample -> token table -> result
                                 |           -> _sampled_upto -> tracker.complete(id)
    scheduler <--wait/drain completion ids (bulk)-- tracker

A back-end supplies three things: `_launch` (run the forward of one iteration and hand its logits to
the copy side), `_copy_items` (the copy side's feed, in iteration order) and `_stop_copy`. Workers
never touch request state (the scheduler thread owns it, so a request's slot can never be freed
under a worker that still uses it): they read immutable IterationInputs and post results keyed by
iteration id. Every multi-threaded torch op runs on the compute thread (docs/architecture.md,
"One OpenMP team").
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from minisgl_backend.executor.sample_stage import ReducedLogits, sample_iteration
from minisgl_backend.executor.token_table import TokenTable
from minisgl_backend.executor.tracker import InflightTracker
from minisgl_backend.iteration import IterationInputs, IterationOutput, PrefillChunk
from minisgl_backend.kvcache.storage import KVCache
from minisgl_backend.metrics import Metrics, Tracer
from minisgl_backend.model.batch import ForwardBatch
from minisgl_backend.model.llama import CausalLM

STOP = None


def index_tensors(inp: IterationInputs, input_ids: torch.Tensor) -> list[torch.Tensor | None]:
    """Every tensor of one iteration that the forward reads, in a fixed order (see forward_batch)."""
    return [
        input_ids,
        inp.positions,
        inp.slot_mapping,
        inp.decode_block_tables,
        inp.decode_mask,
        inp.logits_index,
        *(chunk.block_table for chunk in inp.prefill_chunks),
    ]


def _given(t: torch.Tensor | None) -> torch.Tensor:
    assert t is not None  # a prefill chunk always has its block table
    return t


def forward_batch(inp: IterationInputs, tensors: Sequence[torch.Tensor | None]) -> ForwardBatch:
    """The ForwardBatch of `inp` over `tensors` laid out as by index_tensors (on any device)."""
    ids, positions, slots, tables, mask, logits_index, *chunk_tables = tensors
    # Only the decode tables and mask are None (a batch without decode rows): the rest always exist.
    assert ids is not None and positions is not None and slots is not None and logits_index is not None
    chunks = tuple(
        PrefillChunk(c.start, c.length, c.ctx_len, _given(t))
        for c, t in zip(inp.prefill_chunks, chunk_tables)
    )
    return ForwardBatch(
        input_ids=ids,
        positions=positions,
        slot_mapping=slots,
        num_decode=inp.num_decode,
        decode_block_tables=tables,
        decode_mask=mask,
        prefill_chunks=chunks,
        logits_index=logits_index,
    )


class DualWorkerExecutor:
    # KV blocks at the end of the pool that the back-end writes itself (the padding rows of CUDA-graph
    # decode): the engine allocates them beyond the requests' blocks and never hands them out.
    reserved_kv_blocks = 0

    def __init__(
        self, tracker: InflightTracker, metrics: Metrics, tracer: Tracer, *, debug_delay_ms: float = 0.0
    ) -> None:
        self.tracker = tracker
        self.metrics = metrics
        self.tracer = tracer
        # model, kv and table: set by attach(), before the first iteration is submitted.
        self.model: CausalLM
        self.kv: KVCache
        self.table: TokenTable
        self.results: dict[int, IterationOutput] = {}
        self.error: BaseException | None = None
        self._delay_s = debug_delay_ms / 1000.0
        self._compute_q: queue.SimpleQueue[IterationInputs | tuple | None] = queue.SimpleQueue()
        # The "event" the compute side waits on: the newest iteration whose tokens are written.
        self._sampled_upto = 0
        self._sampled_cv = threading.Condition()
        self._threads = [
            threading.Thread(target=self._compute_loop, name="minisgl-compute", daemon=True),
            threading.Thread(target=self._copy_loop, name="minisgl-copy", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ---- the back-end's part ----
    def _launch(self, inp: IterationInputs, input_ids: torch.Tensor) -> None:
        """Compute thread: run the forward of `inp` and hand its logits to the copy side."""
        raise NotImplementedError

    def _copy_items(self) -> Iterator[tuple[IterationInputs, np.ndarray | ReducedLogits]]:
        """Copy thread: (inputs, float32 host logits) in iteration order, until _stop_copy."""
        raise NotImplementedError

    def _stop_copy(self) -> None:
        """Compute thread, on its way out: end _copy_items once what was handed off is through."""
        raise NotImplementedError

    # ---- the scheduler's side ----
    def run_on_compute(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the compute thread (model loading, KV allocation) and return its result."""
        fut: Future = Future()
        self._compute_q.put((fn, fut))
        return fut.result()

    def attach(self, model: CausalLM, kv: KVCache, table: TokenTable) -> None:
        self.model, self.kv, self.table = model, kv, table

    def submit(self, inputs: IterationInputs) -> None:
        self.tracker.begin()
        self._compute_q.put(inputs)

    @property
    def threads(self) -> tuple[threading.Thread, ...]:
        """The worker threads (the engine refuses blocking calls made from them)."""
        return tuple(self._threads)

    def take_result(self, iteration: int) -> IterationOutput:
        return self.results.pop(iteration)

    def close(self) -> None:
        self._compute_q.put(STOP)
        for t in self._threads:
            t.join(timeout=60)
        if not any(t.is_alive() for t in self._threads):
            self._release()

    def _release(self) -> None:
        """Drop the model, the KV pool and the token table once no worker can read them: a closed
        engine that its caller still holds gives their memory back (on a GPU, to the next engine
        that sizes its pool from the device's free memory)."""
        for name in ("model", "kv", "table"):
            self.__dict__.pop(name, None)

    # ---- compute worker ----
    def _wait_sampled(self, iteration: int) -> bool:
        """Block until the copy worker has sampled `iteration` (False: a worker failed instead)."""
        with self._sampled_cv:
            self._sampled_cv.wait_for(lambda: self._sampled_upto >= iteration or self.error is not None)
        return self.error is None

    def _compute_loop(self) -> None:
        try:
            while (inp := self._compute_q.get()) is not STOP:
                if not isinstance(inp, IterationInputs):  # run_on_compute
                    fn, fut = inp
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # noqa: BLE001 - raised in the caller
                        fut.set_exception(e)
                    # Drop the closure before waiting again: it may reference the Engine, which
                    # must stay collectable (its finaliser closes it).
                    inp = fn = fut = None
                    continue
                if not self._wait_sampled(inp.depends_on):  # the tokens it reads are written first
                    return
                for row, tokens in inp.prompt_writes:
                    self.table.write_prompt(row, tokens)
                self._launch(inp, self.table.gather(inp.table_rows, inp.positions))
        except BaseException as e:  # noqa: BLE001 - reported to the scheduler thread
            self._fail(e)
        finally:
            self._stop_copy()  # also on failure: the copy worker must not wait forever

    # ---- copy worker ----
    def _copy_loop(self) -> None:
        try:
            for inp, logits in self._copy_items():
                if self._delay_s:  # test hook: a slow copy stage widens every race window
                    time.sleep(random.uniform(0, self._delay_s))
                t0 = time.perf_counter()
                out = sample_iteration(inp, logits, self.table)
                t1 = time.perf_counter()
                self.metrics.add("sample_s", t1 - t0)
                self.tracer.span("copy", f"sample {inp.iteration}", t0, t1)
                self.results[inp.iteration] = out
                with self._sampled_cv:
                    self._sampled_upto = inp.iteration
                    self._sampled_cv.notify_all()
                self.tracker.complete(inp.iteration)
        except BaseException as e:  # noqa: BLE001 - reported to the scheduler thread
            self._fail(e)

    def _fail(self, e: BaseException) -> None:
        if self.error is None:
            self.error = e
        with self._sampled_cv:
            self._sampled_cv.notify_all()
        self.tracker.wake()
