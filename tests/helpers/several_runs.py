"""Several training runs of one generated project (any family) in one launch: each rank imports torch (and
transformers) and joins the process group once, then runs train.train() once per run, in order, each run with its
own config and mesh.

    cd PROJECT && PYTHONPATH=. torchrun --nproc-per-node N several_runs.py RUNS.json    (or: python several_runs.py)

RUNS.json is a list of runs, or {"runs": [runs], "scripts": [[SCRIPT, ARGS...]], "preflight": {case: argv of
`python preflight.py`}}. A run is the argument list `train.py ARGS` would be given (its own --job.output_dir), or
{"args": ARGS, and any of:}
- "project": FOLDER: another generated project's train.py runs it (say, one generated with --lora where the launch's
  has none): before the run the modules of the project before it are forgotten (sys.modules) and FOLDER's imported
  instead (torch, transformers and the process group stay). The first run, and one with "kill", are the launch's
  project's (its config joins the process group);
- "interrupted": {"from": FOLDER, "remove": [PATHS], "metrics_lines": N, "flip": [FILES]}: a resume, whose output
  folder rank 0 first makes as an interrupted run leaves it: a copy of FOLDER (an earlier run's, of this launch or
  not) without PATHS (the newer checkpoints), with the first N lines of its metrics.jsonl (all if N is null or not
  given), and FILES (if given) damaged as silent disk corruption damages them: 64 bytes inverted in the middle
  (flipped()), and "unrecorded": [FOLDERS] (if given) checkpoints whose checkpoint.json loses its checksums
  ("files"), as older projects wrote it;
- "file_size_limit": BYTES (the launch's last run): every rank runs it under RLIMIT_FSIZE (SIGXFSZ ignored), as
  `ulimit -f` would: a write past BYTES fails with EFBIG ("File too large"); launch with check=False;
- "reference": true (family hf, one process): after the run, the loss plain transformers computes on its step-1
  batch (tests/helpers/hf_one_process.py), printed as `OUTPUT_DIR: plain transformers step 1 loss X` (plain_losses());
- "kill": {"rank": R, "step": S}: on torchrun's first attempt rank R SIGKILLs itself in the middle of step S, after
  its forward and backward, before the optimizer step (the others wait in the gradient norm's all-reduce); launched
  with restarts=1, torchrun then restarts every rank, and the restart begins again at this run (the runs before it
  are done), which resumes from its newest complete checkpoint. Before dying, rank R leaves RUNS.killed next to
  RUNS.json: the restarted ranks know from it that they are a restart. (Not from TORCHELASTIC_RESTART_COUNT: with
  several torchruns, one per node, only the killed rank's torchrun counts a restart; the others restart their ranks
  for the new rendezvous round and still say 0.)
The scripts (rank 0; a path relative to the launch's project, or absolute) run first, each as `python SCRIPT ARGS`
would (say, another project's scripts/prepare_chat.py), their output passed on; then the preflight cases (rank 0),
each as `python preflight.py ARGS` would (tests/helpers/preflight_driver.py), printed as one line `preflight {case:
[exit code, stdout, stderr]}` (preflight_answers()). The other ranks wait for rank 0 in the process group's
rendezvous.

A launch costs about 2 CPU-s for torchrun's agent and 3 per rank to import torch (6 with transformers); a tiny
run's training a fraction of that. Each run is the run `torchrun train.py ARGS` makes: train() seeds every RNG from
its config, builds its model, optimizer, data and checkpointer afresh and closes them at its end; the mesh is that
run's own layout (built here as init_distributed builds it). Rank 0 prints "run N: ARGS" before each run, so that
the output tells the runs apart. Tests call launch_several().
"""

from __future__ import annotations

import importlib
import json
import os
import re
import resource
import runpy
import shutil
import signal
import subprocess
import sys
from pathlib import Path


