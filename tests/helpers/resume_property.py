"""The resume contract of a generated project, checked with hypothesis inside that project (one process):

    cd SCRATCH && PYTHONPATH=PROJECT python resume_property.py PROJECT BASE.json RUN REPORT.json

RUN is a finished run of BASE.json's arguments (4 steps, checkpoints step-2 and step-4). Each draw changes one
key of the config (any section, any key the project's Config has, values of every type) and resumes a copy of
RUN from step-2. The property: the resume is refused with one line and exit code 2, or the step it trains next
has exactly the uninterrupted run's loss and gradient norm (the same weights, data and random state; up to float
rounding for a key that schema.py declares resume=ROUNDING, e.g. the micro-batches of a step). A key the
schema says defines the run (schema.py: not resume=True, and not in model.py's RESUME_MAY_CHANGE), drawn with a
value other than the checkpoint's, must be refused, by preflight.py, naming the key. Then checkpoint.json itself
is drawn (fields dropped, or given values of other types): preflight either passes it over for step-2 (exit 0)
or refuses in one line; train.py resumes from one of the two checkpoints, never a traceback.

HYPOTHESIS_PROFILE=nightly draws more (see PROFILES). Writes {"refused", "resumed", ...} to REPORT.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
import typing
from pathlib import Path

import pytest
from config_property import keys_of, train_first_step, values_for  # tests/helpers/ is on the path
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from preflight_driver import run_case

# Draws of (key, value), then draws of checkpoint.json.
PROFILES = {"ci": (12, 10), "nightly": (300, 200)}
# The run's own folder: another value is another (new) run's folder, which config_property.py draws.
NOT_DRAWN = {"job.output_dir"}


def main() -> None:
    project, base_file, run, report_file = sys.argv[1:5]
    sys.path.insert(0, project)
    import preflight  # noqa: F401
    import train  # noqa: F401
    from config import Config, parse_args, saved_config
    from model_args import RESUME_MAY_CHANGE
    from schema import ROUNDING, may_change_on_resume

    base = json.loads(Path(base_file).read_text())
    config_toml = str(Path(project) / "config.toml")
    keys = keys_of(Config)
    defaults, fixed, rounding = {}, set(), set()
    for section in dataclasses.fields(Config):
        instance = section.default_factory()
        for spec in dataclasses.fields(instance):
            key = f"{section.name}.{spec.name}"
            defaults[key] = getattr(instance, spec.name)
            if not may_change_on_resume(spec) and not (section.name == "model" and spec.name in RESUME_MAY_CHANGE):
                fixed.add(key)
            if may_change_on_resume(spec) and spec.metadata["bound"].resume == ROUNDING:
                rounding.add(key)
    uninterrupted = {row["step"]: row for row in map(json.loads, (Path(run) / "metrics.jsonl").open())}
    saved = saved_config(json.loads((Path(run) / "checkpoints" / "step-2" / "checkpoint.json").read_text())["config"])
    report = {"refused": 0, "refused_fixed": 0, "resumed": 0, "keys": [], "json_passed_over": 0, "json_refused": 0}
    per_key, json_draws = PROFILES[os.environ.get("HYPOTHESIS_PROFILE", "ci")]

    def copy_of_run() -> Path:
        """RUN as it was after step 2: a crash before its step-4 save."""
        folder = Path(tempfile.mkdtemp(prefix="run-", dir=".")) / "run"
        shutil.copytree(run, folder)
        shutil.rmtree(folder / "checkpoints" / "step-4")
        return folder

    def one_line(code: int, stdout: str, stderr: str, draw: object) -> None:
        assert code == 2 and stdout == "" and stderr.startswith("preflight.py: error: "), (draw, code, stdout, stderr)
        assert stderr.count("\n") == 1 and stderr.endswith("\n"), (draw, stderr)

    def resume_holds(draw: tuple[str, str]) -> None:
        key, value = draw
        folder = copy_of_run()
        argv = ["--config", config_toml, *base, "--job.output_dir", str(folder), f"--{key}", value]
        code, stdout, stderr = run_case(["--world-size", "1", *argv])
        report["keys"].append(key)
        if code == 2:
            one_line(code, stdout, stderr, draw)
            report["refused"] += 1
            return
        assert code == 0 and stdout == stderr == "", (draw, code, stdout, stderr)
        section, _, name = key.partition(".")
        now = getattr(getattr(parse_args(argv), section), name)
        # The property's other half: a key that defines the run is never accepted with another value.
        assert key not in fixed or now == getattr(getattr(saved, section), name), (draw, "accepted")
        numbers = train_first_step(argv)
        # The step after the checkpoint, from the same weights, data and random state: the uninterrupted run's,
        # exactly; up to float rounding for a key declared ROUNDING (another order of the same sums).
        expected = uninterrupted[3]
        found = (float(numbers["loss"]), float(numbers["grad_norm"]))
        if key in rounding and now != getattr(getattr(saved, section), name):
            assert found == pytest.approx((expected["loss"], expected["grad_norm"]), rel=1e-5), (draw, numbers)
        else:
            assert found == (expected["loss"], expected["grad_norm"]), (draw, numbers)
        report["resumed"] += 1

    def fixed_key_is_refused(draw: tuple[str, str]) -> None:
        key, value = draw
        folder = copy_of_run()
        argv = ["--config", config_toml, *base, "--job.output_dir", str(folder), f"--{key}", value]
        fresh = run_case(["--world-size", "1", *argv[:-4], "--job.output_dir", str(folder) + "-new", *argv[-2:]])
        if fresh[0] != 0:
            return  # refused in a new folder too: a value no run accepts (resume_holds covers it)
        section, _, name = key.partition(".")
        if getattr(getattr(parse_args(argv), section), name) == getattr(getattr(saved, section), name):
            return
        code, stdout, stderr = run_case(["--world-size", "1", *argv])
        one_line(code, stdout, stderr, draw)
        assert (f"was saved with {key} " in stderr) or (f"different model ({key} " in stderr), (draw, stderr)
        report["refused_fixed"] += 1

    def near_saved(key: str) -> list[str]:
        """Values next to the checkpoint's own: ones a run may well accept, so that many draws get past the bounds."""
        section, _, name = key.partition(".")
        value = getattr(getattr(saved, section), name)
        if isinstance(value, bool):
            return [str(not value).lower()]
        if isinstance(value, int | float):
            return [str(value + 1), str(value * 2), str(type(value)(value / 2)), str(value)]
        if typing.get_origin(keys[key]) is typing.Literal:
            return [str(choice) for choice in typing.get_args(keys[key])]
        if isinstance(value, list):
            return [",".join(map(str, value[:1])), ",".join(map(str, value))]
        return [f"{value}x", str(value)]

    def drawn_value(key: str) -> st.SearchStrategy[tuple[str, str]]:
        values = st.sampled_from(near_saved(key)) | values_for(key, keys[key], defaults[key])
        return st.tuples(st.just(key), values)

    drawn_keys = sorted(set(keys) - NOT_DRAWN)
    # Half the draws from the keys a resume may change: both outcomes stay exercised however many keys the schema
    # fixes (each key added as fixed would otherwise thin out the resumes).
    changeable = sorted(set(drawn_keys) - fixed)
    any_key = (st.sampled_from(changeable) | st.sampled_from(drawn_keys)).flatmap(drawn_value)
    fixed_key = st.sampled_from(sorted(fixed & set(drawn_keys))).flatmap(drawn_value)
    # Values of checkpoint.json's fields, and of its config's sections and keys, nobody listed.
    json_values = st.recursive(
        st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats() | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
        max_leaves=8,
    )
    info = json.loads((Path(run) / "checkpoints" / "step-4" / "checkpoint.json").read_text())
    paths = [(field,) for field in info if field != "files"] + [("config", section) for section in info["config"]]
    paths += [("config", section, key) for section in info["config"] for key in info["config"][section]]
    edits = st.tuples(st.sampled_from(paths), st.booleans(), json_values)

    def checkpoint_json_holds(edit: tuple[tuple[str, ...], bool, object]) -> None:
        path, drop, value = edit
        folder = Path(tempfile.mkdtemp(prefix="json-", dir=".")) / "run"
        shutil.copytree(run, folder)
        changed = json.loads(json.dumps(info))
        parent = changed
        for part in path[:-1]:
            parent = parent[part]
        if drop:
            del parent[path[-1]]
        else:
            parent[path[-1]] = value
        (folder / "checkpoints" / "step-4" / "checkpoint.json").write_text(json.dumps(changed))
        argv = ["--config", config_toml, *base, "--training.steps", "6", "--job.output_dir", str(folder)]
        code, stdout, stderr = run_case(["--world-size", "1", *argv])
        if code == 2:
            one_line(code, stdout, stderr, edit)
            report["json_refused"] += 1
        else:
            assert code == 0 and stdout == stderr == "", (edit, code, stdout, stderr)
            report["json_passed_over"] += 1

    # A fixed key's draw trains nothing (two preflights), and many of its values are refused by the bounds before a
    # resume is tried: it gets twice the draws.
    runs = [(fixed_key, fixed_key_is_refused, 2 * per_key), (any_key, resume_holds, per_key)]
    runs.append((edits, checkpoint_json_holds, json_draws))
    for strategy, check, count in runs:
        test = given(strategy)(check)  # a new function per run: hypothesis takes one settings object per function
        settings(max_examples=count, derandomize=True, deadline=None, database=None,
                 suppress_health_check=list(HealthCheck))(test)()  # fmt: skip
    Path(report_file).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
