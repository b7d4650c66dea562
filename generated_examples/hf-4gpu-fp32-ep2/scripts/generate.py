"""Continue a prompt with a trained model, in one process (no torchrun; the CPU unless --device cuda).

    python scripts/generate.py --prompt "Once upon a time"          # the newest checkpoint, greedy
    python scripts/generate.py outputs/checkpoints/step-1000 --prompt "Once upon a time" --temperature 0.8 --top-k 50
    python scripts/generate.py --exported exported --prompt "Once upon a time"   # a folder of scripts/export.py
    python scripts/generate.py --prompt-ids 1,2,3                    # no tokenizer (synthetic data): ids in, ids out

Any checkpoint style loads, read by checkpoint_reader.py's open_checkpoint (as scripts/export.py reads it), into an
fp32 model. The tokenizer is
--tokenizer, else data.tokenizer of the run that wrote the checkpoint (its checkpoint.json holds the run's
config), else that run's model.path; with --exported, the folder's own (export.py copies it there).

--temperature 0 (the default) takes the most likely token each time; above 0 the logits are divided by it, only
the --top-k most likely tokens are kept (0: all), and the token is drawn with a generator seeded by --seed, so a
seed gives the same text every time. Generation stops at the tokenizer's end-of-text token or after
--max-new-tokens, and prints the continuation. Each token recomputes the whole sequence (no KV cache): simple,
and quick enough for the small models one looks at this way.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

PROJECT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PROJECT))  # the project's modules, from any current folder
from checkpoint_files import newest_checkpoint  # noqa: E402

# The reader scripts/export.py uses too: what generate.py loads is exactly what export.py writes.
from checkpoint_reader import CheckpointError, open_checkpoint  # noqa: E402
from model import ModelArgs, output_logits  # noqa: E402
from tokenizer import Tokenizer, TokenizerError, load_tokenizer  # noqa: E402


class GenerateError(Exception):
    """A mistake in the arguments or inputs; the message names it and the fix."""


def main() -> None:
    parser = argparse.ArgumentParser(description="Continue a prompt with a trained model.")
    parser.add_argument("checkpoint", nargs="?", type=Path, help="a step-N folder (default: the newest complete one)")
    parser.add_argument("--checkpoints", type=Path, default=Path("outputs/checkpoints"),
                        help="where to look for the newest checkpoint (default: %(default)s)")  # fmt: skip
    parser.add_argument("--exported", type=Path, help="instead of a checkpoint: a folder written by scripts/export.py")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the text to continue")
    prompt.add_argument("--prompt-ids", help="token ids to continue, e.g. 1,2,3; no tokenizer needed, prints ids")
    parser.add_argument("--tokenizer", help="a folder or hub id (default: the run's data.tokenizer, else its model)")
    parser.add_argument("--max-new-tokens", type=int, default=50, help="at most this many (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); above 0: sample")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default: 0, all)")
    parser.add_argument("--seed", type=int, default=0, help="of the sampling (default: %(default)s)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="(default: %(default)s)")
    args = parser.parse_args()
    try:
        print(generate(args))
    except (GenerateError, CheckpointError, TokenizerError) as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")


def generate(args: argparse.Namespace) -> str:
    """The continuation of the prompt: its text, or its ids (comma-separated) for --prompt-ids."""
    check_arguments(args)
    if args.exported is not None:
        if args.checkpoint is not None:
            raise GenerateError("give a checkpoint or --exported, not both")
        if not args.exported.is_dir():
            raise GenerateError(f"--exported {args.exported} is not a folder; give one written by scripts/export.py")
        model, model_args = load_exported(args.exported)
        # export.py copies the model's tokenizer into the folder.
        tokenizer = open_tokenizer(args, str(args.exported))
        prompt = prompt_ids(args, tokenizer, model_args.vocab_size)
    else:
        checkpoint = find_checkpoint(args)
        # Checked and opened, not read yet: the weights are read once the prompt is known to be fine.
        config, weights, read = open_checkpoint(checkpoint)
        model_args = ModelArgs(**config["model"])
        tokenizer = open_tokenizer(args, config["data"].get("tokenizer") or model_args.path)
        prompt = prompt_ids(args, tokenizer, model_args.vocab_size)
        model = load_checkpoint(model_args, weights, read)
    model = model.to(args.device).eval()
    new = continue_ids(model, prompt, args, model_args.max_seq_len, tokenizer.eos_id if tokenizer else None)
    if tokenizer is None:
        return ",".join(map(str, new))
    # Decoded with the prompt, then cut: some tokenizers (SentencePiece) drop a token's leading space when it
    # is decoded alone.
    text, before = tokenizer.decode(prompt + new), tokenizer.decode(prompt)
    return text[len(before) :] if text.startswith(before) else tokenizer.decode(new)


def check_arguments(args: argparse.Namespace) -> None:
    if args.prompt is not None and not args.prompt:
        raise GenerateError("--prompt is empty; give some text to continue")
    if args.max_new_tokens < 1:
        raise GenerateError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise GenerateError(f"--temperature must be 0 (greedy) or more, got {args.temperature}")
    if args.top_k < 0:
        raise GenerateError(f"--top-k must be 0 (all tokens) or more, got {args.top_k}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise GenerateError("--device cuda: no CUDA GPU is visible here; use --device cpu")


def find_checkpoint(args: argparse.Namespace) -> Path:
    checkpoint = args.checkpoint or newest_checkpoint(args.checkpoints)
    if checkpoint is None:
        raise GenerateError(f"no complete checkpoint (step-N folder) in {args.checkpoints}; give one or --checkpoints")
    return checkpoint


def open_tokenizer(args: argparse.Namespace, run_tokenizer: str) -> Tokenizer | None:
    """--tokenizer, else the run's; None for --prompt-ids, which needs none."""
    if args.prompt_ids is not None:
        return None
    spec = args.tokenizer or run_tokenizer
    if not spec:
        raise GenerateError(
            "no tokenizer: the run has no data.tokenizer; pass --tokenizer (a tokenizer.json, its folder or a hub "
            "id), or --prompt-ids 1,2,3 to continue token ids"
        )
    return load_tokenizer(spec)


