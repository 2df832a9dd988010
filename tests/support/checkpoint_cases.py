"""Training runs whose whole state must survive a checkpoint: one per stateful thing jax_cgx has.

Used by tests/optax/test_checkpoint.py (orbax across processes: saved after some steps, restored
in new processes, the next steps bitwise equal to an uninterrupted run) and
tests/optax/test_resize_state.py (a state saved on 8 devices restored on 4, and back). Every
device's gradient at step ``t`` is a function of ``t`` alone (:func:`gradients`), so any process
can make its part of it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cgx
import jax_cgx.optax as cgx_optax

AXIS = "d"
FOUR = jax_cgx.CompressionConfig(bits=4, bucket_size=64, min_size=16)
PARAMS = {"w": np.linspace(-1, 1, 64 * 40, dtype=np.float32).reshape(64, 40),
          "b": np.zeros((40,), np.float32),
          "h": np.linspace(1, -1, 48 * 30, dtype=np.float32).reshape(48, 30)}


def _mean(**kw):
    return cgx_optax.compressed_mean(AXIS, kw.pop("config", FOUR), layer_min_size=100, **kw)


# name -> the transformation (each chained with an optimizer whose own state must survive too).
OPTAX_CASES = {
    "mean": lambda: optax.chain(_mean(), optax.adam(1e-2)),
    "mean+ef": lambda: optax.chain(_mean(error_feedback=True), optax.sgd(0.1, momentum=0.9)),
    "mean+ef+stochastic": lambda: optax.chain(
        _mean(config=FOUR.replace(stochastic=True), error_feedback=True, seed=3), optax.adam(1e-2)),
    "powersgd": lambda: optax.chain(cgx_optax.powersgd_mean(AXIS, rank=2, start_iter=1), optax.sgd(0.1)),
    "topk": lambda: optax.chain(cgx_optax.topk_mean(AXIS, 0.05, min_size=100, momentum=0.9), optax.adam(1e-2)),
    "multisteps": lambda: optax.MultiSteps(optax.chain(_mean(error_feedback=True), optax.sgd(0.1)), every_k_schedule=2),
}
ZERO_CASE = "zero+ef"
CASES = (*OPTAX_CASES, ZERO_CASE)


def zero_optimizer():
    return cgx_optax.sharded(optax.adam(1e-2), AXIS, grad_config=FOUR.replace(stochastic=True), error_feedback=True)


def gradients(step: int, world: int) -> dict:
    """Every device's gradient at ``step``: leaves ``[world, *shape]``, different per device."""
    rng = np.random.default_rng(1000 + step)
    return {k: (rng.standard_normal((world, *v.shape)) * (1 + np.arange(world)).reshape(-1, *[1] * v.ndim))
            .astype(np.float32) for k, v in PARAMS.items()}


def global_array(x: np.ndarray, mesh, spec):
    """``x`` (the same on every process) as a global array of ``mesh`` (processes hold their part)."""
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda idx: x[idx])


class Run:
    """One case on ``mesh``: ``init()``, then ``step(t)`` -> parameters; ``params``/``state`` the
    current ones (global arrays, ``specs`` their ``shard_map`` specs)."""

    def __init__(self, case: str, mesh):
        self.case, self.mesh, self.world = case, mesh, mesh.size
        params = {k: global_array(v, mesh, P()) for k, v in PARAMS.items()}
        if case == ZERO_CASE:
            opt = zero_optimizer()
            self.specs = opt.state_specs(params, mesh)
            self._init = jax.jit(jax.shard_map(opt.init, mesh=mesh, in_specs=P(), out_specs=self.specs))

            def local(params, state, g, t):
                del params
                return opt.update(jax.tree.map(lambda v: v[0], g), state,
                                  key=jax.random.fold_in(jax.random.key(7), t))
        else:
            tx = OPTAX_CASES[case]()
            self.specs = cgx_optax.state_specs(jax.eval_shape(tx.init, PARAMS), AXIS)
            self._init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=self.specs))

            def local(params, state, g, t):
                del t
                updates, state = tx.update(jax.tree.map(lambda v: v[0], g), state, params)
                return optax.apply_updates(params, updates), state

        self._step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), self.specs, P(AXIS), P()),
                                           out_specs=(P(), self.specs)))
        self.params = params
        self.state = None

    def init(self):
        self.state = self._init(self.params)
        return self

    def shardings(self, tree_specs):
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), tree_specs)

    def step(self, t: int) -> dict:
        g = {k: global_array(v, self.mesh, P(AXIS)) for k, v in gradients(t, self.world).items()}
        self.params, self.state = self._step(self.params, self.state, g, jnp.int32(t))
        return {k: local_copy(v) for k, v in self.params.items()}


def local_copy(x) -> np.ndarray:
    """A replicated global array's value, read from this process's first shard."""
    return np.asarray(x.addressable_shards[0].data)
