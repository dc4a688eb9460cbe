"""tierckpt_dev/shape_check.py (run by ``make lint``): it passes on the repository and fails on
each kind of bad input, checked on a small copy of the repository's lint configuration."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tierckpt_dev import shape_check as sc

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A minimal repository: the real pyproject.toml, Makefile and lazy-export modules, one
    file per package (``tierckpt``'s is ``errors.py``, a module of the lowest wing), and a
    ``launch/dist/`` folder (a name ruff's default exclude skips: it skipped ``tierckpt/dist/``,
    renamed ``tierckpt/cluster/`` since; the check still guards any package folder so named)."""
    for name in ("pyproject.toml", "Makefile"):
        shutil.copy(REPO / name, tmp_path / name)
    for pkg in sc.PACKAGES + ("tests", "scripts"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / ("errors.py" if pkg == "tierckpt" else "mod.py")).write_text("X = 1\n")
    for rel in sc.LAZY_MODULES:
        shutil.copy(REPO / rel, tmp_path / rel)
    (tmp_path / "launch" / "dist").mkdir()
    (tmp_path / "launch" / "dist" / "collectives.py").write_text("Y = 2\n")
    (tmp_path / "tierckpt" / "engine.py").write_text("class TieredCheckpointer:\n    def save(self):\n        pass\n")
    return tmp_path


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, 1))


def _failed(root: Path) -> dict[str, str]:
    status, results = sc.run(root)
    failed = {r.name: r.line for r in results if not r.ok and r.enforced}
    assert status == int(bool(failed))
    return failed


