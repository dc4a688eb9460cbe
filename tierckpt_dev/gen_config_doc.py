"""Generate docs/configuration.md from the configuration's own source, so it cannot drift.

Sources, read at generation time:

- :class:`tierckpt.config.TierConfig` and :class:`tierckpt.config.ScheduleOptions`: every
  dataclass field (name, annotation, default), its entry in the class docstring's
  ``Attributes:`` section and the ``# comment`` on its line;
- the torchtitan ``[checkpoint]`` keys: the fields of ``TieredCheckpointManager.Config`` in
  ``titan_plugin/manager.py`` with their attribute docstrings (read with :mod:`ast`, so
  torchtitan is not imported), and the field → key renames of ``titan_plugin.config``;
- the Megatron ``--ckpt-plugin-*`` flags: the argparse group that
  ``mcore_plugin.args.add_plugin_args`` builds (flag, default, help) and its field → flag renames.

Usage (from the repository root)::

    python -m tierckpt_dev.gen_config_doc            # rewrite docs/configuration.md
    python -m tierckpt_dev.gen_config_doc --check    # exit 1 when the file is out of date

``tests/test_config_doc.py`` fails when the committed file differs from :func:`render`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import os
import re
import sys
from collections.abc import Callable, Mapping

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC_PATH = os.path.join(REPO, "docs", "configuration.md")
MANAGER_PY = os.path.join(REPO, "titan_plugin", "manager.py")
GENERATOR = "tierckpt_dev/gen_config_doc.py"

UNDOCUMENTED = "(undocumented)"
"""Text written for a field without a docstring entry; :func:`undocumented` lists them."""


# -- TierConfig / ScheduleOptions --------------------------------------------------------------


def attribute_docs(cls: type) -> dict[str, str]:
    """The ``Attributes:`` section of ``cls``'s docstring as ``{field: text}``.

    An entry is ``name: text`` (or ``a, b: text``, shared by both names) at the section's first
    indentation; deeper-indented lines continue it. The section ends at the first non-empty line
    indented no deeper than the ``Attributes:`` heading. Lines are joined with single spaces.
    """
    doc = inspect.getdoc(cls) or ""
    out: dict[str, str] = {}
    lines = doc.splitlines()
    try:
        start = next(i for i, ln in enumerate(lines) if ln.strip() == "Attributes:")
    except StopIteration:
        return out
    head_indent = len(lines[start]) - len(lines[start].lstrip())
    entry_indent = None
    names: list[str] = []
    for ln in lines[start + 1:]:
        if not ln.strip():
            continue
        indent = len(ln) - len(ln.lstrip())
        if indent <= head_indent:
            break
        if entry_indent is None:
            entry_indent = indent
        m = re.match(r"([A-Za-z_][\w]*(?:\s*,\s*[A-Za-z_][\w]*)*)\s*:(?:\s+(.*))?$", ln.strip())
        if indent == entry_indent and m:
            names = [n.strip() for n in m.group(1).split(",")]
            for n in names:
                out[n] = (m.group(2) or "").strip()
        elif names:
            for n in names:
                out[n] = (out[n] + " " + ln.strip()).strip()
    return out


def line_comments(cls: type) -> dict[str, str]:
    """``{field: comment}`` for the fields of ``cls`` whose definition line ends in ``# comment``."""
    out: dict[str, str] = {}
    try:
        src = inspect.getsource(cls)
    except (OSError, TypeError):
        return out
    for ln in src.splitlines():
        m = re.match(r"\s+([A-Za-z_]\w*)\s*:[^#]*#\s*(.+)$", ln)
        if m:
            out[m.group(1)] = m.group(2).strip()
    return out


def _type_name(f: dataclasses.Field) -> str:
    t = f.type
    return t if isinstance(t, str) else getattr(t, "__name__", repr(t))


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        return f"`{type(value).__name__}()`"
    if isinstance(value, Mapping):
        value = dict(value)
    if isinstance(value, float) and value >= 86400:
        return f"`{value!r}` (≈ {value / 3600:,.0f} h)"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"`{value}` ({value >> 30} GiB)" if value % (1 << 30) == 0 else f"`{value}` ({value >> 20} MiB)"
    return f"`{value!r}`"


def md(text: str) -> str:
    """A docstring's reStructuredText markup as Markdown: double backticks become single ones, a
    Sphinx role becomes code (its last name after a ``~``, else the whole target)."""
    text = re.sub(r":[a-z]+:`~(?:[\w.]*\.)?([^`]+)`", r"`\1`", text)
    text = re.sub(r":[a-z]+:`([^`]+)`", r"`\1`", text)
    return re.sub(r"``([^`]+)``", r"`\1`", text)


def _cell(text: str) -> str:
    """``text`` safe inside a Markdown table cell (one line, pipes escaped, RST roles as code)."""
    return md(" ".join(text.split())).replace("|", "\\|")


@dataclasses.dataclass
class FieldDoc:
    """One configuration field as documented: ``name`` (``schedule.x`` for ScheduleOptions),
    annotation, default (Markdown), description, the torchtitan key and the Megatron flag
    (``—`` when none sets it)."""

    name: str
    type: str
    default: str
    text: str
    toml: str
    flag: str


