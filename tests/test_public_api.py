"""Issue 30: a narrow, typed public API.

``tierckpt`` exports the user-facing names only (≤ 16), lazily and typed for mypy; adapter
plumbing lives in ``tierckpt.integration`` (its own ``__all__``); a name that moved still resolves
from ``tierckpt`` for one release, with a DeprecationWarning naming the new import.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

USER_FACING = {
    "TieredCheckpointer", "TierConfig", "ScheduleOptions", "SaveHandle", "CheckpointRecord", "RestoreResult",
    "PersistentIO", "Preempted", "PREEMPTED_EXIT", "protect_loader_workers", "preempted_by",
    "TierckptError", "ConfigError", "NoCheckpointError", "TemplateMismatchError", "TierFailedError",
}
PLUMBING = {
    "all_gather", "run_agreed", "PeerFailure", "check_replication", "accelerator_present", "signal_numbers",
    "write_dcp", "read_item", "plan_restore", "TIERS", "validate_tiers", "record_metrics", "restore_metrics",
    "result_metrics", "decision_metrics", "describe_failure", "RestoreRecord", "VerificationError",
    "agree_loader_death",
}
#: integration names that never were in ``tierckpt`` (no deprecated alias there)
NEW_IN_INTEGRATION = {"agree_loader_death"}


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, cwd=REPO)


def test_tierckpt_exports_the_user_facing_names_and_integration_the_plumbing():
    import tierckpt
    import tierckpt.integration as integration

    assert set(tierckpt.__all__) == USER_FACING and len(tierckpt.__all__) <= 16
    assert set(integration.__all__) == PLUMBING
    for name in tierckpt.__all__:
        assert getattr(tierckpt, name) is not None
    for name in integration.__all__:
        assert getattr(integration, name) is not None
    from tierckpt.config import TierConfig
    from tierckpt.cluster.collectives import all_gather

    assert tierckpt.TierConfig is TierConfig and integration.all_gather is all_gather
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        tierckpt.nope  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'TierConfig'"):
        integration.TierConfig  # noqa: B018  (user-facing names are not exported twice)


def test_star_import_and_lazy_resolution_do_not_import_torch_distributed():
    """``import tierckpt`` / ``tierckpt.integration`` stay light (the ``tierckpt`` command and
    launchers import them); ``from tierckpt import *`` binds exactly ``__all__``."""
    r = _run("""
        import sys
        import tierckpt, tierckpt.integration
        assert "torch.distributed" not in sys.modules, "import tierckpt pulled in torch.distributed"
        ns = {}
        exec("from tierckpt import *", ns)
        got = sorted(k for k in ns if not k.startswith("__"))
        assert got == sorted(tierckpt.__all__), got
        print("OK")
    """)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


def test_a_name_new_in_integration_has_no_alias_in_tierckpt():
    import tierckpt

    for name in NEW_IN_INTEGRATION:
        with pytest.raises(AttributeError, match=f"no attribute '{name}'"):
            getattr(tierckpt, name)


@pytest.mark.parametrize("name", sorted(PLUMBING - NEW_IN_INTEGRATION))
def test_a_moved_name_still_resolves_from_tierckpt_with_a_deprecation_warning(name):
    import tierckpt
    import tierckpt.integration as integration

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = getattr(tierckpt, name)
    assert value is getattr(integration, name)
    dep = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(dep) == 1, [str(w.message) for w in caught]
    assert f"from tierckpt.integration import {name}" in str(dep[0].message)
    assert dep[0].filename == __file__  # stacklevel: the warning points at the caller's line
    assert name not in tierckpt.__all__ and name not in dir(tierckpt)


def test_mypy_sees_the_real_type_of_every_export(tmp_path):
    """The ``if TYPE_CHECKING:`` blocks: without them every lazily exported name is ``Any`` to
    mypy, and a wrong use type-checks."""
    from mypy import api

    import tierckpt
    import tierckpt.integration as integration

    lines = ["import tierckpt", "import tierckpt.integration"]
    lines += [f"reveal_type(tierckpt.{n})" for n in tierckpt.__all__]
    lines += [f"reveal_type(tierckpt.integration.{n})" for n in integration.__all__]
    lines += ["bad: int = tierckpt.TierConfig(local_root='/l', persistent_root='/p')"]
    # the repository's configuration (and so `make lint`'s mypy cache): a cold cache costs minutes
    snippet = tmp_path / "uses_tierckpt.py"
    snippet.write_text("\n".join(lines) + "\n")
    out, err, status = api.run(["--config-file", str(REPO / "pyproject.toml"), "--cache-dir", str(REPO / ".mypy_cache"),
                                "--no-error-summary", "--show-error-codes", str(snippet)])
    revealed = [ln for ln in out.splitlines() if "Revealed type is" in ln]
    assert len(revealed) == len(tierckpt.__all__) + len(integration.__all__), out + err
    untyped = [ln for ln in revealed if '"Any"' in ln or "is \"builtins.object\"" in ln]
    assert not untyped, untyped
    assert any("tierckpt.config.TierConfig" in ln for ln in revealed), out
    assert 'Incompatible types in assignment (expression has type "TierConfig", variable has type "int")' in out, out
