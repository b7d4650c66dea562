"""Training configuration: `config.toml` plus `--section.key VALUE` overrides.

Every section is a dataclass, so a key that does not exist, or a value of the
wrong type, is an error before any process group or model is created. Each key
declares its bounds at its field (schema.py), and RULES below (with model_args.py's
MODEL_RULES) tie keys together: load_config checks them all, for every key.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import reprlib
import stat
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from errors import stop

# model_args.py, not model.py: reading a config imports no torch.
from model_args import MODEL_RULES, ModelArgs
from schema import MAX_COUNT, ROUNDING, Rule, SchemaError, setting, total_memory, validate


@dataclass
class JobConfig:
    device: Literal["auto", "cpu", "cuda"] = setting("auto", resume=ROUNDING)
    output_dir: str = setting("outputs", nonempty="name a folder, e.g. --job.output_dir outputs", resume=True)
    log_every: int = setting(10, low=1, high=MAX_COUNT, resume=True)
    # config.toml sets 60 for full checkpoints (rank 0 writes, the others wait). At most ~2 years: the process
    # group's timeout is a timedelta, which overflows near 1e12 minutes.
    timeout_minutes: float = setting(10, low=1, high=1_000_000, resume=True)


@dataclass
class TrainingConfig:
    # A resume may change how long the run trains and its learning-rate schedule (they take effect from the step it
    # resumes at), not what it trains on: the seed, the batch and the sequence are fixed (schema.py).
    steps: int = setting(1000, low=1, high=MAX_COUNT, resume=True)
    seed: int = setting(0, low=0, high=2**32 - 2)  # numpy seeds below 2**32; validation uses seed + 1
    global_batch_size: int = setting(32, low=1, high=MAX_COUNT)
    seq_len: int = setting(256, low=1, high=MAX_COUNT)
    lr: float = setting(3e-4, positive=True, high=10, resume=True)
    lr_min_ratio: float = setting(0.1, low=0, high=1, resume=True)
    warmup_steps: int = setting(100, low=0, high=MAX_COUNT, resume=True)
    weight_decay: float = setting(0.1, low=0, resume=True)
    grad_accum_steps: int = setting(1, low=1, high=MAX_COUNT, resume=ROUNDING)
    # When gradients are reduce-scattered with grad_accum_steps > 1: "every_micro_batch" keeps only sharded
    # gradients (1/N of the model per rank) at the cost of one reduce-scatter per micro-batch;
    # "last_micro_batch" reduces once per step but every rank holds the whole model's unsharded gradients
    # (in reduce_dtype) from the first micro-batch until the last one's backward.
    grad_sync: Literal["every_micro_batch", "last_micro_batch"] = setting("every_micro_batch", resume=ROUNDING)
    max_norm: float = setting(1.0, low=0, zero="no clipping", resume=True)
    # The loss's logits are computed in this many chunks of the sequence, one at a time (chunked_loss.py);
    # 1 = all at once. It must divide seq_len (RULES).
    loss_chunks: int = setting(8, low=1, high=MAX_COUNT, resume=ROUNDING)


@dataclass
class DataConfig:
    # "" = synthetic tokens; a folder written by scripts/prepare_data.py; or a flat file of token ids.
    path: str = setting("")
    # Documents packed into one window attend only to themselves, with positions restarting at 0 at each, as
    # they are at inference (and as torchtitan, TRL and Axolotl train): on by default so that a document never
    # learns from an unrelated one before it. Needs data that records where documents start (a folder written
    # by scripts/prepare_data.py); false = plain causal attention over the whole window.
    document_mask: bool = True
    # The tokenizer of scripts/prepare_data.py and scripts/generate.py; "" = the model's own (model.path).
    tokenizer: str = setting("", resume=True)  # read by the data scripts, not by training
    synthetic_samples: int = setting(4096, low=1, high=MAX_COUNT)


@dataclass
class EvalConfig:
    # Validation loss every N steps and after the last, over `batches` of global_batch_size samples each (the same
    # ones every time): a resume may change both, as they train nothing.
    every: int = setting(100, low=1, high=MAX_COUNT, zero="off", resume=True)
    batches: int = setting(4, low=1, high=MAX_COUNT, resume=True)


@dataclass
class ProfileConfig:
    # torch.profiler traces of `steps` steps from step `start` (1-based; 0 = off), one Chrome trace per rank
    # in output_dir/profile/ (open in https://ui.perfetto.dev).
    start: int = setting(0, low=1, high=MAX_COUNT, zero="off", resume=True)
    steps: int = setting(2, low=1, high=MAX_COUNT, resume=True)
    # On CUDA, a memory snapshot (https://pytorch.org/memory_viz) of the allocations up to this step; 0 = off.
    memory_snapshot_step: int = setting(0, low=1, high=MAX_COUNT, zero="off", resume=True)


@dataclass
class ParallelConfig:
    # HSDP: shard over groups of dp_shard ranks, replicate across dp_replicate groups (-1: the rest).
    dp_replicate: int = setting(1, low=1, high=MAX_COUNT, resume=ROUNDING)
    dp_shard: int = setting(-1, low=1, high=MAX_COUNT, also=(-1,), words="-1 (the rest) or at least 1", resume=ROUNDING)
    # Expert parallelism: each MoE layer's experts shared out over groups of ep ranks borrowed from dp_shard (1: off).
    ep: int = setting(2, low=1, high=MAX_COUNT, resume=ROUNDING)
    # true, false, or the size of the groups that keep parameters sharded between forward and backward.
    reshard_after_forward: bool | int = setting(
        True, low=1, high=MAX_COUNT, words="true, false or at least 1", resume=True
    )
    # Classes to fully_shard one module at a time; empty: the model's _no_split_modules (its decoder layers).
    shard_modules: list[str] = setting([], resume=True)


@dataclass
class CheckpointConfig:
    interval: int = setting(100, low=1, high=MAX_COUNT, resume=True)
    keep_last: int = setting(2, low=1, high=MAX_COUNT, resume=True)
    model_only_final: bool = setting(False, resume=True)
    resume: Literal["auto", "never"] = setting("auto", resume=True)
    # "hf": each checkpoint is also written as a Hugging Face transformers folder, job.output_dir/hf/step-N/ (the
    # newest keep_last kept), which from_pretrained loads as it is; resume still reads checkpoints/step-N/ only.
    save_format: Literal["native", "hf"] = setting("native", resume=True)


@dataclass
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelArgs = field(default_factory=ModelArgs)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


# The rules between keys of the config, after each key's own bounds (model_args.py's MODEL_RULES come first). Each
# message is formatted with the config as `c` and this machine's memory as `ram`.
RULES = [
    *MODEL_RULES,
    Rule(
        lambda c: c.training.lr * c.training.weight_decay <= 1,
        "training.lr x training.weight_decay = {c.training.lr} x {c.training.weight_decay} is above 1: AdamW "
        "multiplies the weights by 1 - lr x weight_decay each step, which would flip their sign; lower "
        "--training.weight_decay",
    ),
    # Equal chunks: each chunk's logits have the same shape, so its memory (and a compiled kernel) is the same.
    Rule(
        lambda c: c.training.seq_len % c.training.loss_chunks == 0,
        "training.loss_chunks = {c.training.loss_chunks} does not divide training.seq_len = {c.training.seq_len} "
        "(the loss is computed in equal sequence chunks); pick a divisor of seq_len, e.g. --training.loss_chunks 1",
    ),
    # ShuffledEpochs draws a permutation of the sample indices (8 bytes each) on every rank.
    Rule(
        lambda c: c.data.path or 8 * c.data.synthetic_samples <= total_memory(),
        "data.synthetic_samples = {c.data.synthetic_samples} takes 8 bytes each to shuffle, more than this "
        "machine's {ram} of memory; use fewer, e.g. --data.synthetic_samples 4096",
    ),
]


class ConfigError(ValueError):
    pass


def _field_types(section_cls: type) -> dict[str, typing.Any]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}


def _convert(value: object, expected: typing.Any, key: str) -> object:
    """Check (TOML values) or parse (command-line strings) `value` as the type declared for `key`."""
    if isinstance(expected, types.UnionType):  # e.g. bool | int: the first type that accepts the value
        for option in typing.get_args(expected):
            try:
                return _convert(value, option, key)
            except ConfigError:
                pass
        names = " or ".join(option.__name__ for option in typing.get_args(expected))
        raise ConfigError(f"{key} must be {names}, got {shown(value)}")
    if typing.get_origin(expected) is Literal:
        choices = typing.get_args(expected)
        if value not in choices:
            raise ConfigError(f"{key} must be one of {', '.join(map(repr, choices))}, got {shown(value)}")
        return value
    if expected == list[str]:
        # On the command line a comma-separated list: --parallel.shard_modules Block,Embedding
        items = [item for item in value.split(",") if item] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
            raise ConfigError(f"{key} must be a list of strings, got {shown(value)}")
        return items
    if isinstance(value, str) and expected is not str:
        if expected is bool:
            if value.lower() not in ("true", "false"):
                raise ConfigError(f"{key} must be true or false, got {shown(value)}")
            return value.lower() == "true"
        try:
            return expected(value)
        except ValueError:
            raise ConfigError(f"{key} must be {expected.__name__}, got {shown(value)}") from None
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(value) is not expected:
        raise ConfigError(f"{key} must be {expected.__name__}, got {shown(value)}")
    return value


def load_config(path: str | Path, overrides: dict[str, str] | None = None) -> Config:
    """Read `path`, apply `{"section.key": "value"}` overrides, and return a typed Config."""
    # Only a regular file: opening a FIFO would wait for a writer forever, a device could be read forever.
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
        raise ConfigError(f"config file {path} is {kind}; pass --config PATH of a TOML file")
    values = config_tables(read_toml(Path(path)), f"config file {path}")
    for dotted, value in (overrides or {}).items():
        section, _, key = dotted.partition(".")
        if section not in values or not key:
            raise ConfigError(f"unknown option --{dotted}; options look like --training.steps 20")
        values[section][key] = value
    config = typed_config(values, unknown_keys=True)
    try:
        validate(config, RULES)
    except SchemaError as error:
        raise ConfigError(str(error)) from None
    return config


def read_toml(path: Path) -> dict:
    """A config file's TOML; a file that is not TOML as one line that says what to fix."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except UnicodeDecodeError as error:  # a binary file
        raise ConfigError(
            f"config file {path} is not text (byte {error.start} is not UTF-8); pass --config PATH of a TOML file"
        ) from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"config file {path} is not valid TOML ({error}); fix it, or pass --config PATH") from None
    except RecursionError:  # tomllib parses nested arrays and tables recursively
        raise ConfigError(
            f"config file {path} nests arrays or tables too deeply to read; a config has one level of [sections]"
        ) from None


