"""Environment variables: each one is validated when jax_cgx first reads it, a bad value is an
error naming the variable, the value and what is accepted (or, for torch_cgx's documented floor
of the minimal size, an INFO line), and docs/environment.md lists every one the code reads."""

import logging
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jax_cgx
from jax_cgx import CompressionConfig
from jax_cgx._src import config, extensions
from jax_cgx._src.nccl import unique_ids
from jax_cgx.distributed import detect

ROOT = pathlib.Path(__file__).resolve().parents[1]
TREE = {"w": jax.ShapeDtypeStruct((4096,), jnp.float32)}


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    """Nothing checked or logged yet, and none of the variables set."""
    monkeypatch.setattr(config.variables, "_said", set())  # what was logged once
    for name in config.CONFIG_VARIABLES:
        monkeypatch.delenv(name, raising=False)


# --- JAX_CGX_CPU_ISA ----------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["garbage", "AVX2", " avx2", "sse"])
def test_cpu_isa_takes_only_the_variants_names(value):
    # The C++ took an unknown name for auto without a word (AVX2 ran avx512).
    with pytest.raises(ValueError, match=rf"JAX_CGX_CPU_ISA={value!r} is not a CPU kernel variant: use one of "
                                         "auto, avx512, avx2, baseline"):
        extensions.choose_isa({"JAX_CGX_CPU_ISA": value})


def test_cpu_isa_the_cpu_lacks_is_an_error(monkeypatch):
    class OldCpu:
        def set_isa(self, name):
            return name in ("auto", "avx2", "baseline")

        def kernel_info(self):
            return {"isa_supported": ["avx2", "baseline"]}

    monkeypatch.setattr(extensions, "_cpu", OldCpu())
    with pytest.raises(ValueError, match="JAX_CGX_CPU_ISA='avx512': this CPU cannot run the avx512 kernels; it runs "
                                         "avx2, baseline"):
        extensions.choose_isa({"JAX_CGX_CPU_ISA": "avx512"})
    assert extensions.choose_isa({"JAX_CGX_CPU_ISA": ""}) == "auto"


def test_cpu_isa_chosen_sets_the_kernels():
    try:
        assert extensions.choose_isa({"JAX_CGX_CPU_ISA": "baseline"}) == "baseline"
        assert extensions.cpu().kernel_info()["isa"] == "baseline"
    finally:
        extensions.choose_isa({})
    assert extensions.cpu().kernel_info()["isa"] == extensions.cpu().kernel_info()["isa_supported"][0]


def test_a_bad_cpu_isa_stops_the_import():
    run = subprocess.run([sys.executable, "-c", "import jax_cgx"], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "JAX_CGX_CPU_ISA": "AVX2"}, cwd=ROOT / "tests")
    assert run.returncode != 0
    assert "JAX_CGX_CPU_ISA='AVX2' is not a CPU kernel variant" in run.stderr


# --- the config variables, where a config is given ---------------------------------------------------

BAD = [
    ("JAX_CGX_BACKEND", "garbage", "must be auto, xla, nccl or tcp"),
    ("JAX_CGX_ALGORITHM", "tree", "must be sra or ring"),
    ("JAX_CGX_HIERARCHICAL", "yes", "must be 0 or 1"),
    ("JAX_CGX_PIPELINE_SEGMENTS", "many", "is not an integer; use 0..64"),
    ("JAX_CGX_POLICY", "sometimes", "must be always or auto"),
    ("CGX_COMPRESSION_QUANTIZATION_BITS", "four", "is not an integer; use 1..8"),
    ("CGX_COMPRESSION_BUCKET_SIZE", "0", "must be >= 1"),
    ("CGX_COMPRESSION_BUCKET_SIZE", str(2**40), "is above the largest bucket, 2147483647; use a whole number of values in 1..2147483647"),
    ("CGX_COMPRESSION_SKIP_INCOMPLETE_BUCKETS", "maybe", "must be 0 or 1"),
    ("CGX_COMPRESSION_MINIMAL_SIZE", "-1", "must be >= 0"),
    ("CGX_FUSION_BUFFER_SIZE_MB", "lots", "is not a number; use a finite number of MiB"),
    ("CGX_CROSS_COMMUNICATOR_TYPE", "UCX", "must be NCCL, MPI or SHM"),
    ("CGX_INNER_COMMUNICATOR_TYPE", "UCX", "must be NCCL, MPI or SHM"),
    ("CGX_INTRA_BROADCAST", "2", "must be 0 or 1"),
]


