"""jax_cgx/bench/profile.py: XLA:CPU's operations sorted into phases, from a real trace."""

import jax
import jax.numpy as jnp
import pytest

import jax_cgx
from jax_cgx.bench.profile import PHASES, phase, summarize


@pytest.mark.parametrize("name, expected", [
    ("jax_cgx_quantize.3", "codec"), ("jax_cgx_dequantize_sum_requantize.19", "codec"),
    ("all-to-all.17", "wire"), ("all_gather.143", "wire"), ("all-reduce", "wire"),
    ("collective-permute.2", "wire"), ("copy.96", "copies"), ("bitcast_pad_fusion", "copies"),
    ("concatenate_slice_fusion", "copies"), ("wrapped_concatenate", "copies"), ("dot.2", "compute"),
    ("ynn_fusion.4", "compute"), ("multiply_add_fusion.6", "compute"),
    ("ThunkExecutor::Execute", None), ("PjitFunction(<lambda>)", None), ("$profiler.py:307 trace", None),
])
def test_phase_of_an_event(name, expected):
    assert phase(name) == expected


def test_summarize_a_real_trace(tmp_path):
    config = jax_cgx.CompressionConfig(bits=4, min_size=16)
    f = jax.jit(lambda x: jax_cgx.dequantize(jax_cgx.quantize(x * 2, config)).reshape(1024, -1) @ x.reshape(1024, -1).T)
    x = jnp.ones((1 << 20,), jnp.float32)
    f(x).block_until_ready()
    with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
        f(x).block_until_ready()
    phases = summarize(tmp_path)
    assert set(phases) == {*PHASES, "ops"}
    assert phases["codec"] > 0 and phases["compute"] > 0
    assert phases["ops"] == pytest.approx(sum(phases[k] for k in PHASES))


def test_no_trace_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no perfetto_trace.json.gz under .*create_perfetto_trace=True"):
        summarize(tmp_path)
