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
    "agree_loader_death", "mark_phase", "install_process_group_hook",
}
#: what the adapters imported from engine modules before (tierckpt.config, .validators, .records):
#: exported by tierckpt.integration, never by tierckpt
ADAPTER_RULES = {"GenericRecord", "RULES", "SCHEDULE_RULES", "Number", "non_negative_int", "non_negative_seconds",
                 "positive_number"}
#: integration names that never were in ``tierckpt`` (no deprecated alias there)
NEW_IN_INTEGRATION = {"agree_loader_death", "mark_phase", "install_process_group_hook"}


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, cwd=REPO)


def test_tierckpt_exports_the_user_facing_names_and_integration_the_plumbing():
    import tierckpt
    import tierckpt.integration as integration

    assert set(tierckpt.__all__) == USER_FACING and len(tierckpt.__all__) <= 16
    assert set(integration.__all__) == PLUMBING | ADAPTER_RULES
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
    from tierckpt.config import RULES
    from tierckpt.validators import Number

    assert integration.RULES is RULES and integration.Number is Number
    for name in ADAPTER_RULES:
        assert not hasattr(tierckpt, name), name  # never a tierckpt name: no deprecated alias either


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


#: every read-only engine attribute and the type mypy must see (tierckpt/readonly.py: ReadOnly)
ENGINE_ATTRIBUTES = {
    "cfg": "tierckpt.config.TierConfig",
    "topo": "tierckpt.cluster.topology.Topology",
    "groups": "tierckpt.cluster.topology.Groups",
    "local": "tierckpt.tiers.local_tier.LocalTier | None",
    "persistent": "tierckpt.tiers.persistent.PersistentTier",
    "ledger": "tierckpt.history.ledger.Ledger",
    "lineage": "str",
    "timeline": "tierckpt.history.timeline.Timeline",
    "preemption": "tierckpt.preemption.PreemptionWatch",
    "pool": "tierckpt.staging.pool.StagingPool",
    "restorer": "tierckpt.restore.restorer.Restorer",
    "jobs": "tierckpt.tiers.jobs.TierJobs",
    "gate": "tierckpt.tiers.gate.SaveGate",
    "last_redundancy": "concurrent.futures._base.Future[Any] | None",
    "history": "list[tierckpt.records.CheckpointRecord]",
}


def test_mypy_sees_the_engine_attributes_typed_and_read_only(tmp_path):
    """Each engine attribute the adapters read has its real type (a ``property(lambda ...)`` was
    ``Any``: ``e.cfg.tierz`` type-checked), and an assignment to one is a type error."""
    from mypy import api

    from tierckpt.engine import TieredCheckpointer
    from tierckpt.readonly import ReadOnly

    declared = {k for k, v in vars(TieredCheckpointer).items() if isinstance(v, ReadOnly)}
    assert declared == set(ENGINE_ATTRIBUTES), declared ^ set(ENGINE_ATTRIBUTES)
    lines = ["from tierckpt import TieredCheckpointer", "from tierckpt.history.journal import RunJournal",
             "from tierckpt.preemption import FinalSaveEngine, PreemptionJournal", "",
             "def conforms(e: TieredCheckpointer, j: RunJournal) -> tuple[FinalSaveEngine, PreemptionJournal]:",
             "    return e, j  # preemption.final_save's protocols", "",
             "def use(e: TieredCheckpointer) -> None:"]
    lines += [f"    reveal_type(e.{n})" for n in ENGINE_ATTRIBUTES]
    lines += ["    e.cfg.tierz"]
    first_assignment = len(lines) + 1
    lines += [f"    e.{n} = e.{n}" for n in ENGINE_ATTRIBUTES]
    snippet = tmp_path / "uses_engine.py"
    snippet.write_text("\n".join(lines) + "\n")
    out, err, _ = api.run(["--config-file", str(REPO / "pyproject.toml"), "--cache-dir", str(REPO / ".mypy_cache"),
                           "--no-error-summary", "--show-error-codes", str(snippet)])
    revealed = [ln.split("Revealed type is ", 1)[1].strip('"') for ln in out.splitlines() if "Revealed type is" in ln]
    assert revealed == list(ENGINE_ATTRIBUTES.values()), out + err
    assert '"TierConfig" has no attribute "tierz"' in out, out
    refused = {int(ln.split(":")[1]) for ln in out.splitlines() if "[assignment]" in ln}
    assert refused == set(range(first_assignment, first_assignment + len(ENGINE_ATTRIBUTES))), out
    errors = [ln for ln in out.splitlines() if ": error:" in ln]
    assert len(errors) == len(ENGINE_ATTRIBUTES) + 1, out  # the assignments and `tierz`: nothing else


def test_engine_attributes_refuse_assignment_at_run_time():
    """No setter at run time either, and each keeps its documentation."""
    from tierckpt.engine import TieredCheckpointer

    eng = TieredCheckpointer.__new__(TieredCheckpointer)  # no process group needed: attributes only
    eng._cfg = cfg = object()
    assert eng.cfg is cfg
    for name in ("cfg", "history", "last_redundancy"):
        with pytest.raises(AttributeError, match=f"TieredCheckpointer.{name} is read-only"):
            setattr(eng, name, None)
    with pytest.raises(AttributeError, match="read-only"):
        del eng.cfg
    assert "read-only" in (TieredCheckpointer.cfg.__doc__ or "")
