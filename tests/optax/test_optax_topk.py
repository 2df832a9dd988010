"""jax_cgx.optax.topk_mean (Deep Gradient Compression) on 8 virtual CPU devices."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from allreduce_cases import mesh_1d
from bitwise import assert_same_bits
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_cgx._src.optax.topk_exchange import first_true
from jax_cgx.optax import TopKState, topk_bytes, topk_mean, topk_state_specs

W = 8
PARAMS = {
    "w": jnp.zeros((48, 64), jnp.float32),  # 3072: compressed
    "e": jnp.zeros((2000,), jnp.float32),  # compressed
    "b": jnp.zeros((10,), jnp.float32),  # small
    "s": jnp.zeros((), jnp.float32),  # scalar
}
COMPRESSED = ("w", "e")
LITE = {"w": PARAMS["w"], "b": PARAMS["b"]}  # one leaf of each kind: faster to compile


def grads(step, params=PARAMS, seed=0, scale=1.0):
    """Per-rank gradients: leaves [W, *shape], different on every rank and step."""
    leaves, treedef = jax.tree.flatten(params)
    key = jax.random.fold_in(jax.random.key(seed), step)
    out = [
        scale * jax.random.normal(jax.random.fold_in(key, i), (W,) + p.shape, jnp.float32).astype(p.dtype)
        for i, p in enumerate(leaves)
    ]
    return treedef.unflatten(out)


def per_rank(x):
    """A per-rank state leaf (ranks' states concatenated along axis 0) as [W, *shape]."""
    x = np.asarray(x)
    return x.reshape((W, x.shape[0] // W) + x.shape[1:])


class Runner:
    """Runs ``tx`` step by step in ``jax.shard_map``, the state crossing the boundary per rank."""

    def __init__(self, tx, params=PARAMS, check_vma=True):
        self.mesh = mesh_1d()
        self.specs = topk_state_specs(jax.eval_shape(tx.init, params), "d")
        self.state = jax.jit(jax.shard_map(tx.init, mesh=self.mesh, in_specs=P(), out_specs=self.specs))(params)
        self.traces = 0

        def body(g, state):
            self.traces += 1
            g = jax.tree.map(lambda x: x[0], g)
            upd, state = tx.update(g, state)
            return jax.tree.map(lambda x: x[None], upd), state

        self.step_fn = jax.jit(
            jax.shard_map(
                body,
                mesh=self.mesh,
                in_specs=(P("d"), self.specs),
                out_specs=(P("d"), self.specs),
                check_vma=check_vma,
            )
        )

    def step(self, gs):
        gs = jax.device_put(gs, NamedSharding(self.mesh, P("d")))
        upd, self.state = self.step_fn(gs, self.state)
        out = {}
        for name, x in upd.items():  # every replica gets bitwise the same mean
            x = np.asarray(x)
            for r in range(1, W):
                assert_same_bits(x[r], x[0], f"{name}: replica {r} vs 0")
            out[name] = x[0]
        return out


def reference(steps, ratio, momentum=0.0, nesterov=False, warmup_steps=0, warmup_ratios=(), min_size=1024):
    """Single-program DGC with exact top-k thresholds (sample_ratio=1), simulated ranks.

    Returns the updates of every step and the final per-rank (u, v) of the compressed leaves.
    """
    m = np.float32(momentum)
    u, v, u_small, outs = {}, {}, {}, []
    for t, gs in enumerate(steps):
        phase = min(t // warmup_steps, len(warmup_ratios)) if warmup_steps else 0
        r_t = (tuple(warmup_ratios) + (ratio,))[phase] if warmup_steps else ratio
        out = {}
        for name, g in gs.items():
            g = np.asarray(g, np.float32)
            shape = g.shape[1:]
            n = math.prod(shape)
            if g.ndim >= 2 and n >= min_size:
                g = g.reshape(W, n)
                u.setdefault(name, np.zeros((W, n), np.float32))
                v.setdefault(name, np.zeros((W, n), np.float32))
                k = min(n, max(1, math.ceil(r_t * n)))
                dense = np.zeros(n, np.float32)
                for r in range(W):
                    if momentum:
                        u[name][r] = m * u[name][r] + g[r]
                        v[name][r] += g[r] + m * u[name][r] if nesterov else u[name][r]
                    else:
                        v[name][r] += g[r]
                    sel = np.arange(n) if k == n else np.argsort(-np.abs(v[name][r]), kind="stable")[:k]
                    dense[sel] += v[name][r][sel]
                    v[name][r][sel] = 0
                    if k < n:
                        u[name][r][sel] = 0
                out[name] = (dense / np.float32(W)).reshape(shape)
            else:
                mean = g.mean(0)
                if momentum:
                    us = u_small[name] = m * u_small.get(name, np.zeros_like(mean)) + mean
                    mean = mean + m * us if nesterov else us
                out[name] = mean
        outs.append(out)
    return outs, u, v


@pytest.mark.parametrize(
    "momentum,nesterov,warmup",
    [(0.0, False, 0), (0.9, False, 0), (0.9, True, 0), (0.9, False, 2)],
    ids=["plain", "momentum", "nesterov", "warmup"],
)
def test_matches_reference(momentum, nesterov, warmup):
    kw = dict(ratio=0.01, momentum=momentum, nesterov=nesterov, warmup_steps=warmup, warmup_ratios=(0.25, 0.05))
    tx = topk_mean("d", sample_ratio=1.0, **kw)
    run = Runner(tx)
    steps = [grads(t) for t in range(7 if warmup else 4)]
    expected, u_ref, v_ref = reference(steps, **kw)
    for t, gs in enumerate(steps):
        got = run.step(gs)
        for name in PARAMS:
            np.testing.assert_allclose(got[name], expected[t][name], rtol=1e-6, atol=1e-5, err_msg=f"step {t} {name}")
    for name in COMPRESSED:
        n = math.prod(PARAMS[name].shape)
        # f32 rounding (XLA may contract m * u + g into an FMA; values up to ~10 cancel)
        np.testing.assert_allclose(per_rank(run.state.v[name]).reshape(W, n), v_ref[name], rtol=1e-6, atol=1e-5)
        if momentum:
            np.testing.assert_allclose(per_rank(run.state.u[name]).reshape(W, n), u_ref[name], rtol=1e-6, atol=1e-5)
    assert int(run.state.count) == len(steps)
    assert run.traces == 1


def test_ratio_one_is_pmean_and_momentum_of_pmean():
    steps = [grads(t) for t in range(3)]
    run = Runner(topk_mean("d", 1.0, momentum=0.0))
    for gs in steps:
        got = run.step(gs)
        for name in PARAMS:
            np.testing.assert_allclose(got[name], np.asarray(gs[name]).mean(0), rtol=1e-6, atol=1e-7)
    # ratio=1 sends everything and does not mask u: momentum SGD on the mean (DGC's
    # reference with compress_ratio=1), for every leaf.
    run = Runner(topk_mean("d", 1.0, momentum=0.9, nesterov=True))
    trace = optax.trace(0.9, nesterov=True)
    tstate = trace.init(PARAMS)
    for gs in steps:
        got = run.step(gs)
        want, tstate = trace.update(jax.tree.map(lambda x: x.mean(0), gs), tstate)
        for name in PARAMS:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)


def test_small_leaves_exact_pmean():
    """Uncompressed leaves: bitwise lax.pmean (momentum=0), optax.trace of it (momentum)."""
    mesh = mesh_1d()
    small = {"b": PARAMS["b"], "s": PARAMS["s"], "big_int": jnp.zeros((4096,), jnp.int32)}
    gs = grads(0, {"b": small["b"], "s": small["s"]})
    gs["big_int"] = jnp.arange(W * 4096, dtype=jnp.int32).reshape(W, 4096)
    for momentum in (0.0, 0.9):
        tx = topk_mean("d", 0.01, momentum=momentum)

        def body(g):
            g = jax.tree.map(lambda x: x[0], g)
            upd, _ = tx.update(g, tx.init(small))
            return jax.tree.map(lambda x: x[None], upd), jax.tree.map(lambda x: lax.pmean(x, "d")[None], g)

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
        got, want = f(jax.device_put(gs, NamedSharding(mesh, P("d"))))
        for name in small:  # one step from zero momentum: u = pmean(g)
            assert_same_bits(got[name], want[name], name)
        state = tx.init(small)
        assert state.v["b"] == state.v["big_int"] == optax.MaskedNode()  # no state: a node without leaves
        assert (state.u["b"].shape == (10,)) if momentum else (state.u["b"] == optax.MaskedNode())


def _sent_counts(v_before_mask, v_after):
    """Per rank: elements zeroed by the step (were nonzero, now zero)."""
    return ((v_before_mask != 0) & (v_after == 0)).reshape(W, -1).sum(1)


def test_sparsity_sampled_threshold():
    """With a sampled threshold each rank contributes at most k = ceil(ratio n) elements."""
    ratio = 0.01
    run = Runner(topk_mean("d", ratio, sample_ratio=0.05, momentum=0.9))
    for t in range(4):
        got = run.step(grads(t))
        for name in COMPRESSED:
            n = math.prod(PARAMS[name].shape)
            k = math.ceil(ratio * n)
            zeros = (per_rank(run.state.v[name]) == 0).reshape(W, -1).sum(1)
            assert np.all(zeros <= k) and np.all(zeros >= 1), (t, name, zeros)
            # Momentum factor masking: u is zero exactly where v was sent.
            np.testing.assert_array_equal(per_rank(run.state.u[name]) == 0, per_rank(run.state.v[name]) == 0)
            assert np.count_nonzero(got[name]) <= W * k


def test_nothing_is_lost():
    """momentum=0: sum of applied means + mean over ranks of v == sum of mean gradients."""
    run = Runner(topk_mean("d", 0.01, sample_ratio=0.02, momentum=0.0))
    applied = {name: 0.0 for name in COMPRESSED}
    true = {name: 0.0 for name in COMPRESSED}
    for t in range(6):
        gs = grads(t)
        got = run.step(gs)
        for name in COMPRESSED:
            applied[name] = applied[name] + got[name].astype(np.float64)
            true[name] = true[name] + np.asarray(gs[name], np.float64).mean(0)
    for name in COMPRESSED:
        residual = per_rank(run.state.v[name]).astype(np.float64).mean(0)
        assert np.abs(residual).max() > 0.1  # most is still held back
        np.testing.assert_allclose(applied[name] + residual, true[name], atol=1e-5)


def test_warmup_schedule():
    """k per step follows warmup_ratios (each for warmup_steps steps), then ratio; one all_gather of k_t per phase."""
    n = math.prod(PARAMS["w"].shape)
    ratios = (0.25, 0.0625)
    tx = topk_mean("d", 0.01, sample_ratio=1.0, momentum=0.0, warmup_steps=2, warmup_ratios=ratios)
    run = Runner(tx, {"w": PARAMS["w"]})
    expected_k = [math.ceil(r * n) for r in (0.25, 0.25, 0.0625, 0.0625, 0.01, 0.01, 0.01)]
    for t, k in enumerate(expected_k):
        gs = {"w": grads(t)["w"]}
        run.step(gs)
        zeros = (per_rank(run.state.v["w"]) == 0).reshape(W, -1).sum(1)
        np.testing.assert_array_equal(zeros, k, err_msg=f"step {t}")
    assert run.traces == 1

    # The program gathers exactly k_t (value, index) pairs per phase (a lax.switch branch each).
    def gathered_sizes(jaxpr, out):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name.startswith("all_gather"):
                out.add(eqn.invars[0].aval.shape)
            for p in eqn.params.values():
                for sub in p if isinstance(p, (tuple, list)) else (p,):
                    if hasattr(sub, "jaxpr"):
                        gathered_sizes(sub.jaxpr if hasattr(sub.jaxpr, "eqns") else sub.jaxpr.jaxpr, out)
                    elif hasattr(sub, "eqns"):
                        gathered_sizes(sub, out)
        return out

    gs = jax.device_put(grads(0, {"w": PARAMS["w"]}), NamedSharding(run.mesh, P("d")))
    jaxpr = jax.make_jaxpr(run.step_fn)(gs, run.state)
    assert gathered_sizes(jaxpr.jaxpr, set()) == {(2 * math.ceil(r * n),) for r in (0.25, 0.0625, 0.01)}


def test_state_fixed_and_pytree():
    tx = topk_mean("d", 0.01, momentum=0.9, warmup_steps=1)
    state0 = tx.init(PARAMS)
    assert isinstance(state0, TopKState)
    assert state0.count.dtype == jnp.int32 and state0.count.shape == ()
    for name in PARAMS:
        compressed = name in COMPRESSED
        assert (state0.v[name].shape == PARAMS[name].shape) if compressed else (state0.v[name] == optax.MaskedNode())
        assert state0.u[name].shape == PARAMS[name].shape
        assert state0.u[name].dtype == jnp.float32 and (not compressed or state0.v[name].dtype == jnp.float32)
    run = Runner(tx)
    shapes = jax.tree.map(lambda x: (x.shape, x.dtype), run.state)
    for t in range(6):  # through every warm-up phase
        run.step(grads(t))
        assert jax.tree.map(lambda x: (x.shape, x.dtype), run.state) == shapes
    assert run.traces == 1


def test_ranks_sample_independently_and_deterministic():
    """Same gradient on every rank, sampled threshold: ranks pick different sets; reruns repeat."""
    params = {"w": jnp.zeros((64, 256), jnp.float32)}
    g = jax.random.normal(jax.random.key(3), (64, 256))
    gs = {"w": jnp.broadcast_to(g, (W, 64, 256))}
    results = []
    for _ in range(2):
        run = Runner(topk_mean("d", 0.01, sample_ratio=0.01, momentum=0.0, seed=5), params)
        upd = run.step(gs)
        results.append((upd["w"], per_rank(run.state.v["w"]) == 0))
    assert_same_bits(results[0][0], results[1][0], "rerun")
    masks = results[0][1]
    assert len({masks[r].tobytes() for r in range(W)}) > 1


def test_pmap_matches_shard_map():
    tx = topk_mean("d", 0.02, sample_ratio=0.05, momentum=0.9, nesterov=True, warmup_steps=1, warmup_ratios=(0.1,))
    run = Runner(tx, LITE)
    pstep = jax.pmap(tx.update, axis_name="d")
    pstate = jax.pmap(tx.init)(jax.tree.map(lambda p: jnp.broadcast_to(p, (W,) + p.shape), LITE))
    for t in range(3):
        gs = grads(t, LITE)
        want = run.step(gs)
        got, pstate = pstep(gs, pstate)
        for name in LITE:
            np.testing.assert_allclose(np.asarray(got[name])[0], want[name], rtol=1e-6, atol=1e-7)
            for r in range(1, W):
                assert_same_bits(np.asarray(got[name])[r], np.asarray(got[name])[0], name)
    for name in ("w",):
        np.testing.assert_allclose(np.asarray(pstate.v[name]), per_rank(run.state.v[name]), rtol=1e-6, atol=1e-7)


def test_check_vma_off_and_tuple_axes():
    tx = topk_mean("d", 0.01, sample_ratio=0.05)
    steps = [grads(t, LITE) for t in range(2)]
    want = [Runner(tx, LITE).step(gs) for gs in steps[:1]]
    got = Runner(tx, LITE, check_vma=False).step(steps[0])
    for name in LITE:
        assert_same_bits(got[name], want[0][name], name)

    # Two mesh axes reduced together: ranks numbered row-major, as on the 1-D mesh.
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    tx2 = topk_mean(("a", "b"), 0.01, sample_ratio=0.05)
    specs = topk_state_specs(jax.eval_shape(tx2.init, LITE), ("a", "b"))

    def body(g):
        g = jax.tree.map(lambda x: x[0], g)
        upd, _ = tx2.update(g, tx2.init(LITE))
        return upd

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("a", "b")), out_specs=P()))
    out = f(jax.device_put(steps[0], NamedSharding(mesh, P(("a", "b")))))
    for name in LITE:
        assert_same_bits(np.asarray(out[name]), want[0][name], name)
    assert specs.v["w"] == P(("a", "b"))


