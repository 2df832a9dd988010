"""examples/train_digits.py's --reduce-in-backward and --policy auto train, in-process on 8 devices."""

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
