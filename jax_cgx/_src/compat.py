"""The few JAX internals jax_cgx touches, in one place (jax 0.10.2 here, 0.11.2 on GPU machines)."""

import functools
import re

import jax as _jax
from jax._src import config as _config
from jax._src import core as _core

try:
    from jax._src.dispatch import apply_primitive
except ImportError:  # pragma: no cover - a future layout
    from jax._src.interpreters.pxla import apply_primitive  # type: ignore[no-redef]

__all__ = ["apply_primitive"]

# The oldest jax the tests run on (pyproject.toml's floor). Older ones import, then fail far from
# here (jax 0.7.2: a TypeError from inside compressed_psum in multi-process jobs), so refuse them now.
MIN_JAX = (0, 10, 2)


def _release(version: str) -> tuple[int, ...]:
    """``"0.10.3rc1"`` -> ``(0, 10, 3)``: the leading numbers of a version."""
    return tuple(int(n) for n in re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", version).groups() if n is not None)


if _release(_jax.__version__) < MIN_JAX:
    raise ImportError(f"jax_cgx needs jax >= {'.'.join(map(str, MIN_JAX))}, found jax {_jax.__version__}: "
                      "pip install -U jax jaxlib (or jax[cuda13] on GPUs)")

NamedAxisEffect = _core.NamedAxisEffect


def check_vma_enabled() -> bool:
    """True while tracing under shard_map(check_vma=True)."""
    return bool(_config._check_vma.value)


# jax 0.10 spells an aval's varying manual axes `aval.mat.varying`; earlier releases
# spelled them `aval.vma`.
_HAS_MAT = hasattr(_core.ShapedArray((), "float32"), "mat")


def varying_axes(aval) -> frozenset:
    return frozenset(aval.mat.varying if _HAS_MAT else getattr(aval, "vma", frozenset()))


def is_varying(aval, axes) -> bool:
    return bool(set(axes) & varying_axes(aval))


def remove_varying(aval, axes):
    keep = frozenset(a for a in varying_axes(aval) if a not in axes)
    if _HAS_MAT:
        return aval.update(manual_axis_type=aval.mat.update(varying=keep))
    return aval.update(vma=keep)


def pvary(x, axes):
    """Mark ``x`` as varying over ``axes`` (the transpose of an invariant-producing reduction)."""
    if hasattr(_core, "pvary"):
        return _core.pvary(x, axis_name=tuple(axes))
    from jax import lax

    return lax.pcast(x, tuple(axes), to="varying")


def is_tracer(x) -> bool:
    """Whether ``x`` is a value being traced (inside ``jax.jit``, ``grad``, ...), not an array."""
    return isinstance(x, _core.Tracer)


def axes_bound(axes) -> bool:
    """Whether every name of ``axes`` is bound here (inside a shard_map / pmap over it)."""
    env = _core.get_axis_env()
    return all(env.axis_exists(name) for name in axes)


def check_axis_names(axes, api_name: str) -> None:
    env = _core.get_axis_env()
    for name in axes:
        if not env.axis_exists(name):
            raise NameError(
                f"{api_name}: axis name {name!r} is not bound. Call it inside jax.shard_map "
                f"(with {name!r} a mesh axis) or jax.pmap(axis_name={name!r})."
            )


def all_gather_invariant(x, axis_name, *, axis: int = 0, tiled: bool = True):
    """An all-gather typed varying -> invariant (jax 0.10 keeps it in jax._src)."""
    from jax import lax

    gather = getattr(lax, "all_gather_invariant", None)
    if gather is None:
        from jax._src.lax.parallel import all_gather_invariant as gather
    return gather(x, axis_name, axis=axis, tiled=tiled)


def vmapped_axes(axes) -> tuple:
    """The names in ``axes`` bound by ``vmap`` inside a ``shard_map`` / ``pmap`` (not mesh axes).

    Empty outside a mesh context (plain ``vmap``), where the all-reduce primitive's batching
    rule reports them.
    """
    import jax

    get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
    if get_mesh is None:  # pragma: no cover - older layouts
        from jax._src.mesh import get_abstract_mesh as get_mesh
    mesh = get_mesh()
    if mesh.empty:
        return ()
    return tuple(a for a in axes if a not in mesh.axis_names)


def is_prng_key(x) -> bool:
    """Whether ``x`` is a PRNG key: a typed key array of any shape (``jax.random.key``) or a raw
    key of the default implementation (``jax.random.PRNGKey``: ``uint32`` of its key shape, ``[2]``
    for threefry). The one rule of what a key is; :func:`check_prng_key` and the step's keyword
    checks read it."""
    import jax
    import numpy as np

    dtype, shape = getattr(x, "dtype", None), getattr(x, "shape", None)
    if dtype is None or shape is None:
        return False
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return True
    return dtype == np.dtype(np.uint32) and tuple(shape) == _raw_key_shape(jax.config.jax_default_prng_impl)


@functools.cache
def _raw_key_shape(impl: str) -> tuple[int, ...]:
    """The shape of the raw keys of PRNG implementation ``impl`` (the default's, passed so that a
    changed default is looked up again), traced abstractly once: no backend started."""
    import jax

    return tuple(jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape)


def check_prng_key(key, api_name: str) -> None:
    """Raise a clear TypeError unless ``key`` is one PRNG key (:func:`is_prng_key`; a typed key
    array must have shape ``()``)."""
    import jax
    import numpy as np

    if key is None:
        return
    if is_prng_key(key):
        if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) or key.shape == ():
            return
        raise TypeError(
            f"{api_name}: key must be a single PRNG key, got an array of {key.shape} keys; pass "
            "one key (the same on every rank), e.g. key=jax.random.key(0)"
        )
    dtype, shape = getattr(key, "dtype", None), getattr(key, "shape", None)
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        got, fix = f"the integer {key!r}", f"key=jax.random.key({int(key)})"
    else:
        what = f"{dtype}{list(shape)}" if dtype is not None and shape is not None else type(key).__name__
        got, fix = what, "key=jax.random.key(seed)"
    raise TypeError(
        f"{api_name}: key must be a PRNG key from jax.random.key(seed) (or a legacy "
        f"jax.random.PRNGKey(seed)), got {got}; pass {fix}"
    )


