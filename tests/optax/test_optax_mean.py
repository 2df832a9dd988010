"""jax_cgx.optax.compressed_mean (with and without error feedback) and cast_mean, on 8 virtual CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from allreduce_cases import W, mesh_1d, oracle, residual_bound, ring_oracle
from bitwise import assert_same_bits
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cgx
from jax_cgx import CompressionConfig
from jax_cgx._src.optax.mean import (
    CastMeanState,
    CompressedMeanState,
    cast_mean,
    compressed_mean,
)
from jax_cgx.optax import compressed_mean_state_specs

FOUR = CompressionConfig(bits=4, bucket_size=64, min_size=16)


def params_like():
    return {
        "w": jnp.zeros((64, 40)),  # compressed
        "b": jnp.zeros((40,)),  # ndim 1: exact
        "small": jnp.zeros((8, 8)),  # < layer_min_size: exact
        "h": jnp.zeros((40, 30), jnp.bfloat16),  # compressed, bfloat16
    }


def grads_like(params, lead=(W,), seed=0):
    """Random gradients shaped like ``params`` with leading axes ``lead`` (step, rank)."""
    keys = jax.random.split(jax.random.key(seed), len(jax.tree.leaves(params)))
    leaves, treedef = jax.tree.flatten(params)
    return treedef.unflatten(
        [
            (jax.random.normal(k, lead + p.shape) * (1 + jnp.arange(p.shape[-1]) / 8)).astype(p.dtype)
            for k, p in zip(keys, leaves)
        ]
    )


def put(tree, mesh, specs):
    return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), tree, specs)


def init_per_rank(tx, params, mesh):
    """The documented recipe: init inside shard_map with compressed_mean_state_specs."""
    specs = compressed_mean_state_specs(jax.eval_shape(tx.init, params), "d")
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
    return state, specs


def local(tree):
    return jax.tree.map(lambda v: v[0], tree)


def stacked(tree):
    return jax.tree.map(lambda v: v[None], tree)


# ------------------------------------------------------------- the mean itself


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_compressed_mean_is_compressed_pmean_with_the_layer_filter(stochastic):
    mesh = mesh_1d()
    params = params_like()
    config = FOUR.replace(stochastic=stochastic)
    tx = compressed_mean("d", config, layer_min_size=100, seed=3)
    grads = grads_like(params)
    filtered = {"w": config, "b": None, "small": None, "h": config}

    def body(g):
        g = local(g)
        state = tx.init(params)
        u0, state = tx.update(g, state)
        u1, state = tx.update(g, state)
        keys = [jax.random.fold_in(jax.random.key(3), t) for t in (0, 1)]
        refs = [jax_cgx.compressed_pmean(g, "d", filtered, key=k) for k in keys]
        exact = jax.lax.pmean({"b": g["b"], "small": g["small"]}, "d")
        return stacked((u0, u1, refs, exact, state.count))

    u0, u1, refs, exact, count = jax.tree.map(
        np.asarray,
        jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))(
            put(grads, mesh, jax.tree.map(lambda _: P("d"), grads))
        ),
    )
    for name in params:
        assert u0[name].dtype == params[name].dtype
        assert_same_bits(u0[name], refs[0][name], name)
        assert_same_bits(u1[name], refs[1][name], name)
    for name in ("b", "small"):
        assert_same_bits(u0[name], exact[name], f"{name} is lax.pmean")
    assert int(count[0]) == 2
    if stochastic:  # step 1 folds in another count: another rounding
        assert not np.array_equal(np.asarray(u0["w"]), np.asarray(u1["w"]))
    else:
        assert_same_bits(u0["w"], u1["w"])
    exact_w = np.asarray(grads["w"], np.float64).mean(0)
    assert np.abs(np.asarray(u0["w"][0]) - exact_w).max() < 0.2 * np.abs(exact_w).max()


def test_config_none_reads_the_environment_once(monkeypatch):
    monkeypatch.setenv("CGX_COMPRESSION_QUANTIZATION_BITS", "3")
    tx = compressed_mean("d", layer_min_size=16)
    monkeypatch.setenv("CGX_COMPRESSION_QUANTIZATION_BITS", "32")
    mesh = mesh_1d()
    g = grads_like({"w": jnp.zeros((30, 50))})

    def body(g):
        g = local(g)
        return stacked((tx.update(g, tx.init(g))[0], jax_cgx.compressed_pmean(
            g, "d", CompressionConfig.from_env({"CGX_COMPRESSION_QUANTIZATION_BITS": "3"}))))

    out, ref = jax.tree.map(
        np.asarray,
        jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))(put(g, mesh, {"w": P("d")})),
    )
    assert_same_bits(out["w"], ref["w"])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_cast_mean_is_a_half_precision_pmean(dtype):
    mesh = mesh_1d()
    tree = {"w": grads_like({"w": jnp.zeros((20, 30))})["w"], "n": jnp.arange(W * 3, dtype=jnp.int32).reshape(W, 3)}
    tx = cast_mean("d", dtype)
    assert tx.init(tree) == CastMeanState()

    def body(t):
        t = local(t)
        out, state = tx.update(t, tx.init(t))
        # PyTorch's hooks: cast, divide by the world size in the 16-bit type, sum, cast back.
        ref = jax.lax.psum(t["w"].astype(dtype) / W, "d").astype(t["w"].dtype)
        return stacked((out, ref, jax.lax.pmean(t["n"], "d")))

    out, ref, n_ref = jax.tree.map(
        np.asarray,
        jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))(
            put(tree, mesh, {"w": P("d"), "n": P("d")})
        ),
    )
    assert out["w"].dtype == jnp.float32  # non-float leaves: exactly lax.pmean (which returns floats)
    assert_same_bits(out["w"], ref)
    assert_same_bits(out["n"], n_ref)
    exact = np.asarray(tree["w"], np.float64).mean(0)
    np.testing.assert_allclose(np.asarray(out["w"][0]), exact, rtol=0.02, atol=0.02)


# ------------------------------------------------------------- error feedback


def _run_steps(tx, grads, mesh, check_vma=True):
    """``T`` updates (one ``lax.scan`` inside one shard_map) on ``grads[T, W, ...]``.

    Returns ``(updates[T, ...] from rank 0, residuals after each step [T, W, ...], final state)``.
    """
    params = jax.tree.map(lambda g: jnp.zeros(g.shape[2:], g.dtype), grads)
    state, specs = init_per_rank(tx, params, mesh)
    res_specs = jax.tree.map(lambda s: P(None, *s), specs.residual)

    def body(gs, state):
        def step(s, g):
            u, s = tx.update(g, s)
            return s, (u, s.residual)

        state, (us, res) = jax.lax.scan(step, state, jax.tree.map(lambda a: a[:, 0], gs))
        return jax.tree.map(lambda v: v[:, None], us), res, state

    f = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(jax.tree.map(lambda _: P(None, "d"), grads), specs),
            out_specs=(jax.tree.map(lambda _: P(None, "d"), grads), res_specs, specs),
            check_vma=check_vma,
        )
    )
    us, res, state = f(put(grads, mesh, jax.tree.map(lambda _: P(None, "d"), grads)), state)
    us = jax.tree.map(lambda u: np.asarray(u)[:, 0], us)
    if res != ():
        res = jax.tree.map(lambda r, g: np.asarray(r).reshape(g.shape) if r.size else r, res, grads)
    return us, res, state


T_STEPS = 30


def _drift_case(algorithm, error_feedback, bits=2):
    shape = (64, 48)
    k1, k2 = jax.random.split(jax.random.key(0))
    # A fixed mean plus noise: nearest rounding errs the same way step after step.
    grads = {"w": jax.random.normal(k1, shape) + 0.3 * jax.random.normal(k2, (T_STEPS, W, *shape))}
    config = CompressionConfig(bits=bits, bucket_size=128, algorithm=algorithm, min_size=16)
    tx = compressed_mean("d", config, error_feedback=error_feedback)
    us, res, state = _run_steps(tx, grads, mesh_1d())
    applied = np.asarray(us["w"], np.float64).sum(0)
    true = np.asarray(grads["w"], np.float64).mean(1).sum(0)
    return grads["w"], applied - true, res["w"] if error_feedback else None, state


@pytest.mark.parametrize("algorithm", ["sra", "ring"])
def test_error_feedback_telescopes_and_bounds_the_drift(algorithm):
    """Over T steps: sum_t applied_t == sum_t mean_r(g_r,t) - mean_r(e_r,T) (float32 rounding).

    So the drift of the applied updates from the true means is ``mean_r(e_r,T)``: one step's
    compression error of the mean, however many steps were taken. Checked against the
    analytic bound of the last step's exchange (nearest rounding: each rank's residual is
    at most half a quantization step of the quantization it ran, computed from the scales
    the oracle finds for the values compressed at the last step, ``c_r = g_r,T + e_r,T-1``),
    and, more loosely, against one quantization step ``R / (2^bits - 1)`` with ``R`` the
    widest range of the values any rank compressed (SRA: each rank's residual is at most
    half a step of its own quantization, step <= R / (2^bits-1), or of the owner's sum,
    step <= W R / (2^bits-1); the mean over ranks is below ((W-1)/2 + W/2) / W steps).
    Without error feedback the drift is the sum of T steps' errors: much larger.
    """
    bits = 2
    grads, drift, res, state = _drift_case(algorithm, True, bits)
    assert int(state.count) == T_STEPS
    final = res[-1].astype(np.float64)  # [W, ...]
    magnitude = T_STEPS * W * 2.0**-21 * (np.abs(np.asarray(grads, np.float64)).max() + np.abs(final).max())
    np.testing.assert_allclose(drift, -final.mean(0), rtol=0, atol=magnitude)

    config = CompressionConfig(bits=bits, bucket_size=128, algorithm=algorithm, min_size=16)
    compressed = (np.asarray(grads[-1]) + res[-2]).reshape(W, -1)  # float32, as the last step added them
    find = ring_oracle if algorithm == "ring" else oracle
    _, scales, chunk = find(compressed, config)[:3]
    per_rank = residual_bound(config, scales, chunk, compressed.shape[1])  # [W, n]
    assert np.all(np.abs(final.reshape(W, -1)) <= per_rank * (1 + 1e-4) + 1e-5)
    bound = per_rank.mean(0) * (1 + 1e-4) + 1e-5
    assert np.all(np.abs(drift.reshape(-1)) <= bound), f"drift above one step's bound by {np.max(np.abs(drift.reshape(-1)) - bound)}"
    if algorithm == "sra":
        widest = (compressed.max(1) - compressed.min(1)).max()
        assert np.abs(drift).max() <= widest / (2**bits - 1) * (1 + 1e-3)

    _, drift_without, _, _ = _drift_case(algorithm, False, bits)
    assert np.abs(drift_without).max() > 4 * np.abs(drift).max()


def test_error_feedback_state_and_shapes():
    params = params_like()
    with_ef = compressed_mean("d", FOUR, layer_min_size=100, error_feedback=True)
    without = compressed_mean("d", FOUR)
    # init runs outside shard_map: no collective, no bound axis.
    s = with_ef.init(params)
    assert isinstance(s, CompressedMeanState) and s.count.dtype == jnp.int32 and s.count.shape == ()
    assert s.residual["w"].shape == (64, 40) and s.residual["w"].dtype == jnp.float32
    assert s.residual["h"].dtype == jnp.bfloat16
    assert s.residual["b"] == s.residual["small"] == optax.MaskedNode()  # filtered: nothing to keep
    assert not np.any(np.asarray(s.residual["w"]))
    assert without.init(params) == CompressedMeanState(jnp.zeros([], jnp.int32), ())
    specs = compressed_mean_state_specs(s, "d")
    assert specs.count == P() and specs.residual["w"] == P("d") and specs.residual["b"] == optax.MaskedNode()


@pytest.mark.parametrize("error_feedback", [False, True])
def test_state_round_trips_through_jit_and_shard_map(error_feedback):
    mesh = mesh_1d()
    params = params_like()
    tx = compressed_mean("d", FOUR.replace(stochastic=True), layer_min_size=100, error_feedback=error_feedback)
    state, specs = init_per_rank(tx, params, mesh)
    g_specs = jax.tree.map(lambda _: P("d"), params)
    step = jax.jit(
        jax.shard_map(
            lambda g, s: (stacked(tx.update(local(g), s)[0]), tx.update(local(g), s)[1]),
            mesh=mesh,
            in_specs=(g_specs, specs),
            out_specs=(g_specs, specs),
        )
    )
    shapes = jax.tree.map(lambda a: (a.shape, a.dtype), state)
    outs = []
    for t in range(3):
        u, state = step(put(grads_like(params, seed=t), mesh, g_specs), state)
        jax.block_until_ready(u)
        assert jax.tree.map(lambda a: (a.shape, a.dtype), state) == shapes
        outs.append(u)
    assert int(state.count) == 3
    assert step._cache_size() == 1  # one compilation: the state never changed type
    if error_feedback:
        assert np.any(np.asarray(state.residual["w"]))


def test_pmap_matches_shard_map():
    mesh = mesh_1d()
    params = {"w": jnp.zeros((50, 40))}
    tx = compressed_mean("i", CompressionConfig(bits=3, bucket_size=64, min_size=16), error_feedback=True)
    grads = grads_like(params, lead=(3, W), seed=4)
    state = jax.tree.map(lambda a: jnp.broadcast_to(a, (W, *a.shape)), tx.init(params))
    step = jax.pmap(tx.update, axis_name="i")
    pmapped = []
    for t in range(3):
        u, state = step(jax.tree.map(lambda g: g[t], grads), state)
        pmapped.append(np.asarray(u["w"][0]))
    tx_d = compressed_mean("d", CompressionConfig(bits=3, bucket_size=64, min_size=16), error_feedback=True)
    us, res, _ = _run_steps(tx_d, grads, mesh)
    for t in range(3):
        assert_same_bits(pmapped[t], us["w"][t], f"step {t}")
    assert_same_bits(np.asarray(state.residual["w"]), res["w"][-1])


def _train(tx, params, grads_per_step, state_specs_of):
    """Run ``tx`` for the given per-rank gradients (a list of ``{leaf: [W, ...]}``) inside shard_map.

    ``init`` runs outside shard_map (no collective); ``state_specs_of(state)`` gives the
    state's specs, the per-rank parts ``P("d")`` (the ranks' copies, concatenated). Returns
    every step's ``(params, state)`` as numpy.
    """
    mesh = mesh_1d()
    state = tx.init(params)
    specs = state_specs_of(state)
    state = put(
        jax.tree.map(lambda a, s: jnp.concatenate([a] * W) if s == P("d") else a, state, specs), mesh, specs
    )
    g_specs = jax.tree.map(lambda _: P("d"), params)

    def body(g, p, s):
        u, s = tx.update(local(g), s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(g_specs, P(), specs), out_specs=(P(), specs)))
    history = []
    for g in grads_per_step:
        params, state = step(put(g, mesh, g_specs), params, state)
        jax.block_until_ready(params)
        history.append((jax.tree.map(np.asarray, params), jax.tree.map(np.asarray, state)))
    return history


def test_apply_if_finite_after_compressed_mean_skips_a_nan_step_on_every_rank():
    """chain(compressed_mean(ef), apply_if_finite(sgd)): a NaN on one rank skips the step everywhere,
    and the residuals survive it."""
    params = {"w": jnp.ones((64, 40)), "b": jnp.ones((40,))}
    tx = optax.chain(
        compressed_mean("d", FOUR, layer_min_size=100, error_feedback=True),
        optax.apply_if_finite(optax.sgd(0.1), 3),
    )
    grads = [grads_like(params, seed=t) for t in range(3)]
    grads[1]["w"] = grads[1]["w"].at[5, 0, 0].set(jnp.nan)  # rank 5 only
    history = _train(
        tx,
        params,
        grads,
        lambda s: (compressed_mean_state_specs(s[0], "d"), jax.tree.map(lambda _: P(), s[1])),
    )
    for p, _ in history:
        assert all(np.all(np.isfinite(v)) for v in jax.tree.leaves(p))
    (p0, s0), (p1, s1), (p2, s2) = history
    assert not np.array_equal(p0["w"], np.ones((64, 40), np.float32))
    assert_same_bits(p1["w"], p0["w"])
    assert_same_bits(p1["b"], p0["b"])
    assert_same_bits(s1[0].residual["w"], s0[0].residual["w"])
    assert int(s1[1].total_notfinite) == 1 and int(s1[0].count) == 1  # the bad step does not count
    assert not np.array_equal(p2["w"], p1["w"])
    assert np.all(np.isfinite(s2[0].residual["w"])) and not np.array_equal(s2[0].residual["w"], s1[0].residual["w"])


def test_multisteps_composes():
    """MultiSteps(chain(compressed_mean(ef), sgd), 2): every 2nd step applies the mean of the
    averaged micro-gradients, exactly as the chain would on that average."""
    params = {"w": jnp.ones((64, 40)), "b": jnp.ones((40,))}
    inner = optax.chain(compressed_mean("d", FOUR, layer_min_size=100, error_feedback=True), optax.sgd(0.1))
    tx = optax.MultiSteps(inner, every_k_schedule=2)
    grads = [grads_like(params, seed=t) for t in range(4)]

    def specs_of(state):
        return jax.tree.map(lambda _: P(), state)._replace(
            acc_grads=jax.tree.map(lambda _: P("d"), state.acc_grads),
            inner_opt_state=(compressed_mean_state_specs(state.inner_opt_state[0], "d"),)
            + jax.tree.map(lambda _: P(), state.inner_opt_state[1:]),
        )

    history = _train(tx, params, grads, specs_of)
    # MultiSteps' running mean of the two micro-gradients, then the chain on it.
    averaged = [jax.tree.map(lambda a, b: a + (b - a) / 2, grads[i], grads[i + 1]) for i in (0, 2)]
    reference = _train(
        inner, params, averaged, lambda s: (compressed_mean_state_specs(s[0], "d"), jax.tree.map(lambda _: P(), s[1]))
    )
    assert_same_bits(history[0][0]["w"], np.ones((64, 40), np.float32))
    assert_same_bits(history[2][0]["w"], history[1][0]["w"])
    for name in params:
        assert_same_bits(history[1][0][name], reference[0][0][name], name)
        assert_same_bits(history[3][0][name], reference[1][0][name], name)
    assert_same_bits(history[3][1].inner_opt_state[0].residual["w"], reference[1][1][0].residual["w"])


def test_apply_if_finite_around_compressed_mean_composes_under_pmap():
    """Finite gradients: apply_if_finite(compressed_mean) gives compressed_mean's updates.

    (Under shard_map(check_vma=True) optax.apply_if_finite cannot wrap any mean, lax.pmean
    included: its reject branch returns varying zeros, its accept branch an invariant mean.
    And wrapping is unsafe when only some ranks see a NaN; see compressed_mean's docstring.)
    """
    params = {"w": jnp.zeros((64, 40))}
    inner = compressed_mean("i", FOUR, error_feedback=True)
    tx = optax.apply_if_finite(inner, 2)
    g = grads_like(params)
    replicate = lambda s: jax.tree.map(lambda a: jnp.broadcast_to(a, (W, *a.shape)), s)  # noqa: E731
    u, s = jax.pmap(tx.update, axis_name="i")(g, replicate(tx.init(params)))
    v, r = jax.pmap(inner.update, axis_name="i")(g, replicate(inner.init(params)))
    assert_same_bits(u["w"], v["w"])
    assert_same_bits(s.inner_state.residual["w"], r.residual["w"])


def test_check_vma_off_and_invariant_gradients():
    mesh = mesh_1d()
    params = {"w": jnp.zeros((64, 40))}
    tx = compressed_mean("d", FOUR, error_feedback=True)
    grads = grads_like(params, lead=(2, W))
    a, ra, _ = _run_steps(tx, grads, mesh, check_vma=True)
    b, rb, _ = _run_steps(tx, grads, mesh, check_vma=False)
    assert_same_bits(a["w"], b["w"])
    assert_same_bits(ra["w"], rb["w"])


def test_bad_arguments():
    with pytest.raises(TypeError, match="config must be"):
        compressed_mean("d", 4)
    with pytest.raises(ValueError, match="layer_min_size must be an integer >= 0, got -1"):
        compressed_mean("d", FOUR, layer_min_size=-1)
    with pytest.raises(ValueError, match=r"layer_min_size must be an integer >= 0, got 2.5 \(float\); non-integers"):
        compressed_mean("d", FOUR, layer_min_size=2.5)
    with pytest.raises(ValueError, match="layer_min_size must be an integer >= 0, got the bool True"):
        compressed_mean("d", FOUR, layer_min_size=True)
    with pytest.raises(ValueError, match="seed must be an integer, got 0.5"):
        compressed_mean("d", FOUR, seed=0.5)
    with pytest.raises(ValueError, match="seed must be an integer, got the bool True"):
        compressed_mean("d", FOUR, seed=True)
    with pytest.raises(ValueError, match="error_feedback must be True or False, got 'yes'"):
        compressed_mean("d", FOUR, error_feedback="yes")
    compressed_mean("d", FOUR, layer_min_size=1e3, seed=np.int64(3))  # integral values are fine
    with pytest.raises(ValueError, match="impl"):
        compressed_mean("d", FOUR, impl="gpu")
    for dtype in (jnp.int8, jnp.float32, None, "float8_e4m3fn"):  # only the two 16-bit floats
        with pytest.raises(TypeError, match="dtype must be jnp.bfloat16 or jnp.float16"):
            cast_mean("d", dtype)
    for make in (lambda a: compressed_mean(a, FOUR), cast_mean):  # a mean over no axis: replicas drift
        with pytest.raises(ValueError, match=r"axis_name must name at least one mapped axis .*got \(\)"):
            make(())
    with pytest.raises(NameError, match="not bound"):
        cast_mean("d").update({"w": jnp.ones(3)}, CastMeanState())


# ------------------------------------------------------------- non-finite steps, mismatched states


def _stepper(tx, params):
    """One jit(shard_map) step: ``(step(grads, state) -> (updates [W, ...], state), initial state)``."""
    mesh = mesh_1d()
    state, specs = init_per_rank(tx, params, mesh)
    g_specs = jax.tree.map(lambda _: P("d"), params)

    def body(g, s):
        u, s = tx.update(local(g), s)
        return stacked(u), s

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(g_specs, specs), out_specs=(g_specs, specs)))
    return (lambda g, s: step(put(g, mesh, g_specs), s)), state


@pytest.mark.parametrize(
    "value,leaf,error_feedback",
    [(np.nan, "w", True), (np.inf, "h", True), (-np.inf, "b", True), (np.nan, "w", False)],
    ids=["nan-compressed-ef", "inf-bfloat16-ef", "neginf-exact-ef", "nan-compressed"],
)
def test_nonfinite_step_keeps_the_state_and_later_steps_are_unaffected(value, leaf, error_feedback):
    """Stochastic rounding (its key folds in the count) and error feedback: a non-finite gradient on
    one rank gives a non-finite mean on every rank, leaves the state (count and residuals) bitwise
    unchanged, and every later update is bitwise the one of a run without the bad step."""
    params = params_like()
    tx = compressed_mean("d", FOUR.replace(stochastic=True), layer_min_size=100, error_feedback=error_feedback, seed=1)
    step, init = _stepper(tx, params)
    steps = [grads_like(params, seed=20 + t) for t in range(3)]
    clean, state = [], init
    for g in steps:
        u, state = step(g, state)
        clean.append(u)
    clean_state = state

    bad = dict(steps[1])
    bad[leaf] = bad[leaf].at[(2,) + (0,) * params[leaf].ndim].set(value)  # rank 2
    state = init
    for t, g in enumerate([steps[0], bad, steps[1], steps[2]]):
        before = state
        u, state = step(g, state)
        if t == 1:
            for r in range(W):
                assert not np.isfinite(np.asarray(u[leaf], np.float32)[r]).all(), r
            for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state)):
                assert_same_bits(a, b, "state across the bad step")
        else:
            for name in params:
                assert_same_bits(u[name], clean[t - (t > 1)][name], f"step {t} {name}")
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(clean_state)):
        assert_same_bits(a, b, "final state")
    assert int(state.count) == 3


def test_nonfinite_step_without_state_to_keep_is_not_checked():
    """Nearest rounding, no error feedback: no later update depends on the state, so the mean is not
    checked (a pass over every gradient each step): the bad step counts, and every later update is
    bitwise the one of a run without it."""
    params = params_like()
    tx = compressed_mean("d", FOUR, layer_min_size=100)
    step, init = _stepper(tx, params)
    steps = [grads_like(params, seed=30 + t) for t in range(2)]
    clean = [step(g, init)[0] for g in steps]
    bad = dict(steps[0], w=steps[0]["w"].at[(2, 0, 0)].set(np.nan))
    state = init
    for t, g in enumerate([bad, *steps]):
        u, state = step(g, state)
        if t:
            for name in params:
                assert_same_bits(u[name], clean[t - 1][name], f"step {t} {name}")
    assert int(state.count) == 3
    for config, checked in ((FOUR, False), (FOUR.replace(stochastic=True), True)):
        tx = compressed_mean("d", config, layer_min_size=100)
        mesh = mesh_1d()
        state, specs = init_per_rank(tx, params, mesh)
        g_specs = jax.tree.map(lambda _: P("d"), params)
        body = jax.shard_map(lambda g, s: tx.update(local(g), s)[1], mesh=mesh, in_specs=(g_specs, specs),
                             out_specs=specs)
        assert ("is_finite" in str(jax.make_jaxpr(body)(put(steps[0], mesh, g_specs), state))) == checked


def test_mismatched_state_raises_naming_the_leaf_and_both_shapes():
    params = params_like()
    tx = compressed_mean("d", FOUR, layer_min_size=100, error_feedback=True)

    def error_of(state, tx=tx, updates=params):
        with pytest.raises(ValueError) as info:
            tx.update(updates, state)
        return str(info.value)

    # before: the mismatched leaf silently lost its error feedback
    msg = error_of(tx.init(dict(params, w=jnp.zeros((40, 64)))))
    assert "compressed_mean: state.residual['w'] has shape (40, 64), expected (64, 40)" in msg
    assert "update ['w'] of shape (64, 40)" in msg and "Build the state with this transformation's init" in msg
    # a state for another layer_min_size: 'small' kept a residual it does not have here
    msg = error_of(compressed_mean("d", FOUR, layer_min_size=10, error_feedback=True).init(params))
    assert "state.residual['small'] has shape (8, 8), expected no state (optax.MaskedNode())" in msg
    # shard_map's stacked per-rank residuals, as if given the spec P() instead of P("d")
    state = tx.init(params)
    global_residual = jax.tree.map(lambda e: jnp.concatenate([e] * W) if e.size else e, state.residual)
    msg = error_of(state._replace(residual=global_residual))
    assert "state.residual['h'] has shape (320, 30), expected (40, 30)" in msg and "P(axis_name)" in msg
    # with and without error feedback
    msg = error_of(compressed_mean("d", FOUR).init(params))
    assert "state.residual does not have the structure of the updates" in msg and "['w']" in msg
    msg = error_of(state, tx=compressed_mean("d", FOUR))
    assert "built with error_feedback=True" in msg and "this compressed_mean has error_feedback=False" in msg
    # another structure, another state type, a batched count
    msg = error_of(state, updates={"w": params["w"]})
    assert "state leaves not in the updates" in msg and "['small']" in msg
    assert "expected a CompressedMeanState" in error_of(CastMeanState())
    msg = error_of(state._replace(count=jnp.zeros((W,), jnp.int32)))
    assert "state.count must be a scalar, shape (), got shape (8,)" in msg
    with pytest.raises(ValueError, match="cast_mean: expected a CastMeanState .* got CompressedMeanState"):
        cast_mean("d").update(params, state)


def test_complex_leaves_are_averaged_exactly():
    """Complex leaves are non-float: compressed_mean (with error feedback) and cast_mean average
    them exactly, imaginary part included."""
    mesh = mesh_1d()
    shape = (64, 40)
    z = (grads_like({"z": jnp.zeros(shape)})["z"] + 1j * grads_like({"z": jnp.zeros(shape)}, seed=1)["z"]).astype(
        jnp.complex64
    )
    ef = compressed_mean("d", FOUR, layer_min_size=16, error_feedback=True)
    assert ef.init({"z": z[0]}).residual["z"] == optax.MaskedNode()

    def body(z):
        g = {"z": z[0]}
        exact = jax.lax.pmean(g["z"], "d")
        return stacked((ef.update(g, ef.init(g))[0]["z"], cast_mean("d").update(g, CastMeanState())[0]["z"], exact))

    a, b, ref = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))(
        jax.device_put(z, NamedSharding(mesh, P("d")))
    )
    assert a.dtype == b.dtype == jnp.complex64 and np.abs(np.asarray(ref).imag).max() > 0.1
    np.testing.assert_array_equal(np.asarray(a), np.asarray(ref))
    np.testing.assert_array_equal(np.asarray(b), np.asarray(ref))


def test_layer_filter_is_compressed_means_per_leaf_config():
    import jax_cgx.optax as cgx_optax

    config = CompressionConfig(bits=4, min_size=16)
    spec = cgx_optax.layer_filter(config, layer_min_size=100)
    leaves = {"w": jnp.zeros((10, 20)), "small": jnp.zeros((5, 5)), "bias": jnp.zeros(500),
              "ints": jnp.zeros((10, 20), jnp.int32)}
    assert {k: spec((), v) for k, v in leaves.items()} == {"w": config, "small": None, "bias": None, "ints": None}
    by_path = cgx_optax.layer_filter(lambda path, leaf: config.replace(bits=8), layer_min_size=100)
    assert by_path((), leaves["w"]).bits == 8 and by_path((), leaves["bias"]) is None
