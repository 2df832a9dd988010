"""The all-reduce benchmark across N processes, each in its own network namespace, over shaped links.

    sudo python benchmarks/netem/run.py --processes 2 --rate 1gbit
    sudo python benchmarks/netem/run.py --processes 4 --rate 10gbit -- --sizes-mib 16 64 --bits 2 4 8 -n 5
    sudo python benchmarks/netem/run.py -p 2 --rate 10gbit --gpu --script benchmarks/train_step.py -- --link-gbps 10
    sudo python benchmarks/netem/run.py --nodes 2 --per-node 2 --rate 1gbit -- --two-level --sizes-mib 64 --bits 4
    sudo python benchmarks/netem/run.py --processes 2 --rate unlimited --dry-run   # print the plan only
    sudo python benchmarks/netem/run.py --cleanup                                  # leftovers of crashed runs

The network: namespace ``cgx<TAG>-br`` holds a bridge ``br0``; namespace ``cgx<TAG>-<i>`` (one per
process, ``TAG`` is this launcher's pid) holds ``eth0`` with 10.77.0.<i+1>/24, one end of a veth
pair whose other end (``p<i>``) is a port of the bridge: a switch with one port per host. With a
rate, ``tc qdisc ... tbf`` shapes both ends of every pair (``eth0``: what the host sends, ``p<i>``:
what it receives), so each host's link carries RATE in each direction, like a NIC on a switch.
Nothing is added to the root namespace but ``/etc/netns/<namespace>/hosts``.

Nodes (``--nodes N --per-node M``): the namespace is a node's, ``cgx<TAG>-<k>`` for node ``k`` with
10.77.0.<k+1>, and its M processes share it: they reach each other over its own address, unshaped,
as processes of one machine do, and only the links between nodes are shaped. Each process gets
``JAX_CGX_LOCAL_RANK`` (its index in the node) and ``JAX_CGX_LOCAL_COUNT=M``; ``--two-level`` makes
the all-reduce benchmark build the ``("node", "local")`` mesh from them. ``-p N`` is ``--nodes N
--per-node 1``.

Process i runs ``benchmarks/allreduce.py`` (or ``--script``) in namespace i, with the hostname
``cgx<TAG>-<i>`` (its own UTS namespace) resolving to its address: gloo binds to the address
gethostname() resolves to. It gets jax_cgx.launch's variables (``JAX_CGX_PROCESS_ID``,
``JAX_CGX_NUM_PROCESSES``, ``JAX_CGX_LOCAL_RANK=0``, ``JAX_CGX_LOCAL_COUNT=1``,
``JAX_CGX_COORDINATOR=10.77.0.1:PORT``) and one CPU device; with ``--gpu``, GPU 0 instead, every
process on the same one, with NCCL told to use the namespace's ``eth0`` by sockets alone (each process
its own ``NCCL_HOSTID``: no P2P or shared memory between them), so XLA's, jax_cgx's and PyTorch's NCCL
traffic all crosses the shaped link. Arguments after ``--`` go to the
benchmark (default ``--sizes-mib 64 --bits 4 8 -n 5``); rank 0 writes the JSON results (``--output``
among them, else ``benchmarks/netem/results/``), and this launcher adds the link settings to every
record and prints the file's path.

Everything is torn down (processes, namespaces, with them the bridge and the veths, and the
/etc/netns entries) when the run ends, fails, or gets SIGINT/SIGTERM/SIGHUP. If the launcher
itself is SIGKILLed, its processes die with it (PR_SET_PDEATHSIG) and ``--cleanup`` removes the
namespaces it left. Needs root, ``ip`` and ``unshare`` (and ``tc`` with a rate): exit code 2 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from jax_cgx.bench.rates import UNLIMITED, tc_rate_bits
from jax_cgx.launch import ProcessGroup, describe_status, exit_code

REPO = Path(__file__).resolve().parents[2]
DEFAULT_SCRIPT = REPO / "benchmarks" / "allreduce.py"
DEFAULT_RESULTS = REPO / "benchmarks" / "netem" / "results"
DEFAULT_BENCH_ARGS = ["--sizes-mib", "64", "--bits", "4", "8", "-n", "5"]
SUBNET = "10.77.0"
NETNS_ETC = Path("/etc/netns")
NAME_RE = re.compile(r"^cgx(\d+)-(br|\d+)$")  # every namespace (and /etc/netns entry) we create

# In the new UTS namespace: take the hostname, then become the benchmark process.
_SET_HOSTNAME = "import os, socket, sys; socket.sethostname(sys.argv[1]); os.execv(sys.argv[2], sys.argv[2:])"

# tc's rate syntax, parsed as the cost model parses it: bits per second, None for no limit.
parse_rate = tc_rate_bits


def _rate_arg(text: str) -> str:
    parse_rate(text)  # validate
    t = text.strip().lower()
    return "unlimited" if t in UNLIMITED else t.replace(" ", "")


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything a run does, as data: namespaces, commands, files, environments (built without root)."""

    processes: int  # in all: nodes x per_node
    rate: str = "unlimited"  # a tc rate, or "unlimited"
    mtu: int = 1500
    burst: str | None = None  # tbf burst; default: 2 ms at the rate, at least 64 KiB
    latency: str = "50ms"  # tbf latency (how long a packet may wait in the queue)
    port: int = 12321
    gpu: bool = False  # every process on GPU 0, NCCL over the namespaces' links (see environment)
    tag: str = dataclasses.field(default_factory=lambda: str(os.getpid()))
    per_node: int = 1  # processes sharing a node's namespace (its unshaped inside)

    def __post_init__(self):
        if not 1 <= self.processes <= 250:
            raise ValueError("processes must be between 1 and 250")
        if self.per_node < 1 or self.processes % self.per_node:
            raise ValueError(f"{self.processes} processes are not whole nodes of {self.per_node}")
        if not 68 <= self.mtu <= 65535:
            raise ValueError("mtu must be between 68 and 65535")
        if not self.tag.isdigit():
            raise ValueError("tag must be digits (the launcher's pid)")

    # -- names -----------------------------------------------------------------------------
    @property
    def bridge_ns(self) -> str:
        return f"cgx{self.tag}-br"

    @property
    def nodes(self) -> int:
        return self.processes // self.per_node

    def node(self, rank: int) -> int:
        return rank // self.per_node

    def ns(self, rank: int) -> str:
        """The namespace of process ``rank`` (its node's)."""
        return f"cgx{self.tag}-{self.node(rank)}"

    def hostname(self, rank: int) -> str:
        return self.ns(rank)

    def address(self, rank: int) -> str:
        return f"{SUBNET}.{self.node(rank) + 1}"

    def first(self, node: int) -> int:
        """The first process of ``node`` (names a node by one of its processes)."""
        return node * self.per_node

    @property
    def namespaces(self) -> list[str]:
        """Every namespace of the run, the bridge's last (deleted last)."""
        return [self.ns(self.first(k)) for k in range(self.nodes)] + [self.bridge_ns]

    @property
    def coordinator(self) -> str:
        return f"{self.address(0)}:{self.port}"

    @property
    def rate_bps(self) -> float | None:
        return parse_rate(self.rate)

    @property
    def tbf_burst(self) -> str:
        if self.burst:
            return self.burst
        # 2 ms of traffic at the rate; at least one 64 KiB GSO packet and a few MTUs.
        return f"{max(int(self.rate_bps / 8 * 0.002), 65536, 4 * self.mtu)}b"

    # -- commands --------------------------------------------------------------------------
    def tbf(self, ns: str, dev: str) -> list[str]:
        return ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf",
                "rate", self.rate, "burst", self.tbf_burst, "latency", self.latency]

    def setup_commands(self) -> list[list[str]]:
        """The ip/tc commands that build the network, in order."""
        b = self.bridge_ns
        cmds = [
            ["ip", "netns", "add", b],
            ["ip", "-n", b, "link", "set", "lo", "up"],
            ["ip", "-n", b, "link", "add", "br0", "type", "bridge"],
            ["ip", "-n", b, "link", "set", "br0", "up"],
        ]
        for k in range(self.nodes):
            i = self.first(k)
            ns, port = self.ns(i), f"p{k}"
            cmds += [
                ["ip", "netns", "add", ns],
                ["ip", "-n", ns, "link", "set", "lo", "up"],
                ["ip", "-n", b, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns],
                ["ip", "-n", b, "link", "set", port, "mtu", str(self.mtu), "master", "br0", "up"],
                ["ip", "-n", ns, "link", "set", "eth0", "mtu", str(self.mtu), "up"],
                ["ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0"],
            ]
            if self.rate_bps is not None:
                cmds += [self.tbf(ns, "eth0"), self.tbf(b, port)]  # what host i sends / receives
        return cmds

    def teardown_commands(self) -> list[list[str]]:
        """Deleting the namespaces deletes the bridge and the veths in them."""
        return [["ip", "netns", "delete", ns] for ns in self.namespaces]

    def files(self) -> dict[Path, str]:
        """/etc/netns/<ns>/hosts: `ip netns exec` binds it over /etc/hosts inside the namespace."""
        firsts = [self.first(k) for k in range(self.nodes)]
        peers = "".join(f"{self.address(j)}\t{self.hostname(j)}\n" for j in firsts)
        return {
            NETNS_ETC / self.ns(i) / "hosts": f"127.0.0.1\tlocalhost\n::1\tlocalhost\n{peers}"
            for i in firsts
        }

    def environment(self, rank: int, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
        env.update(
            JAX_CGX_PROCESS_ID=str(rank),
            JAX_CGX_NUM_PROCESSES=str(self.processes),
            JAX_CGX_LOCAL_RANK=str(rank % self.per_node),
            JAX_CGX_LOCAL_COUNT=str(self.per_node),
            JAX_CGX_COORDINATOR=self.coordinator,
            XLA_FLAGS=" ".join([*flags, "--xla_force_host_platform_device_count=1"]),
            PYTHONUNBUFFERED="1",
        )
        if not self.gpu:
            env.setdefault("JAX_PLATFORMS", "cpu")
            return env
        # Every process on the one GPU, and every NCCL byte (XLA's collectives, jax_cgx's, PyTorch's)
        # over this run's link: each process its own NCCL host (a host id of its own, so NCCL neither
        # refuses two ranks on one GPU nor joins them by P2P or shared memory), sockets on eth0.
        env.update(
            JAX_PLATFORMS="cuda", CUDA_VISIBLE_DEVICES=env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0],
            NCCL_HOSTID=self.hostname(rank), NCCL_SOCKET_IFNAME="eth0",
            NCCL_IB_DISABLE="1", NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1", NCCL_NVLS_ENABLE="0",
            XLA_PYTHON_CLIENT_PREALLOCATE="false",
            XLA_PYTHON_CLIENT_MEM_FRACTION=f"{0.85 / self.processes:.3f}",
        )
        return env

    def process_command(self, rank: int, argv: list[str], python: str = sys.executable) -> list[str]:
        """Run argv (a full command, python first) in namespace `rank` under its own hostname."""
        return ["ip", "netns", "exec", self.ns(rank), "unshare", "--uts", "--",
                python, "-c", _SET_HOSTNAME, self.hostname(rank), *argv]

    def annotation(self) -> dict:
        """What this launcher adds to every result record."""
        return dict(
            netem_processes=self.processes, netem_nodes=self.nodes, netem_per_node=self.per_node,
            netem_rate=self.rate, netem_rate_bps=self.rate_bps,
            netem_mtu=self.mtu, netem_tbf_burst=self.tbf_burst if self.rate_bps else None,
            netem_tbf_latency=self.latency if self.rate_bps else None, netem_gpu=self.gpu,
        )


