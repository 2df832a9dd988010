"""``PeerError``: the one exception type of a compressed collective that failed because of a peer.

A reduction across processes fails when a peer dies, hangs or resets its connection. Inside a
compiled step the failure comes out of XLA, on every backend, as ``jax.errors.JaxRuntimeError``
(jaxlib raises it; no library can raise another type there): the xla backend's from gloo or
NCCL, the tcp backend's from its custom call, with the rank and the cause in the message
("jax_cgx_tcp_allreduce: receiving from rank 1: Connection reset by peer"). What jax_cgx itself
raises about a peer, outside the step (a process that never reached a reduction every process
must lower together; a tcp set-up a peer never joined, or joined twice), is a
:class:`PeerError`, a subclass of it: one ``except jax.errors.JaxRuntimeError`` catches every
one of them, and jax's own collectives' failures too. docs/checkpointing.md has the table of
faults, how each looks and how long each takes to surface.
"""

from __future__ import annotations

import jax

__all__ = ["PeerError"]


class PeerError(jax.errors.JaxRuntimeError):
    """A peer process failed, hung or is not who it claims to be; the message names it and the
    cause. A ``jax.errors.JaxRuntimeError``, as the failures XLA raises inside a step are."""
