"""A real one-node Slurm on loopback for the tests: Debian's munged, slurmctld and slurmd
(22.05), run as root in the foreground without systemd, configured in a directory of
their own (non-default ports, their own munge key and socket), stopped after. Clients
find it through $SLURM_CONF."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.procs import free_port, stop_process, wait_for

NODESET = "gpus"   # a nodeset naming the one node: `predictor act drain gpus` must be refused
DAEMONS = ("munged", "slurmctld", "slurmd", "scontrol", "sbatch")
# Debian puts munged and the Slurm daemons in /usr/sbin, which a non-root PATH may lack.
SBIN = "/usr/sbin"

SLURM_CONF = """\
ClusterName=ckptguard
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
PlugStackConfig={dir}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=30
NodeName={node} NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
NodeSet={nodeset} Nodes={node}
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


def binary(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path=SBIN)
    if path is None:  # fail, not skip: scripts/apt-packages.txt installs them
        pytest.fail(f"{name} not found: install the Debian packages slurmctld, slurmd, slurm-client and munge")
    return path


class SlurmCluster:
    """munged + slurmctld + slurmd for one node named after this host (8 CPUs declared,
    so a few small jobs run side by side on a 2-core machine)."""

    def __init__(self) -> None:
        if os.geteuid() != 0:
            pytest.skip(f"the Slurm fixture runs munged, slurmctld and slurmd as root; the tests run as uid "
                        f"{os.geteuid()}")
        paths = {name: binary(name) for name in DAEMONS}
        # Not under pytest's 0700 tmp dir: a non-root client must reach the config and munge socket.
        self.dir = Path(tempfile.mkdtemp(prefix="ckpt-guard-slurm-"))
        self.dir.chmod(0o755)
        self.node = socket.gethostname().split(".")[0]
        munge = self.dir / "munge"
        munge.mkdir(mode=0o711)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        shutil.chown(munge, "munge", "munge")
        shutil.chown(key, "munge", "munge")
        for sub in ("state", "spool"):
            (self.dir / sub).mkdir()
        (self.dir / "plugstack.conf").touch()
        self.conf = self.dir / "slurm.conf"
        self.conf.write_text(SLURM_CONF.format(node=self.node, dir=self.dir, munge_socket=munge / "socket",
                                               ctld_port=free_port(), slurmd_port=free_port(), nodeset=NODESET))
        self.conf.chmod(0o644)
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: list[subprocess.Popen] = []
        try:
            self._start(paths, munge)
        except BaseException:
            self.stop()
            raise

    def _start(self, paths: dict[str, str], munge: Path) -> None:
        self.procs.append(subprocess.Popen(
            ["runuser", "-u", "munge", "--", paths["munged"], "--foreground", "--force",
             f"--key-file={munge / 'munge.key'}", f"--socket={munge / 'socket'}", f"--pid-file={munge / 'pid'}",
             f"--log-file={munge / 'log'}", f"--seed-file={munge / 'seed'}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))   # its log file has it all
        if not wait_for(lambda: (munge / "socket").exists(), timeout=30):
            pytest.fail(f"munged did not start: {self._log(munge / 'log')}")
        for daemon in ("slurmctld", "slurmd"):
            args = [paths[daemon], "-D", "-f", str(self.conf)] + (["-N", self.node] if daemon == "slurmd" else [])
            self.procs.append(subprocess.Popen(args, env=self.env, stdout=subprocess.DEVNULL,
                                               stderr=subprocess.DEVNULL))
        if not wait_for(lambda: "idle" in self.scontrol("show", "node", self.node, check=False).stdout.lower(),
                        timeout=60, interval=0.5):
            pytest.fail(f"the Slurm node did not come up idle: {self._log(self.dir / 'slurmctld.log')}\n"
                        f"{self._log(self.dir / 'slurmd.log')}")

    @staticmethod
    def _log(path: Path) -> str:
        return path.read_text()[-3000:] if path.exists() else f"({path} missing)"

    def run(self, *args: str, check: bool = True, user: str | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster (as ``user`` when given; ``env`` adds
        variables, which sbatch passes on to the job)."""
        cmd = (["runuser", "-u", user, "--"] if user else []) + list(args)
        return subprocess.run(cmd, env={**self.env, **(env or {})}, capture_output=True, text=True, check=check,
                              timeout=60)

    def scontrol(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.run("scontrol", *args, check=check)

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as key=value pairs (JobState, Restarts, Reason, ...)."""
        out = self.scontrol("show", "job", "-o", job_id).stdout
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def node_state(self) -> dict[str, str]:
        out = self.scontrol("show", "node", "-o", self.node).stdout
        fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
        reason = out.split("Reason=", 1)[1].strip() if "Reason=" in out else ""
        return {"State": fields["State"], "Reason": reason}

    def wait_state(self, job_id: str, states: set[str], timeout: float = 120) -> dict[str, str]:
        info = wait_for(lambda: (j := self.job(job_id))["JobState"] in states and j, timeout=timeout, interval=0.5)
        assert info, f"job {job_id} never reached {states}: {self.job(job_id)}"
        return info

    def stop(self) -> None:
        """Cancel every job, then stop the daemons this fixture started, newest first."""
        if len(self.procs) == 3:
            # running jobs: SIGKILL to every process at once (not SIGTERM + KillWait); then the pending ones
            self.run("scancel", "--user=root", "--full", "--signal=KILL", check=False)
            self.run("scancel", "--user=root", check=False)
            wait_for(lambda: not self.run("squeue", "-h", "-t", "R,CG", check=False).stdout.strip(), timeout=30)
        for proc in reversed(self.procs):
            stop_process(proc, grace_s=15)
        self.procs.clear()
        time.sleep(0.1)
        shutil.rmtree(self.dir, ignore_errors=True)
