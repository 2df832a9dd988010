"""One inf or NaN in one device's gradient, under optax.MultiSteps around jax_cgx's means (issue 58):
without a skip test it stays in the accumulator and poisons every later step; with
jax_cgx.optax.skip_not_finite every device skips that mini-step, the state is left bitwise as it
was, and training goes on exactly as if the bad batch had never come."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from bitwise import assert_same_bits
from jax.sharding import PartitionSpec as P
from meshes import device_mesh

import jax_cgx
from jax_cgx.optax import compressed_mean, skip_not_finite, state_specs

W = 8
CONFIG = jax_cgx.CompressionConfig(bits=4, bucket_size=64, min_size=16)


def _grads(step, bad=False):
    g = np.random.default_rng(step).standard_normal((W, 32, 64)).astype(np.float32)
    if bad:
        g[3, 5, 7] = np.nan  # one value on one device
    return {"w": g}


def _tx(skip):
    inner = optax.chain(compressed_mean("data", CONFIG, layer_min_size=1, error_feedback=True), optax.sgd(0.1))
    return optax.MultiSteps(inner, every_k_schedule=2, **({"should_skip_update_fn": skip} if skip else {}))


def _run(tx, batches):
    mesh = device_mesh((W,), ("data",), jax.sharding.AxisType.Auto)
    params = {"w": jnp.zeros((32, 64), jnp.float32)}
    specs = state_specs(jax.eval_shape(tx.init, params), "data")
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

    def step(params, state, g):
        updates, state = tx.update(jax.tree.map(lambda v: v[0], g), state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs)))
    states = []
    for g in batches:
        params, state = step(params, state, g)
        states.append(state)
    return params, states


def test_without_a_skip_test_one_nan_poisons_every_later_step():
    # optax's behaviour, reproduced: the accumulator keeps the NaN ((1 - emit) * nan is nan).
    params, _ = _run(_tx(None), [_grads(0), _grads(1, bad=True), *(_grads(t) for t in range(2, 6))])
    assert not np.all(np.isfinite(np.asarray(params["w"])))


def test_skip_not_finite_skips_on_every_device_as_if_the_batch_never_came():
    batches = [_grads(0), _grads(1, bad=True), *(_grads(t) for t in range(2, 6))]
    params, states = _run(_tx(skip_not_finite("data")), batches)
    assert np.all(np.isfinite(np.asarray(params["w"])))
    skipped = states[1]
    for a, b in zip(jax.tree.leaves(skipped._replace(skip_state=())), jax.tree.leaves(states[0]._replace(skip_state=()))):
        assert_same_bits(np.asarray(a), np.asarray(b))  # the whole state, per-device residuals included
    assert bool(skipped.skip_state["should_skip"]) and int(skipped.skip_state["num_not_finite"]) == 1
    clean, _ = _run(_tx(skip_not_finite("data")), [b for i, b in enumerate(batches) if i != 1])
    assert_same_bits(np.asarray(params["w"]), np.asarray(clean["w"]))


def test_optax_own_skip_test_disagrees_between_devices():
    # optax.skip_not_finite judges each device alone: its state differs between the devices, which
    # shard_map refuses to return replicated. docs/training.md points to skip_not_finite("data").
    with pytest.raises(Exception, match=r"(?s)skip_state.*varying|varying.*skip_state|out_specs"):
        _run(_tx(optax.skip_not_finite), [_grads(0)])


def test_skip_not_finite_counts_every_device_and_checks_its_axis():
    mesh = device_mesh((W,), ("data",), jax.sharding.AxisType.Auto)
    fn = skip_not_finite("data")
    g = np.ones((W, 4), np.float32)
    g[2, 1], g[5, 0] = np.inf, np.nan
    out = jax.jit(jax.shard_map(lambda v: fn({"g": v[0], "i": jnp.ones(3, jnp.int32)}, 0)[1], mesh=mesh,
                                in_specs=P("data"), out_specs=P()))(g)
    assert int(out["num_not_finite"]) == 2 and bool(out["should_skip"])
    with pytest.raises(ValueError, match="skip_not_finite"):
        skip_not_finite(())


@pytest.mark.multiprocess
def test_two_processes_skip_together(tmp_path):
    # The data axis across 2 processes x 2 devices (gloo); the NaN on a device of process 1: both
    # processes skip the mini-step (its count, 1, on both), end with the same finite parameters,
    # bitwise those of the run that never saw the bad batch.
    from processes import run_workers

    run_workers("not_finite_worker.py", 2, tmp_path)
    results = [np.load(tmp_path / f"process{i}.npz") for i in range(2)]
    for r in results:
        assert r["skips"][1] == 1 and np.all(r["skips"][[0, 2, 3, 4, 5]] == 0), r["skips"]
        assert np.all(np.isfinite(r["bad"]))
        assert_same_bits(r["bad"], r["clean"])
    assert_same_bits(results[0]["bad"], results[1]["bad"])
