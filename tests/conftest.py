"""Test setup: 8 virtual CPU devices, skipping of `gpu` tests where no GPU is present, and
tests/support (shared cases, bitwise comparison, worker scripts) on sys.path.

The folders mirror the package's jax_cgx/_src (adaptive/, backends/, codec/, collectives/, config/,
data_parallel/, exchange/, nccl/, optax/, policy/, tcp/), beside runtime/, engines/ and bench/;
test file names stay unique across them (pytest's default import mode needs that).
"""

import os
import pathlib
import sys

# Must happen before jax initializes its backends.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers (pyproject.toml's addopts) may share one GPU: neither takes 75% of its memory up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import pytest  # noqa: E402

SUPPORT = pathlib.Path(__file__).resolve().parent / "support"
sys.path.insert(0, str(SUPPORT))

# JAX_CGX_TEST_INSTALLED=1: the tests are run against an installed wheel (.ci/run), never the checkout.
if os.environ.get("JAX_CGX_TEST_INSTALLED") == "1":
    import jax_cgx  # noqa: E402

    _checkout = pathlib.Path(__file__).resolve().parent.parent / "jax_cgx"
    if pathlib.Path(jax_cgx.__file__).resolve().parent == _checkout:
        raise RuntimeError(f"JAX_CGX_TEST_INSTALLED=1 but jax_cgx was imported from the checkout ({_checkout}): "
                           "run pytest (not python -m pytest) from an environment with the wheel installed")


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


@pytest.fixture
def fresh_policy():
    """jax_cgx._src.policy.pricing with no measured figure and no logged decision, before the test and
    after it (pricing.reset); the fixture's value is the module."""
    from jax_cgx._src.policy import pricing

    pricing.reset()
    yield pricing
    pricing.reset()


def pytest_collection_modifyitems(config, items):
    # Modules with `slow` tests (30 s or more) run first: pytest-xdist's workers then end on short
    # tests, instead of one waiting while the other finishes a long one. Whole modules move, so
    # module-scoped fixtures (a compiled emulator, a baseline training run) are still made once.
    modules = {}
    for item in items:
        modules.setdefault(item.module, []).append(item)
    order = sorted(modules.values(), key=lambda group: not any(i.get_closest_marker("slow") for i in group))
    items[:] = [item for group in order for item in group]
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# What the tests start in other processes; none may outlive the test session: any script of
# tests/support (the worker scripts are there), the launcher, the CUDA emulator's binaries, the
# local SLURM's and Ray's daemons.
_WORKER_SCRIPTS = frozenset({*(p.name for p in SUPPORT.glob("*.py")),
                              "jax_cgx.launch", "emu_test", "slurmctld", "slurmd", "munged", "raylet", "gcs_server"})


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
        if int(ppid) == me or any(os.path.basename(word) in _WORKER_SCRIPTS for word in cmdline.split()):
            strays.append(f"{entry}: {cmdline.strip()[:200]}")
    return strays


def pytest_sessionfinish(session, exitstatus):
    # Under pytest-xdist the other workers' processes are still running when one worker ends:
    # only the controller, which ends after every worker, looks for strays.
    if not os.path.isdir("/proc") or os.environ.get("PYTEST_XDIST_WORKER"):
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
