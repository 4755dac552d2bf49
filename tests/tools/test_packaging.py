"""What a wheel install carries and finds without the checkout: configs/ as package data (presets,
the determinism defaults, the lm-eval tasks), found when the checkout has no configs/; the local
tasks' data resolved from any working directory; the GGUF conversion cache keyed by content."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from minisgl_backend import ConfigError, EngineConfig
from minisgl_backend import config as config_mod
from minisgl_backend.model.loader import gguf_cache_key

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """setup.py's build_py output: what a wheel installs into site-packages (no extension build)."""
    out = tmp_path_factory.mktemp("build_lib")
    r = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture
def wheel_layout(built, monkeypatch, tmp_path) -> Path:
    """The lookup as in a wheel install: no checkout, package data from the build, cwd elsewhere."""
    shipped = built / "minisgl_backend" / "configs"
    monkeypatch.setattr(config_mod, "checkout_root", lambda: None)
    monkeypatch.setattr(config_mod, "package_configs", lambda: shipped)
    monkeypatch.chdir(tmp_path)
    return shipped


def test_the_build_ships_every_config_file(built):
    shipped = built / "minisgl_backend" / "configs"
    source = sorted(
        p.relative_to(REPO / "configs")
        for p in (REPO / "configs").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )
    assert source and sorted(p.relative_to(shipped) for p in shipped.rglob("*") if p.is_file()) == source
    assert (built / "minisgl-lm-eval.pth").is_file()


def test_presets_and_determinism_defaults_come_from_package_data_without_a_checkout(wheel_layout):
    assert config_mod.config_dir("engine") == wheel_layout / "engine"
    assert config_mod.resolve_preset("serial") == wheel_layout / "engine" / "serial.yaml"
    # the repository's spelling of a preset path works in a wheel install too
    assert config_mod.resolve_preset("configs/engine/serial.yaml") == wheel_layout / "engine" / "serial.yaml"
    cfg = EngineConfig.resolve("serial")
    assert (cfg.chunk_size, cfg.mixed_batches) == (None, False)
    assert EngineConfig.resolve("fast-bf16").dtype == "bfloat16"
    with pytest.raises(ConfigError, match=r"presets: default, fast-bf16, serial"):
        EngineConfig.resolve("no-such-preset")
    for name in ("default.yaml", "prompts.yaml"):
        assert (config_mod.config_dir("determinism") / name).is_file()


def test_the_checkout_wins_where_it_has_configs():
    assert config_mod.checkout_root() == REPO
    assert config_mod.config_dir("engine") == REPO / "configs" / "engine"
    assert config_mod.config_dir("tasks") == REPO / "configs" / "tasks"
    from lm_eval_minisgl import tasks_dir

    assert tasks_dir() == REPO / "configs" / "tasks"  # the adapter's torch-free lookup agrees


def test_local_tasks_load_their_data_from_any_working_directory(wheel_layout, tmp_path):
    """The wheel's copy of the tasks (and a copy moved elsewhere) read the data beside their YAML."""
    from lm_eval.tasks import TaskManager

    moved = tmp_path / "elsewhere"
    shutil.copytree(wheel_layout / "tasks", moved)
    for tasks in (wheel_layout / "tasks", moved):
        tm = TaskManager(include_path=str(tasks), include_defaults=False)
        loaded = tm.load(["minisgl_mc", "minisgl_gen", "minisgl_ppl"])["tasks"]
        sizes = {name: len(list(task.test_docs())) for name, task in loaded.items()}
        assert sizes == {"minisgl_mc": 150, "minisgl_gen": 40, "minisgl_ppl": 12}
        for task in loaded.values():
            (data,) = task.config.dataset_kwargs["data_files"].values()
            assert Path(data).parent == tasks / "data"


def test_task_manager_gets_the_package_tasks_unless_a_copy_is_named(tmp_path):
    from lm_eval_minisgl import _with_our_tasks, tasks_dir

    ours = str(tasks_dir())
    assert _with_our_tasks(None, True) == [ours]
    assert _with_our_tasks(str(tmp_path), True) == [ours, str(tmp_path)]
    assert _with_our_tasks([str(tmp_path)], False) == [str(tmp_path)]  # include_defaults=False: as given
    copy = tmp_path / "copy"
    shutil.copytree(tasks_dir(), copy)
    assert _with_our_tasks(str(copy), True) == str(copy)  # the named copy alone: no override warnings


def test_gguf_cache_key_follows_content_not_path_or_mtime(tmp_path):
    data = bytes(range(256)) * 20000  # 5 MB: start, middle and end samples are distinct
    a, b = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for p in (a, b):
        p.parent.mkdir()
        p.write_bytes(data)
    b.touch()
    assert gguf_cache_key(a) == gguf_cache_key(b)  # another venv's copy of the same file
    for offset in (0, len(data) // 2, len(data) - 1):  # a change in any sampled region changes the key
        changed = bytearray(data)
        changed[offset] ^= 1
        b.write_bytes(bytes(changed))
        assert gguf_cache_key(b) != gguf_cache_key(a), offset
    b.write_bytes(data[:-1])
    assert gguf_cache_key(b) != gguf_cache_key(a)  # size
    b.rename(b.with_name("n.gguf"))
    b.with_name("n.gguf").write_bytes(data)
    assert gguf_cache_key(b.with_name("n.gguf")) != gguf_cache_key(a)  # name


# Run in a child interpreter where lm_eval and langchain_core cannot be imported, as after a base install.
_WITHOUT_EXTRAS = r"""
import importlib.abc, sys

class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("lm_eval", "langchain_core"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Absent())
for name in [m for m in sys.modules if m.split(".")[0] in ("lm_eval", "langchain_core")]:
    del sys.modules[name]
exec(PTH_LINE)  # what the installed .pth runs at start-up
heavy = sorted(m for m in ("torch", "minisgl_backend", "lm_eval", "transformers") if m in sys.modules)
assert not heavy, heavy
assert "lm_eval_minisgl._pth_hook" in sys.modules
for module, extra in (("langchain_minisgl", "langchain"), ("lm_eval_minisgl.model", "lm-eval")):
    try:
        __import__(module)
    except ModuleNotFoundError as e:
        assert f"pip install 'minisgl[{extra}]'" in str(e), e
    else:
        raise AssertionError(module + " imported without its extra")
try:
    import lm_eval.models  # the hook's finder steps aside: the plain error, nothing else
except ModuleNotFoundError as e:
    assert e.name == "lm_eval", e
print("ok")
"""


def _pth_line() -> str:
    """setup.py's PTH_LINE, read without running setup()."""
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "PTH_LINE":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no PTH_LINE")


def test_the_pth_hook_is_harmless_and_the_adapters_name_their_extra_without_their_library():
    script = f"PTH_LINE = {_pth_line()!r}\n{_WITHOUT_EXTRAS}"
    r = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_requirements_are_ranges_and_the_adapters_are_extras():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    requirements = project["dependencies"] + [r for group in extras.values() for r in group]
    assert not [r for r in requirements if "==" in r or "<=" in r], "a pin keeps users' versions out"
    names = {
        r.split("[")[0].split(">")[0].split("<")[0].split("~")[0].strip() for r in project["dependencies"]
    }
    assert not names & {"lm-eval", "langchain-core", "langchain"}, names
    assert extras["lm-eval"] and extras["langchain"] and extras["all"]
    assert "minisgl[lm-eval,langchain]" in extras["test"]  # `make setup` installs both adapters' libraries
