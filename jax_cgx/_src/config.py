"""CompressionConfig: what to compress and how, validated once, hashable for jit."""

from __future__ import annotations

import dataclasses
import fractions
import logging
import math
import numbers
import os
from collections.abc import Mapping
from typing import Literal

__all__ = [
    "CompressionConfig",
    "CONFIG_VARIABLES",
    "ENV_VARS",
    "JAX_CGX_ENV_VARS",
    "BACKENDS",
    "MAX_SEGMENTS",
    "ALGORITHMS",
    "POLICIES",
    "TORCH_CGX_VARIABLES",
    "check_environment",
    "default_config",
    "given_link_gbps",
    "link_gbps_from_env",
    "MIN_FUSION_BUFFER_MB",
    "MAX_FUSION_BUFFERS",
]

log = logging.getLogger("jax_cgx")

_QUANT_BITS = tuple(range(1, 9))
_VALID_BITS = _QUANT_BITS + (16, 32)

# torch_cgx's environment variables, with their defaults (bits=32 means compression off).
ENV_VARS: Mapping[str, str] = {
    "CGX_COMPRESSION_QUANTIZATION_BITS": "32",
    "CGX_COMPRESSION_BUCKET_SIZE": "512",
    "CGX_COMPRESSION_SKIP_INCOMPLETE_BUCKETS": "0",
    "CGX_COMPRESSION_MINIMAL_SIZE": "16",
    "CGX_FUSION_BUFFER_SIZE_MB": "64",
}
# jax_cgx's own variables (the execution settings torch_cgx has no variable for).
JAX_CGX_ENV_VARS: Mapping[str, str] = {
    "JAX_CGX_BACKEND": "auto",
    "JAX_CGX_ALGORITHM": "sra",
    "JAX_CGX_HIERARCHICAL": "0",
    "JAX_CGX_PIPELINE_SEGMENTS": "0",
    "JAX_CGX_POLICY": "always",
    "JAX_CGX_LINK_GBPS": "",  # unset: policy="auto" measures the link
}
# Every variable from_env reads (torch_cgx's communicator types included).
CONFIG_VARIABLES = (*ENV_VARS, "CGX_CROSS_COMMUNICATOR_TYPE", "CGX_INNER_COMMUNICATOR_TYPE",
                    "CGX_INTRA_BROADCAST", *JAX_CGX_ENV_VARS)
# torch_cgx's own: any of them set makes config=None torch_cgx's settings (default_config).
TORCH_CGX_VARIABLES = tuple(name for name in CONFIG_VARIABLES if name.startswith("CGX_"))
BACKENDS = ("auto", "xla", "nccl", "tcp")
ALGORITHMS = ("sra", "ring")
POLICIES = ("always", "auto")
# torch_cgx's transport choices, accepted for its cross-node communicator.
_CROSS_COMMUNICATORS = {"NCCL": "nccl", "MPI": "xla", "SHM": "xla"}
# The most messages one collective is cut into (pipeline_segments' bound; xla_ffi's kMaxSegments).
MAX_SEGMENTS = 64
# torch_cgx never lets the minimal size fall below this.
_MIN_SIZE_FLOOR = 16
# The smallest fusion buffer: 1 KiB (256 float32 values). Every buffer costs its own
# collectives and kernel launches, so smaller ones only add overhead (1e-9 MiB would put
# one value in each).
MIN_FUSION_BUFFER_MB = 2.0**-10
# Buckets beyond this are never needed: a buffer holds fewer values (collectives/chunks.py).
MAX_BUCKET_SIZE = 2**31 - 1
# The most fusion buffers one compressed_psum may cut its values into. Every buffer is its own
# exchange in the compiled program, so compile time grows with their number (XLA:CPU, 8
# devices: 256 buffers take 11 s to compile, 4000 over 2 minutes). 1024 buffers at the
# default 64 MiB are 64 GiB per device in one reduction.
MAX_FUSION_BUFFERS = 1024


