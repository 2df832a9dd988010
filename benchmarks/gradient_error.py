"""What each compression setting does to a transformer's averaged gradient (docs/flax.md).

    python benchmarks/gradient_error.py [--steps 5] [--devices 8]

An lm1b-shaped transformer (pre-LN, 2 blocks, width 128, vocabulary 256, learned positions,
LayerNorm scales and biases; 0.47 M parameters), a token-weighted cross-entropy over padded rows;
each device's own gradient on its rows of a batch (8 simulated devices, 4 rows of 64 tokens
each). For each setting, the compressed mean against the exact mean, the median over ``--steps``
batches of the parameters as they train (Adam, uncompressed): the relative error of the mean
(``|c - m| / |m|``), the ratio of global norms (``|c| / |m|``: what a clip-by-global-norm after the
mean sees), the worst LayerNorm leaf's relative error, and the bytes one device sends per step.
"""

from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__" and "--devices" in sys.argv:
    n = sys.argv[sys.argv.index("--devices") + 1]
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n}"
elif __name__ == "__main__":
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_cgx  # noqa: E402
import jax_cgx.optax as cgx_optax  # noqa: E402

VOCAB, DIM, LENGTH, BLOCKS, ROWS_PER_DEVICE = 256, 128, 64, 2, 4


def init(key):
    keys = iter(jax.random.split(key, 4 + 6 * BLOCKS))
    n = lambda shape, scale: jax.random.normal(next(keys), shape) * scale  # noqa: E731
    params = {"embed": n((VOCAB, DIM), 1.0), "pos": n((LENGTH, DIM), 0.02),
              "final": {"scale": jnp.ones(DIM), "bias": jnp.zeros(DIM)}, "head": n((DIM, VOCAB), DIM ** -0.5)}
    for b in range(BLOCKS):
        params[f"block{b}"] = {
            "ln1": {"scale": jnp.ones(DIM), "bias": jnp.zeros(DIM)}, "ln2": {"scale": jnp.ones(DIM), "bias": jnp.zeros(DIM)},
            "qkv": n((DIM, 3 * DIM), DIM ** -0.5), "out": n((DIM, DIM), DIM ** -0.5),
            "up": n((DIM, 4 * DIM), DIM ** -0.5), "up_bias": jnp.zeros(4 * DIM),
            "down": n((4 * DIM, DIM), (4 * DIM) ** -0.5), "down_bias": jnp.zeros(DIM)}
    return params


def _norm(x, p):
    return p["scale"] * (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-6) + p["bias"]


def loss_sum(params, tokens, targets, weights):
    h = params["embed"][tokens] + params["pos"][None, : tokens.shape[1]]
    causal = jnp.tril(jnp.ones((tokens.shape[1], tokens.shape[1]), bool))
    for b in range(BLOCKS):
        p = params[f"block{b}"]
        q, k, v = jnp.split(_norm(h, p["ln1"]) @ p["qkv"], 3, axis=-1)
        attn = jax.nn.softmax(jnp.where(causal, q @ k.swapaxes(1, 2) / np.sqrt(DIM), -1e9), axis=-1)
        h = h + (attn @ v) @ p["out"]
        h = h + jax.nn.gelu(_norm(h, p["ln2"]) @ p["up"] + p["up_bias"]) @ p["down"] + p["down_bias"]
    logits = _norm(h, params["final"]) @ params["head"]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(losses * weights), jnp.sum(weights)


