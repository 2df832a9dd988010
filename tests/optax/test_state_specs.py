"""jax_cgx.optax.state_specs: the shard_map specs of any optax state that holds jax_cgx's
(chain, named_chain, inject_hyperparams, MultiSteps, apply_if_finite, nested), on 8 CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from allreduce_cases import W, mesh_1d
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cgx.optax as cgx_optax
from jax_cgx import CompressionConfig

FOUR = CompressionConfig(bits=4, bucket_size=64, min_size=16)
PARAMS = {"w": jnp.ones((64, 40)), "b": jnp.ones((40,)), "h": jnp.ones((48, 32), jnp.bfloat16)}
STEPS = 5  # odd: MultiSteps(every_k_schedule=2) ends with one gradient accumulated


def _mean():
    return cgx_optax.compressed_mean("d", FOUR, layer_min_size=100, error_feedback=True)


def _sgd_in_chain(learning_rate):
    return optax.chain(_mean(), optax.sgd(learning_rate, momentum=0.9))


CASES = {
    "chain": lambda: optax.chain(_mean(), optax.adam(1e-2)),
    "named_chain": lambda: optax.named_chain(("mean", _mean()), ("sgd", optax.sgd(0.1, momentum=0.9))),
    "inject_hyperparams": lambda: optax.inject_hyperparams(_sgd_in_chain)(learning_rate=0.1),
    "MultiSteps": lambda: optax.MultiSteps(_sgd_in_chain(0.1), every_k_schedule=2),
    "nested topk": lambda: optax.chain(
        optax.chain(cgx_optax.topk_mean("d", 0.05, min_size=100)),
        optax.apply_if_finite(optax.adam(1e-2), 3),
    ),
    "powersgd in inject_hyperparams in MultiSteps": lambda: optax.MultiSteps(
        optax.inject_hyperparams(
            lambda learning_rate: optax.chain(cgx_optax.powersgd_mean("d", start_iter=1), optax.sgd(learning_rate))
        )(learning_rate=0.1),
        every_k_schedule=2,
    ),
    "cast_mean in MultiSteps": lambda: optax.MultiSteps(
        optax.chain(cgx_optax.cast_mean("d"), optax.adam(1e-2)), every_k_schedule=2),
}


def _gradients(seed):
    """Each device's own gradient for every step: leaves [STEPS, W, ...], different per device."""
    leaves, treedef = jax.tree.flatten(PARAMS)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return treedef.unflatten([jax.random.normal(k, (STEPS, W, *p.shape)).astype(p.dtype)
                              for k, p in zip(keys, leaves)])


def _update(tx, g, params, state):
    """One step inside shard_map: ``g`` is this device's slice ``[1, ...]`` of the gradients."""
    updates, state = tx.update(jax.tree.map(lambda v: v[0], g), state, params)
    return optax.apply_updates(params, updates), state


@pytest.mark.parametrize("case", CASES)
def test_specs_carry_the_state_across_shard_map_calls(case):
    """init with out_specs=specs, then every step a shard_map call with in_specs=out_specs=specs
    (check_vma=True: shard_map refuses P() for a leaf typed as differing between devices; the test
    below shows it). P("d") is given exactly where the devices' leaves differ."""
    tx = CASES[case]()
    mesh = mesh_1d()
    specs = cgx_optax.state_specs(jax.eval_shape(tx.init, PARAMS), "d")
    grads = jax.device_put(_gradients(1), NamedSharding(mesh, P(None, "d")))
    params = jax.device_put(PARAMS, NamedSharding(mesh, P()))

    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
    step = jax.jit(jax.shard_map(lambda g, p, s: _update(tx, g, p, s), mesh=mesh,
                                 in_specs=(P("d"), P(), specs), out_specs=(P(), specs)))
    p = params
    for t in range(STEPS):
        p, state = step(jax.tree.map(lambda v: v[t], grads), p, state)
    for k in PARAMS:
        assert not np.array_equal(np.asarray(p[k]), np.asarray(PARAMS[k]))  # the steps did something
    assert P("d") in jax.tree.leaves(specs)  # every case keeps something per device
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    for (path, leaf), spec in zip(flat, jax.tree.leaves(specs), strict=True):
        if spec == P("d"):  # the devices' leaves, concatenated along axis 0: they differ
            blocks = np.split(np.asarray(leaf), W)
            assert any(not np.array_equal(blocks[0], b) for b in blocks[1:]), jax.tree_util.keystr(path)