def launch_several(
    project: Path, runs: list | dict, runs_file: Path, nproc: int, env: dict[str, str] | None = None,
    restarts: int = 0, check: bool = True,
) -> subprocess.CompletedProcess:  # fmt: skip
    """The runs (see the module's docstring) in one launch of `nproc` gloo ranks in `project` (1: a plain process,
    a group of one, as `python train.py` runs; `restarts`: torchrun's --max-restarts), the list written to
    `runs_file`, with `env` added to the environment (PYTHONPATH: the project's by default); fails the test with
    the output's tail unless every run succeeds (check=False: a launch whose last run is to stop it)."""
    from tests.conftest import torchrun_env

    runs_file.write_text(json.dumps(runs))
    killed_mark(runs_file).unlink(missing_ok=True)
    command = [sys.executable, __file__, str(runs_file)]
    if nproc > 1:
        command[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                        f"--max-restarts={restarts}"]  # fmt: skip
    result = subprocess.run(command, cwd=project, capture_output=True, text=True,
                            env={**torchrun_env(), "PYTHONPATH": str(project), **(env or {})}, timeout=600)  # fmt: skip
    assert result.returncode == 0 or not check, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def plain_losses(stdout: str) -> dict[str, float]:
    """{output folder: plain transformers' step-1 loss} of the runs marked "reference", from a launch's stdout."""
    return {folder: float(loss) for folder, loss in
            re.findall(r"^(\S+): plain transformers step 1 loss (\S+)$", stdout, flags=re.M)}  # fmt: skip


def preflight_answers(stdout: str) -> dict[str, list]:
    """{case: [exit code, stdout, stderr]} of the launch's preflight cases, from its stdout."""
    return json.loads(stdout.split("preflight ", 1)[1].splitlines()[0])


def assert_resumed_bit_for_bit(stdout: str, run: Path, kill: dict, checkpoint: int, keys: tuple[str, ...]) -> None:
    """The run in folder `run`, killed as `kill` says (the launch's `stdout`) and restarted by torchrun, resumed from
    its checkpoint of step `checkpoint`, and the steps its first attempt had logged since then (metrics.rewound.jsonl)
    came out the same again: `keys` of each row equal (==)."""
    from tests.conftest import metrics

    assert f"rank {kill['rank']}: SIGKILL in step {kill['step']}, before its optimizer step" in stdout, stdout[-3000:]
    assert f"resumed from {run / 'checkpoints' / f'step-{checkpoint}'} at step {checkpoint}" in stdout, stdout[-3000:]
    first_attempt = metrics(run, "metrics.rewound.jsonl")
    assert [row["step"] for row in first_attempt] == list(range(checkpoint + 1, kill["step"]))
    resumed = {row["step"]: row for row in metrics(run)}
    for row in first_attempt:
        assert [resumed[row["step"]][key] for key in keys] == [row[key] for key in keys], row["step"]


def main() -> None:
    import torch.distributed as dist

    mark = killed_mark(Path(sys.argv[1]).resolve())
    with open(sys.argv[1]) as file:
        spec = json.load(file)
    runs, cases = (spec, {}) if isinstance(spec, list) else (spec["runs"], spec.get("preflight", {}))
    scripts = [] if isinstance(spec, list) else spec.get("scripts", [])
    runs = [run if isinstance(run, dict) else {"args": run} for run in runs]
    first_attempt = not mark.exists()
    if not first_attempt:  # a restart after a kill: the runs before the killed one are done
        runs = runs[next(index for index, run in enumerate(runs) if "kill" in run) :]
    if first_attempt and os.environ.get("RANK", "0") == "0":
        for argv in scripts:
            run_script(argv)
    if cases and os.environ.get("RANK", "0") == "0":
        from preflight_driver import run_case

        print("preflight " + json.dumps({case: run_case(argv) for case, argv in cases.items()}), flush=True)
    # The project's messages name the script they come from (sys.argv[0]): each run speaks as train.py does.
    sys.argv = ["train.py"]

    def work(_config, device, _mesh) -> int | None:
        launched = Path.cwd().resolve()
        for index, run in enumerate(runs):
            use_project(Path(run.get("project", launched)).resolve())
            train = importlib.import_module("train")
            config = importlib.import_module("config").parse_args(run["args"])
            ParallelLayout = importlib.import_module("layout").ParallelLayout
            dist.barrier()  # every rank has finished the run before (its last files written)
            if dist.get_rank() == 0:
                print(f"run {index}: {' '.join(run['args'])}", flush=True)
                if "interrupted" in run:
                    interrupt(run["interrupted"], Path(config.job.output_dir))
            dist.barrier()  # the folder is ready on every rank
            mesh = ParallelLayout.of(config.parallel, dist.get_world_size()).build_mesh(device.type)
            if "file_size_limit" in run:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (run["file_size_limit"],) * 2)
            with killed(train, run.get("kill") if first_attempt else None, mark):
                if run.get("reference"):
                    from hf_one_process import train_then_reference

                    code = train_then_reference(config, device, mesh, label=f"{config.job.output_dir}: ")
                else:
                    code = train.train(config, device, mesh)
            if "wandb" in sys.modules:
                # What the end of the run's process does (W&B's atexit hook): finish() may return before W&B's
                # service has written the run's file (measured: 7 of 3368 bytes), which the next run may copy.
                sys.modules["wandb"].teardown()
            if code:
                return code
        return None

    # The first run's config joins the process group (job.device, timeout); every run builds its own mesh. (Imported
    # here, after the scripts: a script of another project makes the launch's modules be imported again.)
    importlib.import_module("train").run_on_every_rank(work, runs[0]["args"])


