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


def varying_axes(aval) -> frozenset:
    return aval.mat.varying


def is_varying(aval, axes) -> bool:
    return bool(set(axes) & set(aval.mat.varying))


def remove_varying(aval, axes):
    keep = frozenset(a for a in aval.mat.varying if a not in axes)
    return aval.update(manual_axis_type=aval.mat.update(varying=keep))


def pvary(x, axes):
    """Mark ``x`` as varying over ``axes`` (the transpose of an invariant-producing reduction)."""
    return _core.pvary(x, axis_name=tuple(axes))


def check_axis_names(axes, api_name: str) -> None:
    env = _core.get_axis_env()
    for name in axes:
        if not env.axis_exists(name):
            raise NameError(
                f"{api_name}: axis name {name!r} is not bound. Call it inside jax.shard_map "
                f"(with {name!r} a mesh axis) or jax.pmap(axis_name={name!r})."
            )