def config_tables(raw: object, source: str, *, every_section: bool = False) -> dict[str, dict[str, object]]:
    """The shape of a config (a config file's TOML, or the "config" a checkpoint.json saved): a table of known
    [sections], each a table of keys; {section: {key: value}} for typed_config. ConfigError otherwise. With
    `every_section`, each section of Config must be there (a checkpoint saves them all)."""
    sections = _field_types(Config)
    if not isinstance(raw, dict):
        raise ConfigError(f"{source} is not a table of [sections] but {shown(raw)}")
    values: dict[str, dict[str, object]] = {name: {} for name in sections}
    for section, table in raw.items():
        if section not in sections:
            raise ConfigError(f"unknown section [{section}] in {source}; known: {', '.join(sections)}")
        if not isinstance(table, dict):
            fix = f"; write it as a [{section}] line and key = value lines" if source.startswith("config") else ""
            raise ConfigError(f"[{section}] in {source} is not a table but {shown(table)}{fix}")
        values[section].update(table)
    missing = [name for name in sections if name not in raw]
    if every_section and missing:
        raise ConfigError(f"{source} lacks the section(s) {', '.join(missing)}")
    return values


def typed_config(values: dict[str, dict[str, object]], *, unknown_keys: bool) -> Config:
    """The Config of `values` ({section: {key: value}}): each value checked, or parsed, as its key's type. An
    unknown key is refused with `unknown_keys`, else passed over (a checkpoint of an older version of the
    project may hold keys it since dropped). The bounds and rules are load_config's."""
    kwargs = {}
    for section, section_cls in _field_types(Config).items():
        types = _field_types(section_cls)
        known = {}
        for key, value in values[section].items():
            if key in types:
                known[key] = _convert(value, types[key], f"{section}.{key}")
            elif unknown_keys:
                raise ConfigError(f"unknown key {section}.{key}; known: {', '.join(types)}")
        kwargs[section] = section_cls(**known)
    return Config(**kwargs)


