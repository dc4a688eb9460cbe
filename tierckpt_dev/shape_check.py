"""Shape checks of the repository, run by ``make lint`` (``python -m tierckpt_dev.shape_check``).

Each check is a function ``check_*(root: Path) -> Check`` reading the files under ``root`` (the
repository, or a temporary tree in the tests); :data:`CHECKS` lists them in the order they run.
A :class:`Check` carries one printed line and whether it passed; a check with
``enforced=False`` only reports (a target still being worked towards). The command prints every
line and exits 1 when an enforced check failed.

Checks today:

- :func:`check_public_names`: ``tierckpt.__all__`` has at most :data:`MAX_PUBLIC` names, and in
  ``tierckpt`` and ``tierckpt.integration`` alike ``__all__``, the lazy ``_EXPORTS`` table and
  the ``if TYPE_CHECKING:`` imports name the same set (so mypy and IDEs see every export's real
  type, and nothing is exported twice);
- :func:`check_ruff_coverage`: ``make lint`` runs ruff over every package of :data:`PACKAGES`,
  no ruff ``exclude`` pattern matches a folder or file inside one, and ruff itself
  (``ruff check --show-files``) lists every ``.py`` file of every package;
- :func:`check_mypy_coverage`: ``[tool.mypy] files`` names every package, ``make lint`` runs
  mypy on that configuration, and neither mypy's ``exclude`` nor an ``ignore_errors`` override
  drops a package's module;
- :func:`check_wing_order`: every module of ``tierckpt/`` belongs to one wing of
  :data:`WING_ORDER`, and no import (module level, lazy or under ``TYPE_CHECKING``) reaches a
  wing above the importing module's own (docs/architecture.md shows the order);
- :func:`check_adapter_imports`: the framework adapters (:data:`ADAPTERS`) import tierckpt only
  through :data:`ADAPTER_SURFACE`: ``tierckpt`` (the user-facing names), ``tierckpt.integration``
  (adapter plumbing) and the documented extension points ``tierckpt.io`` (its modules too) and
  ``tierckpt.cli`` (docs/architecture.md, "Adapters");
- :func:`check_engine_size`: ``tierckpt/engine.py`` has at most :data:`ENGINE_MAX_LINES` lines
  and the engine class at most :data:`ENGINE_MAX_METHODS` methods (issue 30; a new feature gets
  its own module, not more engine); a ``property(...)`` or lambda in the class body counts as a
  method, a typed ``ReadOnly`` attribute (:mod:`tierckpt.readonly`) does not and is printed apart.

To add a check, write a ``check_*`` function returning a :class:`Check` and append it to
:data:`CHECKS`.
"""

from __future__ import annotations

import ast
import fnmatch
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]

PACKAGES = ("tierckpt", "titan_plugin", "mcore_plugin", "tierckpt_dev", "launch", "bench")
"""Every folder of Python code that ships or runs from the repository (tests/ and scripts/ are
linted by ruff too, but are not required to pass mypy)."""

MAX_PUBLIC = 16
"""Most names ``tierckpt.__all__`` may hold (issue 30: about 15 user-facing names)."""

ENGINE_MAX_LINES = 400
ENGINE_MAX_METHODS = 20
ENGINE_FILE = "tierckpt/engine.py"
ENGINE_CLASS = "TieredCheckpointer"

LAZY_MODULES = ("tierckpt/__init__.py", "tierckpt/integration.py")

ADAPTERS = ("titan_plugin", "mcore_plugin")
"""The framework adapters: packages that build on the engine through its documented surface."""

ADAPTER_SURFACE: tuple[tuple[str, bool], ...] = (
    ("tierckpt", False), ("tierckpt.integration", False), ("tierckpt.io", True), ("tierckpt.cli", False))
"""What an adapter may import of tierckpt: ``(module, its submodules too)``. Everything else of
``tierckpt/`` is internal to the engine (docs/architecture.md, "Adapters")."""

