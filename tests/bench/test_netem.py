"""benchmarks/netem/run.py: the plan it builds (no root needed), and, as root, a real shaped 2-process run."""

import dataclasses
import importlib.util
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest

RUN_PY = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "netem" / "run.py"


def _load():
    spec = importlib.util.spec_from_file_location("netem_run", RUN_PY)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up
    spec.loader.exec_module(module)
    return module


netem = _load()


# -- pure parts ---------------------------------------------------------------------------


def test_parse_rate():
    assert netem.parse_rate("1gbit") == 1e9
    assert netem.parse_rate("10Gbit") == 1e10
    assert netem.parse_rate("500mbit") == 5e8
    assert netem.parse_rate("125mbps") == 1e9  # tc's "bps" is bytes per second
    assert netem.parse_rate("1.5gbit") == 1.5e9
    assert netem.parse_rate("1mibit") == 2**20
    for text in ("unlimited", "none", "0"):
        assert netem.parse_rate(text) is None
    for bad in ("fast", "1gbits", "-1gbit", "0gbit", ""):
        with pytest.raises(Exception, match="not a tc rate"):
            netem.parse_rate(bad)


def test_arguments_and_benchmark_arguments():
    args = netem.parse_args([])
    assert (args.processes, args.rate, args.mtu) == (2, "1gbit", 1500)
    assert args.bench_args == ["--sizes-mib", "64", "--bits", "4", "8", "-n", "5"]
    args = netem.parse_args(["--processes", "4", "--rate", "10GBIT", "--mtu", "9000", "--", "--bits", "4", "-n", "1"])
    assert (args.processes, args.rate, args.mtu) == (4, "10gbit", 9000)
    assert args.bench_args == ["--bits", "4", "-n", "1"]
    assert args.plan.processes == 4 and args.plan.rate == "10gbit" and args.plan.mtu == 9000
    assert netem.parse_args(["--rate", "unlimited"]).plan.rate_bps is None
    for bad in (["--rate", "fast"], ["--processes", "0"], ["--mtu", "10"]):
        with pytest.raises(SystemExit) as e:
            netem.parse_args(bad)
        assert e.value.code == 2


def test_benchmark_command_gets_one_output_and_no_progress_bar():
    out = pathlib.Path("/r/x.json")
    script = pathlib.Path("/b/allreduce.py")
    argv = netem.benchmark_argv(["--bits", "4", "--output", "mine.json", "-n", "1"], out, script, "py")
    assert argv == ["py", "/b/allreduce.py", "--bits", "4", "-n", "1", "--output", "/r/x.json", "--no-progress"]
    argv = netem.benchmark_argv(["--output=a.json", "--no-progress"], out, script, "py")
    assert argv == ["py", "/b/allreduce.py", "--no-progress", "--output", "/r/x.json"]
    assert netem.output_path(["-n", "1", "--output", "a.json"]) == pathlib.Path("a.json")
    assert netem.output_path(["--output=b.json"]) == pathlib.Path("b.json")
    assert netem.output_path(["-n", "1"]) is None


def _namespace_of(cmd):
    """The namespace an ip/tc command acts in (None: the root namespace)."""
    if cmd[:3] == ["ip", "netns", "add"]:
        return cmd[3]
    assert cmd[1] == "-n", cmd
    return cmd[2]


@pytest.mark.parametrize("processes", [2, 4])
def test_plan_shapes_both_directions_of_every_link(processes):
    plan = netem.Plan(processes, "1gbit", mtu=1500, tag="4242")
    assert plan.namespaces == [f"cgx4242-{i}" for i in range(processes)] + ["cgx4242-br"]
    assert all(netem.NAME_RE.match(n) for n in plan.namespaces)
    cmds = plan.setup_commands()
    created = []
    for cmd in cmds:
        ns = _namespace_of(cmd)
        assert ns in plan.namespaces, f"{cmd} acts outside the run's namespaces"
        if cmd[:3] == ["ip", "netns", "add"]:
            created.append(ns)
        else:
            assert ns in created, f"{cmd} before its namespace exists"
    assert created[0] == plan.bridge_ns and sorted(created) == sorted(plan.namespaces)
    tbf = [c for c in cmds if c[0] == "tc"]
    assert len(tbf) == 2 * processes
    shaped = {(c[2], c[6]) for c in tbf}
    assert shaped == {(plan.ns(i), "eth0") for i in range(processes)} | {
        (plan.bridge_ns, f"p{i}") for i in range(processes)}
    for c in tbf:
        assert c[3:] == ["qdisc", "add", "dev", c[6], "root", "tbf", "rate", "1gbit", "burst", "250000b",
                         "latency", "50ms"]
    for i in range(processes):
        assert ["ip", "-n", plan.ns(i), "addr", "add", f"10.77.0.{i + 1}/24", "dev", "eth0"] in cmds
        assert ["ip", "-n", plan.ns(i), "link", "set", "lo", "up"] in cmds
        assert ["ip", "-n", plan.ns(i), "link", "set", "eth0", "mtu", "1500", "up"] in cmds
        assert ["ip", "-n", plan.bridge_ns, "link", "set", f"p{i}", "mtu", "1500", "master", "br0", "up"] in cmds
    assert plan.teardown_commands() == [["ip", "netns", "delete", n] for n in plan.namespaces]