def saved_config(table: object) -> Config:
    """The Config a checkpoint.json saved (its "config"), read through the same schema as config.toml: every
    section there and a table, every value of its key's type. ValueError (ConfigError) for any other shape."""
    return typed_config(config_tables(table, 'checkpoint.json\'s "config"', every_section=True), unknown_keys=False)


def shown(value: object) -> str:
    """`value` for a one-line message: short, however long or deeply nested it is."""
    return reprlib.repr(value)


def parse_args(argv: list[str] | None = None) -> Config:
    """`train.py [--config config.toml] [--section.key VALUE ...]`; a mistake exits with one line and code 2."""
    parser = argparse.ArgumentParser(description="FSDP2 training", allow_abbrev=False)
    parser.add_argument("--config", default="config.toml", help="TOML file (default: %(default)s)")
    args, rest = parser.parse_known_args(argv)
    try:
        return load_config(args.config, parse_overrides(rest))
    except (ConfigError, TypeError, ValueError) as error:
        message = str(error)
    except FileNotFoundError:
        message = f"config file {args.config} not found; pass --config PATH"
    except OSError as error:
        message = f"config file {args.config} cannot be read ({error.strerror or error}); pass --config PATH"
    # Under torchrun every rank parses the same arguments: one of them says what is wrong (errors.stop, which
    # also keeps a launch script from retrying it).
    stop(message)


# Given to train.py (through a launch script's extra arguments), these would be torchrun's, not the run's.
TORCHRUN_OPTIONS = ("--world-size", "--world_size", "--nproc-per-node", "--nproc_per_node", "--nnodes")


def parse_overrides(rest: list[str]) -> dict[str, str]:
    """["--training.steps", "20", "--job.device=cpu"] -> {"training.steps": "20", "job.device": "cpu"}."""
    overrides: dict[str, str] = {}
    while rest:
        flag = rest.pop(0)
        if flag.split("=")[0] in TORCHRUN_OPTIONS:
            raise ConfigError(
                f"{flag} is torchrun's option, not train.py's; the launch scripts take the ranks per node from "
                "NPROC (and NNODES), e.g. NPROC=4 scripts/launch_local.sh"
            )
        if not flag.startswith("--") or "." not in flag:
            raise ConfigError(f"unexpected argument {flag!r}; overrides look like --training.steps 20")
        name, eq, value = flag[2:].partition("=")
        if not eq:
            if not rest:
                raise ConfigError(f"{flag} needs a value")
            value = rest.pop(0)
        overrides[name] = value
    return overrides