def field_docs(cls: type, prefix: str, toml_of: Callable[[str], str], flag_of: Callable[[str], str]) -> list[FieldDoc]:
    """Every init field of the dataclass ``cls`` with its docs and mappings, in definition order."""
    docs, comments = attribute_docs(cls), line_comments(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        # the line comment only stands in for a missing docstring entry: where both exist the
        # comment is a terser repeat of the docstring
        text = docs.get(f.name) or comments.get(f.name, "")
        out.append(FieldDoc(prefix + f.name, _type_name(f), _default(f), text or UNDOCUMENTED,
                            toml_of(f.name), flag_of(f.name)))
    return out


# -- torchtitan [checkpoint] keys --------------------------------------------------------------


@dataclasses.dataclass
class TomlKey:
    """A ``[checkpoint]`` key the plugin adds: name, default (source text) and its docstring."""

    name: str
    default: str
    text: str


def titan_keys(path: str = MANAGER_PY) -> list[TomlKey]:
    """The fields ``TieredCheckpointManager.Config`` adds to torchtitan's checkpoint config, read
    from the source with :mod:`ast` (each annotated field and the string literal after it)."""
    with open(path) as f:
        src = f.read()
    tree = ast.parse(src)
    out: list[TomlKey] = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.ClassDef) and node.name == "TieredCheckpointManager"):
            continue
        for inner in node.body:
            if not (isinstance(inner, ast.ClassDef) and inner.name == "Config"):
                continue
            body = inner.body
            for i, stmt in enumerate(body):
                if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                    continue
                default = ast.get_source_segment(src, stmt.value) if stmt.value is not None else "required"
                m = re.fullmatch(r"field\(default_factory=(?:lambda:\s*)?(.*)\)", default or "", re.S)
                if m:
                    default = "[]" if m.group(1) == "list" else m.group(1)
                nxt = body[i + 1] if i + 1 < len(body) else None
                text = ""
                if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                    text = inspect.cleandoc(nxt.value.value)
                out.append(TomlKey(stmt.target.id, default or "", text or UNDOCUMENTED))
    return out


def _titan_renames() -> dict[str, str]:
    try:
        from titan_plugin import config as tc
    except ImportError:
        return {}
    return dict(getattr(tc, "_KEY_OF_FIELD", {}))


def _mapped(field: str, renames: Mapping[str, str], exists: Callable[[str], bool], fmt: Callable[[str], str]) -> str:
    """How a front-end sets ``field``: its own rename, the renames of its mapping entries
    (``keep_latest_k.local``), or the same name when the front-end has it; ``—`` otherwise."""
    subs = sorted((k.split(".", 1)[1], v) for k, v in renames.items() if k.startswith(field + "."))
    if subs:
        text = ", ".join(f"{sub}: {fmt(v)}" for sub, v in subs)
        if field in renames and renames[field] not in (v for _, v in subs):
            text += f"; other tiers: {fmt(renames[field])}"
        return text
    if field in renames:
        return fmt(renames[field])
    for name in (field, field.removesuffix("_s")):
        if exists(name):
            return fmt(name)
    return "—"


# -- Megatron --ckpt-plugin-* flags ------------------------------------------------------------


@dataclasses.dataclass
class Flag:
    """A Megatron-LM flag of the plugin's argument group: flag, metavar/choices, help."""

    flag: str
    value: str
    help: str


def megatron_flags() -> list[Flag]:
    """The ``--ckpt-plugin-*`` flags, as ``mcore_plugin.args.add_plugin_args`` adds them to an
    empty parser (empty when the module cannot be imported)."""
    try:
        from mcore_plugin.args import add_plugin_args
    except ImportError:
        return []
    parser = add_plugin_args(argparse.ArgumentParser(add_help=False))
    out = []
    for action in parser._actions:  # the documented way to list them has no public accessor
        if not action.option_strings:
            continue
        flag = max(action.option_strings, key=len)
        if action.choices:
            value = " | ".join(str(c) for c in action.choices)
            if action.nargs == "+":
                value += " (one or more)"
        elif action.nargs == 0:
            value = "(switch)"
        else:
            value = str(action.metavar or action.dest.upper())
        text = (action.help or UNDOCUMENTED).replace("%(default)s", str(action.default)).replace("%%", "%")
        out.append(Flag(flag, value, text))
    return out


def _megatron_renames() -> dict[str, str]:
    try:
        from mcore_plugin import args as ma
    except ImportError:
        return {}
    return dict(getattr(ma, "_FIELD_TO_FLAG", {}))


# -- the document ------------------------------------------------------------------------------


def _config_classes():
    from tierckpt.config import ScheduleOptions, TierConfig

    return TierConfig, ScheduleOptions


