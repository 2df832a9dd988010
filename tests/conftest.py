"""Test setup: 8 virtual CPU devices, and skipping of `gpu` tests where no GPU is present."""

import os

# Must happen before jax initializes its backends.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def same_bits(a, b) -> bool:
    """Bitwise equality, counting any two NaNs as equal (NaN payloads are unspecified)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.kind == "f" or a.dtype.name == "bfloat16":
        nan_a, nan_b = np.isnan(a.astype(np.float32)), np.isnan(b.astype(np.float32))
        if not np.array_equal(nan_a, nan_b):
            return False
        view = {2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
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
        view = {2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
        return (np.isnan(fa) & np.isnan(fb)) | (a.view(view) == b.view(view))
    return a == b


# Scripts the tests start in other processes; none may outlive the test session.
_WORKER_SCRIPTS = ("launch_check.py", "mp_worker.py", "nccl_worker.py", "nccl_gpu_worker.py", "jax_cgx.launch", "emu_test")


def _stray_processes() -> list[str]:
    me = os.getpid()
    strays = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if state == "Z":
            continue
        if int(ppid) == me or any(s in cmdline for s in _WORKER_SCRIPTS):
            strays.append(f"{entry}: {cmdline.strip()[:200]}")
    return strays


def pytest_sessionfinish(session, exitstatus):
    if not os.path.isdir("/proc"):
        return
    import time

    deadline = time.monotonic() + 10
    strays = _stray_processes()
    while strays and time.monotonic() < deadline:
        time.sleep(0.2)
        strays = _stray_processes()
    if strays:
        print("\nstray processes left by the tests:\n  " + "\n  ".join(strays))
        session.exitstatus = 1
