"""The few JAX internals jax_cgx touches, in one place (jax 0.10.2 here, 0.11.2 on GPU machines)."""


try:
    from jax._src.dispatch import apply_primitive
except ImportError:  # pragma: no cover - a future layout
    from jax._src.interpreters.pxla import apply_primitive  # type: ignore[no-redef]

__all__ = ["apply_primitive"]

from jax._src import config as _config
from jax._src import core as _core

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


def check_axis_names(axes, api_name: str) -> None:
    env = _core.get_axis_env()
    for name in axes:
        if not env.axis_exists(name):
            raise NameError(
                f"{api_name}: axis name {name!r} is not bound. Call it inside jax.shard_map "
                f"(with {name!r} a mesh axis) or jax.pmap(axis_name={name!r})."
            )


def all_gather_invariant(x, axis_name):
    """A tiled all-gather typed varying -> invariant (jax 0.10 keeps it in jax._src)."""
    from jax import lax

    gather = getattr(lax, "all_gather_invariant", None)
    if gather is None:
        from jax._src.lax.parallel import all_gather_invariant as gather
    return gather(x, axis_name, axis=0, tiled=True)
