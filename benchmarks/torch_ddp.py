"""The yardstick: the same training step in PyTorch DDP, with its compression hooks, in the same processes.

``benchmarks/train_step.py --compressors ... ddp:none ddp:fp16 ddp:powersgd:2`` adds a
:class:`DdpTrainer` per ``ddp:`` spec to its round robin, so PyTorch's step runs in the same processes,
on the same link, between the same JAX steps: the ratios in one table are measured side by side.

What a PyTorch user would run, with PyTorch's defaults:

- ``torch.nn.parallel.DistributedDataParallel`` on a gloo process group on the CPU, an NCCL one when
  JAX runs on a GPU (then on ``cuda:0``, the one GPU the process sees; float32 matrix products on
  TensorFloat-32, as XLA's default precision computes them), with its default buckets, gradients
  reduced as backward produces them;
- ``ddp:none`` plain DDP (float32 all-reduce), ``ddp:fp16`` the ``fp16_compress_hook``,
  ``ddp:powersgd:RANK`` the ``powerSGD_hook``
  (error feedback and warm start on, as by default) starting at step 10 as ``powersgd_mean`` does
  (on gloo in one DDP bucket: several crash gloo, see ``DdpTrainer``);
- the model of ``--model`` (the MLP, or the character transformer written again in PyTorch:
  :class:`CharTransformer`), from the very same initial weights, on the very same batches (each
  process takes its rows of the global batch, as the JAX data-parallel step does), Adam with the same
  learning rate and cosine decay; ``torch.get_num_threads()`` is PyTorch's default, recorded.

The rendezvous goes through jax.distributed's key-value store: process 0 hosts a ``TCPStore`` on a free
port of the address jax_cgx's tcp backend would publish, and the others read its address.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

HOOKS = ("none", "fp16", "powersgd")
POWERSGD_START = 10  # powersgd_mean's default start_iter: both run uncompressed steps first
_KV_KEY = "jax_cgx/bench/torch_ddp_store"


def parse_spec(spec: str) -> tuple[str, int | None]:
    """``ddp:none`` -> ("none", None), ``ddp:powersgd:2`` -> ("powersgd", 2); anything else raises ValueError."""
    _, _, rest = spec.partition(":")
    hook, _, value = rest.partition(":")
    if hook == "bf16":  # DDP refuses it at register_comm_hook, after the process group is up
        raise ValueError(f"{spec!r}: PyTorch's bf16_compress_hook needs CUDA and NCCL; on the CPU use ddp:fp16")
    if hook not in HOOKS or (hook == "powersgd") != bool(value):
        raise ValueError(f"{spec!r} is not ddp:none, ddp:fp16 or ddp:powersgd:RANK")
    if hook != "powersgd":
        return hook, None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{spec!r}: the PowerSGD rank must be a positive integer")
    return hook, int(value)


def import_torch():
    try:
        import torch
        import torch.distributed  # noqa: F401
    except ImportError as err:
        raise SystemExit(
            "train_step: the ddp: compressors need PyTorch (the yardstick, not a jax_cgx dependency): "
            "pip install torch (a CPU build is enough)"
        ) from err
    return torch


_group = None


def on_gpu() -> bool:
    """PyTorch goes where JAX goes: the GPU (and NCCL) when JAX's devices are GPUs."""
    import jax

    return jax.devices()[0].platform == "gpu"


def process_group():
    """The process group over the JAX processes (created once, ranks = ``jax.process_index()``):
    NCCL on the GPU, gloo on the CPU."""
    global _group
    if _group is not None:
        return _group
    import jax
    import torch.distributed as dist

    rank, world = jax.process_index(), jax.process_count()
    if world == 1:
        store = dist.HashStore()
    else:
        from jax._src import distributed

        from jax_cgx.tcp import host_address

        client = distributed.global_state.client
        if rank == 0:
            store = dist.TCPStore(host_address(), 0, world, is_master=True, wait_for_workers=False)
            client.key_value_set(_KV_KEY, f"{host_address()}:{store.port}")
        else:
            host, port = client.blocking_key_value_get(_KV_KEY, 120_000).rsplit(":", 1)
            store = dist.TCPStore(host, int(port), world, is_master=False)
    if on_gpu():
        import torch

        torch.cuda.set_device(0)  # the one GPU this process sees (CUDA_VISIBLE_DEVICES)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world, device_id=torch.device("cuda", 0))
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    _group = dist.group.WORLD
    return _group


