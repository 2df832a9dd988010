"""CompressionConfig: what to compress and how, validated once, hashable for jit; and what
``config=None`` means (:func:`default_config`)."""

from __future__ import annotations

import dataclasses
import fractions
import numbers
import os
from collections.abc import Mapping
from typing import Literal, NamedTuple

from jax_cgx._src.config import variables
from jax_cgx._src.config.limits import (
    ALGORITHMS,
    BACKENDS,
    POLICIES,
    QUANTIZED_BITS,
    accepted,
    field_problem,
)
from jax_cgx._src.config.variables import (
    _LINK,
    CONFIG_VARIABLES,
    TORCH_CGX_VARIABLES,
    _execution_from_env,
    fields_from_env,
    link_gbps_from_env,
    log,
)

__all__ = ["CompressionConfig", "GivenLink", "check_environment", "default_config", "given_link", "given_link_gbps"]


@dataclasses.dataclass(frozen=True)
class CompressionConfig:
    """Settings of the max-min quantization codec and of the compressed all-reduce.

    Frozen and hashable (a static argument under ``jit``); :meth:`replace` makes a changed copy,
    :meth:`from_env` one from torch_cgx's and jax_cgx's environment variables. Every field is
    checked when the config is made: a bad value raises ``TypeError`` or ``ValueError`` naming it.
    docs/choosing-settings.md says which values suit which link.

    The constructor's arguments are the fields, each described under Attributes.

    Args:
      bits: 1..8, 16 or 32 (default 4).
      bucket_size: 1..2^31-1 values (default 128).
      stochastic: a bool (default False).
      skip_incomplete_buckets: a bool (default False).
      min_size: an int >= 0 (default 1024).
      fusion_buffer_mb: a finite number of MiB >= 1/1024 (default 64).
      half_dtype: ``"bfloat16"`` (the default) or ``"float16"``.
      backend: ``"auto"`` (the default), ``"xla"``, ``"nccl"`` or ``"tcp"``.
      algorithm: ``"sra"`` (the default) or ``"ring"``.
      hierarchical: a bool (default False).
      pipeline_segments: 0..64 (default 0: by size).
      policy: ``"always"`` (the default) or ``"auto"``.
      link_gbps: a number of Gbit/s > 0 (``inf``: unlimited), or None (the default).

    Raises:
      TypeError: ``bits``, ``bucket_size``, ``min_size`` or ``pipeline_segments`` not an int;
        ``stochastic``, ``skip_incomplete_buckets`` or ``hierarchical`` not a bool;
        ``fusion_buffer_mb`` or ``link_gbps`` not a number.
      ValueError: a value out of its range above, or an unknown ``half_dtype``, ``backend``,
        ``algorithm`` or ``policy``.

    Attributes:
      bits: **Codec.** Bits per quantized value, 1..8; 16 means an all-reduce in
        ``half_dtype``; 32 means no compression (a plain ``psum``).
      bucket_size: consecutive values sharing one (min, scale) pair. Smaller buckets
        give a smaller error and cost more metadata (8 bytes per bucket). The default, 128,
        with ``min_size`` 1024 is the setting measured best across the examples
        (docs/choosing-settings.md): at 4 bits it sends 4.5 bits per value, 1/7.1 of float32.
      stochastic: stochastic (unbiased) rounding instead of round-to-nearest; needs a
        PRNG key wherever values are quantized.
      skip_incomplete_buckets: leave the last, shorter bucket of a buffer uncompressed
        (as torch_cgx does) instead of quantizing it.
      half_dtype: the 16-bit float type used when ``bits == 16``.
      min_size: **Fusion.** Arrays with fewer elements than this are reduced uncompressed
        (empty arrays always are). The default, 1024, keeps a model's small leaves (biases, norm
        scales) exact: they cost few bytes and carry much of a transformer's quantization error.
      fusion_buffer_mb: small arrays are fused into buffers of at most this many MiB
        before they are compressed and exchanged (on CPUs an array of at least a quarter
        of it is exchanged on its own, where it lies: docs/algorithm.md). A finite number, at least
        ``MIN_FUSION_BUFFER_MB`` (1/1024 MiB, 1 KiB). Each buffer is one exchange in the
        compiled program, so a reduction may need at most ``MAX_FUSION_BUFFERS`` (1024)
        of them: more raises ``ValueError`` when it is traced (compile time grows with the
        number of buffers: about 45 ms each on XLA:CPU). Raise it for large pytrees.
      backend: **Execution.** Who runs the compressed exchange. ``"xla"``: XLA collectives
        (``all_to_all``/``all_gather``/``ppermute``) around the codec kernels, on any
        platform. ``"nccl"``: one custom call per fusion buffer over jax_cgx's own NCCL
        communicators (GPU only; see :func:`jax_cgx.nccl.setup`). ``"tcp"``: one custom
        call per fusion buffer over jax_cgx's own TCP connections, the codec pipelined with
        the wire (CPU only, SRA only; see :func:`jax_cgx.tcp.setup`). ``"auto"``: ``tcp``
        or ``nccl`` where :func:`jax_cgx.tcp.setup` or :func:`jax_cgx.nccl.setup` connected
        the reduction's axes, otherwise ``xla``. All backends give bitwise the same result.
      algorithm: ``"sra"`` (scatter-reduce/all-gather: every value quantized twice) or
        ``"ring"`` (a ring reduce-scatter re-quantizing the partial sum at every hop, then
        an all-gather: W quantizations, the same bytes on the wire, neighbour-only
        traffic). See docs/algorithm.md.
      hierarchical: for a reduction over several axes ``(outer..., inner)``, sum over the
        last (intra-node) axis exactly with a reduce-scatter, run the compressed exchange
        over the other axes, and all-gather back over the inner axis (docs/multinode.md).
      pipeline_segments: how the exchange is cut, 0..64; 0 picks by size. nccl and tcp
        backends: each chunk is split into this many segments so that quantizing one
        segment overlaps sending the previous (by size: one segment on nccl, about 1 MiB of
        input per segment on tcp). xla backend: every collective's per-peer message is sent
        as this many messages; by size, on CPU with several processes, at most 2 ms of
        the link each where its rate is given (``link_gbps``), else 256 KiB (gloo runs
        large two-way messages at half the line rate of a slow link, and every message is
        a round of its own, which costs more than it saves on a fast one); one message
        elsewhere. With ``policy="auto"`` and no rate given, the all-reduce
        (:func:`jax_cgx.compressed_psum` and what builds on it) times each group's largest
        buffer both cut and in one message, and the faster runs (the sharded collectives
        keep the cut). Never changes the result.
      policy: ``"always"`` compresses every buffer the lanes give it; ``"auto"`` reduces
        each fusion buffer with plain ``psum`` where the cost model (with the link and the
        codec measured the first time, or timed where the prediction is a near tie) says
        compressing would not be faster, and over nodes chooses the form (flat or
        hierarchical, SRA or ring); each decision is logged once and shown by
        :func:`jax_cgx.explain`. Bitwise the same as ``"always"`` where it compresses.
      link_gbps: each rank's link rate in Gbit/s each way (``inf``: unlimited), where you
        know it; None: ``JAX_CGX_LINK_GBPS``, else ``policy="auto"`` measures it. Given,
        nothing is measured over the network, and the xla backend sizes its messages to it.

    Examples:
      >>> config = jax_cgx.CompressionConfig(bits=8, bucket_size=128)
      >>> config.replace(bits=4).bits
      4
    """

    bits: int = 4
    bucket_size: int = 128
    stochastic: bool = False
    skip_incomplete_buckets: bool = False
    min_size: int = 1024
    fusion_buffer_mb: float = 64
    half_dtype: Literal["bfloat16", "float16"] = "bfloat16"
    backend: Literal["auto", "xla", "nccl", "tcp"] = "auto"
    algorithm: Literal["sra", "ring"] = "sra"
    hierarchical: bool = False
    pipeline_segments: int = 0
    policy: Literal["always", "auto"] = "always"
    link_gbps: float | None = None

    def __post_init__(self) -> None:
        for name in ("bits", "bucket_size", "min_size"):
            _check_int(name, getattr(self, name))
        for name in ("stochastic", "skip_incomplete_buckets"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"CompressionConfig: {name} must be a bool, got "
                    f"{getattr(self, name)!r}"
                )
        if isinstance(self.fusion_buffer_mb, bool) or not isinstance(
            self.fusion_buffer_mb, numbers.Real
        ):
            raise TypeError(
                "CompressionConfig: fusion_buffer_mb must be a number of MiB, got "
                f"{self.fusion_buffer_mb!r}"
            )
        if not isinstance(self.fusion_buffer_mb, (int, float)):  # a numpy number: as the Python one
            integral = isinstance(self.fusion_buffer_mb, numbers.Integral)
            object.__setattr__(self, "fusion_buffer_mb", (int if integral else float)(self.fusion_buffer_mb))
        _check_int("pipeline_segments", self.pipeline_segments)
        for name in ("bits", "bucket_size", "min_size", "fusion_buffer_mb", "pipeline_segments"):
            value = getattr(self, name)
            if problem := field_problem(name, value):
                raise ValueError(f"CompressionConfig: {name}={value!r} {problem}; {accepted(name)}")
        if not isinstance(self.half_dtype, str) or self.half_dtype not in ("bfloat16", "float16"):
            raise ValueError(
                "CompressionConfig: half_dtype must be 'bfloat16' or 'float16', got "
                f"{self.half_dtype!r}"
            )
        if self.backend not in BACKENDS:
            raise ValueError(
                f"CompressionConfig: backend must be one of {', '.join(map(repr, BACKENDS))}, "
                f"got {self.backend!r}"
            )
        if self.algorithm not in ALGORITHMS:
            raise ValueError(
                f"CompressionConfig: algorithm must be 'sra' or 'ring', got {self.algorithm!r}"
            )
        if not isinstance(self.hierarchical, bool):
            raise TypeError(f"CompressionConfig: hierarchical must be a bool, got {self.hierarchical!r}")
        if self.policy not in POLICIES:
            raise ValueError(
                f"CompressionConfig: policy must be 'always' or 'auto', got {self.policy!r}"
            )
        if self.link_gbps is not None:
            if isinstance(self.link_gbps, bool) or not isinstance(self.link_gbps, numbers.Real):
                raise TypeError(
                    f"CompressionConfig: link_gbps must be a number of Gbit/s or None, got {self.link_gbps!r}"
                )
            if not self.link_gbps > 0:  # also rejects nan
                raise ValueError(
                    f"CompressionConfig: link_gbps must be > 0 Gbit/s (inf: unlimited), got {self.link_gbps}"
                )

    @property
    def enabled(self) -> bool:
        """False when ``bits == 32``: reductions are plain, exact ``psum`` calls."""
        return self.bits != 32

    @property
    def quantizes(self) -> bool:
        """True for max-min quantization (``bits`` in 1..8)."""
        return self.bits in QUANTIZED_BITS

    @property
    def fusion_buffer_bytes(self) -> int:
        # Exact: a float near the largest finite one times 2**20 would overflow to inf.
        return int(fractions.Fraction(self.fusion_buffer_mb) * 2**20)

    def replace(self, **changes) -> CompressionConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **overrides
    ) -> CompressionConfig:
        """A config from torch_cgx's environment variables.

        ===========================================  =========  ==========================
        variable                                     default    field
        ===========================================  =========  ==========================
        ``CGX_COMPRESSION_QUANTIZATION_BITS``        32 (off)   ``bits``
        ``CGX_COMPRESSION_BUCKET_SIZE``              512        ``bucket_size``
        ``CGX_COMPRESSION_SKIP_INCOMPLETE_BUCKETS``  0          ``skip_incomplete_buckets``
        ``CGX_COMPRESSION_MINIMAL_SIZE``             16         ``min_size`` (never < 16)
        ``CGX_FUSION_BUFFER_SIZE_MB``                64         ``fusion_buffer_mb`` (finite,
                                                                >= 1/1024)
        ``CGX_CROSS_COMMUNICATOR_TYPE``              (unset)    ``backend``: NCCL -> nccl,
                                                                MPI or SHM -> xla
        ``JAX_CGX_BACKEND``                          auto       ``backend`` (wins over the above)
        ``JAX_CGX_ALGORITHM``                        sra        ``algorithm``
        ``JAX_CGX_HIERARCHICAL``                     0          ``hierarchical``
        ``JAX_CGX_PIPELINE_SEGMENTS``                0          ``pipeline_segments`` (0..64)
        ``JAX_CGX_POLICY``                           always     ``policy`` (always or auto)
        ``JAX_CGX_LINK_GBPS``                        (unset)    ``link_gbps`` (> 0, or inf)
        ===========================================  =========  ==========================

        torch_cgx's ``CGX_INNER_COMMUNICATOR_TYPE`` and ``CGX_INTRA_BROADCAST`` are
        validated but change nothing: jax_cgx's intra-node stage (hierarchical mode) is
        always XLA's uncompressed reduce-scatter and all-gather (docs/algorithm.md).

        The defaults are torch_cgx's (buckets of 512, ``min_size`` 16), not ``CompressionConfig()``'s,
        so that a torch_cgx job's variables mean here what they meant there.

        Keyword ``overrides`` win over the environment. A malformed value raises
        ``ValueError`` naming the variable, the value and what is accepted; a minimal size below
        16 is raised to 16 with an INFO line. Every variable jax_cgx reads: docs/environment.md.
        """
        return cls(**{**fields_from_env(os.environ if environ is None else environ), **overrides})


