"""jax_cgx.adaptive.choose_bits: bit widths per leaf within a uniform width's bytes (jax_cgx/_src/adaptive/).

The error model against the codec itself, the solver against exhaustive search, the budget, and
the plan used as a config where jax_cgx takes one.
"""

import io
import itertools
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bitwise import assert_same_bits
from jax.sharding import PartitionSpec as P

import jax_cgx
from jax_cgx.adaptive import EXACT, choose_bits, describe, expected_errors

# The config these exhaustive checks are written for (their byte arithmetic: buckets of 512; every leaf
# of 16 values or more planned), passed wherever the planner would otherwise take CompressionConfig().
BASE = jax_cgx.CompressionConfig(bucket_size=512, min_size=16)


def _leaves(seed: int, count: int = 4) -> list[np.ndarray]:
    r = np.random.default_rng(seed)
    return [(r.standard_normal(int(r.integers(600, 5000))) * float(r.choice([0.01, 1.0, 30.0]))).astype(np.float32)
            for _ in range(count)]


def _budget(sizes, bits: float, bucket: int = 512) -> int:
    return sum(math.ceil(n * bits / 8) + 8 * -(-n // bucket) for n in sizes)


def _bytes(n: int, bits: int, bucket: int = 512) -> int:
    return 4 * n if bits == EXACT else -(-n * bits // 8) + 8 * -(-n // bucket)


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_predicted_error_is_the_codecs(stochastic):
    # Nearest rounding: exactly the codec's squared error (but for the scale's rounding to 16 bits);
    # stochastic: its expectation, checked against the mean of 16 draws (within 4 standard errors).
    r = np.random.default_rng(0)
    config = BASE.replace(stochastic=stochastic)
    widths = (1, 2, 4, 8)
    for x in (r.standard_normal(70001), r.standard_cauchy(1 << 14), r.uniform(-1, 1, 1 << 14)):
        x = jnp.asarray(x, jnp.float32)
        predicted = expected_errors([x], config, widths)[0]
        for b, p in zip(widths, predicted):
            draws = [float(jnp.sum((jax_cgx.dequantize(jax_cgx.quantize(
                x, config.replace(bits=b), key=jax.random.key(k) if stochastic else None)) - x) ** 2))
                for k in range(16 if stochastic else 1)]
            if stochastic:
                assert abs(np.mean(draws) - p) <= 4 * np.std(draws) / 4 + 1e-3 * p, (b, np.mean(draws), p)
            else:
                assert draws[0] == pytest.approx(p, rel=2e-2), (b, draws[0], p)


@pytest.mark.parametrize("seed", range(12))
def test_the_plan_is_the_best_within_the_budget(seed):
    # Exhaustive search over every combination of widths (and exact): the same least error.
    leaves = _leaves(seed)
    sizes = [x.size for x in leaves]
    candidates = (2, 3, 4, 8)
    widths = (*candidates, EXACT)
    errors = expected_errors(leaves, BASE, candidates)
    for budget_bits in (2.5, 3.0, 4.0, 5.3):
        configs, plans = choose_bits(leaves, budget_bits=budget_bits, candidates=candidates, return_plan=True, config=BASE)
        budget = _budget(sizes, budget_bits)
        assert sum(p.bytes for p in plans) <= budget
        best = min(
            sum(0.0 if b == EXACT else errors[i][candidates.index(b)] for i, b in enumerate(combo))
            for combo in itertools.product(widths, repeat=len(leaves))
            if sum(_bytes(n, b) for n, b in zip(sizes, combo)) <= budget
        )
        assert sum(p.error for p in plans) == pytest.approx(best, rel=1e-12)
        for c, p in zip(configs, plans):  # the configs say what the plan says
            assert (c is None) == (p.bits == EXACT) and (c is None or c.bits == p.bits)


def test_wide_leaves_get_the_bits_and_the_budget_holds():
    r = np.random.default_rng(1)
    tree = {"wide": (r.standard_cauchy(1 << 14) * 10).astype(np.float32),
            "narrow": (r.standard_normal(1 << 14) * 1e-3).astype(np.float32),
            "step": np.int32(3), "bias": np.ones(8, np.float32)}  # kept as they are: not compressed
    configs, plans = choose_bits(tree, budget_bits=4, return_plan=True, config=BASE)
    assert configs["step"] == BASE and configs["bias"] == BASE  # int, and fewer than min_size values
    by_path = {p.path: p for p in plans}
    assert by_path["['wide']"].bits > by_path["['narrow']"].bits
    assert sum(p.bytes for p in plans) <= _budget([1 << 14, 1 << 14], 4)
    uniform = expected_errors([tree["wide"], tree["narrow"]], BASE, (4,)).sum()
    assert sum(p.error for p in plans) < uniform / 4  # far below uniform 4-bit's error, at its bytes
    assert "total" in describe(plans) and "['wide']" in describe(plans)


def test_the_plan_is_a_config_jax_cgx_takes():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:8])
    r = np.random.default_rng(2)
    grads = {"a": r.standard_normal((8, 4096)).astype(np.float32), "b": r.standard_cauchy((8, 4096)).astype(np.float32)}
    configs = choose_bits(jax.tree.map(lambda g: g.mean(0), grads), budget_bits=3.0, candidates=(2, 3, 4), config=BASE)
    configs["b"] = None  # and an exact leaf beside them

    def mean(g):
        return jax_cgx.compressed_pmean(jax.tree.map(lambda v: v[0], g), "data", configs)

    out = jax.jit(jax.shard_map(mean, mesh=mesh, in_specs=P("data"), out_specs=P()))(grads)
    exact = jax.jit(jax.shard_map(lambda g: jax.tree.map(lambda v: jax.lax.pmean(v[0], "data"), g), mesh=mesh,
                                  in_specs=P("data"), out_specs=P()))(grads)
    assert_same_bits(np.asarray(out["b"]), np.asarray(exact["b"]), "exact leaf")
    assert 0 < float(jnp.max(jnp.abs(out["a"] - exact["a"]))) < 1.0


def test_the_same_gradient_gives_the_same_plan():
    leaves = _leaves(3, 6)
    first = choose_bits(leaves, budget_bits=3.5, return_plan=True, config=BASE)[1]
    assert choose_bits([x.copy() for x in leaves], budget_bits=3.5, return_plan=True, config=BASE)[1] == first


def test_bad_arguments_say_what_was_wrong():
    x = {"w": np.ones(4096, np.float32)}
    with pytest.raises(ValueError, match="below the narrowest candidate"):
        choose_bits(x, budget_bits=1.5, config=BASE)
    for bad in ((), (0, 4), (9,), (True,), (2.5,)):
        with pytest.raises(ValueError, match="candidates must be widths in 1..8"):
            choose_bits(x, candidates=bad, config=BASE)
    for bad in (float("nan"), "4", True):
        with pytest.raises(ValueError, match="budget_bits must be a number"):
            choose_bits(x, budget_bits=bad, config=BASE)
    with pytest.raises(TypeError, match="config must be a CompressionConfig"):
        choose_bits(x, config={"bits": 4})
    with pytest.raises(ValueError, match=r"leaf \['w'\] is not finite"):
        choose_bits({"w": np.array([1.0, np.inf] * 2048, np.float32)}, config=BASE)
    with pytest.raises(TypeError, match="is traced"):
        jax.jit(lambda g: choose_bits(g, config=BASE))(x)
    for bad in ((0, 4), (9,), (True,), (2.5,)):  # width 0 gave a NaN column
        with pytest.raises(ValueError, match="expected_errors: widths must be quantized widths, integers in 1..8"):
            expected_errors([x["w"]], BASE, bad)


def test_the_planner_replans_with_bounded_compilations(caplog):
    r = np.random.default_rng(4)
    like = {"a": np.zeros(1 << 13, np.float32), "b": np.zeros(1 << 13, np.float32)}
    planner = jax_cgx.adaptive.Planner(like, budget_bits=4, candidates=(2, 3, 4, 6, 8), bucket_sizes=None, every=10,
                                       min_gain=0.05, config=BASE)  # widths only
    assert {c.bits for c in jax.tree.leaves(planner.configs)} == {4} and planner.plans is None
    made = []

    def make_step(configs):
        made.append(configs)
        return lambda: configs

    assert planner.compiled(make_step)() is planner.configs and planner.compilations == 1
    wide_a = {"a": (r.standard_cauchy(1 << 13) * 100).astype(np.float32), "b": r.standard_normal(1 << 13).astype(np.float32)}
    with caplog.at_level("INFO", logger="jax_cgx"):
        assert not planner.observe(5, wide_a)  # not a planning step
        assert planner.observe(10, wide_a)
    assert "new bit widths" in caplog.text and "['a']" in caplog.text
    assert planner.configs["a"] is None or planner.configs["a"].bits > planner.configs["b"].bits
    planner.compiled(make_step)
    assert planner.compilations == 2 and planner.changes == 1
    # The same kind of gradient again: no gain, no change, no compilation.
    again = {"a": (r.standard_cauchy(1 << 13) * 100).astype(np.float32), "b": r.standard_normal(1 << 13).astype(np.float32)}
    assert not planner.observe(20, again)
    planner.compiled(make_step)
    assert planner.compilations == 2 and len(made) == 2
    # The other leaf wide now: the plan turns round, and coming back later compiles nothing new.
    wide_b = {"a": again["b"], "b": again["a"]}
    assert planner.observe(30, wide_b)
    planner.compiled(make_step)
    assert planner.observe(40, again)
    planner.compiled(make_step)
    assert planner.compilations == 3 and planner.changes == 3


def test_the_recommended_setting_is_planned_with_its_small_leaves_exact():
    # layer_filter(CompressionConfig(bits=4, bucket_size=128, min_size=16), 1024), the recommended transformer setting:
    # it was refused ("config must be a CompressionConfig or None, got function").
    r = np.random.default_rng(5)
    grads = {"w": (r.standard_cauchy((64, 128)) * 10).astype(np.float32),
             "v": r.standard_normal((64, 128)).astype(np.float32),
             "bias": r.standard_normal(64).astype(np.float32), "scale": r.standard_normal((16, 32)).astype(np.float32)}
    base = jax_cgx.CompressionConfig(bits=4, bucket_size=128, min_size=16)
    recommended = jax_cgx.optax.layer_filter(base, 1024)
    configs, plans = choose_bits(grads, budget_bits=4, config=recommended, return_plan=True, exact=False)
    assert configs["bias"] is None and configs["scale"] is None  # 1-D, or under 1024 values: exact, outside the plan
    assert sorted(p.path for p in plans) == ["['v']", "['w']"]
    assert {configs[k].bucket_size for k in "wv"} == {128} and configs["w"].bits > configs["v"].bits
    # The same plan as the CompressionConfig over the planned leaves alone.
    alone = choose_bits({"w": grads["w"], "v": grads["v"]}, budget_bits=4, config=base, exact=False)
    assert {k: configs[k] for k in "wv"} == alone

    planner = jax_cgx.adaptive.Planner(grads, budget_bits=4, config=recommended, bucket_sizes=None, every=1,
                                       exact=False, min_gain=0)
    assert planner.configs["bias"] is None and planner.configs["w"] == base.replace(bits=4)
    errors = planner.leaf_errors(grads)
    assert errors.shape[0] == 2  # the planned leaves only
    assert planner.observe(0, grads, errors=errors)
    assert planner.configs == configs
    with pytest.raises(ValueError, match="gives the leaves 2 different configs"):
        choose_bits(grads, config=lambda path, leaf: base.replace(bits=2 + (leaf.size > 5000)))
    with pytest.raises(TypeError, match="must return a CompressionConfig or None, got int"):
        choose_bits(grads, config=lambda path, leaf: 4)


def test_planner_arguments_are_checked():
    like = {"a": np.zeros(4096, np.float32)}
    for kwargs, message in (({"every": 0}, "every must be a positive"), ({"min_gain": 1.0}, r"min_gain must be in \[0, 1\)"),
                            ({"budget_bits": 1}, "below the narrowest"), ({"exact": "yes"}, "exact")):
        with pytest.raises((ValueError, TypeError), match=message):
            jax_cgx.adaptive.Planner(like, **kwargs)


PLAN_ON_EACH_PROCESS = """
import json, sys
import jax_cgx
jax_cgx.distributed.initialize()
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

mesh = jax.make_mesh((jax.device_count(),), ("data",))
rank = jax.process_index()
# Each process's own gradient, differently shaped per leaf; the plan comes from their compressed mean.
r = np.random.default_rng(rank)
mine = {"emb": r.standard_cauchy((1, 8192)).astype(np.float32), "w": r.standard_normal((1, 20000)).astype(np.float32),
        "b": (r.standard_normal((1, 4096)) * 1e-3).astype(np.float32)}
local = jax.tree.map(lambda v: jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), v), mine)
mean = jax.jit(jax.shard_map(lambda g: jax_cgx.compressed_pmean(jax.tree.map(lambda v: v[0], g), "data"),
                             mesh=mesh, in_specs=P("data"), out_specs=P()))(local)
configs, plans = jax_cgx.adaptive.choose_bits(mean, budget_bits=3.0, return_plan=True)
print("PLAN", json.dumps([[p.path, p.bits, p.error, p.bytes] for p in plans]))
"""


@pytest.mark.multiprocess
def test_every_process_chooses_the_same_plan(tmp_path):
    script = tmp_path / "plan.py"
    script.write_text(PLAN_ON_EACH_PROCESS)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device per process
    proc = subprocess.run([sys.executable, "-m", "jax_cgx.launch", "-n", "2", str(script)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    plans = [line.split("PLAN ", 1)[1] for line in proc.stdout.splitlines() if "PLAN " in line]
    assert len(plans) == 2 and plans[0] == plans[1], plans  # the same widths, errors and bytes, to the bit
    assert len({bits for _, bits, _, _ in json.loads(plans[0])}) > 1  # not uniform


def test_compressed_mean_takes_the_plan():
    # jax_cgx.optax.compressed_mean with choose_bits's pytree: the same mean as compressed_pmean with it
    # (for the leaves the layer filter keeps; 1-D leaves are averaged exactly).
    optax = pytest.importorskip("optax")
    del optax
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:8])
    r = np.random.default_rng(5)
    grads = {"w": r.standard_normal((8, 64, 64)).astype(np.float32), "e": r.standard_cauchy((8, 32, 64)).astype(np.float32),
             "b": r.standard_normal((8, 64)).astype(np.float32)}
    configs = choose_bits(jax.tree.map(lambda g: g.mean(0), grads), budget_bits=3.0, candidates=(2, 3, 4, 6), config=BASE)
    assert configs["w"].bits != configs["e"].bits
    tx = jax_cgx.optax.compressed_mean("data", configs, layer_min_size=1024)
    filtered = {**configs, "b": None}

    def both(g):
        g = jax.tree.map(lambda v: v[0], g)
        return tx.update(g, tx.init(g))[0], jax_cgx.compressed_pmean(g, "data", filtered)

    ours, ref = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=P("data"), out_specs=P()))(grads)
    for k in grads:
        assert_same_bits(np.asarray(ours[k]), np.asarray(ref[k]), k)
    with pytest.raises(TypeError, match="a pytree of them"):
        jax_cgx.optax.compressed_mean("data", {"w": 4})


