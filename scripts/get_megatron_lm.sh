#!/usr/bin/env bash
# Get a Megatron-LM source tree (pretrain_gpt.py + megatron/training) for `make test-megatron-lm`.
# Megatron-LM is not on PyPI, and its code never goes into this repository: the tree is
# exported to DEST (default: ~/.cache/tierckpt/megatron-lm-<REF>), outside the repo, and the
# script prints DEST on its last line (use it as MEGATRON_LM_DIR).
#
#   scripts/get_megatron_lm.sh [--ref REF] [--from GIT_DIR_OR_URL] [DEST]
#
# REF defaults to core_v0.16.1, the tag whose megatron/core equals the megatron-core 0.16.1
# wheel in .venv (the training loop and the wheel must agree). --from takes a local clone or
# bare git directory (exported with `git archive`, no network) or a URL (shallow clone);
# default: the GitHub repository. An existing DEST holding pretrain_gpt.py is reused.
set -euo pipefail
REF=core_v0.16.1
FROM=https://github.com/NVIDIA/Megatron-LM.git
DEST=
while [ $# -gt 0 ]; do
  case "$1" in
    --ref) REF=$2; shift 2 ;;
    --from) FROM=$2; shift 2 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    -*) echo "get_megatron_lm.sh: unknown option $1 (allowed: --ref REF, --from GIT_DIR_OR_URL, DEST)" >&2; exit 2 ;;
    *) DEST=$1; shift ;;
  esac
done
DEST=${DEST:-${XDG_CACHE_HOME:-$HOME/.cache}/tierckpt/megatron-lm-$REF}
if [ -f "$DEST/pretrain_gpt.py" ] && [ -d "$DEST/megatron/training" ]; then
  echo "$DEST"; exit 0
fi
mkdir -p "$(dirname "$DEST")"
TMP=$(mktemp -d "$(dirname "$DEST")/.megatron-lm.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
if [ -d "$FROM" ]; then
  git -C "$FROM" rev-parse --verify -q "$REF^{commit}" >/dev/null \
    || { echo "get_megatron_lm.sh: $FROM has no ref $REF" >&2; exit 2; }
  git -C "$FROM" archive --format=tar "$REF" | tar -x -C "$TMP"
  COMMIT=$(git -C "$FROM" rev-parse "$REF^{commit}")
else
  git clone -q --depth 1 --branch "$REF" "$FROM" "$TMP/clone"
  COMMIT=$(git -C "$TMP/clone" rev-parse HEAD)
  rm -rf "$TMP/clone/.git"
  (shopt -s dotglob; mv "$TMP/clone"/* "$TMP"/); rmdir "$TMP/clone"
fi
[ -f "$TMP/pretrain_gpt.py" ] || { echo "get_megatron_lm.sh: $REF has no pretrain_gpt.py" >&2; exit 2; }
printf '%s %s\n' "$REF" "$COMMIT" > "$TMP/.tierckpt-megatron-lm-ref"
rm -rf "$DEST"; mv "$TMP" "$DEST"; trap - EXIT
echo "$DEST"
