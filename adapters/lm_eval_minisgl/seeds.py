"""Per-request seeds that depend only on the run's seed and the request's position in lm-eval's order.

The engine seeds an unseeded request from its own generator in submission order, so the seed value a
request gets would depend on how the work is split (one engine, or N data-parallel replicas each
seeing a share). The adapter therefore seeds every unseeded request itself, before any split:
`seed = H(run seed, index)`, where index counts the requests the adapter has sent in lm-eval's order
across the whole run. Identical repeated requests get different indices, hence different seeds.
"""

from __future__ import annotations

import dataclasses
import hashlib

from minisgl_backend import SamplingParams

SEED_BITS = 63  # seeds in [0, 2**63), like the engine's own draws


def derive_seed(base: int, index: int) -> int:
    """A stable (process- and platform-independent) seed for request `index` of a run seeded `base`."""
    digest = hashlib.blake2b(f"minisgl-lm-eval:{base}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> (64 - SEED_BITS)


class RequestSeeds:
    """Seeds unseeded requests from a run seed and a counter advanced once per request sent.

    `base=None` (the user asked for fresh random seeds) leaves requests unseeded: the engine draws.
    """

    def __init__(self, base: int | None) -> None:
        self.base = base
        self.sent = 0  # requests seeded or passed through so far, in lm-eval's order

    def assign(self, params: list[SamplingParams]) -> list[SamplingParams]:
        out: list[SamplingParams] = []
        for sp in params:
            index, self.sent = self.sent, self.sent + 1
            if sp.seed is None and self.base is not None:
                sp = dataclasses.replace(sp, seed=derive_seed(self.base, index))
            out.append(sp)
        return out
