"""A real SLURM on this machine for the tests: munged, slurmctld and slurmd, one node, started from a
configuration written to a temporary folder and stopped (every daemon, every job) afterwards.

    with LocalSlurm(tmp_path, cpus=4) as slurm:
        run = slurm.run(["srun", "--ntasks=4", sys.executable, "worker.py"])

Needs Debian's ``slurm-wlm`` and ``munge`` (``.ci/run`` installs them) and root (slurmd starts
the tasks as the submitting user, and the daemons' spool folders are ours). :func:`unavailable`
says why SLURM cannot run here, for a skip that names it; nothing here is silent.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import time

DAEMONS = ("munged", "slurmctld", "slurmd")
NODE = socket.gethostname()  # jax takes the coordinator's host from the node list: it must resolve


def unavailable() -> str | None:
    """Why a local SLURM cannot start here, or None."""
    missing = [d for d in (*DAEMONS, "srun", "sbatch", "scontrol") if shutil.which(d) is None and
               not os.path.exists(f"/usr/sbin/{d}")]
    if missing:
        return (f"SLURM is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge "
                "(.ci/run does)")
    if os.geteuid() != 0:
        return "a local SLURM needs root (its daemons run as root and start tasks as the submitting user)"
    try:
        socket.getaddrinfo(NODE, None)
    except OSError:
        return (f"this host's name {NODE!r} does not resolve (the node's name, where jax puts the coordinator): "
                "add it to /etc/hosts")
    return None


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _daemon(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class LocalSlurm:
    """One SLURM node, this host (its name, 127.0.0.1), with ``cpus`` CPUs (more
    than the machine has is fine: slurmd takes the configured count), a partition ``debug``."""

    def __init__(self, root: pathlib.Path, cpus: int = 4, memory_mb: int = 4096):
        self.root = pathlib.Path(root) / "slurm"
        self.cpus = cpus
        self.memory_mb = memory_mb
        self.procs: dict[str, subprocess.Popen] = {}
        self.env: dict[str, str] = {}

    # --- setup -------------------------------------------------------------------------------

    def _write_config(self) -> pathlib.Path:
        r = self.root
        for sub in ("state", "spool", "munge", "log"):
            (r / sub).mkdir(parents=True, exist_ok=True)
        ctld_port, d_port = _free_ports(2)
        conf = r / "slurm.conf"
        conf.write_text(f"""\
ClusterName=jaxcgx
SlurmctldHost={socket.gethostname()}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r / "munge" / "munge.socket"},cred_expire=15
StateSaveLocation={r / "state"}
SlurmdSpoolDir={r / "spool"}/%n
SlurmctldPidFile={r / "slurmctld.pid"}
SlurmdPidFile={r / "slurmd.pid"}
SlurmctldLogFile={r / "log" / "slurmctld.log"}
SlurmdLogFile={r / "log" / "slurmd.log"}
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
MinJobAge=5
InactiveLimit=0
KillOnBadExit=1
JobRequeue=1
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName={NODE} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={self.memory_mb} State=UNKNOWN
PartitionName=debug Nodes={NODE} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
        return conf

    def _start_munge(self) -> None:
        m = self.root / "munge"
        key = m / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.procs["munged"] = subprocess.Popen(
            [_daemon("munged"), "-F", "--force", f"--key-file={key}", f"--socket={m / 'munge.socket'}",
             f"--pid-file={m / 'munged.pid'}", f"--log-file={m / 'munged.log'}", f"--seed-file={m / 'seed'}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        self._wait_for(lambda: (m / "munge.socket").exists(), "munged", 20)

    def _wait_for(self, ready, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode} while starting:\n{self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} was not ready in {timeout:.0f} s:\n{self.logs()}")
            time.sleep(0.2)

    def __enter__(self) -> LocalSlurm:
        conf = self._write_config()
        self.env = dict(os.environ, SLURM_CONF=str(conf))
        for key in [k for k in self.env if k.startswith(("SLURM_", "JAX_CGX_", "OMPI_", "PMI_"))]:
            if key != "SLURM_CONF":
                del self.env[key]
        try:
            self._start_munge()
            self.procs["slurmctld"] = subprocess.Popen(
                [_daemon("slurmctld"), "-D", "-i", "-f", str(conf)], env=self.env, stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE, start_new_session=True)
            self.procs["slurmd"] = subprocess.Popen(
                [_daemon("slurmd"), "-D", "-N", NODE, "-f", str(conf)], env=self.env, stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE, start_new_session=True)
            self._wait_for(self._node_idle, "the SLURM node (sinfo: idle)", 60)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _node_idle(self) -> bool:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], env=self.env, capture_output=True, text=True)
        return out.returncode == 0 and out.stdout.strip().rstrip("*") in ("idle", "mix", "alloc")

    # --- use ---------------------------------------------------------------------------------

    def run(self, command: list[str], timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
        """``command`` (``srun ...``, ``sbatch --wait ...``) with this cluster's ``SLURM_CONF``."""
        env = dict(self.env, **kwargs.pop("env", {}))
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, **kwargs)

    def show_job(self, job_id: str) -> str:
        """``scontrol show job``'s words about ``job_id`` (what :meth:`job_state` reads; a failure's message)."""
        out = subprocess.run(["scontrol", "show", "job", job_id], env=self.env, capture_output=True, text=True)
        return out.stdout + out.stderr

    def job_state(self, job_id: str) -> str:
        for field in self.show_job(job_id).split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return "GONE"

    def logs(self) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*.log")) + sorted((self.root / "munge").glob("*.log")):
            parts.append(f"--- {path.name} (last lines)\n" + "\n".join(path.read_text(errors="replace").splitlines()[-30:]))
        return "\n".join(parts)

    # --- teardown ----------------------------------------------------------------------------

    def __exit__(self, *exc) -> None:
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            subprocess.run(["scancel", "--full", "--partition=debug"], env=self.env, capture_output=True, timeout=30)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for proc in self.procs.values():
            if proc.stderr:
                proc.stderr.close()
