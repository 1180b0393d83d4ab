"""Which process a rank is, in terms that stay true across hosts and pid reuse: what the
hang detector needs to name a rank in a log and to kill it safely from its own host."""
from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Identity:
    """Where a rank runs: enough to name it in a log and to kill it safely from its host."""

    rank: int
    node: str
    host: str  # hostname, boot id and pid namespace: pids mean the same thing only within one
    pid: int
    started: str  # the process start time (/proc/<pid>/stat): a reused pid is never killed

    def encode(self) -> str:
        return "\t".join(map(str, (self.rank, self.node, self.host, self.pid, self.started)))

    @classmethod
    def decode(cls, text: str) -> Identity:
        rank, node, host, pid, started = text.split("\t")
        return cls(int(rank), node, host, int(pid), started)


def this_process(rank: int) -> Identity:
    node = os.environ.get("CKPT_GUARD_NODE") or socket.gethostname().split(".")[0]
    return Identity(rank, node, host_key(), os.getpid(), started(os.getpid()))


def boot_time() -> float | None:
    """When this host booted (epoch seconds): /proc's start times count from it."""
    for line in _read("/proc/stat").splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    return None


def host_key() -> str:
    """This host and pid namespace: two ranks with the same key see the same pids."""
    boot = _read("/proc/sys/kernel/random/boot_id") or uuid.getnode()
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = ""
    return f"{socket.gethostname()}/{boot}/{ns}"


def proc_stat(pid: int) -> list[str]:
    """/proc/<pid>/stat after the command name: [0] the state, [19] the start time in
    clock ticks since boot ([] when unknown or gone)."""
    stat = _read(f"/proc/{pid}/stat")
    return stat.rsplit(")", 1)[1].split() if stat else []


def started(pid: int) -> str:
    """When ``pid`` started ('' when unknown or gone): with the pid, names one process."""
    return "".join(proc_stat(pid)[19:20])


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""
