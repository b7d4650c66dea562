"""Model step time: the generated llama model vs a reference loop with torchtitan's llama3 model choices, on CPU.

    python benchmarks/model_step.py [--steps 5] [--repeat 5] [--threads 1] [--profile] [--tiny]

Generates a project (`fsdp2gen new --fp32`) into a temporary folder and imports its `model.py`. In one process,
on CPU, with the same number of threads, times a forward + backward + AdamW step of:

- ours: the project's `Transformer` (its own RMSNorm, rotary, attention, SwiGLU and init_weights);
- reference: the model below, written with the reference trainer's choices (torchtitan/models/llama3 and
  models/common: `nn.RMSNorm`, rotary as a complex multiply of adjacent pairs, `F.scaled_dot_product_attention`
  with `is_causal=True` and `enable_gqa` only when the kv heads are fewer, SwiGLU `w2(silu(w1 x) * w3 x)`,
  truncated-normal init with depth-scaled output projections),

at the shape of the reference trainer's debug model (dim 256, 6 layers, 16 heads, vocab 2048, fp32), for
seq 128 x batch 4 and seq 256 x batch 8. Both see the same batches, alternate step by step, and use the same
AdamW (foreach). Prints the median step time of each (wall and CPU time: on a shared machine other processes
stretch the wall clock of either) and, per shape, the median of the step-by-step ratios ours / reference.
--profile adds torch.profiler's top ops by self CPU time for each model (one step per shape).
Target: ours / reference <= 1.03 (noise) at both shapes.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parent.parent

# torchtitan's llama3 "debugmodel": dim 256, 6 layers, 16 heads (kv heads = heads), vocab 2048; its FFN hidden
# size is 2/3 * 4 * dim rounded up to a multiple of 256 = 768.
SHAPE = {"dim": 256, "n_layers": 6, "n_heads": 16, "n_kv_heads": 16, "ffn_dim": 768, "vocab_size": 2048}
TINY_SHAPE = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 172, "vocab_size": 128}
RUNS = ((128, 4), (256, 8))  # (seq, batch)
TINY_RUNS = ((32, 2), (64, 2))


# ---- The reference: torchtitan's llama3 model choices, written out -------------------------------------------


def rope_cis(head_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """torchtitan's ComplexRoPE cache: (max_seq_len, head_dim / 2) complex64."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(max_seq_len), freqs).float()
    return torch.polar(torch.ones_like(angles), angles)


def rotate(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """ComplexRoPE.apply_rotary_emb on (batch, seq, heads, head_dim), adjacent dims as (real, imaginary)."""
    x_ = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_ * cis[None, :, None, :]).flatten(-2).type_as(x)


class RefAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.enable_gqa = n_heads > n_kv_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        q = self.wq(x).view(batch, seq_len, -1, self.head_dim)
        k = self.wk(x).view(batch, seq_len, -1, self.head_dim)
        v = self.wv(x).view(batch, seq_len, -1, self.head_dim)
        q, k = rotate(q, cis), rotate(k, cis)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=self.enable_gqa
        )
        return self.wo(out.transpose(1, 2).contiguous().view(batch, seq_len, -1))


class RefBlock(nn.Module):
    def __init__(self, shape: dict[str, int]) -> None:
        super().__init__()
        dim = shape["dim"]
        self.attention_norm = nn.RMSNorm(dim, eps=1e-5)
        self.attention = RefAttention(dim, shape["n_heads"], shape["n_kv_heads"])
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-5)
        self.w1 = nn.Linear(dim, shape["ffn_dim"], bias=False)
        self.w2 = nn.Linear(shape["ffn_dim"], dim, bias=False)
        self.w3 = nn.Linear(dim, shape["ffn_dim"], bias=False)

    def forward(self, x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cis)
        normed = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(normed)) * self.w3(normed))


