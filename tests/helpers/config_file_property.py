"""The shape of a generated project's config file, checked with hypothesis inside that project (one process):

    cd PROJECT && PYTHONPATH=PROJECT python config_file_property.py SCRATCH REPORT.json

For config files nobody listed (random bytes; TOML assembled from section headers, known and unknown, and keys of
any value: tables where a section or a value should be, arrays and inline tables nested up to 100,000 deep; the
project's own config.toml with lines dropped, repeated or changed), config.parse_args (what train.py, preflight.py
and the data scripts read it with) returns a Config, or exits with code 2 after one line on stderr; never a
traceback. Writes {"accepted", "refused"} to REPORT.json.

HYPOTHESIS_PROFILE=nightly draws more (see PROFILES).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from pathlib import Path

from config_property import keys_of  # tests/helpers/ is on the path
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

PROFILES = {"ci": 150, "nightly": 3000}
DEPTHS = [1, 2, 3, 50, 1000, 100_000]


def toml_values() -> st.SearchStrategy[str]:
    """TOML values as text: scalars, arrays and inline tables, some nested very deep."""
    scalars = st.one_of(
        st.integers(-(2**70), 2**70).map(str),
        st.floats().map(repr),
        st.booleans().map(lambda value: str(value).lower()),
        st.text(max_size=8).map(json.dumps),
        st.sampled_from(["1979-05-27T07:32:00Z", "07:32:00", "0x1F", "1_000", "'literal'", '"""multi\nline"""']),
    )
    nested = st.tuples(st.sampled_from(DEPTHS), st.sampled_from(["[", "{a = "]), scalars).map(
        lambda drawn: drawn[1] * drawn[0] + drawn[2] + ("]" if drawn[1] == "[" else "}") * drawn[0]
    )
    containers = st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=3).map(lambda items: f"[{', '.join(items)}]")
            | st.lists(st.tuples(st.sampled_from(["a", "steps", "lr"]), inner), max_size=3).map(
                lambda pairs: "{" + ", ".join(f"{key} = {value}" for key, value in pairs) + "}"
            )
        ),
        max_leaves=6,
    )
    return st.one_of(scalars, nested, containers)


def assembled(sections: list[str], keys: list[str]) -> st.SearchStrategy[bytes]:
    """TOML text: section headers (known, unknown, dotted, arrays of tables) and key = value lines."""
    header = st.sampled_from(sections + ["trainer", "training.inner", "job.x"]).flatmap(
        lambda name: st.sampled_from([f"[{name}]", f"[[{name}]]"])
    )
    line = st.one_of(
        header,
        st.tuples(st.sampled_from(keys + sections + ["x"]), toml_values()).map(lambda kv: f"{kv[0]} = {kv[1]}"),
        st.text(max_size=10),
    )
    return st.lists(line, max_size=8).map(lambda lines: ("\n".join(lines) + "\n").encode("utf-8", "surrogatepass"))


def edited(original: str) -> st.SearchStrategy[bytes]:
    """The project's config.toml with one line dropped, repeated, or given another value."""
    lines = original.splitlines()
    return st.tuples(st.integers(0, len(lines) - 1), st.sampled_from(["drop", "repeat", "value"]), toml_values()).map(
        lambda drawn: "\n".join(
            lines[: drawn[0]]
            + {
                "drop": [],
                "repeat": [lines[drawn[0]]] * 2,
                "value": [f"{lines[drawn[0]].partition('=')[0].strip() or 'x'} = {drawn[2]}"],
            }[drawn[1]]
            + lines[drawn[0] + 1 :]
        ).encode("utf-8", "surrogatepass")
    )


def main() -> None:
    scratch, report_file = Path(sys.argv[1]), sys.argv[2]
    sys.path.insert(0, os.getcwd())
    import dataclasses

    from config import Config, parse_args

    sections = [spec.name for spec in dataclasses.fields(Config)]
    keys = sorted({dotted.partition(".")[2] for dotted in keys_of(Config)})
    files = st.one_of(st.binary(max_size=64), assembled(sections, keys), edited(Path("config.toml").read_text()))
    report = {"accepted": 0, "refused": 0}
    path = scratch / "drawn.toml"

    @settings(max_examples=PROFILES[os.environ.get("HYPOTHESIS_PROFILE", "ci")], derandomize=True, deadline=None,
              database=None, suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(files)
    def shape_holds(content: bytes) -> None:
        path.write_bytes(content)
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr):
                config = parse_args(["--config", str(path)])
        except SystemExit as exit:
            assert exit.code == 2, (content[:200], exit.code, stderr.getvalue())
            line = stderr.getvalue()
            one_line = line.startswith(f"{Path(sys.argv[0]).name}: error: ") and line.count("\n") == 1
            assert one_line, (content[:200], line)
            assert len(line) < 2000, (content[:200], line[:300])  # a line, however large the value
            report["refused"] += 1
            return
        assert isinstance(config, Config) and stderr.getvalue() == "", content[:200]
        report["accepted"] += 1

    shape_holds()
    Path(report_file).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
