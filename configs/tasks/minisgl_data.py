"""The local tasks' data files, as absolute paths next to this file, so the tasks run from any working
directory (a checkout's configs/tasks/ or an installed wheel's copy of it).

Each task YAML reads one of these with lm-eval's `!function` tag (`data_files: !function
minisgl_data.mc`), which imports this module from the YAML's own directory; `datasets` would resolve
a plain relative `data_files` against the working directory instead.
"""

from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"

mc = {"test": str(DATA / "minisgl_mc.jsonl")}
gen = {"test": str(DATA / "minisgl_gen.jsonl")}
ppl = {"test": str(DATA / "minisgl_ppl.jsonl")}