def test_plan_unlimited_and_options():
    plan = netem.Plan(2, "unlimited", mtu=9000, tag="7")
    cmds = plan.setup_commands()
    assert not [c for c in cmds if c[0] == "tc"]
    assert ["ip", "-n", "cgx7-1", "link", "set", "eth0", "mtu", "9000", "up"] in cmds
    assert plan.annotation()["netem_rate_bps"] is None
    assert netem.Plan(2, "10gbit", tag="7").tbf_burst == "2500000b"  # 2 ms at 10 Gbit/s
    assert netem.Plan(2, "10mbit", tag="7").tbf_burst == "65536b"  # never below 64 KiB
    assert netem.Plan(2, "1gbit", burst="1mb", latency="5ms", tag="7").tbf("n", "eth0")[-4:] == [
        "burst", "1mb", "latency", "5ms"]
    for bad in (dict(processes=0), dict(processes=2, mtu=20), dict(processes=2, tag="x1")):
        with pytest.raises(ValueError):
            netem.Plan(**bad)


def test_hosts_files_resolve_every_hostname_to_its_address():
    plan = netem.Plan(3, "1gbit", tag="99")
    files = plan.files()
    assert sorted(files) == [pathlib.Path(f"/etc/netns/cgx99-{i}/hosts") for i in range(3)]
    for text in files.values():
        entries = [line.split() for line in text.splitlines()]
        assert ["127.0.0.1", "localhost"] in entries
        for i in range(3):
            assert [f"10.77.0.{i + 1}", plan.hostname(i)] in entries
        assert not any(e[0].startswith("127.") and e[1].startswith("cgx") for e in entries)


def test_processes_run_in_their_namespace_with_the_launcher_environment():
    plan = netem.Plan(4, "1gbit", port=5000, tag="12")
    base = {"XLA_FLAGS": "--xla_cpu_foo=1 --xla_force_host_platform_device_count=8", "KEEP": "1"}
    for rank in range(4):
        env = plan.environment(rank, base)
        assert env["JAX_CGX_PROCESS_ID"] == str(rank) and env["JAX_CGX_NUM_PROCESSES"] == "4"
        assert env["JAX_CGX_LOCAL_RANK"] == "0" and env["JAX_CGX_LOCAL_COUNT"] == "1"
        assert env["JAX_CGX_COORDINATOR"] == "10.77.0.1:5000"
        assert env["XLA_FLAGS"] == "--xla_cpu_foo=1 --xla_force_host_platform_device_count=1"
        assert env["KEEP"] == "1" and env["JAX_PLATFORMS"] == "cpu"
        cmd = plan.process_command(rank, ["py", "bench.py", "-n", "1"], python="py")
        assert cmd[:7] == ["ip", "netns", "exec", f"cgx12-{rank}", "unshare", "--uts", "--"]
        assert cmd[7:9] == ["py", "-c"] and cmd[10] == plan.hostname(rank)
        assert cmd[11:] == ["py", "bench.py", "-n", "1"]
    # The hostname snippet hands over to the benchmark command (exec, same pid).
    assert "sethostname(sys.argv[1])" in cmd[9] and "execv(sys.argv[2], sys.argv[2:])" in cmd[9]