def collect() -> tuple[list[FieldDoc], list[TomlKey], list[Flag]]:
    """The documented fields of TierConfig then ScheduleOptions (``schedule.*``), the torchtitan
    keys and the Megatron flags."""
    tier_config, schedule_options = _config_classes()
    keys = titan_keys()
    key_names = {k.name for k in keys}
    flags = megatron_flags()
    flag_names = {f.flag for f in flags}
    t_ren, m_ren = _titan_renames(), _megatron_renames()

    def toml_of(name: str) -> str:
        return _mapped(name, t_ren, lambda n: n in key_names, lambda k: f"`checkpoint.{k}`")

    def flag_of(name: str) -> str:
        return _mapped(name, m_ren, lambda n: f"--ckpt-plugin-{n.replace('_', '-')}" in flag_names,
                       lambda v: f"`{v}`" if v.startswith("--") else f"`--ckpt-plugin-{v.replace('_', '-')}`")

    fields = field_docs(tier_config, "", toml_of, flag_of)
    fields += field_docs(schedule_options, "schedule.", toml_of, flag_of)
    return fields, keys, flags


def undocumented() -> list[str]:
    """Names of fields, keys and flags that have no documentation text in the source."""
    fields, keys, flags = collect()
    return ([f.name for f in fields if f.text == UNDOCUMENTED] + [f"checkpoint.{k.name}" for k in keys if k.text == UNDOCUMENTED]
            + [f.flag for f in flags if f.help == UNDOCUMENTED])


def render() -> str:
    """The whole text of docs/configuration.md."""
    fields, keys, flags = collect()
    w: list[str] = [
        "# Configuration reference",
        "",
        f"<!-- GENERATED by `python -m tierckpt_dev.gen_config_doc` from {GENERATOR}: do not edit by hand. -->",
        "",
        "Generated from the source: the fields of `tierckpt.config.TierConfig` and",
        "`tierckpt.config.ScheduleOptions` with their docstrings, the torchtitan `[checkpoint]` keys",
        "of `titan_plugin/manager.py` and the Megatron `--ckpt-plugin-*` flags of",
        "`mcore_plugin/args.py`. Regenerate with `python -m tierckpt_dev.gen_config_doc` after changing",
        "any of them; `tests/test_config_doc.py` fails while this file is out of date.",
        "",
        "`TierConfig` is frozen and validated when it is built (`cfg.replace(...)` validates the copy):",
        "a bad value raises `ConfigError` naming the field (`keep_latest_k.local` for a mapping entry)",
        "and the allowed values; an unknown field name is refused the same way. Every rank rejects a",
        "bad config before any collective. Examples: `tiers` names an unknown tier;",
        "`keep_latest_k.local` is negative; `replication_factor` exceeds the node count (checked once",
        "the topology is known); `local_root` is not writable. The torchtitan front-end renames the",
        "error to the `checkpoint.*` key (exit 2 before any process group exists), the Megatron",
        "launcher to the flag.",
        "",
        "## TierConfig and ScheduleOptions",
        "",
        "`schedule.*` are the fields of `ScheduleOptions` (`TierConfig(schedule=ScheduleOptions(...))`).",
        "The last two columns say which torchtitan key and which Megatron flag set the field (— = none).",
        "",
        "| field | type | default | meaning | torchtitan | Megatron |",
        "|---|---|---|---|---|---|",
    ]
    for f in fields:
        w.append(f"| `{f.name}` | `{_cell(f.type)}` | {_cell(f.default)} | {_cell(f.text)} | {_cell(f.toml)} | {_cell(f.flag)} |")
    w += [
        "",
        "## torchtitan: `[checkpoint]` keys added by the plugin",
        "",
        "torchtitan's own checkpoint keys keep their meaning (`interval` and `keep_latest_k` are the",
        "persistent tier's). Set them in the TOML file (`python -m titan_plugin.train --toml FILE`) or",
        "on the command line (`--checkpoint.key value`, which wins over the file).",
        "",
        "| key | default | meaning |",
        "|---|---|---|",
    ]
    for k in keys:
        w.append(f"| `{k.name}` | `{_cell(k.default)}` | {_cell(k.text)} |")
    w += [
        "",
        "## Megatron-LM: `--ckpt-plugin-*` flags",
        "",
        "Added to Megatron's parser by `python -m mcore_plugin.pretrain` (details and Megatron's own",
        "flags that the plugin reads: [mcore_plugin/README.md](../mcore_plugin/README.md)).",
        "",
        "| flag | value | meaning |",
        "|---|---|---|",
    ]
    for fl in flags:
        w.append(f"| `{fl.flag}` | {_cell(fl.value)} | {_cell(fl.help)} |")
    return "\n".join(w) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write docs/configuration.md, or with ``--check`` compare it; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when the file differs from the generated text")
    ap.add_argument("--out", default=DOC_PATH, help="output path (default: docs/configuration.md)")
    a = ap.parse_args(argv)
    text = render()
    if a.check:
        try:
            with open(a.out) as f:
                same = f.read() == text
        except FileNotFoundError:
            same = False
        if not same:
            print(f"{a.out} is out of date: run python -m tierckpt_dev.gen_config_doc", file=sys.stderr)
        return 0 if same else 1
    with open(a.out, "w") as f:
        f.write(text)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
