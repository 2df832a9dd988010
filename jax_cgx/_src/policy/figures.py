"""What ``policy="auto"`` knows about this machine (:class:`Figures`) and what it decided for a
buffer (:class:`Decision`): the records :mod:`jax_cgx._src.policy.pricing` measures and returns."""

from __future__ import annotations

import dataclasses

from jax_cgx._src.policy.cost_model import CodecRates, LinkModel
from jax_cgx._src.policy.probes import ExchangeFit

__all__ = ["Decision", "Figures", "gbits"]


def gbits(rate: float) -> str:
    return "unlimited" if rate == float("inf") else f"{rate * 8 / 1e9:.3g} Gbit/s"


@dataclasses.dataclass(frozen=True)
class Figures:
    """What the cost model knows about this machine, the same on every process.

    Made by :func:`~jax_cgx.cost_model.figures` and :func:`~jax_cgx.calibrate`.

    Attributes:
      link: the link's rate and per-message cost (its latency 0 where the rate was given).
      rates: the codec's measured rates.
      platform: the JAX platform measured (``"cpu"``, ``"gpu"``, ...).
      link_source: where the link's figures come from: ``"measured over N devices"``,
        ``"JAX_CGX_LINK_GBPS"`` or ``"CompressionConfig.link_gbps"``.
      share: ranks per core (CPU devices of one process share its cores); 1.0 off CPU.
      exchange: the compressed exchange's measured fixed cost and rate.
    """

    link: LinkModel
    rates: CodecRates
    platform: str
    link_source: str  # "measured over N devices", "JAX_CGX_LINK_GBPS" or "CompressionConfig.link_gbps"
    share: float = 1.0  # ranks per core: CPU devices of one process share its cores
    exchange: ExchangeFit = ExchangeFit()

    @property
    def link_measured(self) -> bool:
        """The link's figures come from the probe (not from a rate the user gave)."""
        return self.link_source.startswith("measured")

    def describe(self) -> str:
        return (f"link {gbits(self.link.bandwidth)} per rank each way, {self.link.latency * 1e3:.3g} ms per message "
                f"({self.link_source}); {self.platform} codec: quantize {self.rates.quantize / 1e9:.3g} GB/s, "
                f"dequantize {self.rates.dequantize / 1e9:.3g} GB/s, copy {self.rates.add / 1e9:.3g} GB/s"
                + (f", {self.share:g} devices per core" if self.share > 1 else "")
                + (f"; compressed exchange measured at {self.exchange.overhead * 1e3:.3g} ms + "
                   f"{self.exchange.rate / 1e9:.3g} GB/s" if self.exchange != ExchangeFit() else ""))


@dataclasses.dataclass(frozen=True)
class Decision:
    """Whether one buffer is compressed, and the two predictions that decided it (seconds)."""

    compress: bool
    psum_s: float
    compressed_s: float
    measured: bool = False  # the two times were measured on this buffer's size, not predicted
    backend: str = "xla"  # the backend the compressed exchange was priced on