WING_ORDER: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("errors", "validators", "records", "priors", "handle", "preemption", "loader_signals", "gcpause",
              "_lazy", "readonly", "priority", "clock")),
    ("cluster", ("cluster",)),
    ("io", ("io",)),
    ("config", ("config",)),
    ("sched", ("sched",)),
    ("staging", ("staging",)),
    ("transport", ("transport",)),
    ("history", ("history",)),
    ("tiers", ("tiers",)),
    ("restore", ("restore",)),
    ("recovery", ("recovery",)),
    ("cli", ("cli",)),
    ("top", ("metrics", "startup", "exit", "engine", "integration", "launch", "__init__")),
)
"""The wings of ``tierckpt/``, lowest first (issue 30: the order a save flows through them): each
entry names a wing and the first component under ``tierckpt.`` of its modules (a subpackage, or a
top-level module). A module imports only its own wing and the wings listed before it; ``top`` (the
engine, its start and exit, the package's lazy exports and the adapters' integration surface)
may import any wing."""


@dataclass
class Check:
    """One check's outcome: ``line`` is printed; ``ok`` False fails ``make lint`` unless the
    check only reports (``enforced`` False)."""

    name: str
    ok: bool
    line: str
    enforced: bool = True

    def render(self) -> str:
        tag = "ok" if self.ok else ("FAIL" if self.enforced else "over target (report only)")
        return f"shape: {self.name}: {tag}: {self.line}"


# -- helpers -----------------------------------------------------------------------------------
def _pyproject(root: Path) -> dict:
    with open(root / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _lint_recipe(root: Path) -> list[str]:
    """The command lines of the Makefile's ``lint`` target (tab-indented lines after
    ``lint:``), with make's ``$(VAR)`` references left as they are."""
    lines = (root / "Makefile").read_text().splitlines()
    out: list[str] = []
    inside = False
    for line in lines:
        if re.match(r"^lint\s*:", line):
            inside = True
            continue
        if inside:
            if line.startswith("\t"):
                out.append(line.strip())
            elif line.strip() and not line.startswith("#"):
                break
    return out


def _tool_args(recipe: list[str], tool: list[str]) -> list[str] | None:
    """The arguments after ``tool`` (e.g. ``["-m", "ruff", "check"]``) on the first recipe line
    that runs it; None when no line does."""
    for line in recipe:
        words = shlex.split(line)
        for i in range(len(words) - len(tool) + 1):
            if words[i:i + len(tool)] == tool:
                return words[i + len(tool):]
    return None


def _covers(paths: list[str], package: str) -> bool:
    """Whether the path arguments ``paths`` include ``package`` (itself or a folder above)."""
    for p in paths:
        p = p.rstrip("/") or "."
        if p in (".", "./") or p == package or package.startswith(p + "/"):
            return True
    return False


def _package_files(root: Path, package: str) -> list[Path]:
    """The ``.py`` files of ``package``: in a git work tree the tracked ones and the untracked
    ones git does not ignore (outputs a test or demo left inside a package are not source);
    elsewhere every ``.py`` file outside ``__pycache__``."""
    r = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", f"{package}/"],
                       cwd=root, capture_output=True, text=True)
    inside_git = r.returncode == 0 and subprocess.run(
        ["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True, text=True).stdout.strip() == str(
        root.resolve())
    if inside_git:
        return sorted({root / line for line in r.stdout.splitlines() if line.endswith(".py") and (root / line).is_file()})
    return sorted(p for p in (root / package).rglob("*.py") if "__pycache__" not in p.parts)


def _package_paths(root: Path, package: str) -> list[str]:
    """The package folder, its ``.py`` files and every folder holding one, relative to
    ``root`` (posix): what a ruff ``exclude`` pattern must not match."""
    out = {package}
    for f in _package_files(root, package):
        rel = f.relative_to(root)
        out.add(rel.as_posix())
        out |= {p.as_posix() for p in rel.parents if p.as_posix() not in (".", "")}
    return sorted(out)


def _ruff_pattern_hits(pattern: str, rel: str) -> bool:
    """Whether a ruff ``exclude`` pattern matches ``rel`` (a path relative to the project root):
    ruff matches a pattern against the full path and against each file or folder name."""
    pattern = pattern.rstrip("/")
    parts = rel.split("/")
    return (fnmatch.fnmatchcase(rel, pattern) or fnmatch.fnmatchcase(rel, pattern + "/*")
            or any(fnmatch.fnmatchcase(part, pattern) for part in parts))


# -- checks ------------------------------------------------------------------------------------
def _lazy_module_names(path: Path) -> tuple[list[str] | None, set[str] | None, set[str]]:
    """``(__all__, _EXPORTS keys, names imported under if TYPE_CHECKING:)`` of a lazily
    exporting module; None for a part that is missing or not a literal."""
    tree = ast.parse(path.read_text())
    all_: list[str] | None = None
    exports: set[str] | None = None
    typed: set[str] = set()
    all_from_exports = False
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = {t.id for t in targets if isinstance(t, ast.Name)}
            value = node.value
            if "__all__" in names and isinstance(value, (ast.List, ast.Tuple)):
                if all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in value.elts):
                    all_ = [e.value for e in value.elts]  # type: ignore[attr-defined]
            if "__all__" in names and isinstance(value, ast.Call) and ast.unparse(value) == "sorted(_EXPORTS)":
                all_from_exports = True
            if "_EXPORTS" in names and isinstance(value, ast.Dict):
                if all(isinstance(k, ast.Constant) for k in value.keys):
                    exports = {k.value for k in value.keys}  # type: ignore[union-attr]
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for sub in node.body:
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    typed |= {a.asname or a.name.split(".")[-1] for a in sub.names}
    if all_from_exports and exports is not None:
        all_ = sorted(exports)
    return all_, exports, typed


