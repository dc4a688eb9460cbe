"""Installs the bench's shared-storage throttle (``bench/goodput/throttle.py``) at interpreter
start when ``$TIERCKPT_BENCH_SHARED_ROOT`` is set; ``make bench-goodput`` puts this folder on the
``PYTHONPATH`` of the launcher's node agents and ranks. Loaded by file path: nothing else of the
repository is imported here."""

import os

if os.environ.get("TIERCKPT_BENCH_SHARED_ROOT"):
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "tierckpt_bench_throttle", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "throttle.py"))
    assert _spec is not None and _spec.loader is not None
    _mod = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_mod)
    _mod.install_from_env()