def test_specs_are_the_ones_written_by_hand_before():
    # The specs tests/optax/test_optax_mean.py wrote out for a chain and a MultiSteps state (the
    # same specs, so the same shard_map programs and bits as before).
    chain = optax.chain(_mean(), optax.apply_if_finite(optax.sgd(0.1), 3))
    state = jax.eval_shape(chain.init, PARAMS)
    assert cgx_optax.state_specs(state, "d") == (
        cgx_optax.compressed_mean_state_specs(state[0], "d"), jax.tree.map(lambda _: P(), state[1]))
    multi = jax.eval_shape(CASES["MultiSteps"]().init, PARAMS)
    assert cgx_optax.state_specs(multi, "d") == jax.tree.map(lambda _: P(), multi)._replace(
        acc_grads=jax.tree.map(lambda _: P("d"), multi.acc_grads),
        inner_opt_state=(cgx_optax.compressed_mean_state_specs(multi.inner_opt_state[0], "d"),)
        + jax.tree.map(lambda _: P(), multi.inner_opt_state[1:]),
    )


def test_the_earlier_names_are_the_same_helper():
    # Applied to our bare states they give what they gave before: count P(), per-device leaves
    # P(axis), placeholders (optax.MaskedNode, no leaves) kept as they are, and the momentum of an uncompressed leaf's mean P().
    assert cgx_optax.compressed_mean_state_specs is cgx_optax.state_specs
    assert cgx_optax.topk_state_specs is cgx_optax.state_specs
    params = {"w": jnp.ones((64, 40)), "b": jnp.ones((40,))}
    mean = jax.eval_shape(_mean().init, params)
    assert cgx_optax.compressed_mean_state_specs(mean, "d") == cgx_optax.CompressedMeanState(
        P(), {"w": P("d"), "b": optax.MaskedNode()})
    topk = jax.eval_shape(cgx_optax.topk_mean("d", min_size=100).init, params)
    assert cgx_optax.topk_state_specs(topk, ("a", "b")) == cgx_optax.TopKState(
        P(), {"w": P(("a", "b")), "b": P()}, {"w": P(("a", "b")), "b": optax.MaskedNode()})


def test_a_transformation_before_the_mean_is_refused_by_shard_map():
    # optax.trace before the mean keeps each device's own momentum, which the walk gives P():
    # under check_vma shard_map refuses to return it so, rather than keep one device's copy.
    tx = optax.chain(optax.trace(0.9), _mean())
    mesh = mesh_1d()
    specs = cgx_optax.state_specs(jax.eval_shape(tx.init, PARAMS), "d")
    assert specs[0].trace == {"w": P(), "b": P(), "h": P()}
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(
        jax.device_put(PARAMS, NamedSharding(mesh, P())))
    g = jax.device_put(jax.tree.map(lambda v: v[0], _gradients(2)), NamedSharding(mesh, P("d")))
    params = jax.device_put(PARAMS, NamedSharding(mesh, P()))
    step = jax.shard_map(lambda g, p, s: _update(tx, g, p, s), mesh=mesh,
                         in_specs=(P("d"), P(), specs), out_specs=(P(), specs))
    with pytest.raises(ValueError, match="out_specs"):
        jax.jit(step)(g, params, state)


def test_multisteps_accumulator_of_a_scalar_is_refused():
    tx = optax.MultiSteps(_sgd_in_chain(0.1), every_k_schedule=2)
    state = jax.eval_shape(tx.init, {"w": jnp.ones((64, 40)), "temperature": jnp.ones(())})
    with pytest.raises(ValueError, match=r"\.acc_grads\['temperature'\].*shape \(1,\)"):
        cgx_optax.state_specs(state, "d")
    # After the mean, a MultiSteps accumulates means: replicated, scalars included.
    after = optax.chain(_mean(), optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2))
    specs = cgx_optax.state_specs(jax.eval_shape(after.init, {"w": jnp.ones((64, 40)), "t": jnp.ones(())}), "d")
    assert specs[1].acc_grads == {"w": P(), "t": P()} and specs[0].residual == {"w": P("d"), "t": optax.MaskedNode()}


def test_the_means_work_inside_optax_masked():
    # optax.masked hands its inner transformation MaskedNode updates where the mask is False; the
    # state's own placeholders are MaskedNode too: the state check takes both (before: refused).
    mesh = mesh_1d()
    params = {"w": jnp.ones((64, 40)), "b": jnp.ones((40,)), "skip": jnp.ones((64, 40))}
    mask = {"w": True, "b": True, "skip": False}
    for inner in (_mean(), cgx_optax.topk_mean("d", 0.05, min_size=100), cgx_optax.powersgd_mean("d", start_iter=0)):
        tx = optax.masked(inner, mask)
        specs = cgx_optax.state_specs(jax.eval_shape(tx.init, params), "d")
        state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
        g = jax.device_put(jax.tree.map(lambda p: jnp.stack([p * (i + 1) for i in range(W)]), params),
                           NamedSharding(mesh, P("d")))
        def local(g, s):
            updates, s = tx.update(jax.tree.map(lambda v: v[0], g), s)
            skipped = updates.pop("skip")
            return updates, skipped[None], s

        step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("d"), specs), out_specs=(P(), P("d"), specs)))
        updates, skipped, _ = step(g, state)
        np.testing.assert_array_equal(skipped, np.asarray(g["skip"]))  # each device's own, left alone by the mask
        assert updates["w"].shape == (64, 40)