def check_public_names(root: Path) -> Check:
    """``tierckpt.__all__`` ≤ :data:`MAX_PUBLIC` names; in each module of :data:`LAZY_MODULES`,
    ``__all__`` == ``_EXPORTS`` keys == the ``TYPE_CHECKING`` imports; no name in both."""
    problems: list[str] = []
    seen: dict[str, list[str]] = {}
    for rel in LAZY_MODULES:
        path = root / rel
        if not path.is_file():
            problems.append(f"{rel} is missing")
            continue
        all_, exports, typed = _lazy_module_names(path)
        if all_ is None:
            problems.append(f"{rel}: __all__ is not a literal list of names")
            continue
        seen[rel] = all_
        if len(set(all_)) != len(all_):
            problems.append(f"{rel}: __all__ lists a name twice")
        if exports is None or exports != set(all_):
            diff = sorted(set(all_) ^ (exports or set()))
            problems.append(f"{rel}: __all__ and _EXPORTS differ ({', '.join(diff) or '_EXPORTS missing'})")
        if typed != set(all_):
            untyped, extra = sorted(set(all_) - typed), sorted(typed - set(all_))
            problems.append(f"{rel}: the TYPE_CHECKING imports differ from __all__ (missing: "
                            f"{', '.join(untyped) or '-'}; not exported: {', '.join(extra) or '-'})")
    public = seen.get(LAZY_MODULES[0], [])
    if len(public) > MAX_PUBLIC:
        problems.append(f"tierckpt.__all__ has {len(public)} names, at most {MAX_PUBLIC} allowed")
    both = sorted(set(public) & set(seen.get(LAZY_MODULES[1], [])))
    if both:
        problems.append(f"exported by tierckpt and tierckpt.integration: {', '.join(both)}")
    counts = ", ".join(f"{rel.removesuffix('.py').removesuffix('/__init__').replace('/', '.')} "
                       f"{len(names)}" for rel, names in seen.items())
    line = f"{counts or 'none'} (tierckpt ≤ {MAX_PUBLIC}), each typed under TYPE_CHECKING"
    return Check("public names", not problems, line + ("" if not problems else "; " + "; ".join(problems)))


