"""powersgd_mean (PyTorch's powerSGD_hook as an optax transformation) against a numpy reference.

The reference runs the same algorithm in float64 over simulated ranks: per-rank gradients
xs[W, ...]; P = sum_r M_r Q, Gram-Schmidt, Q = mean_r M_r^T P, out = P Q^T, E_r = M_r - out.
Each step is checked from the state the transformation itself produced, so rounding never
accumulates between the two.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from bitwise import assert_same_bits
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from meshes import device_mesh

from jax_cgx._src.optax import powersgd
from jax_cgx._src.optax.powersgd import powersgd_bytes
from jax_cgx.optax import PowerSGDState, TopKState, powersgd_mean

W = 8
AUTO = jax.sharding.AxisType.Auto


SHAPES = {
    "w": ((16, 12), jnp.float32),  # compressed
    "conv": ((8, 3, 2, 2), jnp.float32),  # [8, 12], compressed
    "b": ((12,), jnp.float32),  # 1-D
    "s": ((), jnp.float32),  # scalar
    "tiny": ((2, 2), jnp.float32),  # too small to shrink
    "h": ((16, 8), jnp.bfloat16),  # compressed, bfloat16
}


def params_like(shapes=SHAPES):
    return {k: jnp.zeros(s, d) for k, (s, d) in shapes.items()}


def rank_grads(seed, shapes=SHAPES, scale=1.0):
    """One step's gradients of every rank: a dict of [W, *shape] arrays."""
    rng = np.random.default_rng(seed)
    return put({k: jnp.asarray(scale * rng.standard_normal((W, *s)), d) for k, (s, d) in shapes.items()}, P("d"))


# --- running it ---------------------------------------------------------------------------


def put(tree, spec, mesh=None):
    """device_put with ``spec`` (zero-size placeholders replicated: where jit puts them)."""
    mesh = mesh or device_mesh((W,), ("d",), AUTO)
    return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, spec if x.size else P())), tree)


def to_global(state, q_per_rank=False, mesh=None, dev=P("d")):
    """init's (per-rank) state as the global arrays shard_map takes: errors stacked along dim 0.

    Placed where the step's outputs will be, so the step compiles once.
    """
    stack = lambda x: jnp.concatenate([x] * W)  # noqa: E731
    return PowerSGDState(
        count=put(state.count, P(), mesh),
        q=put(jax.tree.map(stack, state.q), dev, mesh) if q_per_rank else put(state.q, P(), mesh),
        error=put(jax.tree.map(stack, state.error), dev, mesh),
    )