def test_the_repository_passes_and_prints_one_line_per_check(capsys):
    assert sc.main([str(REPO)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [ln.split(":")[1].strip() for ln in out] == ["public names", "ruff coverage", "mypy coverage",
                                                         "wing order", "adapter imports", "engine size"]
    assert re.search(r"public names: ok: tierckpt (\d+),", out[0]) and int(
        re.search(r"tierckpt (\d+),", out[0]).group(1)) <= sc.MAX_PUBLIC
    assert "6/6 packages" in out[2]
    assert "base < cluster < io < config < sched < staging < transport < history < tiers < restore" in out[3]
    assert out[3].endswith(", 0 upward"), out[3]
    assert out[4].endswith(", 0 outside"), out[4]
    assert "read-only attributes" in out[5], out[5]


def test_the_minimal_tree_passes(tree):
    assert _failed(tree) == {}


def test_ruff_default_exclude_fails_on_a_dist_folder(tree):
    """Without its own `exclude`, ruff skips every folder named dist: launch/dist/ unlinted."""
    _edit(tree / "pyproject.toml", '\nexclude = [".git",', '\nextend-exclude = [".git",')  # ruff's default applies
    failed = _failed(tree)
    assert set(failed) == {"ruff coverage"}
    assert "default `exclude`" in failed["ruff coverage"]
    assert "ruff does not lint launch/dist/collectives.py" in failed["ruff coverage"]


def test_an_exclude_pattern_matching_inside_a_package_fails(tree):
    _edit(tree / "pyproject.toml", 'exclude = [".git",', 'exclude = ["dist", ".git",')
    failed = _failed(tree)
    assert "launch/dist ('dist')" in failed["ruff coverage"], failed


def test_make_lint_leaving_a_package_out_of_ruff_fails(tree):
    _edit(tree / "Makefile", "tierckpt_dev tests bench launch scripts", "tierckpt_dev tests bench scripts")
    failed = _failed(tree)
    assert "make lint's ruff call leaves out launch" in failed["ruff coverage"], failed


def test_a_package_missing_from_mypy_files_fails(tree):
    _edit(tree / "pyproject.toml", '"launch", "bench"]', '"launch"]')
    failed = _failed(tree)
    assert set(failed) == {"mypy coverage"} and "mypy does not check bench" in failed["mypy coverage"]


def test_a_mypy_override_silencing_a_package_fails(tree):
    with open(tree / "pyproject.toml", "a") as f:
        f.write('\n[[tool.mypy.overrides]]\nmodule = ["titan_plugin.*"]\nignore_errors = true\n')
    failed = _failed(tree)
    assert "silences titan_plugin.*" in failed["mypy coverage"], failed


def test_a_mypy_exclude_dropping_a_package_file_fails(tree):
    _edit(tree / "pyproject.toml", "explicit_package_bases = true", 'explicit_package_bases = true\nexclude = "^bench/"')
    failed = _failed(tree)
    assert "drops bench/mod.py" in failed["mypy coverage"], failed


def test_mypy_paths_on_the_make_lint_line_replace_the_config(tree):
    _edit(tree / "Makefile", "$(VPY) -m mypy\n", "$(VPY) -m mypy tierckpt\n")
    failed = _failed(tree)
    assert "mypy does not check titan_plugin, mcore_plugin, tierckpt_dev, launch, bench" in failed["mypy coverage"]


def test_a_seventeenth_public_name_fails(tree):
    init = tree / "tierckpt" / "__init__.py"
    _edit(init, '    "TierFailedError": "tierckpt.errors",\n',
          '    "TierFailedError": "tierckpt.errors",\n    "StagingError": "tierckpt.errors",\n')
    _edit(init, "TierckptError, TierFailedError\n", "TierckptError, TierFailedError, StagingError\n")
    _edit(init, '    "TierFailedError",\n', '    "TierFailedError",\n    "StagingError",\n')
    failed = _failed(tree)
    assert set(failed) == {"public names"}
    assert "tierckpt.__all__ has 17 names, at most 16 allowed" in failed["public names"]


def test_an_export_without_its_type_checking_import_fails(tree):
    _edit(tree / "tierckpt" / "integration.py", "    from tierckpt.restore.peek import read_item\n", "")
    failed = _failed(tree)
    assert "integration.py: the TYPE_CHECKING imports differ from __all__ (missing: read_item" in failed["public names"]


def test_a_name_exported_by_both_modules_fails(tree):
    integ = tree / "tierckpt" / "integration.py"
    _edit(integ, '    "VerificationError": "tierckpt.errors",\n',
          '    "VerificationError": "tierckpt.errors",\n    "ConfigError": "tierckpt.errors",\n')
    _edit(integ, "    from tierckpt.errors import VerificationError\n",
          "    from tierckpt.errors import ConfigError, VerificationError\n")
    _edit(integ, '    "VerificationError",\n', '    "VerificationError",\n    "ConfigError",\n')
    failed = _failed(tree)
    assert "exported by tierckpt and tierckpt.integration: ConfigError" in failed["public names"], failed


@pytest.mark.parametrize("methods, extra_lines, expect", [
    (21, 0, "21 methods (≤ 20)"),  # one method too many
    (20, 400 - 41 + 1, "401 lines (≤ 400)"),  # one line too many (20 methods: 41 lines)
])
def test_an_engine_over_its_size_fails(tree, methods, extra_lines, expect):
    """Issue 30's figures are enforced: one method or one line over fails make lint."""
    body = "".join(f"    def m{i}(self):\n        pass\n" for i in range(methods))
    (tree / "tierckpt" / "engine.py").write_text("class TieredCheckpointer:\n" + body + "#\n" * extra_lines)
    failed = _failed(tree)
    assert set(failed) == {"engine size"} and expect in failed["engine size"], failed


def test_an_engine_at_its_size_passes(tree):
    body = "".join(f"    def m{i}(self):\n        pass\n" for i in range(20))
    (tree / "tierckpt" / "engine.py").write_text("class TieredCheckpointer:\n" + body + "#\n" * (400 - 41))
    assert _failed(tree) == {}


def test_the_repository_engine_is_within_issue_30s_figures():
    eng = sc.check_engine_size(REPO)
    assert eng.ok and eng.enforced, eng.line
    assert re.search(r"TieredCheckpointer: \d+ methods \(≤ 20\), (\d+) read-only attributes", eng.line), eng.line
    assert int(re.search(r"(\d+) read-only attributes", eng.line).group(1)) >= 15, eng.line


@pytest.mark.parametrize("member", [
    "    cfg = property(lambda self: self._cfg)\n",
    "    cfg, topo = _readonly('cfg'), _readonly('topo')\n",  # a helper that makes properties: two
    "    cfg = lambda self: self._cfg\n",
    "    cfg = functools.cached_property(lambda self: 1)\n",
])
def test_attributes_made_of_calls_or_lambdas_count_as_methods(tree, member):
    """A method cannot hide as ``property(lambda ...)`` or behind a helper: only the typed
    descriptor ``ReadOnly`` (tierckpt/readonly.py) is an attribute and not a method."""
    body = "".join(f"    def m{i}(self):\n        pass\n" for i in range(20))
    (tree / "tierckpt" / "engine.py").write_text("class TieredCheckpointer:\n" + member + body)
    failed = _failed(tree)
    names = member.split("=")[0].count(",") + 1
    assert set(failed) == {"engine size"} and f"{20 + names} methods (≤ 20)" in failed["engine size"], failed


def test_readonly_descriptors_and_constants_are_not_methods(tree):
    body = "".join(f"    def m{i}(self):\n        pass\n" for i in range(20))
    members = ('    cfg: ReadOnly[TierConfig] = ReadOnly("_cfg")\n'
               '    history: ReadOnly[list[int]] = ReadOnly("_gate.history", copy=list)\n'
               '    LIMIT = 3\n    NAMES: tuple[str, ...] = ("a", "b")\n')
    (tree / "tierckpt" / "engine.py").write_text("class TieredCheckpointer:\n" + members + body)
    assert _failed(tree) == {}
    line = sc.check_engine_size(tree).line
    assert "20 methods (≤ 20), 2 read-only attributes (ReadOnly, not methods)" in line, line


def _wings(tree: Path, files: dict[str, str]) -> dict[str, str]:
    for rel, text in files.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(text)
    return _failed(tree)


def test_imports_down_the_wings_pass(tree):
    """history imports io and cluster (below it), restore imports tiers, a relative import inside
    a wing, a base module, and the engine (top) imports any wing."""
    assert _wings(tree, {
        "tierckpt/io/__init__.py": "", "tierckpt/io/layout.py": "from tierckpt.errors import X\n",
        "tierckpt/cluster/__init__.py": "", "tierckpt/cluster/topology.py": "Y = 1\n",
        "tierckpt/history/__init__.py": "",
        "tierckpt/history/ledger.py": "from tierckpt.io import layout\nfrom tierckpt.cluster.topology import Y\n"
                                      "from .journal import Z\n",
        "tierckpt/history/journal.py": "Z = 1\n",
        "tierckpt/tiers/__init__.py": "", "tierckpt/tiers/jobs.py": "from tierckpt.history import ledger\n",
        "tierckpt/restore/__init__.py": "",
        "tierckpt/restore/pull.py": "def f():\n    from tierckpt.tiers.jobs import Z\n",
        "tierckpt/engine.py": "from tierckpt import startup\nfrom tierckpt.restore import pull\n"
                              "class TieredCheckpointer:\n    pass\n",
    }) == {}


@pytest.mark.parametrize("rel, text, expect", [
    # issue 30's three back-edges, as they were
    ("tierckpt/config.py", "from tierckpt.sched.mtbf import DEFAULT_WEIGHT\n",
     "tierckpt.config (config) imports tierckpt.sched.mtbf (sched, above)"),
    ("tierckpt/history/rollback.py", "from tierckpt.restore import Inventory\n",
     "tierckpt.history.rollback (history) imports tierckpt.restore (restore, above)"),
    ("tierckpt/io/peek.py", "from tierckpt.restore import plan_restore\n",
     "tierckpt.io.peek (io) imports tierckpt.restore (restore, above)"),
    # lazy, TYPE_CHECKING-only and relative imports count too
    ("tierckpt/transport/wire.py", "def f():\n    from tierckpt.tiers import jobs\n",
     "tierckpt.transport.wire (transport) imports tierckpt.tiers.jobs (tiers, above)"),
    ("tierckpt/cluster/topology.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                     "    from tierckpt.engine import TieredCheckpointer\n",
     "tierckpt.cluster.topology (cluster) imports tierckpt.engine (top, above)"),
    ("tierckpt/io/manifest.py", "from ..staging import pool\n",
     "tierckpt.io.manifest (io) imports tierckpt.staging.pool (staging, above)"),
    # a base module importing the package's lazy exports is an upward import
    ("tierckpt/records.py", "from tierckpt import TieredCheckpointer\n",
     "tierckpt.records (base) imports tierckpt (top, above)"),
    # a new wing must be placed in the order
    ("tierckpt/newwing/thing.py", "X = 1\n", "tierckpt.newwing.thing is in no wing"),
])
def test_an_import_up_the_wings_fails(tree, rel, text, expect):
    (tree / "tierckpt" / "staging").mkdir()
    (tree / "tierckpt" / "staging" / "pool.py").write_text("X = 1\n")
    (tree / "tierckpt" / "tiers").mkdir()
    (tree / "tierckpt" / "tiers" / "jobs.py").write_text("X = 1\n")
    failed = _wings(tree, {rel: text})
    assert set(failed) == {"wing order"}, failed
    assert expect in failed["wing order"], failed["wing order"]


@pytest.mark.parametrize("text, reached", [
    ("from tierckpt.config import RULES\n", "tierckpt.config"),
    ("def f():\n    from tierckpt.validators import Number\n", "tierckpt.validators"),
    ("import tierckpt.records\n", "tierckpt.records"),
    ("from tierckpt import errors\n", "tierckpt.errors"),  # a module, not a public name
    ("from tierckpt.cli.steps import x\n", "tierckpt.cli.steps"),  # only the cli package itself
])
def test_an_adapter_importing_an_engine_module_fails(tree, text, reached):
    """Adapters build on tierckpt, tierckpt.integration and the extension points only."""
    (tree / "mcore_plugin" / "bad.py").write_text(text)
    failed = _failed(tree)
    assert set(failed) == {"adapter imports"} and "mcore_plugin/bad.py:" in failed["adapter imports"], failed
    assert f"imports {reached}" in failed["adapter imports"], failed


def test_adapter_imports_through_the_surface_pass(tree):
    (tree / "titan_plugin" / "good.py").write_text(
        "from tierckpt import ConfigError\nfrom tierckpt.integration import RULES\n"
        "from tierckpt.io import layout\nfrom tierckpt.io.storage import Store\nfrom tierckpt.cli import CliError\n"
        "from tierckpt_dev.titan import cpu\nimport torch\n")
    assert _failed(tree) == {}
    assert "5 imports, 0 outside" in sc.check_adapter_imports(tree).line