def check_ruff_coverage(root: Path, ruff: list[str] | None = None) -> Check:
    """``make lint``'s ruff call names every package, no ``exclude`` pattern of
    ``[tool.ruff]`` matches inside one, and ``ruff check --show-files`` lists every file.

    Args:
        ruff: the command that runs ruff (default: this interpreter's ``-m ruff``).
    """
    problems: list[str] = []
    args = _tool_args(_lint_recipe(root), ["-m", "ruff", "check"])
    if args is None:
        args = _tool_args(_lint_recipe(root), ["ruff", "check"])
    paths = [a for a in args or [] if not a.startswith("-")]
    if args is None:
        problems.append("the Makefile's lint target does not run `ruff check`")
    else:
        missing = [p for p in PACKAGES if not _covers(paths, p)]
        if missing:
            problems.append(f"make lint's ruff call leaves out {', '.join(missing)}")
    cfg = _pyproject(root).get("tool", {}).get("ruff", {})
    if "exclude" not in cfg:
        # ruff's default exclude holds generic names ("dist", "build", "venv", ...) that match
        # package folders; the project overrides it
        problems.append("[tool.ruff] keeps ruff's default `exclude` (it skips any folder named dist, "
                        "_build, venv, ...): set `exclude` explicitly")
    patterns = list(cfg.get("exclude", [])) + list(cfg.get("extend-exclude", []))
    for pkg in PACKAGES:
        if not (root / pkg).is_dir():
            problems.append(f"package folder {pkg}/ is missing")
            continue
        hits = sorted({f"{rel} ({pat!r})" for rel in _package_paths(root, pkg) for pat in patterns
                       if _ruff_pattern_hits(pat, rel)})
        if hits:
            problems.append(f"ruff excludes {', '.join(hits[:5])}{' …' if len(hits) > 5 else ''}")
    checked = 0
    if paths:
        cmd = (ruff or [sys.executable, "-m", "ruff"]) + ["check", "--show-files", *paths]
        r = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            problems.append(f"`{' '.join(cmd)}` failed: {r.stderr.strip()[-300:]}")
        else:
            listed = {Path(line.strip()).resolve() for line in r.stdout.splitlines() if line.strip()}
            for pkg in PACKAGES:
                files = _package_files(root, pkg)
                checked += len(files)
                unlisted = [f.relative_to(root).as_posix() for f in files if f.resolve() not in listed]
                if unlisted:
                    problems.append(f"ruff does not lint {', '.join(unlisted[:5])}"
                                    f"{f' and {len(unlisted) - 5} more' if len(unlisted) > 5 else ''}")
    line = f"{len(PACKAGES)} packages ({', '.join(PACKAGES)}), {checked} files, each listed by `ruff --show-files`"
    return Check("ruff coverage", not problems, line + ("" if not problems else "; " + "; ".join(problems)))


def check_mypy_coverage(root: Path) -> Check:
    """``[tool.mypy] files`` names every package, ``make lint`` runs mypy on that
    configuration (or names every package itself), and no ``exclude`` regex or
    ``ignore_errors`` override drops a package's module."""
    problems: list[str] = []
    cfg = _pyproject(root).get("tool", {}).get("mypy", {})
    files = cfg.get("files", [])
    files = [f.strip() for f in files.split(",")] if isinstance(files, str) else list(files)
    args = _tool_args(_lint_recipe(root), ["-m", "mypy"])
    if args is None:
        args = _tool_args(_lint_recipe(root), ["mypy"])
    if args is None:
        problems.append("the Makefile's lint target does not run mypy")
        targets = files
    else:
        cli_paths = [a for a in args if not a.startswith("-")]
        targets = cli_paths or files  # paths on the command line replace the config's `files`
    missing = [p for p in PACKAGES if not _covers(targets, p)]
    if missing:
        problems.append(f"mypy does not check {', '.join(missing)} (pyproject [tool.mypy] files: {files})")
    excludes = cfg.get("exclude", [])
    excludes = [excludes] if isinstance(excludes, str) else list(excludes)
    for pkg in PACKAGES:
        if not (root / pkg).is_dir():
            continue
        for f in _package_files(root, pkg):
            rel = f.relative_to(root).as_posix()
            hit = next((x for x in excludes if re.search(x, rel)), None)
            if hit is not None:
                problems.append(f"mypy's exclude {hit!r} drops {rel}")
                break
    for ov in cfg.get("overrides", []):
        mods = ov.get("module", [])
        mods = [mods] if isinstance(mods, str) else list(mods)
        if ov.get("ignore_errors") or ov.get("follow_imports") == "skip":
            ours = [m for m in mods if m.split(".")[0].rstrip("*") in PACKAGES or m in ("*",)]
            if ours:
                problems.append(f"a mypy override silences {', '.join(ours)} (ignore_errors / follow_imports=skip)")
    line = f"{len(PACKAGES) - len(missing)}/{len(PACKAGES)} packages in mypy's files, none excluded or silenced"
    return Check("mypy coverage", not problems, line + ("" if not problems else "; " + "; ".join(problems)))


