"""Build steps pyproject.toml cannot express. Everything else is declared in pyproject.toml."""

import os
import shutil
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

# Registers `lm_eval --model minisgl` at interpreter start (see adapters/lm_eval_minisgl/_pth_hook.py).
# The name sorts after setuptools' "__editable__*.pth", whose import finder must be in place first.
PTH_NAME = "minisgl-lm-eval.pth"
PTH_LINE = 'import sys; exec("try:\\n import lm_eval_minisgl._pth_hook\\nexcept Exception:\\n pass")\n'
# configs/ (engine presets, the determinism grid, the local lm-eval tasks) ships inside the package as
# minisgl_backend/configs/ (found by minisgl_backend.config.config_dir; a checkout's own files win).
CONFIGS_SRC = Path(__file__).resolve().parent / "configs"
CONFIGS_DST = Path("minisgl_backend") / "configs"


def _config_files() -> list[Path]:
    return sorted(
        p.relative_to(CONFIGS_SRC)
        for p in CONFIGS_SRC.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix in (".yaml", ".jsonl", ".py")
    )


class BuildPyWithPth(build_py):
    """Ships PTH_NAME at the top of site-packages, for wheels and editable installs alike, and
    configs/ as package data (not for an editable install, which reads the checkout's)."""

    def run(self) -> None:
        super().run()
        if not self.editable_mode:
            for rel in _config_files():
                dst = Path(self.build_lib) / CONFIGS_DST / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(CONFIGS_SRC / rel, dst)
        # A wheel installs build_lib's top level into site-packages. An editable (PEP 660) build
        # ignores build_lib; what the `install` command targets is the unpacked editable wheel.
        target = Path(
            self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib
        )
        target.mkdir(parents=True, exist_ok=True)
        (target / PTH_NAME).write_text(PTH_LINE)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        extra = (
            []
            if self.editable_mode
            else [str(Path(self.build_lib) / PTH_NAME)]
            + [str(Path(self.build_lib) / CONFIGS_DST / rel) for rel in _config_files()]
        )
        return super().get_outputs(include_bytecode) + extra


# The native completion-callback core (csrc/inflight_tracker.cpp). Optional: without it the
# executor uses the pure-Python tracker (minisgl_backend/executor/tracker.py), so a machine without a
# compiler still installs.
# optional=True also makes an editable install skip copying a .so that was never built.
NATIVE = Extension(
    "minisgl_backend.native._native", ["csrc/inflight_tracker.cpp"], language="c++", optional=True
)
# The CPU decode kernels: every .cpp of csrc/cpu/ (a file per kernel family, the attention in three:
# the blocks of rows, the bf16 scorers, the avx2 family's; docs/architecture.md, "CPU kernels").
# Optional too: without them the model runs torch's own ops (minisgl_backend/model/cpu_kernels.py
# decides per call). The headers are `depends`: a change to one rebuilds every file, and the sdist ships them.
KERNEL_SOURCES = sorted(str(p) for p in Path("csrc/cpu").glob("*.cpp"))
KERNEL_HEADERS = sorted(str(p) for p in Path("csrc/cpu").glob("*.h"))
KERNELS = Extension(
    "minisgl_backend.native._kernels", KERNEL_SOURCES, depends=KERNEL_HEADERS, language="c++", optional=True
)
SKIP_NATIVE_ENV = "MINISGL_SKIP_NATIVE"
FALLBACKS = {
    NATIVE.name: "the Python callback path (PyInflightTracker), which is slower (docs/architecture.md)",
    KERNELS.name: "torch's own ops for every layer, which are slower at decode (docs/performance.md)",
}  # =1: do not even try (also how the fallback is tested)


class OptionalBuildExt(build_ext):
    """Builds NATIVE with pybind11; on any failure warns and carries on with the Python callback path."""

    def build_extension(self, ext: Extension) -> None:
        try:
            if os.environ.get(SKIP_NATIVE_ENV, "") not in ("", "0"):
                raise RuntimeError(f"{SKIP_NATIVE_ENV} is set")
            import pybind11  # a build requirement; imported late so its absence is just another failure

            ext.include_dirs.append(pybind11.get_include())
            if self.compiler.compiler_type == "unix":
                ext.extra_compile_args += ["-std=c++17", "-O2", "-g0", "-fvisibility=hidden"]
                ext.extra_link_args += ["-ldl"]  # dlopen of the CUDA runtime at run time
                if ext is KERNELS:
                    # The kernels run on their own pool (csrc/cpu/pool.h) or, where torch computes much
                    # of the forward, on OpenMP's team: libgomp.so.1 is the soname torch's wheel loads
                    # too, so that is one runtime and one team.
                    # -Wno-*uninitialized: GCC 12 flags the _mm512_undefined_* placeholders of immintrin.h.
                    quiet = ["-Wno-uninitialized", "-Wno-maybe-uninitialized"]
                    ext.extra_compile_args += ["-O3", "-fopenmp", "-pthread", *quiet]
                    ext.extra_link_args += ["-fopenmp", "-pthread"]
            super().build_extension(ext)
        except Exception as exc:  # compiler missing or failing, pybind11 missing, ...
            bar = "=" * 78
            print(
                f"\n{bar}\nWARNING: could not build the native extension {ext.name} "
                f"({type(exc).__name__}: {exc}).\n"
                f"minisgl will use {FALLBACKS[ext.name]}.\n"
                f"{bar}\n",
                file=sys.stderr,
            )

    def get_outputs(self) -> list[str]:
        # Only what was actually built, so a skipped extension is not listed as a missing wheel file.
        return [path for path in super().get_outputs() if os.path.exists(path)]


setup(ext_modules=[NATIVE, KERNELS], cmdclass={"build_py": BuildPyWithPth, "build_ext": OptionalBuildExt})