def close() -> None:
    """Destroy the process group, if one was made (every process, after its last DDP step)."""
    global _group
    if _group is not None:
        import torch.distributed as dist

        dist.destroy_process_group()
        _group = None


def _register_hook(model, hook: str, rank: int | None):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                            start_powerSGD_iter=POWERSGD_START)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def _tensor(torch, value, transpose: bool = False):
    array = np.array(value, dtype=np.float32)
    return torch.from_numpy(np.ascontiguousarray(array.T if transpose else array))


def mlp(torch, params):
    """The MLP of ``--model mlp`` from the JAX model's weights, ``[{"w": (in, out), "b"}, ...]``."""
    layers = []
    for layer in params:
        linear = torch.nn.Linear(*np.shape(layer["w"]))
        with torch.no_grad():
            linear.weight.copy_(_tensor(torch, layer["w"], transpose=True))
            linear.bias.copy_(_tensor(torch, layer["b"]))
        layers += [linear, torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def char_transformer(torch, params, heads: int):
    """examples/train_charlm.py's transformer in PyTorch, from the JAX model's weights: the same
    pre-norm blocks (causal attention, tanh-approximated GELU), operation for operation."""
    F = torch.nn.functional

    def parameters(tree: dict) -> torch.nn.ParameterDict:
        return torch.nn.ParameterDict({k: torch.nn.Parameter(_tensor(torch, v)) for k, v in tree.items()})

    class CharTransformer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Parameter(_tensor(torch, params["embed"]))
            self.pos = torch.nn.Parameter(_tensor(torch, params["pos"]))
            self.blocks = torch.nn.ModuleList(
                parameters({"ln1_scale": b["ln1"]["scale"], "ln1_bias": b["ln1"]["bias"],
                            "ln2_scale": b["ln2"]["scale"], "ln2_bias": b["ln2"]["bias"],
                            **{k: b[k] for k in ("qkv", "proj", "fc1", "fc1_b", "fc2", "fc2_b")}})
                for b in params["blocks"])
            self.ln_f = parameters(params["ln_f"])
            self.unembed = torch.nn.Parameter(_tensor(torch, params["unembed"]))

        def forward(self, tokens):
            batch, length = tokens.shape
            x = self.embed[tokens] + self.pos[:length]
            d = x.shape[-1]
            causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
            for b in self.blocks:
                h = F.layer_norm(x, (d,), b["ln1_scale"], b["ln1_bias"], eps=1e-5)
                q, k, v = (h @ b["qkv"]).reshape(batch, length, 3 * heads, d // heads).split(heads, dim=2)
                scores = torch.einsum("bthd,bshd->bhts", q, k) / (d // heads) ** 0.5
                attn = torch.softmax(scores.masked_fill(~causal, -1e9), dim=-1)
                x = x + torch.einsum("bhts,bshd->bthd", attn, v).reshape(batch, length, d) @ b["proj"]
                h = F.layer_norm(x, (d,), b["ln2_scale"], b["ln2_bias"], eps=1e-5)
                x = x + F.gelu(h @ b["fc1"] + b["fc1_b"], approximate="tanh") @ b["fc2"] + b["fc2_b"]
            return F.layer_norm(x, (d,), self.ln_f["scale"], self.ln_f["bias"], eps=1e-5) @ self.unembed

    return CharTransformer()


class DdpTrainer:
    """One DDP configuration, a step at a time: the interface of train_step.py's ``Trainer``
    (``step``, ``times``, ``losses``, ``facts``)."""

    def __init__(self, spec: str, model, args: argparse.Namespace, lr: float):
        self.hook, self.rank = parse_spec(spec)
        torch = import_torch()
        import jax
        import torch.nn.functional as F
        from torch.nn.parallel import DistributedDataParallel

        self.spec, self.model, self.args, self.torch, self.F = spec, model, args, torch, F
        self.world, self.index = jax.process_count(), jax.process_index()
        self.batch_size = args.batch_per_device * jax.device_count()
        group = process_group()
        self.gpu = on_gpu()
        self.device = torch.device("cuda", 0) if self.gpu else torch.device("cpu")
        if self.gpu:  # XLA's default precision multiplies float32 matrices on TensorFloat-32 too
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        params = jax.device_get(model.init())
        if args.model == "mlp":
            net, self.loss = mlp(torch, params), lambda out, y: F.cross_entropy(out, y)
        else:
            net = char_transformer(torch, params, model.heads)
            self.loss = lambda out, y: F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        net = net.to(self.device)
        self.parameters = sum(p.numel() for p in net.parameters())
        # PowerSGD on gloo needs a single bucket: with several, each bucket's hook issues its Q
        # all-reduce from a callback of its P all-reduce, and the ranks can issue them in different
        # orders (seen: gloo aborts with "Received data size doesn't match expected size" at the first
        # compressed step). Other hooks, and every hook on NCCL, keep DDP's default buckets (a small
        # first one, then 25 MB: passing bucket_cap_mb=25 would make the first bucket 25 MB too).
        one_bucket = self.hook == "powersgd" and not self.gpu
        buckets = dict(bucket_cap_mb=4 * self.parameters / 2**20 + 1) if one_bucket else {}
        self.net = DistributedDataParallel(net, process_group=group, **buckets)
        self.one_bucket = one_bucket
        self.group = group
        _register_hook(self.net, self.hook, self.rank)
        self.wire = self._wire_bytes(params)
        self.optimizer = torch.optim.Adam(net.parameters(), lr=lr)
        steps = args.steps
        # optax.cosine_decay_schedule(lr, steps): lr * (1 + cos(pi * min(t, steps) / steps)) / 2
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda t: 0.5 * (1 + np.cos(np.pi * min(t, steps) / steps)))
        self.rng = np.random.default_rng(0)  # the same batches as every JAX trainer
        self.times, self.losses = [], []

    def _inputs(self):
        """This process's rows of the global batch, on the device: (input, target)."""
        batch = self.model.batch(self.rng, self.batch_size)
        rows = slice(self.index * len(batch[0]) // self.world, (self.index + 1) * len(batch[0]) // self.world)
        if self.args.model == "mlp":
            x, y = batch
            x, y = self.torch.from_numpy(x[rows]), self.torch.from_numpy(y[rows]).long()
        else:
            tokens = self.torch.from_numpy(batch[0][rows]).long()
            x, y = tokens[:, :-1], tokens[:, 1:]
        return x.to(self.device), y.to(self.device)

    def step(self) -> None:
        x, y = self._inputs()
        if self.gpu:
            self.torch.cuda.synchronize()  # the batch is in place before the clock starts, as JAX's is
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(self.net(x), y)
        loss.backward()  # DDP's all-reduces run during backward and are waited for before it returns
        self.optimizer.step()
        self.schedule.step()
        if self.gpu:
            self.torch.cuda.synchronize()  # the step has run, not just been queued (JAX's: block_until_ready)
        self.times.append(time.perf_counter() - t0)
        # The mean over the processes, as the JAX step reports it (outside the timed step).
        loss = loss.detach()
        self.torch.distributed.all_reduce(loss, group=self.group)
        self.losses.append(loss.item() / self.world)

    def describe(self) -> str:
        name = {"none": "plain (float32)", "fp16": "fp16_compress_hook",
                "powersgd": f"PowerSGD rank {self.rank}{', one bucket' if self.one_bucket else ''}"}[self.hook]
        return f"PyTorch DDP {name}"

    def _wire_bytes(self, params) -> int:
        """Bytes one process sends per step, counted as train_step counts jax_cgx's: DDP's plain,
        fp16 and PowerSGD all-reduces move what pmean, cast_mean and powersgd_mean move."""
        import _common  # examples/, on the path train_step.py sets

        like = {"none": "none", "fp16": "cast", "powersgd": "powersgd"}[self.hook]
        return int(_common.wire_bytes(argparse.Namespace(compressor=like, rank=self.rank), params, self.world))

    def facts(self) -> dict:
        """What train_step's record says of this trainer besides its step times."""
        return dict(compressor=self.spec, description=self.describe(), devices=self.world,
                    platform=(f"gpu (torch {self.torch.__version__}, NCCL "
                              f"{'.'.join(map(str, self.torch.cuda.nccl.version()))}, TF32)" if self.gpu else
                              f"cpu (torch {self.torch.__version__}, {self.torch.get_num_threads()} threads)"),
                    parameters=self.parameters, steps=self.args.steps, batch=self.batch_size,
                    wire_bytes=self.wire)
