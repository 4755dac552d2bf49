"""The compiled extensions setup.py builds from csrc/, both optional (a machine without a C++ compiler
installs without them, and their one importer each falls back to Python or torch):

- `_native`: the in-flight tracker (csrc/inflight_tracker.cpp), loaded by executor/tracker.py;
- `_kernels`: the CPU kernels (csrc/cpu/), loaded by model/cpu_kernels.py.

They live in a package of their own at the bottom of the layering (pyproject.toml,
[tool.importlinter]): the import graph cannot see into a compiled module, so importing one reads as
importing the package that holds it, and this one imports nothing.
"""
