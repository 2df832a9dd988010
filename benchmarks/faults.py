"""How each fault of a 2-process job looks, and how long it takes to surface (docs/checkpointing.md).

    python benchmarks/faults.py [--backends xla tcp] [--faults kill stop exception] [--launchers launch plain]
                                [--forms scaled direct]

Two processes (one CPU device each, gloo) run a compressed_pmean step in a loop. After 5 steps
process 1 has a fault (the step returns the collective's result directly, or computes with it first:
``--forms``): ``kill`` (SIGKILL, a dead node), ``stop`` (SIGSTOP, a hung node) or
``exception`` (an uncaught Python exception), or ``extra`` (it runs one step more than process 0,
which finishes: a collective nobody joins; the row then says how each process ended, and the
seconds run from process 0's last step to the job's end). Under ``launch`` (``python -m jax_cgx.launch``) or
``plain`` (two processes started by hand, jax.distributed set up by each), the table says what
process 0 sees: the exception type and the start of its message, or how it ended, the seconds
from the fault until then, and the launcher's report. Defaults everywhere (jax's 100 s heartbeat,
the tcp backend's 300 s timeout), as a user's job has them.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

STEP = r"""
import json, os, signal, sys, time, pathlib
import jax_cgx
rank, n, out = int(os.environ["JAX_CGX_PROCESS_ID"]), int(os.environ["JAX_CGX_NUM_PROCESSES"]), pathlib.Path(sys.argv[1])
backend, fault, form = sys.argv[2], sys.argv[3], sys.argv[4]
jax_cgx.distributed.initialize()
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((jax.device_count(),), ("d",))
if backend == "tcp":
    jax_cgx.tcp.setup(mesh)
config = jax_cgx.CompressionConfig(bits=4, backend=backend)
# "direct": the step returns the collective's result as it is; "scaled": it computes with it first.
scale = (lambda y: y) if form == "direct" else (lambda y: y * 0.5)
step = jax.jit(jax.shard_map(lambda v: scale(jax_cgx.compressed_pmean(v[0], "d", config))[None], mesh=mesh,
                             in_specs=P("d"), out_specs=P("d")))
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), np.ones((1, 1 << 20), np.float32))
try:
    for t in range(10 ** 6):
        if fault == "extra" and t == 5 + rank:  # process 1 runs one step more than process 0
            if rank == 0:
                (out / "fault").write_text(str(time.time()))
            break
        if rank == 1 and t == 5 and fault != "extra":
            (out / "fault").write_text(str(time.time()))
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            raise RuntimeError("the training step failed on process 1")
        x = step(x)
        float(np.asarray(x.addressable_shards[0].data).sum())
        time.sleep(0.05)
except Exception as err:
    if rank == 0:
        (out / "seen").write_text(json.dumps({"time": time.time(), "type": type(err).__name__,
                                              "jax": isinstance(err, jax.errors.JaxRuntimeError),
                                              "message": str(err)[:300]}))
    raise
"""


def run(backend: str, fault: str, launcher: str, limit: float, form: str = "scaled") -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp)
        script = out / "step.py"
        script.write_text(STEP)
        args = [str(script), str(out), backend, fault, form]
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
        if launcher == "launch":
            procs = [subprocess.Popen([sys.executable, "-m", "jax_cgx.launch", "-n", "2", *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
        else:
            from jax_cgx.launch import free_port
            port = free_port()
            procs = [subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=dict(env, JAX_CGX_PROCESS_ID=str(r), JAX_CGX_NUM_PROCESSES="2",
                                                          JAX_CGX_COORDINATOR=f"127.0.0.1:{port}"))
                     for r in range(2)]
        texts = []  # every output read, for the line a process ended by (extra)
        try:
            out0, err0 = procs[0].communicate(timeout=limit)
            texts += [out0, err0]
            for p in procs[1:] if fault == "extra" else ():  # the job's end: every process's
                texts += p.communicate(timeout=limit)
            ended = time.time()
            status = procs[0].returncode
        except subprocess.TimeoutExpired:
            err0, ended, status = "", None, None
        finally:
            for p in procs:
                p.kill()
                p.wait()
        fault_at = float((out / "fault").read_text()) if (out / "fault").exists() else None
        seen = json.loads((out / "seen").read_text()) if (out / "seen").exists() else None
    report = [line.split("jax_cgx.launch: ", 1)[1] for line in err0.splitlines() if line.startswith("jax_cgx.launch:")]
    if seen:
        outcome = f"{seen['type']}{' (JaxRuntimeError)' if seen['jax'] and seen['type'] != 'JaxRuntimeError' else ''}"
        at, message = seen["time"], seen["message"]
    elif status is None:
        outcome, at, message = f"still running after {limit:g} s", None, ""
    elif fault == "extra":
        named = [line for line in "\n".join(texts).splitlines() if "failed: it has waited" in line]
        outcome = ", ".join(f"process {r} exit {p.returncode}" for r, p in enumerate(procs))
        at, message = ended, named[0].split("] ", 1)[-1] if named else ""
    else:
        outcome, at, message = f"exit status {status}", ended, ""
    return {"backend": backend, "fault": fault, "launcher": launcher, "form": form, "outcome": outcome,
            "seconds": None if at is None or fault_at is None else round(at - fault_at, 1),
            "message": " ".join(message.split())[:160], "launcher_report": " / ".join(report)[:300]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", nargs="+", default=["xla", "tcp"])
    parser.add_argument("--faults", nargs="+", default=["kill", "stop", "exception", "extra"],
                        choices=["kill", "stop", "exception", "extra"])
    parser.add_argument("--launchers", nargs="+", default=["launch", "plain"])
    parser.add_argument("--forms", nargs="+", default=["scaled", "direct"], choices=["scaled", "direct"],
                        help="the step returns the collective's result scaled (computed with) or directly")
    parser.add_argument("--limit", type=float, default=400.0, help="seconds to wait for process 0's end")
    parser.add_argument("--json", type=pathlib.Path, help="also write the rows here")
    args = parser.parse_args()
    rows = []
    print("| backend | fault on process 1 | launcher | step returns | process 0 sees | s after the fault | message | "
          "launcher says |")
    print("|---|---|---|---|---|---|---|---|")
    for backend in args.backends:
        for fault in args.faults:
            for launcher in args.launchers:
                for form in args.forms:
                    if fault == "extra" and form == "direct":
                        continue  # no fault to surface in a result: one form says it
                    r = run(backend, fault, launcher, args.limit, form)
                    rows.append(r)
                    print(f"| {r['backend']} | {r['fault']} | {r['launcher']} | {r['form']} | {r['outcome']} | "
                          f"{r['seconds']} | {r['message']} | {r['launcher_report']} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