def benchmark_argv(bench_args: list[str], output: Path, script: Path, python: str = sys.executable) -> list[str]:
    """The benchmark command: bench_args with ``--output output`` (instead of theirs) and --no-progress."""
    args, skip = [], False
    for i, a in enumerate(bench_args):
        if skip:
            skip = False
        elif a == "--output":
            skip = True
        elif not a.startswith("--output="):
            args.append(a)
    args += ["--output", str(output)]
    if "--no-progress" not in args:
        args.append("--no-progress")
    return [python, str(script), *args]


def output_path(bench_args: list[str]) -> Path | None:
    """Where rank 0 writes results, from --output in the benchmark's arguments."""
    for i, a in enumerate(bench_args):
        if a.startswith("--output="):
            return Path(a.split("=", 1)[1])
        if a == "--output" and i + 1 < len(bench_args):
            return Path(bench_args[i + 1])
    return None


def default_output(plan: Plan, script: Path) -> Path:
    """results/<script>_<N>p_<rate>_mtu<MTU>_<time>.json: named after the benchmark that wrote it."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return DEFAULT_RESULTS / f"{script.stem}_{plan.processes}p_{plan.rate}_mtu{plan.mtu}_{stamp}.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = sys.argv[1:] if argv is None else list(argv)
    bench = None
    if "--" in argv:
        cut = argv.index("--")
        argv, bench = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(
        prog="benchmarks/netem/run.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [options] [-- benchmark arguments]",
    )
    p.add_argument("-p", "--processes", type=int, default=2, help="processes, one namespace each (default 2)")
    p.add_argument("--nodes", type=int, help="nodes, one namespace each, joined by the shaped links (instead of -p)")
    p.add_argument("--per-node", type=int, default=1,
                   help="with --nodes: processes per node, in its namespace, unshaped between them (default 1)")
    p.add_argument("--rate", type=_rate_arg, default="1gbit",
                   help="link rate per host and direction, any tc rate (1gbit, 10gbit, 500mbit) or "
                        "'unlimited' (default 1gbit)")
    p.add_argument("--mtu", type=int, default=1500, help="MTU of every link (default 1500)")
    p.add_argument("--burst", help="tbf burst (default: 2 ms at the rate, at least 64 KiB)")
    p.add_argument("--latency", default="50ms", help="tbf latency: the queue's length in time (default 50ms)")
    p.add_argument("--port", type=int, default=12321, help="coordinator port on 10.77.0.1 (default 12321)")
    p.add_argument("--gpu", action="store_true",
                   help="every process on GPU 0 (CUDA_VISIBLE_DEVICES' first), NCCL's sockets on the shaped "
                        "link (P2P, shared memory and InfiniBand off, a host id per process)")
    p.add_argument("--script", type=Path, default=DEFAULT_SCRIPT,
                   help="the Python script every process runs (default benchmarks/allreduce.py)")
    p.add_argument("--python", default=sys.executable, help="the interpreter (default: this one)")
    p.add_argument("--timeout", type=float, help="stop everything after this many seconds (exit code 124)")
    p.add_argument("--grace", type=float, default=2.0,
                   help="seconds between SIGTERM and SIGKILL when stopping (default 2)")
    p.add_argument("--dry-run", action="store_true", help="print what would run, run nothing")
    p.add_argument("--cleanup", action="store_true",
                   help="remove namespaces and /etc/netns entries left by runs that are no longer running")
    p.add_argument("--force", action="store_true", help="with --cleanup: also those of runs still running")
    args = p.parse_args(argv)
    args.bench_args = DEFAULT_BENCH_ARGS if bench is None else bench
    try:
        processes = args.processes if args.nodes is None else args.nodes * args.per_node
        if args.nodes is None and args.per_node != 1:
            raise ValueError("--per-node needs --nodes")
        args.plan = Plan(processes, args.rate, args.mtu, args.burst, args.latency, args.port, gpu=args.gpu,
                         per_node=args.per_node)
    except ValueError as e:
        p.error(str(e))
    return args


# -- running ------------------------------------------------------------------------------


class Fatal(Exception):
    """A run that cannot go on; carries the exit code."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


