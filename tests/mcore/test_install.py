"""Version-aware hooks (``mcore_plugin.install``) and the launcher (``mcore_plugin.pretrain``).

Version detection and refusal of unknown versions run on the megatron-core wheel of the
environment (0.16.1 in ``.venv``, 0.19.x in ``.venv-mcore019``). The hook points inside
Megatron-LM's ``megatron/training`` and the launcher run when ``MEGATRON_LM_DIR`` points at a
checkout (in a subprocess, so the checkout's ``megatron`` package does not shadow the wheel in
this process); each checks the names of the checkout's own megatron-core version.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from mcore_plugin import install

MLM = os.environ.get("MEGATRON_LM_DIR", "")
NEEDS_MLM = pytest.mark.skipif(
    not MLM, reason="MEGATRON_LM_DIR is not set: the training-loop hook points live in a Megatron-LM checkout "
                    "(make test-megatron-lm sets it)")


def test_detects_the_imported_megatron_core():
    (major, minor, patch), text = install.megatron_core_version()
    wheel = version("megatron-core")
    assert wheel.startswith(f"{major}.{minor}.{patch}"), (wheel, text)
    spec = install.hook_spec()
    assert spec.version == (major, minor)
    base = Path(__import__("megatron.core.dist_checkpointing.strategies", fromlist=["x"]).__file__).parent / "base.py"
    assert base.exists() == spec.has_strategies_base  # 0.16 has strategies/base.py, 0.19 dropped it
    if (major, minor) == (0, 16):
        assert spec.save_strategy == "get_default_save_sharded_strategy"
    else:
        assert spec.save_strategy == "TorchDistSaveShardedStrategy"


@pytest.mark.parametrize("v", [(0, 15, 3), (0, 17, 1), (0, 18, 0), (1, 0, 0)])
def test_unknown_versions_are_refused_by_name(v):
    with pytest.raises(install.UnsupportedMegatronVersion) as e:
        install.hook_spec(v)
    msg = str(e.value)
    assert ".".join(map(str, v)) in msg and "0.16.x" in msg and "0.19.x" in msg


def test_a_version_that_contradicts_the_package_is_refused(monkeypatch):
    import megatron.core.package_info as info

    (major, minor, _), _ = install.megatron_core_version()
    other = "0.19.2" if (major, minor) == (0, 16) else "0.16.1"
    monkeypatch.setattr(info, "__version__", other)
    with pytest.raises(install.UnsupportedMegatronVersion, match="mixed up"):
        install.hook_spec()


def test_install_on_the_wheel_alone():
    assert not install.installed()
    try:
        rt = install.install(training=False)
        assert install.install() is rt and install.runtime() is rt and rt.spec == install.hook_spec()
    finally:
        install.uninstall()
    assert install.runtime() is None


_HOOKS = r"""
import sys, importlib
sys.path.insert(0, sys.argv[1])
from mcore_plugin import install
spec = install.hook_spec()
ck = importlib.import_module("megatron.training.checkpointing")
tr = importlib.import_module("megatron.training.training")
tasd = importlib.import_module("megatron.core.dist_checkpointing.tensor_aware_state_dict")
pkg = importlib.import_module("megatron.training")
points = [(ck, spec.save_strategy), (ck, spec.load_strategy), (ck, "generate_state_dict"),
          (tr, "setup_model_and_optimizer"), (tr, "checkpoint_and_decide_exit"), (tr, "pretrain"),
          (pkg, "pretrain"), (tasd, "MCoreTensorAwareStateDict")]
for m in spec.parser_modules:
    mod = importlib.import_module(m)
    points += [(mod, "parse_args"), (mod, "validate_args")]
before = {(m.__name__, n): getattr(m, n) for m, n in points}
install.install()
changed = sorted(f"{m}.{n}" for (m, n), v in before.items() if getattr(sys.modules[m], n) is not v)
missing = sorted(f"{m}.{n}" for (m, n), v in before.items() if getattr(sys.modules[m], n) is v)
install.uninstall()
restored = all(getattr(sys.modules[m], n) is v for (m, n), v in before.items())
print("SPEC", spec.version)
print("CHANGED", len(changed), "MISSING", missing, "RESTORED", restored)
# a checkout without one of the version's hook points is refused, nothing changed
delattr(ck, spec.save_strategy)
try:
    install.install()
    print("REFUSED no")
except install.UnsupportedMegatronVersion as e:
    print("REFUSED", spec.save_strategy in str(e), install.runtime() is None)