def test_a_config_pytree_over_a_tree_with_lists():
    # A model's layers in a list: each leaf gets its own config (a list node is not a config's leaf).
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:8])
    r = np.random.default_rng(6)
    grads = {"layers": [{"w": r.standard_normal((8, 4096)).astype(np.float32)},
                        {"w": r.standard_cauchy((8, 4096)).astype(np.float32)}]}
    configs = {"layers": [BASE.replace(bits=2), None]}

    def both(g):
        g = jax.tree.map(lambda v: v[0], g)
        return (jax_cgx.compressed_pmean(g, "data", configs),
                jax_cgx.compressed_pmean(g["layers"][0], "data", BASE.replace(bits=2)),
                jax.lax.pmean(g["layers"][1], "data"))

    out, first, second = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=P("data"), out_specs=P()))(grads)
    assert_same_bits(np.asarray(out["layers"][0]["w"]), np.asarray(first["w"]), "2-bit layer")
    assert_same_bits(np.asarray(out["layers"][1]["w"]), np.asarray(second["w"]), "exact layer")


def test_the_relative_objective_does_not_see_a_leafs_scale():
    # Scaling a leaf by 2^10 scales its squared errors by 2^20 and moves the squared plan's bits to it;
    # in units of its own mean square nothing changes.
    r = np.random.default_rng(7)
    tree = {"a": r.standard_normal(1 << 13).astype(np.float32), "b": r.standard_cauchy(1 << 13).astype(np.float32)}
    scaled = {"a": tree["a"] * 1024, "b": tree["b"]}
    plan = lambda t, objective: [p.bits for p in choose_bits(t, budget_bits=3, objective=objective,  # noqa: E731
                                                                return_plan=True, config=BASE)[1]]
    assert plan(tree, "relative") == plan(scaled, "relative")
    assert plan(tree, "squared") != plan(scaled, "squared")
    with pytest.raises(ValueError, match="objective must be one of"):
        choose_bits(tree, objective="adagrad", config=BASE)


