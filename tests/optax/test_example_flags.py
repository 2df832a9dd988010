"""examples: train_digits.py's --reduce-in-backward and --policy auto, train_charlm.py's --adaptive, in-process on 8 devices."""

import os
import sys

import pytest

pytest.importorskip("optax")
pytest.importorskip("sklearn")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples"))

import train_digits  # noqa: E402

COMMON = ["--devices", "8", "--steps", "40", "--batch", "128", "--log-every", "0", "--no-progress",
          "--compressor", "maxmin", "--bits", "4"]


@pytest.mark.parametrize("flags", [["--reduce-in-backward"], ["--policy", "auto"],
                                   ["--reduce-in-backward", "--stochastic"]],
                         ids=["in-backward", "auto", "in-backward-stochastic"])
def test_trains(flags):
    result = train_digits.run(train_digits.parse_args([*COMMON, *flags]))
    assert result["losses"][-1] < 0.5 * result["losses"][0]
    assert result["final_accuracy"] > 80


def test_in_backward_refuses_error_feedback():
    with pytest.raises(SystemExit, match="only with --compressor maxmin, without --error-feedback"):
        train_digits.run(train_digits.parse_args([*COMMON, "--reduce-in-backward", "--error-feedback"]))


@pytest.mark.slow
def test_charlm_adaptive_replans_within_the_budget():
    # examples/train_charlm.py --adaptive: plans from each device's own gradient every 10 steps; one
    # compiled step per distinct plan; trains.
    import train_charlm

    args = train_charlm.parse_args(["--devices", "8", "--steps", "20", "--batch", "32", "--d-model", "32", "--layers", "1",
                                    "--log-every", "0", "--no-progress", "--compressor", "maxmin", "--adaptive", "3",
                                    "--replan-every", "10", "--layer-min-size", "256"])
    result = train_charlm.run(args)
    assert result["losses"][-1] < 0.8 * result["losses"][0]
    assert 1 <= result["compilations"] <= result["plan_changes"] + 1 <= 3  # 2 planning steps at most


def test_adaptive_needs_maxmin():
    import train_charlm

    with pytest.raises(SystemExit, match="--adaptive: only with --compressor maxmin"):
        train_charlm.run(train_charlm.parse_args(["--devices", "8", "--steps", "2", "--no-progress",
                                                  "--compressor", "cast", "--adaptive", "4"]))
    with pytest.raises(SystemExit, match=r"--adaptive: Planner: candidates must be widths in 1..8, got \[2, 9\]"):
        train_charlm.run(train_charlm.parse_args(["--devices", "8", "--steps", "2", "--no-progress", "--compressor",
                                                  "maxmin", "--adaptive", "4", "--adaptive-candidates", "2", "9"]))


def test_the_planner_sees_each_devices_own_gradient():
    # DataParallel.errors (one compiled function for every plan) is errors_fn of each device's gradient on
    # its rows of the batch, averaged over the devices: leaf_errors of each shard's gradient, meaned.
    import _common
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jax_cgx

    devices = _common.mesh_devices(8)
    params = {"w": jax.random.normal(jax.random.key(0), (64, 32)), "b": jnp.zeros(32)}
    config = jax_cgx.CompressionConfig(bits=4, bucket_size=64, min_size=1024)

    def loss_fn(p, x):
        return jnp.mean(jnp.tanh(x @ p["w"] + p["b"]) ** 2)

    errors_fn = lambda g: jax_cgx.adaptive.leaf_errors(g, config, (2, 4), _common.AXIS)  # noqa: E731
    dp = _common.DataParallel(loss_fn, optax.identity(), optax.sgd(0.1), devices, errors_fn=errors_fn)
    x = np.asarray(jax.random.normal(jax.random.key(1), (16, 64)))
    params, _ = dp.init(params, (x,))
    got = np.asarray(dp.errors(params, dp.shard(x)))
    host = jax.device_get(params)
    rows = [jax_cgx.adaptive.leaf_errors(jax.grad(loss_fn)(host, x[2 * i:2 * i + 2]), config, (2, 4))
            for i in range(8)]
    assert got.shape == (1, 2)  # "w" is planned, "b" is under min_size
    np.testing.assert_allclose(got, np.mean(rows, axis=0), rtol=1e-5)
