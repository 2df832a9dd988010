"""Compressed data parallelism on meshes with model axes (tensor parallelism, FSDP): each gradient
keeps its parameter's sharding, each device quantizes only its own shard, nothing is gathered over
a model axis (jax_cgx/_src/collectives/shards.py, data_parallel_value_and_grad's param_specs).

bits=32 is jax.value_and_grad of the unsharded loss to float32 rounding; compressed, every shard's
values are within the bound the data gives for the stream of that shard's leaves (docs/algorithm.md).
"""

import functools
import logging
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bitwise import assert_same_bits
from hlo import collectives, float_all_gathers
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from meshes import device_mesh
from model_axes_cases import assert_within_bound_per_shard

import jax_cgx
from jax_cgx._src.collectives import shards

ROWS = 32
CONFIG = jax_cgx.CompressionConfig(bits=8, bucket_size=64, min_size=16)
SPECS_2D = {"b1": P("model"), "w1": P(None, "model"), "w2": P("model", None)}
# lm1b's ("data", "fsdp", "tensor"): parameters over fsdp and tensor, the batch over data and fsdp.
SPECS_3D = {"b1": P("tensor"), "w1": P("fsdp", "tensor"), "w2": P("tensor", "fsdp")}


def _problem(seed=0):
    rng = np.random.default_rng(seed)
    params = {"b1": rng.standard_normal((64,)).astype(np.float32) * 0.1,
              "w1": rng.standard_normal((16, 64)).astype(np.float32) * 0.3,
              "w2": rng.standard_normal((64, 4)).astype(np.float32) * 0.3}
    x = rng.standard_normal((ROWS, 16)).astype(np.float32)
    y = rng.standard_normal((ROWS, 4)).astype(np.float32)
    return params, x, y


def _loss(params, x, y, *, explicit=False):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    # With Explicit axes a contraction over a sharded dimension names its result's sharding (jax's rule).
    out = jnp.matmul(h, params["w2"], out_sharding=P()) if explicit else h @ params["w2"]
    return jnp.mean((out - y) ** 2)


def _placed(mesh, specs, params, x, y, batch_spec=P("data")):
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    x, y = (jax.device_put(a, NamedSharding(mesh, batch_spec)) for a in (x, y))
    return params, x, y


def _per_data_device(params, x, y, data: int):
    """Each data-parallel group's own gradient (its rows' mean), stacked: [data, ...] per leaf."""
    xs, ys = x.reshape(data, -1, x.shape[1]), y.reshape(data, -1, y.shape[1])
    return jax.vmap(jax.grad(_loss), in_axes=(None, 0, 0))(params, xs, ys)


