"""What to compress and how: the settings and where they come from.

=================  =====================================================================
``compression``    :class:`~jax_cgx.CompressionConfig`, and what ``config=None`` means
``variables``      the environment variables a config is read from, parsed and checked
``limits``         every enumeration and limit of a field
=================  =====================================================================
"""

from jax_cgx._src.config.compression import (
    CompressionConfig,
    GivenLink,
    check_environment,
    default_config,
    given_link,
    given_link_gbps,
)
from jax_cgx._src.config.limits import (
    ALGORITHMS,
    BACKENDS,
    MAX_BUCKET_SIZE,
    MAX_FUSION_BUFFERS,
    MAX_SEGMENTS,
    MIN_FUSION_BUFFER_MB,
    POLICIES,
    QUANTIZED_BITS,
    VALID_BITS,
)
from jax_cgx._src.config.variables import (
    CONFIG_VARIABLES,
    ENV_VARS,
    JAX_CGX_ENV_VARS,
    TORCH_CGX_VARIABLES,
    link_gbps_from_env,
)

__all__ = [
    "CompressionConfig",
    "CONFIG_VARIABLES",
    "ENV_VARS",
    "JAX_CGX_ENV_VARS",
    "BACKENDS",
    "MAX_BUCKET_SIZE",
    "MAX_SEGMENTS",
    "ALGORITHMS",
    "POLICIES",
    "TORCH_CGX_VARIABLES",
    "check_environment",
    "default_config",
    "GivenLink",
    "given_link",
    "given_link_gbps",
    "link_gbps_from_env",
    "MIN_FUSION_BUFFER_MB",
    "MAX_FUSION_BUFFERS",
    "QUANTIZED_BITS",
    "VALID_BITS",
]