def per_rank_error(e):
    """A global (stacked) error leaf as [W, *leaf shape] (placeholders stay (0,))."""
    e = np.asarray(e)
    return e if e.size == 0 else e.reshape(W, e.shape[0] // W, *e.shape[1:])


def shard_map_step(tx, check_vma=True, q_per_rank=False, with_pmean=False):
    """jit(shard_map(tx.update)) over 'd': updates come back stacked [W, ...] (one row per rank)."""
    spec = PowerSGDState(count=P(), q=P("d") if q_per_rank else P(), error=P("d"))

    def body(g, state):
        g = jax.tree.map(lambda x: x[0], g)
        upd, state = tx.update(g, state)
        out = (jax.tree.map(lambda x: x[None], upd), state)
        if with_pmean:
            out += (jax.tree.map(lambda x: jax.lax.pmean(x, "d")[None], g),)
        return out

    out_specs = (P("d"), spec) + ((P("d"),) if with_pmean else ())
    return jax.jit(
        jax.shard_map(body, mesh=device_mesh((W,), ("d",), AUTO), in_specs=(P("d"), spec), out_specs=out_specs,
                      check_vma=check_vma)
    )


def pmap_step(tx):
    return jax.pmap(tx.update, axis_name="d")


def replicate(tree):
    return jax.tree.map(lambda x: jnp.stack([x] * W), tree)


# --- the reference ------------------------------------------------------------------------


def ref_orthogonalize(p, eps):
    p = np.array(p, np.float64)
    for i in range(p.shape[1]):
        norm = np.linalg.norm(p[:, i])
        p[:, i] = (p[:, i] / norm if norm > 0 else 0.0) if eps == 0 else p[:, i] / (norm + eps)
        for j in range(i + 1, p.shape[1]):
            p[:, j] -= (p[:, i] @ p[:, j]) * p[:, i]
    return p


def ref_leaf(gs, q, es, eps=0.0, error_feedback=True):
    """One rank-r PowerSGD step of one leaf over W simulated ranks, in float64.

    gs: [W, *shape] gradients; q: [m, r]; es: [W, *shape] errors (or None). Returns the mean
    estimate (leaf shape), the new Q, and M ([W, n, m]), the error-corrected local matrices.
    """
    gs = np.asarray(np.asarray(gs, np.float32), np.float64)
    n = gs.shape[1]
    mats = gs.reshape(W, n, -1)
    if error_feedback:
        mats = mats + np.asarray(es, np.float64).reshape(W, n, -1)
    q = np.asarray(q, np.float64)
    p = ref_orthogonalize(sum(m @ q for m in mats), eps)
    q_new = np.mean([m.T @ p for m in mats], axis=0)
    return (p @ q_new.T).reshape(gs.shape[1:]), q_new, mats


def tol(dtype):
    return dict(rtol=2e-2, atol=2e-2) if dtype == jnp.bfloat16 else dict(rtol=2e-5, atol=2e-5)


def check_step(tx_kwargs, grads, state_in, upd, state_out, fresh_q=None):
    """Compare one step of the transformation (from state_in) with the reference."""
    rank, ef = tx_kwargs.get("rank", 1), tx_kwargs.get("error_feedback", True)
    eps, warm = tx_kwargs.get("orthogonalization_epsilon", 0.0), tx_kwargs.get("warm_start", True)
    compressing = int(state_in.count) >= tx_kwargs.get("start_iter", 10)
    assert int(state_out.count) == int(state_in.count) + 1
    for k, (shape, dtype) in SHAPES.items():
        out = np.asarray(upd[k], np.float32)
        for r in range(1, W):  # every rank got the same result
            np.testing.assert_array_equal(out[r], out[0], err_msg=k)
        out = out[0].astype(np.float64)
        plan = powersgd._plan(shape, dtype, rank, tx_kwargs.get("min_compression_rate", 2.0))
        if plan is None or not compressing:
            np.testing.assert_allclose(out, np.mean(np.asarray(grads[k], np.float64), 0), **tol(dtype), err_msg=k)
            np.testing.assert_array_equal(np.asarray(state_out.q[k]), np.asarray(state_in.q[k]), err_msg=k)
            np.testing.assert_array_equal(np.asarray(state_out.error[k]), np.asarray(state_in.error[k]), err_msg=k)
            continue
        q_in = state_in.q[k] if warm else fresh_q[k]
        es = per_rank_error(state_in.error[k]) if ef else None
        approx, q_new, mats = ref_leaf(grads[k], q_in, es, eps, ef)
        np.testing.assert_allclose(out, approx, **tol(dtype), err_msg=k)
        if warm:
            np.testing.assert_allclose(np.asarray(state_out.q[k]), q_new, rtol=1e-4, atol=1e-5, err_msg=k)
        else:
            assert state_out.q[k] == optax.MaskedNode()
        if ef:  # E_r = M_r - (what was applied), float32
            e_ref = mats - out.reshape(1, shape[0], -1)
            np.testing.assert_allclose(
                per_rank_error(state_out.error[k]).reshape(e_ref.shape), e_ref, rtol=1e-5, atol=1e-5, err_msg=k
            )
        else:
            assert state_out.error[k] == optax.MaskedNode()


# --- tests --------------------------------------------------------------------------------


@pytest.mark.parametrize("rank,check_vma", [(1, True), (3, False)])
def test_matches_reference_shard_map(rank, check_vma):
    kw = dict(rank=rank, start_iter=2)
    tx = powersgd_mean("d", **kw)
    step = shard_map_step(tx, check_vma=check_vma)
    state = to_global(tx.init(params_like()))
    for t in range(5):
        grads = rank_grads(t)
        upd, new_state = step(grads, state)
        check_step(kw, grads, state, upd, new_state)
        state = new_state
    assert int(state.count) == 5


def test_matches_reference_pmap_and_shard_map_agree():
    kw = dict(rank=2, start_iter=1, orthogonalization_epsilon=1e-3)
    tx = powersgd_mean("d", **kw)
    sm, pm = shard_map_step(tx), pmap_step(tx)
    s_sm = to_global(tx.init(params_like()))
    s_pm = jax.pmap(lambda _: tx.init(params_like()))(np.arange(W))  # init inside pmap: no collectives

    def as_global(s):  # pmap's state [W, ...] in shard_map's layout
        s = jax.tree.map(np.asarray, s)
        return PowerSGDState(
            s.count[0],
            jax.tree.map(lambda x: x[0], s.q),
            jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]) if x[0].size else x[0], s.error),
        )

    for t in range(3):
        grads = rank_grads(10 + t)
        u_sm, n_sm = sm(grads, s_sm)
        u_pm, n_pm = pm(grads, s_pm)
        check_step(kw, grads, as_global(s_pm), u_pm, as_global(n_pm))
        for k in SHAPES:
            np.testing.assert_allclose(
                np.asarray(u_sm[k], np.float32), np.asarray(u_pm[k], np.float32), **tol(SHAPES[k][1]), err_msg=k
            )
        s_sm, s_pm = n_sm, n_pm