def _adam_errors_numpy(x: np.ndarray, bucket: int, bits: int, v: np.ndarray | None = None) -> float:
    # Quantize each bucket to its max-min grid (nearest), in float64; sum each value's e / (v + e), v its
    # square unless given.
    total = 0.0
    v = x.astype(np.float64) ** 2 if v is None else v.astype(np.float64)
    for chunk, vs in zip(np.split(x.astype(np.float64), range(bucket, x.size, bucket)),
                         np.split(v, range(bucket, x.size, bucket))):
        low, step = chunk.min(), (chunk.max() - chunk.min()) / (2**bits - 1)
        q = low + np.round((chunk - low) / step) * step if step > 0 else chunk
        e = (q - chunk) ** 2
        total += float(np.sum(np.divide(e, vs + e, out=np.zeros_like(e), where=e > 0)))
    return total


@pytest.mark.parametrize("seed", range(3))
def test_the_adam_objective_is_each_values_share_of_noise(seed):
    # Against a float64 quantization of every bucket: the sum over values of e / (x^2 + e), each term at
    # most 1; the same for a leaf scaled by any power of two (it sees each value against itself).
    x = np.concatenate([_leaves(seed, 1)[0], _spiky(seed, 1 << 11)])
    widths = (2, 3, 5, 8)
    for bucket in (64, 512):
        got = expected_errors([x, x * 2.0**-20], BASE.replace(bucket_size=bucket), widths, objective="adam")
        want = [_adam_errors_numpy(x, bucket, b) for b in widths]
        np.testing.assert_allclose(got[0], want, rtol=2e-3)
        np.testing.assert_allclose(got[1], got[0], rtol=1e-5)
        assert np.all(got[0] <= x.size) and np.all(np.diff(got[0]) < 0)


