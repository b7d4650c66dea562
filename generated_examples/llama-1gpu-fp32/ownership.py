"""Which run owns job.output_dir, and which launch a process belongs to.

- The run lock: rank 0 holds an exclusive flock on job.output_dir/run.lock for as long as it lives. The kernel
  releases it when the process ends, however it ends, so a lock is never stale; the file itself stays (deleting
  it would let a second run lock a new file of the same name). The holder writes who it is into the file, for
  the line that refuses a second run.
  The lock must hold across nodes: on a filesystem where flock fails (Lustre mounted without -o flock: ENOSYS;
  NFSv3 without a lock daemon: ENOLCK; others: EOPNOTSUPP) the run is refused in one line that names the
  filesystem and the fix (flock_refusal), never run without a lock. Why no fallback lock file (O_EXCL): the
  kernel would not release it when its holder dies, and whether a holder on another node still lives cannot be
  told (its pid is not visible; a suspended job stops any heartbeat), so it would either be taken from a live
  run (two runs mixing in one folder) or have to be deleted by hand after every crash. A filesystem whose flock
  is local to each node (Lustre -o localflock, NFS -o nolock) succeeds and cannot be told apart: README.md.
- The launch id: the launch scripts give every rank of one launch the same TRAIN_LAUNCH_ID (a new uuid per
  launch; the SLURM job id, which a requeue keeps). run.json records it, and a restart continues the run in
  job.output_dir only if it was started by its own launch (run_folder.resuming).
- Ranks die with their launcher: a rank exits when torchrun (its parent) or the launch script is gone, so a
  killed launcher leaves nothing training.

Linux only where it says so (/proc, prctl); elsewhere those parts do nothing.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import re
import signal
import socket
import sys
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

LOCK_FILE = "run.lock"
LAUNCH_ID = "TRAIN_LAUNCH_ID"  # set by every launcher (scripts/, ray) for every rank of a launch
LAUNCHER = "TRAIN_LAUNCHER"  # "host:pid:start time" of the launch script, set by scripts/restarts.sh
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
# What flock fails with where the filesystem does not lock (EOPNOTSUPP is ENOTSUP on Linux).
NO_FLOCK = {errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOLCK}

_PROCESS_LAUNCH = f"process-{uuid.uuid4().hex}"
_held_locks: list = []  # open lock files: the lock lasts as long as the file stays open


def launch_id() -> str:
    """The launch this process belongs to, the same for every attempt of it (restarts).

    Without the launch scripts: under `torchrun train.py` the torchrun agent that started this process, which is
    the parent of every attempt's workers on this node (TORCHELASTIC_RUN_ID would not do: it is "none" with a
    static rendezvous, and a --rdzv-id that the user may reuse for every launch); a plain `python train.py` is
    its own launch (it has no restarts).
    """
    if os.environ.get(LAUNCH_ID):
        return os.environ[LAUNCH_ID]
    if "TORCHELASTIC_RUN_ID" in os.environ:
        agent = os.getppid()
        return f"torchrun-{socket.gethostname()}-{agent}-{process_start(agent)}"
    return _PROCESS_LAUNCH


def attempt_prefix() -> str | None:
    """The key prefix that keeps this torchrun attempt's rendezvous apart from the attempts before it, or None.

    torchrun keeps one store for all its restarts (--max-restarts; torch's own TCPStore, reused since 2.6), where
    restarted workers would read the addresses the dead attempt's workers left and fail to connect (gloo:
    "Connection refused"). With one torchrun, its restart count, the same on every rank, gives each attempt its own
    keys. With several nodes each torchrun counts only its own restarts (the others restart on the membership
    change, counting 0), so no prefix can agree across nodes: such restarts need a fresh store per attempt, which
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives torchrun; without it they are refused here, in one line, instead of
    failing at the first restart. The launch scripts start a new torchrun (a new store) per attempt and pass
    --max-restarts 0."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None  # the launch scripts' Ray workers, or a hand-set RANK: no torchrun, no restarts
    if int(os.environ.get("GROUP_WORLD_SIZE", 1)) == 1:
        return f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0))
    if restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        from errors import stop

        stop(
            f"torchrun --max-restarts {restarts} over {os.environ['GROUP_WORLD_SIZE']} nodes would restart the ranks "
            "into the dead attempt's rendezvous store (each node counts its own restarts); give every node's torchrun "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a fresh store per attempt), or use the launch scripts"
        )
    return None


