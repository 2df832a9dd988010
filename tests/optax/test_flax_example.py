"""examples/train_flax.py: a Flax NNX model trained both ways, in-process on 8 devices (docs/flax.md)."""

import os
import sys

import pytest

pytest.importorskip("flax")
pytest.importorskip("sklearn")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples"))

import train_flax  # noqa: E402

COMMON = ["--devices", "8", "--steps", "30", "--batch", "128", "--log-every", "0"]


def _run(*flags) -> dict:
    return train_flax.run(train_flax.parse_args([*COMMON, *flags]))


def test_the_two_ways_are_the_same_mean():
    # data_parallel_value_and_grad with layer_filter(config, 1024) in a jit step, and
    # compressed_mean (whose layer filter that is) in a shard_map step: the same gradients, so the
    # same training, to the bit.
    jit, via_optax = _run("--way", "jit"), _run("--way", "optax")
    assert jit["losses"] == via_optax["losses"]
    assert jit["losses"][-1] < 0.3 * jit["losses"][0] and jit["final_accuracy"] > 85


def test_error_feedback_trains():
    # The residuals are per device: state sharded over the mesh in the shard_map step.
    result = _run("--way", "optax", "--error-feedback")
    assert result["losses"][-1] < 0.3 * result["losses"][0] and result["final_accuracy"] > 85
    assert result["losses"][1:] != _run("--way", "optax")["losses"][1:]  # the residual is added back


def test_error_feedback_needs_the_optax_way():
    with pytest.raises(SystemExit):
        train_flax.parse_args(["--error-feedback"])
