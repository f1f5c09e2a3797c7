"""A real single-node Slurm for the tests: munged, slurmctld and slurmd on this machine.

Debian's ``slurm-wlm`` and ``munge`` are installed with apt when missing (root and apt are
needed; :func:`unavailable_reason` says why not otherwise). Everything the daemons write
(state, spool, logs, pid files, the munge key and socket) lives in one private directory,
and they listen on free ports, so the system's own Slurm (if any) and parallel test runs are
not touched. The configuration is the smallest that runs tasks without cgroups:
``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``,
``SlurmdParameters=config_overrides``, one node declared with this host's CPUs.

:meth:`SingleNodeSlurm.stop` cancels every job, waits for the queue to drain, stops the
daemons, and finally ends any job step process (``slurmstepd``) still carrying this
cluster's ``SLURM_CONF``: nothing is left running.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from tensorfleet.launch.ports import free_ports

#: The Debian packages of a Slurm node and its authentication service.
PACKAGES = ("slurm-wlm", "munge")
#: The programs the harness runs.
PROGRAMS = (
    "munged",
    "slurmctld",
    "slurmd",
    "srun",
    "sbatch",
    "squeue",
    "sinfo",
    "scancel",
    "scontrol",
)
APT_TIMEOUT_S = 600
START_TIMEOUT_S = 60
DRAIN_TIMEOUT_S = 30


def missing_programs() -> list[str]:
    return [name for name in PROGRAMS if shutil.which(name) is None]


def unavailable_reason() -> str | None:
    """Why this machine cannot run the daemons, or ``None`` if it can (maybe after apt)."""
    if not missing_programs():
        return None if os.geteuid() == 0 else "the Slurm daemons need root here (not root)"
    if os.geteuid() != 0:
        return f"Slurm is not installed ({', '.join(missing_programs())} missing) and we are not root to apt-get install {' '.join(PACKAGES)}"
    if shutil.which("apt-get") is None:
        return f"Slurm is not installed ({', '.join(missing_programs())} missing) and there is no apt-get to install {' '.join(PACKAGES)}"
    return None


def install() -> None:
    """``apt-get install slurm-wlm munge`` when a program is missing (``apt-get update`` first
    if the package lists are too old to find them)."""
    if not missing_programs():
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    command = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=APT_TIMEOUT_S)
    if result.returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=APT_TIMEOUT_S, check=True)  # fmt: skip
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=APT_TIMEOUT_S)  # fmt: skip
    if result.returncode != 0 or missing_programs():
        raise RuntimeError(
            f"apt-get install {' '.join(PACKAGES)} failed (exit {result.returncode}), still "
            f"missing {missing_programs()}:\n{result.stdout}\n{result.stderr}"
        )


class SingleNodeSlurm:
    """A running one-node Slurm cluster under ``root``; use :attr:`env` for its clients."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.node = socket.gethostname().split(".")[0]
        self.cpus = os.cpu_count() or 1
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "run" / "munge.socket"
        self._daemons: dict[str, subprocess.Popen[bytes]] = {}
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        for name in ("TF_CONFIG", "TENSORFLEET_SECRET", "TENSORFLEET_SECRET_FILE"):
            self.env.pop(name, None)
        for name in [n for n in self.env if n.startswith("SLURM_") and n != "SLURM_CONF"]:
            del self.env[name]

    def start(self) -> None:
        for sub in ("run", "state", "spool", "log"):
            (self.root / sub).mkdir(mode=0o755, exist_ok=True)
        key = self.root / "run" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        ctld_port, slurmd_port = free_ports(2)
        self.conf.write_text(self._config(ctld_port, slurmd_port))
        run, log = self.root / "run", self.root / "log"
        self._spawn("munged", ["munged", "--foreground", "--force", f"--socket={self.munge_socket}", f"--key-file={key}", f"--log-file={log / 'munged.log'}", f"--pid-file={run / 'munged.pid'}", f"--seed-file={run / 'munged.seed'}"])  # fmt: skip
        self._wait_for(lambda: self.munge_socket.exists(), "munged to create its socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        self._spawn("slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", self.node])
        self._wait_for(self._node_idle, f"node {self.node} to be idle in sinfo")

    def _config(self, ctld_port: int, slurmd_port: int) -> str:
        run, log = self.root / "run", self.root / "log"
        return f"""\
ClusterName=tensorfleet-test
SlurmctldHost={self.node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={self.root / "state"}
SlurmdSpoolDir={self.root / "spool"}
SlurmctldPidFile={run / "slurmctld.pid"}
SlurmdPidFile={run / "slurmd.pid"}
SlurmctldLogFile={log / "slurmctld.log"}
SlurmdLogFile={log / "slurmd.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmdParameters=config_overrides
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""

    def _spawn(self, name: str, command: list[str]) -> None:
        with open(self.root / "log" / f"{name}.out", "wb") as out:
            self._daemons[name] = subprocess.Popen(
                command, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip

    def _node_idle(self) -> bool:
        result = subprocess.run(
            ["sinfo", "-h", "-n", self.node, "-o", "%T"], env=self.env,
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
        return result.returncode == 0 and result.stdout.strip() == "idle"

    def _wait_for(self, condition, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not condition():
            for name, process in self._daemons.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited with {process.returncode} while waiting for {what}\n{self.logs()}")  # fmt: skip
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {START_TIMEOUT_S} s waiting for {what}\n{self.logs()}")  # fmt: skip
            time.sleep(0.2)

    def run_batch_job(self, script: Path, cwd: Path, timeout_s: float) -> tuple[str, int, str]:
        """Submit ``script`` with ``sbatch`` and wait for its end by polling the controller
        every quarter second: ``(job state, exit code, the job's record)``. Used instead of
        ``sbatch --wait``, whose own polling backs off to many seconds per check (it added
        about 25 s to every run here). On the deadline the job is cancelled and the error
        carries the record and the daemons' logs."""
        submitted = subprocess.run(
            ["sbatch", "--parsable", str(script)], env=self.env, cwd=cwd,
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        if submitted.returncode != 0:
            raise RuntimeError(f"sbatch failed (exit {submitted.returncode}): {submitted.stderr}")
        job = submitted.stdout.strip().split(";")[0]
        deadline = time.monotonic() + timeout_s
        record = ""
        while time.monotonic() < deadline:
            shown = subprocess.run(
                ["scontrol", "-o", "show", "job", job], env=self.env,
                capture_output=True, text=True, timeout=10,
            )  # fmt: skip
            record = shown.stdout.strip()
            fields = dict(f.split("=", 1) for f in record.split() if "=" in f)
            state = fields.get("JobState", "")
            if state and state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
                return state, int(fields.get("ExitCode", "-1:0").split(":")[0]), record
            time.sleep(0.25)
        subprocess.run(["scancel", job], env=self.env, capture_output=True, timeout=10)
        raise AssertionError(
            f"job {job} still running after {timeout_s} s\n{record}\n{self.logs()}"
        )

    def logs(self) -> str:
        """The daemons' logs, for failure messages."""
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            text = path.read_text(errors="replace")[-3000:]
            parts.append(f"--- {path.name} ---\n{text}")
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel every job, drain, stop the daemons, end stray job step processes."""
        if "slurmctld" in self._daemons and self._daemons["slurmctld"].poll() is None:
            subprocess.run(["scancel", "--user", "root"], env=self.env, capture_output=True, timeout=10)  # fmt: skip
            deadline = time.monotonic() + DRAIN_TIMEOUT_S
            while time.monotonic() < deadline:
                queue = subprocess.run(["squeue", "-h"], env=self.env, capture_output=True, text=True, timeout=10)  # fmt: skip
                if queue.returncode != 0 or not queue.stdout.strip():
                    break
                time.sleep(0.2)
        for name in ("slurmd", "slurmctld", "munged"):
            process = self._daemons.get(name)
            if process is None or process.poll() is not None:
                continue
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=15)
        # Step processes finish their own clean-up shortly after their job; give them that.
        deadline = time.monotonic() + DRAIN_TIMEOUT_S / 3
        while self._stray_step_processes() and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in self._stray_step_processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _stray_step_processes(self) -> list[int]:
        """``slurmstepd`` processes started by this cluster's slurmd (they carry its
        ``SLURM_CONF``); slurmd leaves them running when it stops."""
        marker = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if (entry / "comm").read_text().strip() != "slurmstepd":
                    continue
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
        return found
