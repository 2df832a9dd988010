"""benchmarks/plan_noise.py: each plan scored by the noise Adam sees."""

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


@pytest.mark.slow
def test_the_plan_made_for_adams_noise_has_the_least_of_it():
    # A 65-word vocabulary after 3 steps: the score is what the second_moment=nu plan minimizes, so within
    # each budget it beats (or ties) every other objective's plan and the uniform width there.
    import plan_noise

    rows = plan_noise.main(["--words", "64", "--steps", "3", "--bucket-sizes", "64", "512"])
    assert rows["uniform 4-bit"] == 1.0 and rows["uniform 8-bit"] < 1.0 < rows["uniform 3-bit"]
    for budget in (4, 3):
        best = rows[f"within {budget}-bit bytes, adam, second_moment=nu"]
        others = [v for k, v in rows.items() if k.startswith(f"within {budget}-bit")] + [rows[f"uniform {budget}-bit"]]
        assert best <= min(others) * (1 + 1e-6)
