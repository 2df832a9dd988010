"""The all-reduce's algorithms by name: what the xla backend runs for ``compressed_allreduce_p``.

Each is the per-device program on rows, XLA collectives around the codec's kernels:
:func:`~jax_cgx._src.exchange.sra.sra_rows` (scatter-reduce-allgather, the default) and
:func:`~jax_cgx._src.exchange.ring.ring_rows`. The backends that own connections run the same
bytes their own way (:mod:`jax_cgx._src.backends`).
"""

from __future__ import annotations

from jax_cgx._src.exchange import wire
from jax_cgx._src.exchange.ring import ring_rows
from jax_cgx._src.exchange.sra import sra_rows

__all__ = ["ROWS", "xla_rows"]

ROWS = {"sra": sra_rows, "ring": ring_rows}


def xla_rows(x, seeds, valid, *, platforms, algorithm, link_gbps, **params):
    """``algorithm``'s program on rows ``x[R, n]``, its messages cut for ``platforms``.

    ``residual=True`` (in ``params``) also returns this rank's compression error; ``segments``
    and the message cap of the platforms and the given link say how messages are cut
    (:mod:`jax_cgx._src.exchange.wire`).
    """
    return ROWS[algorithm](x, seeds, valid, message_cap=wire.message_cap(platforms, link_gbps), **params)
