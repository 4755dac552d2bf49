"""Turns a planned Batch into model inputs, runs the forward pass and samples on the CPU (S16)."""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

import numpy as np
import torch

from minisgl_backend.kvcache.storage import KVCache
from minisgl_backend.model.llama import CausalLM, ForwardBatch, PrefillRow
from minisgl_backend.sampling.sampler import SampleRow, apply_processors, sample, token_logprobs
from minisgl_backend.scheduler.request import Request
from minisgl_backend.scheduler.scheduler import Batch, ScheduledRow, StepOutput
from minisgl_backend.types import TokenLogprob


class _Plan(NamedTuple):
    forward: ForwardBatch
    sample_rows: list[tuple[int, ScheduledRow]]  # (logits row, scheduled row)
    prompt_rows: list[tuple[int, Request, int]]  # (logits row, request, prompt index scored)


def _slots(table: list[int], start: int, end: int, block_size: int) -> np.ndarray:
    pos = np.arange(start, end)
    return np.asarray(table, dtype=np.int64)[pos // block_size] * block_size + pos % block_size


class ModelRunner:
    def __init__(self, model: CausalLM, kv: KVCache, device: torch.device | str) -> None:
        self.model = model
        self.kv = kv
        self.bs = kv.block_size
        self.device = torch.device(device)

    def _plan(self, batch: Batch) -> _Plan:
        bs, dev = self.bs, self.device
        ids: list[int] = []
        pos: list[int] = []
        slots: list[np.ndarray] = []
        logits_index: list[int] = []
        sample_rows: list[tuple[int, ScheduledRow]] = []
        prompt_rows: list[tuple[int, Request, int]] = []

        ctx = [row.start + 1 for row in batch.decode]
        for i, row in enumerate(batch.decode):
            ids.append(row.req.token_at(row.start))
            pos.append(row.start)
            slots.append(_slots(row.req.block_table, row.start, row.start + 1, bs))
            sample_rows.append((len(logits_index), row))
            logits_index.append(i)
        dec_tables = dec_mask = None
        if batch.decode:
            nb = -(-max(ctx) // bs)
            tables = np.zeros((len(ctx), nb), dtype=np.int64)
            for i, row in enumerate(batch.decode):
                t = row.req.block_table[: -(-ctx[i] // bs)]
                tables[i, : len(t)] = t
            dec_tables = torch.from_numpy(tables).to(dev)
            dec_mask = (torch.arange(nb * bs)[None, :] < torch.tensor(ctx)[:, None])[:, None, None, :].to(dev)

        prefill: list[PrefillRow] = []
        for row in batch.prefill:
            req, s, n = row.req, row.start, row.length
            base = len(ids)
            ids.extend(req.tokens(s, s + n))
            pos.extend(range(s, s + n))
            slots.append(_slots(req.block_table, s, s + n, bs))
            end = s + n
            mask = None
            if s > 0:  # later chunk: causal over the cached prefix plus itself
                mask = (torch.arange(end)[None, :] <= torch.arange(s, end)[:, None]).to(dev)
            table = torch.tensor(req.block_table[: -(-end // bs)], dtype=torch.int64, device=dev)
            prefill.append(PrefillRow(base, n, end, table, mask))
            # Prompt logprobs are scored inside the chunk: logits at position p score token p + 1.
            for p in range(s, end):
                if req.needs_prompt_logprob(p + 1):
                    prompt_rows.append((len(logits_index), req, p + 1))
                    logits_index.append(base + p - s)
            if row.samples:
                sample_rows.append((len(logits_index), row))
                logits_index.append(base + n - 1)

        fb = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(pos, dtype=torch.int64, device=dev),
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            num_decode=len(batch.decode),
            decode_block_tables=dec_tables,
            decode_mask=dec_mask,
            prefill_rows=tuple(prefill),
            logits_index=torch.tensor(logits_index, dtype=torch.int64, device=dev),
        )
        return _Plan(fb, sample_rows, prompt_rows)

    def run(self, batch: Batch) -> StepOutput:
        plan = self._plan(batch)
        logits = self.model(plan.forward, self.kv)
        # S16: the rows that sample or score are copied to the CPU; all decisions are made there.
        logits = logits.to("cpu", torch.float32)
        return self._sample(logits, plan)

    @staticmethod
    def _sample(logits: torch.Tensor, plan: _Plan) -> StepOutput:
        sampled: dict[int, int] = {}
        logprobs: dict[int, TokenLogprob] = {}
        errors: dict[int, Exception] = {}
        if plan.sample_rows:
            idx = [i for i, _ in plan.sample_rows]
            rows = [
                SampleRow(r.req.params, r.req.seed, r.start + r.length, r.req.output_ids)
                for _, r in plan.sample_rows
            ]
            processed, failed = apply_processors(logits[idx], rows)
            errors = {id(plan.sample_rows[i][1].req): e for i, e in failed.items()}
            tokens = sample(processed, rows)
            for (i, r), tok in zip(plan.sample_rows, tokens):
                sampled[id(r.req)] = tok
            want = [(i, r, tok) for (i, r), tok in zip(plan.sample_rows, tokens) if r.req.params.logprobs is not None]
            for k, group in _group_by_top(want, lambda w: w[1].req.params.logprobs).items():
                lps = token_logprobs(logits[[w[0] for w in group]], [w[2] for w in group], k)
                for w, lp in zip(group, lps):
                    logprobs[id(w[1].req)] = lp
        prompt: list[tuple[Request, int, TokenLogprob]] = []
        for k, group in _group_by_top(plan.prompt_rows, lambda w: w[1].params.prompt_logprobs).items():
            lps = token_logprobs(
                logits[[w[0] for w in group]], [w[1].prompt_ids[w[2]] for w in group], k
            )
            prompt.extend((w[1], w[2], lp) for w, lp in zip(group, lps))
        return StepOutput(sampled, logprobs, prompt, errors)


def _group_by_top(items, key) -> dict[int, list]:
    groups: dict[int, list] = defaultdict(list)
    for it in items:
        groups[key(it)].append(it)
    return groups
