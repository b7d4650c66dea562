"""`fsdp2gen check`: find FSDP2 mistakes in training scripts by reading them, never running them.

Only Python's `ast` is used: no torch import, no code executed, so it runs anywhere in milliseconds.
Every rule fires only on evidence inside the file it reads (a `fully_shard` call, an import, a
call order in one function or across the helper functions it calls, a dtype bound to a name); when
the evidence lives elsewhere the rule stays silent, so that a finding is worth reading.
`# fsdp2gen: noqa FSDPxxx` on a finding's line silences it.

This module runs the rules over files and reports what they find; the rules live in check_rules.py (FSDP001-011)
and check_rules_pipeline.py (FSDP012-015), the model of a file they query in check_analysis.py.
"""

from __future__ import annotations

import ast
import io
import json
import re
import tokenize
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

# Importing the rule modules registers their rules in RULES, in code order (check_rules first).
from fsdp2gen import check_rules, check_rules_pipeline  # noqa: F401
from fsdp2gen.check_analysis import RULES, CheckInputError, Finding, _Module

NOQA = re.compile(r"#\s*fsdp2gen:\s*noqa\b(?P<codes>(?:[\s,:]+FSDP\d{3})*)", re.IGNORECASE)


def _suppressed(source: str) -> dict[int, set[str] | None]:
    """Line -> codes silenced by `# fsdp2gen: noqa FSDPxxx` (None: every code) on that line."""
    suppressed: dict[int, set[str] | None] = {}
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return suppressed
    for token in tokens:
        if token.type != tokenize.COMMENT:
            continue
        match = NOQA.search(token.string)
        if match:
            codes = set(re.findall(r"FSDP\d{3}", match.group("codes").upper()))
            suppressed[token.start[0]] = codes or None
    return suppressed


def check_source(source: str, path: str = "<string>") -> list[Finding]:
    """Findings for one file's text, sorted, without the suppressed ones.

    Raises SyntaxError, and CheckInputError for code nested too deeply for Python's parser or for this
    checker (a 100,000-term `1 + 1 + ...` is a RecursionError in ast, a deep `- - - 1` a MemoryError).
    """
    too_deep = f"{path}: code nested too deeply to analyse (Python's %s limit); fix the file or exclude it"
    try:
        tree = ast.parse(source, filename=path)
    except MemoryError:
        # CPython's parser reports its own stack overflow (e.g. 100,000 unary minuses) as MemoryError.
        raise CheckInputError(too_deep % "parser stack") from None
    except RecursionError:
        raise CheckInputError(too_deep % "recursion") from None
    try:
        module = _Module(tree, path)
        for registered in RULES.values():
            module.checking = registered
            registered.check(module)
    except RecursionError:
        raise CheckInputError(too_deep % "recursion") from None
    # Tokenizing is the slowest step: only do it when there is something to suppress.
    suppressed = _suppressed(source) if module.findings and "noqa" in source else {}
    kept = {
        f
        for f in module.findings
        if f.line not in suppressed or (suppressed[f.line] is not None and f.code not in suppressed[f.line])
    }
    return sorted(kept)


def python_files(paths: Iterable[Path]) -> list[Path]:
    """The given files, and every *.py under the given folders (hidden folders and caches skipped)."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            for found in sorted(path.rglob("*.py")):
                parts = found.relative_to(path).parts
                if not any(part.startswith(".") or part == "__pycache__" for part in parts):
                    files.append(found)
        elif path.exists():
            files.append(path)
        else:
            raise CheckInputError(f"{path}: no such file or folder; pass Python files or folders")
    return files


def check_paths(paths: Iterable[Path]) -> list[Finding]:
    """Check every file; the first unreadable, unparsable or too deeply nested one raises CheckInputError
    (nothing is reported)."""
    findings: list[Finding] = []
    for file in python_files(paths):
        try:
            # utf-8-sig: a UTF-8 byte order mark (some Windows editors write one) is valid Python source.
            source = file.read_text(encoding="utf-8-sig")
        except UnicodeDecodeError as error:
            raise CheckInputError(
                f"{file}: cannot read (not UTF-8 text, byte {error.start}); save it as UTF-8 or exclude it"
            ) from None
        except OSError as error:
            raise CheckInputError(f"{file}: cannot read ({error.strerror}); fix the file or exclude it") from None
        try:
            findings += check_source(source, str(file))
        except SyntaxError as error:
            where = f"{file}:{error.lineno}" if error.lineno else str(file)
            detail = "" if error.msg == "invalid syntax" else f" ({error.msg})"
            raise CheckInputError(f"{where}: invalid syntax{detail}; fix the file or exclude it") from None
    return findings


def format_text(findings: list[Finding]) -> str:
    """`path:line:col: CODE message; fix: hint`, one line each, like ruff."""
    lines = [f"{f.path}:{f.line}:{f.col}: {f.code} {f.message}; fix: {f.fix}" for f in findings]
    if findings:
        files = len({f.path for f in findings})
        lines.append(f"Found {len(findings)} problem{'s' * (len(findings) != 1)} in {files} file{'s' * (files != 1)}.")
    return "\n".join(lines)


def format_json(findings: list[Finding]) -> str:
    return json.dumps([asdict(f) for f in findings], indent=2)