class Interrupted(BaseException):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def missing_requirements(need_tc: bool) -> list[str]:
    problems = []
    if os.geteuid() != 0:
        problems.append("needs root (network namespaces, veth pairs, tc): run it with sudo")
    tools = ["ip", "unshare"] + (["tc"] if need_tc else [])
    problems += [f"`{t}` not found on PATH (iproute2 / util-linux)" for t in tools if shutil.which(t) is None]
    return problems


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise Fatal(f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()}", 2)
    return proc


def existing_namespaces() -> list[str]:
    proc = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


class Network:
    """Builds the plan's network; `close()` removes it (idempotent, also after a partial build)."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.group: ProcessGroup | None = None

    def build(self) -> None:
        clash = set(self.plan.namespaces) & set(existing_namespaces())
        if clash:
            raise Fatal(f"namespaces {sorted(clash)} exist already; `--cleanup` removes leftovers", 2)
        for path, text in self.plan.files().items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        for cmd in self.plan.setup_commands():
            _run(cmd)

    def start(self, argv: list[str], python: str) -> None:
        ranks = range(self.plan.processes)
        self.group = ProcessGroup(
            [self.plan.process_command(rank, argv, python) for rank in ranks],
            [self.plan.environment(rank) for rank in ranks],
            cwd=REPO,
        )

    def wait(self, timeout: float | None, grace: float) -> int:
        """Wait for every process; the first failure (or the timeout) stops the rest."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self.group.wait_for_end_or_failure(deadline):
            print(f"netem: timed out after {timeout:g} s; stopping every process", file=sys.stderr)
            self.stop(grace)
            return 124
        if failed := self.group.failures():
            rank, status = failed[0]
            print(f"netem: process {rank} {describe_status(status)}; stopping the others", file=sys.stderr)
            self.stop(grace)
            return exit_code(status)
        self.group.close()
        return 0

    def stop(self, grace: float) -> None:
        if self.group is None:
            return
        self.group.stop(grace)
        self.group.close()

    def close(self, grace: float) -> list[str]:
        """Stop the processes, delete the namespaces and /etc/netns entries; return what failed."""
        self.stop(grace)
        return remove(self.plan.namespaces, existing_namespaces())


