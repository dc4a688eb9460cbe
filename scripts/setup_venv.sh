#!/usr/bin/env bash
# Create or update .venv (Python 3.11) from requirements-cpu.txt and install tierckpt editable.
# pip's "Location ... is ignored" lines come from this machine's local index config; they are
# filtered out, pip's own exit status is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3.11}
VENV=.venv
quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
quiet "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r requirements-cpu.txt -r requirements-dev.txt
quiet "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
check() { (cd / && "$OLDPWD/$VENV/bin/python" -c "import torch, xxhash, rich, tomli, fsspec, tierckpt, titan_plugin; assert torch.__version__.startswith('2.13.0'), torch.__version__"); }
# an editable install made before a package existed does not map it: reinstall then
check 2>/dev/null || { quiet "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation --force-reinstall -e . && check; }
# tierckpt_dev (CPU shims, demo assets; not in the wheel) from this checkout, for every process of
# the venv: Megatron-LM test runs and Slurm jobs start from other directories
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
printf '%s\n' "$PWD" > "$site/tierckpt_dev.pth"
(cd / && "$OLDPWD/$VENV/bin/python" -c "import tierckpt_dev")
touch "$VENV/.installed-stamp"
