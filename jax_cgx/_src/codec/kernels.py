"""The compiled codec: one JAX primitive per FFI target.

Each primitive lowers to the XLA FFI custom call of the same name on CPU (always
built) and CUDA (when the CUDA extension was built), and to the pure-JAX
reference (:mod:`jax_cgx._src.codec.reference`) on any other platform, or on a GPU without
the CUDA extension, with a warning, unless the caller asked for the kernel only.
Operands and results carry a leading row axis ``R`` (xla_ffi/README.md); the
batching rule folds vmapped axes into it, so kernels never see more than one
batch dimension.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Literal

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jax_cgx._src import extensions
from jax_cgx._src.codec import reference as _reference
from jax_cgx._src.compat import apply_primitive

log = logging.getLogger("jax_cgx")

# Which implementation of the codec runs: the compiled kernel where the platform has one
# (else the reference, with a warning), the kernel only, or the pure-JAX reference.
Impl = Literal["auto", "kernel", "reference"]
IMPLS = ("auto", "kernel", "reference")


def check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")

# Loaded (and the CPU kernels' variant chosen) once, in jax_cgx._src.extensions.
cuda_extension_available = extensions.cuda_extension_available
require_cuda_extension = extensions.require_cuda_extension


# ------------------------------------------------------------- primitives


def _aval(like, shape, dtype):
    """An output aval: ``like``'s varying-axes typing with a new shape and dtype."""
    return like.update(shape=tuple(shape), dtype=np.dtype(dtype), weak_type=False)