def test_warm_start_off_and_no_error_feedback():
    kw = dict(rank=2, start_iter=1, warm_start=False, error_feedback=False)
    tx = powersgd_mean("d", **kw)
    state = to_global(tx.init(params_like()))
    assert jax.tree.leaves((state.q, state.error)) == []  # optax.MaskedNode() everywhere
    step = shard_map_step(tx)
    for t in range(3):
        grads = rank_grads(20 + t)
        upd, new_state = step(grads, state)
        # the compressed leaves in flatten (sorted key) order, one draw for all of them
        names = [k for k in sorted(SHAPES) if powersgd._plan(*SHAPES[k], 2, 2.0)]
        sizes = tuple(powersgd._plan(*SHAPES[k], 2, 2.0)[1:] for k in names)
        fresh = dict(zip(names, powersgd._fresh_qs(int(state.count), seed=0, sizes=sizes, epsilon=0.0)))
        check_step(kw, grads, state, upd, new_state, fresh_q=fresh)
        state = new_state


def test_first_compressed_step_same_with_or_without_warm_start():
    grads = rank_grads(30)
    outs = []
    for warm in (True, False):
        tx = powersgd_mean("d", rank=2, start_iter=0, warm_start=warm)
        outs.append(shard_map_step(tx)(grads, to_global(tx.init(params_like())))[0])
    for k in SHAPES:
        np.testing.assert_array_equal(np.asarray(outs[0][k]), np.asarray(outs[1][k]), err_msg=k)


def test_rank1_gradient_recovered_exactly():
    # Every rank holds the same rank-1 gradient: a rank-1 PowerSGD step returns it to float32,
    # at every step (warm start from the previous step's Q). Without error feedback: with it,
    # the previous step's rounding error is added in, and a warm-start Q nearly orthogonal to
    # the new gradient's row space amplifies it.
    rng = np.random.default_rng(1)
    shapes = {"w": ((32, 24), jnp.float32), "c": ((6, 4, 5), jnp.float32)}
    for ef, steps in ((True, 1), (False, 3)):
        tx = powersgd_mean("d", rank=1, start_iter=0, error_feedback=ef)
        step = shard_map_step(tx)
        state = to_global(tx.init(params_like(shapes)))
        for t in range(steps):
            g = {
                k: np.outer(rng.standard_normal(s[0]), rng.standard_normal(int(np.prod(s[1:])))).reshape(s)
                for k, (s, _) in shapes.items()
            }
            upd, state = step(
                put({k: jnp.asarray(np.stack([v] * W), jnp.float32) for k, v in g.items()}, P("d")), state
            )
            for k, v in g.items():
                np.testing.assert_allclose(np.asarray(upd[k][0]), v, rtol=1e-5, atol=1e-5 * np.abs(v).max())
                if ef:  # the error left is only rounding
                    assert np.abs(np.asarray(state.error[k])).max() <= 1e-5 * np.abs(v).max()