@dataclasses.dataclass(frozen=True)
class CompressionConfig:
    """Settings of the max-min quantization codec and of the compressed all-reduce.

    Attributes:
      bits: bits per quantized value, 1..8; 16 means an all-reduce in ``half_dtype``;
        32 means no compression (a plain ``psum``).
      bucket_size: consecutive values sharing one (min, scale) pair. Smaller buckets
        give a smaller error and cost more metadata (8 bytes per bucket).
      stochastic: stochastic (unbiased) rounding instead of round-to-nearest; needs a
        PRNG key wherever values are quantized.
      skip_incomplete_buckets: leave the last, shorter bucket of a buffer uncompressed
        (as torch_cgx does) instead of quantizing it.
      min_size: arrays with fewer elements than this are reduced uncompressed (empty
        arrays always are).
      fusion_buffer_mb: small arrays are fused into buffers of at most this many MiB
        before they are compressed and exchanged. A finite number, at least
        ``MIN_FUSION_BUFFER_MB`` (1/1024 MiB, 1 KiB). Each buffer is one exchange in the
        compiled program, so a reduction may need at most ``MAX_FUSION_BUFFERS`` (1024)
        of them: more raises ``ValueError`` when it is traced (compile time grows with the
        number of buffers: about 45 ms each on XLA:CPU, over 2 minutes for 0.001 MiB
        buffers of a 4 MiB array). Raise ``fusion_buffer_mb`` for large pytrees.
      half_dtype: the 16-bit float type used when ``bits == 16``.
      backend: who runs the compressed exchange. ``"xla"``: XLA collectives
        (``all_to_all``/``all_gather``/``ppermute``) around the codec kernels, on any
        platform. ``"nccl"``: one custom call per fusion buffer over jax_cgx's own NCCL
        communicators (GPU only; see :func:`jax_cgx.nccl.setup`). ``"tcp"``: one custom
        call per fusion buffer over jax_cgx's own TCP connections, the codec pipelined with
        the wire (CPU only, SRA only; see :func:`jax_cgx.tcp.setup`). ``"auto"``: ``tcp``
        on CPU when connections exist for the mesh, otherwise ``xla`` (on GPUs too: the nccl
        backend measured slower than xla, so auto runs it only where asked for; it warns).
        All backends give bitwise the same result.
      algorithm: ``"sra"`` (scatter-reduce/all-gather: every value quantized twice) or
        ``"ring"`` (a ring reduce-scatter re-quantizing the partial sum at every hop, then
        an all-gather: W quantizations, the same bytes on the wire, neighbour-only
        traffic). See docs/algorithm.md.
      hierarchical: for a reduction over several axes ``(outer..., inner)``, sum over the
        last (intra-node) axis uncompressed with a reduce-scatter, run the compressed
        exchange over the other axes, and all-gather back over the inner axis.
      pipeline_segments: how the exchange is cut, 0..64; 0 picks by size. nccl and tcp
        backends: each chunk is split into this many segments so that quantizing one
        segment overlaps sending the previous (by size: one segment on nccl, where the
        GPU's kernels leave nothing worth overlapping and every segment costs NCCL calls;
        about 1 MiB of input per segment on tcp). xla backend: every collective's per-peer message is sent
        as this many messages; by size, on CPU with several processes, at most 2 ms of
        the link each where its rate is given (``link_gbps``), else 256 KiB (2 ms of 1
        Gbit/s: gloo runs large two-way messages at half the line rate of a slow link,
        and every message is a round of its own, which costs more than it saves on a fast
        one); one message elsewhere. Never changes the result.

    Examples:
      >>> config = jax_cgx.CompressionConfig(bits=8, bucket_size=128)
      >>> config.replace(bits=4).bits
      4
    """

    bits: int = 4
    bucket_size: int = 512
    stochastic: bool = False
    skip_incomplete_buckets: bool = False
    min_size: int = 16
    fusion_buffer_mb: float = 64
    half_dtype: Literal["bfloat16", "float16"] = "bfloat16"
    backend: Literal["auto", "xla", "nccl", "tcp"] = "auto"
    algorithm: Literal["sra", "ring"] = "sra"
    hierarchical: bool = False
    pipeline_segments: int = 0
    policy: Literal["always", "auto"] = "always"
    link_gbps: float | None = None

    def __post_init__(self) -> None:
        _check_int("bits", self.bits)
        if self.bits not in _VALID_BITS:
            raise ValueError(
                f"CompressionConfig: bits={self.bits} is not supported; use 1..8 for "
                "max-min quantization, 16 for a half-precision all-reduce or 32 for no "
                "compression"
            )
        _check_int("bucket_size", self.bucket_size)
        if not 1 <= self.bucket_size <= MAX_BUCKET_SIZE:
            raise ValueError(
                f"CompressionConfig: bucket_size must be in 1..{MAX_BUCKET_SIZE} (2^31 - 1: a buffer's "
                f"values fit in fewer), got {self.bucket_size}"
            )
        for name in ("stochastic", "skip_incomplete_buckets"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"CompressionConfig: {name} must be a bool, got "
                    f"{getattr(self, name)!r}"
                )
        _check_int("min_size", self.min_size)
        if self.min_size < 0:
            raise ValueError(f"CompressionConfig: min_size must be >= 0, got {self.min_size}")
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
        mb = self.fusion_buffer_mb
        if not ((isinstance(mb, int) or math.isfinite(mb)) and mb >= MIN_FUSION_BUFFER_MB):
            raise ValueError(
                "CompressionConfig: fusion_buffer_mb must be a finite number of MiB >= "
                f"1/1024 (1 KiB), got {mb}; e.g. 64 (the default)"
            )
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
        _check_int("pipeline_segments", self.pipeline_segments)
        if not 0 <= self.pipeline_segments <= MAX_SEGMENTS:
            raise ValueError(
                f"CompressionConfig: pipeline_segments must be in 0..{MAX_SEGMENTS} (0 = by size), "
                f"got {self.pipeline_segments}"
            )

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
        return self.bits in _QUANT_BITS

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

        Keyword ``overrides`` win over the environment. A malformed value raises
        ``ValueError`` naming the variable, the value and what is accepted; a minimal size below
        16 is raised to 16 with an INFO line. Every variable jax_cgx reads: docs/environment.md.
        """
        env = os.environ if environ is None else environ

        def read(name: str) -> str:
            return env.get(name, ENV_VARS[name]).strip()

        def read_int(name: str, accepted: str) -> int:
            raw = read(name)
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not an integer; {accepted}") from None

        fields: dict = {}
        bits_accepted = "use 1..8 (bits per value), 16 (a half-precision all-reduce) or 32 (no compression)"
        bits = read_int("CGX_COMPRESSION_QUANTIZATION_BITS", bits_accepted)
        if bits not in _VALID_BITS:
            raise ValueError(f"CGX_COMPRESSION_QUANTIZATION_BITS={bits} is not supported; {bits_accepted}")
        fields["bits"] = bits
        bucket_accepted = f"use a whole number of values in 1..{MAX_BUCKET_SIZE}, e.g. 512 (the default)"
        bucket = read_int("CGX_COMPRESSION_BUCKET_SIZE", bucket_accepted)
        if not 1 <= bucket <= MAX_BUCKET_SIZE:
            raise ValueError(f"CGX_COMPRESSION_BUCKET_SIZE={bucket} must be >= 1; {bucket_accepted}")
        fields["bucket_size"] = bucket
        fields["skip_incomplete_buckets"] = _flag(env, "CGX_COMPRESSION_SKIP_INCOMPLETE_BUCKETS",
                                                  read("CGX_COMPRESSION_SKIP_INCOMPLETE_BUCKETS"))
        min_size = read_int("CGX_COMPRESSION_MINIMAL_SIZE", "use a whole number of values >= 0 (16 and below: 16)")
        if min_size < 0:
            raise ValueError(f"CGX_COMPRESSION_MINIMAL_SIZE={min_size} must be >= 0 (16 and below: 16, "
                             "torch_cgx's floor)")
        if min_size < _MIN_SIZE_FLOOR and ("min", min_size) not in _said:
            _said.add(("min", min_size))
            log.info("jax_cgx: CGX_COMPRESSION_MINIMAL_SIZE=%d raised to %d, torch_cgx's floor (arrays with fewer "
                     "values are reduced uncompressed); CompressionConfig(min_size=...) takes any value >= 0",
                     min_size, _MIN_SIZE_FLOOR)
        fields["min_size"] = max(min_size, _MIN_SIZE_FLOOR)
        raw_mb = read("CGX_FUSION_BUFFER_SIZE_MB")
        mb_accepted = "use a finite number of MiB >= 1/1024 (1 KiB), e.g. 64 (the default)"
        try:
            mb = float(raw_mb)
        except ValueError:
            raise ValueError(f"CGX_FUSION_BUFFER_SIZE_MB={raw_mb!r} is not a number; {mb_accepted}") from None
        if not (math.isfinite(mb) and mb >= MIN_FUSION_BUFFER_MB):
            raise ValueError(f"CGX_FUSION_BUFFER_SIZE_MB={raw_mb} must be a finite number of MiB >= "
                             "1/1024 (1 KiB); e.g. 64 (the default)")
        fields["fusion_buffer_mb"] = int(mb) if mb.is_integer() else mb
        fields.update(_execution_from_env(env))
        fields.update(overrides)
        return cls(**fields)


def _flag(env: Mapping[str, str], name: str, raw: str) -> bool:
    """A 0/1 variable (true/false too, any case)."""
    value = raw.strip().lower()
    if value not in ("0", "1", "true", "false"):
        raise ValueError(f"{name}={env.get(name)!r} must be 0 or 1 (or false/true)")
    return value in ("1", "true")


def _choice(env: Mapping[str, str], name: str, raw: str, choices) -> str:
    """The one of ``choices`` that ``raw`` names, in any case."""
    for choice in choices:
        if raw.lower() == choice.lower():
            return choice
    raise ValueError(f"{name}={env.get(name)!r} must be {', '.join(choices[:-1])} or {choices[-1]} (any case)")


def _execution_from_env(env: Mapping[str, str]) -> dict:
    """backend, algorithm, hierarchical, pipeline_segments, policy and link_gbps from the environment."""
    fields: dict = {}

    def read(name: str) -> str | None:
        raw = env.get(name)
        return None if raw is None or not raw.strip() else raw.strip()

    communicators = tuple(_CROSS_COMMUNICATORS)
    if (cross := read("CGX_CROSS_COMMUNICATOR_TYPE")) is not None:
        fields["backend"] = _CROSS_COMMUNICATORS[_choice(env, "CGX_CROSS_COMMUNICATOR_TYPE", cross, communicators)]
    if (inner := read("CGX_INNER_COMMUNICATOR_TYPE")) is not None:
        _choice(env, "CGX_INNER_COMMUNICATOR_TYPE", inner, communicators)
    if (intra := read("CGX_INTRA_BROADCAST")) is not None:
        _flag(env, "CGX_INTRA_BROADCAST", intra)
    if (backend := read("JAX_CGX_BACKEND")) is not None:
        fields["backend"] = _choice(env, "JAX_CGX_BACKEND", backend, BACKENDS)
    if (algorithm := read("JAX_CGX_ALGORITHM")) is not None:
        fields["algorithm"] = _choice(env, "JAX_CGX_ALGORITHM", algorithm, ALGORITHMS)
    if (hier := read("JAX_CGX_HIERARCHICAL")) is not None:
        fields["hierarchical"] = _flag(env, "JAX_CGX_HIERARCHICAL", hier)
    if (segments := read("JAX_CGX_PIPELINE_SEGMENTS")) is not None:
        accepted = f"use 0..{MAX_SEGMENTS} (0 = by size, the default)"
        try:
            count = int(segments)
        except ValueError:
            raise ValueError(f"JAX_CGX_PIPELINE_SEGMENTS={segments!r} is not an integer; {accepted}") from None
        if not 0 <= count <= MAX_SEGMENTS:
            raise ValueError(f"JAX_CGX_PIPELINE_SEGMENTS={segments} must be in 0..{MAX_SEGMENTS} (0 = by size)")
        fields["pipeline_segments"] = count
    if (policy := read("JAX_CGX_POLICY")) is not None:
        fields["policy"] = _choice(env, "JAX_CGX_POLICY", policy, POLICIES)
    if (link := link_gbps_from_env(env)) is not None:
        fields["link_gbps"] = link
    return fields


_said: set = set()  # what was logged once, and the environments check_environment found good
_LINK = "JAX_CGX_LINK_GBPS"


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
    if (config_given, seen) in _said:
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
    _said.add((config_given, seen))


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
    if ("default", config, source) not in _said:
        _said.add(("default", config, source))
        log.info("jax_cgx: %s with config=None uses %r: %s. %s", api, config, source, hint)
    return config


def link_gbps_from_env(environ: Mapping[str, str] | None = None) -> float | None:
    """``JAX_CGX_LINK_GBPS`` as a number of Gbit/s (None when unset or empty); a bad value raises."""
    env = os.environ if environ is None else environ
    raw = env.get("JAX_CGX_LINK_GBPS", "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(
            f"JAX_CGX_LINK_GBPS={raw!r} is not a number; give each rank's link rate in Gbit/s, "
            "e.g. 1, 10 or inf (unset: policy='auto' measures it)"
        ) from None
    if not value > 0:
        raise ValueError(f"JAX_CGX_LINK_GBPS={raw!r} must be > 0 Gbit/s (inf: an unlimited link)")
    return value


def given_link_gbps(config: CompressionConfig) -> float | None:
    """The link's rate per rank where the user gave it: ``config.link_gbps``, else
    ``JAX_CGX_LINK_GBPS``; None where neither says (or the variable is malformed: logged by
    :func:`check_environment`, and raised where ``policy='auto'`` calibrates). The xla backend
    sizes its messages to it (:func:`jax_cgx._src.exchange.wire.message_cap`)."""
    if config.link_gbps is not None:
        return float(config.link_gbps)
    try:
        return link_gbps_from_env()
    except ValueError:
        return None


def _check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"CompressionConfig: {name} must be an int, got {value!r}")
