"""Every run owns its job.output_dir (issue 24, data paths 1-5), for real: launch_local.sh and torchrun, 2 gloo ranks.

- two launches into one folder at once: one trains, the other stops in one line naming the holder;
- a killed launcher (or torchrun) leaves no rank training, and a relaunch resumes cleanly;
- a restart continues only the run its own launch started, whatever the restart counters say;
- an output folder inside another run's folder is refused, nothing deleted;
- a folder with run.json and no checkpoint is not continued by another model;
- a job.output_dir on a filesystem whose flock does not work (Lustre without -o flock, NFSv3 without its lock
  daemon; here a FUSE filesystem that answers lock requests so) is refused in one line naming it, before torchrun;
- a usage error found after the ranks started stops the launch once, exit code 2, never retried, and nothing
  but its line is printed (no torchrun traceback: tests/test_checkpoint_integrity.py's launch of a run whose only
  checkpoint is corrupt); a bare torchrun's restarts do not repeat it.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import REPO, TINY, generate, metrics, torchrun_env, tree
from tests.helpers import noflock_fs
from tests.helpers.in_process import preflight_cases_in_this_process
from tests.helpers.scripts import captured_in_this_process

# The generated project's ownership.py is plain Python (no template code, no torch): its mechanisms are tested
# here directly, as well as through real launches below.
OWNERSHIP = REPO / "templates" / "project" / "ownership.py"

FRESH = "start a new run in another --job.output_dir"


def load_ownership():
    import importlib.util

    spec = importlib.util.spec_from_file_location("ownership", OWNERSHIP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_of_many_processes_taking_the_lock_at_once_exactly_one_wins(tmp_path: Path) -> None:
    # 6 processes race for one folder's lock; each then keeps what it got for a moment, as a run would.
    race = (
        "import json, sys, time; sys.path.insert(0, sys.argv[1]); import ownership; from pathlib import Path; "
        "holder = ownership.take_run_lock(Path(sys.argv[2]), [sys.argv[3]]); "
        "print(json.dumps(holder), flush=True); time.sleep(3)"
    )
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", race, str(OWNERSHIP.parent), str(tmp_path), f"launch-{i}"],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(6)
    ]
    results = [json.loads(racer.communicate(timeout=60)[0]) for racer in racers]
    winners = [racer.pid for racer, result in zip(racers, results, strict=True) if result is None]
    assert len(winners) == 1, results
    # Every loser names the winner; the lock file says the same.
    holder = json.loads((tmp_path / "run.lock").read_text())
    assert holder["pid"] == winners[0] and holder["host"] == socket.gethostname()
    assert [result for result in results if result is not None] == [holder] * 5
    # The winner has exited: the kernel released its lock, nobody holds the folder now.
    assert load_ownership().lock_holder(tmp_path) is None


SEGMENT = st.sampled_from(["a", "b", "checkpoints", "step-1", "step-2.tmp", "run-b", ".", ".."])


@settings(max_examples=200, deadline=None)
@given(
    run_at=st.lists(SEGMENT, max_size=3),
    marker=st.sampled_from(["run.json", "run.lock", "checkpoints/step-3/checkpoint.json", None]),
    below=st.lists(SEGMENT, max_size=5),
    link=st.booleans(),
)
def test_an_output_dir_is_found_inside_a_run_folder_however_it_is_spelled(
    tmp_path_factory: pytest.TempPathFactory, run_at: list[str], marker: str | None, below: list[str], link: bool
) -> None:
    # A run folder (or none) somewhere below a root, and an output_dir written as any path from the root:
    # through "." and "..", and through a symlink to the root when `link`.
    root = Path(os.path.realpath(tmp_path_factory.mktemp("tree")))
    ownership = load_ownership()
    run_folder = Path(os.path.normpath(root.joinpath(*run_at))) if marker else None
    if run_folder is not None and run_folder.is_relative_to(root):
        (run_folder / marker).parent.mkdir(parents=True, exist_ok=True)
        (run_folder / marker).write_text("{}")
    else:
        run_folder = None
    start = root
    if link:
        (root.parent / f"{root.name}-link").symlink_to(root)
        start = root.parent / f"{root.name}-link"
    output_dir = start.joinpath(*run_at, *below)
    real = Path(os.path.realpath(output_dir))
    found = ownership.run_folder_above(output_dir)
    inside = run_folder is not None and real != run_folder and real.is_relative_to(run_folder)
    if inside:
        assert found is not None and found[0] == run_folder, (output_dir, found)
    else:
        # Outside the run folder (or none): only a folder above the root could hold a run, and none does.
        assert found is None or not found[0].is_relative_to(root.parent), (output_dir, found)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("ownership") / "run", "--gpus", "2", "--fp32")


def launch(project: Path, out: Path, log: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """scripts/launch_local.sh on 2 CPU ranks (one restart allowed), output in the files log.out and log.err."""
    return subprocess.Popen(
        ["scripts/launch_local.sh", *TINY, "--job.output_dir", str(out), *args],
        cwd=project,
        env={**torchrun_env(), "NPROC": "2", "DEVICE": "cpu", "MAX_RESTARTS": "1", **(env or {})},
        stdout=open(log.with_suffix(".out"), "w"),
        stderr=open(log.with_suffix(".err"), "w"),
    )


def run(project: Path, out: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """launch_local.sh to its end."""
    return subprocess.run(
        ["scripts/launch_local.sh", *TINY, "--job.output_dir", str(out), *args],
        cwd=project, env={**torchrun_env(), "NPROC": "2", "DEVICE": "cpu", "MAX_RESTARTS": "1", **(env or {})},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def processes_of(out: Path) -> list[str]:
    """The command lines of the live processes launched for `out` (launcher, torchrun, ranks)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if str(out) in cmdline and state != "Z" and proc.name != str(os.getpid()):
            found.append(f"{proc.name}: {cmdline}")
    return found