def batch_rows(prim: Primitive, args, dims, **params):
    """vmap rule: fold the batch axis into the leading row axis of every operand.

    Shared by every row-shaped primitive (the codec's and the all-reduce's): rows are
    independent problems, so a vmapped axis is just more rows. With no operand batched (a
    collective under vmap whose inputs do not depend on the mapped axis, e.g. nearest
    rounding, which ignores the key) every element of the batch is the same: one unbatched
    result.
    """
    if all(d is None for d in dims):
        out = prim.bind(*args, **params)  # None: not mapped (jax.interpreters.batching.not_mapped, gone in 0.10)
        return (out, [None] * len(out)) if prim.multiple_results else (out, None)
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    flat = []
    for a, d in zip(args, dims):
        a = jax.numpy.broadcast_to(a, (size, *a.shape)) if d is None else jax.numpy.moveaxis(a, d, 0)
        flat.append(a.reshape(size * a.shape[1], *a.shape[2:]))
    out = prim.bind(*flat, **params)
    outs = out if prim.multiple_results else [out]
    unfolded = [o.reshape(size, o.shape[0] // size, *o.shape[1:]) for o in outs]
    if prim.multiple_results:
        return unfolded, [0] * len(unfolded)
    return unfolded[0], 0


_warned_fallback: set[tuple[str, str]] = set()


def _fallback_lowering(prim_name: str, platform: str, reference: Callable):
    def lowering(ctx, *args, strict: bool, **params):
        if strict:
            raise NotImplementedError(
                f"jax_cgx: no compiled kernel for '{prim_name}' on platform '{platform}' "
                "(impl='kernel' was requested). Build the CUDA extension, or pass "
                "impl='auto' to fall back to the pure-JAX reference."
            )
        if (prim_name, platform) not in _warned_fallback:
            _warned_fallback.add((prim_name, platform))
            log.warning(
                "jax_cgx: no compiled kernel for %s on %s; using the pure-JAX reference "
                "(same bytes, slower)",
                prim_name,
                platform,
            )
        fun = functools.partial(reference, **params)
        return mlir.lower_fun(fun, multiple_results=True)(ctx, *args)

    return lowering


def _ffi_lowering(target: str, attrs: Callable[[dict], dict]):
    rule = jax.ffi.ffi_lowering(target)

    def lowering(ctx, *args, strict: bool, **params):
        del strict
        return rule(ctx, *args, **attrs(params))

    return lowering


def _define(name: str, abstract_eval: Callable, reference: Callable, attr_names: tuple[str, ...]):
    prim = Primitive(name)
    prim.multiple_results = True
    prim.def_impl(functools.partial(apply_primitive, prim))
    prim.def_abstract_eval(abstract_eval)
    batching.primitive_batchers[prim] = functools.partial(batch_rows, prim)

    def attrs(params):
        out = {"bits": np.int32(params["bits"]), "bucket_size": np.int64(params["bucket_size"])}
        if "stochastic" in attr_names:
            out["stochastic"] = bool(params["stochastic"])
        if "scale" in attr_names:
            out["scale"] = np.float32(params["scale"])
        return out

    ref = _reference_rule(reference)
    mlir.register_lowering(prim, _ffi_lowering(name, attrs), platform="cpu")
    if extensions.cuda_extension_available():
        mlir.register_lowering(prim, _ffi_lowering(name, attrs), platform="cuda")
    else:
        mlir.register_lowering(prim, _fallback_lowering(name, "cuda", ref), platform="cuda")
    mlir.register_lowering(prim, _fallback_lowering(name, "rocm", ref), platform="rocm")
    mlir.register_lowering(prim, _fallback_lowering(name, "tpu", ref), platform="tpu")
    return prim


def _reference_rule(reference: Callable) -> Callable:
    """Adapt a reference function to return a list (primitives have multiple results)."""

    def rule(*args, **params):
        out = reference(*args, **params)
        return list(out) if isinstance(out, tuple) else [out]

    return rule


def _check_bucketing(m: int, bits: int, bucket_size: int, payload_shape, meta_shape, what: str):
    from jax_cgx._src.codec.quantized import num_buckets, payload_bytes

    if payload_shape[-1] != payload_bytes(m, bucket_size, bits) or meta_shape[-2:] != (
        num_buckets(m, bucket_size),
        2,
    ):
        raise ValueError(
            f"{what}: payload {payload_shape} / meta {meta_shape} do not hold {m} values "
            f"at bits={bits}, bucket_size={bucket_size}"
        )


def _valid_or_none(valid):
    """``valid[R]`` per-row counts, or None for ``valid[0]`` (every value sets the ranges)."""
    return None if valid.shape[0] == 0 else valid


# quantize: x[R,n], seeds[R,2], valid[R|0] -> payload[R,P], meta[R,nb,2]
def _quantize_abstract(x, seeds, valid, *, bits, bucket_size, stochastic, m, strict):
    from jax_cgx._src.codec.quantized import num_buckets, payload_bytes

    r = x.shape[0]
    return (
        _aval(x, (r, payload_bytes(m, bucket_size, bits)), np.uint8),
        _aval(x, (r, num_buckets(m, bucket_size), 2), np.float32),
    )


def _quantize_reference(x, seeds, valid, *, bits, bucket_size, stochastic, m):
    return _reference.quantize(
        x, seeds, _valid_or_none(valid), bits=bits, bucket_size=bucket_size, stochastic=stochastic, m=m
    )


quantize_p = _define("jax_cgx_quantize", _quantize_abstract, _quantize_reference, ("stochastic",))


# dequantize: payload[R,P], meta[R,nb,2] -> out[R,m], each decoded value times `scale` (1, or a
# mean's 1/W) before its one rounding to dtype
def _dequantize_abstract(payload, meta, *, bits, bucket_size, m, dtype, scale, strict):
    _check_bucketing(m, bits, bucket_size, payload.shape, meta.shape, "dequantize")
    return (_aval(payload, (payload.shape[0], m), dtype),)


def _dequantize_reference(payload, meta, *, bits, bucket_size, m, dtype, scale):
    return _reference.dequantize(payload, meta, bits=bits, bucket_size=bucket_size, m=m, dtype=dtype, scale=scale)


dequantize_p = _define("jax_cgx_dequantize", _dequantize_abstract, _dequantize_reference, ("scale",))


# dequantize_sum: payload[R,W,P], meta[R,W,nb,2], addend[R,m|0] -> out[R,m]
def _sum_abstract(payload, meta, addend, *, bits, bucket_size, m, dtype, strict):
    _check_bucketing(m, bits, bucket_size, payload.shape, meta.shape, "dequantize_sum")
    return (_aval(payload, (payload.shape[0], m), dtype),)


def _addend_or_none(addend):
    return None if addend.shape[1] == 0 else addend


def _sum_reference(payload, meta, addend, *, bits, bucket_size, m, dtype):
    return _reference.dequantize_sum(
        payload, meta, _addend_or_none(addend), bits=bits, bucket_size=bucket_size, m=m, dtype=dtype
    )


dequantize_sum_p = _define("jax_cgx_dequantize_sum", _sum_abstract, _sum_reference, ())


# dequantize_sum_requantize: ... + seeds[R,2], valid[R|0] -> payload[R,P], meta[R,nb,2], out[R,m]
def _dsr_abstract(payload, meta, addend, seeds, valid, *, bits, bucket_size, stochastic, m, dtype, strict):
    _check_bucketing(m, bits, bucket_size, payload.shape, meta.shape, "dequantize_sum_requantize")
    r = payload.shape[0]
    return (
        _aval(payload, (r, payload.shape[-1]), np.uint8),
        _aval(payload, (r, meta.shape[-2], 2), np.float32),
        _aval(payload, (r, m), dtype),
    )


def _dsr_reference(payload, meta, addend, seeds, valid, *, bits, bucket_size, stochastic, m, dtype):
    return _reference.dequantize_sum_requantize(
        payload,
        meta,
        _addend_or_none(addend),
        seeds,
        _valid_or_none(valid),
        bits=bits,
        bucket_size=bucket_size,
        stochastic=stochastic,
        m=m,
        dtype=dtype,
    )


dequantize_sum_requantize_p = _define(
    "jax_cgx_dequantize_sum_requantize", _dsr_abstract, _dsr_reference, ("stochastic",)
)