def _compiled(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text()


@pytest.mark.parametrize("in_backward", [True, False], ids=["in_backward", "after"])
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_2d_gradients_keep_their_sharding_exact_and_within_the_bound(axis_type, in_backward):
    mesh = device_mesh((4, 2), ("data", "model"), axis_type)
    explicit = axis_type == AxisType.Explicit
    params, x, y = _problem()
    placed = _placed(mesh, SPECS_2D, params, x, y)
    # Auto axes under jit: the specs are given; Explicit: read off the parameters' types.
    given = {} if explicit else {"param_specs": SPECS_2D}
    loss_fn = functools.partial(_loss, explicit=explicit)
    make = lambda bits: jax_cgx.data_parallel_value_and_grad(  # noqa: E731
        loss_fn, mesh=mesh, config=CONFIG if bits == 8 else jax_cgx.CompressionConfig(bits=32),
        in_backward=in_backward, **given)
    ref_loss, ref = jax.value_and_grad(_loss)(params, x, y)
    for bits in (32, 8):
        loss, grads = jax.jit(make(bits))(*placed)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
        for k, spec in SPECS_2D.items():
            assert grads[k].sharding.is_equivalent_to(NamedSharding(mesh, spec), grads[k].ndim), (bits, k,
                                                                                               grads[k].sharding)
        if bits == 32:
            for k in ref:
                np.testing.assert_allclose(grads[k], ref[k], rtol=2e-5, atol=1e-7, err_msg=k)
        else:
            mine = _per_data_device(params, x, y, 4)
            assert_within_bound_per_shard(grads, mine, SPECS_2D, mesh, ("model",), 4, CONFIG)
    # Compression adds no gather of floating-point values: the exact step has none either.
    exact, compressed = (float_all_gathers(_compiled(make(b), *placed)) for b in (32, 8))
    assert compressed == [] and exact == [], compressed + exact


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_3d_fsdp_and_tensor_axes_the_fsdp_reduction_stays_xlas(axis_type):
    mesh = device_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_type)
    explicit = axis_type == AxisType.Explicit
    params, x, y = _problem(1)
    placed = _placed(mesh, SPECS_3D, params, x, y, batch_spec=P(("data", "fsdp")))
    given = {} if explicit else {"param_specs": SPECS_3D}  # Explicit: the parameters' types say it
    make = lambda config: jax_cgx.data_parallel_value_and_grad(  # noqa: E731
        functools.partial(_loss, explicit=explicit), mesh=mesh, config=config, **given)
    ref_loss, ref = jax.value_and_grad(_loss)(params, x, y)
    loss, grads = jax.jit(make(jax_cgx.CompressionConfig(bits=32)))(*placed)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for k in ref:
        np.testing.assert_allclose(grads[k], ref[k], rtol=2e-5, atol=1e-7, err_msg=k)
    loss, grads = jax.jit(make(CONFIG))(*placed)
    for k, spec in SPECS_3D.items():
        assert grads[k].sharding.is_equivalent_to(NamedSharding(mesh, spec), grads[k].ndim), (k, grads[k].sharding)
    # Each data group's own gradient: the mean over its rows, which fsdp splits further (XLA sums them exactly).
    assert_within_bound_per_shard(grads, _per_data_device(params, x, y, 2), SPECS_3D, mesh, ("fsdp", "tensor"), 2, CONFIG)

    text = _compiled(make(CONFIG), *placed)
    exact_text = _compiled(make(jax_cgx.CompressionConfig(bits=32)), *placed)
    # FSDP gathers parameters over fsdp in the forward pass; compression adds no gather to that.
    assert len(float_all_gathers(text)) == len(float_all_gathers(exact_text))
    # Over fsdp the gradients are summed by XLA in float (a reduce-scatter or an all-reduce); the
    # quantized exchange runs over data alone: its all-to-all groups are pairs of data devices.
    floats = [t for t, _ in collectives(text, "reduce-scatter") + collectives(text, "all-reduce") if "f32[" in t]
    assert floats
    quantized = [line for line in text.splitlines() if 'custom_call_target="jax_cgx_quantize"' in line]
    assert quantized
    # Each device quantizes its shard: a quarter of the 1344 values (fsdp x tensor), not all of them.
    sizes = [int(np.prod([int(d) for d in line.split("custom-call(")[0].split("f32[")[0].split("u8[")[1].split("]")[0]
                         .split(",")])) for line in quantized]
    assert sum(sizes) * 4 <= 1344 + 4 * 64 * len(sizes), sizes


def test_unknown_sharding_under_jit_is_reduced_whole_and_said(caplog):
    mesh = device_mesh((4, 2), ("data", "model"), AxisType.Auto)
    params, x, y = _problem()
    placed = _placed(mesh, SPECS_2D, params, x, y)
    grad_fn = jax_cgx.data_parallel_value_and_grad(_loss, mesh=mesh, config=CONFIG)
    shards._warned.clear()
    with caplog.at_level(logging.WARNING, logger="jax_cgx"):
        _, grads = jax.jit(grad_fn)(*placed)
    said = [r.getMessage() for r in caplog.records if "param_specs" in r.getMessage()]
    assert len(said) == 1 and "('model',)" in said[0], said
    assert all(g.sharding.is_fully_replicated for g in grads.values())
    ref = jax.grad(_loss)(params, x, y)
    for k in ref:  # still the mean gradient (within 8 bits of it)
        np.testing.assert_allclose(grads[k], ref[k], atol=5e-3)
    # Called outside jax.jit the arrays say how they are sharded: nothing to warn of.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jax_cgx"):
        shards._warned.clear()
        _, eager = grad_fn(*placed)
    assert not [r for r in caplog.records if "param_specs" in r.getMessage()]
    for k, spec in SPECS_2D.items():
        assert eager[k].sharding.is_equivalent_to(NamedSharding(mesh, spec), eager[k].ndim), k