def test_warmup_is_pmean_bitwise_and_leaves_state_alone():
    tx = powersgd_mean("d", rank=2, start_iter=3)
    step = shard_map_step(tx, with_pmean=True)
    state0 = to_global(tx.init(params_like()))
    state = state0
    for t in range(3):
        upd, state, pmean = step(rank_grads(40 + t), state)
        for k in SHAPES:
            np.testing.assert_array_equal(np.asarray(upd[k]), np.asarray(pmean[k]), err_msg=k)
            assert upd[k].dtype == SHAPES[k][1]
    for a, b in zip(jax.tree.leaves((state0.q, state0.error)), jax.tree.leaves((state.q, state.error))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    upd, state, pmean = step(rank_grads(43), state)  # now compressing
    assert not np.allclose(np.asarray(upd["w"]), np.asarray(pmean["w"]), atol=1e-3)


def test_small_and_1d_leaves_are_pmean_bitwise():
    shapes = {
        "b": ((12,), jnp.float32),
        "s": ((), jnp.float32),
        "tiny": ((2, 2), jnp.float32),
        "i": ((3, 4), jnp.int32),
        "wide": ((1, 64), jnp.float32),
        "hb": ((7,), jnp.bfloat16),
        "c": ((16, 12), jnp.complex64),  # complex: never compressed, the imaginary part kept
    }
    tx = powersgd_mean("d", rank=1, start_iter=0)
    state = to_global(tx.init(params_like(shapes)))
    assert jax.tree.leaves((state.q, state.error)) == []  # optax.MaskedNode() everywhere
    rng = np.random.default_rng(2)
    grads = {k: jnp.asarray(rng.standard_normal((W, *s)) * 10, d) for k, (s, d) in shapes.items()}
    grads["c"] = grads["c"] + 1j * jnp.asarray(rng.standard_normal((W, 16, 12)), jnp.float32)
    upd, _, pmean = shard_map_step(tx, with_pmean=True)(grads, state)
    for k in shapes:
        np.testing.assert_array_equal(np.asarray(upd[k]), np.asarray(pmean[k]), err_msg=k)


def test_min_compression_rate_is_strict_like_pytorch():
    # 4x4, r=1: 16 / (1 * 8) = 2 exactly -> not compressed (torch: 8 * 2 < 16 is False).
    # 5x5, r=1: 25 / 10 = 2.5 -> compressed at rate 2, not at rate 2.5.
    assert powersgd._plan((4, 4), jnp.float32, 1, 2.0) is None
    assert powersgd._plan((5, 5), jnp.float32, 1, 2.0) == (5, 5, 1)
    assert powersgd._plan((5, 5), jnp.float32, 1, 2.5) is None
    assert powersgd._plan((5, 5), jnp.float32, 9, 0.4) == (5, 5, 5)  # r = min(rank, n, m)
    assert powersgd._plan((3, 0), jnp.float32, 1, 0.0) is None  # empty
    shapes = {"a": ((4, 4), jnp.float32), "b": ((5, 5), jnp.float32)}
    for rate, compressed in ((2.0, {"b"}), (2.5, set())):
        tx = powersgd_mean("d", start_iter=0, min_compression_rate=rate)
        state = tx.init(params_like(shapes))
        assert {k for k in shapes if state.q[k] != optax.MaskedNode()} == compressed
        assert {k for k in shapes if state.error[k] != optax.MaskedNode()} == compressed
        grads = rank_grads(3, shapes)
        upd, _, pmean = shard_map_step(tx, with_pmean=True)(grads, to_global(state))
        np.testing.assert_array_equal(np.asarray(upd["a"]), np.asarray(pmean["a"]))
        assert np.array_equal(np.asarray(upd["b"]), np.asarray(pmean["b"])) == ("b" not in compressed)


def test_error_feedback_telescopes():
    # sum_t applied_t = sum_t mean_r g_t + mean_r (E_0 - E_T), E_0 = 0
    shapes = {"w": ((16, 12), jnp.float32), "c": ((8, 3, 4), jnp.float32)}
    tx = powersgd_mean("d", rank=1, start_iter=1)
    step = shard_map_step(tx)
    state = to_global(tx.init(params_like(shapes)))
    applied = {k: 0.0 for k in shapes}
    true = {k: 0.0 for k in shapes}
    for t in range(6):
        grads = rank_grads(50 + t, shapes)
        upd, state = step(grads, state)
        for k in shapes:
            applied[k] = applied[k] + np.asarray(upd[k][0], np.float64)
            true[k] = true[k] + np.mean(np.asarray(grads[k], np.float64), 0)
    for k in shapes:
        e_mean = per_rank_error(state.error[k]).astype(np.float64).mean(0)
        assert np.abs(e_mean).max() > 0.1  # a rank-1 estimate leaves a real error
        np.testing.assert_allclose(applied[k], true[k] - e_mean, rtol=0, atol=1e-4, err_msg=k)


def test_orthogonalize():
    x = jax.random.normal(jax.random.key(0), (50, 4))
    p = np.asarray(powersgd._orthogonalize(x, 0.0))
    np.testing.assert_allclose(p.T @ p, np.eye(4), atol=1e-5)
    np.testing.assert_allclose(p, ref_orthogonalize(x, 0.0), atol=1e-5)
    np.testing.assert_allclose(np.asarray(powersgd._orthogonalize(x, 0.5)), ref_orthogonalize(x, 0.5), atol=1e-5)
    # a zero column stays zero (no NaN) with epsilon 0
    z = np.asarray(powersgd._orthogonalize(x.at[:, 1].set(0.0), 0.0))
    assert np.isfinite(z).all() and not z[:, 1].any()
    np.testing.assert_allclose(z[:, [0, 2, 3]].T @ z[:, [0, 2, 3]], np.eye(3), atol=1e-5)


def test_estimate_is_an_orthogonal_projection():
    # out = P P^T mean(M) with orthonormal P: the residual is orthogonal to the estimate's columns.
    tx = powersgd_mean("d", rank=4, start_iter=0, error_feedback=False)
    shapes = {"w": ((40, 30), jnp.float32)}
    grads = rank_grads(60, shapes)
    upd, _ = shard_map_step(tx)(grads, to_global(tx.init(params_like(shapes))))
    out = np.asarray(upd["w"][0], np.float64)
    mean = np.mean(np.asarray(grads["w"], np.float64), 0)
    assert np.linalg.matrix_rank(out, tol=1e-4) == 4
    np.testing.assert_allclose(out.T @ (mean - out), 0.0, atol=1e-4)
    u = np.linalg.svd(out)[0][:, :4]  # its column space is the span of P
    np.testing.assert_allclose(u @ (u.T @ mean), out, atol=1e-4)


def test_zero_gradient_then_recovers():
    # A zero gradient at the first compressed step zeroes Q; the next step restarts that column
    # from the seeded normal instead of staying at zero (or NaN) forever.
    shapes = {"w": ((16, 12), jnp.float32)}
    tx = powersgd_mean("d", rank=1, start_iter=0)
    step = shard_map_step(tx)
    state = to_global(tx.init(params_like(shapes)))
    upd, state = step({"w": jnp.zeros((W, 16, 12))}, state)
    assert not np.asarray(upd["w"]).any() and not np.asarray(state.q["w"]).any()
    assert np.isfinite(np.asarray(state.error["w"])).all()
    v = np.outer(np.arange(1.0, 17.0), np.linspace(-1, 1, 12))
    upd, state = step({"w": jnp.asarray(np.stack([v] * W), jnp.float32)}, state)
    np.testing.assert_allclose(np.asarray(upd["w"][0]), v, rtol=1e-5, atol=1e-5 * np.abs(v).max())


def test_state_shapes_fixed_under_jit():
    tx = powersgd_mean("d", rank=2, start_iter=2)
    step = shard_map_step(tx)
    state = to_global(tx.init(params_like()))
    shapes = jax.tree.map(lambda x: (x.shape, x.dtype), state)
    assert state.count.dtype == jnp.int32 and state.count.shape == ()
    assert state.q["w"].shape == (12, 2) and state.q["conv"].shape == (12, 2) and state.q["b"] == optax.MaskedNode()
    assert state.error["w"].shape == (W * 16, 12) and state.error["h"].dtype == jnp.float32
    for t in range(4):
        _, state = step(rank_grads(70 + t), state)
        assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == shapes
    assert step._cache_size() == 1
    # init is jittable, uses no collectives, and matches its eval_shape
    local = jax.jit(tx.init)(params_like())
    assert jax.tree.map(lambda x: (x.shape, x.dtype), jax.eval_shape(tx.init, params_like())) == jax.tree.map(
        lambda x: (x.shape, x.dtype), local
    )


def test_chain_with_adam_check_vma_replicated_out_specs():
    # The usual layout: updates and the optimizer's state replicated (P()), only the error per rank.
    tx = optax.chain(powersgd_mean("d", rank=1, start_iter=1), optax.adam(1e-2))
    params = params_like()
    state = tx.init(params)
    spec = (PowerSGDState(count=P(), q=P(), error=P("d")), P())

    def body(params, g, state):
        upd, state = tx.update(jax.tree.map(lambda x: x[0], g), state, params)
        return optax.apply_updates(params, upd), state

    step = jax.jit(jax.shard_map(body, mesh=device_mesh((W,), ("d",), AUTO), in_specs=(P(), P("d"), spec),
                                 out_specs=(P(), spec)))
    state, params = (to_global(state[0]), put(state[1], P())), put(params, P())
    for t in range(3):
        params, state = step(params, rank_grads(80 + t), state)
    assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree.leaves(params))
    assert int(state[0].count) == 3


