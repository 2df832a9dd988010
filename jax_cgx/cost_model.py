"""What ``policy="auto"`` knows and predicts: the cost model of a psum and of the compressed exchange.

- :func:`figures`: this machine's figures for a config (the link rate given or measured, the
  codec's rates measured), the same on every process (collective when it measures);
- :func:`predict`: the seconds of a psum and of the compressed exchange of a buffer, from a
  :class:`LinkModel` and :class:`CodecRates`;
- :class:`Figures`, :class:`LinkModel`, :class:`CodecRates`.

docs/performance.md explains the model and where it is right and wrong.
"""

from jax_cgx._src.policy.cost_model import CodecRates, LinkModel, predict
from jax_cgx._src.policy.pricing import Figures, figures

__all__ = ["CodecRates", "Figures", "LinkModel", "figures", "predict"]