def _loop(tx, steps, params=LITE, check_vma=True):
    """Runs all steps inside one shard_map; returns the updates and the final state.

    The state (any optax state) is kept per rank by stacking it on a leading axis of size W.
    """
    mesh = mesh_1d()
    state = jax.tree.map(lambda x: jnp.broadcast_to(x, (W,) + x.shape), tx.init(params))

    def body(gs, state):
        state = jax.tree.map(lambda x: x[0], state)
        outs = []
        for g in gs:
            upd, state = tx.update(jax.tree.map(lambda x: x[0], g), state, params)
            outs.append(jax.tree.map(lambda x: x[None], upd))
        return outs, jax.tree.map(lambda x: x[None], state)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"), check_vma=check_vma))
    sharding = NamedSharding(mesh, P("d"))
    outs, state = f(jax.device_put(steps, sharding), jax.device_put(state, sharding))
    return [jax.tree.map(lambda x: np.asarray(x)[0], o) for o in outs], state


def test_chain_multisteps():
    lr = 0.1
    inner = optax.chain(topk_mean("d", 0.01, sample_ratio=1.0, momentum=0.9), optax.apply_if_finite(optax.sgd(lr), 3))
    tx = optax.MultiSteps(inner, every_k_schedule=2)
    steps = [grads(t, LITE) for t in range(4)]
    # check_vma=False: MultiSteps' own per-rank accumulator starts invariant (optax's zeros).
    got, _ = _loop(tx, steps, check_vma=False)

    # Expected: topk_mean fed the averages of micro-step pairs.
    averaged = [jax.tree.map(lambda a, b: (a + b) / 2, steps[i], steps[i + 1]) for i in (0, 2)]
    want, _ = _loop(inner, averaged)
    zeros = jax.tree.map(np.zeros_like, want[0])
    for t, expected in enumerate([zeros, want[0], zeros, want[1]]):
        for name in LITE:
            np.testing.assert_allclose(got[t][name], expected[name], rtol=1e-6, atol=1e-6, err_msg=f"{t} {name}")

    # The same under pmap.
    pstate = jax.pmap(tx.init)(jax.tree.map(lambda p: jnp.broadcast_to(p, (W,) + p.shape), LITE))
    pupdate = jax.pmap(tx.update, axis_name="d")
    for t, gs in enumerate(steps):
        pgot, pstate = pupdate(gs, pstate)
        for name in LITE:
            np.testing.assert_allclose(np.asarray(pgot[name])[3], got[t][name], rtol=1e-6, atol=1e-6)


