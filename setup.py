"""Build steps pyproject.toml cannot express. Everything else is declared in pyproject.toml."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

# Registers `lm_eval --model minisgl` at interpreter start (see adapters/lm_eval_minisgl/_pth_hook.py).
# The name sorts after setuptools' "__editable__*.pth", whose import finder must be in place first.
PTH_NAME = "minisgl-lm-eval.pth"
PTH_LINE = 'import sys; exec("try:\\n import lm_eval_minisgl._pth_hook\\nexcept Exception:\\n pass")\n'


class BuildPyWithPth(build_py):
    """Ships PTH_NAME at the top of site-packages, for wheels and editable installs alike."""

    def run(self) -> None:
        super().run()
        # A wheel installs build_lib's top level into site-packages. An editable (PEP 660) build
        # ignores build_lib; what the `install` command targets is the unpacked editable wheel.
        target = Path(self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib)
        target.mkdir(parents=True, exist_ok=True)
        (target / PTH_NAME).write_text(PTH_LINE)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        extra = [] if self.editable_mode else [str(Path(self.build_lib) / PTH_NAME)]
        return super().get_outputs(include_bytecode) + extra


setup(cmdclass={"build_py": BuildPyWithPth})