def run_script(argv: list[str]) -> None:
    """`python SCRIPT ARGS` (argv), in this process, in the project SCRIPT is in (its modules and config.toml, as
    `cd PROJECT && python scripts/SCRIPT` sees them); what it put on sys.path is taken away after it."""
    launched, project = Path.cwd().resolve(), Path(argv[0]).resolve().parents[1]
    use_project(project)
    path = list(sys.path)
    sys.argv = argv
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exit:
        assert exit.code in (None, 0), f"{argv}: exit {exit.code}"
    finally:
        sys.path[:] = path
        forget(project / "scripts")
        use_project(launched)


def use_project(folder: Path) -> None:
    """Make `folder` the project whose modules `import` finds (the cwd, first on sys.path): the modules of the one
    before it, and the helpers that imported them, are forgotten (see the module's docstring)."""
    current = Path.cwd().resolve()
    if folder == current:
        return
    forget(current, Path(__file__).resolve().parent)
    sys.path[:] = [path for path in sys.path if not path or Path(path).resolve() != current]
    sys.path.insert(0, str(folder))
    os.chdir(folder)


def forget(*folders: Path) -> None:
    """Drop from sys.modules the modules imported from files in `folders` (this script, __main__, stays)."""
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and name != "__main__" and Path(file).resolve().parent in folders:
            del sys.modules[name]


def killed_mark(runs_file: Path) -> Path:
    """The file the killed rank leaves next to RUNS.json before it dies (see the module's docstring)."""
    return runs_file.with_name(runs_file.stem + ".killed")


class killed:
    """While active, train.optimizer_step (which train_step looks up in the module at every step) SIGKILLs rank
    kill["rank"] at step kill["step"] (None: no kill), after writing `mark`."""

    def __init__(self, train, kill: dict | None, mark: Path) -> None:
        self.train, self.kill, self.real, self.mark = train, kill, train.optimizer_step, mark

    def __enter__(self) -> None:
        if self.kill is None:
            return
        import torch.distributed as dist

        rank, step, real, mark = self.kill["rank"], self.kill["step"], self.real, self.mark

        def optimizer_step(state, config):
            if dist.get_rank() == rank and state.step == step - 1:  # state.step: the steps done before this one
                mark.touch()
                print(f"rank {rank}: SIGKILL in step {step}, before its optimizer step", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return real(state, config)

        self.train.optimizer_step = optimizer_step

    def __exit__(self, *_) -> None:
        self.train.optimizer_step = self.real


def interrupt(interrupted: dict, output_dir: Path) -> None:
    """`output_dir` as a run stopped after its last kept checkpoint leaves it (see the module's docstring)."""
    shutil.copytree(interrupted["from"], output_dir)
    for path in interrupted["remove"]:
        shutil.rmtree(output_dir / path)
    if interrupted.get("metrics_lines") is not None:
        metrics = output_dir / "metrics.jsonl"
        metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[: interrupted["metrics_lines"]]))
    for path in interrupted.get("flip", []):
        (output_dir / path).write_bytes(flipped((output_dir / path).read_bytes()))
    for folder in interrupted.get("unrecorded", []):
        info = json.loads((output_dir / folder / "checkpoint.json").read_text())
        del info["files"]
        (output_dir / folder / "checkpoint.json").write_text(json.dumps(info))


def flipped(data: bytes) -> bytes:
    """`data` with 64 bytes inverted in the middle (tensor data, past every header: a checkpoint file still parses
    and keeps its size)."""
    middle = len(data) // 2
    return data[:middle] + bytes(byte ^ 0xFF for byte in data[middle : middle + 64]) + data[middle + 64 :]


if __name__ == "__main__":
    main()