def test_the_adam_objective_takes_the_optimizers_second_moment():
    # leaf_errors(..., second_moment=) divides by it instead of each value's square (Adam's nu), against
    # the float64 reference; the value's own square as second moment gives the objective's default.
    r = np.random.default_rng(11)
    tree = {"w": r.standard_normal(3000).astype(np.float32), "v": _spiky(11)}
    nu = {"w": (r.random(3000) * 2).astype(np.float32), "v": np.full(1 << 13, 0.5, np.float32)}
    config = BASE.replace(bucket_size=256)
    got = np.asarray(jax_cgx.adaptive.leaf_errors(tree, config, (2, 4), objective="adam", second_moment=nu))
    want = [[_adam_errors_numpy(tree[k], 256, b, nu[k]) for b in (2, 4)] for k in ("v", "w")]  # sorted keys
    np.testing.assert_allclose(got, want, rtol=2e-3)
    own = jax_cgx.adaptive.leaf_errors(tree, config, (2, 4), objective="adam",
                                       second_moment=jax.tree.map(np.square, tree))
    np.testing.assert_allclose(own, jax_cgx.adaptive.leaf_errors(tree, config, (2, 4), objective="adam"), rtol=1e-6)
    with pytest.raises(ValueError, match="second_moment is for objective='adam', not 'relative'"):
        jax_cgx.adaptive.leaf_errors(tree, config, objective="relative", second_moment=nu)
    with pytest.raises(ValueError, match="second_moment must have the gradient's structure"):
        jax_cgx.adaptive.leaf_errors(tree, config, objective="adam", second_moment={"w": nu["w"]})
    with pytest.raises(ValueError, match=r"second_moment\['w'\] has shape \(10,\), the gradient's leaf \(3000,\)"):
        jax_cgx.adaptive.leaf_errors(tree, config, objective="adam", second_moment={**nu, "w": np.ones(10)})