"""


def _run(code_or_args, env_extra=None, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.update(env_extra or {})
    base_bin = os.path.join(sys.base_prefix, "bin")
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), base_bin, env.get("PATH", "")])
    return subprocess.run([sys.executable, *code_or_args], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=str(Path(MLM) if MLM else Path.cwd()))


@NEEDS_MLM
def test_hooks_replace_and_restore_every_point_of_the_checkouts_version():
    out = _run(["-c", _HOOKS, MLM])
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    lines = {ln.split()[0]: ln for ln in out.stdout.splitlines() if ln.split() and ln.split()[0].isupper()}
    assert "MISSING [] RESTORED True" in lines["CHANGED"], lines["CHANGED"]
    assert lines["REFUSED"] == "REFUSED True True", lines["REFUSED"]


def test_launcher_usage_errors(tmp_path):
    out = _run(["-m", "mcore_plugin.pretrain"])
    assert out.returncode == 2 and "usage:" in out.stderr
    out = _run(["-m", "mcore_plugin.pretrain", "--save", "/x"])
    assert out.returncode == 2 and "first argument must be the Megatron-LM script" in out.stderr
    out = _run(["-m", "mcore_plugin.pretrain", str(tmp_path / "missing.py")])
    assert out.returncode == 2 and "is not a Python file" in out.stderr
    script = tmp_path / "s.py"
    script.write_text("")
    out = _run(["-m", "mcore_plugin.pretrain", str(script), "@" + str(tmp_path / "none.args")])
    assert out.returncode == 2 and "none.args" in out.stderr


def test_launcher_sets_argv_and_path_like_python_script(tmp_path, monkeypatch):
    from mcore_plugin.pretrain import prepare

    script = tmp_path / "train.py"
    script.write_text("")
    args = tmp_path / "x.args"
    args.write_text("--lr 1e-3  # comment\n--save /s\n")
    monkeypatch.setattr(sys, "argv", ["pretrain.py"])
    monkeypatch.setattr(sys, "path", [os.getcwd(), "/other"])
    assert prepare([str(script), "--a", f"@{args}", "--b"]) == str(script)
    assert sys.argv == [str(script), "--a", "--lr", "1e-3", "--save", "/s", "--b"]
    assert sys.path == [str(tmp_path), "/other"]


_PARSE = r"""
import sys
sys.path.insert(0, sys.argv[1])
from mcore_plugin import install
install.install()
import megatron.training.arguments as A
sys.argv = ["pretrain_gpt.py", "--num-layers", "3", "--ckpt-plugin-enable", "--ckpt-plugin-local-interval", "7",
            "--ckpt-plugin-adaptive", "local", "persistent", "--tensor-model-parallel-size", "2"]
args = A.parse_args()
print("PARSED", args.num_layers, args.tensor_model_parallel_size, args.ckpt_plugin_enable,
      args.ckpt_plugin_local_interval, args.ckpt_plugin_adaptive)
# the group is in Megatron's parser (its --help lists it; 0.19.0's own --help crashes on a '%' in
# another flag's help text, so the parser's groups are inspected instead)
import argparse
seen = []
orig = argparse.ArgumentParser.parse_args
def grab(self, *a, **kw):
    seen.append([g.title for g in self._action_groups])
    return orig(self, *a, **kw)
argparse.ArgumentParser.parse_args = grab
A.parse_args()
print("GROUP", "tierckpt checkpoint plugin" in seen[0])
"""


@NEEDS_MLM
def test_plugin_flags_are_parsed_by_megatrons_parser():
    out = _run(["-c", _PARSE, MLM])
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "PARSED 3 2 True 7 ['local', 'persistent']" in out.stdout, out.stdout[-2000:]
    assert "GROUP True" in out.stdout


@NEEDS_MLM
@pytest.mark.parametrize("extra, flag", [
    (["--ckpt-plugin-enable", "--save-interval", "5"], "--save"),
    (["--ckpt-plugin-enable", "--save", "{tmp}/c", "--save-interval", "5", "--ckpt-format", "torch"],
     "--ckpt-format"),
    (["--ckpt-plugin-local-interval", "5"], "--ckpt-plugin-local-interval"),
])
def test_launcher_refuses_invalid_flags_at_start(tmp_path, extra, flag):
    """Megatron-LM parses and validates before creating any process group: a bad plugin flag
    ends the run right there with exit 2 and the flag's name."""
    args = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--distributed-backend",
            "gloo", "--transformer-impl", "local"]
    extra = [a.replace("{tmp}", str(tmp_path)) for a in extra]
    out = _run(["-m", "mcore_plugin.pretrain", str(Path(MLM) / "pretrain_gpt.py"), *args, *extra],
               env_extra={"WORLD_SIZE": "1", "RANK": "0"})
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
    last = [ln for ln in out.stderr.splitlines() if ln.startswith("mcore_plugin.pretrain: error:")]
    assert last and re.search(re.escape(flag) + r"\b", last[-1]), out.stderr[-2000:]
    assert "initializing torch distributed" not in out.stdout


