"""TOML front-end for torchtitan 0.3 (which dropped TOML configs).

A file names the torchtitan module and config function in ``[job]`` and may override any
section of the resulting ``Trainer.Config``; ``[checkpoint]`` holds torchtitan's checkpoint
fields and the plugin's tier fields together (the checkpoint config is always a
:class:`~titan_plugin.manager.TieredCheckpointManager.Config`)::

    [job]
    module = "llama3"              # torchtitan model/experiment name, or a package with
    config = "llama3_debugmodel"   # a config_registry module (e.g. "tierckpt_dev.titan")

    [training]
    steps = 30

    [checkpoint]
    enable = true
    interval = 20                  # persistent tier (torchtitan's own field)
    local_interval = 5
    local_root = "/local_nvme/{job}/node-{node}"
    replication_factor = 2

Precedence: command line (``--section.key value``) > TOML > the registry function. Every key
is checked against the config dataclasses before any process group exists: unknown keys,
wrong types and invalid values raise :class:`ConfigError` with the full key path (e.g.
``checkpoint.replication_factor``) and the allowed values.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import types
import typing
from typing import Any, Literal, get_args, get_origin

import tomli

from tierckpt import ConfigError

JOB_KEYS = {"module": "torchtitan module (e.g. llama3) or package with a config_registry",
            "config": "function of that config_registry returning a Trainer.Config"}


def _registry(module: str):
    """Import the config_registry of ``module`` the way torchtitan's ConfigManager does:
    a torchtitan model/experiment name, else ``<module>.config_registry``, else ``module``."""
    tried = []
    for path in (f"torchtitan.models.{module}.config_registry",
                 f"torchtitan.experiments.{module}.config_registry",
                 f"{module}.config_registry", module):
        try:
            return importlib.import_module(path)
        except ModuleNotFoundError as e:
            if not e.name or not (path == e.name or path.startswith(e.name + ".")):
                raise  # the module exists but one of its own imports is missing
            tried.append(path)
    raise ConfigError("job.module", f"cannot import a config_registry for {module!r} (tried {', '.join(tried)})")


def _is_config(v: Any) -> bool:
    return dataclasses.is_dataclass(v) and not isinstance(v, type)


def _hints(obj) -> dict[str, Any]:
    try:
        return typing.get_type_hints(type(obj))
    except Exception:  # forward references the module cannot resolve: fall back to raw annotations
        return {f.name: f.type for f in dataclasses.fields(obj)}


def _fields(obj) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(obj) if not f.name.startswith("_")}


def _describe(tp) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp))
    if origin in (list, tuple):
        return "a list"
    if origin is dict:
        return "a table"
    if tp is type(None):
        return "none"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def convert(value: Any, tp, path: str, from_cli: bool = False) -> Any:
    """Convert ``value`` (TOML value, or string from the command line) to the field type ``tp``.

    Raises:
        ConfigError: naming ``path`` and the allowed values/type.
    """
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if type(None) in args and (value is None or (from_cli and str(value).lower() in ("none", "null"))):
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return convert(value, a, path, from_cli)
            except ConfigError:
                continue  # try the next member of the union
        raise ConfigError(path, f"expected {_describe(tp)}, got {value!r}")
    if origin is Literal:
        allowed = get_args(tp)
        if value in allowed:
            return value
        if from_cli:
            for a in allowed:
                if str(a) == str(value):
                    return a
        raise ConfigError(path, f"invalid value {value!r}; allowed: {', '.join(repr(a) for a in allowed)}")
    if origin in (list, tuple):
        (inner, *_) = get_args(tp) or (Any,)
        if from_cli and isinstance(value, str):
            value = [v for v in value.split(",") if v != ""]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"expected a list, got {value!r}")
        out = [convert(v, inner, f"{path}[{i}]", from_cli) for i, v in enumerate(value)]
        return out if origin is list else tuple(out)
    if origin is dict:
        return _table(value, path, from_cli)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_cli and str(value).lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return str(value).lower() in ("true", "1", "yes", "on")
        raise ConfigError(path, f"expected true/false, got {value!r}")
    if tp in (int, float):
        accepted = (int,) if tp is int else (int, float)
        if isinstance(value, accepted) and not isinstance(value, bool):
            return tp(value)
        if from_cli:
            try:
                return tp(str(value))
            except ValueError:
                pass
        raise ConfigError(path, f"expected {_describe(tp)}, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(path, f"expected a string, got {value!r}")
    if tp is Any:
        return value
    raise ConfigError(path, f"cannot be set from TOML or the command line (type {tp})")


def _table(value: Any, path: str, from_cli: bool) -> dict:
    """A table-valued key (``checkpoint.storage_options``): a TOML table, or on the command line
    a JSON object (``--checkpoint.storage_options '{"endpoint_url": "http://..."}'``) or
    ``--checkpoint.storage_options.<key> VALUE`` (a string).

    Raises:
        ConfigError: naming ``path``: not a table, or not a JSON object.
    """
    if from_cli and isinstance(value, str):
        import json

        try:
            value = json.loads(value)
        except ValueError as e:
            raise ConfigError(path, f"expected a JSON object, got {value!r} ({e})") from None
    if not isinstance(value, dict):
        raise ConfigError(path, f"expected a table, got {value!r}")
    return dict(value)


def apply_table(obj, table: dict, prefix: str = "", from_cli: bool = False) -> None:
    """Set ``table``'s keys on the config dataclass ``obj`` (recursively for sub-tables)."""
    fields = _fields(obj)
    hints = _hints(obj)
    for key, value in table.items():
        path = f"{prefix}{key}"
        if key not in fields:
            raise ConfigError(path, f"unknown key; allowed keys of [{prefix.rstrip('.') or 'top level'}]: "
                                    f"{', '.join(sorted(fields))}")
        current = getattr(obj, key)
        if get_origin(hints.get(key)) is dict:  # a table-valued key: later sources add keys
            setattr(obj, key, {**(current or {}), **convert(value, hints[key], path, from_cli)})
            continue
        if isinstance(value, dict):
            if not _is_config(current):
                raise ConfigError(path, f"is not a table; expected {_describe(hints.get(key))}")
            apply_table(current, value, f"{path}.", from_cli)
            continue
        if _is_config(current):
            raise ConfigError(path, f"is a table; set its keys, e.g. {path}.<key>")
        setattr(obj, key, convert(value, hints.get(key, Any), path, from_cli))


