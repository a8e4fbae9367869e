#!/usr/bin/env bash
# Install a single-host Slurm (Debian's slurm-wlm) and munge for tests/test_slurm.py.
#
# Idempotent: does nothing when the programs are already there. Exits 0 without installing
# where apt-get is not available or we cannot become root, 1 when apt-get fails: either way the
# Slurm tests then skip, printing why (under CI=true they fail instead: tests/support/skips.py).
# The packages start no services where there is no systemd;
# the tests start their own daemons.
set -uo pipefail

needed=(munged mungekey slurmctld slurmd sbatch srun scontrol sinfo scancel)
missing=()
for prog in "${needed[@]}"; do
    command -v "$prog" >/dev/null 2>&1 || [ -x "/usr/sbin/$prog" ] || missing+=("$prog")
done
if [ "${#missing[@]}" -eq 0 ]; then
    echo "slurm_setup: slurm-wlm and munge already installed"
    exit 0
fi
echo "slurm_setup: missing ${missing[*]}"

if ! command -v apt-get >/dev/null 2>&1; then
    echo "slurm_setup: no apt-get on this machine; the Slurm tests will skip (fail under CI=true)"
    exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
    as_root=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    as_root=(sudo -n)
else
    echo "slurm_setup: not root and no password-less sudo; the Slurm tests will skip (fail under CI=true)"
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
if "${as_root[@]}" apt-get update -q \
    && "${as_root[@]}" apt-get install -y -q --no-install-recommends slurm-wlm munge slurm-client
then
    echo "slurm_setup: installed slurm-wlm, munge, slurm-client"
    exit 0
fi
echo "slurm_setup: apt-get failed; the Slurm tests will skip (fail under CI=true)" >&2
exit 1
