"""``--ckpt-plugin-*`` flags: parsing, validation against Megatron's own flags, the TierConfig
they produce, and ``configs/mcore_gpt_nvme.args``.

Most tests use a parser holding the Megatron-LM checkpoint flags the plugin reads, with
Megatron-LM 0.16's names and defaults (``megatron/training/training_config.py``), so they run
on the megatron-core wheel alone. ``test_config_file_with_megatron_parser`` parses and
validates the config with Megatron-LM's real parser when ``MEGATRON_LM_DIR`` is set.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_plugin.args import (
    add_plugin_args,
    expand_args_files,
    read_args_file,
    settings_of,
    tier_config_from_args,
    validate_plugin_args,
)
from tierckpt import ScheduleOptions
from tierckpt.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "mcore_gpt_nvme.args"


def megatron_like_parser() -> argparse.ArgumentParser:
    """Megatron-LM's checkpoint flags the plugin reads (names and defaults of 0.16.1)."""
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--save", default=None)
    p.add_argument("--load", default=None)
    p.add_argument("--save-interval", "--persistent-save-interval", type=int, default=None)
    p.add_argument("--ckpt-format", default="torch_dist", choices=["torch", "torch_dist", "torch_dcp", "fsdp_dtensor"])
    p.add_argument("--non-persistent-ckpt-type", default=None, choices=["global", "local", "in_memory"])
    p.add_argument("--non-persistent-save-interval", type=int, default=None)
    p.add_argument("--non-persistent-global-ckpt-dir", default=None)
    p.add_argument("--non-persistent-local-ckpt-dir", default=None)
    p.add_argument("--replication", action="store_true")
    p.add_argument("--replication-jump", type=int, default=None)
    p.add_argument("--replication-factor", type=int, default=2)
    p.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true")
    p.add_argument("--async-save", action="store_true")
    return add_plugin_args(p)


def parse(argv: list[str]) -> argparse.Namespace:
    args, _ = megatron_like_parser().parse_known_args(argv)
    args.use_dist_ckpt = args.ckpt_format != "torch"  # Megatron's update_use_dist_ckpt
    return args


GOOD = ["--save", "/shared/ckpt", "--save-interval", "100", "--ckpt-plugin-enable",
        "--ckpt-plugin-local-interval", "10", "--ckpt-plugin-local-root", "/nvme/{job}/node-{node}"]


def error_of(argv: list[str], env: dict | None = None, monkeypatch=None) -> ConfigError:
    if env and monkeypatch:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError) as e:
        validate_plugin_args(parse(argv))
    return e.value


def test_flags_are_in_the_parser_help():
    text = megatron_like_parser().format_help()
    for flag in ("--ckpt-plugin-enable", "--ckpt-plugin-local-root", "--ckpt-plugin-replication-jump",
                 "--ckpt-plugin-replication-factor", "--ckpt-plugin-local-interval",
                 "--ckpt-plugin-persistent-interval", "--ckpt-plugin-adaptive", "--ckpt-plugin-gpu-mtbf-hours",
                 "--ckpt-plugin-restart-prior", "--ckpt-plugin-min-interval", "--ckpt-plugin-local-wait-timeout", "--ckpt-plugin-max-interval", "--ckpt-plugin-local-keep",
                 "--ckpt-plugin-persistent-keep", "--ckpt-plugin-job-id", "--ckpt-plugin-busy-tier-policy",
                 "--ckpt-plugin-cpu-staging", "--ckpt-plugin-restore-read-timeout"):
        assert flag in text, flag


