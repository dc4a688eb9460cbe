"""TOML front-end: precedence, validation with full key paths, the shipped configs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


from tierckpt.errors import ConfigError  # noqa: E402
from titan_plugin.toml import load_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = '[job]\nmodule = "llama3"\nconfig = "llama3_debugmodel"\n'


def _toml(tmp_path, text):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return str(p)


def test_precedence_cli_over_toml_over_registry(tmp_path):
    path = _toml(tmp_path, LLAMA + "[training]\nsteps = 7\nseq_len = 64\n[checkpoint]\nenable = true\nlocal_interval = 3\n")
    c = load_config(path, ["--training.steps", "9", "--checkpoint.replication_factor=1"])
    assert c.training.steps == 9            # CLI beats TOML
    assert c.training.seq_len == 64         # TOML beats registry (2048)
    assert c.training.local_batch_size == 8  # registry default kept
    assert type(c.checkpoint).__name__ == "Config" and c.checkpoint.local_interval == 3
    assert c.checkpoint.replication_factor == 1 and c.checkpoint.enable is True


@pytest.mark.parametrize("text,overrides,key,fragment", [
    ("[checkpoint]\nbogus = 1\n", [], "checkpoint.bogus", "allowed keys of [checkpoint]"),
    ("[checkpoint]\nreplication_factor = \"two\"\n", [], "checkpoint.replication_factor", "expected an integer"),
    ("", ["--checkpoint.replication_factor", "0"], "checkpoint.replication_factor", ">= 1"),
    ("", ["--checkpoint.async_mode", "fast"], "checkpoint.async_mode", "'disabled', 'async'"),
    ("", ["--checkpoint.keep_latest_k", "1"], "checkpoint.keep_latest_k", "at least 2"),
    ("", ["--checkpoint.local_keep_latest_k", "-1"], "checkpoint.local_keep_latest_k", ">= 0"),
    ("[checkpoint]\nenable = true\nlocal_root = \"/x/{nodes}\"\n", [], "checkpoint.local_root", "unknown field"),
    ("[training]\nsteps = true\n", [], "training.steps", "expected an integer"),
    ("[checkpoint]\nadaptive = [\"nvme\"]\n", [], "checkpoint.adaptive", "allowed: local, persistent"),
    ("", ["--checkpoint.restart_prior_s", "-1"], "checkpoint.restart_prior_s", ">= 0"),
    ("", ["--checkpoint.local_wait_timeout_s", "-2"], "checkpoint.local_wait_timeout_s",
     "[0, 604800] (0 = wait without limit)"),
    ("", ["--checkpoint.busy_tier_policy", "later"], "checkpoint.busy_tier_policy", "'defer' or 'wait'"),
    ("", ["--checkpoint.cpu_staging", "async"], "checkpoint.cpu_staging", "'blocking' or 'overlapped'"),
    ("", ["--checkpoint.restore_read_timeout_s", "-1"], "checkpoint.restore_read_timeout_s", ">= 0 (0 = the default)"),
    ("[nosuchsection]\nx = 1\n", [], "nosuchsection", "unknown key"),
    ("", ["--checkpoint.keep_interval_s", "-60"], "checkpoint.keep_interval_s", ">= 0 (0 = off)"),
    ("", ["--checkpoint.keep_every_n_steps", "-1"], "checkpoint.keep_every_n_steps", ">= 0 (0 = off)"),
    ("[checkpoint]\nkeep_period = 2.5\n", [], "checkpoint.keep_period", "expected an integer"),
    ("[checkpoint]\nkeep_steps = [120, -1]\n", [], "checkpoint.keep_steps[1]", ">= 0"),
    ("[checkpoint]\nkeep_steps = 120\n", [], "checkpoint.keep_steps", "expected a list"),
])
def test_bad_values_name_the_key(tmp_path, text, overrides, key, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(_toml(tmp_path, LLAMA + text), overrides)
    assert e.value.option == key and fragment in str(e.value), str(e.value)


def test_impossible_replication_rejected_before_process_groups(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    path = _toml(tmp_path, LLAMA + "[checkpoint]\nenable = true\nsimulated_ranks_per_node = 1\nreplication_factor = 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert e.value.option == "checkpoint.replication_factor" and "1..2" in str(e.value)


def test_scheduler_options_reach_the_engine_config(tmp_path):
    from tierckpt import ScheduleOptions
    from titan_plugin.config import build_tier_config as tier_config
    path = _toml(tmp_path, LLAMA + "[checkpoint]\nenable = true\ninterval = 40\nlocal_interval = 4\n"
                 "adaptive = [\"local\", \"persistent\"]\ngpu_mtbf_hours = 2.5\nrestart_prior_s = 20.0\n"
                 "min_interval_steps = 2\nmax_interval_steps = 300\nlocal_wait_timeout_s = 30\n"
                 "cpu_staging = \"overlapped\"\nrestore_read_timeout_s = 12.5\n")
    cfg = tier_config(load_config(path).checkpoint, "/shared/ckpt")
    assert cfg.tiers == ("local", "persistent") and cfg.intervals == {"local": 4, "persistent": 40}
    assert cfg.adaptive == ("local", "persistent") and cfg.persistent_root == "/shared/ckpt"
    assert cfg.local_wait_timeout_s == 30.0 and cfg.cpu_staging == "overlapped" and cfg.restore_read_timeout_s == 12.5
    assert cfg.schedule == ScheduleOptions(min_steps=2, max_steps=300, gpu_mtbf_s=9000.0, restart_prior_s=20.0)
    # 0 = the scheduler's own defaults
    plain = tier_config(load_config(_toml(tmp_path, LLAMA + "[checkpoint]\nenable = true\n")).checkpoint, "/p")
    assert plain.schedule == ScheduleOptions(min_steps=1)


@pytest.mark.parametrize("text,key,fragment", [
    ("local_wait_timeout_s = 1e9\n", "checkpoint.local_wait_timeout_s", "[0, 604800]"),
    ("local_root = \"/nvme/ckpt\"\n", "checkpoint.local_root", "{node}"),
    ("adaptive = [\"local\"]\ngpu_mtbf_hours = inf\n", "checkpoint.gpu_mtbf_hours", "hours >= 0"),
])
def test_early_check_and_runtime_builder_give_the_same_error(tmp_path, monkeypatch, text, key, fragment):
    """The TOML check before any process group and the manager's builder at start-up are one
    function: the same bad [checkpoint] fails with the same checkpoint.* key and message."""
    from titan_plugin import toml
    from titan_plugin.config import build_tier_config

    path = _toml(tmp_path, LLAMA + "[checkpoint]\nenable = true\n" + text)
    with pytest.raises(ConfigError) as early:
        load_config(path)
    assert early.value.option == key and fragment in str(early.value), str(early.value)
    from torchtitan.components.checkpoint import CheckpointManager

    from titan_plugin.manager import TieredCheckpointManager

    # the section's own __post_init__ runs the same builder: keep torchtitan's checks only
    monkeypatch.setattr(toml, "check_tiers_early", lambda ckpt: None)
    monkeypatch.setattr(TieredCheckpointManager.Config, "__post_init__", CheckpointManager.Config.__post_init__)
    ckpt = load_config(path).checkpoint
    with pytest.raises(ConfigError) as runtime:
        build_tier_config(ckpt, ckpt.persistent_folder or ckpt.folder)
    assert (runtime.value.option, str(runtime.value)) == (early.value.option, str(early.value))


def test_unknown_key_names_the_checkpoint_key(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(_toml(tmp_path, LLAMA + "[checkpoint]\nenable = true\nlocal_intervall = 5\n"))
    assert e.value.option == "checkpoint.local_intervall" and "local_interval" in str(e.value)


def test_job_table_is_validated(tmp_path):
    with pytest.raises(ConfigError, match="job.module"):
        load_config(_toml(tmp_path, "[job]\nconfig = \"x\"\n"))
    with pytest.raises(ConfigError, match="job.config.*allowed"):
        load_config(_toml(tmp_path, '[job]\nmodule = "llama3"\nconfig = "nope"\n'))
    with pytest.raises(ConfigError, match="job.extra"):
        load_config(_toml(tmp_path, LLAMA + "extra = 1\n"))


@pytest.mark.parametrize("name", ["titan_demo.toml", "titan_llama3_8b_nvme.toml"])
def test_shipped_configs_load(name):
    c = load_config(os.path.join(ROOT, "configs", name))
    assert c.checkpoint.enable and c.checkpoint.local_interval > 0
    assert c.checkpoint.replication_factor == 2 and "{node}" in c.checkpoint.local_root
    if "8b" in name:
        assert c.checkpoint.adaptive == ["local", "persistent"] and c.checkpoint.max_interval_steps == 5000


def test_cli_exit_code_and_message(tmp_path):
    path = _toml(tmp_path, LLAMA + "[checkpoint]\nreplication_jump = 0\n")
    r = subprocess.run([sys.executable, "-m", "titan_plugin.train", "--toml", path],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "checkpoint.replication_jump" in r.stderr, r.stderr[-2000:]


def test_seed_checkpoint_run_validation(monkeypatch):
    """A seed run (one rank) takes the demo TOML unchanged: J/F do not apply to it; more than
    one rank, or checkpointing off, is an error naming the option."""
    demo = os.path.join(ROOT, "configs", "titan_demo.toml")
    monkeypatch.setenv("WORLD_SIZE", "1")
    c = load_config(demo, ["--checkpoint.create_seed_checkpoint", "true"])
    assert c.checkpoint.create_seed_checkpoint and c.checkpoint.replication_factor == 2
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError) as e:
        load_config(demo, ["--checkpoint.create_seed_checkpoint", "true"])
    assert e.value.option == "checkpoint.create_seed_checkpoint" and "allowed: 1" in str(e.value)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError) as e:
        load_config(demo, ["--checkpoint.create_seed_checkpoint", "true", "--checkpoint.enable", "false"])
    assert e.value.option == "checkpoint.create_seed_checkpoint" and "enable" in str(e.value)


def test_retention_keys_reach_the_engine_config(tmp_path):
    """The [checkpoint] keep_* keys set the persistent tier's rules (tierckpt/tiers/keep.py); 0 is off."""
    from titan_plugin.config import build_tier_config

    path = _toml(tmp_path, LLAMA + "[checkpoint]\nenable = true\nkeep_latest_k = 2\nkeep_interval_s = 3600\n"
                 "keep_every_n_steps = 50\nkeep_period = 1000\nkeep_steps = [120, 7]\n")
    cfg = build_tier_config(load_config(path).checkpoint, "/p")
    assert (cfg.keep_latest_k["persistent"], cfg.keep_interval_s, cfg.keep_every_n_steps, cfg.keep_period,
            cfg.keep_steps) == (2, 3600.0, 50, 1000, (7, 120))
    plain = build_tier_config(load_config(_toml(tmp_path, LLAMA + "[checkpoint]\nenable = true\n")).checkpoint, "/p")
    assert (plain.keep_interval_s, plain.keep_every_n_steps, plain.keep_period, plain.keep_steps) == (None,) * 3 + ((),)