def test_specs_that_cannot_work_are_refused_by_name():
    mesh = device_mesh((4, 2), ("data", "model"), AxisType.Auto)
    params, x, y = _problem()
    placed = _placed(mesh, {k: P() for k in params}, params, x, y)

    def run(specs):
        return jax.jit(jax_cgx.data_parallel_value_and_grad(_loss, mesh=mesh, config=CONFIG, param_specs=specs))(
            *placed)

    with pytest.raises(ValueError, match=r"params\['w1'\] is sharded over 'data'.*an axis it is reduced over.*fsdp"):
        run({**SPECS_2D, "w1": P("data", None)})
    with pytest.raises(ValueError, match=r"params\['w1'\] has 15 entries in dimension 0, which its spec .* splits over "
                                         r"\('model',\) \(2 devices\): not divisible"):
        odd = dict(params, w1=np.zeros((15, 64), np.float32))
        jax.jit(jax_cgx.data_parallel_value_and_grad(
            lambda p, x, y: _loss(dict(p, w1=jnp.concatenate([p["w1"], p["w1"][:1]])), x, y), mesh=mesh,
            config=CONFIG, param_specs={**SPECS_2D, "w1": P("model")}))(odd, *placed[1:])
    with pytest.raises(ValueError, match=r"names 'pipe', not an axis of the mesh"):
        run({**SPECS_2D, "b1": P("pipe")})
    with pytest.raises(TypeError, match=r"param_specs must hold PartitionSpecs"):
        run({**SPECS_2D, "b1": "model"})
    with pytest.raises(ValueError, match=r"param_specs must be a pytree prefix of params"):
        run([P()])


def test_compressed_pmean_in_a_shard_map_over_data_alone():
    # The collective itself, written by hand inside a shard_map that leaves "model" to XLA:
    # the specs keep each leaf's sharding; without them (Auto) the leaf is reduced whole.
    mesh = device_mesh((4, 2), ("data", "model"), AxisType.Auto)
    params, x, y = _problem()
    placed = _placed(mesh, SPECS_2D, params, x, y)

    def step(specs, residual):
        def local(params, x, y):
            grads = jax.grad(_loss)(jax.tree.map(lambda v: lax.pcast(v, "data", to="varying"), params), x, y)
            out = jax_cgx.compressed_pmean(grads, "data", CONFIG, specs=specs, return_residual=residual)
            return out[0] if residual else out

        return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P(),
                                     axis_names=frozenset({"data"})))

    mean = step(SPECS_2D, False)(*placed)
    for k, spec in SPECS_2D.items():
        assert mean[k].sharding.is_equivalent_to(NamedSharding(mesh, spec), mean[k].ndim), k
    assert_within_bound_per_shard(mean, _per_data_device(params, x, y, 4), SPECS_2D, mesh, ("model",), 4, CONFIG)
    assert float_all_gathers(jax.jit(step(SPECS_2D, False)).lower(*placed).compile().as_text()) == []
    # With the residual (error feedback) the mean is bitwise the same; a spec prefix works too.
    with_residual = step({"b1": P("model"), "w1": P(None, "model"), "w2": P("model")}, True)(*placed)
    for k in mean:
        np.testing.assert_array_equal(np.asarray(with_residual[k]), np.asarray(mean[k]))


def test_local_shape():
    mesh = jax.sharding.AbstractMesh((2, 2, 2), ("data", "fsdp", "tensor"))
    assert shards.local_shape((16, 64), P("fsdp", "tensor"), mesh) == (8, 32)
    assert shards.local_shape((16, 64), P(("fsdp", "tensor")), mesh) == (4, 64)
    assert shards.local_shape((16, 64), P(), mesh) == (16, 64)