@pytest.mark.parametrize("name, value, says", BAD, ids=[f"{n}={v}" for n, v, _ in BAD])
def test_a_malformed_variable_raises_where_a_config_is_given(monkeypatch, name, value, says):
    # JAX_CGX_BACKEND=garbage was ignored when a config was given.
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(f"{name}={value!r}"[: len(name) + 1]) + ".*" + re.escape(says)):
        jax_cgx.bytes_on_wire(TREE, 4, CompressionConfig(bits=4))
    with pytest.raises(ValueError, match=re.escape(says)):  # and where none is
        CompressionConfig.from_env()


def test_compressed_psum_with_a_config_checks_the_environment(monkeypatch):
    monkeypatch.setenv("JAX_CGX_BACKEND", "garbage")
    mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    f = jax.shard_map(lambda x: jax_cgx.compressed_psum(x, "d", CompressionConfig(bits=4)), mesh=mesh,
                      in_specs=P("d"), out_specs=P())
    with pytest.raises(ValueError, match="JAX_CGX_BACKEND='garbage' must be auto, xla, nccl or tcp"):
        jax.jit(f).lower(jnp.ones((2, 64), jnp.float32))


def test_valid_variables_a_config_leaves_unused_are_logged_once(monkeypatch, caplog):
    monkeypatch.setenv("JAX_CGX_BACKEND", "xla")
    monkeypatch.setenv("CGX_COMPRESSION_QUANTIZATION_BITS", "8")
    with caplog.at_level(logging.INFO, logger="jax_cgx"):
        jax_cgx.bytes_on_wire(TREE, 4, CompressionConfig(bits=4))
        jax_cgx.bytes_on_wire(TREE, 4, CompressionConfig(bits=4))
    said = [r.getMessage() for r in caplog.records if "unused" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith(
        " given a config: CGX_COMPRESSION_QUANTIZATION_BITS, JAX_CGX_BACKEND set in the environment but unused "
        "(they apply where config=None)"), said


def test_a_malformed_link_rate_is_a_warning_where_the_config_never_reads_it(monkeypatch, caplog):
    # Raising there on one process would leave the others in the policy's agreement; the
    # calibration that reads it raises (tests/policy/test_policy.py).
    monkeypatch.setenv("JAX_CGX_LINK_GBPS", "fast")
    with caplog.at_level(logging.WARNING, logger="jax_cgx"):
        jax_cgx.bytes_on_wire(TREE, 4, CompressionConfig(bits=4))
    assert "JAX_CGX_LINK_GBPS='fast' is not a number" in caplog.text
    assert "elsewhere it is ignored" in caplog.text


@pytest.mark.parametrize("value", ["0", "15"])
def test_minimal_size_floor_is_logged(caplog, value):
    # CGX_COMPRESSION_MINIMAL_SIZE=0 became 16 without a word.
    with caplog.at_level(logging.INFO, logger="jax_cgx"):
        assert CompressionConfig.from_env({"CGX_COMPRESSION_MINIMAL_SIZE": value}).min_size == 16
        CompressionConfig.from_env({"CGX_COMPRESSION_MINIMAL_SIZE": value})
    said = [r.getMessage() for r in caplog.records if "MINIMAL_SIZE" in r.getMessage()]
    assert len(said) == 1 and f"CGX_COMPRESSION_MINIMAL_SIZE={value} raised to 16, torch_cgx's floor" in said[0]
    assert CompressionConfig.from_env({"CGX_COMPRESSION_MINIMAL_SIZE": "16"}).min_size == 16


# --- config=None ------------------------------------------------------------------------------------


def test_config_none_is_compression_configs_defaults_without_torch_cgx_variables(monkeypatch):
    assert config.default_config() == CompressionConfig()  # 4 bits: it compresses
    monkeypatch.setenv("JAX_CGX_ALGORITHM", "ring")  # jax_cgx's own variables apply on top of them
    monkeypatch.setenv("JAX_CGX_POLICY", "auto")
    assert config.default_config() == CompressionConfig(algorithm="ring", policy="auto")


@pytest.mark.parametrize("env, want", [
    ({"CGX_COMPRESSION_QUANTIZATION_BITS": "8", "CGX_COMPRESSION_BUCKET_SIZE": "128"},
     CompressionConfig(bits=8, bucket_size=128, min_size=16)),
    # torch_cgx's defaults come with its variables (buckets of 512, min_size 16): one set, compression
    # stays off as there.
    ({"CGX_FUSION_BUFFER_SIZE_MB": "32"}, CompressionConfig(bits=32, bucket_size=512, min_size=16, fusion_buffer_mb=32)),
    ({"CGX_CROSS_COMMUNICATOR_TYPE": "MPI", "JAX_CGX_ALGORITHM": "ring"},
     CompressionConfig(bits=32, bucket_size=512, min_size=16, backend="xla", algorithm="ring")),
], ids=["bits_and_bucket", "fusion_only", "communicator_only"])
def test_torch_cgx_variables_make_config_none_from_env(monkeypatch, env, want):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert config.default_config() == want == CompressionConfig.from_env()


def test_config_none_is_logged_once_naming_its_source(monkeypatch, caplog):
    def said():
        return [r.getMessage() for r in caplog.records if "config=None" in r.getMessage()]

    with caplog.at_level(logging.INFO, logger="jax_cgx"):
        for _ in range(2):
            jax_cgx.bytes_on_wire(TREE, 4)
            jax_cgx.explain(TREE, world=4, file=None)
    assert said() == [f"jax_cgx: bytes_on_wire with config=None uses {CompressionConfig()!r}: CompressionConfig()'s "
                      "defaults, as no torch_cgx variable (CGX_*) is set. Pass config= to choose "
                      "(CompressionConfig(bits=32): no compression)"], said()
    caplog.clear()
    monkeypatch.setenv("CGX_COMPRESSION_QUANTIZATION_BITS", "32")
    monkeypatch.setenv("JAX_CGX_BACKEND", "xla")
    with caplog.at_level(logging.INFO, logger="jax_cgx"):
        for _ in range(2):
            jax_cgx.explain(TREE, world=4, file=None)
    assert said() == [f"jax_cgx: explain with config=None uses {CompressionConfig(bits=32, bucket_size=512, min_size=16, backend='xla')!r}: "
                      "torch_cgx's variables (CompressionConfig.from_env(): CGX_COMPRESSION_QUANTIZATION_BITS=32, "
                      "JAX_CGX_BACKEND=xla). bits=32, torch_cgx's default, reduces exactly: set "
                      "CGX_COMPRESSION_QUANTIZATION_BITS (1..8), or pass config=, to compress"], said()


# --- the others ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value, says", [("soon", "is not a number of seconds; use a number > 0"),
                                         ("-1", "JAX_CGX_NCCL_TIMEOUT_S='-1': the timeout must be > 0")])