def parse_overrides(args: list[str]) -> dict:
    """``["--a.b", "1", "--c=2", "--flag"]`` → nested dict of strings (True for bare flags).

    Raises:
        ConfigError: an argument that is not ``--key[=value]``.
    """
    out: dict = {}
    i = 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--") or len(a) < 3:
            raise ConfigError("command line", f"expected --section.key VALUE, got {a!r}")
        key, eq, val = a[2:].partition("=")
        if not eq:
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                val = args[i + 1]
                i += 1
            else:
                val = "true"
        d = out
        parts = key.replace("-", "_").split(".")
        for p in parts[:-1]:
            d = d.setdefault(p, {})
            if not isinstance(d, dict):
                raise ConfigError(key, "set both as a value and as a table")
        d[parts[-1]] = val
        i += 1
    return out


def _post_init_all(obj, base, user: dict, path: str = "") -> None:
    """Re-run every nested config's ``__post_init__`` (torchtitan's validation) bottom-up.

    torchtitan's messages do not always name the field; the culprit is found by applying each
    user-set key of the failing section alone onto the registry default (``base``).
    """
    for name in _fields(obj):
        v = getattr(obj, name)
        if _is_config(v):
            _post_init_all(v, getattr(base, name, None), user.get(name, {}) if isinstance(user.get(name), dict) else {},
                           f"{path}{name}.")
    post = getattr(obj, "__post_init__", None)
    if post is None:
        return
    try:
        post()
    except ConfigError:
        raise
    except (ValueError, AssertionError, TypeError) as e:
        culprit = _culprit(obj, base, user)
        raise ConfigError(f"{path}{culprit}" if culprit else (path.rstrip(".") or "config"), str(e)) from None


def _culprit(obj, base, user: dict) -> str | None:
    import copy

    if base is None or type(base) is not type(obj):
        return None
    for key, val in user.items():
        if isinstance(val, dict):
            continue
        trial = copy.copy(base)
        setattr(trial, key, getattr(obj, key))
        try:
            trial.__post_init__()
        except Exception:
            return key
    return None