def test_valid_flags_give_tier_config_and_drive_megatron_args():
    args = parse(GOOD + ["--ckpt-plugin-replication-factor", "3", "--ckpt-plugin-local-keep", "4",
                         "--ckpt-plugin-persistent-keep", "0", "--ckpt-plugin-job-id", "run7",
                         "--ckpt-plugin-local-wait-timeout", "45", "--ckpt-plugin-busy-tier-policy", "wait",
                         "--ckpt-plugin-cpu-staging", "overlapped", "--ckpt-plugin-restore-read-timeout", "20"])
    s = validate_plugin_args(args)
    assert s.tiers == ("local", "persistent") and s.intervals == {"local": 10, "persistent": 100}
    # Megatron's own loop then calls the local path every 10 iterations, --save every 100
    assert args.non_persistent_ckpt_type == "local" and args.non_persistent_save_interval == 10
    assert args.save_interval == 100 and args.load == "/shared/ckpt" and args.replication is False
    cfg = tier_config_from_args(args)
    assert cfg.persistent_root == "/shared/ckpt" and cfg.local_root == "/nvme/{job}/node-{node}"
    assert (cfg.replication_jump, cfg.replication_factor) == (1, 3)
    assert cfg.keep_latest_k == {"local": 4, "persistent": 0} and cfg.job_id == "run7"
    assert cfg.intervals == {"local": 10, "persistent": 100} and cfg.adaptive == ()
    assert cfg.local_wait_timeout_s == 45.0 and cfg.restore_read_timeout_s == 20.0
    assert cfg.busy_tier_policy == {"local": "wait", "persistent": "wait"} and cfg.cpu_staging == "overlapped"
    plain = parse(GOOD)
    validate_plugin_args(plain)
    assert tier_config_from_args(plain).local_wait_timeout_s == 300.0  # the engine's default
    assert tier_config_from_args(plain).busy_tier_policy == {"local": "defer", "persistent": "defer"}
    assert tier_config_from_args(plain).cpu_staging == "blocking"


def test_megatron_local_flags_are_taken_over():
    args = parse(["--save", "/s", "--save-interval", "50", "--ckpt-plugin-enable", "--non-persistent-ckpt-type",
                  "local", "--non-persistent-save-interval", "5", "--non-persistent-local-ckpt-dir", "/nvme/ckpt"])
    s = validate_plugin_args(args)
    assert s.intervals == {"local": 5, "persistent": 50}
    assert s.local_root == "/nvme/ckpt" and s.local_root_is_node_private  # a node-local path, no {node}
    assert tier_config_from_args(args).local_root_is_node_private


def test_persistent_only_and_adaptive():
    args = parse(["--save", "/s", "--save-interval", "500", "--ckpt-plugin-enable", "--ckpt-plugin-adaptive",
                  "persistent", "--ckpt-plugin-min-interval", "50", "--ckpt-plugin-max-interval", "5000",
                  "--ckpt-plugin-gpu-mtbf-hours", "20000", "--ckpt-plugin-restart-prior", "45"])
    s = validate_plugin_args(args)
    assert s.tiers == ("persistent",) and args.non_persistent_ckpt_type is None
    cfg = tier_config_from_args(args)
    assert cfg.adaptive == ("persistent",)
    assert cfg.schedule == ScheduleOptions(min_steps=50, max_steps=5000, gpu_mtbf_s=20000 * 3600.0,
                                           restart_prior_s=45.0)


def test_plugin_off_leaves_args_alone_and_refuses_stray_flags():
    args = parse(["--save", "/s", "--save-interval", "10"])
    assert validate_plugin_args(args) is None and settings_of(args) is None and args.load is None
    e = error_of(["--save", "/s", "--ckpt-plugin-local-interval", "5"])
    assert e.option == "--ckpt-plugin-local-interval" and "--ckpt-plugin-enable" in str(e)


