"""jax_cgx.optax.resize_state: a state saved on 8 devices restarted on 4, and on 4 restarted on 8.

What it promises to keep, checked leaf by leaf: the mean over devices of every per-device leaf of
the means (so the error feedback the next reduction applies is unchanged, to float32 rounding of
that mean), every replicated leaf bitwise, the ZeRO optimizer's master parameters and moments
bitwise (re-padded); and the resized state runs on the new mesh."""

import logging

import jax
import numpy as np
import pytest
from checkpoint_cases import AXIS, CASES, PARAMS, ZERO_CASE, Run
from jax.sharding import PartitionSpec as P
from meshes import device_mesh

import jax_cgx.optax as cgx_optax

STEPS = 3
EPS32 = np.finfo(np.float32).eps


def _flat(tree):
    return jax.tree_util.tree_flatten_with_path(tree)[0]


def _blocks(leaf, world):
    return np.asarray(leaf).reshape(world, -1)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("before,after", [(8, 4), (4, 8)])
def test_resize_keeps_what_it_promises(case, before, after, caplog):
    old = Run(case, device_mesh((before,), (AXIS,))).init()
    for t in range(STEPS):
        old.step(t)
    with caplog.at_level(logging.INFO, logger="jax_cgx"):
        resized = cgx_optax.resize_state(old.state, PARAMS, AXIS, world=after)
    per_device = P(AXIS) in jax.tree.leaves(old.specs)
    assert (f"{before} -> {after} devices" if per_device else "no per-device leaves") in caplog.text

    new = Run(case, device_mesh((after,), (AXIS,)))
    abstract = jax.eval_shape(new._init, new.params)
    # The saved layout's shapes from the new state's, through resize_state (orbax's restore target).
    saved = jax.eval_shape(lambda s: cgx_optax.resize_state(s, PARAMS, AXIS, world=before), abstract)
    assert jax.tree.map(lambda s: (s.shape, s.dtype), saved) == jax.tree.map(lambda s: (s.shape, s.dtype), old.state)
    assert jax.tree.map(lambda s: (s.shape, s.dtype), resized) == jax.tree.map(lambda s: (s.shape, s.dtype), abstract)

    specs = jax.tree.leaves(old.specs)
    for (path, a), b, spec in zip(_flat(old.state), jax.tree.leaves(resized), specs, strict=True):
        name = jax.tree_util.keystr(path)
        a, b = np.asarray(a), np.asarray(b)
        if spec == P():
            np.testing.assert_array_equal(a, b, err_msg=f"{name}: a replicated leaf is kept bitwise")
        elif case == ZERO_CASE and ".residual" not in name:
            # one flat parameter, padded for the device count: the same values, padded again
            n = next(np.size(v) for k, v in PARAMS.items() if f"['{k}']" in name)
            np.testing.assert_array_equal(a[:n], b[:n], err_msg=f"{name}: kept bitwise")
            assert not b[n:].any(), name
        else:
            # per-device: every new device holds the old devices' mean, so their mean is unchanged
            old_blocks = _blocks(a, before).astype(np.float64)
            new_blocks = _blocks(b, after)
            assert all(np.array_equal(new_blocks[0], blk) for blk in new_blocks[1:]), name
            want = old_blocks.mean(0)
            if case == ZERO_CASE:  # each device's whole flat gradient: compare the unpadded part
                n = next(np.size(v) for k, v in PARAMS.items() if f"['{k}']" in name)
                want, got = want[:n], new_blocks[0][:n].astype(np.float64)
            else:
                got = new_blocks[0].astype(np.float64)
            # float32: the sum of `before` values, then a division, then one rounding
            bound = (before + 1) * EPS32 * np.abs(old_blocks).mean(0)[: got.size] + np.finfo(np.float32).tiny
            assert np.all(np.abs(got - want) <= bound), f"{name}: {np.max(np.abs(got - want) - bound)}"
            assert np.any(want != 0), f"{name}: the run left nothing per device to check"

    new.state = jax.device_put(resized, new.shardings(new.specs))
    params = new.step(STEPS)
    assert all(np.all(np.isfinite(v)) for v in params.values())


def test_the_same_world_keeps_the_state(caplog):
    run = Run("mean+ef", device_mesh((8,), (AXIS,))).init()
    run.step(0)
    with caplog.at_level(logging.INFO, logger="jax_cgx"):
        assert cgx_optax.resize_state(run.state, PARAMS, AXIS, world=8) is run.state
    assert "saved on 8 devices already" in caplog.text


def test_a_state_of_other_parameters_is_refused():
    run = Run("mean+ef", device_mesh((8,), (AXIS,))).init()
    other = dict(PARAMS, w=np.zeros((40, 64), np.float32))
    # Its momentum (laid out as the parameters) says it first.
    with pytest.raises(ValueError, match=r"resize_state: the state at \[1\]\[0\]\.trace\['w'\] has shape \(64, 40\) "
                                         r"where the parameter has \(40, 64\)"):
        cgx_optax.resize_state(run.state, other, AXIS, world=4)
    with pytest.raises(ValueError, match=r"resize_state: .*\['w'\] has shape \(512, 40\), which is not a stack"):
        cgx_optax.resize_state(run.state[0], other, AXIS, world=4)  # the mean's state alone
    with pytest.raises(ValueError, match="world must be an integer >= 1"):
        cgx_optax.resize_state(run.state, PARAMS, AXIS, world=0)


def test_the_state_of_a_smaller_model_of_the_same_width_is_refused():
    # Halving a leaf's first dimension with twice the devices keeps the per-device stack's shape:
    # (64, 40) on 8 devices is (512, 40), as (32, 40) on 16. Adam's moments (laid out as the
    # parameters) say it; with a momentum-SGD chain, saved_world= does.
    smaller = dict(PARAMS, w=np.zeros((32, 40), np.float32), h=np.zeros((24, 30), np.float32))
    adam = Run("mean", device_mesh((8,), (AXIS,))).init()
    with pytest.raises(ValueError, match=r"the state at \[1\]\[0\]\.mu\['h'\] has shape \(48, 30\) where the "
                                         r"parameter has \(24, 30\): it is the state of other parameters"):
        cgx_optax.resize_state(adam.state, smaller, AXIS, world=4)
    # the mean's state alone: nothing laid out as the parameters
    mean = Run("mean+ef", device_mesh((8,), (AXIS,))).init().state[0]
    with pytest.raises(ValueError, match=r"laid out for 16 devices with these parameters, not the saved_world=8"):
        cgx_optax.resize_state(mean, smaller, AXIS, world=4, saved_world=8)
    resized = cgx_optax.resize_state(mean, PARAMS, AXIS, world=4, saved_world=8)
    assert resized.residual["w"].shape == (4 * 64, 40)
