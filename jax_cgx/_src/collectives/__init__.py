"""Compressed collectives: ``compressed_psum`` / ``compressed_pmean`` and how they run.

- :mod:`~jax_cgx._src.collectives.psum`: ``compressed_psum`` / ``compressed_pmean`` on pytrees: lanes,
  fusion buffers;
- :mod:`~jax_cgx._src.collectives.wire_bytes`: ``bytes_on_wire``, what one rank sends, for each op;
- :mod:`~jax_cgx._src.collectives.backward`: ``reduce_in_backward``, the mean taken in the backward pass;
- :mod:`~jax_cgx._src.collectives.reduce_scatter`, :mod:`~jax_cgx._src.collectives.all_gather`:
  ``compressed_psum_scatter`` and ``compressed_all_gather`` (sharded training) on pytrees;
  :mod:`~jax_cgx._src.collectives.scatter_gather` holds what they share (lanes, fusion of whole
  leaves, keys, bytes on the wire);
- :mod:`~jax_cgx._src.collectives.plan`: how each leaf is reduced (its lane, its fusion buffers, and
  with ``policy="auto"`` each buffer's decision and form, from :mod:`jax_cgx._src.policy`);
- :mod:`~jax_cgx._src.collectives.explain`: ``jax_cgx.explain``, the plan printed.

One buffer's collective (each op's primitive, its program and its rules) is the exchange's
(:mod:`jax_cgx._src.exchange`); ``policy="auto"``'s figures and decisions are the policy's
(:mod:`jax_cgx._src.policy`).

Data flows one way: collectives -> backends, codec -> config. Each reduction's backend is
chosen once while tracing and carried by its primitive, whose one lowering rule hands it to that
backend (:mod:`jax_cgx._src.backends`); nothing here names a transport.
"""

from jax_cgx._src.collectives.all_gather import compressed_all_gather
from jax_cgx._src.collectives.backward import reduce_in_backward
from jax_cgx._src.collectives.explain import Explanation, explain
from jax_cgx._src.collectives.psum import ConfigSpec, compressed_pmean, compressed_psum
from jax_cgx._src.collectives.reduce_scatter import compressed_psum_scatter
from jax_cgx._src.collectives.wire_bytes import bytes_on_wire
from jax_cgx._src.policy.pricing import Figures, calibrate

__all__ = ["compressed_psum", "compressed_pmean", "compressed_psum_scatter", "compressed_all_gather", "bytes_on_wire", "ConfigSpec", "explain", "Explanation",
           "calibrate", "Figures", "reduce_in_backward"]