def wait_for(condition, timeout: float, what: str, poll: float = 0.1) -> float:
    """Poll `condition` until it holds; return the seconds it took, or fail naming `what`."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout, f"{what}: not within {timeout} s"
        time.sleep(poll)
    return time.monotonic() - started


def steps_logged(out: Path) -> int:
    try:
        return len((out / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def error_lines(text: str) -> list[str]:
    return re.findall(r"^\S+\.py: error: .*$", text, flags=re.M)


@pytest.fixture(scope="module")
def race(project: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two launches at once into one folder; once the winner trains and the loser has stopped, the winner's launcher
    is killed (SIGKILL); then a relaunch continues the run. What each step left, for the two tests below."""
    tmp = tmp_path_factory.mktemp("race")
    out, steps = tmp / "out", 40
    args = ["--training.steps", str(steps), "--checkpoint.interval", "4"]
    launches = [launch(project, out, tmp / f"launch{i}", *args) for i in (0, 1)]
    # The loser stops within moments (refused by preflight, or by its rank 0 if both passed preflight at once);
    # the winner is killed between its checkpoints of steps 4 and 8 (usually), far from its end, so that the
    # relaunch has rows to set aside.
    # (Its line, printed as it is refused, marks it: its exit may come a moment later, once torchrun has ended.)
    errors = [tmp / f"launch{i}.err" for i in (0, 1)]
    wait_for(lambda: any("error: " in path.read_text() for path in errors), 300, "one launch refused")
    wait_for(lambda: steps_logged(out) >= 6, 300, "6 steps", poll=0.02)
    loser = next(i for i in (0, 1) if "error: " in errors[i].read_text())
    winner = 1 - loser
    assert launches[winner].poll() is None, "the winner ended before the kill: nothing was tested"
    holder = json.loads((out / "run.lock").read_text())
    os.kill(launches[winner].pid, signal.SIGKILL)
    launches[winner].wait()
    # The loser's exit after the kill, not before: on a loaded machine its torchrun can take longer to end than the
    # winner's 40 steps take to run.
    assert launches[loser].wait(timeout=300) == 2
    # The ranks notice within a second (their watchdog), torchrun then ends as its ranks did.
    gone = wait_for(lambda: not processes_of(out), 10, "every process of the killed launch gone")
    print(f"all processes gone {gone:.1f} s after the launcher's SIGKILL")
    logged = steps_logged(out)
    time.sleep(2)
    still_logged = steps_logged(out)
    relaunch = run(project, out, *args)
    return {
        "out": out, "steps": steps, "launches": launches, "winner": winner, "holder": holder, "logged": logged,
        "still_logged": still_logged, "relaunch": relaunch,
        "loser_err": (tmp / f"launch{loser}.err").read_text(), "loser_out": (tmp / f"launch{loser}.out").read_text(),
    }  # fmt: skip