def check_environment(config_given: bool = True, api: str = "compressed_psum",
                      environ: Mapping[str, str] | None = None) -> None:
    """Validate every variable :meth:`CompressionConfig.from_env` reads, also where a config is
    given and they are unused: a malformed one raises the ``ValueError`` from_env raises (naming
    the variable, its value and what is accepted), so that a setting is never ignored unnoticed.
    Valid ones that a given config leaves unused are logged once (INFO). Runs once per set of
    values.

    ``JAX_CGX_LINK_GBPS`` is left to what reads it, the ``policy='auto'`` calibration, which
    raises after the processes agree (raising here, on one process only, would leave the others
    waiting in that agreement); a malformed value is logged here (WARNING), once.
    """
    env = os.environ if environ is None else environ
    seen = tuple((name, env[name]) for name in CONFIG_VARIABLES if name in env)
    if (config_given, seen) in variables._said:
        return
    CompressionConfig.from_env({name: value for name, value in seen if name != _LINK})
    try:
        link_gbps_from_env(env)
    except ValueError as err:
        log.warning("jax_cgx: %s. It raises when policy='auto' calibrates; elsewhere it is ignored", err)
    unused = [name for name, value in seen if value.strip() and name != _LINK]  # policy reads the link rate
    if config_given and unused:
        log.info("jax_cgx: %s given a config: %s set in the environment but unused (they apply where config=None)",
                 api, ", ".join(unused))
    variables._said.add((config_given, seen))


