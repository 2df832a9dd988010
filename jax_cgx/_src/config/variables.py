"""The environment variables a config is read from: torch_cgx's ``CGX_*`` and jax_cgx's ``JAX_CGX_*``
(the table of :meth:`~jax_cgx.CompressionConfig.from_env`), each parsed and checked with an error
that names it."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from jax_cgx._src.config.limits import (
    _MIN_SIZE_FLOOR,
    ALGORITHMS,
    BACKENDS,
    POLICIES,
    accepted,
    field_problem,
)

__all__ = ["CONFIG_VARIABLES", "ENV_VARS", "JAX_CGX_ENV_VARS", "TORCH_CGX_VARIABLES", "fields_from_env",
           "link_gbps_from_env"]

log = logging.getLogger("jax_cgx")

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
# torch_cgx's transport choices, accepted for its cross-node communicator.
_CROSS_COMMUNICATORS = {"NCCL": "nccl", "MPI": "xla", "SHM": "xla"}

_said: set = set()  # what was logged once, and the environments check_environment found good
_LINK = "JAX_CGX_LINK_GBPS"


def fields_from_env(env: Mapping[str, str]) -> dict:
    """The fields :meth:`~jax_cgx.CompressionConfig.from_env` takes from ``env`` (its table), checked."""

    def read(name: str) -> str:
        return env.get(name, ENV_VARS[name]).strip()

    def read_int(name: str, accepted: str) -> int:
        raw = read(name)
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not an integer; {accepted}") from None

    fields: dict = {}
    for name, field in (("CGX_COMPRESSION_QUANTIZATION_BITS", "bits"), ("CGX_COMPRESSION_BUCKET_SIZE", "bucket_size"),
                        ("CGX_COMPRESSION_MINIMAL_SIZE", "min_size")):
        value = read_int(name, accepted(field))
        if problem := field_problem(field, value):
            raise ValueError(f"{name}={value} {problem}; {accepted(field)}")
        fields[field] = value
    fields["skip_incomplete_buckets"] = _flag(env, "CGX_COMPRESSION_SKIP_INCOMPLETE_BUCKETS",
                                              read("CGX_COMPRESSION_SKIP_INCOMPLETE_BUCKETS"))
    min_size = fields["min_size"]
    if min_size < _MIN_SIZE_FLOOR and ("min", min_size) not in _said:
        _said.add(("min", min_size))
        log.info("jax_cgx: CGX_COMPRESSION_MINIMAL_SIZE=%d raised to %d, torch_cgx's floor (arrays with fewer "
                 "values are reduced uncompressed); CompressionConfig(min_size=...) takes any value >= 0",
                 min_size, _MIN_SIZE_FLOOR)
    fields["min_size"] = max(min_size, _MIN_SIZE_FLOOR)
    raw_mb = read("CGX_FUSION_BUFFER_SIZE_MB")
    try:
        mb = float(raw_mb)
    except ValueError:
        raise ValueError(f"CGX_FUSION_BUFFER_SIZE_MB={raw_mb!r} is not a number; {accepted('fusion_buffer_mb')}") from None
    if problem := field_problem("fusion_buffer_mb", mb):
        raise ValueError(f"CGX_FUSION_BUFFER_SIZE_MB={raw_mb} {problem}; {accepted('fusion_buffer_mb')}")
    fields["fusion_buffer_mb"] = int(mb) if mb.is_integer() else mb
    fields.update(_execution_from_env(env))
    return fields


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
        try:
            count = int(segments)
        except ValueError:
            raise ValueError(f"JAX_CGX_PIPELINE_SEGMENTS={segments!r} is not an integer; "
                             f"{accepted('pipeline_segments')}") from None
        if problem := field_problem("pipeline_segments", count):
            raise ValueError(f"JAX_CGX_PIPELINE_SEGMENTS={segments} {problem}; {accepted('pipeline_segments')}")
        fields["pipeline_segments"] = count
    if (policy := read("JAX_CGX_POLICY")) is not None:
        fields["policy"] = _choice(env, "JAX_CGX_POLICY", policy, POLICIES)
    if (link := link_gbps_from_env(env)) is not None:
        fields["link_gbps"] = link
    return fields


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