def test_two_launches_at_once_into_one_folder_one_trains_the_other_is_refused(race: dict) -> None:
    out, holder, winner = race["out"], race["holder"], race["launches"][race["winner"]]
    host = socket.gethostname()
    # One line, from preflight (the winner held the folder already) or from the loser's rank 0 (both passed
    # preflight at once; the lock decides): it names the winner's launcher, the process to stop.
    assert holder["launcher_pid"] == winner.pid
    expected = (
        f"job.output_dir {out} is in use by another run: rank 0 pid {holder['pid']} on {host}, launcher pid "
        f"{winner.pid}, launch {holder['launch'][0]}, since {holder['since']}; wait for it to finish, stop "
        f"it (kill {winner.pid} on {host}), or choose another --job.output_dir"
    )
    # Nothing else (issue 40): no torchrun traceback after a refusal by the ranks, no restart (exit code 2).
    assert re.fullmatch(rf"(preflight|train)\.py: error: {re.escape(expected)}\n", race["loser_err"]), race["loser_err"]
    assert "parameters" not in race["loser_out"]  # the loser built no model
    # Only the winner's run trained there, continued by the relaunch: one run id.
    records = metrics(out)
    assert [r["step"] for r in records] == list(range(1, race["steps"] + 1))
    assert {r["run_id"] for r in records} == {json.loads((out / "run.json").read_text())["run_id"]}


def test_a_killed_launcher_leaves_no_rank_and_a_relaunch_resumes(race: dict) -> None:
    out, steps, logged, relaunch = race["out"], race["steps"], race["logged"], race["relaunch"]
    assert logged < steps, "the run ended before the kill: nothing was tested"
    assert race["still_logged"] == logged  # nothing trained after the kill
    assert relaunch.returncode == 0, relaunch.stderr[-3000:]
    resumed = int(re.search(r"resumed from \S+/step-(\d+) at step", relaunch.stdout).group(1))
    assert 4 <= resumed <= logged
    # The first launch's steps up to the checkpoint, then the relaunch's, one row per step: never two runs logging
    # at once. The first launch's rows past the checkpoint are kept aside, in order (issue 40).
    assert [r["step"] for r in metrics(out)] == list(range(1, steps + 1))
    aside = metrics(out, "metrics.rewound.jsonl") if (out / "metrics.rewound.jsonl").exists() else []
    assert [r["step"] for r in aside] == list(range(resumed + 1, logged + 1))


def rank_process(out: Path, rank: int) -> int | None:
    """The pid of the rank `rank` training into `out`, if it is running."""
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes()
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"train.py" in cmdline and str(out).encode() in cmdline and f"RANK={rank}".encode() in environ:
            return int(proc.name)
    return None


def test_a_crash_is_restarted_and_a_new_run_continues_itself(project: Path, tmp_path: Path) -> None:
    # The launch script's own restart (one torchrun per attempt): rank 1 killed mid-run, every rank starts again
    # and the new run (checkpoint.resume = "never") continues itself, as the run of this same launch.
    # Killed after its checkpoint of step 4, far from its end (the kill lands within a poll of the 6th row; the
    # restarted run resumes from step 4 or 8 and trains to the end: the steps past 16 would prove nothing more).
    out, steps = tmp_path / "out", 16
    args = ["--training.steps", str(steps), "--checkpoint.interval", "4", "--checkpoint.resume", "never"]
    launcher = launch(project, out, tmp_path / "launch", *args)
    wait_for(lambda: rank_process(out, 1) is not None, 300, "rank 1 started")
    rank_1 = rank_process(out, 1)
    wait_for(lambda: steps_logged(out) >= 6, 300, "6 steps", poll=0.02)
    os.kill(rank_1, signal.SIGKILL)
    assert launcher.wait(timeout=600) == 0, (tmp_path / "launch.err").read_text()[-3000:]
    err, stdout = (tmp_path / "launch.err").read_text(), (tmp_path / "launch.out").read_text()
    assert "launch_local.sh: training failed (exit code 1); restart 1 of 1, from the newest checkpoint" in err
    assert re.search(rf"resumed from {out}/checkpoints/step-\d+ at step", stdout), stdout[-2000:]
    records = metrics(out)
    assert records[-1]["step"] == steps
    assert {r["run_id"] for r in records} == {json.loads((out / "run.json").read_text())["run_id"]}


