#!/usr/bin/env bash
# Create or update .venv-latest (Python 3.12) from requirements-latest.txt: the newest torch,
# torchtitan, megatron-core and nvidia-resiliency-ext the package index serves, with tierckpt
# installed editable. `make test-latest` runs the engine, torchtitan and Megatron tests in it
# (.venv keeps the pinned versions). PY3_12 picks the interpreter: python3.12 on PATH, else pyenv's 3.12.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-latest
NVRX=nvidia-resiliency-ext==0.7.0
# This machine's pip configuration caps torch at the releases on its local disk (a constraint
# file); the newest torch comes from the package index, so the cap is lifted for this venv only
# (an empty constraint file in its place: an empty PIP_CONSTRAINT does not override it).
export PIP_CONSTRAINT=/dev/null
if [ -z "${PY3_12:-}" ]; then
  # (a pyenv shim may exist without a selected 3.12: check that it runs)
  if python3.12 -c "" >/dev/null 2>&1; then PY3_12=python3.12
  else
    cand=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12.*/bin/python 2>/dev/null | tail -n1 || true)
    [ -n "$cand" ] || { echo "setup_venv_latest.sh: no Python 3.12 found; set PY3_12=/path/to/python3.12" >&2; exit 2; }
    PY3_12=$cand
  fi
fi
quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
pipi() { quiet "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }
[ -x "$VENV/bin/python" ] || "$PY3_12" -m venv "$VENV"
pipi -r requirements-latest.txt
# nvidia-resiliency-ext 0.7.0 ships one wheel, tagged manylinux_2_39 (built on glibc 2.39); pip
# refuses it on an older glibc (Debian 12 has 2.36). The rest is Python; its one compiled file,
# nvrx_cupti_module (imported only by nvidia_resiliency_ext.attribution.straggler.cupti), needs
# GLIBC_2.32 and GLIBCXX_3.4.32 (GCC 13's libstdc++; Debian 12 has 3.4.30), so on Debian 12 only
# nvrx's CUPTI straggler detection fails to load: neither tierckpt nor megatron-core's checkpointing
# uses it. Where the normal install finds no wheel, the same wheel is installed by its platform tag.
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
if ! "$VENV/bin/python" -c "import sys; from importlib.metadata import version; sys.exit(version('nvidia-resiliency-ext') != '${NVRX#*==}')" 2>/dev/null; then
  if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps "$NVRX" >/dev/null 2>&1; then
    echo "setup_venv_latest.sh: pip finds no $NVRX wheel for this platform ($(ldd --version 2>/dev/null | head -n1 | awk '{print "glibc", $NF}')); installing its manylinux_2_39 wheel by tag"
    pipi --no-deps --only-binary=:all: --platform manylinux_2_39_x86_64 --python-version 3.12 \
      --implementation cp --upgrade --target "$site" "$NVRX"
  fi
fi
# its dependencies (a --no-deps or --target install does not bring them): the non-extra requirements
# of its metadata
mapfile -t deps < <("$VENV/bin/python" - <<'PY'
from importlib.metadata import requires
for r in requires("nvidia-resiliency-ext") or []:
    if "extra ==" not in r:
        print(r.split(";")[0].strip())
PY
)
[ "${#deps[@]}" -eq 0 ] || pipi "${deps[@]}"
pipi --no-deps --no-build-isolation -e .
check() {
  (cd / && "$OLDPWD/$VENV/bin/python" - <<'PY'
import sys
from importlib.metadata import version
import torch, xxhash, rich, fsspec, tierckpt, titan_plugin, mcore_plugin
import torchtitan
import megatron.core.dist_checkpointing
import nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager
assert sys.version_info[:2] == (3, 12), sys.version
assert torch.__version__.startswith("2.15.0"), torch.__version__
assert version("megatron-core") == "0.19.2", version("megatron-core")
assert version("nvidia-resiliency-ext") == "0.7.0", version("nvidia-resiliency-ext")
assert version("torchtitan") == "0.3.0", version("torchtitan")
PY
  )
}
# an editable install made before a package existed does not map it: reinstall then
check 2>/dev/null || { pipi --no-deps --no-build-isolation --force-reinstall -e . && check; }
# tierckpt_dev (CPU shims, demo assets; not in the wheel) from this checkout, for every process of
# the venv: Megatron-LM test runs and Slurm jobs start from other directories
printf '%s\n' "$PWD" > "$site/tierckpt_dev.pth"
(cd / && "$OLDPWD/$VENV/bin/python" -c "import tierckpt_dev")
touch "$VENV/.installed-stamp"