def default_config(api: str = "compressed_psum", environ: Mapping[str, str] | None = None) -> CompressionConfig:
    """What ``config=None`` means, for every function that takes it: ``CompressionConfig()`` with the
    ``JAX_CGX_*`` variables applied; where one of torch_cgx's ``CGX_*`` is set, :meth:`from_env
    <CompressionConfig.from_env>`, torch_cgx's defaults included, so a torch_cgx job runs as there
    (uncompressed without ``CGX_COMPRESSION_QUANTIZATION_BITS``). Logged once (INFO), naming ``api``."""
    env = os.environ if environ is None else environ
    set_here = [f"{name}={env[name].strip()}" for name in CONFIG_VARIABLES if env.get(name, "").strip()]
    if any(env.get(name, "").strip() for name in TORCH_CGX_VARIABLES):
        config = CompressionConfig.from_env(env)
        source = f"torch_cgx's variables (CompressionConfig.from_env(): {', '.join(set_here)})"
        hint = ("bits=32, torch_cgx's default, reduces exactly: set CGX_COMPRESSION_QUANTIZATION_BITS (1..8), "
                "or pass config=, to compress" if not config.enabled else "Pass config= to choose")
    else:
        config = CompressionConfig(**_execution_from_env(env))
        source = "CompressionConfig()'s defaults, as no torch_cgx variable (CGX_*) is set"
        if set_here:
            source += f", with {', '.join(set_here)}"
        hint = "Pass config= to choose (CompressionConfig(bits=32): no compression)"
    if ("default", config, source) not in variables._said:
        variables._said.add(("default", config, source))
        log.info("jax_cgx: %s with config=None uses %r: %s. %s", api, config, source, hint)
    return config


