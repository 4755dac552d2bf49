"""`python -m minisgl_backend.bench.schema`: the server against its own `/openapi.json`, fuzzed.

It starts a server in this process on 127.0.0.1 (the tiny random model unless `--model`; a short
context, so that no generated request runs long), loads the schema the server publishes, and has
schemathesis generate requests for every operation in it: valid ones (`positive`) and ones the
schema forbids (`negative`), in rounds with a fresh seed each until `--cases` were sent or
`--budget-s` has passed. Every answer is counted per operation:

- `5xx`: a server error (a well-formed request or not, the server must say what is wrong with it);
- `violations`: an answer that the schema does not describe (its status code, its content type, or a
  body that does not match the documented model).

schemathesis is not a dependency of minisgl: install it for the run (`pip install schemathesis`, or
the `fuzz` extra).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

# The server's bounds for the run: a short context and few sequences per request, so that a generated
# request with no max_tokens (all the context) or a large n still answers in a moment.
ENGINE = {"max_model_len": 64, "num_blocks": 64, "max_num_seqs": 16, "num_threads": 1, "stats_interval_s": 0}
LIMITS: dict[str, Any] = {
    "max_prompts": 4,
    "max_sequences": 8,
    "max_request_chars": 16 * 1024,
    "stream_idle_timeout_s": 10.0,
}
MODES = ("positive", "negative")
# What schemathesis checks beside the server-error count: the answer is one the schema documents.
CHECKS = ("status_code_conformance", "content_type_conformance", "response_schema_conformance")
MAX_EXAMPLES_KEPT = 3  # failure messages kept per operation and kind


class SchemathesisMissing(RuntimeError):
    """schemathesis is not installed."""


def _schemathesis() -> Any:
    try:
        import schemathesis
    except ImportError as e:
        raise SchemathesisMissing(
            "python -m minisgl_backend.bench.schema needs schemathesis, which minisgl does not depend "
            "on: pip install schemathesis (or pip install 'minisgl[fuzz]')"
        ) from e
    return schemathesis


@dataclass
class Tally:
    """What one operation's generated requests got back."""

    cases: int = 0
    statuses: Counter = field(default_factory=Counter)
    server_errors: int = 0
    violations: int = 0
    examples: list[str] = field(default_factory=list)

    def keep(self, what: str) -> None:
        if len(self.examples) < MAX_EXAMPLES_KEPT * 2:
            self.examples.append(what[:600])


def _checks() -> list[Any]:
    from schemathesis.specs.openapi import checks

    return [getattr(checks, name) for name in CHECKS]


