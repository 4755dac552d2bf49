"""The sampling-parameter table of docs/sampling.md, rendered from SamplingParams's fields.

`python -m minisgl_backend.tools.sampling_doc` rewrites the table in place; a test fails when the
page and the fields disagree, so the page cannot drift from the code.
"""

from __future__ import annotations

import sys
from pathlib import Path

from minisgl_backend.types import SURFACES, SamplingParams, sampling_fields

DOC = Path(__file__).resolve().parents[2] / "docs" / "sampling.md"
START = "<!-- sampling-table:start (generated: python -m minisgl_backend.tools.sampling_doc) -->"
END = "<!-- sampling-table:end -->"
_SURFACE_NAMES = {"server": "server", "langchain": "LangChain", "lm_eval": "lm-eval", "cli": "CLI"}


def _default(value: object) -> str:
    if value == ():
        return "empty"
    return "`None`" if value is None else f"`{value!r}`"


def render_table(params_cls: type[SamplingParams] = SamplingParams) -> str:
    """One row per field: name, default, accepted values, the front ends that offer it, its doc."""
    rows = [
        "| Field | Default | Accepts | Offered by | What it does |",
        "| --- | --- | --- | --- | --- |",
    ]
    for f in sampling_fields(params_cls).values():
        where = [
            f"CLI `--{f.name.replace('_', '-')}`" if s == "cli" else _SURFACE_NAMES[s]
            for s in SURFACES
            if s in f.surfaces
        ]
        offered = ", ".join(where) or "Python API only"
        accepts = f.accepts.replace("|", "\\|")
        rows.append(f"| `{f.name}` | {_default(f.default)} | {accepts} | {offered} | {f.doc} |")
    return "\n".join(rows)


def documented_table(text: str) -> str:
    """The table between the markers of a page's text."""
    if START not in text or END not in text:
        raise ValueError(f"{DOC.name} has no generated table (markers {START!r} ... {END!r})")
    return text.split(START, 1)[1].split(END, 1)[0].strip()


def main() -> int:
    text = DOC.read_text()
    before, rest = text.split(START, 1)
    after = rest.split(END, 1)[1]
    DOC.write_text(f"{before}{START}\n{render_table()}\n{END}{after}")
    print(f"wrote {DOC}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