def test_the_adam_objective_sees_small_values_drowned_by_large_ones():
    # Buckets of 512 each holding 64 values 10^4 times the other 448: at 8 bits the small values lie
    # within one grid step of one another, each all noise (share near 1), which the leaf-wide relative
    # error (in units of the mean square, which the large values set) does not see; buckets of 64
    # separate the scales.
    r = np.random.default_rng(3)
    x = r.standard_normal(1 << 14).astype(np.float32) * 1e-3
    x.reshape(-1, 512)[:, :64] *= 1e4
    small = x.size // 512 * 448
    share = lambda bucket, objective: float(expected_errors(  # noqa: E731
        [x], BASE.replace(bucket_size=bucket), (8,), objective=objective)[0, 0])
    assert share(512, "adam") > 0.8 * small
    assert share(64, "adam") < 0.01 * small
    assert share(512, "relative") < 1e-3 * x.size  # in units of the mean square: per value, tiny


def _spiky(seed: int, n: int = 1 << 13) -> np.ndarray:
    # An embedding's gradient: most rows untouched (zero), a few with values, one far larger.
    r = np.random.default_rng(seed)
    x = np.zeros(n, np.float32)
    rows = r.choice(n // 64, n // 256, replace=False)
    for row in rows:
        x[row * 64:(row + 1) * 64] = r.standard_normal(64) * float(r.choice([0.1, 1.0, 10.0]))
    return x


@pytest.mark.parametrize("seed", range(4))
def test_width_and_bucket_size_plan_is_the_best_within_the_budget(seed):
    # Exhaustive search over every (width, bucket size) per leaf (and exact): the same least error,
    # within uniform budget_bits' bytes at the config's bucket size.
    leaves = [*_leaves(seed, 2), _spiky(seed)]
    sizes = [x.size for x in leaves]
    candidates, buckets = (2, 3, 4), (64, 512)
    errors = {bucket: expected_errors(leaves, BASE.replace(bucket_size=bucket), candidates) for bucket in buckets}
    choices = [(b, bucket) for bucket in buckets for b in candidates] + [(EXACT, None)]
    for budget_bits in (2.5, 3.0, 4.0):
        configs, plans = choose_bits(leaves, budget_bits=budget_bits, candidates=candidates, bucket_sizes=buckets,
                                     return_plan=True, config=BASE)
        budget = _budget(sizes, budget_bits)
        assert sum(p.bytes for p in plans) <= budget
        best = min(
            sum(0.0 if b == EXACT else errors[bucket][i][candidates.index(b)] for i, (b, bucket) in enumerate(combo))
            for combo in itertools.product(choices, repeat=len(leaves))
            if sum(_bytes(n, b, bucket or 1) for n, (b, bucket) in zip(sizes, combo)) <= budget
        )
        assert sum(p.error for p in plans) == pytest.approx(best, rel=1e-12)
        for c, p in zip(configs, plans):
            assert (c is None) == (p.bits == EXACT)
            assert c is None or (c.bits, c.bucket_size) == p.choice == (p.bits, p.bucket_size)


def test_a_sparse_leaf_gets_small_buckets_and_one_bucket_size_is_the_width_plan():
    tree = {"embed": _spiky(0, 1 << 15), "w": np.random.default_rng(0).standard_normal(1 << 14).astype(np.float32)}
    configs, plans = choose_bits(tree, budget_bits=4, bucket_sizes=(64, 512, 4096), objective="relative",
                                 return_plan=True, config=BASE)
    assert configs["embed"].bucket_size < 512  # its zero rows become exact buckets
    assert "bucket" in describe(plans) and str(configs["embed"].bucket_size) in describe(plans)
    widths_only = choose_bits(tree, budget_bits=3.5, return_plan=True, config=BASE)[1]
    assert choose_bits(tree, budget_bits=3.5, bucket_sizes=(512,), return_plan=True, config=BASE)[1] == widths_only
    assert {p.bucket_size for p in widths_only} == {512}
    for bad in ((), (0,), (2**31,), (True,), (64.0,), "64"):
        with pytest.raises(ValueError, match="bucket_sizes must be bucket sizes"):
            choose_bits(tree, bucket_sizes=bad, config=BASE)


def test_leaf_errors_with_bucket_sizes_plan_as_the_gradient_does():
    # leaf_errors' columns: each bucket size's widths, in order; choose_bits(errors=..., config=BASE) then plans as
    # it does from the gradient itself; its configs reduce as each leaf's own config does, bitwise.
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:8])
    r = np.random.default_rng(8)
    grads = {"e": np.stack([_spiky(k, 1 << 13) for k in range(8)]), "w": r.standard_normal((8, 4096)).astype(np.float32)}
    mean = jax.tree.map(lambda g: g.mean(0), grads)
    buckets, candidates = (64, 256, 1024), (2, 3, 4)
    errors = jax_cgx.adaptive.leaf_errors(mean, BASE, candidates, bucket_sizes=buckets)
    assert errors.shape == (2, 9)
    for k, bucket in enumerate(buckets):
        np.testing.assert_allclose(np.asarray(errors[:, 3 * k:3 * k + 3]), expected_errors(
            list(mean.values()), BASE.replace(bucket_size=bucket), candidates), rtol=1e-6)
    kwargs = dict(budget_bits=3, candidates=candidates, bucket_sizes=buckets, return_plan=True)
    assert choose_bits(mean, errors=errors, **kwargs)[1] == choose_bits(mean, **kwargs)[1]
    with pytest.raises(ValueError, match="candidates x bucket sizes"):
        choose_bits(mean, errors=errors[:, :3], **kwargs)
    configs = choose_bits(mean, budget_bits=3, candidates=candidates, bucket_sizes=buckets, config=BASE)
    configs["w"] = configs["w"].replace(bucket_size=128)  # two groups of different bucket sizes

    def both(g):
        g = jax.tree.map(lambda v: v[0], g)
        return (jax_cgx.compressed_pmean(g, "data", configs),
                {k: jax_cgx.compressed_pmean(v, "data", configs[k]) for k, v in g.items()})

    together, alone = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=P("data"), out_specs=P()))(grads)
    for k in grads:
        assert_same_bits(np.asarray(together[k]), np.asarray(alone[k]), k)


