"""The one run a job.output_dir holds: its identity, and the checks that keep runs apart.

A new run (checkpoint.resume = "never", or "auto" in a folder without one) writes run.json there; its run id goes
into every checkpoint.json and metrics row, and a run prunes only its own checkpoints. A new run is refused in a
folder that holds another run, so nothing we write can delete, hide, or resume as its own another run's
checkpoints. A run continues only with the model and data positions it was saved with. While it trains, a run
holds the folder's lock (ownership.py), and a folder inside another run's folder is refused (that run may prune
it).

preflight.py runs these checks before any rank starts, and start_run again on rank 0 under the lock. Each
mistake raises RunFolderError (or checkpoint_files.CheckpointFolderError) with one line naming it and the fix.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

from checkpoint_files import newest_intact_checkpoint
from config import Config, saved_config
from model_args import RESUME_MAY_CHANGE
from ownership import (
    LOCK_FILE,
    check_flock,
    describe_holder,
    flock_refusal,
    launch_id,
    lock_holder,
    run_folder_above,
    take_run_lock,
)
from schema import as_option, resume_changes

NEW_RUN = "start a new run in another --job.output_dir"


class RunFolderError(Exception):
    """job.output_dir cannot hold this run as configured: the message is one line that names why and the fix."""


def restarted(output_dir: Path, launch_ids: list[str] | None = None) -> bool:
    """Whether the run in `output_dir` was started by this launch (run.json names it), which this process then
    restarts: after a failure, or a requeue of the SLURM job. Restart counters in the environment are not
    asked: any shell inside a requeued job has SLURM_RESTART_COUNT, and a run refused in a folder would be
    "restarted" by torchrun into a continuation of the run it was refused for."""
    try:
        recorded = json.loads((output_dir / "run.json").read_text()).get("launch", [])
    except (OSError, ValueError, AttributeError):
        return False  # no run.json (an unreadable one is reported by run_id_of)
    return bool(set(recorded) & set(launch_ids or [launch_id()]))


def resuming(config: Config, launch_ids: list[str] | None = None) -> bool:
    """Whether this process continues the run in job.output_dir: with checkpoint.resume = "auto", or when this
    launch started it (a restart continues its own new run, never another)."""
    return config.checkpoint.resume == "auto" or restarted(Path(config.job.output_dir), launch_ids)


def run_id_of(output_dir: Path) -> str | None:
    """The run `output_dir` holds: run.json's id; for checkpoints copied in without it, the newest one's."""
    run_file = output_dir / "run.json"
    if run_file.exists():
        try:
            return json.loads(run_file.read_text())["run_id"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise RunFolderError(
                f"{run_file} cannot be read ({type(exc).__name__}: {exc}); restore it, or start a new run in "
                "another --job.output_dir"
            ) from None
    # The newest intact one's, as a resume would pick it (damaged ones are passed over, never deleted).
    return newest_intact_checkpoint(output_dir / "checkpoints")[1].get("run_id")


def start_run(output_dir: Path, config: Config, launch_ids: list[str]) -> str:
    """Make `output_dir` this run's and return its id: the one the folder holds when resuming, or a new one.

    Called on rank 0 after preflight(). Locks the folder for the life of this process (ownership.py), then
    checks it again under the lock: between preflight and now another launch may have started, or ended, a run
    here. `launch_ids`: this launch's id on each node, recorded in run.json for its restarts.
    """
    try:
        holder = take_run_lock(output_dir, launch_ids)
    except OSError as exc:
        raise RunFolderError(
            flock_refusal(output_dir, exc)
            or f"{output_dir / LOCK_FILE} cannot be opened ({exc.strerror or exc}); it must be a file this user can "
            "write, or absent"
        ) from None
    if holder is not None:
        raise RunFolderError(describe_holder(output_dir, holder))
    check_run_folder(config, launch_ids)
    run_file = output_dir / "run.json"
    run_id = run_id_of(output_dir) if resuming(config, launch_ids) else None
    if run_id is None:
        run_id = uuid.uuid4().hex[:12]
    if not run_file.exists():
        started = datetime.now(UTC).isoformat(timespec="seconds")
        # What a resume of this run must keep (check_run_settings), for as long as it has no checkpoint: its whole
        # config, of which a resume may change only the keys the schema says (schema.py).
        record = {"run_id": run_id, "started": started, "launch": launch_ids, "config": asdict(config)}
        staging = run_file.with_suffix(".json.tmp")
        staging.write_text(json.dumps(record) + "\n")
        staging.rename(run_file)
    return run_id


def check_run_folder(config: Config, launch_ids: list[str] | None = None) -> None:
    """The run job.output_dir holds (if any) is one this run may continue, or, for a new run, there is none."""
    output_dir = Path(config.job.output_dir)
    if resuming(config, launch_ids):
        checkpoint, info = newest_intact_checkpoint(output_dir / "checkpoints")
        if checkpoint is not None:
            check_resumable(checkpoint, info, config, run_id_of(output_dir))
        else:
            check_run_settings(output_dir, config)
    else:
        check_no_run(output_dir)


def check_resumable(path: Path, info: dict, config: Config, run_id: str | None) -> None:
    """`path` must continue this run as configured: same run, and every key that defines the run as saved."""
    saved_run = info.get("run_id")
    if run_id is not None and saved_run is not None and saved_run != run_id:
        raise RunFolderError(
            f"{path} belongs to run {saved_run}, but {path.parent.parent} holds run {run_id} (run.json); move the "
            f"checkpoint to its own run's folder, or {NEW_RUN}"
        )
    check_unchanged(saved_config(info["config"]), config, str(path), path / "checkpoint.json")
    if info["model_only"] and info["step"] < config.training.steps:
        raise RunFolderError(
            f"{path} is a model-only final checkpoint (checkpoint.model_only_final) of a run that ended at step "
            f"{info['step']}: it cannot continue training to step {config.training.steps}; export it with "
            f"scripts/export.py, or {NEW_RUN} (to continue from an earlier checkpoint, move {path.name} out of "
            f"{path.parent})"
        )


def check_unchanged(saved: Config, config: Config, where: str, record: Path) -> None:
    """Every key of `config` that defines the run (schema.py: not declared resume=True; of the model, not in
    model.py's RESUME_MAY_CHANGE) as in `saved`, the config of the checkpoint (or run.json) `where`."""
    changed = [
        (key, before, now)
        for key, before, now in resume_changes(saved, config, may_change=False)
        if key.removeprefix("model.") not in RESUME_MAY_CHANGE
    ]
    model = [f"{key} {before!r} -> {now!r}" for key, before, now in changed if key.startswith("model.")]
    if model:
        raise RunFolderError(
            f"{where} holds a different model ({', '.join(model)}); resume with the model settings in {record}, or "
            f"{NEW_RUN}"
        )
    if changed:
        key, before, now = changed[0]
        raise RunFolderError(
            f"{where} was saved with {key} {as_option(before)}, but this run has {as_option(now)} (a resume may not "
            f"change what defines the run); resume with --{key} {as_option(before)}, or {NEW_RUN}"
        )


def check_run_settings(output_dir: Path, config: Config) -> None:
    """run.json of a run that has no checkpoint yet: it is continued only with the keys that define the run as
    they were, as a checkpoint would be (check_resumable)."""
    try:
        recorded = json.loads((output_dir / "run.json").read_text())
    except (OSError, ValueError):
        return  # no run.json; an unreadable one is reported by run_id_of
    if not isinstance(recorded, dict) or "config" not in recorded:
        return  # written by an older project, which recorded less
    try:
        saved = saved_config(recorded["config"])
    except ValueError as exc:
        raise RunFolderError(f"{output_dir / 'run.json'} cannot be read ({exc}); restore it, or {NEW_RUN}") from None
    where = f"{output_dir} holds run {recorded.get('run_id')} (run.json), which has no checkpoint yet and"
    check_unchanged(saved, config, where, output_dir / "run.json")


def check_no_run(output_dir: Path) -> None:
    """A new run (checkpoint.resume = "never") must not mix with, prune or resume another run's files."""
    found = [name for name in ("run.json", "metrics.jsonl") if (output_dir / name).exists()]
    checkpoints = sorted(p.name for p in (output_dir / "checkpoints").glob("step-*"))
    if checkpoints:
        found.append(f"checkpoints {', '.join(checkpoints)}")
    if found:
        raise RunFolderError(
            f"job.output_dir {output_dir} already holds a run ({'; '.join(found)}); checkpoint.resume = 'never' "
            "starts a new run, which must not mix with it: give the new run its own --job.output_dir, or "
            "continue that run with --checkpoint.resume auto"
        )


def check_output_dir(output_dir: Path) -> None:
    """job.output_dir exists (or is created here) and takes files: found now, not by a rank mid-run."""
    if output_dir.exists() and not output_dir.is_dir():
        raise RunFolderError(
            f"job.output_dir {output_dir} is a file, not a folder; choose a folder with --job.output_dir"
        )
    # What the run writes there must be able to take its place: found now, not at the first save or log line.
    writes = {"checkpoints": "its checkpoints there", "metrics.jsonl": "its metrics to it", "run.json": "its id to it"}
    for name, what in writes.items():
        found = output_dir / name
        folder = name == "checkpoints"
        if found.exists() and found.is_dir() != folder:
            should = "a folder" if folder else "a file"
            raise RunFolderError(
                f"job.output_dir {output_dir} has {name}, which is not {should}: the run writes {what}; move it "
                "away or choose another --job.output_dir"
            )
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe = output_dir / f".write-test-{uuid.uuid4().hex}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise RunFolderError(
            f"job.output_dir {output_dir} cannot be written ({exc.strerror or exc}); choose a writable folder "
            "with --job.output_dir"
        ) from None
    # The run lock (ownership.py) needs a flock that works there, on every node.
    try:
        check_flock(output_dir)
    except OSError as exc:
        raise RunFolderError(flock_refusal(output_dir, exc) or f"job.output_dir {output_dir}: {exc}") from None


def check_not_inside_a_run(output_dir: Path) -> None:
    """job.output_dir must not lie inside another run's folder, whose run may prune (delete) it."""
    found = run_folder_above(output_dir)
    if found is not None:
        folder, evidence = found
        raise RunFolderError(
            f"job.output_dir {output_dir} is inside {folder}, the folder of another run (it holds {evidence}), "
            f"which may delete it when it prunes its checkpoints; choose a --job.output_dir outside {folder}"
        )


def check_not_in_use(output_dir: Path) -> None:
    """No other launch's run is training in job.output_dir now (one of this launch, a restart's previous
    attempt still ending, is waited for by start_run)."""
    try:
        holder = lock_holder(output_dir)
    except OSError as exc:
        raise RunFolderError(flock_refusal(output_dir, exc) or f"{output_dir / LOCK_FILE}: {exc}") from None
    if holder is not None and not set(holder.get("launch", [])) & {launch_id()}:
        raise RunFolderError(describe_holder(output_dir, holder))
