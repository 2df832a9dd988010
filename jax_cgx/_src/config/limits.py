"""Every enumeration and limit of a config: what each field accepts."""

__all__ = ["ALGORITHMS", "BACKENDS", "MAX_BUCKET_SIZE", "MAX_FUSION_BUFFERS", "MAX_SEGMENTS", "MIN_FUSION_BUFFER_MB",
           "POLICIES"]

_QUANT_BITS = tuple(range(1, 9))
_VALID_BITS = _QUANT_BITS + (16, 32)

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
