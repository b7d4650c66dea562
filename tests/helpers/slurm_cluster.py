"""A real one-node SLURM cluster on localhost (munged + slurmctld + slurmd), for the launcher tests.

Uses the daemons installed on the machine (Debian's `slurm-wlm` and `munge`, which .ci/run installs) and needs
root to start them; the tests never install anything. Without them the SLURM tests skip, saying why and the
command that enables them, unless FSDP2GEN_REQUIRE_SLURM=1 (set by .ci/run): then they fail, so CI never skips.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SLURM_CONF = """\
ClusterName=fsdp2gen-test
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


TOOLS = ("slurmctld", "slurmd", "sbatch", "sinfo", "munged", "munge", "unmunge")
ENABLE = "sudo apt-get install slurm-wlm munge, then run the tests as root (as .ci/run does)"


def unavailable() -> str | None:
    """Why this machine cannot run a local SLURM cluster, with the command that enables it; None if it can."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"SLURM tests need {', '.join(missing)} (not on PATH); to run them: {ENABLE}"
    if os.geteuid() != 0:
        return f"SLURM tests start slurmctld, slurmd and munged, which needs root; to run them: {ENABLE}"
    return None


def _munge_works() -> bool:
    encoded = subprocess.run(["munge", "-n"], capture_output=True)
    return (
        encoded.returncode == 0
        and subprocess.run(["unmunge"], input=encoded.stdout, capture_output=True).returncode == 0
    )


def _start_munged() -> None:
    for folder in ("/run/munge", "/var/log/munge", "/var/lib/munge"):
        os.makedirs(folder, exist_ok=True)
        shutil.chown(folder, "munge", "munge")
    subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True)


def _stop(pid_file: Path) -> None:
    if pid_file.exists():
        try:
            os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
        except (ProcessLookupError, ValueError):
            pass


@contextmanager
def local_slurm_cluster(root: Path, cpus: int = 2) -> Iterator[dict[str, str]]:
    """Start the daemons under `root`; yield the environment that points sbatch at them; stop them."""
    for folder in ("state", "spool"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    conf = root / "slurm.conf"
    conf.write_text(SLURM_CONF.format(root=root, cpus=cpus, ctld_port=free_port(), slurmd_port=free_port()))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    started_munged = False
    if not _munge_works():
        _start_munged()
        started_munged = True
    try:
        subprocess.run(["slurmctld", "-f", str(conf), "-L", str(root / "slurmctld.log")], env=env, check=True)
        subprocess.run(
            ["slurmd", "-f", str(conf), "-N", "localhost", "-L", str(root / "slurmd.log")], env=env, check=True
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout
            if state.strip() == "idle":
                break
            time.sleep(0.5)
        else:
            raise RuntimeError(f"SLURM node never became idle; see {root}/slurmctld.log and slurmd.log")
        yield env
    finally:
        _stop(root / "slurmd.pid")
        _stop(root / "slurmctld.pid")
        if started_munged:
            subprocess.run(["pkill", "-x", "munged"])


# Job states after which a job never runs again (`scontrol show job`'s JobState).
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE"}  # fmt: skip


def job_fields(job_id: str, env: dict[str, str]) -> dict[str, str]:
    """`scontrol show job -o JOB_ID`'s fields (JobState, ExitCode, ...), as a dict."""
    shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True, text=True,
                           timeout=60, check=True)  # fmt: skip
    return dict(field.split("=", 1) for field in shown.stdout.split() if "=" in field)


def wait_for_job(job_id: str, env: dict[str, str], timeout: float = 300) -> int:
    """Wait until the job has ended; its exit code, as `sbatch --wait` returns it. `sbatch --wait` itself sleeps
    2 s, then 8 s, then 32 s between its polls (measured here: a 12 s job returned after 42 s), which leaves the test
    waiting on an ended job for up to half a minute; this asks slurmctld every 0.5 s (3.5 ms of CPU a call; the job
    is kept there for MinJobAge, 300 s, after it ends)."""
    deadline = time.monotonic() + timeout
    while (fields := job_fields(job_id, env))["JobState"] not in ENDED:
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still {fields['JobState']} after {timeout} s")
        time.sleep(0.5)
    code, signal_number = (int(part) for part in fields["ExitCode"].split(":"))
    return code or (128 + signal_number if signal_number else 0) or int(fields["JobState"] != "COMPLETED")
