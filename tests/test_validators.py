"""Issue 30: every numeric option refuses ``True``, NaN, ±inf, a negative value and a string with a
:class:`ConfigError` naming the option as the user wrote it: the ``TierConfig`` /
``ScheduleOptions`` field, the torchtitan ``[checkpoint]`` key, the ``--ckpt-plugin-*`` flag.

The options are enumerated from the dataclasses' type hints and the parser's actions, so a new
numeric option is covered without touching this file.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import typing
from collections.abc import Mapping

import pytest

from tierckpt import ScheduleOptions, TierConfig
from tierckpt.errors import ConfigError

BAD = [True, math.inf, math.nan, -math.inf, -1, "x"]  # no engine option takes a negative value
BASE = {"local_root": "/nvme/{job}/node-{node}", "persistent_root": "/shared/ckpt",
        "intervals": {"local": 5, "persistent": 10}}


def _numeric(tp) -> set[str]:
    """How a type hint takes numbers: ``{"scalar"}``, ``{"mapping"}`` (``Mapping[str, int]``),
    ``{"sequence"}`` (``tuple[int, ...]``), scalar and mapping, or none."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in (int, float):
        return {"scalar"}
    if origin in (typing.Union, getattr(__import__("types"), "UnionType")):
        return set().union(*(_numeric(a) for a in args))
    if origin is not None and isinstance(origin, type) and issubclass(origin, Mapping) and args:
        return {"mapping"} if _numeric(args[1]) else set()
    if origin in (tuple, list) and args and _numeric(args[0]):  # tuple[int, ...], list[int]
        return {"sequence"}
    return set()


def _numeric_fields(cls) -> dict[str, set[str]]:
    hints = typing.get_type_hints(cls)
    out = {f.name: _numeric(hints[f.name]) for f in dataclasses.fields(cls) if f.init}
    return {k: v for k, v in out.items() if v}


def _cases(cls):
    for name, kinds in _numeric_fields(cls).items():
        for bad in BAD:
            if "scalar" in kinds:
                yield name, bad, name
            if "mapping" in kinds:
                yield name, {"local": bad}, f"{name}.local"
            if "sequence" in kinds:
                yield name, (7, bad), f"{name}[1]"


def test_enumeration_finds_the_options():
    """Guard against a vacuous enumeration (a hint the helper stops recognising)."""
    tier = _numeric_fields(TierConfig)
    assert {"replication_factor", "staging_buffers", "collective_timeout_s", "restore_read_timeout_s",
            "preemption_grace_s", "transfer_chunk_bytes"} <= set(tier)
    assert tier["keep_latest_k"] == {"mapping"} and tier["intervals"] == {"mapping"}
    assert tier["keep_steps"] == {"sequence"}
    sched = _numeric_fields(ScheduleOptions)
    assert {"gpu_mtbf_s", "mtbf_weight", "ema_alpha", "persistent_share"} <= set(sched)
    assert sched["min_steps"] == {"scalar", "mapping"}


@pytest.mark.parametrize("name, value, option", list(_cases(TierConfig)))
def test_tier_config_refuses(name, value, option):
    kw = dict(BASE)
    if name == "intervals":
        value = {**BASE["intervals"], **value}
    kw[name] = value
    with pytest.raises(ConfigError) as e:
        TierConfig(**kw)
    assert e.value.option == option and str(e.value).startswith(f"{option}: must be"), str(e.value)


@pytest.mark.parametrize("name, value, option", list(_cases(ScheduleOptions)))
def test_schedule_options_refuse(name, value, option):
    with pytest.raises(ConfigError) as e:
        ScheduleOptions(**{name: value})
    assert e.value.option == option and str(e.value).startswith(f"{option}: must be"), str(e.value)


@pytest.mark.parametrize("name", sorted(n for n, k in _numeric_fields(TierConfig).items() if k == {"mapping"}))
@pytest.mark.parametrize("value", [True, 3, "x"])
def test_per_tier_fields_refuse_a_scalar(name, value):
    with pytest.raises(ConfigError) as e:
        TierConfig(**{**BASE, name: value})
    assert e.value.option == name and "mapping" in str(e.value), str(e.value)


