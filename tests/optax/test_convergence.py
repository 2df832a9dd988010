"""Training converges as well compressed as uncompressed: examples/train_digits.py, in-process.

An MLP on scikit-learn's digits, data-parallel over the 8 virtual CPU devices of the test
session, trained to a stable test accuracy (about 97%, 100% on the training set) with pmean,
then with each compressor, from the same seeds. The final test accuracy, averaged over the
seeds (one seed alone moves it by about a point), must stay within a fixed margin of the
uncompressed run's:

    4-bit max-min                        1.0 point
    2-bit max-min with error feedback    2.0 points
    PowerSGD rank 2                      2.0 points
    top-k 1%                             2.0 points
"""

import os
import sys

import pytest

pytest.importorskip("optax")
pytest.importorskip("sklearn")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples"))

import train_digits  # noqa: E402

pytestmark = pytest.mark.slow

SEEDS = (0, 1, 2)
COMMON = ["--devices", "8", "--steps", "400", "--batch", "256", "--log-every", "0", "--no-progress"]


def mean_accuracy(*flags) -> tuple[float, list]:
    accuracies = []
    for seed in SEEDS:
        result = train_digits.run(train_digits.parse_args([*COMMON, "--seed", str(seed), *flags]))
        assert result["bytes_per_step"] > 0
        accuracies.append(result["final_accuracy"])
    return sum(accuracies) / len(accuracies), accuracies


@pytest.fixture(scope="module")
def baseline():
    mean, accuracies = mean_accuracy("--compressor", "none")
    assert mean >= 95.0, f"uncompressed training reached only {accuracies}"
    return mean, accuracies


@pytest.mark.parametrize(
    "flags, margin",
    [
        (("--compressor", "maxmin", "--bits", "4"), 1.0),
        (("--compressor", "maxmin", "--bits", "2", "--error-feedback"), 2.0),
        (("--compressor", "powersgd", "--rank", "2"), 2.0),
        (("--compressor", "topk", "--ratio", "0.01"), 2.0),
    ],
    ids=["maxmin-4bit", "maxmin-2bit-ef", "powersgd-rank2", "topk-1pct"],
)
def test_accuracy_close_to_uncompressed(baseline, flags, margin):
    reference, reference_runs = baseline
    mean, runs = mean_accuracy(*flags)
    print(f"{' '.join(flags)}: {mean:.2f}% {[round(a, 2) for a in runs]}; uncompressed {reference:.2f}% "
          f"{[round(a, 2) for a in reference_runs]}")
    assert mean >= reference - margin, (
        f"{' '.join(flags)}: test accuracy {mean:.2f}% (seeds {SEEDS}: {runs}) vs uncompressed "
        f"{reference:.2f}% ({reference_runs}): more than {margin} points below"
    )
