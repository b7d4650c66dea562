"""The property of a generated project's config, checked with hypothesis inside that project (one process: torch
and the project's modules are imported once, every accepted draw is trained in it):

    cd SCRATCH && python config_property.py PROJECT BASE.json REPORT.json [PROJECT BASE.json REPORT.json ...]

(several projects in turn, in one process: torch is imported once; each project's modules are forgotten before the
next one's are imported.)

For draws of 1 or 2 `--section.key VALUE` overrides, over every key of every section of the project's Config
(enumerated from its dataclasses) and values across types, signs, NaN/inf, huge and tiny magnitudes, strings
and empty ones, preflight (exactly as `python preflight.py --world-size 1 BASE... OVERRIDES...`) either exits
with code 2 and one line, or the run it accepted trains its first step (world size 1, in this process) with a
finite loss and finite weights after the update. BASE.json holds the base arguments (a tiny model). Writes
{"draws", "refused", "trained", "keys"} to REPORT.json; an assertion error (with the draw) otherwise.

HYPOTHESIS_PROFILE=nightly draws more (see PROFILES).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import io
import json
import math
import os
import sys
import tempfile
import time
import typing
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from preflight_driver import run_case  # tests/helpers/ is on the path: both run as scripts from there

# Draws per key, then draws of two keys together.
PROFILES = {"ci": (2, 30), "nightly": (20, 300)}

# Edges of every kind: an int key is also drawn floats, bools and strings, and the other way round.
INTS = [-(2**63), -(2**31), -2, -1, 0, 1, 2, 3, 7, 2**31 - 1, 2**31, 2**32 - 2, 2**32, 2**53 + 1, 2**63, 10**30]
FLOATS = ["nan", "-nan", "inf", "-inf", "-0.0", "0.0", "5e-324", "1e-300", "1e-30", "1e-8", "0.5", "1.0", "2.5",
          "1e30", "1e300", "1.7976931348623157e308", "-1.5"]  # fmt: skip
WORDS = ["", " ", "true", "false", "True", "0x10", "1_000", "1e3", "-", ",", "a,b", "é", "none", "Block", "cpu",
         "auto", "never", "float32", "compute", "q_proj"]  # fmt: skip


def keys_of(config_cls: type) -> dict[str, typing.Any]:
    """section.key -> the declared type, for every field of every section dataclass of the Config."""
    hints = typing.get_type_hints(config_cls)
    found = {}
    for section in dataclasses.fields(config_cls):
        section_hints = typing.get_type_hints(hints[section.name])
        for spec in dataclasses.fields(hints[section.name]):
            found[f"{section.name}.{spec.name}"] = section_hints[spec.name]
    return found


def values_for(key: str, declared: typing.Any, default: typing.Any) -> st.SearchStrategy[str]:
    """Command-line values for `key`: of every type, edges first, and some near its default."""
    near = []
    if isinstance(default, int | float) and not isinstance(default, bool):
        near = [str(default), str(default * 2), str(-default), str(type(default)(default / 2))]
    if typing.get_origin(declared) is typing.Literal:
        near = [str(choice) for choice in typing.get_args(declared)]
    if key.endswith(("output_dir", ".path", "tokenizer")):
        # Relative names only: a draw never writes outside its scratch folder.
        words = st.text(alphabet="abc-_.", min_size=0, max_size=6).filter(lambda w: ".." not in w)
    else:
        words = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=6)
    # Half the draws near the default or small: values a run may well accept, so that many draws train.
    likely = st.sampled_from(near) if near else st.sampled_from(WORDS)
    return st.one_of(
        likely,
        st.integers(0, 70).map(str),
        st.sampled_from([str(v) for v in INTS] + FLOATS + WORDS),
        st.floats(allow_nan=True, allow_infinity=True).map(repr),
        words,
    )


def sum_lists(lists: list[list]) -> list:
    return [item for part in lists for item in part]


class FirstStep(Exception):
    """Raised after the first training step, with its numbers: the property needs that step only."""


def train_first_step(argv: list[str]) -> dict:
    """Parse `argv` as train.py does and train its first step in this process (a group of one); its numbers."""
    import torch
    import train

    original = train.train_step

    def first_step(state, batches, config):
        numbers = original(state, batches, config)
        weights = [p.to_local() if hasattr(p, "to_local") else p for p in state.model.parameters()]
        numbers["weights_finite"] = all(bool(torch.isfinite(w).all()) for w in weights)
        raise FirstStep(numbers)

    # A run stopped after its first step closes its profiler, as its last step would have.
    profilers: list = []
    profiler_class = train.Profiler
    train.Profiler = lambda *args: profilers.append(profiler_class(*args)) or profilers[-1]
    train.train_step = first_step
    config = train.parse_args(argv)
    device, mesh = train.init_distributed(config)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            train.train(config, device, mesh)
    except FirstStep as done:
        for profiler in profilers:
            profiler.close()
        return done.args[0]
    finally:
        train.train_step, train.Profiler = original, profiler_class
        train.close_process_group()
    raise AssertionError(f"train.py {argv} ended without a training step")


previous: list[str] = []  # the project whose modules are imported


def main() -> None:
    args = sys.argv[1:]
    assert args and len(args) % 3 == 0, "usage: config_property.py PROJECT BASE.json REPORT.json [...]"
    for project, base_file, report_file in zip(args[0::3], args[1::3], args[2::3], strict=True):
        check(str(Path(project).resolve()), base_file, report_file)


def check(project: str, base_file: str, report_file: str) -> None:
    """The property for one project (see the module's docstring): its modules imported in place of the last's."""
    if previous:  # the project before this one: its modules (train, config, preflight, ...) and its path
        for name, module in list(sys.modules.items()):
            file = getattr(module, "__file__", None)
            if file and name != "__main__" and Path(file).resolve().parent == Path(previous[0]):
                del sys.modules[name]
        sys.path.remove(previous.pop())
    previous.append(project)
    sys.path.insert(0, project)
    # Imported before any draw: what importing prints (warnings of optional libraries) is not a draw's output.
    import preflight  # noqa: F401
    import train  # noqa: F401
    from config import Config

    gc.freeze()  # the imports outlive the probe: keep them out of the collector's full passes
    base = json.loads(Path(base_file).read_text())
    config_toml = str(Path(project) / "config.toml")
    keys = keys_of(Config)
    defaults = {}
    for section in dataclasses.fields(Config):
        instance = section.default_factory()
        for spec in dataclasses.fields(instance):
            defaults[f"{section.name}.{spec.name}"] = getattr(instance, spec.name)
    # Every number, string and list key declares its bounds at its field (schema.py's setting()).
    unbounded = [
        f"{section.name}.{spec.name}"
        for section in dataclasses.fields(Config)
        for spec in dataclasses.fields(section.default_factory())
        if keys[f"{section.name}.{spec.name}"] in (int, float, str, list[str], bool | int)
        and "bound" not in spec.metadata
    ]
    drawn: set[str] = set()
    report = {"draws": 0, "refused": 0, "trained": 0, "preflight_s": 0.0, "train_s": 0.0, "keys": sorted(keys)}
    per_key, pairs = PROFILES[os.environ.get("HYPOTHESIS_PROFILE", "ci")]

    def one_key(key: str) -> st.SearchStrategy[list[tuple[str, str]]]:
        return values_for(key, keys[key], defaults[key]).map(lambda value: [(key, value)])

    def property_holds(draw: list[tuple[str, str]]) -> None:
        output_dir = tempfile.mkdtemp(prefix="out-", dir=".")
        overrides = [item for key, value in draw for item in (f"--{key}", value)]
        if not any(key == "job.output_dir" for key, _ in draw):
            overrides = ["--job.output_dir", output_dir, *overrides]
        argv = ["--config", config_toml, *base, *overrides]
        report["draws"] += 1
        drawn.update(key for key, _ in draw)
        started = time.monotonic()
        code, stdout, stderr = run_case(["--world-size", "1", *argv])
        report["preflight_s"] += time.monotonic() - started
        if code == 2:
            assert stdout == "" and stderr.startswith("preflight.py: error: "), (draw, stdout, stderr)
            assert stderr.count("\n") == 1 and stderr.endswith("\n"), (draw, stderr)
            report["refused"] += 1
            return
        assert code == 0 and stdout == stderr == "", (draw, code, stdout, stderr)
        started = time.monotonic()
        numbers = train_first_step(argv)
        report["train_s"] += time.monotonic() - started
        assert math.isfinite(numbers["loss"]) and numbers["weights_finite"], (draw, numbers)
        report["trained"] += 1

    # Every key on its own (so that none is left out), then pairs of keys drawn together.
    runs = [(one_key(key), per_key) for key in sorted(keys)]
    runs.append(
        (st.lists(st.sampled_from(sorted(keys)).flatmap(one_key), min_size=2, max_size=2).map(sum_lists), pairs)
    )
    for strategy, count in runs:
        # A new function per run: hypothesis takes one settings object per decorated function.
        run = given(draw=strategy)(lambda draw: property_holds(draw))
        settings(max_examples=count, derandomize=True, deadline=None, database=None,
                 suppress_health_check=list(HealthCheck))(run)()  # fmt: skip
    report["keys_drawn"] = sorted(drawn)
    report["unbounded"] = unbounded
    Path(report_file).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
