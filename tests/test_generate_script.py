"""scripts/generate.py: a tiny model trained until it memorises one sentence continues it from a checkpoint of
each style (dcp, full), greedily and by seeded sampling; bad input stops with one line. (For family hf, that the
checkpoint and its exported folder continue a prompt alike rides on test_hf.py's qwen2-tied training and export.)

No network: the tokenizers are made here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.conftest import TINY, generate
from tests.helpers.scripts import run_scripts
from tests.helpers.several_runs import launch_several

SENTENCE = "the quick brown fox jumps over the lazy dog."
PROMPT = "the quick brown"
# A memorised document continues to its end, where the end-of-text token stops generation.
CONTINUATION = " fox jumps over the lazy dog."


def run_generate(project: Path, *runs: list[str]) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of `scripts/generate.py ARGS` for each ARGS of `runs`."""
    return run_scripts(project, *(["scripts/generate.py", *args] for args in runs))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int]:
    """(tokenizer.json, token file, vocabulary size): the sentence as 200 documents, each ended by <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("corpus")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # All 256 bytes: any prompt encodes. The merges then make each word of the sentence one token.
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator([SENTENCE] * 10, trainer)
    tokenizer.save(str(root / "tokenizer.json"))
    document = [*tokenizer.encode(SENTENCE).ids, tokenizer.token_to_id("<|endoftext|>")]
    np.array(document * 200, dtype=np.uint16).tofile(root / "tokens.bin")
    return root / "tokenizer.json", root / "tokens.bin", tokenizer.get_vocab_size()


@pytest.fixture(scope="module")
def trained(corpus: tuple[Path, Path, int], tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """style -> (project, its output folder) after 30 steps on the corpus (the loss is near its floor by then): a
    project of each checkpoint style, both runs in ONE 2-rank launch (tests/helpers/several_runs.py; the full run
    by the full project's train.py)."""
    _, tokens, vocab_size = corpus
    root = tmp_path_factory.mktemp("generate")
    projects = {style: generate(root / style / "run", "--gpus", "2", "--fp32", "--checkpoint", style)
                for style in ("dcp", "full")}  # fmt: skip
    common = [*TINY, "--job.device", "cpu", "--model.vocab_size", str(vocab_size), "--training.steps", "30",
              "--eval.every", "0", "--data.path", str(tokens), "--data.document_mask", "false"]  # fmt: skip
    runs = [
        [*common, "--job.output_dir", str(root / "dcp" / "out")],
        # data.tokenizer is recorded in the checkpoint: generate.py needs no --tokenizer.
        {"args": [*common, "--data.tokenizer", str(corpus[0]), "--job.output_dir", str(root / "full" / "out")],
         "project": str(projects["full"])},
    ]  # fmt: skip
    launch_several(projects["dcp"], runs, root / "runs.json", nproc=2)
    return {style: (project, root / style / "out") for style, project in projects.items()}


@pytest.fixture(scope="module")
def dcp(trained: dict[str, tuple[Path, Path]]) -> tuple[Path, Path]:
    return trained["dcp"]


@pytest.fixture(scope="module")
def full(trained: dict[str, tuple[Path, Path]]) -> tuple[Path, Path]:
    return trained["full"]


def greedy_runs(style: str, corpus: tuple[Path, Path, int], output: Path) -> list[list[str]]:
    # The full run has data.tokenizer; the dcp run trained on a token file only.
    text = [*(["--tokenizer", str(corpus[0])] if style == "dcp" else []), "--prompt", PROMPT]
    return [
        # The newest checkpoint (step-30) of --checkpoints; at most 50 tokens, but the end-of-text token comes first.
        ["--checkpoints", str(output / "checkpoints"), *text],
        [str(output / "checkpoints" / "step-30"), *text, "--max-new-tokens", "3"],
    ]


def sampling_runs(corpus: tuple[Path, Path, int], output: Path) -> list[list[str]]:
    common = ["--checkpoints", str(output / "checkpoints"), "--tokenizer", str(corpus[0]), "--prompt", PROMPT,
              "--max-new-tokens", "20"]  # fmt: skip
    hot = ["--temperature", "3", "--top-k", "20"]
    return [
        [*common, *hot, "--seed", "7"],
        [*common, *hot, "--seed", "7"],
        [*common, *hot, "--seed", "8"],
        # Only the most likely token left to draw: greedy, whatever the temperature.
        [*common, "--temperature", "3", "--top-k", "1"],
    ]


def bad_input_cases(corpus: tuple[Path, Path, int], output: Path, tmp_path: Path) -> dict[str, list[str]]:
    """The expected line (or its start, up to a "(") -> the arguments that must stop with it; the damaged
    checkpoints they name are made in `tmp_path`."""
    checkpoint = output / "checkpoints" / "step-30"
    garbled = tmp_path / "garbled" / "step-1"
    garbled.mkdir(parents=True)
    (garbled / "checkpoint.json").write_text("{")
    weightless = tmp_path / "weightless" / "step-30"
    weightless.mkdir(parents=True)
    (weightless / "checkpoint.json").write_text((checkpoint / "checkpoint.json").read_text())
    text = [str(checkpoint), "--tokenizer", str(corpus[0]), "--prompt"]
    return {
        "no complete checkpoint (step-N folder) in nowhere; give one or --checkpoints":
            ["--checkpoints", "nowhere", "--prompt", PROMPT],
        f"{garbled} is not a complete checkpoint (Expecting property name enclosed in double quotes: line 1 "
        "column 2 (char 1))": [str(garbled), "--prompt-ids", "1"],
        # Its checkpoint.json lists files (with their checksums) that are not there.
        f"{weightless} is corrupt (.metadata: No such file or directory); export an older checkpoint": [
            str(weightless), "--prompt-ids", "1"
        ],
        # The run trained on a token file, without data.tokenizer.
        "no tokenizer: the run has no data.tokenizer; pass --tokenizer (a tokenizer.json, its folder or a hub id), "
        "or --prompt-ids 1,2,3 to continue token ids": [str(checkpoint), "--prompt", PROMPT],
        f"data.tokenizer {tmp_path / 'missing.json'}: {tmp_path / 'missing.json'} does not exist; give a "
        "tokenizer.json, its folder, or a hub id": [str(checkpoint), "--tokenizer", str(tmp_path / "missing.json"),
                                                    "--prompt", PROMPT],
        "--prompt is empty; give some text to continue": [*text, ""],
        "--max-new-tokens must be at least 1, got 0": [*text, PROMPT, "--max-new-tokens", "0"],
        "--temperature must be 0 (greedy) or more, got -0.5": [*text, PROMPT, "--temperature", "-0.5"],
        "--top-k must be 0 (all tokens) or more, got -1": [*text, PROMPT, "--top-k", "-1"],
        "--prompt-ids must be token ids separated by commas (1,2,3), got '1,,x'": [str(checkpoint),
                                                                                   "--prompt-ids", "1,,x"],
        f"the prompt has token id 9999, beyond the model's vocabulary ({corpus[2]} ids); is --tokenizer the one "
        "the model was trained with?": [str(checkpoint), "--prompt-ids", "3,9999"],
    }  # fmt: skip


@pytest.fixture(scope="module")
def dcp_generated(
    dcp: tuple[Path, Path], corpus: tuple[Path, Path, int], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, list]:
    """Every generate.py run on the dcp run, the three tests' runs, in ONE Python process (run_scripts: torch imported
    once): "greedy", "sampling" -> their (exit code, stdout, stderr), in order; "bad" -> (the expected message,
    (exit code, stdout, stderr)) of each bad input case."""
    project, output = dcp
    cases = bad_input_cases(corpus, output, tmp_path_factory.mktemp("bad-input"))
    groups = {"greedy": greedy_runs("dcp", corpus, output), "sampling": sampling_runs(corpus, output),
              "bad": list(cases.values())}  # fmt: skip
    results = iter(run_generate(project, *(run for runs in groups.values() for run in runs)))
    generated = {name: [next(results) for _ in runs] for name, runs in groups.items()}
    return {**generated, "bad": list(zip(cases, generated["bad"], strict=True))}


@pytest.mark.parametrize("style", ["dcp", "full"])
def test_greedy_continues_the_memorised_sentence_to_its_end(
    style: str, corpus: tuple[Path, Path, int], request: pytest.FixtureRequest
) -> None:
    if style == "dcp":  # in dcp_generated's process
        full_length, three_tokens = request.getfixturevalue("dcp_generated")["greedy"]
    else:
        project, output = request.getfixturevalue(style)
        full_length, three_tokens = run_generate(project, *greedy_runs(style, corpus, output))
    assert full_length == (0, CONTINUATION + "\n", "")
    assert three_tokens == (0, " fox jumps over\n", "")


def test_sampling_is_reproducible_with_a_seed(dcp_generated: dict[str, list]) -> None:
    first, again, other_seed, top_1 = dcp_generated["sampling"]
    assert first[0] == 0 and first == again
    # So hot that the memorised sentence is left: the seed decides the text.
    assert first[1] != CONTINUATION + "\n" and other_seed[0] == 0 and other_seed != first
    assert top_1 == (0, CONTINUATION + "\n", "")


def test_bad_input_stops_with_one_line(dcp_generated: dict[str, list]) -> None:
    for message, (code, stdout, stderr) in dcp_generated["bad"]:
        assert (code, stdout) == (2, ""), (message, stderr)
        assert stderr.count("\n") == 1 and stderr.startswith("generate.py: error: " + message), (message, stderr)
        if not message.endswith("("):
            assert stderr == f"generate.py: error: {message}\n"