def test_apply_if_finite_after_topk_skips_nonfinite_steps():
    lr = 0.1
    topk = topk_mean("d", 0.01, sample_ratio=0.05, momentum=0.9)
    tx = optax.chain(topk, optax.apply_if_finite(optax.sgd(lr), 3))
    steps = [grads(t, LITE) for t in range(3)]
    bad = dict(steps[1])
    bad["w"] = bad["w"].at[5, 7, 17].set(jnp.nan)  # one rank, one element
    got, state = _loop(tx, [steps[0], bad, steps[2]])
    want, want_state = _loop(tx, [steps[0], steps[2]])
    for name in LITE:
        assert_same_bits(got[0][name], want[0][name], name)
        assert not np.any(got[1][name])  # skipped on every rank
        assert_same_bits(got[2][name], want[1][name], name)
    assert np.all(np.asarray(state[1].total_notfinite) == 1)  # on every rank
    for a, b in zip(jax.tree.leaves(state[0]), jax.tree.leaves(want_state[0])):
        assert_same_bits(a, b)


def test_scan_with_state_created_inside_shard_map():
    """init inside shard_map(check_vma=True) gives the per-rank leaves the type update returns."""
    mesh = mesh_1d()
    tx = topk_mean("d", 0.01, sample_ratio=0.05, warmup_steps=1, warmup_ratios=(0.1,))
    xs = jnp.stack([grads(t)["w"] for t in range(3)], axis=1)  # [W, T, 48, 64]
    params = {"w": PARAMS["w"]}

    def body(x):
        def step(state, g):
            upd, state = tx.update({"w": g}, state)
            return state, upd["w"]

        state, upds = lax.scan(step, tx.init(params), x[0])
        return upds, state.v["w"][None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=(P(), P("d"))))
    upds, v = f(jax.device_put(xs, NamedSharding(mesh, P("d"))))
    run = Runner(tx, params)
    for t in range(3):
        want = run.step({"w": xs[:, t]})["w"]
        assert_same_bits(upds[t], want, f"step {t}")
    assert_same_bits(v, per_rank(run.state.v["w"]), "v")


