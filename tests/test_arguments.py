"""Arguments of the public functions: booleans are real booleans (one shared check,
jax_cgx/_src/arguments.py), and jax_cgx.optax.sharded checks what it is given when it is built."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from meshes import device_mesh

import jax_cgx
import jax_cgx.optax as cgx_optax
from jax_cgx._src import arguments
from jax_cgx._src.optax import checks

NOT_BOOLS = ["False", "True", 0, 1, None, "no"]
X = {"w": jnp.ones((8,), jnp.float32)}


CALLS = {
    "compressed_psum(return_residual)": lambda v: jax_cgx.compressed_psum(X, "data", return_residual=v),
    "compressed_pmean(return_residual)": lambda v: jax_cgx.compressed_pmean(X, "data", return_residual=v),
    "compressed_psum_scatter(return_residual)":
        lambda v: jax_cgx.compressed_psum_scatter(X, "data", return_residual=v),
    "compressed_psum_scatter(tiled)": lambda v: jax_cgx.compressed_psum_scatter(X, "data", tiled=v),
    "compressed_all_gather(tiled)": lambda v: jax_cgx.compressed_all_gather(X, "data", tiled=v),
    "data_parallel_value_and_grad(has_aux)":
        lambda v: jax_cgx.data_parallel_value_and_grad(lambda p: 0.0, mesh=device_mesh((1,), ("data",)), has_aux=v),
    "dequantize_sum_requantize(stochastic)": lambda v: jax_cgx.dequantize_sum_requantize(None, stochastic=v),
    "nccl.teardown(abort)": lambda v: jax_cgx.nccl.teardown(abort=v),
    "distributed.initialize(one_gpu_per_process)":
        lambda v: jax_cgx.distributed.initialize(one_gpu_per_process=v),
    "distributed.initialize(exit_on_uncaught_exception)":
        lambda v: jax_cgx.distributed.initialize(exit_on_uncaught_exception=v),
    "optax.sharded(error_feedback)": lambda v: cgx_optax.sharded(optax.sgd(0.1), "data", error_feedback=v),
    "optax.compressed_mean(error_feedback)": lambda v: cgx_optax.compressed_mean("data", error_feedback=v),
}


@pytest.mark.parametrize("value", NOT_BOOLS, ids=repr)
@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
def test_boolean_arguments_take_only_booleans(call, value):
    # return_residual="False" used to return a (sum, residual) tuple: the string is true.
    name = next(k for k, c in CALLS.items() if c is call).split("(")[1].rstrip(")")
    with pytest.raises(ValueError, match=rf"{name} must be True or False, got {value!r:.4}"):
        call(value)


def test_numpy_bools_are_booleans():
    assert arguments.check_bool("f", "x", np.bool_(True)) is True
    assert arguments.check_bool("f", "x", False) is False


def test_one_boolean_check():
    assert checks.check_bool is arguments.check_bool and checks.check_axes is arguments.check_axes


def test_data_parallel_needs_an_axis():
    # axis_name=() failed with an IndexError.
    with pytest.raises(ValueError, match="data_parallel_value_and_grad: axis_name must name at least one mapped axis"):
        jax_cgx.data_parallel_value_and_grad(lambda p: 0.0, mesh=device_mesh((1,), ("data",)), axis_name=())


@pytest.mark.parametrize("axis_name", [(), [], None, ("data", None), (("data",),)], ids=repr)
def test_sharded_needs_axis_names(axis_name):
    # sharded(tx, ()) was accepted, then state_specs raised an IndexError.
    with pytest.raises(ValueError, match=r"jax_cgx.optax.sharded: axis_name must (name at least one|be a mesh)"):
        cgx_optax.sharded(optax.sgd(0.1), axis_name)


def test_sharded_needs_an_optax_transformation():
    with pytest.raises(TypeError, match="sharded: optimizer must be an optax.GradientTransformation"):
        cgx_optax.sharded("adam", "data")
    cgx_optax.sharded(optax.adam(1e-3), ("data",))  # a tuple of one name is fine
