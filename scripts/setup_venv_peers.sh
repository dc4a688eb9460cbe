#!/usr/bin/env bash
# Create or update .venv-peers (Python 3.11) from requirements-peers.txt: the side virtualenv in
# which `make bench-peers` runs lm-resiliency (bench/peers_lmr.py). It holds no tierckpt and is
# never a dependency of the product; .venv stays untouched.
# LMR_WHEEL: install lm-resiliency from this wheel file instead of the package index.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3.11}
VENV=.venv-peers
quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
if [ -n "${LMR_WHEEL:-}" ]; then
  quiet "$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==2.13.0" "numpy>=1.26" "$LMR_WHEEL"
else
  quiet "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r requirements-peers.txt
fi
(cd / && "$OLDPWD/$VENV/bin/python" - <<'PY'
import sys
from importlib.metadata import version
import torch
from lm_resiliency.checkpointing import InMemoryCheckpointManager, InMemoryCkptConfig  # noqa: F401
assert sys.version_info[:2] == (3, 11), sys.version
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert version("lm-resiliency") == "0.2.0", version("lm-resiliency")
PY
)
touch "$VENV/.installed-stamp"
