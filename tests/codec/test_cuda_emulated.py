"""The CUDA kernels' bodies, run on the CPU under cuda/tests/emu.h, against a scalar reference and
against tests/support/numpy_oracle.py.

No GPU needed, only nvcc (CI has it): this is how the CUDA code is tested on machines without a GPU.
The GPU itself runs the same comparison in cuda/tests/device_test.cu and tests/codec/test_codec_gpu.py.
The scalar reference (cuda/tests/ref.h) includes xla_ffi/codec_math.h, the code under test; the
NumPy oracle, written from docs/format.md alone, shares nothing with it: `emu_test dump DIR` writes
a few cases of the kernel bodies (inputs, seeds, outputs) for it.
"""

import pathlib
import re
import shutil
import subprocess

import ml_dtypes
import numpy as np
import numpy_oracle as oracle
import pytest
from bitwise import assert_same_bits

ROOT = pathlib.Path(__file__).resolve().parents[2]
NVCC = shutil.which("nvcc")
DTYPES = {"f32": np.dtype(np.float32), "bf16": np.dtype(ml_dtypes.bfloat16), "f16": np.dtype(np.float16)}


@pytest.fixture(scope="module")
def emu_test(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc not found")
    exe = tmp_path_factory.mktemp("emu") / "emu_test"
    build = subprocess.run(
        [
            NVCC, "-std=c++17", "-O1", "--fmad=false", "--expt-relaxed-constexpr", "-arch=sm_90",
            f"-I{ROOT}", f"-I{ROOT / 'cuda' / 'tests'}", "-Xcompiler", "-ffp-contract=off",
            str(ROOT / "cuda" / "tests" / "emu_test.cu"), "-o", str(exe),
        ],
        capture_output=True, text=True, timeout=600,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    return exe


@pytest.mark.slow
def test_cuda_kernels_under_emulation(emu_test):
    run = subprocess.run([str(emu_test), "quick"], capture_output=True, text=True, timeout=900)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    total = [line for line in output.splitlines() if line.startswith("TOTAL:")]
    assert total and total[-1].endswith(" 0 failures"), output[-4000:]
    # "0 failures" of 0 checks would pass too: the checks must have run. The quick run made
    # 1,287,791 unit checks and 3,000 more over its bucket loop (this file's writing).
    counts = {m[1]: int(m[2]) for m in re.finditer(r"^(units|TOTAL): (\d+) checks, 0 failures$", output, re.M)}
    assert counts.get("units", 0) >= 1_000_000, f"too few unit checks ran: {counts}\n{output[-4000:]}"
    assert counts["TOTAL"] - counts["units"] >= 2_500, f"too few kernel checks ran: {counts}\n{output[-4000:]}"
    assert all(f"B={b} done" in output for b in (1, 3, 8, 13, 64, 100, 257, 1000, 1500)), output[-4000:]


def test_cuda_kernels_under_emulation_equal_the_numpy_oracle(emu_test, tmp_path):
    """quantize and dequantize_sum_requantize (valid counts, NaN/inf/wide buckets, every width, buckets
    3/64/512, f32/bf16/f16): the CUDA kernel bodies' bytes are the oracle's."""
    run = subprocess.run([str(emu_test), "dump", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    cases = (tmp_path / "cases.txt").read_text().splitlines()
    assert len(cases) == 40

    def load(k, name, dtype, shape):
        return np.fromfile(tmp_path / f"case{k}_{name}.bin", dtype=dtype).reshape(shape)

    for line in cases:
        k, kind, *rest = line.split()
        if kind == "quantize":
            dtype, r, n, b, bits, stochastic = rest
            r, n, b, bits, stochastic = int(r), int(n), int(b), int(bits), bool(int(stochastic))
            nb, p = -(-n // b), oracle.payload_bytes(n, b, bits)
            x = load(k, "x", DTYPES[dtype], (r, n))
            payload, meta = oracle.quantize_rows(x, load(k, "seeds", np.uint32, (r, 2)), bits=bits, bucket_size=b,
                                                 stochastic=stochastic, valid=load(k, "valid", np.int32, (r,)))
            assert_same_bits(load(k, "meta", np.float32, (r, nb, 2)), meta, f"{line}: meta")
            assert_same_bits(load(k, "payload", np.uint8, (r, p)), payload, f"{line}: payload")
        else:
            adtype, odtype, r, w, m, b, bits, stochastic = rest
            r, w, m, b, bits, stochastic = int(r), int(w), int(m), int(b), int(bits), bool(int(stochastic))
            nb, p = -(-m // b), oracle.payload_bytes(m, b, bits)
            payload, meta, out = oracle.dequantize_sum_requantize_rows(
                load(k, "in_payload", np.uint8, (r, w, p)), load(k, "in_meta", np.float32, (r, w, nb, 2)),
                load(k, "addend", DTYPES[adtype], (r, m)), load(k, "seeds", np.uint32, (r, 2)), bits=bits,
                bucket_size=b, stochastic=stochastic, m=m, dtype=DTYPES[odtype],
                valid=load(k, "valid", np.int32, (r,)))
            assert_same_bits(load(k, "meta", np.float32, (r, nb, 2)), meta, f"{line}: meta")
            assert_same_bits(load(k, "payload", np.uint8, (r, p)), payload, f"{line}: payload")
            assert_same_bits(load(k, "out", DTYPES[odtype], (r, m)), out, f"{line}: decoded")