def axes_tuple(axis_name) -> tuple:
    """``axis_name`` (a name, or a tuple or list of names) as a tuple of names."""
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def ensure_varying(x, axes):
    """Under ``shard_map(check_vma=True)``, type ``x`` as varying over every axis of ``axes``
    (``pvary`` over the ones it is not varying over yet); unchanged otherwise."""
    if not check_vma_enabled():
        return x
    have = varying_axes(_core.typeof(x))
    missing = tuple(a for a in axes if a not in have)
    return pvary(x, missing) if missing else x


def lowering_platform(platform: str) -> str:
    """The platform a computation for ``platform`` is lowered for: a device says "gpu", its lowering
    "cuda" or "rocm" (whichever is present); a platform that names no alias, or "gpu" where no GPU
    backend is present, is returned as it is."""
    from jax._src import xla_bridge

    try:
        return xla_bridge.canonicalize_platform(platform)
    except RuntimeError:  # "gpu" with no GPU backend here
        return platform


def context_mesh(ctx):
    """The mesh of the shard_map/pmap whose body a lowering rule is lowering (None outside one)."""
    return getattr(ctx.module_context.axis_context, "mesh", None)


def current_mesh():
    """The mesh of the context: ``jax.set_mesh``'s (an ``AbstractMesh`` where only that is set), or
    ``with mesh:``'s; None outside both."""
    from jax._src import mesh as mesh_lib

    abstract = mesh_lib.get_abstract_mesh()
    if not abstract.empty:
        return abstract

    physical = mesh_lib.thread_resources.env.physical_mesh
    return None if physical.empty else physical


def trace_platform() -> str:
    """The platform of the mesh being traced over (the enclosing ``shard_map``'s), else JAX's
    default backend (inside ``pmap`` or outside a mesh)."""
    import jax

    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    return getattr(device, "platform", None) or jax.default_backend()
