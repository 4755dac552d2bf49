"""EngineConfig.resolve: the one way the CLI and both adapters build a config (no model is loaded)."""

import pytest

from minisgl_backend import ConfigError, EngineConfig
from minisgl_backend.config import PRESET_DIR, REPO_ROOT, load_preset, resolve_preset


def test_precedence_preset_then_defaults_then_overrides_then_model(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("model: from-preset\nchunk_size: 8\nblock_size: 8\nnum_blocks: 8\nmax_num_seqs: 8\n")
    cfg = EngineConfig.resolve(
        preset,
        {"model": "from-overrides", "num_blocks": 32, "max_num_seqs": 32},
        defaults={"model": "from-defaults", "block_size": 16, "num_blocks": 16, "max_num_seqs": 16},
        model="from-model",
    )
    assert cfg.chunk_size == 8  # the preset alone
    assert cfg.block_size == 16  # defaults over the preset
    assert (cfg.num_blocks, cfg.max_num_seqs) == (32, 32)  # overrides over defaults and the preset
    assert cfg.model == "from-model"  # model over everything
    # model=None leaves the layers below it alone
    assert EngineConfig.resolve(preset, {"model": "from-overrides"}, model=None).model == "from-overrides"
    assert EngineConfig.resolve(preset).model == "from-preset"
    assert EngineConfig.resolve() == EngineConfig()


def test_preset_by_bare_name_repo_relative_path_and_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the repository-relative spellings must not depend on the working directory
    serial = PRESET_DIR / "serial.yaml"
    assert resolve_preset("serial") == serial
    assert resolve_preset("configs/engine/serial.yaml") == REPO_ROOT / "configs/engine/serial.yaml"
    assert resolve_preset(serial) == serial
    for ref in ("serial", "configs/engine/serial.yaml", str(serial), serial):
        cfg = EngineConfig.resolve(ref)
        assert (cfg.chunk_size, cfg.mixed_batches) == (None, False), ref
    (tmp_path / "local.yaml").write_text("max_num_seqs: 3\n")
    assert EngineConfig.resolve("local.yaml").max_num_seqs == 3  # relative to the working directory
    assert load_preset("local.yaml") == {"max_num_seqs": 3}
    with pytest.raises(ConfigError, match="engine config 'no-such-preset' not found"):
        EngineConfig.resolve("no-such-preset")


def test_unknown_keys_name_the_valid_ones_in_every_layer(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("chunksize: 8\n")
    for kwargs in (
        {"preset": bad},
        {"overrides": {"chunksize": 8}},
        {"defaults": {"chunksize": 8}},
    ):
        with pytest.raises(ConfigError) as err:
            EngineConfig.resolve(**kwargs)
        msg = str(err.value)
        assert "unknown engine config key(s) ['chunksize']" in msg and "valid keys:" in msg, kwargs
        assert "chunk_size" in msg
    not_a_mapping = tmp_path / "list.yaml"
    not_a_mapping.write_text("- chunk_size\n")
    with pytest.raises(ConfigError, match="expected a mapping of config keys"):
        EngineConfig.resolve(not_a_mapping)
    with pytest.raises(ConfigError, match="overlap"):  # values are checked as for every other path
        EngineConfig.resolve(overrides={"overlap": "false"})