def remove(names: list[str], existing: list[str]) -> list[str]:
    """Kill what runs in these namespaces, delete them and their /etc/netns entries."""
    errors = []
    for ns in names:
        if ns in existing:
            pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            proc = _run(["ip", "netns", "delete", ns], check=False)
            if proc.returncode != 0:
                errors.append(f"ip netns delete {ns}: {proc.stderr.strip()}")
        shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
    try:
        NETNS_ETC.rmdir()  # only when empty: someone else's entries stay
    except OSError:
        pass
    return errors


def _run_alive(tag: str) -> bool:
    """Is the launcher that made namespaces cgx<tag>-* still running?"""
    try:
        cmdline = Path(f"/proc/{tag}/cmdline").read_bytes()
    except OSError:
        return False
    return b"netem" in cmdline or b"run.py" in cmdline


def cleanup(force: bool) -> int:
    existing = existing_namespaces()
    entries = sorted(p.name for p in NETNS_ETC.iterdir()) if NETNS_ETC.is_dir() else []
    ours = sorted({n for n in existing + entries if NAME_RE.match(n)})
    skipped = sorted({n for n in ours if not force and _run_alive(NAME_RE.match(n).group(1))})
    doomed = [n for n in ours if n not in skipped]
    # Host namespaces before bridge namespaces (the order does not matter to the kernel).
    doomed.sort(key=lambda n: n.endswith("-br"))
    for n in skipped:
        print(f"netem: keeping {n}: its run (pid {NAME_RE.match(n).group(1)}) is still going (--force removes it)")
    errors = remove(doomed, existing)
    for n in doomed:
        print(f"netem: removed {n}")
    if not doomed and not skipped:
        print("netem: nothing to clean up")
    for e in errors:
        print(f"netem: {e}", file=sys.stderr)
    return 1 if errors else 0


