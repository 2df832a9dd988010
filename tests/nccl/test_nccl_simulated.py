"""The nccl backend's handler on simulated ranks and streams (cuda/tests/nccl_sim.cc): no GPU needed.

Needs g++, the CUDA runtime headers (nvcc's toolkit) and nccl.h (NCCL_HOME, or the
nvidia-nccl-cu13 wheel); CI has all three.
"""

import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _nccl_include() -> str | None:
    if os.environ.get("NCCL_HOME"):
        return os.path.join(os.environ["NCCL_HOME"], "include")
    try:
        import nvidia.nccl

        return os.path.join(list(nvidia.nccl.__path__)[0], "include")
    except ImportError:
        return None


def _cuda_include() -> str | None:
    nvcc = shutil.which("nvcc")
    candidates = [os.path.join(os.environ[v], "include") for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    if nvcc:
        candidates.append(str(pathlib.Path(nvcc).resolve().parent.parent / "include"))
    candidates.append("/usr/local/cuda/include")
    return next((c for c in candidates if os.path.exists(os.path.join(c, "cuda_runtime_api.h"))), None)


@pytest.mark.slow
def test_handler_under_simulated_ranks(tmp_path):
    import jaxlib

    nccl, cuda, gxx = _nccl_include(), _cuda_include(), shutil.which("g++")
    if not (nccl and os.path.exists(os.path.join(nccl, "nccl.h")) and cuda and gxx):
        pytest.skip("needs g++, the CUDA toolkit headers and nccl.h")
    exe = tmp_path / "nccl_sim"
    ffi = pathlib.Path(jaxlib.__file__).parent / "include"
    build = subprocess.run(
        [gxx, "-std=c++17", "-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
         f"-I{ROOT}", f"-I{nccl}", f"-I{cuda}", "-isystem", str(ffi),
         str(ROOT / "cuda" / "tests" / "nccl_sim.cc"), "-o", str(exe)],
        capture_output=True, text=True, timeout=600,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(exe), "1500"], capture_output=True, text=True, timeout=600)
    output = run.stdout + run.stderr
    assert run.returncode == 0 and "ok: 0 failures" in output, output[-4000:]