def test_nonfinite_gradient_poisons_every_rank():
    """A NaN on one rank that is not selected still makes the mean non-finite everywhere."""
    steps = [grads(0)]
    steps[0]["w"] = steps[0]["w"].at[3, 0, 0].set(jnp.nan)
    tx = topk_mean("d", 0.01, sample_ratio=0.05)
    got, state = _loop(tx, steps, PARAMS)
    assert not np.all(np.isfinite(got[0]["w"]))
    assert np.all(np.isfinite(got[0]["e"]))
    # ... and the state stays as it was, on every rank.
    assert np.all(np.asarray(state.count) == 0)
    for leaf in jax.tree.leaves((state.u, state.v)):
        assert not np.any(np.asarray(leaf))


def test_bfloat16_gradients():
    params = {"w": jnp.zeros((64, 64), jnp.bfloat16)}
    got, state = _loop(topk_mean("d", 0.01, momentum=0.9), [grads(0, params)], params)
    assert got[0]["w"].dtype == jnp.bfloat16
    assert state.u["w"].dtype == state.v["w"].dtype == jnp.float32
    assert 0 < np.count_nonzero(np.asarray(got[0]["w"], np.float32)) <= W * math.ceil(0.01 * 64 * 64)


@pytest.mark.parametrize("n,k,density", [(1, 1, 0.5), (1000, 7, 0.01), (3000, 50, 0.5), (5000, 20, 0.001)])
def test_first_true_is_nonzero(n, k, density):
    jitted = jax.jit(first_true, static_argnums=1)
    for seed in range(3):
        mask = jax.random.uniform(jax.random.key(seed), (n,)) < density
        assert_same_bits(jitted(mask, k), jnp.nonzero(mask, size=k, fill_value=n)[0].astype(jnp.int32))


