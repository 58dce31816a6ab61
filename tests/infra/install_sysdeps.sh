#!/usr/bin/env bash
# Install the system packages the launcher tests need: Slurm (slurmctld, slurmd, sbatch),
# munge (Slurm's authentication) and numactl (deepspeed --bind_cores_to_rank).
# Idempotent: does nothing when every tool is already on PATH. As root it installs them
# with apt-get; as any other user it prints what to install and exits 0, and the tests
# that need the tools skip with a reason.
set -euo pipefail

PACKAGES=(slurm-wlm munge numactl)
# One command per package that proves it is installed (slurm-wlm pulls slurmctld, slurmd, slurm-client).
TOOLS=(slurmctld slurmd sbatch srun scontrol munged numactl)

missing_tools() {
    local t
    for t in "${TOOLS[@]}"; do
        # Debian puts the daemons in /usr/sbin, which is not always on a user's PATH.
        command -v "$t" >/dev/null 2>&1 || [[ -x "/usr/sbin/$t" ]] || echo "$t"
    done
}

missing=$(missing_tools | tr '\n' ' ')
if [[ -z "${missing// /}" ]]; then
    echo "install_sysdeps: slurm-wlm, munge and numactl already installed"
    exit 0
fi

if [[ "$(id -u)" != "0" ]]; then
    echo "install_sysdeps: missing tools: ${missing}"
    echo "install_sysdeps: not root, so not installing. To enable the Slurm/numactl launcher tests run:"
    echo "    sudo apt-get update && sudo apt-get install -y ${PACKAGES[*]}"
    echo "install_sysdeps: until then those tests skip with a reason."
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_sysdeps: missing tools: ${missing}; no apt-get on this system, install ${PACKAGES[*]} with your package manager"
    exit 0
fi

echo "install_sysdeps: installing ${PACKAGES[*]} (missing: ${missing})"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
# --no-install-recommends keeps out the X/mail extras slurm-wlm recommends; the daemons need none of them.
apt-get install -y -q --no-install-recommends "${PACKAGES[@]}"
missing=$(missing_tools | tr '\n' ' ')
if [[ -n "${missing// /}" ]]; then
    echo "install_sysdeps: still missing after install: ${missing}" >&2
    exit 1
fi
echo "install_sysdeps: done"