def annotate(path: Path, plan: Plan) -> list[dict] | None:
    if path.suffix != ".json" or not path.is_file():
        return None
    records = json.loads(path.read_text())
    for r in records:
        r.update(plan.annotation())
    path.write_text(json.dumps(records, indent=2))
    return records


def summary(records: list[dict]) -> str:
    """A few columns of the results: the all-reduce benchmark's, or benchmarks/train_step.py's,
    allreduce_phases.py's or as_written.py's."""
    if records and "of_harness" in records[0]:  # benchmarks/as_written.py --compare
        return "\n".join(f"{r['run']:>14} {r['median_ms']:>9.1f} ms {r['of_harness']:>5.2f}x the harness's" for r in records)
    if records and "phase" in records[0]:
        return "\n".join(f"{r['phase']:>26} {r['ms']:>9.1f} ms" for r in records)
    if records and "step_ms" in records[0]:
        lines = [f"{'compressor':>12} {'step ms':>9} {'speedup':>7}"]
        for r in records:
            speedup = "-" if r.get("speedup") is None else f"{r['speedup']:.2f}"
            lines.append(f"{r.get('compressor', r.get('spec')):>12} {r['step_ms']:>9.1f} {speedup:>7}")
        return "\n".join(lines)
    lines = [f"{'op':>12} {'MiB':>8} {'bits':>4} {'lax ms':>9} {'cgx ms':>9} {'speedup':>7}"]
    for r in records:
        lines.append(f"{r.get('op', 'psum'):>12} {r['size_mib']:>8g} {r['bits']:>4} {r['psum_ms']:>9.1f} "
                     f"{r['compressed_ms']:>9.1f} {r['speedup']:>7.2f}")
    return "\n".join(lines)


