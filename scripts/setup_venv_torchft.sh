#!/usr/bin/env bash
# Create or update .venv-torchft (Python 3.11) from requirements-torchft.txt: the side virtualenv
# for the torchft row of `make bench-goodput` (torchtitan's experiments/torchft with torchft from
# the package index). It holds no tierckpt and is never a dependency of the product; .venv stays
# untouched. The stamp file holds the torchft version installed (bench/goodput/systems.py reads it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3.11}
VENV=.venv-torchft
quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
quiet "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r requirements-torchft.txt
(cd / && "$OLDPWD/$VENV/bin/python" - <<'PY'
import sys
from importlib.metadata import version
import torch
import torchft  # noqa: F401
from torchtitan.experiments.torchft.manager import TorchFTManager  # noqa: F401
assert sys.version_info[:2] == (3, 11), sys.version
assert torch.__version__.startswith("2.13.0"), torch.__version__
print(version("torchft"))
PY
) > "$VENV/.installed-stamp.tmp"
mv "$VENV/.installed-stamp.tmp" "$VENV/.installed-stamp"