def to_tiered_checkpoint(ckpt):
    """The same checkpoint settings as a ``TieredCheckpointManager.Config``."""
    from titan_plugin.manager import TieredCheckpointManager

    cls = TieredCheckpointManager.Config
    if isinstance(ckpt, cls):
        return ckpt
    kw = {f.name: getattr(ckpt, f.name) for f in dataclasses.fields(ckpt)
          if f.init and f.name in {g.name for g in dataclasses.fields(cls)}}
    return cls(**kw)


def load_config(toml_path: str | None, overrides: list[str] | None = None):
    """Build the ``Trainer.Config`` from a TOML file and ``--section.key value`` overrides.

    Raises:
        ConfigError: the full key path and allowed values of the first bad key.
        FileNotFoundError: the TOML file does not exist.
    """
    data: dict = {}
    if toml_path:
        try:
            with open(toml_path, "rb") as f:
                data = tomli.load(f)
        except (tomli.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(toml_path, f"invalid TOML: {e}") from None
        except IsADirectoryError:
            raise ConfigError("--toml", f"{toml_path} is a directory, not a TOML file") from None
    cli = parse_overrides(overrides or [])
    for src in (data, cli):
        if "job" in src and not isinstance(src["job"], dict):
            raise ConfigError("job", f"must be a table with keys {', '.join(JOB_KEYS)}, got {src['job']!r}")
    job = {**data.pop("job", {}), **cli.pop("job", {})}
    for k in job:
        if k not in JOB_KEYS:
            raise ConfigError(f"job.{k}", f"unknown key; allowed: {', '.join(JOB_KEYS)}")
    for k, what in JOB_KEYS.items():
        if not isinstance(job.get(k), str) or not job[k]:
            raise ConfigError(f"job.{k}", f"required: {what}")
    reg = _registry(job["module"])
    fn = getattr(reg, job["config"], None)
    if not callable(fn):
        import inspect

        names = sorted(n for n, f in vars(reg).items() if not n.startswith("_") and inspect.isfunction(f)
                       and f.__module__ == reg.__name__)
        raise ConfigError("job.config", f"{job['config']!r} not in {reg.__name__}; allowed: {', '.join(names)}")
    config = fn()
    config.checkpoint = to_tiered_checkpoint(config.checkpoint)
    base = fn()
    base.checkpoint = to_tiered_checkpoint(base.checkpoint)
    apply_table(config, data)
    apply_table(config, cli, from_cli=True)
    _post_init_all(config, base, _merge(data, cli))
    check_tiers_early(config.checkpoint)
    return config


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def check_tiers_early(ckpt) -> None:
    """Validate the tier settings before any process group exists: the engine's whole config
    through :func:`titan_plugin.config.build_tier_config` (the function the manager builds it
    with at start-up), plus J/F against the node count when the launcher tells it (WORLD_SIZE
    with LOCAL_WORLD_SIZE or ``simulated_ranks_per_node``). A ``create_seed_checkpoint`` run
    must be one rank (WORLD_SIZE unset or 1) with checkpointing enabled; J/F do not apply to it.

    Raises:
        ConfigError: naming the ``checkpoint.*`` key and the allowed values.
    """
    from tierckpt.integration import check_replication
    from titan_plugin.config import build_tier_config, checkpoint_error

    seed = ckpt.create_seed_checkpoint
    if seed:  # as torchtitan.train.main: one process writes the unsharded model and exits
        if not ckpt.enable:
            raise ConfigError("checkpoint.create_seed_checkpoint", "needs checkpoint.enable = true")
        seed_world = os.environ.get("WORLD_SIZE", "1")
        if seed_world != "1":
            raise ConfigError("checkpoint.create_seed_checkpoint",
                              f"runs on a single rank (the model unsharded); got WORLD_SIZE={seed_world}; allowed: 1")
    if not ckpt.enable:
        return
    tcfg = build_tier_config(ckpt, ckpt.persistent_folder or ckpt.folder)
    world = int(os.environ.get("WORLD_SIZE", "0"))
    rpn = ckpt.simulated_ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if world and rpn and "local" in tcfg.tiers and not seed:  # a seed run writes no local tier
        try:
            check_replication(max(1, world // rpn), tcfg.replication_jump, tcfg.replication_factor)
        except ConfigError as e:
            raise checkpoint_error(e) from None
