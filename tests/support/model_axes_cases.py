"""Checks shared by the tests of meshes with model axes (tests/data_parallel/test_model_axes.py,
tests/data_parallel/test_transformer_step.py): one device's block of a sharded array, and the codec's bound per
shard."""

import numpy as np
from allreduce_cases import sra_window_bound


def shard(value, spec, mesh, index):
    """Block ``index`` (a dict axis -> coordinate) of ``value`` sharded as ``spec`` on ``mesh``."""
    out = np.asarray(value)
    for dim, axes in enumerate(spec):
        axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
        if not axes:
            continue
        ways, at = 1, 0
        for a in axes:  # the first axis named is the major one
            at, ways = at * mesh.shape[a] + index[a], ways * mesh.shape[a]
        n = out.shape[dim] // ways
        out = np.take(out, np.arange(at * n, (at + 1) * n), axis=dim)
    return out


def assert_within_bound_per_shard(grads, mine, specs, mesh, model_axes, data, config):
    """Every shard's stream of leaves (tree order) within the bound of the data groups' own
    gradients of that shard: what each device quantized was its shard, not the whole leaf."""
    coords = [dict(zip(model_axes, c)) for c in np.ndindex(*(mesh.shape[a] for a in model_axes))]
    for index in coords:
        xs = np.stack([np.concatenate([shard(mine[k][d], specs[k], mesh, index).reshape(-1) for k in sorted(grads)])
                       for d in range(data)])
        out = np.concatenate([shard(grads[k], specs[k], mesh, index).reshape(-1) for k in sorted(grads)]) * data
        err, bound = sra_window_bound(xs, out, config)
        assert np.all(err <= bound), (index, float(np.max(err - bound)))
        assert np.any(err > 0)  # compressed