def test_topk_bytes():
    params = {
        "w": jax.ShapeDtypeStruct((1000, 1000), jnp.float32),
        "b": jnp.zeros((1000,), jnp.float32),  # < min_size
        "s": jnp.zeros((), jnp.bfloat16),
    }
    assert topk_bytes(params, 8, ratio=0.001) == 7 * 1000 * 8 + math.ceil(2 * 7 * 4002 / 8)
    assert topk_bytes(params, 8, ratio=0.01, min_size=1000) == 7 * (10000 + 10) * 8 + math.ceil(2 * 7 * 2 / 8)
    assert topk_bytes(params, 1) == 0
    # density 1: a dense float32 all-reduce
    assert topk_bytes({"w": params["w"]}, 4, ratio=1.0) == 2 * 3 * 4 * 10**6 // 4


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(ratio=0.0), r"ratio must be a real number in \(0.0, 1.0\], got 0.0"),
        (dict(ratio=1.5), "ratio must be a real number in"),
        (dict(ratio=float("nan")), "ratio must be a real number in"),
        (dict(ratio=True), "ratio must be a real number in .*, got True"),
        (dict(sample_ratio=0.0), "sample_ratio must be a real number in"),
        (dict(momentum=-0.1), "momentum must be a real number >= 0.0, got -0.1"),
        (dict(momentum=1.0), r"momentum must be in \[0, 1\) \(DGC's is 0.9\), got 1.0: at 1 or more"),
        (dict(momentum=0.0, nesterov=True), "nesterov needs momentum > 0"),
        (dict(nesterov="yes"), "nesterov must be True or False, got 'yes'"),
        (dict(warmup_steps=-1), "warmup_steps must be an integer >= 0, got -1"),
        (dict(warmup_steps=2.5), r"warmup_steps must be an integer >= 0, got 2.5 \(float\); non-integers are not"),
        (dict(warmup_steps=True), "warmup_steps must be an integer >= 0, got the bool True"),
        (dict(warmup_steps=2, warmup_ratios=(0.5, 2.0)), r"warmup_ratios\[1\] must be a real number in"),
        (dict(warmup_steps=2, warmup_ratios=()), "warmup_ratios must be a non-empty tuple"),
        (dict(warmup_steps=2, warmup_ratios=0.5), "warmup_ratios must be a non-empty tuple"),
        (dict(min_size=0), "min_size must be an integer >= 1, got 0"),
        (dict(min_size=1.5), "min_size must be an integer >= 1, got 1.5"),
        (dict(min_size=True), "min_size must be an integer >= 1, got the bool True"),
        (dict(seed=0.5), "seed must be an integer, got 0.5"),
        (dict(seed=False), "seed must be an integer, got the bool False"),
    ],
)
def test_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        topk_mean("d", **kw)