def test_schedule_decisions_go_to_megatron_writers(monkeypatch):
    """Decisions reach Megatron-LM's TensorBoard and W&B writers (stand-ins here; the real
    ones exist on the last rank of a Megatron-LM run)."""
    import sys
    import types

    from mcore_plugin import install

    class TB:
        def __init__(self):
            self.calls = []

        def add_scalar(self, k, v, it):
            self.calls.append((k, v, it))

    class WB:
        def __init__(self):
            self.calls = []

        def log(self, metrics, it):
            self.calls.append((metrics, it))

    tb, wb = TB(), WB()
    gv = types.ModuleType("megatron.training.global_vars")
    gv.get_tensorboard_writer = lambda: tb
    gv.get_wandb_writer = lambda: wb
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", gv)
    if "megatron.training" not in sys.modules:
        monkeypatch.setitem(sys.modules, "megatron.training", types.ModuleType("megatron.training"))
    recs = [{"tier": "local", "tau_steps": 7, "tau_s": 9.0, "delta": 0.2, "M": 100.0, "R": 10.0, "p": 0.1}]

    class Eng:
        def drain_schedule_log(self):
            out, recs[:] = list(recs), []
            return out

    rt = types.SimpleNamespace(tiers=types.SimpleNamespace(engine=Eng()))
    install._log_schedule(rt, 42)
    assert ("tierckpt/local/tau_steps", 7.0, 42) in tb.calls
    assert wb.calls and wb.calls[0][1] == 42 and wb.calls[0][0]["tierckpt/local/mtbf_s"] == 100.0
    install._log_schedule(rt, 43)  # nothing new: nothing written
    assert len(wb.calls) == 1


def test_ckpt_step_is_a_rollback_only_in_a_training_run():
    """``--ckpt-step N`` loads N read-only with ``--skip-train`` (evaluation) and as a rollback
    otherwise; 0 or absent means no explicit step (Megatron's own ``if args.ckpt_step``)."""
    from types import SimpleNamespace as NS

    assert install.explicit_step(NS(ckpt_step=4, skip_train=False)) == (4, True)
    assert install.explicit_step(NS(ckpt_step=4, skip_train=True)) == (4, False)
    assert install.explicit_step(NS(ckpt_step=None, skip_train=False)) == (None, False)
    assert install.explicit_step(NS(ckpt_step=0)) == (None, False)
    assert install.explicit_step(NS()) == (None, False)


def test_planned_exit_after_a_local_only_save_writes_the_persistent_tier():
    """Issue 14, item 5, without a Megatron-LM checkout: Megatron's exit decision followed a
    local-only save (its ``saved_checkpoint`` was set by the non-persistent save, so it skipped
    its exit save). The plugin's hook then calls Megatron's own ``save_checkpoint_and_time``
    for the persistent path at that iteration, with the loop's arguments; it does nothing when
    the persistent tier already has the iteration, when training goes on, or without --save.
    (tests/mcore/test_megatron_lm.py runs the same through pretrain_gpt.py.)"""
    import types

    from mcore_plugin import install

    calls = []

    def save_checkpoint_and_time(iteration, model, optimizer, sched, flops, ctx, non_persistent_ckpt=False,
                                 train_data_iterator=None):
        calls.append((iteration, model, optimizer, sched, flops, ctx, non_persistent_ckpt, train_data_iterator))
        rt.persistent_saved_step = iteration  # what the strategy's due() records for a persistent save

    tr = types.SimpleNamespace(save_checkpoint_and_time=save_checkpoint_and_time)
    rt = install.Runtime(spec=None)
    args = types.SimpleNamespace(save="/ckpt")
    loop = ("model", "opt", "sched")
    rest = (123.0, {"ctx": 1})
    # a planned exit at 6 after a local-only save: the persistent tier is written, as Megatron's
    # own exit save would (persistent path), with train_data_iterator passed through
    assert install._durable_exit(rt, tr, args, True, *loop, 6, rest, {"train_data_iterator": "it"})
    assert calls == [(6, "model", "opt", "sched", 123.0, {"ctx": 1}, False, "it")]
    # the same iteration again (Megatron's end-of-training save path): already durable
    assert not install._durable_exit(rt, tr, args, True, *loop, 6, rest, {"train_data_iterator": "it"})
    # not exiting, or no --save: nothing
    assert not install._durable_exit(rt, tr, args, False, *loop, 8, rest, {})
    assert not install._durable_exit(rt, tr, types.SimpleNamespace(save=None), True, *loop, 8, rest, {})
    assert len(calls) == 1