@pytest.mark.parametrize("argv, option, words", [
    (["--ckpt-plugin-enable", "--save-interval", "10"], "--save", "persistent tier"),
    (GOOD + ["--ckpt-format", "torch"], "--ckpt-format", "torch_dist"),
    (GOOD + ["--ckpt-format", "torch_dcp"], "--ckpt-format", "torch_dist"),
    (GOOD + ["--non-persistent-ckpt-type", "global"], "--non-persistent-ckpt-type", "'local'"),
    (GOOD + ["--non-persistent-global-ckpt-dir", "/x"], "--non-persistent-global-ckpt-dir", "local tier"),
    (["--save", "/s", "--ckpt-plugin-enable"], "--save-interval", "N >= 1"),
    (GOOD + ["--save-interval", "0"], "--save-interval", ">= 1"),
    (GOOD + ["--non-persistent-ckpt-type", "local", "--non-persistent-save-interval", "20"],
     "--ckpt-plugin-local-interval", "contradicts --non-persistent-save-interval 20"),
    (GOOD + ["--ckpt-plugin-persistent-interval", "300"], "--ckpt-plugin-persistent-interval",
     "contradicts --save-interval 100"),
    (["--save", "/s", "--save-interval", "10", "--ckpt-plugin-enable", "--non-persistent-save-interval", "5"],
     "--non-persistent-save-interval", "--non-persistent-ckpt-type local"),
    (["--save", "/s", "--save-interval", "10", "--ckpt-plugin-enable", "--ckpt-plugin-local-interval", "5"],
     "--ckpt-plugin-local-root", "node-local directory"),
    (["--save", "/s", "--save-interval", "10", "--ckpt-plugin-enable", "--ckpt-plugin-local-root", "/n/{node}"],
     "--ckpt-plugin-local-root", "needs the local tier"),
    (["--save", "/s", "--save-interval", "10", "--ckpt-plugin-enable", "--ckpt-plugin-replication-factor", "2"],
     "--ckpt-plugin-replication-factor", "needs the local tier"),
    (["--save", "/s", "--save-interval", "10", "--ckpt-plugin-enable", "--ckpt-plugin-local-wait-timeout", "5"],
     "--ckpt-plugin-local-wait-timeout", "needs the local tier"),
    (["--save", "/s", "--save-interval", "10", "--ckpt-plugin-enable", "--ckpt-plugin-adaptive", "local"],
     "--ckpt-plugin-adaptive", "starting interval"),
    (GOOD + ["--ckpt-plugin-adaptive", "local", "--ckpt-plugin-min-interval", "50", "--ckpt-plugin-max-interval",
             "10"], "--ckpt-plugin-min-interval", "min <= max"),
    (GOOD + ["--ckpt-plugin-min-interval", "5"], "--ckpt-plugin-min-interval", "adaptive"),
    (GOOD + ["--ckpt-plugin-gpu-mtbf-hours", "100"], "--ckpt-plugin-gpu-mtbf-hours", "adaptive"),
    (GOOD + ["--ckpt-plugin-restart-prior", "30"], "--ckpt-plugin-restart-prior", "adaptive"),
    (GOOD + ["--ckpt-plugin-adaptive", "local", "local"], "--ckpt-plugin-adaptive", "twice"),
    (GOOD + ["--dist-ckpt-optim-fully-reshardable"], "--dist-ckpt-optim-fully-reshardable", "local path"),
    (GOOD + ["--async-save"], "--async-save", "local tier"),
    (["--save", "/s", "--save-interval", "10", "--ckpt-plugin-enable", "--ckpt-plugin-local-interval", "5",
      "--ckpt-plugin-local-root", "/nvme/ckpt"], "--ckpt-plugin-local-root", "{node}"),
    (["--save", "/s", "--save-interval", "10", "--ckpt-plugin-enable", "--ckpt-plugin-local-interval", "5",
      "--ckpt-plugin-local-root", "/nvme/{rank}/x"], "--ckpt-plugin-local-root", "unknown field"),
])
def test_invalid_combinations_name_the_flag(argv, option, words):
    e = error_of(argv)
    assert e.option == option, (e.option, str(e))
    assert words in str(e), str(e)


@pytest.mark.parametrize("argv, flag", [
    (["--ckpt-plugin-local-interval", "0"], "--ckpt-plugin-local-interval"),
    (["--ckpt-plugin-persistent-interval", "-3"], "--ckpt-plugin-persistent-interval"),
    (["--ckpt-plugin-replication-factor", "x"], "--ckpt-plugin-replication-factor"),
    (["--ckpt-plugin-local-keep", "-1"], "--ckpt-plugin-local-keep"),
    (["--ckpt-plugin-gpu-mtbf-hours", "0"], "--ckpt-plugin-gpu-mtbf-hours"),
    (["--ckpt-plugin-restart-prior", "-5"], "--ckpt-plugin-restart-prior"),
    (["--ckpt-plugin-local-wait-timeout", "-1"], "--ckpt-plugin-local-wait-timeout"),
    (["--ckpt-plugin-adaptive", "replica"], "--ckpt-plugin-adaptive"),
    (["--ckpt-plugin-cpu-staging", "async"], "--ckpt-plugin-cpu-staging"),
    (["--ckpt-plugin-restore-read-timeout", "-2"], "--ckpt-plugin-restore-read-timeout"),
    (["--ckpt-plugin-persistent-keep-interval", "0"], "--ckpt-plugin-persistent-keep-interval"),
    (["--ckpt-plugin-persistent-keep-every", "0"], "--ckpt-plugin-persistent-keep-every"),
    (["--ckpt-plugin-persistent-keep-period", "2.5"], "--ckpt-plugin-persistent-keep-period"),
    (["--ckpt-plugin-persistent-keep-steps", "120", "-1"], "--ckpt-plugin-persistent-keep-steps"),
    # the engine's bounds (TierConfig.local_wait_timeout_s, ScheduleOptions.gpu_mtbf_s), at parse time
    (["--ckpt-plugin-local-wait-timeout", "1e9"], "--ckpt-plugin-local-wait-timeout"),
    (["--ckpt-plugin-gpu-mtbf-hours", "inf"], "--ckpt-plugin-gpu-mtbf-hours"),
])
def test_bad_values_are_parser_errors_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        megatron_like_parser().parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and ("must be" in err or "invalid choice" in err), err