def test_gpu_processes_share_the_gpu_and_send_nccl_over_the_link():
    """--gpu: every process on the first visible GPU, each its own NCCL host (no P2P or shared memory
    between them), NCCL's sockets on the namespace's eth0: XLA's, jax_cgx's and PyTorch's traffic all
    crosses the shaped link."""
    plan = netem.Plan(2, "10gbit", tag="5", gpu=True)
    envs = [plan.environment(rank, {"CUDA_VISIBLE_DEVICES": "3,4", "JAX_PLATFORMS": "cpu"}) for rank in range(2)]
    for rank, env in enumerate(envs):
        assert env["JAX_PLATFORMS"] == "cuda" and env["CUDA_VISIBLE_DEVICES"] == "3"
        assert env["NCCL_SOCKET_IFNAME"] == "eth0" and env["NCCL_HOSTID"] == plan.hostname(rank)
        assert env["NCCL_P2P_DISABLE"] == env["NCCL_SHM_DISABLE"] == env["NCCL_IB_DISABLE"] == "1"
        assert float(env["XLA_PYTHON_CLIENT_MEM_FRACTION"]) * 2 <= 0.85
    assert envs[0]["NCCL_HOSTID"] != envs[1]["NCCL_HOSTID"]
    assert plan.annotation()["netem_gpu"] is True and netem.parse_args(["--gpu"]).plan.gpu
    assert "NCCL_HOSTID" not in netem.Plan(2, "10gbit", tag="5").environment(0, {})


def test_dry_run_prints_the_plan_without_root(capsys):
    assert netem.main(["-p", "2", "--rate", "1gbit", "--dry-run", "--", "--sizes-mib", "0.25", "-n", "1"]) == 0
    out = capsys.readouterr().out
    for part in ("# network", "ip netns add cgx", "tbf rate 1gbit", "# processes", "ip netns exec",
                 "JAX_CGX_COORDINATOR=10.77.0.1:12321", "--sizes-mib 0.25 -n 1 --output", "# teardown"):
        assert part in out