def test_a_killed_torchrun_leaves_no_rank(project: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    torchrun = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "train.py", *TINY,
         "--job.device", "cpu", "--job.output_dir", str(out), "--training.steps", "2000"],
        cwd=project, env=torchrun_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    wait_for(lambda: steps_logged(out) >= 5, 300, "5 steps")
    os.kill(torchrun.pid, signal.SIGKILL)
    torchrun.wait()
    # PR_SET_PDEATHSIG: the kernel kills each rank as its parent dies.
    gone = wait_for(lambda: not processes_of(out), 5, "every rank of the killed torchrun gone")
    print(f"all ranks gone {gone:.1f} s after torchrun's SIGKILL")


# The finished run's settings: 5 steps on the same 8 samples (the global batch) every step, a checkpoint after each
# step, the last 2 kept.
FINISHED = ["--training.steps", "5", "--data.synthetic_samples", "8", "--checkpoint.interval", "1",
            "--checkpoint.keep_last", "2"]  # fmt: skip


@pytest.fixture(scope="module")
def finished_launch(project: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A folder holding a finished run of FINISHED (launch_local.sh, 2 ranks), and the launch's stdout."""
    out = tmp_path_factory.mktemp("finished") / "run-a"
    result = run(project, out, *FINISHED)
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result.stdout


@pytest.fixture(scope="module")
def finished(finished_launch: tuple[Path, str]) -> Path:
    return finished_launch[0]


def test_launch_local_script_trains_on_two_cpu_ranks(finished_launch: tuple[Path, str]) -> None:
    out, stdout = finished_launch
    records = metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    losses = [r["loss"] for r in records]
    # The same 8 samples every step: the loss must fall steadily.
    assert losses[-1] < 0.8 * losses[0] and losses == sorted(losses, reverse=True), losses
    assert len(re.findall(r"^step +\d+/5 \| loss .* \| ETA \d+:\d\d:\d\d$", stdout, flags=re.M)) == 5
    # A checkpoint after every step, the older ones pruned (keep_last 2).
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-4", "step-5"]


@pytest.fixture
def finished_run(finished: Path, tmp_path: Path) -> Path:
    """A copy of the finished run, this test's to change."""
    return shutil.copytree(finished, tmp_path / "run-a")


def test_a_new_run_restarted_never_continues_another_launchs_run(
    project: Path, finished_run: Path, tmp_path: Path
) -> None:
    before = tree(finished_run)
    never = ["--training.steps", "4", "--checkpoint.interval", "1", "--checkpoint.keep_last", "1",
             "--checkpoint.resume", "never"]  # fmt: skip
    refusal = (
        f"job.output_dir {finished_run} already holds a run (run.json; metrics.jsonl; checkpoints step-4, step-5); "
        "checkpoint.resume = 'never' starts a new run, which must not mix with it: give the new run its own "
        "--job.output_dir, or continue that run with --checkpoint.resume auto"
    )
    # (A new launch through launch_local.sh in a shell inside a requeued SLURM job, which has SLURM_RESTART_COUNT, is
    # refused before torchrun: tests/test_bad_input_runtime.py's new-run-in-a-folder-with-a-run.)
    # torchrun by hand restarts the refused rank (TORCHELASTIC_RESTART_COUNT=1), from another launch than run A's:
    # refused again, never turned into a continuation of run A that prunes its checkpoints. (One rank: what a
    # restart remembers is each rank's own; that only rank 0 of several prints the line:
    # tests/test_bad_input_runtime.py's test_torchrun_without_the_launcher_prints_the_error_once.)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "--max-restarts=1",
         "train.py", *TINY, "--job.device", "cpu", "--job.output_dir", str(finished_run), *never],
        cwd=project, env={**torchrun_env(), "TRAIN_LAUNCH_ID": "another-launch", "SLURM_RESTART_COUNT": "1"},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode != 0
    # Said once (issue 40): the restarted ranks stop the same way without repeating it (torchrun's own summary
    # of its failed workers follows; a launch script would exit with 2 and nothing else).
    assert error_lines(result.stderr) == [f"train.py: error: {refusal}"], result.stderr[-3000:]
    assert tree(finished_run) == before