class Reference(nn.Module):
    def __init__(self, shape: dict[str, int], max_seq_len: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(shape["vocab_size"], shape["dim"])
        self.layers = nn.ModuleList(RefBlock(shape) for _ in range(shape["n_layers"]))
        self.norm = nn.RMSNorm(shape["dim"], eps=1e-5)
        self.output = nn.Linear(shape["dim"], shape["vocab_size"], bias=False)
        self.register_buffer("cis", rope_cis(shape["dim"] // shape["n_heads"], max_seq_len, 10000.0), persistent=False)
        # torchtitan's init: normal embeddings, truncated normal 0.02, output projections scaled by depth.
        nn.init.normal_(self.tok_embeddings.weight)
        for layer_id, block in enumerate(self.layers):
            depth_std = 0.02 / math.sqrt(2 * (layer_id + 1))
            for linear in (block.attention.wq, block.attention.wk, block.attention.wv, block.w1):
                nn.init.trunc_normal_(linear.weight, std=0.02)
            for linear in (block.attention.wo, block.w2, block.w3):
                nn.init.trunc_normal_(linear.weight, std=depth_std)
        final_std = shape["dim"] ** -0.5
        nn.init.trunc_normal_(self.output.weight, std=final_std, a=-3 * final_std, b=3 * final_std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        cis = self.cis[: tokens.shape[1]]
        h = self.tok_embeddings(tokens)
        for block in self.layers:
            h = block(h, cis)
        return self.output(self.norm(h))


# ---- The measurement -----------------------------------------------------------------------------------------


def make_step(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """forward + cross-entropy + backward + AdamW (foreach, as the generated project uses on CPU)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> None:
        logits = model(inputs)
        F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def make_bf16_step(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """The step FSDP2 runs with MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32), torchtitan's
    default (training.mixed_precision_param = "bfloat16" whenever FSDP shards): forward and backward on a bf16
    copy of the parameters, gradients reduced into the fp32 ones, AdamW on fp32."""
    compute = copy.deepcopy(model)
    for param in compute.parameters():
        param.data = param.data.to(torch.bfloat16)
    masters, copies = list(model.parameters()), list(compute.parameters())
    optimizer = torch.optim.AdamW(masters, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> None:
        logits = compute(inputs)
        F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).backward()
        for master, param in zip(masters, copies, strict=True):
            master.grad = param.grad.float()
            param.grad = None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_copy_(copies, masters)  # the next all-gather's bf16 parameters

    return step


def print_profile(name: str, step: Callable[[torch.Tensor, torch.Tensor], None], batch: tuple, rows: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(*batch)
    print(f"--- {name}: top {rows} ops by self CPU time (one step)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="batches (steps) per repetition")
    parser.add_argument("--repeat", type=int, default=6, help="repetitions of the batches, each model a step in turn")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the same for both)")
    parser.add_argument(
        "--bf16-reference",
        action="store_true",
        help="also the reference with bf16 compute (torchtitan's default mixed_precision_param)",
    )
    parser.add_argument("--profile", action="store_true", help="print torch.profiler's top ops of each model")
    parser.add_argument("--project", type=Path, help="an existing generated llama project to import (default: new)")
    parser.add_argument("--tiny", action="store_true", help="tiny model, for a quick check that the script runs")
    args = parser.parse_args()
    shape, runs = (TINY_SHAPE, TINY_RUNS) if args.tiny else (SHAPE, RUNS)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        project = args.project
        if project is None:
            project = Path(tmp) / "model-step"
            command = [sys.executable, "-m", "fsdp2gen", "new", str(project), "--yes", "--gpus", "1", "--fp32"]
            subprocess.run(command, cwd=REPO, check=True, capture_output=True)
        sys.path.insert(0, str(project))
        from model import Transformer
        from model_args import ModelArgs

        max_seq_len = max(seq for seq, _ in runs)
        torch.manual_seed(0)
        ours = Transformer(ModelArgs(**shape, max_seq_len=max_seq_len))
        ours.init_weights(seed=0)
        reference = Reference(shape, max_seq_len)
        count = sum(p.numel() for p in ours.parameters())
        assert count == sum(p.numel() for p in reference.parameters()), "the two models differ in size"
        steps = {"ours": make_step(ours), "reference": make_step(reference)}
        if args.bf16_reference:
            steps["reference-bf16"] = make_bf16_step(Reference(shape, max_seq_len))
        print(
            f"CPU, {torch.get_num_threads()} thread(s), torch {torch.__version__}, {count / 1e6:.2f}M parameters fp32, "
            f"dim {shape['dim']}, {shape['n_layers']} layers, {shape['n_heads']}/{shape['n_kv_heads']} heads, "
            f"vocab {shape['vocab_size']}, {args.steps} batches x {args.repeat} repetitions"
        )
        generator = torch.Generator().manual_seed(0)
        for seq, batch in runs:
            tokens = torch.randint(0, shape["vocab_size"], (args.steps, batch, seq + 1), generator=generator)
            batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
            for step in steps.values():  # warm-up: first-call allocations, AdamW's state
                step(*batches[0])
            # Step by step, the two models alternating (and which goes first), so that both see the same load;
            # CPU time as well as wall time: other processes on a shared machine slow the wall clock of either.
            wall: dict[str, list[float]] = {name: [] for name in steps}
            cpu: dict[str, list[float]] = {name: [] for name in steps}
            names = list(steps)
            for index in range(args.repeat * len(batches)):
                inputs, targets = batches[index % len(batches)]
                for name in names if index % 2 == 0 else names[::-1]:
                    started, started_cpu = time.perf_counter(), time.process_time()
                    steps[name](inputs, targets)
                    wall[name].append(time.perf_counter() - started)
                    cpu[name].append(time.process_time() - started_cpu)
            samples = len(wall["ours"])
            references = [name for name in names if name != "ours"]
            for name in names:
                print(f"seq {seq} x batch {batch}: {name:<14} {statistics.median(wall[name]) * 1e3:9.2f} ms/step wall, "
                      f"{statistics.median(cpu[name]) * 1e3:9.2f} ms CPU (medians of {samples})")  # fmt: skip
            for reference_name in references:
                ratios = {
                    kind: statistics.median(a / b for a, b in zip(times["ours"], times[reference_name], strict=True))
                    for kind, times in (("wall", wall), ("CPU", cpu))
                }
                print(f"seq {seq} x batch {batch}: ours / {reference_name} = {ratios['CPU']:.3f} (CPU time; wall time "
                      f"{ratios['wall']:.3f}), median of the step-by-step ratios")  # fmt: skip
            if args.profile:
                for name, step in steps.items():
                    print_profile(f"{name}, seq {seq} x batch {batch}", step, batches[0], rows=15)


if __name__ == "__main__":
    main()
