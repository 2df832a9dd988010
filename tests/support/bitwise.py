"""Bitwise comparison of arrays: what the tests mean by \"the same bits\"."""

import numpy as np


def same_bits(a, b) -> bool:
    """Bitwise equality, counting any two NaNs as equal (NaN payloads are unspecified)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.kind == "f" or a.dtype.name == "bfloat16":
        nan_a, nan_b = np.isnan(a.astype(np.float32)), np.isnan(b.astype(np.float32))
        if not np.array_equal(nan_a, nan_b):
            return False
        view = {2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
        return np.array_equal(a.view(view)[~nan_a], b.view(view)[~nan_b])
    return np.array_equal(a, b)


def assert_same_bits(a, b, what: str = "") -> None:
    a, b = np.asarray(a), np.asarray(b)
    if same_bits(a, b):
        return
    if a.shape != b.shape or a.dtype != b.dtype:
        raise AssertionError(f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}")
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    bad = np.flatnonzero(~_elementwise_same(flat_a, flat_b))
    i = bad[0]
    raise AssertionError(
        f"{what}: {bad.size} of {flat_a.size} elements differ; first at {i}: "
        f"{flat_a[i]!r} vs {flat_b[i]!r}"
    )


def _elementwise_same(a, b):
    if a.dtype.kind == "f" or a.dtype.name == "bfloat16":
        fa, fb = a.astype(np.float32), b.astype(np.float32)
        view = {2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
        return (np.isnan(fa) & np.isnan(fb)) | (a.view(view) == b.view(view))
    return a == b
