"""A throw-away two-node Slurm cluster on loopback, for testing the sbatch scripts for real.

Debian's ``slurmctld``, ``slurmd``, ``slurm-client`` and ``munge`` packages (Slurm 22.05 on
bookworm) run a whole cluster on one machine: one ``slurmctld`` and two ``slurmd -N nodeX``
daemons, all on 127.0.0.1 with distinct ports (``SlurmdParameters=config_overrides`` lets both
"nodes" claim the same hardware), no cgroups (``ProctrackType=proctrack/linuxproc``,
``TaskPlugin=task/none``), a private ``munged`` with a fresh key. Everything -- config, key,
sockets, state, spool, logs -- lives in one directory; nothing under /etc is touched.

    cluster = LocalSlurmCluster.create()       # new directory under /tmp
    cluster.start()                            # idempotent; raises SlurmUnavailable if it cannot
    job_id = cluster.sbatch(["--nodes=2", "script.sbatch"], env=...)
    job = cluster.wait(job_id, timeout_s=300)  # JobResult(state="COMPLETED", exit_code="0:0", ...)
    cluster.stop()                             # cancels jobs, stops the daemons it started

From a shell (to try slurm/*.sbatch by hand)::

    python tests/slurm/slurm_cluster.py up      # prints: export SLURM_CONF=...
    python tests/slurm/slurm_cluster.py down

Installing needs root and apt-get (``ensure_installed``): `.ci/run` installs the packages before
the suite, and a test installs them only when a developer asks with FASTPATH_SLURM_INSTALL=1; FASTPATH_SLURM_NO_INSTALL=1 forbids it. Whatever cannot be done raises ``SlurmUnavailable`` with the reason, which the tests
turn into a skip.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping, Optional, Sequence

__all__ = [
    "SLURM_PACKAGES",
    "SlurmUnavailable",
    "InstallResult",
    "JobResult",
    "LocalSlurmCluster",
    "ensure_installed",
    "apt_install",
    "find_binary",
    "clean_submit_env",
]

SLURM_PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
_SLURM_BINARIES = ("slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "sinfo", "scancel", "munged")
_SBIN_DIRS = ("/usr/sbin", "/sbin", "/usr/local/sbin")
TERMINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
     "BOOT_FAIL", "DEADLINE"}
)
# Variables a job must not inherit from the submitting (test) process: torch.distributed ranks
# (the conftest's 1-process group sets them) and any enclosing Slurm job's settings.
_DROP_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "TORCHELASTIC_")
_DROP_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
               "MASTER_PORT", "PYTEST_CURRENT_TEST")


class SlurmUnavailable(RuntimeError):
    """Slurm cannot be installed or started here; the message says why."""


@dataclasses.dataclass(frozen=True)
class InstallResult:
    installed_now: bool  # False: everything was already on the machine
    seconds: float


@dataclasses.dataclass(frozen=True)
class JobResult:
    job_id: int
    state: str  # e.g. COMPLETED, FAILED
    exit_code: str  # "<exit status>:<signal>", e.g. "0:0"
    fields: Mapping[str, str]  # everything `scontrol show job -o` (or the jobcomp record) reported
    seconds: float  # submission to terminal state, as observed by the poller

    @property
    def ok(self) -> bool:
        return self.state == "COMPLETED" and self.exit_code == "0:0"


def find_binary(name: str) -> Optional[str]:
    """``shutil.which`` that also looks in the sbin directories (not on a user's PATH)."""
    path = os.pathsep.join([os.environ.get("PATH", ""), *_SBIN_DIRS])
    return shutil.which(name, path=path)


def _missing_binaries() -> list[str]:
    return [b for b in _SLURM_BINARIES if find_binary(b) is None]


def apt_install(packages: Sequence[str], timeout_s: float = 900) -> InstallResult:
    """``apt-get update`` + ``apt-get install -y --no-install-recommends packages``.

    Installs only when FASTPATH_SLURM_INSTALL=1 (CI installs the packages in `.ci/run`, before
    the suite), so a plain ``pytest`` stays fast and skips with the reason. Raises SlurmUnavailable when installing is
    not asked for, when not root, without apt-get, when FASTPATH_SLURM_NO_INSTALL=1, or when apt
    fails (the message carries apt's last lines)."""
    if os.environ.get("FASTPATH_SLURM_NO_INSTALL") == "1":
        raise SlurmUnavailable(f"{' '.join(packages)} not installed and FASTPATH_SLURM_NO_INSTALL=1")
    if os.environ.get("FASTPATH_SLURM_INSTALL") != "1":
        raise SlurmUnavailable(
            f"{' '.join(packages)} not installed; set FASTPATH_SLURM_INSTALL=1 to let the test "
            "apt-get it (`.ci/run` installs it before the suite)"
        )
    if os.geteuid() != 0:
        raise SlurmUnavailable(f"{' '.join(packages)} not installed and not root (cannot apt-get)")
    apt = find_binary("apt-get")
    if apt is None:
        raise SlurmUnavailable(f"{' '.join(packages)} not installed and no apt-get on this machine")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    t0 = time.perf_counter()
    # Short network timeouts: a machine without a reachable mirror skips fast instead of hanging.
    net = ["-o", "Acquire::Retries=1", "-o", "Acquire::http::Timeout=30",
           "-o", "Acquire::https::Timeout=30"]
    for cmd in ([apt, *net, "update", "-q"],
                [apt, *net, "install", "-y", "-q", "--no-install-recommends", *packages]):
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise SlurmUnavailable(f"`{' '.join(cmd)}` did not finish in {timeout_s:.0f} s") from None
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
            raise SlurmUnavailable(f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n{tail}")
    return InstallResult(installed_now=True, seconds=time.perf_counter() - t0)


def ensure_installed(timeout_s: float = 900) -> InstallResult:
    """Install Debian's Slurm + munge packages unless their programs are already present."""
    t0 = time.perf_counter()
    if not _missing_binaries():
        return InstallResult(installed_now=False, seconds=time.perf_counter() - t0)
    result = apt_install(SLURM_PACKAGES, timeout_s=timeout_s)
    missing = _missing_binaries()
    if missing:
        raise SlurmUnavailable(f"installed {' '.join(SLURM_PACKAGES)} but {missing} still missing")
    return result


def clean_submit_env(base: Optional[Mapping[str, str]] = None, **extra: str) -> dict[str, str]:
    """``base`` (default os.environ) without rank/rendezvous and Slurm variables, plus ``extra``."""
    env = {
        k: v for k, v in (os.environ if base is None else base).items()
        if k not in _DROP_NAMES and not k.startswith(_DROP_PREFIXES)
    }
    env.update(extra)
    return env


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped) is not alive for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _parse_fields(line: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S*)", line))


class LocalSlurmCluster:
    """A Slurm cluster of ``len(nodes)`` loopback nodes whose files all live under ``root``."""

    def __init__(self, root: os.PathLike | str, nodes: Sequence[str] = ("node1", "node2"),
                 cpus_per_node: int = 2, partition: str = "debug"):
        if not nodes:
            raise ValueError("a cluster needs at least one node")
        if cpus_per_node < 1:
            raise ValueError(f"cpus_per_node must be >= 1, got {cpus_per_node}")
        self.root = Path(root).resolve()
        self.nodes = tuple(nodes)
        self.cpus_per_node = cpus_per_node
        self.partition = partition
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.jobcomp = self.root / "jobcomp.txt"

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def create(cls, parent: Optional[str] = None, **kwargs) -> "LocalSlurmCluster":
        """A cluster in a new directory. munged needs every directory on its socket's path to be
        searchable by all, so the default parent is /tmp (not pytest's 0700 basetemp)."""
        root = tempfile.mkdtemp(prefix="fastpath-slurm-", dir=parent or "/tmp")
        os.chmod(root, 0o755)
        return cls(root, **kwargs)

    @property
    def env(self) -> dict[str, str]:
        """Variables that point Slurm's clients at this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def _pidfiles(self) -> dict[str, Path]:
        files = {"munged": self.root / "munge" / "munged.pid",
                 "slurmctld": self.root / "run" / "slurmctld.pid"}
        for n in self.nodes:
            files[f"slurmd-{n}"] = self.root / "run" / f"slurmd-{n}.pid"
        return files

    def _daemon_pids(self) -> dict[str, int]:
        """Live daemons that this cluster started (pid file in root, command line names root)."""
        pids = {}
        for name, path in self._pidfiles().items():
            try:
                pid = int(path.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            if _pid_alive(pid) and str(self.root) in _cmdline(pid):
                pids[name] = pid
        return pids

    def _write_config(self) -> None:
        for d in ("munge", "run", "state", "spool", "log"):
            (self.root / d).mkdir(exist_ok=True)
        os.chmod(self.root / "munge", 0o755)  # munged: socket dir must be searchable by all
        keydir = self.root / "munge-key"
        keydir.mkdir(mode=0o700, exist_ok=True)
        key = keydir / "munge.key"
        if not key.exists():
            fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(os.urandom(128))
        ctld_port, *node_ports = _free_ports(1 + len(self.nodes))
        r = self.root
        host = socket.gethostname().split(".")[0]
        lines = [
            "# Generated by tests/slurm/slurm_cluster.py: a loopback test cluster.",
            "ClusterName=fastpathci",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire: a requeued job waits this long before it starts again (default
            # 120 s, slurm.conf(5) AuthInfo); 20 s keeps the preemption tests' requeues short
            # while leaving a loaded machine time to launch each step with its credential
            f"AuthInfo=socket={self.munge_socket},cred_expire=20",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/run/slurmctld.pid",
            f"SlurmdPidFile={r}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd-%n.log",
            "SlurmdParameters=config_overrides",  # all nodes are this machine
            "ProctrackType=proctrack/linuxproc",  # no cgroups in containers
            "TaskPlugin=task/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "ReturnToService=2",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",  # no slurmdbd: no sacct
            "JobCompType=jobcomp/filetxt",  # ... but a record of every finished job
            f"JobCompLoc={self.jobcomp}",
            "MinJobAge=3600",  # keep finished jobs visible to `scontrol show job`
            # Job ids (hence the sbatch scripts' MASTER_PORT = 20000 + id % 20000) differ from
            # one cluster to the next, so a port left busy by an earlier run is not reused.
            f"FirstJobId={random.randrange(1000, 19000)}",
            "KillWait=5",
            "InactiveLimit=0",
            "SlurmdTimeout=120",
        ]
        for name, port in zip(self.nodes, node_ports):
            lines.append(f"NodeName={name} NodeAddr=127.0.0.1 Port={port} "
                         f"CPUs={self.cpus_per_node} State=UNKNOWN")
        lines.append(f"PartitionName={self.partition} Nodes={','.join(self.nodes)} Default=YES "
                     "MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    # -- lifecycle -------------------------------------------------------------------------------
    def is_running(self) -> bool:
        pids = self._daemon_pids()
        if len(pids) != len(self._pidfiles()):
            return False
        return self._run(["scontrol", "ping"], check=False, timeout=15).returncode == 0

    def start(self, timeout_s: float = 60) -> None:
        """Start munged, slurmctld and one slurmd per node, then wait until every node is idle.
        Does nothing if this cluster is already up; raises SlurmUnavailable on failure (after
        stopping whatever it started)."""
        if self.is_running():
            return
        if os.geteuid() != 0:
            raise SlurmUnavailable("running slurmd/slurmctld here needs root")
        missing = _missing_binaries()
        if missing:
            raise SlurmUnavailable(f"Slurm programs missing: {missing} (call ensure_installed())")
        self.stop(remove=False)  # leftovers of a half-started run
        self._write_config()
        keyfile = self.root / "munge-key" / "munge.key"
        try:
            self._daemon(["munged", f"--key-file={keyfile}", f"--socket={self.munge_socket}",
                          f"--pid-file={self.root}/munge/munged.pid",
                          f"--log-file={self.root}/log/munged.log",
                          f"--seed-file={self.root}/munge-key/munged.seed"], "munged")
            self._wait(lambda: self.munge_socket.exists(), 10, "munged socket")
            self._daemon(["slurmctld", "-i", "-f", str(self.conf)], "slurmctld")
            self._wait(lambda: self._run(["scontrol", "ping"], check=False, timeout=15).returncode == 0,
                       timeout_s, "slurmctld to answer `scontrol ping`")
            for n in self.nodes:
                self._daemon(["slurmd", "-f", str(self.conf), "-N", n], f"slurmd-{n}")
            self._wait(self._all_idle, timeout_s, f"nodes {','.join(self.nodes)} to be idle")
        except SlurmUnavailable as e:
            logs = self.log_tails()
            self.stop(remove=False)
            raise SlurmUnavailable(f"{e}\n{logs}") from None

    def stop(self, remove: bool = True, timeout_s: float = 30) -> None:
        """Cancel all jobs, stop the daemons this cluster started, optionally delete ``root``."""
        pids = self._daemon_pids()
        if "slurmctld" in pids:
            ids = self._run(["squeue", "-h", "-o", "%A"], check=False, timeout=15).stdout.split()
            if ids:
                self._run(["scancel", *ids], check=False, timeout=15)
                deadline = time.monotonic() + timeout_s
                while time.monotonic() < deadline:
                    if not self._run(["squeue", "-h", "-o", "%A"], check=False, timeout=15).stdout.split():
                        break
                    time.sleep(0.5)
        # slurmds before slurmctld before munged (each needs the next one to shut down cleanly)
        order = [k for k in pids if k.startswith("slurmd-")] + ["slurmctld", "munged"]
        for name in order:
            pid = pids.get(name)
            if pid is None:
                continue
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while _pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        if remove:
            shutil.rmtree(self.root, ignore_errors=True)

    def _daemon(self, argv: list[str], name: str) -> None:
        exe = find_binary(argv[0])
        out = self.root / "log" / f"{name}.start.log"
        with open(out, "w") as log:
            proc = subprocess.run([exe, *argv[1:]], env=self._env(), stdin=subprocess.DEVNULL,
                                  stdout=log, stderr=subprocess.STDOUT, timeout=60,
                                  start_new_session=True)
        if proc.returncode != 0:
            raise SlurmUnavailable(f"`{' '.join(argv)}` exited with {proc.returncode}: "
                                   f"{out.read_text().strip()[-800:]}")

    @staticmethod
    def _wait(pred, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if pred():
                return
            time.sleep(0.5)
        raise SlurmUnavailable(f"timed out after {timeout_s:.0f} s waiting for {what}")

    def _all_idle(self) -> bool:
        out = self._run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False, timeout=15).stdout
        states = dict(line.split() for line in out.splitlines() if line.strip())
        return all(states.get(n) == "idle" for n in self.nodes)

    def log_tails(self, lines: int = 15) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*.log")):
            text = path.read_text(errors="replace").strip().splitlines()[-lines:]
            if text:
                parts.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(parts)

    # -- clients ---------------------------------------------------------------------------------
    def _env(self, extra: Optional[Mapping[str, str]] = None) -> dict[str, str]:
        env = clean_submit_env() if extra is None else dict(extra)
        env.update(self.env)
        return env

    def _run(self, argv: list[str], env: Optional[Mapping[str, str]] = None, check: bool = True,
             timeout: float = 60) -> subprocess.CompletedProcess:
        exe = find_binary(argv[0]) or argv[0]
        try:
            proc = subprocess.run([exe, *argv[1:]], env=self._env(env), capture_output=True,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            if check:
                raise RuntimeError(f"`{' '.join(argv)}` timed out after {timeout} s") from e
            return subprocess.CompletedProcess(argv, 124, "", f"timed out after {timeout} s")
        if check and proc.returncode != 0:
            raise RuntimeError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def sbatch(self, args: Sequence[str], env: Optional[Mapping[str, str]] = None) -> int:
        """Submit (``sbatch --parsable *args``) with ``env`` (default: clean_submit_env()) plus
        SLURM_CONF; returns the job id."""
        out = self._run(["sbatch", "--parsable", *args], env=env).stdout.strip()
        return int(out.split(";")[0])

    def job(self, job_id: int) -> Optional[dict[str, str]]:
        """The job's fields from slurmctld, else from the jobcomp record, else None."""
        proc = self._run(["scontrol", "show", "job", "-o", str(job_id)], check=False, timeout=15)
        if proc.returncode == 0 and proc.stdout.strip():
            return _parse_fields(proc.stdout)
        if self.jobcomp.exists():
            for line in self.jobcomp.read_text().splitlines():
                if line.startswith(f"JobId={job_id} "):
                    return _parse_fields(line)
        return None

    def wait(self, job_id: int, timeout_s: float = 300, poll_s: float = 1.0) -> JobResult:
        """Poll until the job reaches a terminal state. On timeout the job is cancelled and
        TimeoutError says what state it was stuck in."""
        t0 = time.monotonic()
        fields: Optional[dict[str, str]] = None
        while time.monotonic() - t0 < timeout_s:
            fields = self.job(job_id)
            if fields is not None and fields.get("JobState") in TERMINAL_STATES:
                return JobResult(job_id, fields["JobState"], fields.get("ExitCode", "?"), fields,
                                 time.monotonic() - t0)
            time.sleep(poll_s)
        self._run(["scancel", str(job_id)], check=False)
        state = None if fields is None else (fields.get("JobState"), fields.get("Reason"))
        raise TimeoutError(f"job {job_id} not finished after {timeout_s:.0f} s (state, reason: "
                           f"{state})\n{self.log_tails()}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument("--root", default="/tmp/fastpath-slurm",
                        help="directory holding the cluster's files (default: %(default)s)")
    args = parser.parse_args(argv)
    cluster = LocalSlurmCluster(args.root)
    if args.action == "up":
        try:
            ensure_installed()
            Path(args.root).mkdir(mode=0o755, exist_ok=True)
            cluster.start()
        except SlurmUnavailable as e:
            print(f"cannot start a local Slurm: {e}", file=sys.stderr)
            return 1
        print(f"export SLURM_CONF={cluster.conf}")
    elif args.action == "down":
        cluster.stop(remove=True)
    else:
        up = cluster.is_running()
        print(f"{'up' if up else 'down'}: {cluster.root}")
        return 0 if up else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
