"""What ``policy="auto"`` knows and predicts: the cost model of a psum and of the compressed exchange.

- :func:`figures`: this machine's figures for a config (the link rate given or measured, the
  codec's rates measured), the same on every process (collective when it measures);
- :func:`predict`: the seconds of a psum and of the compressed exchange of a buffer, from a
  :class:`LinkModel` and :class:`CodecRates`;
- :class:`Figures`, :class:`LinkModel`, :class:`CodecRates`, :class:`ExchangeFit` (a measured
  exchange's fixed cost and rate, in :class:`Figures`).

A 64 MiB float32 all-reduce over 8 ranks with links of 1 Gbit/s each way, 4 bits:

>>> from jax_cgx.cost_model import CodecRates, LinkModel, predict
>>> p = predict(64 * 2**20, 8, 4, 512, LinkModel(1e9 / 8), CodecRates(quantize=4e9, dequantize=6e9))
>>> round(p["psum"] / p["compressed"], 1)  # the predicted speedup over psum
5.0

docs/performance.md explains the model and where it is right and wrong.
"""

from jax_cgx._src.policy.cost_model import CodecRates, LinkModel, predict
from jax_cgx._src.policy.figures import Figures
from jax_cgx._src.policy.pricing import figures
from jax_cgx._src.policy.probes import ExchangeFit

__all__ = ["CodecRates", "ExchangeFit", "Figures", "LinkModel", "figures", "predict"]
