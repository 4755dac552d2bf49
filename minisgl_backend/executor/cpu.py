"""The CPU back-end: two worker threads stand in for a compute stream and a copy stream,
so sampling and the hand-back of one iteration overlap the forward of the next.

Torch releases the GIL inside its kernels, so the scheduler thread plans iteration N+1 and processes
the results of N-1 while the compute worker runs N. The logits become float32 numpy on the compute
thread: every thread that runs a parallel torch op gets its own OpenMP thread team, and two teams
contend for the same cores, so their idle workers stop spin-waiting and the forward slows down.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator

import numpy as np
import torch

from minisgl_backend.executor.base import STOP, DualWorkerExecutor, forward_batch, index_tensors
from minisgl_backend.iteration import IterationInputs
from minisgl_backend.model import cpu_threads


class CPUExecutor(DualWorkerExecutor):
    def __init__(self, *args, **kwargs) -> None:
        # Before the base starts the workers: the copy worker reads this queue at once.
        self._copy_q: queue.SimpleQueue[tuple[IterationInputs, np.ndarray] | None] = queue.SimpleQueue()
        super().__init__(*args, **kwargs)

    def _launch(self, inp: IterationInputs, input_ids: torch.Tensor) -> None:
        cpu_threads.adapt(None if inp.prefill_chunks else inp.num_decode)
        t0 = time.perf_counter()
        # Only the rows that sample or score leave the model, as float32 on the host: sampling runs on
        # the CPU, on the copy worker, while the compute worker starts the next forward. The LM head
        # writes them as float32 itself where its kernel can: a pass converting them sits between one
        # decode forward and the next, which waits for their tokens.
        batch = forward_batch(inp, index_tensors(inp, input_ids))
        logits = self.model(batch, self.kv, float32_logits=True).numpy()
        t1 = time.perf_counter()
        self.metrics.add("forward_s", t1 - t0)
        self.tracer.span("compute", f"forward {inp.iteration}", t0, t1)
        self._copy_q.put((inp, logits))

    def _copy_items(self) -> Iterator[tuple[IterationInputs, np.ndarray]]:
        while (item := self._copy_q.get()) is not STOP:
            yield item

    def _stop_copy(self) -> None:
        self._copy_q.put(STOP)
