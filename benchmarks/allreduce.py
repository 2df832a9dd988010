"""``python -m jax_cgx.bench allreduce`` as a script, for launchers that run scripts.

    python -m jax_cgx.launch -n 4 benchmarks/allreduce.py --share-gpu --sizes-mib 16 64 256 --bits 4 8
    mpirun -np 2 python benchmarks/allreduce.py --sizes-mib 64 --bits 4
"""

from jax_cgx.bench.__main__ import main

if __name__ == "__main__":
    import sys

    main(["allreduce", *sys.argv[1:]])
