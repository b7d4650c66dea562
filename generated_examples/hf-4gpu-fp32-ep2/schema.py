"""The config's schema: every key declares its bounds once, at its dataclass field, and one validator enforces
them for every key of every section (config.py's and model.py's), then the rules that tie keys together.

    steps: int = setting(1000, low=1, high=MAX_COUNT)

A value outside its bounds is one line that names the key, the allowed range, the value and a fix:
"training.steps must be at least 1, got 0; e.g. --training.steps 1000". Floats must be finite (NaN and inf
are refused) unless a field says `finite=False`; ints are bounded so that nothing overflows downstream
(torch's int64 and CUDA's int32 indexing, numpy's seeding, datetime.timedelta), and bools are not ints.

Each key also declares whether a resume may change it (`resume=True`): how long the run trains, its learning-rate
schedule, how it is logged, saved, sharded and computed. Every other key defines the run (the model, the batch and
sequence, the data and its order, the precision, LoRA's shape): a resume with another value is refused in one line
(run_folder.py), and a changed key that a resume may change is named once when the run resumes.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Counts (steps, batch sizes, lengths, sizes) stay below 2**31: they index tensors, CUDA kernels among them.
MAX_COUNT = 2**31 - 1


@dataclass(frozen=True)
class Bound:
    """What a numeric, string or list key accepts, besides its type (config.py's _convert checks that)."""

    low: float | None = None  # the smallest value allowed
    high: float | None = None  # the largest value allowed
    positive: bool = False  # above 0 (floats whose 0 would be meaningless: a learning rate, a timeout)
    below: float | None = None  # an upper limit the value must stay below
    zero: str = ""  # 0 is allowed too, and means this (e.g. "off"), whatever `low` says
    also: tuple[int, ...] = ()  # other values allowed, e.g. -1 for "the rest"
    finite: bool = True  # floats: NaN and inf refused
    nonempty: str = ""  # strings and lists: the fix to print when empty
    words: str = ""  # the allowed values in words, where the above do not say it well
    # A resume may change the key: True (the run continues exactly as it would have, or with the new value from the
    # step it resumes at), or ROUNDING (how a step is computed: the same numbers up to float rounding); False: the
    # key defines the run, which a resume keeps.
    resume: bool | str = False


def setting(default: Any, **bound: Any) -> Any:
    """A dataclass field with its default and its Bound (the keyword arguments)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"bound": Bound(**bound)})
    return field(default=default, metadata={"bound": Bound(**bound)})


@dataclass(frozen=True)
class Rule:
    """A constraint between keys: `holds(config)` must be true; else `message`, formatted with the config as c."""

    holds: Callable[[Any], bool]
    message: str


class SchemaError(ValueError):
    """A value that the schema refuses; the message is one line naming the key, the problem and the fix."""


# Bound.resume of the keys that decide how a step is computed, not what: the batch split into micro-batches, the
# loss into chunks, the model over ranks, the device. A resume may change them; the numbers then differ from the
# uninterrupted run's by float rounding only (another order of the same sums).
ROUNDING = "rounding"


def may_change_on_resume(spec: dataclasses.Field) -> bool:
    """Whether a resume may change the key of the dataclass field `spec` (its Bound's `resume`); a key declared
    without setting() defines the run."""
    bound = spec.metadata.get("bound")
    return bound is not None and bool(bound.resume)


def resume_changes(saved: Any, now: Any, may_change: bool) -> list[tuple[str, Any, Any]]:
    """(section.key, saved value, value now) of the keys of two Configs (`saved`: a checkpoint's) that differ, among
    those a resume may change (`may_change`) or those it may not; in the order the sections declare them."""
    changes = []
    for section in dataclasses.fields(saved):
        before, after = getattr(saved, section.name), getattr(now, section.name)
        for spec in dataclasses.fields(before):
            if may_change_on_resume(spec) == may_change and getattr(before, spec.name) != getattr(after, spec.name):
                changes.append((f"{section.name}.{spec.name}", getattr(before, spec.name), getattr(after, spec.name)))
    return changes


def resume_table(config_cls: type, model_may_change: tuple[str, ...]) -> str:
    """What a resume may change, as the README's Markdown: every key of `config_cls` (a Config dataclass) by its
    declaration (`model_may_change`: model.py's RESUME_MAY_CHANGE). fsdp2gen writes it into README.md."""
    groups: dict[str, list[str]] = {"yes": [], ROUNDING: [], "no": []}
    for section in dataclasses.fields(config_cls):
        for spec in dataclasses.fields(section.default_factory()):
            bound = spec.metadata.get("bound")
            kind = bound.resume if bound is not None and bound.resume else "no"
            if section.name == "model" and spec.name in model_may_change:
                kind = "yes"
            groups["yes" if kind is True else kind].append(f"`{section.name}.{spec.name}`")
    return (
        "| a resume | keys |\n|---|---|\n"
        f"| may change them; the run continues exactly as it would have, or with the new value from the step it "
        f"resumes at, and says which it changed | {', '.join(groups['yes'])} |\n"
        f"| may change them; the numbers then differ from the uninterrupted run's by float rounding only | "
        f"{', '.join(groups[ROUNDING])} |\n"
        f"| refuses another value in one line (they define the run) | {', '.join(groups['no'])} |\n"
    )


def as_option(value: Any) -> str:
    """A value as the command line writes it: --training.lr 0.001, --parallel.shard_modules Block,Attention."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value) if value != "" else "''"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


def _allowed(bound: Bound, is_int: bool) -> str:
    """The range of `bound` in words, on the side of its lower limit: "at least 1", "a positive number"..."""
    if bound.words:
        return bound.words
    if bound.positive:
        words = "a positive number"
    elif bound.low is not None and bound.below is not None:
        words = f"at least {_number(bound.low)} and below {_number(bound.below)}"
    elif bound.low is not None and bound.high is not None and not is_int:
        words = f"between {_number(bound.low)} and {_number(bound.high)}"
    elif bound.low is not None:
        words = f"at least {_number(bound.low)}" if bound.low else "0 or more"
    else:
        words = "a number"
    if bound.zero and (bound.low == 0 or is_int and bound.low == 1):
        words = f"0 ({bound.zero}) or more"
    elif bound.zero:
        words = f"0 ({bound.zero}) or {words}"
    for value in bound.also:
        words = f"{value} or {words}"
    return words


def check_value(key: str, value: Any, bound: Bound, default: Any) -> None:
    """Raise SchemaError unless `value` (of the type the key declares) is within `bound`."""
    if isinstance(value, str | list):
        if bound.nonempty and not value:
            raise SchemaError(f"{key} is empty; {bound.nonempty}")
        if any(isinstance(item, str) and "\0" in item for item in ([value] if isinstance(value, str) else value)):
            raise SchemaError(f"{key} contains a NUL character, which no path or name may hold; remove it")
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        return  # a bool, a choice (Literal): its type says it all
    is_int = isinstance(value, int)
    fix = f"e.g. --{key} {str(default).lower() if isinstance(default, bool) else _number(default)}"
    if value == 0 and bound.zero or value in bound.also:
        return
    if not is_int and bound.finite and not math.isfinite(value) and not math.isnan(value):
        raise SchemaError(f"{key} must be a finite number, got {value!r}; {fix}")
    low_ok = (
        (value > 0 if bound.positive else True)
        and (bound.low is None or value >= bound.low)
        and (bound.below is None or value < bound.below)
    )
    if not low_ok or value != value:  # NaN fails every comparison, and is named like a value below the range
        raise SchemaError(f"{key} must be {_allowed(bound, is_int)}, got {value!r}; {fix}")
    if bound.high is not None and value > bound.high:
        allowed = _allowed(bound, is_int)
        allowed = allowed if allowed.startswith("between") else f"at most {_number(bound.high)}"
        raise SchemaError(f"{key} must be {allowed}, got {value!r}; {fix}")


def check_section(name: str, section: Any) -> None:
    """Every field of the dataclass `section` ([name] of the config) within its Bound."""
    for spec in dataclasses.fields(section):
        bound = spec.metadata.get("bound")
        if bound is not None:
            default = spec.default if spec.default is not dataclasses.MISSING else spec.default_factory()
            check_value(f"{name}.{spec.name}", getattr(section, spec.name), bound, default)


def validate(config: Any, rules: list[Rule]) -> None:
    """Every key of every section of `config`, then the `rules` between keys, in order: the first problem
    raises SchemaError (so a rule may rely on the bounds, e.g. divide by a key that is at least 1)."""
    for spec in dataclasses.fields(config):
        check_section(spec.name, getattr(config, spec.name))
    for rule in rules:
        if not rule.holds(config):
            raise SchemaError(rule.message.format(c=config, ram=f"{total_memory() / 2**30:.1f} GiB"))


def total_memory() -> int:
    """This machine's memory in bytes: a bound for what one process can allocate."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