def _composite(inner):
    ms = optax.MultiSteps(inner, every_k_schedule=2)
    return optax.apply_if_finite(ms.gradient_transformation(), max_consecutive_errors=3)


@pytest.mark.parametrize("mapper", ["pmap", "shard_map"])
def test_composes_with_chain_multisteps_apply_if_finite(mapper):
    kw = dict(rank=2, start_iter=1)
    small = {k: SHAPES[k] for k in ("w", "b", "h")}
    inner = optax.chain(powersgd_mean("d", **kw), optax.sgd(0.5))
    tx = _composite(inner)
    if mapper == "pmap":
        run = jax.pmap(tx.update, axis_name="d")
    else:  # every state leaf per rank, stacked; check_vma off (MultiSteps/apply_if_finite state is local)

        def body(g, s):
            u, s = tx.update(jax.tree.map(lambda x: x[0], g), jax.tree.map(lambda x: x[0], s))
            return jax.tree.map(lambda x: x[None], (u, s))

        run = jax.jit(jax.shard_map(body, mesh=device_mesh((W,), ("d",), AUTO), in_specs=P("d"), out_specs=P("d"),
                                    check_vma=False))
    if mapper == "pmap":
        state = jax.pmap(lambda _: tx.init(params_like(small)))(np.arange(W))
    else:
        state = put(replicate(tx.init(params_like(small))), P("d"))
    g = [rank_grads(90 + t, small) for t in range(4)]
    nan = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), g[0])
    outs = []
    for grads in (g[0], g[1], nan, g[2], g[3]):
        upd, state = run(grads, state)
        outs.append(upd)
    assert int(state.total_notfinite[0]) == 1
    for k in small:
        for i in (0, 2, 3):  # mid-steps and the rejected step: zero updates
            assert not np.asarray(outs[i][k], np.float32).any(), (k, i)
    # The bare chain on the two-step averages: a warm-up pmean, then a compressed step from the
    # initial Q and zero error (which the warm-up left alone).
    q0 = powersgd_mean("d", **kw).init(params_like(small)).q
    for i, (a, b) in ((1, (g[0], g[1])), (4, (g[2], g[3]))):
        for k in small:
            avg = (np.asarray(a[k], np.float32) + np.asarray(b[k], np.float32)) / 2
            plan = powersgd._plan(*small[k], kw["rank"], 2.0)
            if i == 1 or plan is None:
                ref = avg.mean(0)
            else:
                ref = ref_leaf(avg, q0[k], None, error_feedback=False)[0]
            for r in range(W):
                np.testing.assert_allclose(
                    np.asarray(outs[i][k][r], np.float32), -0.5 * ref, **tol(small[k][1]), err_msg=k
                )
    assert int(state.inner_state.inner_opt_state[0].count[0]) == 2


