"""Every enumeration and limit of a config: what each field accepts.

:func:`field_problem` is the one rule of each numeric field's range, read by ``CompressionConfig``'s
constructor and by the parser of the environment variables alike, each naming what it checked.
"""

import math

__all__ = ["ALGORITHMS", "BACKENDS", "MAX_BUCKET_SIZE", "MAX_FUSION_BUFFERS", "MAX_SEGMENTS", "MIN_FUSION_BUFFER_MB",
           "POLICIES", "QUANTIZED_BITS", "VALID_BITS", "accepted", "field_problem"]

# The widths the codec quantizes to (bits per value): the kernels' range (kMinBits..kMaxBits in
# xla_ffi/codec_math.h, which the extensions export as `codec_bits`; tests/codec/test_build.py
# checks the two agree). Every check of a width reads it from here.
QUANTIZED_BITS = range(1, 9)
# A config's widths: the quantized ones, 16 (the half lane) and 32 (exact).
VALID_BITS = (*QUANTIZED_BITS, 16, 32)

BACKENDS = ("auto", "xla", "nccl", "tcp")
ALGORITHMS = ("sra", "ring")
POLICIES = ("always", "auto")
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


_ACCEPTED = {
    "bits": "use 1..8 (bits per value), 16 (a half-precision all-reduce) or 32 (no compression)",
    "bucket_size": f"use a whole number of values in 1..{MAX_BUCKET_SIZE}",
    "min_size": "use a whole number of values >= 0 (smaller arrays are reduced uncompressed)",
    "fusion_buffer_mb": "use a finite number of MiB >= 1/1024 (1 KiB), e.g. 64 (the default)",
    "pipeline_segments": f"use 0..{MAX_SEGMENTS} (0 = by size, the default)",
}


def accepted(field: str) -> str:
    """What ``CompressionConfig.<field>`` accepts, as advice: ``"use 0..64 (0 = by size, the default)"``."""
    return _ACCEPTED[field]


def field_problem(field: str, value) -> str:
    """"" where ``value`` (a number) is in the range of ``CompressionConfig.<field>`` (bits,
    bucket_size, min_size, fusion_buffer_mb, pipeline_segments), else what is wrong with it, to
    follow its name: ``"is not supported"``, ``"must be >= 1"``."""
    if field == "bits":
        return "" if value in VALID_BITS else "is not supported"
    if field == "bucket_size":
        return ("must be >= 1" if value < 1 else
                f"is above the largest bucket, {MAX_BUCKET_SIZE}" if value > MAX_BUCKET_SIZE else "")
    if field == "min_size":
        return "must be >= 0" if value < 0 else ""
    if field == "fusion_buffer_mb":  # a Python int is finite however large (math.isfinite would overflow)
        if not (isinstance(value, int) or math.isfinite(value)):
            return "is not finite"
        return "is below 1/1024 MiB (1 KiB)" if value < MIN_FUSION_BUFFER_MB else ""
    if field == "pipeline_segments":
        return "must be >= 0" if value < 0 else f"is above {MAX_SEGMENTS}" if value > MAX_SEGMENTS else ""
    raise KeyError(f"field_problem: no range rule for {field!r}")