def test_integral_arguments_accepted_and_bytes_validation():
    want = topk_mean("d", warmup_steps=3, min_size=100, seed=4).init(PARAMS)
    numpy_ints = dict(warmup_steps=np.int64(3), min_size=np.int32(100), seed=np.uint8(4))
    for kw in (numpy_ints, dict(warmup_steps=3.0, min_size=1e2)):
        got = topk_mean("d", **{"seed": 4, **kw}).init(PARAMS)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert_same_bits(a, b)
    # 0-d arrays are numbers too; a mean over no axis is refused.
    topk_mean("d", ratio=jnp.float32(0.01), momentum=np.array(0.9), warmup_steps=jnp.int32(1), warmup_ratios=(0.5,))
    with pytest.raises(ValueError, match="ratio must be a real number in .*, got Array\\(True"):
        topk_mean("d", ratio=jnp.array(True))
    with pytest.raises(ValueError, match="topk_mean: axis_name must name at least one mapped axis"):
        topk_mean([])
    with pytest.raises(ValueError, match="topk_bytes: world must be an integer >= 1, got 2.5"):
        topk_bytes(PARAMS, 2.5)
    with pytest.raises(ValueError, match="topk_bytes: min_size must be an integer >= 1, got 0"):
        topk_bytes(PARAMS, 8, min_size=0)