def _adapter_import_allowed(module: str) -> bool:
    """Whether an adapter may import ``module`` (dotted; any module outside ``tierckpt``)."""
    if module != "tierckpt" and not module.startswith("tierckpt."):
        return True
    return any(module == m or (subs and module.startswith(m + ".")) for m, subs in ADAPTER_SURFACE)


def check_adapter_imports(root: Path) -> Check:
    """Every import statement of :data:`ADAPTERS` (module level, lazy or under
    ``TYPE_CHECKING``) that reaches ``tierckpt`` names a module of :data:`ADAPTER_SURFACE`
    (``from tierckpt.io import layout`` and ``from tierckpt import TierConfig`` are fine;
    ``from tierckpt.config import RULES`` is not, :mod:`tierckpt.integration` exports it, nor is
    ``from tierckpt import startup``, a module)."""
    problems: list[str] = []
    count = 0
    known = set(_tierckpt_modules(root)) if (root / "tierckpt").is_dir() else set()
    for pkg in ADAPTERS:
        if not (root / pkg).is_dir():
            problems.append(f"adapter folder {pkg}/ is missing")
            continue
        for f in _package_files(root, pkg):
            rel = f.relative_to(root).as_posix()
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.Import):
                    mods = [(a.name, node.lineno) for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    # `from tierckpt import startup` reaches the module tierckpt.startup
                    subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known]
                    mods = [(m, node.lineno) for m in subs or [node.module]]
                else:
                    continue
                for mod, lineno in mods:
                    if mod.split(".")[0] != "tierckpt":
                        continue
                    count += 1
                    if not _adapter_import_allowed(mod):
                        problems.append(f"{rel}:{lineno} imports {mod}")
    surface = ", ".join(m + (".*" if subs else "") for m, subs in ADAPTER_SURFACE)
    line = f"{', '.join(ADAPTERS)} import tierckpt only through {surface}; {count} imports, {len(problems)} outside"
    return Check("adapter imports", not problems, line + ("" if not problems else "; " + "; ".join(problems[:8])
                                                         + (" …" if len(problems) > 8 else "")))


READONLY_DESCRIPTOR = "ReadOnly"
"""The class of a typed read-only attribute (:class:`tierckpt.readonly.ReadOnly`): a class-level
``name: ReadOnly[T] = ReadOnly(...)`` is an attribute, not a method."""


def _class_members(cls: ast.ClassDef) -> tuple[list[str], list[str]]:
    """``(methods, read-only attributes)`` of a class body, by name.

    A method is a ``def`` (properties and dunders included) or a class-level assignment whose
    value is, or holds, a lambda or a call of anything but :data:`READONLY_DESCRIPTOR`
    (``x = property(lambda self: ...)``, ``a, b = helper("a"), helper("b")``: each name counts,
    since the call may make a property or a function). A read-only attribute is an assignment
    of a ``ReadOnly(...)`` call. Plain constants count as neither."""
    methods: list[str] = []
    readonly: list[str] = []
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            methods.append(node.name)
            continue
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        values = list(value.elts) if isinstance(value, ast.Tuple) else [value]
        per_name = len(values) == len(names)
        for i, name in enumerate(names):
            part = values[i] if per_name else value
            calls = [n for n in ast.walk(part) if isinstance(n, ast.Call)]
            if isinstance(part, ast.Call) and ast.unparse(part.func).split(".")[-1] == READONLY_DESCRIPTOR \
                    and not any(isinstance(n, ast.Lambda) for n in ast.walk(part)) and len(calls) == 1:
                readonly.append(name)
            elif calls or any(isinstance(n, ast.Lambda) for n in ast.walk(part)):
                methods.append(name)
    return methods, readonly