def test_the_two_cases_of_the_issue():
    """``staging_buffers=True`` was taken as 1; ``collective_timeout_s=inf`` passed and failed later with an
    ``OverflowError`` in ``timedelta``; a finite but huge wait overflows the same way."""
    for kw, option, allowed in (({"staging_buffers": True}, "staging_buffers", "an integer >= 1"),
                                ({"collective_timeout_s": math.inf}, "collective_timeout_s", "(0, 604800]"),
                                ({"collective_timeout_s": 1e300}, "collective_timeout_s", "(0, 604800]"),
                                ({"preemption_grace_s": 1e300}, "preemption_grace_s", "(0, 604800]"),
                                ({"local_wait_timeout_s": 1e300}, "local_wait_timeout_s", "[0, 604800]"),
                                ({"exit_timeout_s": 1e300}, "exit_timeout_s", "[0, 604800]")):
        with pytest.raises(ConfigError) as e:
            TierConfig(**BASE, **kw)
        assert e.value.option == option and allowed in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match=r"^staging_buffers: must be an integer >= 1, got True$"):
        TierConfig(persistent_root="/shared/ckpt", tiers=("persistent",), staging_buffers=True)
    c = TierConfig(**BASE, collective_timeout_s=7 * 86400, staging_buffers=3, preemption_grace_s=60)
    assert (c.collective_timeout_s, c.staging_buffers, c.preemption_grace_s) == (604800.0, 3, 60.0)
    assert isinstance(c.collective_timeout_s, float)


def test_every_numeric_field_has_one_rule():
    """A numeric field without an entry in RULES / SCHEDULE_RULES would be checked (or not) by hand."""
    from tierckpt.config import RULES, SCHEDULE_RULES
    from tierckpt.validators import Number

    assert set(_numeric_fields(TierConfig)) == set(RULES)
    assert set(_numeric_fields(ScheduleOptions)) == set(SCHEDULE_RULES)
    assert all(isinstance(r, Number) for r in (*RULES.values(), *SCHEDULE_RULES.values()))


# -- the validators themselves --------------------------------------------------------------------
def test_number_rule_messages_and_normalisation():
    from tierckpt.validators import Number, fraction, non_negative_seconds, optional, positive_int, positive_seconds

    steps = positive_int(unit="steps")
    assert steps(5, "n") == 5 and type(steps(5, "n")) is int
    with pytest.raises(ConfigError, match=r"^n: must be an integer number of steps >= 1, got 2\.0$"):
        steps(2.0, "n")
    wait = non_negative_seconds(max=60, note="0 = no limit")
    assert wait(3, "w") == 3.0 and type(wait(3, "w")) is float
    assert wait.describe() == "a number of seconds in [0, 60] (0 = no limit)"
    assert positive_seconds().describe() == "a number of seconds > 0"
    assert fraction().describe() == "a number in (0, 1]"
    with pytest.raises(ConfigError, match=r"in \(0, 1\], got 0"):
        fraction()(0, "f")
    opt = optional(positive_seconds(), "the default").with_max(10, "c / 2 = 10")
    assert opt(None, "o") is None and opt(10, "o") == 10.0
    with pytest.raises(ConfigError, match=r"^o: must be a number of seconds in \(0, c / 2 = 10\], or None \(the default\)"):
        opt(11, "o")
    with pytest.raises(ConfigError, match="got None"):
        positive_seconds()(None, "p")
    aligned = Number(integer=True, min=4096, multiple_of=4096, unit="bytes")
    assert aligned(8192, "b") == 8192
    with pytest.raises(ConfigError, match="a multiple of 4096"):
        aligned(8193, "b")
    assert steps.parse("7", "--s") == 7
    for text in ("True", "x", "nan", "inf", "1.5", "0"):
        with pytest.raises(ConfigError) as e:
            steps.parse(text, "--s")
        assert e.value.option == "--s" and repr(text) in str(e.value) or text in ("nan", "inf", "0")


def test_choice_and_boolean():
    from tierckpt.validators import boolean, choice

    assert choice("a", "c", ("a", "b")) == "a"
    with pytest.raises(ConfigError, match=r"^c: must be 'a' or 'b', got 'z'$"):
        choice("z", "c", ("a", "b"))
    with pytest.raises(ConfigError, match=r"^c: must be 'a', 'b' or 'd', got 1$"):
        choice(1, "c", ("a", "b", "d"))
    assert boolean(False, "f") is False
    with pytest.raises(ConfigError, match=r"^f: must be true or false, got 1$"):
        boolean(1, "f")


# -- torchtitan: the [checkpoint] keys --------------------------------------------------------------
LLAMA = '[job]\nmodule = "llama3"\nconfig = "llama3_debugmodel"\n'
TOML_BAD = ["true", "inf", "nan", "-inf", "-1", '"x"']
NEGATIVE_OK = {"load_step": "torchtitan's -1 = the latest step"}


def _checkpoint_keys() -> dict[str, set[str]]:
    from titan_plugin.manager import TieredCheckpointManager

    return _numeric_fields(TieredCheckpointManager.Config)


