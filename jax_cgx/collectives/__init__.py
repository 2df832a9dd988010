"""Compressed collectives: ``compressed_psum`` / ``compressed_pmean`` and how they run.

- :mod:`~jax_cgx.collectives.allreduce`: the public functions: fusion buffers, ``bytes_on_wire``;
- :mod:`~jax_cgx.collectives.backward`: ``reduce_in_backward``, the mean taken in the backward pass;
- :mod:`~jax_cgx.collectives.reduce_scatter`, :mod:`~jax_cgx.collectives.all_gather`:
  ``compressed_psum_scatter`` and ``compressed_all_gather`` (sharded training), each a
  primitive with its rules and its pytree API; :mod:`~jax_cgx.collectives.sharded` holds
  what they share (lanes, fusion of whole leaves, keys, bytes on the wire);
- :mod:`~jax_cgx.collectives.plan`: how each leaf is reduced (its lane, its fusion buffers);
- :mod:`~jax_cgx.collectives.policy`: ``policy="auto"``: the measured figures and each buffer's
  decision, with :mod:`~jax_cgx.collectives.cost_model` (the predicted times),
  :mod:`~jax_cgx.collectives.probes` (timing this machine) and
  :mod:`~jax_cgx.collectives.explain` (``jax_cgx.explain``: the plan, printed);
- :mod:`~jax_cgx.collectives.primitive`: the all-reduce of one buffer as a JAX primitive (its
  rules, the xla backend's program, and :func:`compressed_sum` that binds it);
- :mod:`~jax_cgx.collectives.sra`, :mod:`~jax_cgx.collectives.ring`,
  :mod:`~jax_cgx.collectives.hierarchical`: one module per algorithm;
- :mod:`~jax_cgx.collectives.chunks`: how SRA and the ring cut a buffer, and their shared last step;
- :mod:`~jax_cgx.collectives.wire`: encodings as byte rows and the collectives that move them.

Data flows one way: collectives -> backends, codec -> config. Each reduction's backend is
chosen once while tracing and carried by its primitive, whose one lowering rule hands it to that
backend (:mod:`jax_cgx.backends`); nothing here names a transport.
"""

from jax_cgx.collectives.all_gather import compressed_all_gather
from jax_cgx.collectives.allreduce import ConfigSpec, bytes_on_wire, compressed_pmean, compressed_psum
from jax_cgx.collectives.backward import reduce_in_backward
from jax_cgx.collectives.explain import Explanation, explain
from jax_cgx.collectives.policy import Figures, calibrate
from jax_cgx.collectives.reduce_scatter import compressed_psum_scatter

__all__ = ["compressed_psum", "compressed_pmean", "compressed_psum_scatter", "compressed_all_gather", "bytes_on_wire", "ConfigSpec", "explain", "Explanation",
           "calibrate", "Figures", "reduce_in_backward"]