class GivenLink(NamedTuple):
    """The link rate per rank the user gave, and where (:func:`given_link`)."""

    #: Gbit/s per rank; None where nothing gives it (``policy="auto"`` measures it).
    gbps: float | None
    #: Where it was given: ``"CompressionConfig.link_gbps"``, ``"JAX_CGX_LINK_GBPS"`` or None.
    source: str | None
    #: The error of a malformed ``JAX_CGX_LINK_GBPS`` (``gbps`` is then None), for the caller to
    #: raise where it may: a process must not raise before an agreement its peers wait in.
    error: ValueError | None


def given_link(config: CompressionConfig | None) -> GivenLink:
    """Which link rate wins, decided here only: ``config.link_gbps``, else ``JAX_CGX_LINK_GBPS``,
    else none (``config=None``: the environment's alone)."""
    if config is not None and config.link_gbps is not None:
        return GivenLink(float(config.link_gbps), "CompressionConfig.link_gbps", None)
    try:
        env = link_gbps_from_env()
    except ValueError as err:
        return GivenLink(None, None, err)
    return GivenLink(env, None if env is None else "JAX_CGX_LINK_GBPS", None)


def given_link_gbps(config: CompressionConfig) -> float | None:
    """The link's rate per rank where the user gave it (:func:`given_link`); None where neither
    says (or the variable is malformed: logged by :func:`check_environment`, and raised where
    ``policy='auto'`` calibrates). The xla backend sizes its messages to it
    (:func:`jax_cgx._src.exchange.wire.message_cap`)."""
    return given_link(config).gbps


def _check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"CompressionConfig: {name} must be an int, got {value!r}")