def batch(step: int, devices: int):
    rng = np.random.default_rng(step)
    rows = devices * ROWS_PER_DEVICE
    # Text-like tokens: a Zipf-ish unigram distribution, so the embedding's rows are hit unevenly.
    tokens = np.minimum(rng.zipf(1.3, (rows, LENGTH)) - 1, VOCAB - 1)
    lengths = rng.integers(LENGTH // 4, LENGTH + 1, rows)
    weights = (np.arange(LENGTH)[None, :] < lengths[:, None]).astype(np.float32)
    return tokens, np.roll(tokens, -1, axis=1), weights


SETTINGS = {  # name -> (config for compressed_pmean as a function of bits, what it is)
    "every leaf, buckets of 512": lambda bits: jax_cgx.CompressionConfig(bits=bits, bucket_size=512),
    "every leaf, buckets of 128": lambda bits: jax_cgx.CompressionConfig(bits=bits, bucket_size=128),
    "filter < 1024 values, buckets of 512": lambda bits: cgx_optax.layer_filter(
        jax_cgx.CompressionConfig(bits=bits, bucket_size=512), 1024),
    "filter < 1024 values, buckets of 128": lambda bits: cgx_optax.layer_filter(
        jax_cgx.CompressionConfig(bits=bits, bucket_size=128), 1024),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--bits", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args()
    devices = jax.device_count()
    mesh = jax.make_mesh((devices,), ("data",))
    params = init(jax.random.key(0))
    optimizer = optax.adam(1e-3)
    opt_state = optimizer.init(params)

    def per_device(params, tokens, targets, weights):
        """Each device's own gradient of its loss sum scaled by W / all weights (the helper's weighting)."""
        shape = (devices, ROWS_PER_DEVICE) + tokens.shape[1:]
        total = jnp.sum(weights)
        return jax.vmap(lambda t, y, w: jax.grad(lambda p: loss_sum(p, t, y, w)[0] * devices / total)(params))(
            tokens.reshape(shape), targets.reshape(shape), weights.reshape(shape))

    per_device = jax.jit(per_device)
    reduce = {}
    for name, make in SETTINGS.items():
        for bits in args.bits:
            config = make(bits)
            reduce[name, bits] = jax.jit(jax.shard_map(
                lambda g, config=config: jax.tree.map(lambda v: v[None], jax_cgx.compressed_pmean(
                    jax.tree.map(lambda v: v[0], g), "data", config)), mesh=mesh, in_specs=P("data"),
                out_specs=P("data")))
    results = {key: [] for key in reduce}
    for step in range(args.steps):
        grads = jax.device_put(per_device(params, *batch(step, devices)), NamedSharding(mesh, P("data")))
        exact = jax.tree.map(lambda g: np.asarray(g, np.float64).mean(0), grads)
        flat_exact = np.concatenate([v.ravel() for v in jax.tree.leaves(exact)])
        norms = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(exact)[0]}
        for key, fn in reduce.items():
            out = jax.tree.map(lambda v: np.asarray(v, np.float64)[0], fn(grads))
            flat = np.concatenate([v.ravel() for v in jax.tree.leaves(out)])
            ln = max(np.linalg.norm(v - norms[jax.tree_util.keystr(p)]) / max(np.linalg.norm(norms[jax.tree_util.keystr(p)]), 1e-30)
                     for p, v in jax.tree_util.tree_flatten_with_path(out)[0] if "ln" in jax.tree_util.keystr(p)
                     or "final" in jax.tree_util.keystr(p))
            results[key].append((np.linalg.norm(flat - flat_exact) / np.linalg.norm(flat_exact),
                                 np.linalg.norm(flat) / np.linalg.norm(flat_exact), ln))
        updates, opt_state = optimizer.update(jax.tree.map(jnp.asarray, exact), opt_state, params)
        params = optax.apply_updates(params, updates)
    like = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), params)
    exact_bytes = jax_cgx.bytes_on_wire(like, devices, jax_cgx.CompressionConfig(bits=32))
    count = sum(v.size for v in jax.tree.leaves(params))
    print(f"{count / 1e6:.2f} M parameters, {devices} devices, median of {args.steps} steps; float32 mean: "
          f"{exact_bytes / 2**20:.3f} MiB sent per device")
    print("| setting | bits | rel. error of the mean | global norm ratio | worst LayerNorm leaf's rel. error | MiB sent |")
    print("|---|---|---|---|---|---|")
    for (name, bits), rows in results.items():
        err, ratio, ln = np.median(np.array(rows), axis=0)
        sent = jax_cgx.bytes_on_wire(like, devices, SETTINGS[name](bits)) / 2**20
        print(f"| {name} | {bits} | {err:.4f} | {ratio:.3f} | {ln:.4f} | {sent:.3f} |")


if __name__ == "__main__":
    main()
