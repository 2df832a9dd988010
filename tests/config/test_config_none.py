"""A call without ``config`` compresses (issue 33, item 1).

``config=None`` is ``CompressionConfig()``'s defaults unless torch_cgx's ``CGX_*`` variables are
set (then ``CompressionConfig.from_env()``, as before): every entry point that takes it gives
bitwise what an explicit ``CompressionConfig()`` gives, which differs from lax's exact result by
no more than the codec's bound. The one function behind them, its log line and its unit cases:
tests/test_environment.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from allreduce_cases import W, exact_psum, mesh_1d, oracle, per_device, sra_bound
from bitwise import assert_same_bits
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cgx
from jax_cgx import CompressionConfig
from jax_cgx._src import config as config_module
from jax_cgx.optax import compressed_mean

DEFAULTS = CompressionConfig()
ROWS, COLS = 64, 48  # a 2-D leaf of 3072 values: above compressed_mean's layer filter (1024)


@pytest.fixture(autouse=True)
def _no_variables(monkeypatch):
    monkeypatch.setattr(config_module.variables, "_said", set())
    for name in config_module.CONFIG_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def _rows(seed=0):
    return np.asarray(jax.random.normal(jax.random.key(seed), (W, ROWS * COLS), jnp.float32))


def _psum(config):
    # A fresh jit each call: config=None is read while tracing, and a cached trace would not read it.
    body = lambda x: jax_cgx.compressed_psum(x[0], "d", config)[None]  # noqa: E731
    return jax.jit(jax.shard_map(body, mesh=mesh_1d(), in_specs=P("d"), out_specs=P("d")))


def test_compressed_psum_without_config_compresses_with_the_defaults():
    xs = _rows()
    placed = per_device(xs, mesh_1d())
    out = np.asarray(_psum(None)(placed))
    assert_same_bits(out[0], oracle(xs, DEFAULTS)[0])  # SRA at 4 bits, buckets of 512, from the documents
    err, bound = sra_bound(xs, out[0], DEFAULTS)
    assert np.all(err <= bound), float(np.max(err - bound))
    assert not np.array_equal(out[0], np.asarray(exact_psum(placed)))  # not lax.psum's exact sum


def _every_entry_point(config, tx_config="same"):
    """compressed_pmean, compressed_psum_scatter, compressed_all_gather, reduce_in_backward and
    compressed_mean (``None``: each given no config), in one program; with ``config=False``, lax's."""
    tx = None if config is False else compressed_mean("d", config if tx_config == "same" else tx_config)

    def body(x, w):
        x = x[0].reshape(ROWS, COLS)
        if config is False:
            mine = jax.lax.pcast(w, "d", to="varying")
            grad = jax.grad(lambda v: jnp.sum(v * x))(mine)
            return tuple(v[None] for v in (jax.lax.pmean(x, "d"), jax.lax.psum_scatter(x, "d", tiled=True),
                                           jax.lax.all_gather(x, "d", tiled=True), jax.lax.pmean(grad, "d"),
                                           jax.lax.pmean(x, "d")))
        grad = jax.grad(lambda v: jnp.sum(jax_cgx.reduce_in_backward(v, "d", config) * x))(w)
        return tuple(v[None] for v in (
            jax_cgx.compressed_pmean(x, "d", config), jax_cgx.compressed_psum_scatter(x, "d", config, tiled=True),
            jax_cgx.compressed_all_gather(x, "d", config, tiled=True), grad, tx.update(x, tx.init(x))[0]))

    mesh = mesh_1d()
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d")))
    out = f(per_device(_rows(1), mesh), jax.device_put(jnp.zeros((ROWS, COLS)), NamedSharding(mesh, P())))
    return [np.asarray(v) for v in out]


NAMES = ("compressed_pmean", "compressed_psum_scatter", "compressed_all_gather", "reduce_in_backward",
         "optax.compressed_mean")


def test_every_entry_point_without_config_is_compression_configs_defaults():
    given, defaults, exact = _every_entry_point(None), _every_entry_point(DEFAULTS), _every_entry_point(False)
    for name, a, b, e in zip(NAMES, given, defaults, exact):
        assert_same_bits(a, b, name)
        assert not np.array_equal(a, e), f"{name} without config returned lax's exact result"


def test_torch_cgx_variables_still_apply(monkeypatch):
    monkeypatch.setenv("CGX_COMPRESSION_QUANTIZATION_BITS", "6")
    monkeypatch.setenv("CGX_COMPRESSION_BUCKET_SIZE", "128")
    six = CompressionConfig(bits=6, bucket_size=128)
    for name, a, b in zip(NAMES, _every_entry_point(None), _every_entry_point(six)):
        assert_same_bits(a, b, name)
    # torch_cgx's default with them: 32 bits, lax's exact results (compressed_mean reads its
    # config when built, here under the variable too).
    monkeypatch.setenv("CGX_COMPRESSION_QUANTIZATION_BITS", "32")
    for name, a, b in zip(NAMES, _every_entry_point(None), _every_entry_point(False)):
        assert_same_bits(a, b, name)


def test_data_parallel_value_and_grad_without_config_compresses():
    mesh = jax.make_mesh((W,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal((32, 64)).astype(np.float32)}
    x = rng.standard_normal((4 * W, 32)).astype(np.float32)

    def loss(p, x):
        return jnp.mean(jnp.tanh(x @ p["w"]) ** 2)

    def grads(config):
        return jax.jit(jax_cgx.data_parallel_value_and_grad(loss, mesh=mesh, config=config))(params, x)[1]["w"]

    given, defaults, exact = grads(None), grads(DEFAULTS), grads(CompressionConfig(bits=32))
    assert_same_bits(np.asarray(given), np.asarray(defaults))
    assert not np.array_equal(np.asarray(given), np.asarray(exact))


def test_optax_compressed_mean_reads_its_config_once(monkeypatch):
    tx = compressed_mean("d")  # read here: the defaults
    monkeypatch.setenv("CGX_COMPRESSION_QUANTIZATION_BITS", "32")
    mesh = mesh_1d()
    body = lambda x: tx.update(x[0], tx.init(x[0]))[0][None]  # noqa: E731
    ref = lambda x: jax_cgx.compressed_pmean(x[0], "d", DEFAULTS)[None]  # noqa: E731
    xs = per_device(_rows(2).reshape(W, ROWS, COLS), mesh)
    out, want = (np.asarray(jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("d"), out_specs=P("d")))(xs))
                 for f in (body, ref))
    assert_same_bits(out, want)