def _plugin_keys() -> set[str]:
    from torchtitan.components.checkpoint import CheckpointManager

    return set(_checkpoint_keys()) - {f.name for f in dataclasses.fields(CheckpointManager.Config)}


def test_checkpoint_keys_found():
    keys = _checkpoint_keys()
    assert {"interval", "keep_latest_k", "local_interval", "replication_factor", "gpu_mtbf_hours",
            "local_wait_timeout_s", "restore_read_timeout_s", "preemption_grace_s", "max_interval_steps"} <= set(keys)
    assert {"interval", "keep_latest_k"}.isdisjoint(_plugin_keys())


@pytest.mark.parametrize("literal", TOML_BAD)
def test_toml_checkpoint_keys_refuse(tmp_path, literal):
    """Every numeric ``[checkpoint]`` key, from a TOML file and from the command line."""
    from titan_plugin.toml import load_config

    path = tmp_path / "c.toml"
    failures = []
    keys = _checkpoint_keys()
    for key in sorted(keys):
        if literal == "-1" and key in NEGATIVE_OK:
            continue
        path.write_text(f"{LLAMA}[checkpoint]\nenable = true\n{key} = {literal}\n")
        cli = [f"--checkpoint.{key}={literal.strip(chr(34))}"]
        for where, args in (("toml", (str(path),)), ("cli", (None, ["--job.module=llama3", "--job.config=llama3_debugmodel",
                                                                     "--checkpoint.enable", *cli]))):
            try:
                load_config(*args)
                failures.append(f"{where} {key} = {literal}: accepted")
            except ConfigError as e:
                # a list key names the item: checkpoint.keep_steps[0]
                item = "sequence" in keys[key] and re.fullmatch(rf"checkpoint\.{key}\[\d+\]", e.option or "")
                if e.option != f"checkpoint.{key}" and not item:
                    failures.append(f"{where} {key} = {literal}: {e}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("value", BAD)
def test_checkpoint_section_built_in_python_refuses(value):
    """A ``TieredCheckpointManager.Config`` built by a config_registry function, not from TOML:
    its ``__post_init__`` applies the engine's rules and names the key, for the plugin's keys and
    torchtitan's own (``interval``, ``keep_latest_k``, ``load_step``: torchtitan's checks raise
    ValueError or TypeError without the key, or take ``True`` as 1)."""
    from titan_plugin.manager import TieredCheckpointManager

    failures = []
    keys = sorted(_checkpoint_keys())
    assert {"interval", "keep_latest_k", "load_step"} <= set(keys)
    for key in keys:
        if value == -1 and key in NEGATIVE_OK:
            continue
        try:
            TieredCheckpointManager.Config(**{key: value})
            failures.append(f"{key} = {value!r}: accepted")
        except ConfigError as e:
            if e.option != f"checkpoint.{key}" or not str(e).startswith(f"checkpoint.{key}: must be"):
                failures.append(f"{key} = {value!r}: {e}")
        except Exception as e:  # noqa: BLE001 - the type is the failure (torchtitan's ValueError/TypeError)
            failures.append(f"{key} = {value!r}: {type(e).__name__}: {e}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("key, value, allowed", [
    ("interval", 0, "an integer number of steps >= 1"),
    ("interval", 2.0, "an integer number of steps >= 1"),
    ("keep_latest_k", 1, "0 (keep all) or at least 2"),  # torchtitan's own rule, named
    ("load_step", -2, "an integer number of steps >= -1 (-1 = the latest step)"),
])
def test_torchtitans_keys_name_the_key_and_the_allowed_values(key, value, allowed):
    from titan_plugin.manager import TieredCheckpointManager

    with pytest.raises(ConfigError) as e:
        TieredCheckpointManager.Config(**{key: value})
    assert e.value.option == f"checkpoint.{key}" and allowed in str(e.value), str(e.value)


def test_torchtitans_keys_keep_their_valid_values():
    from titan_plugin.config import TITAN_RULES
    from titan_plugin.manager import TieredCheckpointManager
    from tierckpt.config import RULES

    c = TieredCheckpointManager.Config(interval=1, keep_latest_k=0, load_step=-1)
    assert (c.interval, c.keep_latest_k, c.load_step) == (1, 0, -1)
    c = TieredCheckpointManager.Config(interval=7, keep_latest_k=2, load_step=0)
    assert (c.interval, c.keep_latest_k, c.load_step) == (7, 2, 0)
    # the keys that set a TierConfig value follow the engine's rule (one object, one bound)
    assert TITAN_RULES["interval"] is RULES["intervals"] and TITAN_RULES["keep_latest_k"] is RULES["keep_latest_k"]