def test_the_planner_keys_plans_on_width_and_bucket_size():
    like = {"e": np.zeros(1 << 14, np.float32), "w": np.zeros(1 << 14, np.float32)}
    planner = jax_cgx.adaptive.Planner(like, budget_bits=4, candidates=(2, 3, 4, 6), bucket_sizes=(64, 512, 4096),
                                       every=1, objective="relative", config=BASE)
    assert {(c.bits, c.bucket_size) for c in jax.tree.leaves(planner.configs)} == {(4, 512)}
    grads = {"e": _spiky(1, 1 << 14), "w": np.random.default_rng(1).standard_normal(1 << 14).astype(np.float32)}
    errors = planner.leaf_errors(grads)
    assert errors.shape == (2, 12)
    assert planner.observe(0, grads, errors=errors)
    assert planner.configs["e"].bucket_size < 512
    assert [p.choice for p in planner.plans] == [(c.bits, c.bucket_size) for c in jax.tree.leaves(planner.configs)]
    planner.compiled(lambda configs: configs)
    assert not planner.observe(1, grads, errors=errors)  # the same plan: no change, nothing new to compile
    assert planner.compiled(lambda configs: configs) is not None and planner.changes == 1


def test_a_budget_no_option_fits_is_a_clear_error():
    # Before: "attempt to get argmin of an empty sequence".
    with pytest.raises(ValueError, match=r"choose_bits: .*bucket sizes \[1\]: no plan fits the budget: .* takes 16384 "
                                         r"bytes, the budget is 2112"):
        choose_bits({"w": np.random.default_rng(0).standard_normal(4096).astype(np.float32)}, bucket_sizes=[1], config=BASE)