def test_without_root_or_tools_it_says_so(monkeypatch, capsys):
    monkeypatch.setattr(netem.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(netem.shutil, "which", lambda name: None if name == "tc" else f"/usr/sbin/{name}")
    assert netem.main(["-p", "2", "--rate", "1gbit"]) == 2
    err = capsys.readouterr().err
    assert "needs root" in err and "`tc` not found" in err
    monkeypatch.setattr(netem.os, "geteuid", lambda: 0)
    assert netem.missing_requirements(need_tc=False) == []  # unlimited needs no tc


def test_summary_table():
    rows = [dict(size_mib=64.0, bits=4, psum_ms=566.5, compressed_ms=178.4, speedup=3.176),  # before --ops: psum
            dict(op="psum_scatter", size_mib=64.0, bits=4, psum_ms=304.8, compressed_ms=59.1, speedup=5.157)]
    assert [line.split() for line in netem.summary(rows).splitlines()[1:]] == [
        ["psum", "64", "4", "566.5", "178.4", "3.18"], ["psum_scatter", "64", "4", "304.8", "59.1", "5.16"]]
    assert netem.summary([dict(phase="psum", ms=562.04)]).split() == ["psum", "562.0", "ms"]
    steps = [dict(compressor="none", step_ms=139.1, speedup=1.0), dict(compressor="maxmin:4", step_ms=84.5, speedup=1.646)]
    assert [line.split() for line in netem.summary(steps).splitlines()[1:]] == [
        ["none", "139.1", "1.00"], ["maxmin:4", "84.5", "1.65"]]


# -- for real, as root --------------------------------------------------------------------


def _can_make_namespaces() -> str | None:
    """Why a real run cannot happen here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"needs `{tool}`"
    probe = f"cgxprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` fails: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


def _leftovers(tag: int) -> list[str]:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    etc = [p.name for p in pathlib.Path("/etc/netns").glob("*")] if pathlib.Path("/etc/netns").is_dir() else []
    return sorted(n for n in names + etc if n.startswith(f"cgx{tag}-"))


_why_not = _can_make_namespaces() if sys.platform == "linux" else "needs Linux"
real = pytest.mark.skipif(_why_not is not None, reason=_why_not or "")


@real
@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_at_1gbit_end_to_end(tmp_path):
    out = tmp_path / "r.json"
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, str(RUN_PY), "--processes", "2", "--rate", "1gbit", "--timeout", "55", "--",
         "--sizes-mib", "0.25", "--bits", "4", "-n", "1", "--output", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        log, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()  # its finally block cannot run: leaves namespaces, removed below
            proc.wait()
            subprocess.run([sys.executable, str(RUN_PY), "--cleanup"], capture_output=True)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, log[-4000:]
    assert elapsed < 60
    assert f"netem: results: {out}" in log
    assert "[0] " in log  # each line with its rank (process 1 prints nothing of its own: gloo's lines are left out)
    assert "[Gloo]" not in log
    (record,) = json.loads(out.read_text())
    assert record["devices"] == 2 and record["platform"] == "cpu" and record["bits"] == 4
    assert record["size_bytes"] == 2**18 and 0 < record["max_abs_error"] < record["max_abs_sum"]
    assert record["netem_rate"] == "1gbit" and record["netem_mtu"] == 1500 and record["netem_processes"] == 2
    assert _leftovers(proc.pid) == []


@real
@pytest.mark.multiprocess
@pytest.mark.slow
def test_sigterm_tears_everything_down(tmp_path):
    """SIGTERM in the middle of a benchmark: every process and namespace goes, exit code 143."""
    log_path = tmp_path / "log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, str(RUN_PY), "--processes", "2", "--rate", "1gbit", "--timeout", "55", "--",
             "--sizes-mib", "16", "--bits", "4", "-n", "1000", "--output", str(tmp_path / "r.json")],
            stdout=log_file, stderr=subprocess.STDOUT, text=True,
        )
    try:
        deadline = time.monotonic() + 40
        while "Rank 0 is connected" not in log_path.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log_path.read_text()[-4000:]
            time.sleep(0.1)
        assert len(_leftovers(proc.pid)) == 5, "3 namespaces and 2 /etc/netns entries while it runs"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            subprocess.run([sys.executable, str(RUN_PY), "--cleanup"], capture_output=True)
    log = log_path.read_text()
    assert proc.returncode == 128 + signal.SIGTERM, log[-4000:]
    assert "got SIGTERM" in log
    assert _leftovers(proc.pid) == []
    assert not (tmp_path / "r.json").exists()


def test_nodes_share_a_namespace_and_only_links_between_nodes_are_shaped():
    """--nodes 2 --per-node 2: two namespaces, each holding two processes that reach each other
    over the node's own address (unshaped); tbf on each node's link only; each process knows its
    place in its node (JAX_CGX_LOCAL_RANK / _COUNT, what --two-level builds the mesh from)."""
    args = netem.parse_args(["--nodes", "2", "--per-node", "2", "--rate", "1gbit"])
    plan = dataclasses.replace(args.plan, tag="31")
    assert (plan.processes, plan.nodes, plan.per_node) == (4, 2, 2)
    assert [plan.ns(r) for r in range(4)] == ["cgx31-0", "cgx31-0", "cgx31-1", "cgx31-1"]
    assert [plan.address(r) for r in range(4)] == ["10.77.0.1", "10.77.0.1", "10.77.0.2", "10.77.0.2"]
    assert plan.namespaces == ["cgx31-0", "cgx31-1", "cgx31-br"]
    cmds = plan.setup_commands()
    assert sum(c[:2] == ["ip", "netns"] and c[2] == "add" for c in cmds) == 3  # two nodes and the bridge
    shaped = [(c[2], c[6]) for c in cmds if c[0] == "tc"]
    assert shaped == [("cgx31-0", "eth0"), ("cgx31-br", "p0"), ("cgx31-1", "eth0"), ("cgx31-br", "p1")]
    assert sorted(plan.files()) == [pathlib.Path(f"/etc/netns/cgx31-{k}/hosts") for k in range(2)]
    for rank in range(4):
        env = plan.environment(rank, {})
        assert env["JAX_CGX_LOCAL_RANK"] == str(rank % 2) and env["JAX_CGX_LOCAL_COUNT"] == "2"
        assert env["JAX_CGX_NUM_PROCESSES"] == "4"
    assert plan.annotation()["netem_nodes"] == 2 and plan.annotation()["netem_per_node"] == 2
    with pytest.raises(ValueError, match="not whole nodes"):
        netem.Plan(3, "1gbit", tag="1", per_node=2)
    with pytest.raises(SystemExit):
        netem.parse_args(["-p", "4", "--per-node", "2"])  # --per-node needs --nodes