def check_engine_size(root: Path) -> Check:
    """``tierckpt/engine.py``'s line count ≤ :data:`ENGINE_MAX_LINES` and the number of methods of
    :data:`ENGINE_CLASS` ≤ :data:`ENGINE_MAX_METHODS` (:func:`_class_members`: every ``def``,
    and every class-level lambda or call that may make a property or function; its ``ReadOnly``
    attributes are counted and printed apart)."""
    path = root / ENGINE_FILE
    if not path.is_file():
        return Check("engine size", False, f"{ENGINE_FILE} is missing")
    text = path.read_text()
    lines = len(text.splitlines())
    methods: list[str] = []
    readonly: list[str] = []
    for node in ast.parse(text).body:
        if isinstance(node, ast.ClassDef) and node.name == ENGINE_CLASS:
            methods, readonly = _class_members(node)
    ok = lines <= ENGINE_MAX_LINES and len(methods) <= ENGINE_MAX_METHODS
    return Check("engine size", ok, f"{ENGINE_FILE}: {lines} lines (≤ {ENGINE_MAX_LINES}), "
                 f"{ENGINE_CLASS}: {len(methods)} methods (≤ {ENGINE_MAX_METHODS}), "
                 f"{len(readonly)} read-only attributes ({READONLY_DESCRIPTOR}, not methods)")


def _wing_of(module: str) -> str | None:
    """The wing of :data:`WING_ORDER` holding ``module`` (dotted, ``tierckpt`` itself: ``top``)."""
    first = module.split(".")[1] if "." in module else "__init__"
    return next((wing for wing, members in WING_ORDER if first in members), None)


def _tierckpt_modules(root: Path) -> dict[str, Path]:
    """``{dotted module name: file}`` of every module under ``root/tierckpt``."""
    out: dict[str, Path] = {}
    for f in _package_files(root, "tierckpt"):
        parts = list(f.relative_to(root).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _imported(module: str, is_package: bool, node: ast.AST, known: set[str]) -> list[str]:
    """The ``tierckpt`` modules an import statement ``node`` of ``module`` reaches (relative
    imports resolved; ``from pkg import name`` reaches ``pkg.name`` when that is a module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "tierckpt"]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target.split(".")[0] != "tierckpt":
        return []
    subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
    # `from tierckpt import startup` reaches the module, not the package's lazy exports
    return subs if subs and len(subs) == len(node.names) else [target] + subs


def check_wing_order(root: Path) -> Check:
    """Every ``tierckpt`` module is in a wing of :data:`WING_ORDER` and imports no wing above its
    own (any import statement: module level, inside a function, under ``TYPE_CHECKING``)."""
    modules = _tierckpt_modules(root)
    rank = {wing: i for i, (wing, _) in enumerate(WING_ORDER)}
    problems: list[str] = []
    edges = 0
    for name, path in sorted(modules.items()):
        wing = _wing_of(name)
        if wing is None:
            problems.append(f"{name} is in no wing (add it to WING_ORDER in tierckpt_dev/shape_check.py)")
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            for target in _imported(name, path.name == "__init__.py", node, set(modules)):
                other = _wing_of(target)
                if other is None or other == wing:
                    continue
                edges += 1
                if rank[other] > rank[wing]:
                    problems.append(f"{name} ({wing}) imports {target} ({other}, above)")
    order = " < ".join(wing for wing, _ in WING_ORDER)
    line = f"{order}; {len(modules)} modules, {edges} imports across wings, {len(problems)} upward"
    return Check("wing order", not problems, line + ("" if not problems else "; " + "; ".join(problems[:8])
                                                     + (" …" if len(problems) > 8 else "")))


CHECKS: list[Callable[[Path], Check]] = [check_public_names, check_ruff_coverage, check_mypy_coverage,
                                         check_wing_order, check_adapter_imports, check_engine_size]


def run(root: Path = REPO) -> tuple[int, list[Check]]:
    """Run :data:`CHECKS` on ``root``; ``(exit status, results)``: 1 when an enforced check failed."""
    results = [c(root) for c in CHECKS]
    return int(any(not r.ok and r.enforced for r in results)), results


def main(argv: list[str] | None = None) -> int:
    """``python -m tierckpt_dev.shape_check [ROOT]``: print every check's line; exit 1 on a
    failed enforced check."""
    argv = sys.argv[1:] if argv is None else argv
    root = Path(argv[0]).resolve() if argv else REPO
    status, results = run(root)
    for r in results:
        print(r.render(), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
