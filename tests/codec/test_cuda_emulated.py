"""The CUDA kernels' bodies, run on the CPU under cuda/tests/emu.h, against a scalar reference.

No GPU needed, only nvcc (CI has it): this is how the CUDA code is tested on machines without a GPU.
The GPU itself runs the same comparison in cuda/tests/device_test.cu and tests/codec/test_codec_gpu.py.
"""

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_cuda_kernels_under_emulation(tmp_path):
    exe = tmp_path / "emu_test"
    build = subprocess.run(
        [
            NVCC, "-std=c++17", "-O1", "--fmad=false", "--expt-relaxed-constexpr", "-arch=sm_90",
            f"-I{ROOT}", f"-I{ROOT / 'cuda' / 'tests'}", "-Xcompiler", "-ffp-contract=off",
            str(ROOT / "cuda" / "tests" / "emu_test.cu"), "-o", str(exe),
        ],
        capture_output=True, text=True, timeout=600,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(exe), "quick"], capture_output=True, text=True, timeout=900)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    total = [line for line in output.splitlines() if line.startswith("TOTAL:")]
    assert total and total[-1].endswith(" 0 failures"), output[-4000:]