# -- Megatron: the --ckpt-plugin-* flags ----------------------------------------------------------------
FLAG_BAD = ["True", "inf", "nan", "-inf", "-1", "x"]


def _parser():
    from tests.mcore.test_args import megatron_like_parser

    return megatron_like_parser()


# typed flags whose value is not a number (their own tests check them)
NOT_NUMERIC = {"--ckpt-plugin-storage-options": "a JSON object (tests/test_s3_persistent.py)"}


def _numeric_flags() -> list[str]:
    flags = sorted(a.option_strings[0] for a in _parser()._actions
                   if a.option_strings and a.option_strings[0].startswith("--ckpt-plugin-") and a.type is not None)
    assert set(NOT_NUMERIC) <= set(flags), "a NOT_NUMERIC flag is gone: drop it here"
    return [f for f in flags if f not in NOT_NUMERIC]


def _args(extra=()) -> argparse.Namespace:
    from tests.mcore.test_args import GOOD, parse

    return parse(GOOD + ["--ckpt-plugin-adaptive", "local", *extra])


def test_numeric_flags_found():
    flags = _numeric_flags()
    assert {"--ckpt-plugin-local-interval", "--ckpt-plugin-gpu-mtbf-hours", "--ckpt-plugin-local-wait-timeout",
            "--ckpt-plugin-restore-read-timeout", "--ckpt-plugin-exit-timeout", "--ckpt-plugin-local-keep"} <= set(flags)
    from mcore_plugin.args import validate_plugin_args

    assert validate_plugin_args(_args()) is not None  # the base line is valid


@pytest.mark.parametrize("text", FLAG_BAD)
def test_flags_refuse_on_the_command_line(text, capsys):
    failures = []
    for flag in _numeric_flags():
        try:
            _parser().parse_args([f"{flag}={text}"])
            failures.append(f"{flag}={text}: accepted")
        except SystemExit as e:
            err = capsys.readouterr().err
            if e.code != 2 or f"argument {flag}: must be" not in err:
                failures.append(f"{flag}={text}: exit {e.code}: {err.strip().splitlines()[-1]}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("value", BAD)
def test_flags_refuse_values_set_without_the_parser(value):
    """Megatron's ``args_defaults`` (and scripts) set ``args`` attributes without the parser's
    type; validate_plugin_args applies the same rules and names the flag."""
    from mcore_plugin.args import validate_plugin_args

    failures = []
    for flag in _numeric_flags():
        args = _args()
        setattr(args, flag[2:].replace("-", "_"), value)
        try:
            validate_plugin_args(args)
            failures.append(f"{flag} = {value!r}: accepted")
        except ConfigError as e:
            if e.option != flag or not str(e).startswith(f"{flag}: must be"):
                failures.append(f"{flag} = {value!r}: {e}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("flag", ["--ckpt-plugin-local-keep", "--ckpt-plugin-restart-prior"])
def test_a_zero_flag_without_the_plugin_is_refused(flag):
    """0 is a value (``0 keeps all``, R = 0 s): given without --ckpt-plugin-enable it is not silently ignored."""
    from mcore_plugin.args import validate_plugin_args
    from tests.mcore.test_args import parse

    with pytest.raises(ConfigError) as e:
        validate_plugin_args(parse(["--save", "/s", "--save-interval", "10", flag, "0"]))
    assert e.value.option == flag and "--ckpt-plugin-enable" in str(e.value)


def test_flags_use_the_engines_rules():
    """Where a flag sets a TierConfig / ScheduleOptions value as is, its rule is the engine's
    (the same object); the exceptions are the flags whose value is not the field's."""
    from mcore_plugin.args import _FIELD_TO_FLAG, FLAG_RULES
    from tierckpt.config import RULES, SCHEDULE_RULES

    assert set(FLAG_RULES) == set(_numeric_flags())
    own = {"--ckpt-plugin-gpu-mtbf-hours": "hours, not seconds",
           "--ckpt-plugin-restore-read-timeout": "0 = the default (None)"}
    engine = {**RULES, **SCHEDULE_RULES}
    for field, flag in _FIELD_TO_FLAG.items():
        name = field.split(".")[0]
        if flag in FLAG_RULES and flag not in own:
            assert FLAG_RULES[flag] is engine[name], (flag, field)
    assert FLAG_RULES["--ckpt-plugin-persistent-keep"] is RULES["keep_latest_k"]
    assert FLAG_RULES["--ckpt-plugin-persistent-interval"] is RULES["intervals"]
