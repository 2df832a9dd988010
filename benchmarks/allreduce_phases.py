"""``python -m jax_cgx.bench phases`` as a script, for launchers that run scripts.

    python -m jax_cgx.launch -n 2 benchmarks/allreduce_phases.py --size-mib 64 --bits 4
    python benchmarks/netem/run.py -p 2 --rate 1gbit --script benchmarks/allreduce_phases.py -- --size-mib 64 --bits 4
"""

from jax_cgx.bench.__main__ import main

if __name__ == "__main__":
    import sys

    main(["phases", *sys.argv[1:]])
