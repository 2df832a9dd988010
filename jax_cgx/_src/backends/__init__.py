"""The backends of the compressed collectives behind one protocol (:mod:`~jax_cgx._src.backends.protocol`).

- :mod:`~jax_cgx._src.backends.protocol`: :class:`Backend`, the registry, :func:`choose` (once per
  reduction, while tracing) and the one lowering rule each collective's primitive registers;
- :mod:`~jax_cgx._src.backends.xla`: the xla backend (the collectives' own programs), always present;
- :mod:`~jax_cgx._src.backends.groups`: reduction groups, family keys and :class:`~jax_cgx._src.backends.groups.Families`, the mesh
  arithmetic of the backends that own connections (``jax_cgx.nccl``, ``jax_cgx.tcp``);
- :mod:`~jax_cgx._src.backends.agreement`: the processes agree on every compressed reduction they
  run together, when it is lowered.

Internal: the public faces are ``CompressionConfig(backend=...)``, :mod:`jax_cgx.nccl` and
:mod:`jax_cgx.tcp`.
"""

from jax_cgx._src.backends import xla  # noqa: F401  (the xla backend is always registered)
from jax_cgx._src.backends.protocol import (
    Backend,
    BackendError,
    CommunicatorInfo,
    Reduction,
    XlaProgram,
    choose,
    choose_in_trace,
    get,
    mean_scale,
    register,
    register_lowering,
    registered,
)

__all__ = ["Backend", "BackendError", "CommunicatorInfo", "Reduction", "XlaProgram", "choose", "choose_in_trace",
           "get", "mean_scale", "register", "register_lowering", "registered"]