def launch_local_preflight(project: Path, cases: dict[str, list[str]]) -> dict[str, list]:
    """{case: [exit code, stdout, stderr]} of `python preflight.py ARGS` as launch_local.sh (NPROC=2, DEVICE=cpu)
    runs it with the arguments `cases` gives, all in this process (preflight_cases_in_this_process)."""
    head = ["--world-size", "2", "--config", "config.toml", "--job.device", "cpu", *TINY]
    return preflight_cases_in_this_process(project, {case: [*head, *args] for case, args in cases.items()})


def test_an_output_dir_inside_another_runs_folder_is_refused(project: Path, finished_run: Path) -> None:
    # preflight.py's refusals, in this process: launch_local.sh stops with them before torchrun starts
    # (tests/test_bad_input_runtime.py's test_launch_script_stops_before_torchrun_starts).
    before = tree(finished_run)
    inside = ("checkpoints/step-4/run-b", "checkpoints", "notes/run-b")
    results = launch_local_preflight(
        project, {case: ["--job.output_dir", str(finished_run / case), "--training.steps", "2"] for case in inside}
    )
    for case in inside:
        expected = (
            f"preflight.py: error: job.output_dir {finished_run / case} is inside {finished_run}, the folder of "
            "another run (it holds run.json), which may delete it when it prunes its checkpoints; choose a "
            f"--job.output_dir outside {finished_run}\n"
        )
        assert results[case] == [2, "", expected], case
    assert tree(finished_run) == before and not (finished_run / "notes").exists()


def test_a_run_without_checkpoint_is_not_continued_by_another_model(project: Path, finished_run: Path) -> None:
    # run.json, metrics.jsonl, no checkpoint yet (as a run killed before its first save leaves it).
    out = finished_run
    shutil.rmtree(out / "checkpoints")
    before = tree(out)
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    # preflight.py as launch_local.sh runs it, in this process (what the script does with its refusal: stop, exit
    # code 2, nothing else, is tests/test_bad_input_runtime.py's test_launch_script_stops_before_torchrun_starts).
    other = launch_local_preflight(
        project, {"other": ["--job.output_dir", str(out), "--training.steps", "2", "--model.dim", "128",
                            "--training.seq_len", "16"]}
    )["other"]  # fmt: skip
    expected = (
        f"preflight.py: error: {out} holds run {run_id} (run.json), which has no checkpoint yet and holds a different "
        f"model (model.dim 64 -> 128); resume with the model settings in {out / 'run.json'}, or {FRESH}\n"
    )
    assert other == [2, "", expected]
    assert tree(out) == before
    # The same model and data continue it (one process: which run a folder holds does not depend on the ranks;
    # `python train.py` run in this process, captured_in_this_process).
    same = captured_in_this_process(project, "train.py", *TINY, "--job.device", "cpu", "--job.output_dir",
                                        str(out), "--training.steps", "2", "--data.synthetic_samples", "8")  # fmt: skip
    assert same[0] == 0, same[2][-3000:]
    assert [r["step"] for r in metrics(out)] == [1, 2]
    assert {r["run_id"] for r in metrics(out)} == {run_id}