def test_the_planner_refuses_a_gradient_of_other_shapes_or_dtypes():
    # Before: another leaf shape was planned and adopted, sending 7.75x the budgeted bytes.
    like = {"e": np.zeros(1 << 12, np.float32), "w": np.zeros(1 << 12, np.float32)}
    planner = jax_cgx.adaptive.Planner(like, budget_bits=4, candidates=(2, 4, 8), every=1, config=BASE)
    wide = {"e": _spiky(1, 1 << 15), "w": np.zeros(1 << 12, np.float32)}
    with pytest.raises(ValueError, match=r"leaf \['e'\] has shape \(32768,\) .* made for shape \(4096,\)"):
        planner.observe(0, wide)
    with pytest.raises(ValueError, match=r"\['w'\] has shape \(4096,\) and dtype bfloat16"):
        planner.observe(0, {"e": like["e"], "w": like["w"].astype(jnp.bfloat16)})
    with pytest.raises(ValueError, match="structure"):
        planner.observe(0, {"e": like["e"]})
    assert planner.changes == 0 and planner.plans is None


def test_a_planner_whose_bucket_sizes_leave_out_the_configs_adopts_its_first_plan(caplog):
    # The uniform start has CompressionConfig()'s buckets of 128, not among (64, 512): the first
    # observe used to raise "the current choices [(4, 128)] are not all among ...".
    like = {"w": np.zeros(1 << 14, np.float32)}
    planner = jax_cgx.adaptive.Planner(like, budget_bits=4, candidates=(2, 4), bucket_sizes=(64, 512), every=1)
    with caplog.at_level("INFO", logger="jax_cgx"):
        assert planner.observe(0, {"w": np.random.default_rng(0).standard_normal(1 << 14).astype(np.float32)})
    assert "not priced: its buckets of 128 are not among bucket_sizes" in caplog.text
    assert planner.configs["w"].bucket_size in (64, 512)


def test_the_planner_state_round_trips_through_orbax(tmp_path, caplog):
    ocp = pytest.importorskip("orbax.checkpoint")
    like = {"e": np.zeros(1 << 14, np.float32), "w": np.zeros(1 << 14, np.float32), "b": np.zeros(8, np.float32)}
    settings = dict(budget_bits=4, candidates=(2, 3, 4, 6), bucket_sizes=(64, 512), every=1)
    rng = np.random.default_rng(3)
    grads = [{"e": _spiky(s, 1 << 14), "w": rng.standard_normal(1 << 14).astype(np.float32),
              "b": np.ones(8, np.float32)} for s in range(4)]
    planner = jax_cgx.adaptive.Planner(like, **settings)
    fresh = jax_cgx.adaptive.Planner(like, **settings).state_dict()
    assert planner.observe(0, grads[0])
    planner.observe(1, grads[1])
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "planner", planner.state_dict())
    ckpt.wait_until_finished()
    restored = jax_cgx.adaptive.Planner(like, **settings)
    with caplog.at_level("INFO", logger="jax_cgx"):
        restored.load_state_dict(ckpt.restore(tmp_path / "planner"))
    assert "restored a plan of 2 leaves" in caplog.text
    assert restored.configs == planner.configs and restored.plans == planner.plans
    assert restored.changes == planner.changes
    # the same decisions afterwards
    for step in (2, 3):
        assert restored.observe(step, grads[step]) == planner.observe(step, grads[step])
        assert restored.configs == planner.configs and restored.changes == planner.changes
    # the uniform plan restores as uniform; another planner's state is refused, nothing changed
    again = jax_cgx.adaptive.Planner(like, **settings)
    again.load_state_dict(fresh)
    assert again.plans is None and again.configs == jax_cgx.adaptive.Planner(like, **settings).configs
    other = jax_cgx.adaptive.Planner({"e": like["e"]}, **settings)
    with pytest.raises(ValueError, match="saved plan is for 2 planned leaves"):
        other.load_state_dict(planner.state_dict())
    narrow = jax_cgx.adaptive.Planner(like, **dict(settings, candidates=(4,), bucket_sizes=None))
    with pytest.raises(ValueError, match="not among this planner's"):
        narrow.load_state_dict(planner.state_dict())
    with pytest.raises(ValueError, match="not a Planner.state_dict"):
        narrow.load_state_dict({"bits": 4})
    assert narrow.changes == 0


def test_a_planner_restores_its_own_uniform_plan_whatever_its_bucket_sizes():
    # config's bucket size outside the bucket sizes offered: the uniform plan it starts from is its own.
    like = {"a": np.zeros(4096, np.float32)}
    settings = dict(bucket_sizes=(64, 4096), config=jax_cgx.CompressionConfig(bucket_size=128, min_size=16))
    state = jax_cgx.adaptive.Planner(like, **settings).state_dict()
    again = jax_cgx.adaptive.Planner(like, **settings)
    again.load_state_dict(state)
    assert again.configs == jax_cgx.adaptive.Planner(like, **settings).configs