@pytest.mark.parametrize("model_shards", [2, 4])
def test_compiled_gradient_memory_is_the_shard(model_shards):
    # benchmarks/model_axes_memory.py's step, smaller: XLA's own per-device figures.
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
    import model_axes_memory

    shards._warned.clear()
    figures = {(bits, given): model_axes_memory.measure(model_shards, bits, specs_given=given, width=128, layers=2)
               for bits, given in ((32, True), (8, True), (8, False))}
    whole = figures[32, True]["param_bytes"]
    for bits in (32, 8):  # the gradients each device holds: its shard, compressed or not (+ the loss)
        assert whole / model_shards <= figures[bits, True]["output_bytes"] <= whole / model_shards + 64
    assert figures[8, False]["output_bytes"] >= whole  # without the specs: the whole model on every device

    def total(f):
        return f["argument_bytes"] + f["output_bytes"] + f["temp_bytes"]

    assert total(figures[8, True]) < total(figures[8, False])


def test_explain_prices_each_devices_shard_and_names_the_axes():
    params = {"b1": jnp.zeros(4096), "s": jnp.zeros((64, 64)), "w1": jnp.zeros((512, 2048))}
    specs = {"b1": P("model"), "s": P(), "w1": P(None, "model")}
    config = jax_cgx.CompressionConfig(bits=4, fusion_buffer_mb=4, min_size=16)
    mesh = device_mesh((4, 2), ("data", "model"), AxisType.Auto)
    outside = jax_cgx.explain(params, world=4, config=config, specs=specs, mesh=mesh, file=None)

    def inside(p):
        inside.report = jax_cgx.explain(p, "data", config, specs=specs, file=None)
        return jnp.zeros(())

    jax.jit(jax.shard_map(inside, mesh=mesh, in_specs=P(), out_specs=P(), axis_names=frozenset({"data"})))(params)
    for report in (outside, inside.report):
        assert report.model_axes == ("model",)
        by = {r.path: r for r in report.leaves}
        assert by["['w1']"].shard == (512, 1024) and by["['w1']"].split_over == ("model",)
        assert by["['w1']"].nbytes == 512 * 1024 * 4  # what each device sends is priced: its shard
        assert by["['s']"].split_over == () and by["['s']"].shard is None
        # The replicated leaf has a buffer of its own: it is not fused with the split ones.
        assert set(by["['s']"].buffers).isdisjoint(by["['b1']"].buffers + by["['w1']"].buffers)
    assert "('data',) (4 ranks)" in str(inside.report)
    assert "model axes ('model',): left to XLA's partitioner" in str(outside)
    with pytest.raises(ValueError, match="mesh= is for specs="):
        jax_cgx.explain(params, world=4, mesh=mesh, file=None)


@pytest.mark.multiprocess
def test_across_processes_replicas_agree_and_shards_within_the_bound(tmp_path):
    # 2 processes x 4 devices (gloo), the data axis across them and then the model axis. Every
    # device along "data" holds bitwise the same shard of each gradient, within the codec's bound
    # of the exact mean of the data groups' own gradients. (Not bitwise the one-process step: XLA:CPU
    # sums a matmul's terms in another order with 4 devices to a process than with 8.)
    from model_axes_worker import CONFIG, LAYOUTS, SPECS, problem
    from model_axes_worker import loss as worker_loss
    from processes import run_workers

    nproc = 2
    run_workers("model_axes_worker.py", nproc, tmp_path)
    results = {}
    for i in range(nproc):
        results.update(np.load(tmp_path / f"process{i}.npz"))
    params, x, y = problem()
    for layout, names in LAYOUTS.items():
        mesh = jax.sharding.AbstractMesh((2, 4), names)
        data, model = mesh.shape["data"], mesh.shape["model"]
        xs, ys = x.reshape(data, -1, x.shape[1]), y.reshape(data, -1, y.shape[1])
        mine = jax.vmap(jax.grad(worker_loss), in_axes=(None, 0, 0))(params, xs, ys)
        grads = {}
        for k in params:
            blocks = []
            for m in range(model):
                first = results[f"{layout}/{k}/data0/model{m}"]
                for d in range(1, data):
                    assert_same_bits(results[f"{layout}/{k}/data{d}/model{m}"], first, f"{layout} {k} model {m}")
                blocks.append(first)
            axis = next(i for i, e in enumerate(SPECS[k]) if e == "model")
            grads[k] = np.concatenate(blocks, axis=axis)
        assert_within_bound_per_shard(grads, mine, SPECS, mesh, ("model",), data, CONFIG)