def print_plan(plan: Plan, argv: list[str], python: str) -> None:
    print("# files")
    for path, text in plan.files().items():
        print(f"{path}:\n" + "".join(f"    {line}\n" for line in text.splitlines()))
    print("# network")
    for cmd in plan.setup_commands():
        print(shlex.join(cmd))
    print("# processes")
    for rank in range(plan.processes):
        env = plan.environment(rank, {})
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(plan.process_command(rank, argv, python)))
    print("# teardown")
    for cmd in plan.teardown_commands():
        print(shlex.join(cmd))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan: Plan = args.plan
    output = output_path(args.bench_args)
    output = (output if output is not None else default_output(plan, args.script)).resolve()
    bench_argv = benchmark_argv(args.bench_args, output, args.script.resolve(), args.python)
    if args.dry_run:
        print_plan(plan, bench_argv, args.python)
        return 0
    problems = missing_requirements(need_tc=not args.cleanup and plan.rate_bps is not None)
    if problems:
        for p in problems:
            print(f"netem: {p}", file=sys.stderr)
        return 2
    if args.cleanup:
        return cleanup(args.force)

    def on_signal(signum, frame):
        raise Interrupted(signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    network = Network(plan)
    code = 1
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        if output.exists():
            output.unlink()  # a stale file must not pass for this run's results
        t0 = time.monotonic()
        network.build()
        shape = f"{plan.nodes} nodes of {plan.per_node} processes" if plan.per_node > 1 else f"{plan.processes} processes"
        print(f"netem: {shape}, rate {plan.rate}, MTU {plan.mtu}, namespaces "
              f"{plan.ns(0)}..{plan.ns(plan.processes - 1)} (bridge in {plan.bridge_ns}); "
              f"built in {time.monotonic() - t0:.1f} s", flush=True)
        network.start(bench_argv, args.python)
        code = network.wait(args.timeout, args.grace)
    except Fatal as e:
        print(f"netem: {e}", file=sys.stderr)
        code = e.code
    except Interrupted as e:
        print(f"netem: got {e}; stopping and tearing down", file=sys.stderr)
        code = 128 + e.signum
    finally:
        # No second signal may cut the teardown short.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
        try:
            errors = network.close(args.grace)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        for e in errors:
            print(f"netem: teardown: {e}", file=sys.stderr)
        if errors and code == 0:
            code = 1
    if code == 0:
        records = annotate(output, plan)
        if records is None and output.suffix == ".json":
            print(f"netem: no results at {output}", file=sys.stderr)
            return 1
        if records:
            print(f"netem: {plan.processes} processes at {plan.rate}, MTU {plan.mtu}:\n{summary(records)}")
        print(f"netem: results: {output}")
    return code


if __name__ == "__main__":
    sys.exit(main())