@pytest.fixture
def noflock_mount(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """A folder on a filesystem whose flock fails with the errno named by the test's parameter, as Lustre mounted
    without -o flock does (ENOSYS) or NFSv3 without its lock daemon (ENOLCK): tests/helpers/noflock_fs.py, a FUSE
    filesystem that takes the locks on itself and answers them so. It needs root and /dev/fuse."""

    def unavailable(reason: str) -> None:
        # CI (.ci/run, as root) sets FSDP2GEN_REQUIRE_FUSE=1: there a missing FUSE is a failure.
        if os.environ.get("FSDP2GEN_REQUIRE_FUSE") == "1":
            pytest.fail(f"FSDP2GEN_REQUIRE_FUSE=1 but {reason}", pytrace=False)
        pytest.skip(reason)

    if reason := noflock_fs.available():
        unavailable(reason)
    mount = tmp_path / "mnt"
    mount.mkdir()
    server = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "helpers" / "noflock_fs.py"), str(mount), request.param],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    if server.stdout.readline() != "ready\n":
        # Root without the right to mount (a container without CAP_SYS_ADMIN): the server's last line says why.
        unavailable(f"mounting a FUSE filesystem failed: {server.communicate(timeout=30)[1].strip().splitlines()[-1:]}")
    try:
        yield mount
    finally:
        ctypes.CDLL(None, use_errno=True).umount2(str(mount).encode(), 2)  # MNT_DETACH; the server then ends
        server.wait(timeout=30)


@pytest.mark.parametrize("noflock_mount", ["ENOSYS"], indirect=True)
def test_an_output_dir_where_flock_does_not_work_is_refused_before_torchrun(project: Path, noflock_mount: Path) -> None:
    # A run trusts the folder's lock (rank 0's flock on run.lock) to keep a second launch out, on every node. Where
    # flock fails, preflight says so in one line naming the filesystem and the fix, before torchrun starts and
    # before the run writes anything; never a traceback from rank 0, never a run without a lock.
    out = noflock_mount / "run"
    results = launch_local_preflight(project, {"no-flock": ["--job.output_dir", str(out)]})
    expected = (
        f"preflight.py: error: job.output_dir {out} is on the fuse.noflock filesystem noflock (mounted at "
        f"{noflock_mount}), where flock does not work (Function not implemented); the run lock that keeps two runs "
        "out of one folder needs it on every node: mount that filesystem with flock (Lustre: -o flock; NFS: version "
        "4, or 3 with its lock daemon running), or choose a --job.output_dir on a filesystem where flock works\n"
    )
    assert results["no-flock"] == [2, "", expected]
    assert os.listdir(out) == []  # the probe that found it is gone; nothing of a run was written


@pytest.mark.parametrize("noflock_mount", ["ENOLCK", "EOPNOTSUPP"], indirect=True)
def test_each_way_flock_fails_on_a_filesystem_is_named(noflock_mount: Path, request: pytest.FixtureRequest) -> None:
    # The other errors a filesystem's flock gives when it cannot lock, through ownership.py's own functions: the
    # probe preflight runs, the lock rank 0 takes (start_run turns its OSError into the same line), and the look
    # preflight takes at a folder that has a run.lock already.
    ownership = load_ownership()
    code = getattr(errno, request.node.callspec.params["noflock_mount"])
    (noflock_mount / "run.lock").write_text("{}")
    for attempt in (
        lambda: ownership.check_flock(noflock_mount),
        lambda: ownership.take_run_lock(noflock_mount, ["launch-a"]),
        lambda: ownership.lock_holder(noflock_mount),
    ):
        with pytest.raises(OSError) as failed:
            attempt()
        assert failed.value.errno == code
        assert ownership.flock_refusal(noflock_mount, failed.value) == (
            f"job.output_dir {noflock_mount} is on the fuse.noflock filesystem noflock (mounted at {noflock_mount}), "
            f"where flock does not work ({os.strerror(code)}); the run lock that keeps two runs out of one folder "
            "needs it on every node: mount that filesystem with flock (Lustre: -o flock; NFS: version 4, or 3 with "
            "its lock daemon running), or choose a --job.output_dir on a filesystem where flock works"
        )
    assert sorted(os.listdir(noflock_mount)) == ["run.lock"]
    # Any other failure is not taken for a filesystem without flock.
    assert ownership.flock_refusal(noflock_mount, OSError(errno.EACCES, "denied")) is None