@pytest.mark.parametrize(
    "value,leaf,at",
    [(np.nan, "w", 1), (np.inf, "b", 2), (-np.inf, "e", 0)],
    ids=["nan-compressed", "inf-small", "neginf-first-step"],
)
def test_nonfinite_step_keeps_the_state_and_later_steps_are_unaffected(value, leaf, at):
    """A non-finite gradient on one rank: that step's mean is non-finite on every rank, the state
    is bitwise unchanged, and every later update is bitwise the one of a run without the bad
    step (with a sampled threshold and a warm-up, both of which depend on the step count)."""
    tx = topk_mean("d", 0.01, sample_ratio=0.05, momentum=0.9, nesterov=True, warmup_steps=2, warmup_ratios=(0.1,))
    run = Runner(tx)
    init = run.state
    steps = [grads(t, seed=7) for t in range(4)]
    clean = [run.step(gs) for gs in steps]
    clean_state = run.state

    bad = dict(steps[at])
    bad[leaf] = bad[leaf].at[(3,) + (0,) * PARAMS[leaf].ndim].set(value)  # rank 3
    run.state = init
    for t, gs in enumerate(steps[:at] + [bad] + steps[at:]):
        before = run.state
        got = run.step(gs)  # (asserts every replica got bitwise the same)
        if t == at:
            assert not np.isfinite(got[leaf]).all()
            for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(run.state)):
                assert_same_bits(a, b, "state across the bad step")
        else:
            for name in PARAMS:
                assert_same_bits(got[name], clean[t - (t > at)][name], f"step {t} {name}")
    for a, b in zip(jax.tree.leaves(run.state), jax.tree.leaves(clean_state)):
        assert_same_bits(a, b, "final state")
    assert run.traces == 1


def test_finite_gradient_overflowing_the_accumulator_is_a_skipped_step():
    """3e38 is finite, but with Nesterov momentum it overflows the accumulator (1.9 * 3e38). Left
    unsent (12 tied candidates come first), that inf would stay in v, be selected at every later
    step and make every later mean inf. The step is non-finite instead, and the state untouched."""
    n = 1024
    params = {"w": jnp.zeros((n,), jnp.float32)}
    tx = topk_mean("d", 10 / n, sample_ratio=1.0, momentum=0.9, nesterov=True, min_size=16)
    run = Runner(tx, params)
    init = run.state
    steps = [grads(t, params, seed=3) for t in range(3)]
    clean = [run.step(gs) for gs in steps]

    big = np.zeros((W, n), np.float32)
    big[:, :12] = 1.0
    big[0, 1000] = 3e38
    run.state = init
    assert not np.isfinite(run.step({"w": jnp.asarray(big)})["w"]).all()
    for a, b in zip(jax.tree.leaves(init), jax.tree.leaves(run.state)):
        assert_same_bits(a, b, "state across the overflowing step")
    for t, gs in enumerate(steps):
        assert_same_bits(run.step(gs)["w"], clean[t]["w"], f"step {t} after it")