def test_the_planner_warns_of_a_step_factory_made_anew_each_step(caplog):
    planner = jax_cgx.adaptive.Planner({"a": np.zeros(4096, np.float32)}, budget_bits=4, config=BASE)
    with caplog.at_level("WARNING", logger="jax_cgx"):
        for _ in range(3):
            planner.compiled(lambda configs: configs)  # a new function each time: a new compilation each time
    assert planner.compilations == 3 and caplog.text.count("Define make_step once") == 1


def test_explain_shows_the_plan_per_leaf():
    # jax_cgx.explain(..., plans=) puts each planned leaf's width, bucket size, predicted error and bytes in
    # its leaf table, for the sum and for the reduce-scatter; plans of another tree are refused.
    r = np.random.default_rng(5)
    tree = {"a": r.standard_normal((64, 64)).astype(np.float32), "b": _spiky(5), "c": np.zeros(8, np.float32)}
    configs, plans = choose_bits(tree, budget_bits=3, bucket_sizes=(64, 512), return_plan=True, config=BASE)
    for op in ("psum", "psum_scatter"):
        text = io.StringIO()
        tiled = {"tiled": True} if op == "psum_scatter" else {}  # as compressed_psum_scatter would need
        report = jax_cgx.explain(tree, world=2, config=configs, plans=plans, op=op, file=text, **tiled)
        rows = {row.path: row for row in report.leaves}
        for p in plans:
            row = rows[p.path]
            assert (row.bits, row.bucket_size) == ((None, None) if p.bits == EXACT else (p.bits, p.bucket_size))
            assert row.how == ("exact" if p.bits == EXACT else "compressed")
            assert (row.predicted_error, row.planned_bytes) == (pytest.approx(p.error), p.bytes)
        assert rows["['c']"].bits is None and rows["['c']"].predicted_error is None  # too small: exact
        assert "predicted error" in text.getvalue() and f"{plans[0].bytes}" in text.getvalue()
    assert "predicted error" not in str(jax_cgx.explain(tree, world=2, config=configs, file=None))
    with pytest.raises(ValueError, match=r"plans name leaves the tree lacks: \[\"\['b'\]\"\]"):
        jax_cgx.explain({"a": tree["a"]}, world=2, config=configs["a"], plans=plans, file=None)


def test_observe_loss_feeds_the_planner_from_the_helper(caplog):
    # One line in the loop, no second gradient function: the errors of each device's own gradient,
    # the same as the hand-written shard_map of planner.leaf_errors, compiled once whatever the plan.
    from jax.sharding import NamedSharding

    from jax_cgx._src.data_parallel import step as dp_step

    mesh = jax.make_mesh((8,), ("data",))
    rng = np.random.default_rng(0)
    params = {"e": jnp.asarray(rng.standard_normal((64, 256)) / 8, jnp.float32),
              "w": jnp.asarray(rng.standard_normal((256, 8)) / 20, jnp.float32)}
    x = jax.device_put(jnp.asarray(rng.standard_cauchy((64, 64)), jnp.float32), NamedSharding(mesh, P("data")))

    def loss_fn(p, x):
        return jnp.mean((jnp.tanh(x @ p["e"]) @ p["w"]) ** 2)

    planner = jax_cgx.adaptive.Planner(params, budget_bits=4, every=2, min_gain=0.0, config=BASE)
    assert planner.bucket_sizes == (64, 512, 4096)  # offered by default
    by_hand = jax.jit(jax.shard_map(
        lambda p, x: planner.leaf_errors(jax.grad(loss_fn)(jax.lax.pcast(p, "data", to="varying"), x), "data"),
        mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
    observer = jax_cgx.data_parallel_value_and_grad(loss_fn, mesh=mesh)
    np.testing.assert_allclose(observer.leaf_errors(planner.leaf_errors, params, x), by_hand(params, x), rtol=1e-5)
    before = dp_step._errors_program.cache_info().currsize
    with caplog.at_level("INFO", logger="jax_cgx"):
        assert not planner.observe_loss(1, observer, params, x)  # not a planning step: nothing computed
        assert dp_step._errors_program.cache_info().currsize == before
        changed = planner.observe_loss(2, observer, params, x)
        other = jax_cgx.data_parallel_value_and_grad(loss_fn, mesh=mesh, config=planner.configs)  # another plan's
        assert not planner.observe_loss(4, other, params, x)  # the same gradient: the plan stays
    assert changed and "the bit widths stay" in caplog.text and "it is the best plan" in caplog.text
    assert dp_step._errors_program.cache_info().currsize == before  # one program for every plan
    with pytest.raises(TypeError, match="grad_fn must be a jax_cgx.data_parallel_value_and_grad function"):
        planner.observe_loss(0, loss_fn, params, x)