@pytest.mark.parametrize("extra, flag, words", [
    (["--ckpt-plugin-local-root", "/nvme/{rank}/x"], "--ckpt-plugin-local-root", "unknown field"),
    (["--ckpt-plugin-restore-read-timeout", "9999"], "--ckpt-plugin-restore-read-timeout", "collective_timeout_s / 2"),
])
def test_early_check_and_runtime_builder_give_the_same_error(monkeypatch, extra, flag, words):
    """validate_plugin_args (before any process group) and the start-up build are one function:
    the same bad flags fail with the same flag and message in both."""
    from mcore_plugin import args as args_mod

    argv = GOOD + extra
    early = error_of(argv)
    assert early.option == flag and words in str(early), str(early)
    args = parse(argv)
    with monkeypatch.context() as m:  # the flag checks alone pass; keep the settings they decide
        m.setattr(args_mod, "tier_config_from_args", lambda a, s=None: None)
        validate_plugin_args(args)
    with pytest.raises(ConfigError) as runtime:
        tier_config_from_args(args)
    assert (runtime.value.option, str(runtime.value)) == (early.option, str(early))


def test_unknown_plugin_flag_is_a_parser_error_naming_it(capsys):
    with pytest.raises(SystemExit) as e:
        megatron_like_parser().parse_args(GOOD + ["--ckpt-plugin-local-intervall", "5"])
    assert e.value.code == 2 and "--ckpt-plugin-local-intervall" in capsys.readouterr().err


