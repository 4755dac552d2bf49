"""The CPU executor: two worker threads stand in for a compute stream and a copy stream (S11).

    scheduler thread --submit--> [compute worker]  wait sampled(depends_on) -> gather inputs -> forward
                                        | logits
                                        v
                                 [copy worker]     logits to host fp32 -> sample -> write token table
                                        |           -> result slot -> tracker.complete(id)
                                        v
    scheduler thread <--wait/drain completion ids (bulk)-- tracker

Torch releases the GIL inside its kernels, so the scheduler thread plans iteration N+1 and processes
the results of N-1 while the compute worker runs N. Workers never touch request state (S7): they
read immutable IterationInputs and post results keyed by iteration id.

Every multi-threaded torch op — loading the model, allocating the KV pool, the forward pass, the
logits conversion — runs on the compute thread; the other threads use numpy or tiny tensors. A
second OpenMP thread team (one per thread that runs a parallel torch op) makes the forward ~30%
slower on a 2-core machine (measured): the teams' idle workers no longer spin-wait.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import torch

from minisgl_backend.executor.inputs import IterationInputs
from minisgl_backend.executor.token_table import TokenTable
from minisgl_backend.executor.tracker import InflightTracker
from minisgl_backend.kvcache.storage import KVCache
from minisgl_backend.metrics import Metrics, Tracer
from minisgl_backend.model.llama import CausalLM, ForwardBatch
from minisgl_backend.sampling.stage import sample_iteration
from minisgl_backend.scheduler.scheduler import StepOutput

_STOP = None


class CPUExecutor:
    def __init__(self, tracker: InflightTracker, metrics: Metrics, tracer: Tracer, *,
                 debug_delay_ms: float = 0.0) -> None:
        self.tracker = tracker
        self.metrics = metrics
        self.tracer = tracer
        self.model: CausalLM | None = None
        self.kv: KVCache | None = None
        self.table: TokenTable | None = None
        self.results: dict[int, StepOutput] = {}
        self.error: BaseException | None = None
        self._delay_s = debug_delay_ms / 1000.0
        self._compute_q: queue.SimpleQueue[IterationInputs | tuple | None] = queue.SimpleQueue()
        self._copy_q: queue.SimpleQueue[tuple[IterationInputs, Any] | None] = queue.SimpleQueue()
        # The "event" the compute stream waits on: the newest iteration whose tokens are written.
        self._sampled_upto = 0
        self._sampled_cv = threading.Condition()
        self._threads = [
            threading.Thread(target=self._compute_loop, name="minisgl-compute", daemon=True),
            threading.Thread(target=self._copy_loop, name="minisgl-copy", daemon=True),
        ]
        for t in self._threads:
            t.start()

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

    def take_result(self, iteration: int) -> StepOutput:
        return self.results.pop(iteration)

    def close(self) -> None:
        self._compute_q.put(_STOP)
        for t in self._threads:
            t.join(timeout=60)

    # ---- compute stream ----
    def _compute_loop(self) -> None:
        while (inp := self._compute_q.get()) is not _STOP:
            if not isinstance(inp, IterationInputs):  # run_on_compute
                fn, fut = inp
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - raised in the caller
                    fut.set_exception(e)
                continue
            try:
                with self._sampled_cv:  # S6: the tokens this iteration reads are written first
                    self._sampled_cv.wait_for(lambda: self._sampled_upto >= inp.depends_on or self.error)
                if self.error:
                    return
                for row, tokens in inp.prompt_writes:
                    self.table.write_prompt(row, tokens)
                batch = ForwardBatch(
                    input_ids=self.table.gather(inp.token_rows, inp.positions),
                    positions=inp.positions,
                    slot_mapping=inp.slot_mapping,
                    num_decode=inp.num_decode,
                    decode_block_tables=inp.decode_block_tables,
                    decode_mask=inp.decode_mask,
                    prefill_rows=inp.prefill_rows,
                    logits_index=inp.logits_index,
                )
                # S16: only the rows that sample or score leave the device, as float32 on the host.
                t0 = time.perf_counter()
                logits = self.model(batch, self.kv).to("cpu", torch.float32).numpy()
                t1 = time.perf_counter()
                self.metrics.add("forward_s", t1 - t0)
                self.tracer.span("compute", f"forward {inp.iteration}", t0, t1)
                self._copy_q.put((inp, logits))
            except BaseException as e:  # noqa: BLE001 - reported to the scheduler thread
                self._fail(e)
                return
        self._copy_q.put(_STOP)

    # ---- copy stream ----
    def _copy_loop(self) -> None:
        while (item := self._copy_q.get()) is not _STOP:
            inp, logits = item
            try:
                if self._delay_s:  # test hook: a slow copy stream widens every race window
                    time.sleep(random.uniform(0, self._delay_s))
                t0 = time.perf_counter()
                out = sample_iteration(inp, logits, self.table)
                t1 = time.perf_counter()
                self.metrics.add("sample_s", t1 - t0)
                self.tracer.span("copy", f"sample {inp.iteration}", t0, t1)
            except BaseException as e:  # noqa: BLE001 - reported to the scheduler thread
                self._fail(e)
                return
            self.results[inp.iteration] = out
            with self._sampled_cv:
                self._sampled_upto = inp.iteration
                self._sampled_cv.notify_all()
            self.tracker.complete(inp.iteration)

    def _fail(self, e: BaseException) -> None:
        self.error = e
        with self._sampled_cv:
            self._sampled_cv.notify_all()
        self.tracker.wake()