def _fuzz_operation(op: Any, mode: str, base_url: str, session: Any, n: int, seed: int, t: Tally) -> None:
    """Up to `n` generated requests of `mode` for `op`, each sent and checked; tallied in `t`."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as fixed_seed
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    strategy = op.as_strategy(generation_mode=GenerationMode(mode))
    checks = _checks()

    @fixed_seed(seed)
    @settings(
        max_examples=n,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def one(case: Any) -> None:
        try:
            response = case.call(base_url=base_url, session=session, timeout=60)
        except Exception as e:  # noqa: BLE001 - a request that got no answer is a failure, counted
            t.cases += 1
            t.server_errors += 1
            t.keep(f"no answer ({type(e).__name__}: {e}) to {case.as_curl_command()}")
            return
        t.cases += 1
        t.statuses[response.status_code] += 1
        if response.status_code >= 500:
            t.server_errors += 1
            t.keep(f"{response.status_code} {response.text[:300]} for {case.as_curl_command()}")
        try:
            case.validate_response(response, checks=checks)
        except Exception as e:  # noqa: BLE001 - schemathesis raises its failures; each is counted
            t.violations += 1
            t.keep(f"violation {type(e).__name__}: {str(e)[:400]} for {case.as_curl_command()}")

    try:
        one()
    except Unsatisfiable:  # no request of this mode exists (a negative one of an operation without inputs)
        pass


def fuzz(base_url: str, *, cases: int = 1000, budget_s: float = 600.0, seed: int = 0) -> dict[str, Any]:
    """Generated requests against the server at `base_url` over every operation of its /openapi.json,
    in rounds until `cases` were sent or `budget_s` passed. Returns the tallies per operation."""
    st = _schemathesis()
    import requests

    schema = st.openapi.from_url(f"{base_url}/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    tallies = {f"{op.method.upper()} {op.path}": Tally() for op in ops}
    per_round = max(1, math.ceil(cases / (len(ops) * len(MODES))))
    deadline = time.monotonic() + budget_s
    rounds = 0
    with requests.Session() as session:
        while sum(t.cases for t in tallies.values()) < cases and time.monotonic() < deadline:
            for op in ops:
                for mode in MODES:
                    if time.monotonic() >= deadline:
                        break
                    t = tallies[f"{op.method.upper()} {op.path}"]
                    _fuzz_operation(op, mode, base_url, session, per_round, seed + rounds, t)
            rounds += 1
    rows: list[dict[str, Any]] = [
        {
            "operation": name,
            "cases": t.cases,
            "statuses": dict(sorted(t.statuses.items())),
            "server_errors": t.server_errors,
            "violations": t.violations,
            "examples": t.examples,
        }
        for name, t in tallies.items()
    ]
    total = {k: sum(r[k] for r in rows) for k in ("cases", "server_errors", "violations")}
    return {"rows": rows, "rounds": rounds, **total, "ok": total["server_errors"] == total["violations"] == 0}


def bench_schema(
    config: Any, *, cases: int = 1000, budget_s: float = 600.0, seed: int = 0, limits: Any = None
) -> dict[str, Any]:
    """Serve `config`'s engine on 127.0.0.1 in this process (ServeLimits of LIMITS unless `limits`)
    and fuzz it (`fuzz`)."""
    _schemathesis()  # before the engine starts: a missing fuzzer is said at once
    from minisgl_backend.engine import Engine
    from minisgl_backend.serve.guard import ServeLimits
    from minisgl_backend.serve.server import start_in_thread

    t0 = time.perf_counter()
    with Engine(config) as engine:
        srv = start_in_thread(engine, limits=limits or ServeLimits(**LIMITS))
        try:
            out = fuzz(str(srv.url).rstrip("/"), cases=cases, budget_s=budget_s, seed=seed)
        finally:
            srv.stop()
    out["wall_s"] = time.perf_counter() - t0
    return out


def format_table(result: dict[str, Any]) -> str:
    lines = ["| operation | cases | statuses | 5xx | violations |", "|---|---|---|---|---|"]
    for r in result["rows"]:
        statuses = ", ".join(f"{k} x{v}" for k, v in r["statuses"].items())
        lines.append(
            f"| {r['operation']} | {r['cases']} | {statuses} | {r['server_errors']} | {r['violations']} |"
        )
    lines.append(
        f"| all | {result['cases']} | {result['rounds']} rounds | {result['server_errors']} | "
        f"{result['violations']} |"
    )
    for r in result["rows"]:
        for ex in r["examples"]:
            lines.append(f"{r['operation']}: {ex}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from minisgl_backend.bench.hostile import add_engine_args, engine_config, report

    p = argparse.ArgumentParser(
        prog="python -m minisgl_backend.bench.schema",
        description="schemathesis-generated requests for every operation of the server's /openapi.json "
        "(a server in this process, on 127.0.0.1): server errors and answers the schema does not describe",
    )
    add_engine_args(p)
    p.add_argument("--cases", type=int, default=1000, help="requests to generate at least (default 1000)")
    p.add_argument("--budget-s", type=float, default=600.0, help="stop starting rounds after this long")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results to this JSON file")
    args = p.parse_args(argv)
    if args.cases < 1 or not args.budget_s > 0:
        p.error("--cases must be >= 1 and --budget-s > 0")

    config = engine_config(args.model, args.set, ENGINE)
    try:
        result = bench_schema(config, cases=args.cases, budget_s=args.budget_s, seed=args.seed)
    except SchemathesisMissing as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return report(result, format_table(result), args.json)


if __name__ == "__main__":
    sys.exit(main())