def test_nccl_timeout_names_the_variable(monkeypatch, value, says):
    monkeypatch.setenv("JAX_CGX_NCCL_TIMEOUT_S", value)
    with pytest.raises(ValueError, match=re.escape(says)):
        unique_ids.timeout(None)


@pytest.mark.parametrize("env, says", [
    ({"JAX_CGX_PROCESS_ID": "2", "JAX_CGX_NUM_PROCESSES": "2"}, "JAX_CGX_PROCESS_ID=2 must be in 0..1"),
    ({"JAX_CGX_PROCESS_ID": "0", "JAX_CGX_NUM_PROCESSES": "0"}, "JAX_CGX_NUM_PROCESSES=0 must be at least 1"),
    ({"OMPI_COMM_WORLD_RANK": "-1", "OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_RANK=-1 must be in 0..1"),
    ({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "3", "MPI_LOCALNRANKS": "2"},
     "MPI_LOCALRANKID=3 must be in 0..1"),
    ({"PMI_RANK": "0", "PMI_SIZE": "2", "JAX_COORDINATOR_ADDRESS": "node0"},
     "JAX_COORDINATOR_ADDRESS='node0' must be host:port"),
    ({"JAX_CGX_PROCESS_ID": "0", "JAX_CGX_NUM_PROCESSES": "2", "JAX_CGX_COORDINATOR": "127.0.0.1:http"},
     "JAX_CGX_COORDINATOR='127.0.0.1:http' must be host:port"),
])
def test_a_launchers_variables_out_of_range(env, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        detect(env)


# --- docs/environment.md ------------------------------------------------------------------------

_NAME = re.compile(r"[\"']((?:JAX_CGX|CGX|JAX|OMPI|PMIX?|MPI|SLURM)_[A-Z0-9_]+)[\"']")
_NOT_VARIABLES = {"JAX_CGX_ENV_VARS"}  # a constant's name in __all__


def _read_in_code() -> set[str]:
    found = set()
    for pattern in ("jax_cgx/**/*.py", "xla_ffi/**/*.cc", "xla_ffi/**/*.h", "cuda/**/*.cu", "cuda/**/*.cuh"):
        for path in ROOT.glob(pattern):
            found |= set(_NAME.findall(path.read_text()))
    return found - _NOT_VARIABLES


def test_docs_list_every_variable_the_code_reads():
    page = (ROOT / "docs" / "environment.md").read_text()
    first_cells = [line.split("|")[1] for line in page.splitlines() if line.startswith("| `")]
    rows = {name for cell in first_cells for name in re.findall(r"`([A-Z0-9_]+)`", cell)}
    missing = sorted(_read_in_code() - rows)
    assert not missing, f"docs/environment.md has no row for {missing}"
    assert {*config.CONFIG_VARIABLES, "JAX_CGX_CPU_ISA", "JAX_CGX_REUSE_ALLOCATIONS"} <= rows
