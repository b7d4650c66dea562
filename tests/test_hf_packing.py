"""Document masking in hf projects: model.py's loss hands per-document positions to transformers as position_ids,
and transformers masks attention between the documents packed in a row; preflight refuses a model or attention
implementation for which it does not (model.document_mask_error's probe). Tiny models made here from their config
classes, fp32, in rendered projects (the model.py of pretraining, and of SFT with LoRA)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import generate, save_tiny_llama
from tests.helpers.scripts import run_scripts

# Run inside a project: one packed batch against its documents one by one, for sdpa and eager, loss chunks 1 and 4.
PACKED = """
import sys

import torch
import transformers

from data import IGNORE
from model import add_chunked_loss, loss, output_logits

lora = sys.argv[1] == "lora"
sizes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             vocab_size=320, max_position_embeddings=64)
lengths = [[5, 7, 4], [9, 7]]  # the documents of each row of 16 tokens
torch.manual_seed(0)
rows = [[torch.randint(320, (n,)) for n in row] for row in lengths]
tokens = torch.stack([torch.cat(row) for row in rows])
positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])


def shifted(document):
    # Each token's target is the next token of its document; the last one's would be the next document's: IGNORE.
    targets = torch.cat([document[1:], torch.tensor([IGNORE])])
    if lora:
        targets[:2] = IGNORE  # an SFT prompt: no loss on it
    return targets


targets = torch.stack([torch.cat([shifted(document) for document in row]) for row in rows])
# Gemma 2 soft-caps its logits: its loss takes add_chunked_loss's other path, transformers' own forward.
models = {"sdpa": transformers.LlamaConfig(**sizes), "eager": transformers.LlamaConfig(**sizes),
          "gemma2": transformers.Gemma2Config(**sizes, head_dim=16, final_logit_softcapping=30.0)}
for attention, config in models.items():
    torch.manual_seed(0)
    implementation = "eager" if attention == "gemma2" else attention
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                          attn_implementation=implementation)
    model.config.use_cache = False  # as build_model sets it
    if lora:
        from model import add_lora_adapters

        add_lora_adapters(model, 4, 8.0, 0.0, ["q_proj", "v_proj"])
        for name, param in model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero; random B makes the adapters count
                torch.nn.init.normal_(param)
    model.eval()
    add_chunked_loss(model, 4)
    with torch.no_grad():
        for chunks in (1, 4):
            packed = loss(model, tokens, targets, positions=positions, chunks=chunks)
            sums = [loss(model, document[None], shifted(document)[None], reduction="sum", chunks=1)
                    for row in rows for document in row]
            counted = int((targets != IGNORE).sum())
            print(attention, "loss", chunks, float(packed), float(sum(sums) / counted))
        # The second document of row 0, after the first is replaced by other tokens: with positions it sees
        # nothing of the first; without, it does (so this check can fail).
        other = tokens.clone()
        other[0, :5] = (tokens[0, :5] + 1) % 320
        second = slice(5, 12)
        for given in ("positions", "none"):
            kwargs = {"position_ids": positions} if given == "positions" else {}
            before = output_logits(model(tokens, **kwargs))[0, second]
            after = output_logits(model(other, **kwargs))[0, second]
            print(attention, "logits", given, float((before - after).abs().max()))
"""


@pytest.fixture(scope="module")
def projects(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_packing")
    return {
        "pretrain": generate(root / "pretrain", "--family", "hf", "--hf-model", "models/unused", "--fp32"),
        "lora": generate(
            root / "sft", "--family", "hf", "--hf-model", "models/unused", "--task", "sft", "--lora", "--fp32"
        ),
    }


@pytest.fixture(scope="module")
def outputs(projects: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The stdout of PACKED in each project and of PROBE in the pretraining one: the pretraining project's two in
    one Python process (run_scripts)."""
    root = tmp_path_factory.mktemp("hf_packing_scripts")
    (root / "packed.py").write_text(PACKED)
    (root / "probe.py").write_text(PROBE)
    runs = {"pretrain": [str(root / "packed.py"), "pretrain"], "probe": [str(root / "probe.py")]}
    results = dict(zip(runs, run_scripts(projects["pretrain"], *runs.values()), strict=True))
    [results["lora"]] = run_scripts(projects["lora"], [str(root / "packed.py"), "lora"])
    for name, (code, _, stderr) in results.items():
        assert code == 0, (name, stderr[-3000:])
    return {name: stdout for name, (_, stdout, _) in results.items()}


@pytest.mark.parametrize("kind", ["pretrain", "lora"])
def test_packed_loss_equals_its_documents_one_by_one(kind: str, outputs: dict[str, str]) -> None:
    # Pretraining, and SFT with LoRA adapters (prompt tokens IGNORE): the packed batch's mean loss is the
    # token-weighted mean of its documents' losses, each run alone (positions from 0, nothing before it).
    rows = [line.split() for line in outputs[kind].splitlines()]
    losses = [row for row in rows if row[1] == "loss"]
    assert [row[0] + row[2] for row in losses] == ["sdpa1", "sdpa4", "eager1", "eager4", "gemma21", "gemma24"]
    for _, _, _, packed, alone in losses:
        assert float(packed) == pytest.approx(float(alone), rel=1e-5, abs=1e-5), outputs[kind]
    # A token's logits do not depend on the previous document in its window; without positions they do.
    logits = {(row[0], row[2]): float(row[3]) for row in rows if row[1] == "logits"}
    for attention in ("sdpa", "eager", "gemma2"):
        assert logits[attention, "positions"] <= 1e-5, outputs[kind]
        assert logits[attention, "none"] > 1e-3, outputs[kind]