def process_start(pid: int) -> str | None:
    """When process `pid` started (field 22 of /proc/PID/stat, in clock ticks since boot), or None if it is gone
    (or a zombie). With the pid it names one process: a pid can be reused, a (pid, start time) pair cannot."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after "PID (COMMAND)", which may hold spaces
    return None if fields[0] in ("Z", "X") else fields[19]


def die_with_launcher() -> None:
    """Make this rank exit (SIGKILL) as soon as torchrun or the launch script that started it is gone.

    torchrun starts each worker in a session of its own, so nothing sent to the launcher's process group reaches
    the workers. Two mechanisms, because a killed launch script is not the workers' parent:
    - PR_SET_PDEATHSIG: the kernel signals this process when the thread that forked it ends. torchrun forks its
      workers from its main thread (LocalElasticAgent, no thread pool), so this fires when torchrun dies.
    - a watchdog thread that polls, once a second, whether the launch script (TRAIN_LAUNCHER, on this host) and
      this process's parent are still the processes they were (pid and start time).
    """
    watched = []
    launcher = os.environ.get(LAUNCHER, "").split(":")
    if len(launcher) == 3 and launcher[0] == socket.gethostname():  # ranks on other nodes cannot see it
        watched.append((int(launcher[1]), launcher[2]))
    if "TORCHELASTIC_RUN_ID" in os.environ:
        parent = os.getppid()
        if sys.platform == "linux":
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        watched.append((parent, process_start(parent)))
    if not watched or sys.platform != "linux":
        return

    def watch() -> None:
        # (A start time of None: the process was gone before it could be read.)
        while all(start is not None and process_start(pid) == start for pid, start in watched):
            time.sleep(1)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="die-with-launcher", daemon=True).start()


def lock_holder(output_dir: Path) -> dict | None:
    """Who holds the run lock of `output_dir` ({} if it has not said yet), or None if nobody does.

    A look, not a take: a shared lock for an instant, which creates nothing and leaves nothing behind."""
    try:
        file = open(output_dir / LOCK_FILE)
    except OSError:
        return None  # no lock file: no run has ever held this folder
    with file:
        try:
            fcntl.flock(file, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return read_holder(file)
        fcntl.flock(file, fcntl.LOCK_UN)
    return None


def take_run_lock(output_dir: Path, launch_ids: list[str], wait_for_own_launch_s: float = 30) -> dict | None:
    """Lock `output_dir` for the life of this process and write who holds it; or return the holder.

    A holder of this same launch (the previous attempt's rank 0, still ending) is waited for, up to
    `wait_for_own_launch_s`; another one gets a second only (a preflight's look holds the lock for an instant).
    """
    file = open(output_dir / LOCK_FILE, "a+")
    started = time.monotonic()
    while True:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            holder = read_holder(file)
            patience = wait_for_own_launch_s if set(holder.get("launch", [])) & set(launch_ids) else 1
            if time.monotonic() - started > patience:
                file.close()
                return holder
            time.sleep(0.1)
    launcher = os.environ.get(LAUNCHER, "").split(":")
    holder = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "launcher_pid": int(launcher[1]) if len(launcher) == 3 else None,
        "launch": launch_ids,
        "since": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    file.truncate(0)
    file.write(json.dumps(holder) + "\n")
    file.flush()
    _held_locks.append(file)
    return None


def read_holder(file) -> dict:
    """What the holder wrote into the lock file; {} while it has not (it writes right after locking)."""
    for _ in range(10):
        file.seek(0)
        try:
            holder = json.loads(file.read())
            if isinstance(holder, dict):
                return holder
        except ValueError:
            pass
        time.sleep(0.05)
    return {}


def describe_holder(output_dir: Path, holder: dict) -> str:
    """One line: who holds `output_dir`, and what to do about it."""
    if not holder:
        return (
            f"job.output_dir {output_dir} is in use by another run (its rank 0 is just starting); wait for it to "
            "finish, stop it, or choose another --job.output_dir"
        )
    stop = holder.get("launcher_pid") or holder.get("pid")
    launcher = f", launcher pid {holder['launcher_pid']}" if holder.get("launcher_pid") else ""
    return (
        f"job.output_dir {output_dir} is in use by another run: rank 0 pid {holder.get('pid')} on "
        f"{holder.get('host')}{launcher}, launch {','.join(holder.get('launch', []))}, since {holder.get('since')}; "
        f"wait for it to finish, stop it (kill {stop} on {holder.get('host')}), or choose another --job.output_dir"
    )


def check_flock(output_dir: Path) -> None:
    """Take and drop a lock on a file of `output_dir` (created and removed here): the OSError of a flock that
    does not work on its filesystem (NO_FLOCK; flock_refusal names it), before a run relies on it."""
    probe = output_dir / f".lock-test-{uuid.uuid4().hex}"
    try:
        with open(probe, "w") as file:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(file, fcntl.LOCK_UN)
    finally:
        probe.unlink(missing_ok=True)


def flock_refusal(output_dir: Path, exc: OSError) -> str | None:
    """The one line for a flock that failed with `exc` because `output_dir`'s filesystem does not lock (None for
    any other failure): it names the filesystem (/proc/self/mountinfo) and the fix."""
    if exc.errno not in NO_FLOCK:
        return None
    return (
        f"job.output_dir {output_dir} is on {mount_of(output_dir)}, where flock does not work "
        f"({os.strerror(exc.errno)}); the run lock that keeps two runs out of one folder needs it on every node: "
        "mount that filesystem with flock (Lustre: -o flock; NFS: version 4, or 3 with its lock daemon running), or "
        "choose a --job.output_dir on a filesystem where flock works"
    )


def mount_of(path: Path) -> str:
    """The filesystem `path` is on, in words ("the lustre filesystem mgs@tcp:/fs (mounted at /lustre)"), from
    /proc/self/mountinfo: the longest mount point that contains it. Linux only; elsewhere "its filesystem"."""
    path, found = str(path.resolve()), None
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return "its filesystem"
    for line in lines:
        fields = line.split()
        # ID PARENT DEV ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPEROPTIONS; octal escapes (\040)
        point = re.sub(r"\\([0-7]{3})", lambda escape: chr(int(escape.group(1), 8)), fields[4])
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (found is None or len(point) >= len(found[0])):
            rest = fields[fields.index("-") + 1 :]
            found = (point, rest[0], rest[1] if len(rest) > 1 else "?")
    if found is None:
        return "its filesystem"
    point, fstype, source = found
    return f"the {fstype} filesystem {source} (mounted at {point})"


def run_folder_above(output_dir: Path) -> tuple[Path, str] | None:
    """The nearest folder above `output_dir` that holds a run, and what shows it; None if there is none."""
    for parent in output_dir.resolve().parents:
        # os.path: False, not an error, for a parent this user may not read.
        for name in ("run.json", LOCK_FILE):
            if os.path.isfile(parent / name):
                return parent, name
        if any(os.path.isfile(step / "checkpoint.json") for step in (parent / "checkpoints").glob("step-*")):
            return parent, "checkpoints"
    return None
