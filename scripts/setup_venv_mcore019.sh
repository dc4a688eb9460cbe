#!/usr/bin/env bash
# Create or update .venv-mcore019 (Python 3.12, megatron-core 0.19.x) from
# requirements-mcore019.txt and install tierckpt editable into it. `make test-mcore-019` uses it
# to run tests/mcore/ against megatron-core 0.19 (the main .venv holds 0.16.1 on Python 3.11).
# PY3_12 picks the interpreter: python3.12 on PATH, else pyenv's 3.12.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-mcore019
if [ -z "${PY3_12:-}" ]; then
  # (a pyenv shim may exist without a selected 3.12: check that it runs)
  if python3.12 -c "" >/dev/null 2>&1; then PY3_12=python3.12
  elif [ -x "${PYENV_ROOT:-$HOME/.pyenv}/versions/3.12.1/bin/python" ]; then PY3_12="${PYENV_ROOT:-$HOME/.pyenv}/versions/3.12.1/bin/python"
  else
    cand=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12.*/bin/python 2>/dev/null | tail -n1 || true)
    [ -n "$cand" ] || { echo "setup_venv_mcore019.sh: no Python 3.12 found; set PY3_12=/path/to/python3.12" >&2; exit 2; }
    PY3_12=$cand
  fi
fi
quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
[ -x "$VENV/bin/python" ] || "$PY3_12" -m venv "$VENV"
quiet "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r requirements-mcore019.txt
# nvidia-resiliency-ext may have come in by hand or by an older requirements file: remove it,
# megatron-core 0.19 cannot be imported next to nvrx 0.4.1.
if "$VENV/bin/python" -m pip show -q nvidia-resiliency-ext >/dev/null 2>&1; then
  quiet "$VENV/bin/python" -m pip uninstall -y -q nvidia-resiliency-ext
fi
quiet "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
check() {
  (cd / && "$OLDPWD/$VENV/bin/python" - <<'PY'
import sys
from importlib.metadata import version
import torch, xxhash, rich, fsspec, tierckpt, mcore_plugin
import megatron.core.dist_checkpointing
assert sys.version_info[:2] == (3, 12), sys.version
assert version("megatron-core").startswith("0.19."), version("megatron-core")
assert torch.__version__.startswith("2.13.0"), torch.__version__
PY
  )
}
check 2>/dev/null || { quiet "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation --force-reinstall -e . && check; }
# tierckpt_dev (CPU shims, demo assets; not in the wheel) from this checkout, for every process of
# the venv: Megatron-LM test runs and Slurm jobs start from other directories
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
printf '%s\n' "$PWD" > "$site/tierckpt_dev.pth"
(cd / && "$OLDPWD/$VENV/bin/python" -c "import tierckpt_dev")
touch "$VENV/.installed-stamp"