# Run inside a project: document_mask_error for models and implementations made here on the meta device.
PROBE = """
import torch
import transformers

from model import document_mask_error

sizes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=320)
configs = {
    "llama": lambda: transformers.LlamaConfig(**sizes, num_key_value_heads=2),
    "mistral": lambda: transformers.MistralConfig(**sizes, num_key_value_heads=2, sliding_window=4),
    "gpt2": lambda: transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=320),
    "opt": lambda: transformers.OPTConfig(**sizes, ffn_dim=128, word_embed_proj_dim=64),
    "mamba": lambda: transformers.MambaConfig(hidden_size=64, num_hidden_layers=2, vocab_size=320),
}
cases = [("llama", "sdpa", 2), ("llama", "eager", 2), ("llama", "flex_attention", 2), ("mistral", "sdpa", 2),
         ("gpt2", "eager", 2), ("opt", "sdpa", 2), ("mamba", "eager", 2), ("llama", "flash_attention_2", 1),
         ("llama", "flash_attention_2", 4), ("llama", "paged|sdpa", 2)]
for kind, attention, rows in cases:
    forced = attention if attention.startswith(("flash", "paged")) else None  # not loadable on a CPU: set after
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(configs[kind](), attn_implementation=forced and "eager"
                                                              or attention)
    model.config.use_cache = False
    if forced:
        model.config._attn_implementation_internal = forced
    print(kind, attention, rows, document_mask_error(model, rows), sep="\\t")
"""

FIX = ('use --data.document_mask false, or an attention implementation that masks documents ("attn_implementation": '
       '"sdpa", "eager" or "flex_attention" in the model\'s config.json)')  # fmt: skip


def test_the_probe_accepts_only_models_and_implementations_that_mask_documents(outputs: dict[str, str]) -> None:
    lines = [line for line in outputs["probe"].splitlines() if line.count("\t") == 3]
    verdicts = {tuple(line.split("\t")[:3]): line.split("\t")[3] for line in lines}
    for accepted in [("llama", "sdpa"), ("llama", "eager"), ("llama", "flex_attention"), ("mistral", "sdpa"),
                     ("gpt2", "eager")]:  # fmt: skip
        assert verdicts[(*accepted, "2")] == "None", verdicts
    assert verdicts["llama", "flash_attention_2", "1"] == "None", verdicts  # flash: one row per micro-batch only
    assert verdicts["opt", "sdpa", "2"] == (  # OPT's forward does not pass position_ids to create_causal_mask
        "data.document_mask: OPTForCausalLM with attn_implementation sdpa does not build transformers' packed-sequence "
        f"mask from position_ids, so packed documents would attend to each other; {FIX}"
    )
    assert verdicts["llama", "paged|sdpa", "2"].startswith(  # no mask function in masking_utils: no mask at all
        "data.document_mask: LlamaForCausalLM with attn_implementation paged|sdpa does not build"
    )
    assert verdicts["mamba", "eager", "2"] == (  # its config's layer_types: whatever the mask, state crosses documents
        "data.document_mask: MambaForCausalLM has linear_attention layers, which carry state across packed documents "
        "whatever the attention mask; use --data.document_mask false"
    )
    assert verdicts["llama", "flash_attention_2", "4"] == (
        "data.document_mask: flash_attention_2 separates packed documents only in micro-batches of one row (this "
        f"run's have 4); {FIX}, or one row per micro-batch (--training.grad_accum_steps)"
    )


def test_preflight_refuses_a_model_that_does_not_mask_documents(projects: dict[str, Path], tmp_path: Path) -> None:
    # One line, exit 2, before anything is written; the same model passes with --data.document_mask false, and a
    # Llama passes the check (both stop next, at the data folder that does not exist).
    import transformers

    opt = tmp_path / "opt"
    config = transformers.OPTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
                                    vocab_size=320, word_embed_proj_dim=64, max_position_embeddings=64)  # fmt: skip
    opt.mkdir()
    (opt / "config.json").write_text(json.dumps(config.to_dict()))
    llama = save_tiny_llama(tmp_path / "llama", "the cat sat on the mat " * 20)
    project = projects["pretrain"]

    def preflight(model: Path, *options: str) -> list[str]:
        return ["preflight.py", "--world-size", "1", "--config", "config.toml", "--model.path", str(model),
                "--data.path", str(tmp_path / "data"), "--job.output_dir", str(tmp_path / "out"),
                "--training.seq_len", "32", *options]  # fmt: skip

    # The three runs one after the other in one Python process (run_scripts).
    passing = [(opt, ["--data.document_mask", "false"]), (llama, [])]
    (code, _, stderr), *others = run_scripts(
        project, preflight(opt), *(preflight(model, *options) for model, options in passing)
    )
    assert code == 2, stderr
    assert stderr.count("error:") == 1 and stderr.strip().splitlines()[-1] == (
        "preflight.py: error: data.document_mask: OPTForCausalLM with attn_implementation sdpa does not build "
        f"transformers' packed-sequence mask from position_ids, so packed documents would attend to each other; {FIX}"
    )
    assert not (tmp_path / "out").exists()
    for code, _, stderr in others:
        assert code == 2 and "document_mask" not in stderr, stderr
        assert str(tmp_path / "data") in stderr, stderr
