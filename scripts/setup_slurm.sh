#!/usr/bin/env bash
# Install Slurm (Debian's slurm-wlm: slurmctld, slurmd, client commands) and MUNGE for the real
# Slurm tests (make test-slurm, tests/slurm/). Debian/Ubuntu, as root; idempotent (does nothing
# when the programs are there). No service is enabled or started: the tests run their own
# private daemons (tests/slurm/cluster.py), and Debian's policy-rc.d / a missing init keep the
# packages' own start attempts harmless.
#
#   scripts/setup_slurm.sh          exit 0 when installed (or already present), 1 otherwise
set -euo pipefail
need=(munged mungekey slurmctld slurmd sbatch srun scontrol sinfo squeue unshare)
missing() {
  local t out=()
  for t in "${need[@]}"; do
    command -v "$t" >/dev/null 2>&1 || [ -x "/usr/sbin/$t" ] || out+=("$t")
  done
  echo "${out[*]}"
}
[ -z "$(missing)" ] && { echo "setup_slurm: slurm-wlm and munge already installed"; exit 0; }
if [ "$(id -u)" != 0 ]; then
  echo "setup_slurm: missing $(missing); installing needs root (apt-get)" >&2; exit 1
fi
command -v apt-get >/dev/null || { echo "setup_slurm: missing $(missing) and no apt-get (Debian/Ubuntu only)" >&2; exit 1; }
export DEBIAN_FRONTEND=noninteractive
t0=$(date +%s)
apt-get update -qq
apt-get install -y -qq --no-install-recommends slurm-wlm munge util-linux >/dev/null
left=$(missing)
[ -z "$left" ] || { echo "setup_slurm: still missing after install: $left" >&2; exit 1; }
echo "setup_slurm: installed slurm-wlm $(dpkg-query -W -f='${Version}' slurm-wlm) and munge in $(( $(date +%s) - t0 )) s"