def prompt_ids(args: argparse.Namespace, tokenizer: Tokenizer | None, vocab_size: int) -> list[int]:
    if tokenizer is not None:
        ids = tokenizer.encode(args.prompt)
        if not ids:
            raise GenerateError(f"--prompt {args.prompt!r} encodes to no tokens; give some text to continue")
    else:
        try:
            ids = [int(part) for part in args.prompt_ids.split(",")]
        except ValueError:
            ids = []
        if not ids or min(ids) < 0:
            raise GenerateError(f"--prompt-ids must be token ids separated by commas (1,2,3), got {args.prompt_ids!r}")
    if max(ids) >= vocab_size:
        raise GenerateError(
            f"the prompt has token id {max(ids)}, beyond the model's vocabulary ({vocab_size} ids); is --tokenizer "
            "the one the model was trained with?"
        )
    return ids


def load_checkpoint(model_args: ModelArgs, weights: dict, read: Callable[[str], torch.Tensor]) -> PreTrainedModel:
    """The model of an opened checkpoint in fp32 on the CPU, its weights read one tensor at a time."""
    # The model's own initialisation fills the non-persistent buffers (rotary inv_freq), which checkpoints do not
    # hold; every weight is replaced next.
    model = AutoModelForCausalLM.from_config(model_args.hf_config, dtype=torch.float32)
    state = model.state_dict()
    with torch.no_grad():
        for name in weights:
            # A tied weight is listed once: copying it fills every name it has.
            state[name].copy_(read(name))
    return model


def load_exported(folder: Path) -> tuple[PreTrainedModel, ModelArgs]:
    """The model of a folder written by scripts/export.py (or save_pretrained), in fp32 on the CPU."""
    try:
        model_args = ModelArgs(path=str(folder))
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    except (OSError, ValueError) as error:  # no such folder, no config.json or weights, an unknown model
        reason = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
        raise GenerateError(f"--exported {folder} cannot be loaded ({reason})") from None
    return model, model_args


@torch.no_grad()
def continue_ids(
    model: torch.nn.Module, prompt: list[int], args: argparse.Namespace, max_seq_len: int, eos_id: int | None
) -> list[int]:
    """Up to args.max_new_tokens new ids after `prompt`, ending before eos_id."""
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    ids, new = list(prompt), []
    while len(new) < args.max_new_tokens:
        # The last max_seq_len ids: the model knows no positions beyond.
        context = torch.tensor([ids[-max_seq_len:]], device=args.device)
        output = model(context, use_cache=False)  # transformers' KV cache: not used here
        logits = output_logits(output)[0, -1].float()
        if args.temperature == 0:
            token = int(logits.argmax())
        else:
            logits = logits / args.temperature
            if args.top_k:
                # Tokens below the k-th largest logit get probability 0.
                kth_largest = torch.topk(logits, min(args.top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth_largest, float("-inf"))
            token = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))
        if token == eos_id:
            break
        ids.append(token)
        new.append(token)
    return new


if __name__ == "__main__":
    main()
