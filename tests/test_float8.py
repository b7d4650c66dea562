"""--float8: torchao's Float8Linear in the blocks, weights all-gathered in float8, on 2 gloo ranks (llama; the hf and
custom families' blocks on one); with tensor and pipeline parallelism, alone and together, the first step's gradients
equal to float8 on one process: llama at tp 2 x dp 2, pp 2 x dp 2 and tp 2 x pp 2, then an hf model's declared plans
at the same three layouts, all in one launch of 4 ranks (the probes fixture).

Torch's CPU float8 matmul (a reference kernel) runs the real float8 numerics here, ~20x slower than bf16, so
the runs are tiny. On GPUs below compute capability 8.9 the generated test checks the error instead.
"""

from __future__ import annotations

import contextlib
import os
import re
import runpy
import sys
from pathlib import Path

import pytest

from tests.conftest import HELPERS, TINY, generate, project_modules, run_own_tests, torchrun


def tiny_hf_model(folder: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


# ffn_dim 172 (TINY's, and the generated tests' tiny model's) is not a multiple of 16: w1, w2, w3 stay bf16; wq, wk, wv,
# wo of both blocks are converted. The token embedding and output layer are not in a block and are never converted.
LLAMA_CONVERTED = "float8: 8 of the blocks' 14 linear layers compute in float8 (CPU: torch's slow reference kernel)\n"


@pytest.mark.parametrize("family", ["llama", "hf", "custom"])
def test_float8_project_tracks_bf16_and_resumes_exactly(tmp_path: Path, family: str) -> None:
    options = ["--hf-model", str(tiny_hf_model(tmp_path / "model"))] if family == "hf" else []
    project = generate(tmp_path / "run", "--family", family, "--gpus", "2", "--bf16", "--float8", *options)
    assert "float8 = true" in (project / "config.toml").read_text()
    # Float8 vs bf16 within 1% of the loss at every step; resumed from a checkpoint, the same float8 steps. (-s: the
    # test prints its float8 run's conversion line, between the test's name and PASSED.) What a family adds is which
    # layers its blocks convert, and that they train and resume: one rank shows it. The float8 all-gather over 2
    # ranks is torchao's for every Float8Linear, whatever the family: llama's run proves it (a rank fewer in the
    # hf and custom runs' 3 launches saves ~25 CPU-s).
    nproc = 2 if family == "llama" else 1
    stdout = run_own_tests(project, "-vv", "-s", "tests/test_training.py", "-k", "float8", nproc=nproc)
    passed = r"^tests/test_training.py::test_float8_training_tracks_bf16_and_resumes_exactly float8: .*\nPASSED"
    assert re.search(passed, stdout, flags=re.M), stdout
    if family == "llama":
        # Only the block linears whose dimensions are multiples of 16, on TINY's shape (2 gloo ranks, bf16).
        assert LLAMA_CONVERTED in stdout, stdout


# One block: the tp run's bf16 rounding (below) enters at wo, and one block keeps the float8 casts downstream of it few.
# The project is generated with --pp 2 as well: its defaults (training.grad_accum_steps 2, loss_chunks 1) are pp's,
# so the tp run names a tp-only project's (1 and 8) and the pipeline run its own, two blocks (one per stage).
ONE_BLOCK = [*TINY, "--model.n_layers", "1", "--job.device", "cpu", "--parallel.pp", "1", "--training.grad_accum_steps",
             "1", "--training.loss_chunks", "8"]  # fmt: skip
TWO_STAGES = [*TINY, "--job.device", "cpu", "--training.grad_accum_steps", "2", "--training.loss_chunks", "1"]
# tp 2 x pp 2 on 4 ranks leaves one data-parallel rank: 4 micro-batches of 2 samples, the same micro-batches as pp 2 x
# dp 2's 2 ranks x 2 (data.py's micro_batches; float8 scales each micro-batch's activations by its own maximum), so
# both compare with one reference. Two blocks, one per stage, each split over the tp ranks.
TP_AND_STAGES = [*TINY, "--job.device", "cpu", "--training.grad_accum_steps", "4", "--training.loss_chunks", "1"]
# The parameters forward computes after the float8 attention (ffn_dim 172: the MLP stays bf16): their gradients say
# whether the attention computed float8's numbers, little blurred by the tp run's own rounding.
AFTER_ATTENTION = re.compile(r"\.(ffn_norm|feed_forward)\.|^(norm|output)\.weight$")


def first_step_gradients(project: Path, out: Path, shape: list[str], *overrides: str) -> dict:
    """tests/helpers/mixed_precision_reference.py's first-step gradients (plain PyTorch, one process, emulating the 2
    data-parallel ranks' batches, bf16, the project's float8 layers unless overridden), computed in this process."""
    import torch

    script = str(HELPERS / "mixed_precision_reference.py")
    argv, threads, grads = sys.argv, torch.get_num_threads(), os.environ.get("GRADS")
    try:
        with project_modules(project), contextlib.chdir(project), torch.random.fork_rng():
            torch.set_num_threads(1)
            os.environ["GRADS"] = str(out / "grads.pt")
            sys.argv = [script, str(out), "bf16", "2", *shape, "--training.steps", "1", *overrides]
            runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv = argv
        torch.set_num_threads(threads)
        os.environ.pop("GRADS") if grads is None else os.environ.update(GRADS=grads)
    return torch.load(out / "grads.pt")


def distance(got: dict, expected: dict, names: list[str]) -> float:
    """|got - expected| / |expected| over the named gradients, taken as one vector."""
    difference = sum(float(((got[name] - expected[name]) ** 2).sum()) for name in names)
    return (difference / sum(float((expected[name] ** 2).sum()) for name in names)) ** 0.5


def assert_near_float8(label: str, got: dict, float8: dict, bf16: dict, bounds: list[tuple[list[str], float]]) -> None:
    """For each (names, bound): got's distance to float8 on one process, over those gradients, is at most `bound`
    times float8's own distance to bf16 (the yardstick: what float8 changes at all)."""
    assert sorted(got) == sorted(float8)
    for names, bound in bounds:
        ratio = distance(got, float8, names) / distance(bf16, float8, names)
        print(f"\n{label} vs one process, {len(names)} gradients: {ratio:.3g} of float8's distance to bf16")
        assert ratio <= bound, (label, names, ratio)


@pytest.fixture(scope="module")
def probes(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One launch of 4 gloo ranks (tests/helpers/float8_tp_probe.py): the llama project's three layouts (the test
    below), then the hf project's (test_float8_hf_...), each layout's first-step gradients in its file. Returns the
    projects, the hf model's folder, the files and the launch's stdout."""
    root = tmp_path_factory.mktemp("float8-probes")
    llama = generate(root / "llama", "--gpus", "4", "--bf16", "--float8", "--tp", "2", "--pp", "2")
    folder = tiny_hf_model(root / "model")
    hf = generate(root / "hf", "--family", "hf", "--hf-model", str(folder), "--gpus", "4", "--bf16", "--float8",
                  "--tp", "2", "--pp", "2")  # fmt: skip
    files = {name: root / f"{name}.pt" for name in ("tp", "pp", "tp-pp", "hf-tp", "hf-pp", "hf-tp-pp")}
    layouts = [
        f"{files['tp']}=--parallel.tp 2 {' '.join(ONE_BLOCK)}",
        f"{files['pp']}=--parallel.tp 1 {' '.join(TWO_STAGES)}",
        f"{files['tp-pp']}=--parallel.tp 2 {' '.join(TP_AND_STAGES)}",
        f"@{hf}",  # the hf project's modules from here on
        f"{files['hf-tp']}=--parallel.tp 2 --parallel.pp 1 --training.grad_accum_steps 2 {' '.join(HF_STEP)}",
        f"{files['hf-pp']}=--parallel.tp 1 --parallel.pp 2 --training.grad_accum_steps 2 {' '.join(HF_STEP)}",
        f"{files['hf-tp-pp']}=--parallel.tp 2 --parallel.pp 2 --training.grad_accum_steps 4 {' '.join(HF_STEP)}",
    ]
    stdout = torchrun(llama, str(HELPERS / "float8_tp_probe.py"), *layouts, "--", nproc=4).stdout
    return {"llama": llama, "hf": hf, "model": folder, "files": files, "stdout": stdout}


def test_float8_tensor_and_pipeline_parallel_equal_float8_on_one_process(probes: dict, tmp_path: Path) -> None:
    """The probes fixture's llama layouts, three in turn on 4 gloo ranks, each one first step from
    train.py's train_step, its gradients against float8 on one process (plain PyTorch):

    - tp 2 x dp 2: float8 conversion before tp, the Float8Linear layers split (torch's styles, on GPUs too: gloo
      cannot all-gather float8, so torchao's float8 styles cannot be tested here), float8 gathers for FSDP, each
      weight's scale precomputed over all its shards before the step. Not bit for bit: tp sums wo's two halves in
      bf16 where one process sums in fp32, and float8's 3-bit mantissa turns those bf16 differences into whole
      float8 steps for a few percent of the elements downstream. Measured on this machine (relative distance of the
      gradients, tp vs one process, / the same for bf16 vs float8 on one process): after the attention 0.18, all
      parameters 0.54; with each tp rank's weight slice scaled on its own (the first step's scale computed in the
      forward, over the data-parallel ranks only) 0.87 and 0.81; tp in bf16 1.00 and 1.00 (bf16 tp vs bf16 one
      process: 0.0044 apart, float8 vs bf16 0.029). The bounds sit between. (On gloo torch's styles split the
      Float8Linear layers, so they cannot be told apart from torchao's here: the same scales.)
    - pp 2 x dp 2 (1F1B, 2 micro-batches, a block per stage): each stage converts its own blocks, the scales of
      every stage's weights are precomputed before the step, and the schedule's micro-batches run float8 matmuls.
      No tp, so nothing rounds differently from one process: measured 4.7e-10 of float8's distance to bf16 (sums
      in another order); with the second stage left in bf16, 0.89. (Precomputing the scales or not gives the same
      numbers here, each stage's weight whole on its dp ranks: the precompute saves one all-reduce per weight.)
    - tp 2 x pp 2 (dp 1; 1F1B, 4 micro-batches): each stage converts its block, then tp splits it; the scales of each
      stage's weights precomputed over both tp slices. Against pp's reference (the same micro-batches), measured:
      after the attention 0.42, all parameters 0.64 (tp's bf16 rounding, over two blocks); with each tp slice scaled
      on its own (precompute left out) 1.04 and 0.97. The bounds sit between.
    """
    project, files = probes["llama"], probes["files"]
    tp, pp, tp_pp = files["tp"], files["pp"], files["tp-pp"]
    # tp: wq, wk, wv, wo convert (multiples of 16 x tp); w1, w2, w3 (172 wide) stay bf16. pp (and tp x pp): the same
    # layers of rank 0's stage (block 0) convert; the other stage converts block 1's. (The hf layouts' lines follow.)
    converted = re.findall(r"^float8: .*", probes["stdout"], flags=re.M)[:3]
    assert converted == ["float8: 4 of the blocks' 7 linear layers compute in float8 (CPU: torch's slow reference "
                         "kernel)"] * 3, probes["stdout"][-2000:]  # fmt: skip
    import torch

    float8 = first_step_gradients(project, tmp_path / "float8", ONE_BLOCK)
    bf16 = first_step_gradients(project, tmp_path / "bf16", ONE_BLOCK, "--parallel.float8", "false")
    after = [name for name in float8 if AFTER_ATTENTION.search(name)]
    assert len(after) == 6, after
    assert_near_float8("float8 tp 2 x dp 2", torch.load(tp), float8, bf16, [(after, 0.5), (list(float8), 0.7)])
    float8 = first_step_gradients(project, tmp_path / "float8-pp", TWO_STAGES)
    bf16 = first_step_gradients(project, tmp_path / "bf16-pp", TWO_STAGES, "--parallel.float8", "false")
    assert_near_float8("float8 pp 2 x dp 2", torch.load(pp), float8, bf16, [(list(float8), 1e-6)])
    after = [name for name in float8 if AFTER_ATTENTION.search(name)]
    assert len(after) == 10, after
    assert_near_float8("float8 tp 2 x pp 2", torch.load(tp_pp), float8, bf16, [(after, 0.7), (list(float8), 0.8)])


# The hf project's shape: global batch 8 of 32 tokens, the loss at once, in micro-batches of 2 samples: 2 per rank on 2
# data-parallel ranks (tp 2 x dp 2, pp 2 x dp 2), 4 on one (tp 2 x pp 2, and the reference on one process). Float8
# scales each micro-batch's activations by its own maximum: every layout's micro-batches are the reference's.
HF_STEP = ["--job.device", "cpu", "--training.steps", "1", "--training.seq_len", "32", "--training.global_batch_size",
           "8", "--training.loss_chunks", "1"]  # fmt: skip
HF_ONE_PROCESS = [*HF_STEP, "--training.grad_accum_steps", "4"]
# The tiny Llama's parameters forward computes after its first attention.
HF_AFTER_ATTENTION = re.compile(r"post_attention_layernorm|\.mlp\.|^model\.norm\.weight$|^lm_head\.weight$")


def hf_first_step_gradients(project: Path, folder: Path, float8: bool) -> dict:
    """The first step's gradients of plain transformers on one process (from_pretrained, fp32 master weights), as
    the hf project's one data-parallel rank computes them in bf16: per micro-batch, the weights cast to bf16 (the
    float8 layers' kept fp32, torchao casts them to float8 itself, as FSDP2's float8 all-gather does), forward and
    backward, the gradients accumulated in fp32; the loss is the cross-entropy summed over the step's targets, over
    their number. With `float8` the decoder layers' linear layers become Float8Linear, as train.py converts them."""
    import torch
    from torch.nn.utils.stateless import _reparametrize_module
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from transformers import AutoModelForCausalLM

    with project_modules(project), contextlib.chdir(project), torch.random.fork_rng():
        from config import parse_args
        from data import ShuffledEpochs, SyntheticTokens, micro_batches

        training = (config := parse_args(HF_ONE_PROCESS)).training
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        for block in model.model.layers if float8 else []:
            convert_to_float8_training(block, config=Float8LinearConfig())  # every dimension a multiple of 16
        float8_weights = {f"{name}.weight" for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
        samples = SyntheticTokens(
            config.model.vocab_size, training.seq_len, config.data.synthetic_samples, training.seed
        )
        batches = micro_batches(ShuffledEpochs(samples, training.seed), 0, training.global_batch_size,
                                training.grad_accum_steps, 0, 1)  # fmt: skip
    params = dict(model.named_parameters())
    grads = {name: torch.zeros_like(param) for name, param in params.items()}
    targets = sum(batch.targets.numel() for batch in batches)  # synthetic: every target counts
    for batch in batches:
        cast = {name: (p if name in float8_weights else p.to(torch.bfloat16)).detach().requires_grad_()
                for name, p in params.items()}  # fmt: skip
        with _reparametrize_module(model, cast):
            logits = model(batch.inputs).logits.float().flatten(0, 1)
            (torch.nn.functional.cross_entropy(logits, batch.targets.flatten(), reduction="sum") / targets).backward()
        for name, param in cast.items():
            grads[name] += param.grad.float()
    return grads


def test_float8_hf_tensor_and_pipeline_parallel_equal_float8_on_one_process(probes: dict) -> None:
    """An hf model (tiny Llama, pretrained weights) under float8, the probes fixture's hf layouts, three in turn on 4
    gloo ranks (after llama's, in the same launch), each one first step's gradients against float8 on one process
    (plain transformers, hf_first_step_gradients):

    - tp 2 x dp 2: the model's declared tp plan (tensor_parallel.py, torch's ColwiseParallel/RowwiseParallel) splits
      the Float8Linear layers train.py converted first; each weight's scale precomputed over both tp slices. Measured
      on this machine (as llama's above): after the first attention 0.64, all parameters 0.80 of float8's distance to
      bf16 (o_proj and down_proj sum their halves in bf16: both blocks' MLPs are float8 too, so more casts are
      downstream of that rounding than in llama's one-block run); each tp slice scaled on its own (precompute left
      out) 1.05 and 1.04 (measured at tp 2 on 2 ranks; 1.09 and 1.10 at tp 2 x pp 2 below); tp in bf16 1.00 and
      1.00. The bounds sit between.
    - pp 2 x dp 2: each stage (pipeline_stages.py's cut of the declared pp plan) converts its own decoder layer; the
      schedule's 2 micro-batches. Measured bit for bit equal to one process (0.0); the second stage left in bf16
      (pp 2 on 2 ranks) 0.96.
    - tp 2 x pp 2 (dp 1, 4 micro-batches): each stage converts its decoder layer, the tp plan splits it, the scales
      precomputed per stage over both tp slices. Measured 0.64 and 0.80, as tp 2 x dp 2 (the stages add no
      rounding); precompute left out 1.09 and 1.10. tp's bounds.
    """
    project, folder, files = probes["hf"], probes["model"], probes["files"]
    tp, pp, tp_pp = files["hf-tp"], files["hf-pp"], files["hf-tp-pp"]
    # q, k, v, o, gate, up, down of both decoder layers (tp), of rank 0's stage's one layer (pp, tp x pp).
    converted = re.findall(r"^float8: (\d+) of the blocks' (\d+) linear layers", probes["stdout"], flags=re.M)[3:]
    assert converted == [("14", "14"), ("7", "7"), ("7", "7")], probes["stdout"][-2000:]
    import torch

    float8 = hf_first_step_gradients(project, folder, float8=True)
    bf16 = hf_first_step_gradients(project, folder, float8=False)
    after = [name for name in float8 if HF_AFTER_ATTENTION.search(name)]
    assert len(after) == 10, after
    assert_near_float8("hf float8 tp 2 x dp 2", torch.load(tp), float8, bf16, [(after, 0.8), (list(float8), 0.9)])
    assert_near_float8("hf float8 pp 2 x dp 2", torch.load(pp), float8, bf16, [(list(float8), 1e-6)])
    assert_near_float8("hf float8 tp 2 x pp 2", torch.load(tp_pp), float8, bf16, [(after, 0.8), (list(float8), 0.9)])