def test_axis_subset_of_2d_mesh_with_check_vma():
    # Average over 'a' only of an ('a', 'b') mesh: the gradients, Q and errors also vary over 'b'.
    mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(AUTO, AUTO))
    shapes = {"w": ((16, 12), jnp.float32), "b": ((5,), jnp.float32)}
    tx = powersgd_mean("a", rank=2, start_iter=1)
    dev = P(("a", "b"))
    spec = PowerSGDState(count=P(), q=dev, error=dev)

    def body(g, state):
        upd, state = tx.update(jax.tree.map(lambda x: x[0], g), state)
        return jax.tree.map(lambda x: x[None], upd), state

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(dev, spec), out_specs=(dev, spec)))
    state = to_global(tx.init(params_like(shapes)), q_per_rank=True, mesh=mesh, dev=dev)
    for t in range(2):
        grads = rank_grads(100 + t, shapes)
        upd, new = step(grads, state)
        for b in range(2):  # device index = 2 a + b
            ranks = [2 * a + b for a in range(4)]
            gb = np.asarray(grads["w"])[ranks]
            mean = gb.mean(0)
            if t == 0:
                np.testing.assert_allclose(np.asarray(upd["w"])[ranks], np.stack([mean] * 4), rtol=1e-5, atol=1e-6)
                continue
            q = np.asarray(state.q["w"]).reshape(W, 12, 2)[ranks[0]]
            es = per_rank_error(state.error["w"])[ranks]
            gs = np.asarray(gb, np.float64).reshape(4, 16, 12) + es
            p = ref_orthogonalize(sum(m @ q for m in gs), 0.0)
            approx = p @ np.mean([m.T @ p for m in gs], 0).T
            for r in ranks:
                np.testing.assert_allclose(np.asarray(upd["w"][r]), approx, rtol=2e-5, atol=2e-5)
            np.testing.assert_allclose(
                np.asarray(upd["b"])[ranks], np.stack([np.asarray(grads["b"])[ranks].mean(0)] * 4), rtol=1e-5
            )
        state = new


