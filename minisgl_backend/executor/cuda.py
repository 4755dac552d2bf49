"""The CUDA back-end: a compute stream and a copy stream linked by events, not by device syncs.

Kernels on one stream run in order, so copies overlap compute only on a stream of their own.

Per iteration N, on the compute worker (all launches are asynchronous; nothing here waits for the GPU
except a staging slot that is still fenced):

    copy stream     [H2D inputs N]                        [D2H logits N] -> host callback: N copied
                          | event h2d                      ^ waits event fwd_end
    compute stream        +--> [forward N, logits fp32] ---+
                                                      (the compute worker goes on to N+1 at once)

The inputs go through pinned staging buffers (staging.py), whose reuse is fenced like KV blocks and
token rows. The end of the D2H is reported by a native host function on the copy stream
(`cuda_host_complete`: cudaLaunchHostFunc in csrc/, which only counts and pushes an id, never
taking the GIL) into a second, executor-private tracker: the copy worker sleeps on it with the GIL
released instead of spinning in cudaEventSynchronize, and samples on the CPU as soon as an
iteration's logits are on the host. Device memory made on one
stream and read on the other is marked with record_stream, so the caching allocator does not hand it
out again before the reading stream is done with it.

Sampled tokens stay in the host token table, so a decode batch waits (on the compute worker) for
the previous iteration's sampling before it stages its input ids. Prompt-only batches do not wait.

With MINISGL_REDUCE_LOGITS=1 the full logits do not cross to the host: the compute stream reduces
each sampled row to its draw candidates (sample_stage.reduce_iteration; the draw keys travel with
the inputs), and the D2H copies those and only the rows needed in full; a row whose candidates cannot
prove its draw is fetched from the device logits, which are kept until the iteration is sampled.
Off by default until it has run on a GPU.

Every device operation goes through `ops` (device_ops.py): CudaOps on a GPU, SimulatedOps in the
tests, which run this very code on CPU tensors with late copies and poisoned buffers.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import numpy as np
import torch

from minisgl_backend.arith import cdiv
from minisgl_backend.executor.base import DualWorkerExecutor, forward_batch, index_tensors
from minisgl_backend.executor.device_ops import CudaOps, DeviceOps
from minisgl_backend.executor.graphs import DecodeGraphs, decode_buckets
from minisgl_backend.executor.sample_stage import ReducedLogits, draw_keys, reduce_iteration
from minisgl_backend.executor.staging import StagingRing, StagingSlot
from minisgl_backend.executor.token_table import TokenTable
from minisgl_backend.executor.tracker import InflightTracker
from minisgl_backend.iteration import IterationInputs
from minisgl_backend.kvcache.storage import KVCache
from minisgl_backend.metrics import Metrics, Tracer
from minisgl_backend.model.llama import CausalLM
from minisgl_backend.sampling.reduce import Candidates


class CUDAExecutor(DualWorkerExecutor):
    def __init__(
        self,
        device: torch.device,
        tracker: InflightTracker,
        copied: InflightTracker,
        metrics: Metrics,
        tracer: Tracer,
        *,
        debug_delay_ms: float = 0.0,
        ops: DeviceOps | None = None,
        decode_graphs: bool = False,
    ) -> None:
        """`copied` is a tracker of its own: the copy stream's host callback reports there that an
        iteration's logits reached the host. It holds at most `tracker.max_inflight` iterations.
        `ops`: the device operations (CudaOps on `device` when None). `decode_graphs`: decode batches
        run at batch-size buckets over static buffers (graphs.py), replayed as CUDA graphs; the pool's
        last block is then the padding rows' (reserved_kv_blocks)."""
        self.device = device
        self._ops: DeviceOps = ops if ops is not None else CudaOps(device)
        self._compute = self._ops.stream("compute")
        self._copy = self._ops.stream("copy")
        self._copied = copied
        # Slots are held from launch to completion and at most max_inflight iterations are in flight,
        # so this many slots never make the compute worker wait in steady state.
        self._ring = StagingRing(tracker.max_inflight, pin=self._ops.pin)
        # iteration -> (inputs, host logits or reduced ones, start, end, device logits kept for
        # fetching rows the reduction could not settle, or None)
        self._pending: dict[int, tuple] = {}
        self._reduce = os.environ.get("MINISGL_REDUCE_LOGITS", "0") == "1"
        self._stopping = False
        self._clock: tuple[object, float] | None = None
        self._decode_graphs = decode_graphs
        self.reserved_kv_blocks = 1 if decode_graphs else 0
        self._graphs: DecodeGraphs | None = None
        super().__init__(tracker, metrics, tracer, debug_delay_ms=debug_delay_ms)

    def attach(self, model: CausalLM, kv: KVCache, table: TokenTable) -> None:
        # Loading and KV allocation ran on the compute thread's default stream; our streams do not
        # wait for it. One device sync at start-up (never in the loop) orders them before iteration 1.
        ops = self._ops
        ops.synchronize()
        ref = ops.event(timing=True)
        ops.record(ref, self._compute)
        ops.event_synchronize(ref)
        self._clock = (ref, time.perf_counter())  # maps GPU event times onto the tracer's host clock
        super().attach(model, kv, table)
        if self._decode_graphs:
            max_len = table.ids.shape[1] - 1  # the engine's max_model_len (one spare column)
            self._graphs = DecodeGraphs(
                model,
                kv,
                decode_buckets(table.ids.shape[0]),  # rows: one per running request
                cdiv(max_len, kv.block_size),
                pad_block=kv.num_blocks - 1,
            )
            ops.capture(self._graphs, self._compute)

    @torch.inference_mode()
    def _launch(self, inp: IterationInputs, input_ids: torch.Tensor) -> None:
        slot = self._acquire_slot(inp.iteration)
        if slot is None:
            return  # a worker failed while we waited; the error is already reported
        ops = self._ops
        keys = draw_keys(inp) if self._reduce else []
        with ops.use(self._copy):
            uploaded = slot.upload([*index_tensors(inp, input_ids), *keys], ops.h2d)
            h2d = ops.event()
            ops.record(h2d, self._copy)
        split = len(uploaded) - len(keys)
        tensors = uploaded[:split]
        keys = [t for t in uploaded[split:] if t is not None]  # keys are never absent inputs
        start, end = ops.event(timing=True), ops.event(timing=True)
        with ops.use(self._compute):
            ops.wait(self._compute, h2d)
            ops.record(start, self._compute)
            batch = forward_batch(inp, tensors)
            graphs = self._graphs
            if graphs is not None and graphs.bucket_for(batch) is not None:
                logits = graphs.run(batch).float()  # a fresh tensor: the next replay may not touch it
            else:
                logits = self.model(batch, self.kv).float()  # fp32: sampled on the host
            reduced = reduce_iteration(inp, logits, keys=keys) if self._reduce else None
            ops.record(end, self._compute)
        for t in [*tensors, *keys]:  # allocated on the copy stream, read on the compute stream
            if t is not None:
                ops.keep_for(t, self._compute)
        with ops.use(self._copy):
            ops.wait(self._copy, end)
            if reduced is None:
                host: object = slot.download(logits, ops.d2h)
                outs = [logits]
            else:
                cand, rows, full = reduced
                names = ("cand_ids", "cand_logits", "cand_bound")
                host = (
                    Candidates(*(slot.download(t, ops.d2h, n) for t, n in zip(cand, names))),
                    rows,
                    slot.download(full, ops.d2h, "full"),
                )
                outs = [logits, *cand, full]
        for t in outs:  # allocated on the compute stream, read by the D2H
            ops.keep_for(t, self._copy)
        self._pending[inp.iteration] = (inp, host, start, end, None if reduced is None else logits)
        self._copied.begin()
        ops.host_callback(self._copy, self._copied, inp.iteration)

    def _fetch(self, logits: torch.Tensor, rows: list[int]) -> np.ndarray:
        """Full logits rows from the device, on the copy stream (rarely: rows whose candidates could
        not prove their draw); the forward that made them is done by then."""
        with self._ops.use(self._copy):
            return self._ops.to_host(logits[rows]).numpy()

    def _acquire_slot(self, iteration: int) -> StagingSlot | None:
        """A staging slot for `iteration`, waiting (rarely) until the oldest held slot's fence passed."""
        while (slot := self._ring.acquire(iteration, self._sampled_upto)) is None:
            fence = self._ring.oldest_fence()
            assert fence is not None  # no free slot: some slot is held
            if not self._wait_sampled(fence):
                return None
        return slot

    def _copy_items(self) -> Iterator[tuple[IterationInputs, np.ndarray | ReducedLogits]]:
        while not (self._stopping and not self._pending) and self.error is None:
            for it in self._copied.wait(1.0):  # host callbacks of one stream fire in order
                inp, host, start, end, device_logits = self._pending.pop(it)
                self._record_forward(inp.iteration, start, end)
                if device_logits is None:
                    yield inp, host.numpy()
                    continue
                cand, rows, full = host
                full_rows = dict(zip(rows, full.numpy()))
                fetch = lambda missing, lg=device_logits: self._fetch(lg, missing)
                yield inp, ReducedLogits(Candidates(*(t.numpy() for t in cand)), full_rows, fetch)

    def _record_forward(self, iteration: int, start: object, end: object) -> None:
        """GPU time of the forward (both events passed: the D2H after them is done)."""
        assert self._clock is not None  # set before the first forward is launched
        ref, t_ref = self._clock
        t0 = t_ref + self._ops.elapsed_ms(ref, start) / 1000
        t1 = t_ref + self._ops.elapsed_ms(ref, end) / 1000
        self.metrics.add("forward_s", t1 - t0)
        self.tracer.span("compute", f"forward {iteration}", t0, t1)

    def _stop_copy(self) -> None:
        self._stopping = True
        self._copied.wake()

    def _release(self) -> None:
        # The graphs hold the model, the pool and their own memory pool; the pending entries hold
        # device logits. The allocator's cache goes back too, so that the device's free memory,
        # which sizes the next engine's pool, counts what this engine held.
        self._graphs = None
        self._pending.clear()
        super()._release()
        self._ops.release_cached()