def test_megatron_replication_jump_in_ranks_becomes_nodes(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    base = GOOD + ["--non-persistent-ckpt-type", "local", "--non-persistent-save-interval", "10", "--replication"]
    args = parse(base + ["--replication-jump", "16", "--replication-factor", "3"])
    s = validate_plugin_args(args)
    assert (s.replication_jump, s.replication_factor) == (2, 3)  # 16 ranks / 8 per node
    assert args.replication is False  # nvrx's replication never starts next to the plugin's
    assert any("16 ranks" in n for n in s.notes)
    e = error_of(base + ["--replication-jump", "12"])
    assert e.option == "--replication-jump" and "--ckpt-plugin-replication-jump" in str(e)
    e = error_of(base + ["--replication-jump", "8", "--replication-factor", "2", "--ckpt-plugin-replication-factor",
                         "3"])
    assert e.option == "--ckpt-plugin-replication-factor"


def test_args_file_reader(tmp_path):
    f = tmp_path / "a.args"
    f.write_text("# comment\n--save /x   --save-interval 5  # trailing\n\n--ckpt-plugin-local-root '/n/{job} x'\n")
    assert read_args_file(str(f)) == ["--save", "/x", "--save-interval", "5", "--ckpt-plugin-local-root", "/n/{job} x"]
    assert expand_args_files(["--a", f"@{f}", "--b"])[:2] == ["--a", "--save"]
    with pytest.raises(ConfigError) as e:
        expand_args_files(["@/nonexistent.args"])
    assert e.value.option == "@/nonexistent.args"
    bad = tmp_path / "bad.args"
    bad.write_text("--save '/x\n")
    with pytest.raises(ValueError, match="bad.args:1"):
        read_args_file(str(bad))


def test_config_file_parses_and_validates():
    argv = read_args_file(str(CONFIG))
    args = parse(argv)
    s = validate_plugin_args(args)
    cfg = tier_config_from_args(args)
    assert cfg.tiers == ("local", "persistent") and cfg.adaptive == ("local", "persistent")
    assert cfg.local_root.startswith("/local_nvme/") and "{node}" in cfg.local_root
    assert cfg.persistent_root == args.save == args.load
    assert (cfg.replication_jump, cfg.replication_factor) == (1, 2)
    assert cfg.intervals == {"local": 50, "persistent": 1000}
    assert cfg.schedule.min_steps == 20 and cfg.schedule.max_steps == 2000
    assert s.keep_latest_k == {"local": 2, "persistent": 3}
    # a realistic GPU run: 16 nodes x 8 GPUs with TP 2 x PP 2 -> DP 32, bf16, NCCL
    def value(flag):
        return argv[argv.index(flag) + 1]

    tp, pp = int(value("--tensor-model-parallel-size")), int(value("--pipeline-model-parallel-size"))
    assert (tp, pp) == (2, 2) and 128 % (tp * pp) == 0
    assert value("--distributed-backend") == "nccl" and "--bf16" in argv and "--use-distributed-optimizer" in argv
    assert int(value("--num-layers")) == 32 and int(value("--hidden-size")) == 4096


MLM = os.environ.get("MEGATRON_LM_DIR", "")

_REAL_PARSE = r"""
import sys
mlm, cfg = sys.argv[1], sys.argv[2]
sys.path.insert(0, mlm)
from mcore_plugin.args import read_args_file
from mcore_plugin import install
install.install()
import megatron.training.arguments as A
A.get_device_arch_version = lambda: 9  # validate as on an H100 (sm_90); this machine has no GPU
sys.argv = ["pretrain_gpt.py", *read_args_file(cfg)]
args = A.parse_args()
A.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
from mcore_plugin.args import settings_of
s = settings_of(args)
print("RESULT", args.data_parallel_size, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
      s.tiers, sorted(s.intervals.items()), s.adaptive)
"""


@pytest.mark.skipif(not MLM, reason="MEGATRON_LM_DIR is not set: Megatron-LM's own parser is in its checkout "
                                    "(make test-megatron-lm sets it)")
def test_config_file_with_megatron_parser():
    env = dict(os.environ, WORLD_SIZE="128", RANK="0", LOCAL_WORLD_SIZE="8", CUDA_DEVICE_MAX_CONNECTIONS="1",
               OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _REAL_PARSE, MLM, str(CONFIG)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT"))
    assert line == ("RESULT 32 2 2 ('local', 'persistent') [('local', 50), ('persistent', 1000)] "
                    "('local', 'persistent')"), line


def test_async_save_is_fine_without_a_local_tier():
    args = parse(["--save", "/s", "--save-interval", "10", "--ckpt-plugin-enable", "--async-save"])
    assert validate_plugin_args(args) is not None


def test_exit_timeout_flag_reaches_the_tier_config():
    cfg = tier_config_from_args(_validated(GOOD + ["--ckpt-plugin-exit-timeout", "30"]))
    assert cfg.exit_timeout_s == 30.0
    assert tier_config_from_args(_validated(GOOD)).exit_timeout_s == 600.0
    with pytest.raises((ConfigError, SystemExit)):
        _validated(GOOD + ["--ckpt-plugin-exit-timeout", "-1"])


def _validated(argv):
    args = parse(argv)
    validate_plugin_args(args)
    return args


def test_retention_flags_reach_the_engine_config():
    """--ckpt-plugin-persistent-keep-* set the persistent tier's rules (tierckpt/tiers/keep.py);
    given as a script's defaults (not parsed), a bad value still fails naming the flag."""
    args = parse(GOOD + ["--ckpt-plugin-persistent-keep", "2", "--ckpt-plugin-persistent-keep-interval", "3600",
                         "--ckpt-plugin-persistent-keep-every", "50", "--ckpt-plugin-persistent-keep-period", "1000",
                         "--ckpt-plugin-persistent-keep-steps", "120", "7"])
    validate_plugin_args(args)
    cfg = tier_config_from_args(args)
    assert (cfg.keep_latest_k["persistent"], cfg.keep_interval_s, cfg.keep_every_n_steps, cfg.keep_period,
            cfg.keep_steps) == (2, 3600.0, 50, 1000, (7, 120))
    args = parse(GOOD)
    validate_plugin_args(args)
    plain = tier_config_from_args(args)
    assert (plain.keep_interval_s, plain.keep_every_n_steps, plain.keep_period, plain.keep_steps) == (None,) * 3 + ((),)
    args = parse(GOOD)
    args.ckpt_plugin_persistent_keep_steps = [120, -4]
    e = error_of_args(args)
    assert e.option == "--ckpt-plugin-persistent-keep-steps" and ">= 0" in str(e), str(e)
    args = parse(GOOD)
    args.ckpt_plugin_persistent_keep_every = 0
    e = error_of_args(args)
    assert e.option == "--ckpt-plugin-persistent-keep-every" and ">= 1" in str(e), str(e)
    e = error_of(["--save", "/s", "--save-interval", "10", "--ckpt-plugin-persistent-keep-every", "50"])
    assert e.option == "--ckpt-plugin-persistent-keep-every" and "--ckpt-plugin-enable" in str(e)


def error_of_args(args: argparse.Namespace) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        validate_plugin_args(args)
    return e.value