def test_powersgd_bytes():
    # w: (16+12)*1*4 = 112; conv: (8+12)*4 = 80; b: 48; s: 4; tiny: 16; h: (16+8)*4 = 96 -> 356
    params = params_like()
    assert powersgd_bytes(params, 8) == 356 * 2 * 7 // 8
    assert powersgd_bytes(params, 1) == 0
    # rank 3: w 28*3*4 = 336; conv 20*3*2 = 120 < 96 fails -> 96*4; h 24*3*2 = 144 < 128 fails -> 16*8*2
    assert powersgd_bytes(params, 2, rank=3) == 336 + 384 + 48 + 4 + 16 + 256
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    assert powersgd_bytes(abstract, 4, min_compression_rate=100.0) == ((16 * 12 + 96 + 12 + 1 + 4) * 4 + 256) * 6 // 4


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(rank=0), "rank must be an integer >= 1, got 0"),
        (dict(rank=2.5), "rank must be an integer >= 1, got 2.5"),
        (dict(rank=True), "rank must be an integer >= 1, got the bool True"),
        (dict(rank="2"), "rank must be an integer >= 1, got '2'"),
        (dict(start_iter=-1), "start_iter must be an integer >= 0, got -1"),
        (dict(start_iter=2.5), r"start_iter must be an integer >= 0, got 2.5 \(float\); non-integers are not rounded"),
        (dict(start_iter=np.float32(1.5)), "start_iter must be an integer"),
        (dict(start_iter=False), "start_iter must be an integer >= 0, got the bool False"),
        (dict(start_iter=float("nan")), "start_iter must be an integer"),
        (dict(seed=0.5), "seed must be an integer, got 0.5"),
        (dict(seed=True), "seed must be an integer, got the bool True"),
        (dict(seed=2**64), "seed must fit in a signed 64-bit integer"),
        (dict(min_compression_rate=-1.0), "min_compression_rate must be a real number >= 0.0"),
        (dict(min_compression_rate=float("nan")), "min_compression_rate must be a real number"),
        (dict(min_compression_rate="2"), "min_compression_rate must be a real number"),
        (dict(orthogonalization_epsilon=-1.0), "orthogonalization_epsilon must be a real number >= 0.0"),
        (dict(error_feedback=1), "error_feedback must be True or False, got 1"),
        (dict(warm_start="yes"), "warm_start must be True or False, got 'yes'"),
    ],
)
def test_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        powersgd_mean("d", **kw)


def test_integral_arguments_accepted():
    # ints, numpy ints and integral floats are the integers they spell (nothing is truncated)
    init = powersgd_mean("d", rank=2, start_iter=3, seed=5).init(params_like())
    for kw in (dict(rank=np.int64(2), start_iter=np.int32(3), seed=np.uint8(5)), dict(rank=2.0, start_iter=3.0)):
        state = powersgd_mean("d", **{"seed": 5, **kw}).init(params_like())
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(init)):
            assert_same_bits(a, b)
    with pytest.raises(ValueError, match="world must be an integer >= 1"):
        powersgd_bytes(params_like(), 0)
    with pytest.raises(ValueError, match="rank must be an integer >= 1, got 1.5"):
        powersgd_bytes(params_like(), 8, rank=1.5)


def test_unbound_axis():
    tx = powersgd_mean("d", start_iter=0)
    with pytest.raises(NameError, match="not bound"):
        tx.update(params_like(), tx.init(params_like()))


# --- non-finite steps -----------------------------------------------------------------------


def with_bad_value(grads, leaf, value, rank=5):
    """``grads`` with one element of ``leaf`` on one rank set to ``value`` (inf or NaN)."""
    bad = dict(grads)
    bad[leaf] = bad[leaf].at[(rank,) + (0,) * (bad[leaf].ndim - 1)].set(value)
    return put(bad, P("d"))


@pytest.mark.parametrize(
    "value,leaf,at,warm_start",
    [
        (np.nan, "w", 2, True),  # a compressed leaf, at the first compressed step
        (np.inf, "conv", 3, True),  # a later compressed step (Q and error warm)
        (-np.inf, "b", 3, False),  # an uncompressed leaf; fresh Qs depend on the count
        (np.nan, "h", 1, True),  # during the warm-up (the warm-up lasts a step longer)
    ],
)
def test_nonfinite_step_keeps_the_state_and_later_steps_are_unaffected(value, leaf, at, warm_start):
    """A non-finite gradient on one rank: that step's mean is non-finite on every rank, the state
    is bitwise unchanged (count, Q, error, on every rank), and every later update is bitwise the
    one of a run that never saw the bad step."""
    tx = powersgd_mean("d", rank=2, start_iter=2, warm_start=warm_start)
    step = shard_map_step(tx)
    g = [rank_grads(200 + t) for t in range(5)]
    init = to_global(tx.init(params_like()))

    clean, state = [], init
    for grads in g:
        upd, state = step(grads, state)
        clean.append(upd)
    clean_state = state

    state, bad_step = init, None
    for t, grads in enumerate(g[:at] + [with_bad_value(g[at], leaf, value)] + g[at:]):
        before = state
        upd, state = step(grads, state)
        if t == at:
            bad_step = upd
            for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state)):
                assert_same_bits(a, b, "state across the bad step")
        else:
            for k in SHAPES:
                assert_same_bits(upd[k], clean[t - (t > at)][k], f"step {t} {k}")
    for r in range(W):  # the bad leaf's mean is non-finite on every rank
        assert not np.isfinite(np.asarray(bad_step[leaf][r], np.float32)).all(), r
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(clean_state)):
        assert_same_bits(a, b, "final state")
    assert int(state.count) == 5