def test_complex_leaves_are_averaged_exactly_with_complex_momentum():
    """A complex leaf is never sparsified (its imaginary part would be lost): an exact pmean, its
    momentum kept in complex64 (optax.trace of the mean)."""
    params = {"z": jnp.zeros((64, 64), jnp.complex64), "w": PARAMS["w"]}
    tx = topk_mean("d", 0.01, momentum=0.9, nesterov=True)
    state = tx.init(params)
    assert state.u["z"].dtype == jnp.complex64 and state.u["z"].shape == (64, 64)
    assert state.v["z"] == optax.MaskedNode()
    assert topk_state_specs(state, "d").u["z"] == P()  # the momentum of the mean: the same on every rank
    steps = []
    for t in range(3):
        g = grads(t, {"z": jnp.zeros((64, 64)), "w": PARAMS["w"]})
        g["z"] = (g["z"] + 1j * grads(t, {"z": jnp.zeros((64, 64))}, seed=1)["z"]).astype(jnp.complex64)
        steps.append(g)
    got, _ = _loop(tx, steps, params)
    trace = optax.trace(0.9, nesterov=True)
    tstate = trace.init({"z": params["z"]})
    for t, gs in enumerate(steps):
        want, tstate = trace.update({"z": jnp.asarray(gs["z"]).mean(0)}, tstate)
        assert got[t]["z"].dtype == np.complex64
        assert np.abs(np.asarray(want["z"]).imag).max() > 0.1
        np.testing.assert_allclose(got[t]["z"], np.asarray(want["z"]), rtol=1e-5, atol=1e-6)
    # counted as a dense all-reduce of its 8-byte elements
    assert topk_bytes({"z": params["z"]}, 8) == math.ceil(2 * 7 * 64 * 64 * 8 / 8)


def test_mismatched_state_raises_naming_the_leaf_and_both_shapes():
    tx = topk_mean("d", 0.01, momentum=0.9)

    def error_of(state, updates=PARAMS, tx=tx):
        with pytest.raises(ValueError) as info:
            tx.update(updates, state)
        return str(info.value)

    transposed = dict(PARAMS, w=jnp.zeros((64, 48)))
    msg = error_of(tx.init(transposed))
    assert "topk_mean: state.u['w'] has shape (64, 48), expected (48, 64)" in msg
    assert "update ['w'] of shape (48, 64)" in msg and "Build the state with this transformation's init" in msg
    # a state without momentum
    msg = error_of(topk_mean("d", 0.01, momentum=0.0).init(PARAMS))
    assert "state.u['b'] has no state (optax.MaskedNode()), expected shape (10,)" in msg
    # a state for another min_size: 'b' kept a velocity it does not have here
    msg = error_of(topk_mean("d", 0.01, momentum=0.9, min_size=4).init(PARAMS))
    assert "state.v['b'] has shape (10,), expected no state (optax.MaskedNode())" in msg
    # shard_map's stacked per-rank state, as if given the spec P() instead of P("d")
    state = tx.init(PARAMS)
    stacked = state._replace(v=jax.tree.map(lambda v: jnp.concatenate([v] * W) if v.size else v, state.v))
    msg = error_of(stacked)
    assert "state.v['e'] has shape (16000,), expected (2000,)" in msg and "P(axis_name)" in msg
    # another structure, another transformation's state, a batched count
    msg = error_of(tx.init(LITE))
    assert "state.u does not have the structure of the updates" in msg
    assert "missing from the state: [\"['e']\", \"['s']\"]" in msg
    assert "expected a TopKState" in error_of((jnp.zeros((), jnp.int32), state.u, state.v))
    msg = error_of(state._replace(count=jnp.zeros((1,), jnp.int32)))
    assert "state.count must be a scalar, shape (), got shape (1,)" in msg


def test_float64_leaves_are_refused_as_by_the_other_transformations():
    # With x64 on (a process of its own: the flag is global), a float64 leaf would keep its momentum
    # and velocity, and send its values, in 32 bits: its mean ~1e-7 off, silently.
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import jax, jax.numpy as jnp
        from jax.sharding import PartitionSpec as P
        from jax_cgx.optax import topk_mean
        mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
        tx = topk_mean("data", 1.0, min_size=1)
        params = {"w": jnp.zeros((8, 8), jnp.float64)}
        try:
            jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P())(params)
        except TypeError as err:
            print("refused:", err)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "JAX_ENABLE_X64": "1"})
    assert "refused: topk_mean: leaf ['w'] has dtype float64, which top-k keeps and sends in 32 bits" in run.stdout, \
        run.stdout + run.stderr[-2000:]