@pytest.mark.parametrize("check_vma", [True, False])
def test_nonfinite_in_one_group_of_a_2d_mesh_keeps_every_state(check_vma):
    """Averaging over 'a' of an ('a', 'b') mesh, a NaN in one 'b' group: that group's mean is
    non-finite, the other's is not, yet every device keeps its state and the replicated count
    stays the same everywhere."""
    mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(AUTO, AUTO))
    shapes = {"w": ((16, 12), jnp.float32), "b": ((5,), jnp.float32)}
    tx = powersgd_mean("a", rank=2, start_iter=1)
    dev = P(("a", "b"))
    spec = PowerSGDState(count=P(), q=dev, error=dev)

    def body(g, state):
        upd, new = tx.update(jax.tree.map(lambda x: x[0], g), state)
        return jax.tree.map(lambda x: x[None], upd), new, new.count[None]

    step = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(dev, spec), out_specs=(dev, spec, dev), check_vma=check_vma)
    )
    state = to_global(tx.init(params_like(shapes)), q_per_rank=True, mesh=mesh, dev=dev)
    for t in range(2):  # a warm-up step, then a compressed one
        _, state, _ = step(put(rank_grads(300 + t, shapes), dev, mesh), state)
    grads = rank_grads(302, shapes)
    bad = dict(grads)
    bad["w"] = bad["w"].at[2, 3, 4].set(jnp.nan)  # device 2: a = 1, b = 0
    upd, new, counts = step(put(bad, dev, mesh), state)
    w = np.asarray(upd["w"]).reshape(4, 2, 16, 12)
    assert all(not np.isfinite(w[a, 0]).all() for a in range(4)) and np.isfinite(w[:, 1]).all()
    np.testing.assert_array_equal(np.asarray(counts), 2)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(new)):
        assert_same_bits(a, b)
    _, after, counts = step(put(grads, dev, mesh), state)
    np.testing.assert_array_equal(np.asarray(counts), 3)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(after))


# --- mismatched states ----------------------------------------------------------------------


def test_mismatched_state_raises_naming_the_leaf_and_both_shapes():
    params = {"w": jnp.zeros((16, 12)), "b": jnp.zeros((12,))}
    other = {"w": jnp.zeros((12, 16)), "b": jnp.zeros((12,))}
    tx = powersgd_mean("d", rank=2, start_iter=0)

    def error_of(tx, state, updates=params):
        with pytest.raises(ValueError) as info:
            tx.update(updates, state)
        return str(info.value)

    # a state for other shapes: Q is [m, r] with m = 16 instead of 12
    msg = error_of(tx, tx.init(other))
    assert "powersgd_mean: state.q['w'] has shape (16, 2), expected (12, 2)" in msg
    assert "update ['w'] of shape (16, 12)" in msg and "Build the state with this transformation's init" in msg
    # the errors, without warm start (Q is a placeholder either way)
    cold = powersgd_mean("d", rank=2, start_iter=0, warm_start=False)
    msg = error_of(cold, cold.init(other))
    assert "state.error['w'] has shape (12, 16), expected (16, 12)" in msg
    # a state of another rank
    msg = error_of(tx, powersgd_mean("d", rank=1).init(params))
    assert "state.q['w'] has shape (12, 1), expected (12, 2)" in msg
    # a state without error feedback for a transformation with it
    msg = error_of(tx, powersgd_mean("d", rank=2, error_feedback=False).init(params))
    assert "state.error['w'] has no state (optax.MaskedNode()), expected shape (16, 12)" in msg
    # the stacked (global) error of shard_map's layout, as if given the spec P() instead of P("d")
    msg = error_of(tx, to_global(tx.init(params)))
    assert "state.error['w'] has shape (128, 12), expected (16, 12)" in msg and "P(axis_name)" in msg
    # another structure
    msg = error_of(tx, tx.init({"w": params["w"]}))
    assert "state.q does not have the structure of the updates" in msg and "missing from the state: [\"['b']\"]" in msg
    msg = error_of(tx, tx.init({**params, "extra": jnp.zeros((16, 12))}))
    assert "state leaves not in the updates: [\"['extra']\"]" in msg
    # another transformation's state, or a batched count
    msg = error_of(tx, TopKState(jnp.zeros((), jnp.int32), {}, {}))
    assert "expected a PowerSGDState" in msg and "got TopKState" in msg
    msg = error_of(tx, tx.init(params)._replace(count=jnp.zeros((8,), jnp.int32)))
    assert "state.count must be a scalar, shape (), got shape (8,)" in msg
