"""Mixture-of-experts: the grouped-GEMM experts (torch._grouped_mm) against the per-expert loop, same numbers, faster?

    python benchmarks/moe_experts.py              # CUDA (compute capability 9.0+: H100, H200, B200), bf16
    python benchmarks/moe_experts.py --tiny       # CPU dry run: small shapes, fp32

Generates a `fsdp2gen new --moe` project in a temporary folder and imports its moe.py, so what is measured is
the generated code: `grouped_swiglu` (the path moe.py takes on CUDA bf16 GPUs of compute capability 9.0+) and
`looped_swiglu` (fp32 and older GPUs) on the same routed tokens and expert weights. The shape is one layer of the
qwen3-30b-a3b preset (128 experts, dim 2048, expert hidden 768), 8192 tokens x top 8, routed with a skew (some
experts get several times the mean, some none), as real routers do early in training.

Printed: each path's median time for forward + backward, the ratio loop / grouped, and the largest difference
between the two paths' outputs and gradients, relative to the largest value (bf16 rounds differently in one
kernel than in 128 matmuls: expect about 1e-2 at most). Nothing is asserted (tests/test_benchmarks.py runs it
--tiny).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
SHAPE = {"experts": 128, "dim": 2048, "hidden": 768, "tokens": 8192, "top_k": 8}
# Dimensions multiples of 4: the CPU kernel needs 16-byte strides (fp32).
TINY = {"experts": 8, "dim": 64, "hidden": 32, "tokens": 256, "top_k": 2}


def generated_moe(folder: Path):  # noqa: ANN201 (the generated module)
    """The moe.py of a freshly generated --moe project."""
    project = folder / "moe-bench"
    command = [sys.executable, "-m", "fsdp2gen", "new", str(project), "--moe", "--fp32", "--gpus", "1", "--yes"]
    subprocess.run(command, cwd=REPO, check=True, capture_output=True, text=True)
    sys.path.insert(0, str(project))
    import moe  # noqa: PLC0415 (only exists once generated)

    return moe


def skewed_counts(shape: dict[str, int], generator: torch.Generator) -> torch.Tensor:
    """Tokens per expert summing to tokens x top_k, drawn from a skewed (exponential) popularity."""
    total = shape["tokens"] * shape["top_k"]
    popularity = torch.empty(shape["experts"]).exponential_(generator=generator) ** 2
    counts = torch.floor(popularity / popularity.sum() * total).long()
    counts[0] += total - counts.sum()
    return counts


def measure(function, inputs: list[torch.Tensor], upstream: torch.Tensor, repeat: int):  # noqa: ANN001, ANN201
    """Median seconds of function(*inputs) and its backward from the gradient `upstream` (a real one: an expanded
    gradient, as .sum() gives, takes another kernel path), and the output and gradients of the last run."""
    times = []
    for _ in range(repeat):
        for tensor in inputs:
            tensor.grad = None
        if upstream.is_cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        out = function(*inputs)
        out.backward(upstream)
        if upstream.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    grads = [tensor.grad for tensor in inputs if tensor.grad is not None]
    return statistics.median(times[1:] or times), [out.detach(), *grads]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU, small shapes, fp32")
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda and not args.tiny:
        sys.exit("benchmarks/moe_experts.py: the grouped path runs on CUDA GPUs; add --tiny for the CPU dry run")
    shape = TINY if args.tiny else SHAPE
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    with tempfile.TemporaryDirectory() as folder:
        moe = generated_moe(Path(folder))
        generator = torch.Generator().manual_seed(0)
        counts = skewed_counts(shape, generator)
        experts, dim, hidden = shape["experts"], shape["dim"], shape["hidden"]

        def draw(*size: int) -> torch.Tensor:
            tensor = torch.randn(*size, generator=generator) * 0.02
            return tensor.to(device, dtype).requires_grad_()

        routed = draw(int(counts.sum()), dim)
        w1, w2, w3 = draw(experts, hidden, dim), draw(experts, dim, hidden), draw(experts, hidden, dim)
        counts = counts.to(device)
        if cuda:
            print(f"device: {torch.cuda.get_device_name(device)}, moe.py uses the grouped path: "
                  f"{moe.use_grouped_mm(routed, hidden)}")  # fmt: skip
        else:
            print("device: CPU (dry run): fp32, torch's reference grouped kernel")
        tokens, top_k = shape["tokens"], shape["top_k"]
        spread = f"min {int(counts.min())} / mean {counts.float().mean():.0f} / max {int(counts.max())}"
        print(f"shape: {experts} experts, dim {dim}, hidden {hidden}, {tokens} tokens x top {top_k}")
        print(f"tokens per expert: {spread}")
        inputs = [routed, counts, w1, w2, w3]
        upstream = draw(int(counts.sum()), dim).detach()
        grouped_s, grouped = measure(moe.grouped_swiglu, inputs, upstream, args.repeat)
        looped_s, looped = measure(moe.looped_swiglu, inputs, upstream, args.repeat)
    print(f"grouped (forward + backward) {grouped_s * 1e3:10.2f} ms (median of {args.repeat})")
    print(f"looped  (forward + backward) {looped_s * 1e3:10.2f} ms (median of {args.repeat})")
    print(f"looped / grouped = {looped_s / grouped_s:.2f}")
    names = ["output", "routed grad", "w1 grad", "w2 grad", "w3 grad"][: len(grouped)]
    for name, a, b in zip(names, grouped, looped, strict=True):
        difference = float((a.float() - b.float()).abs().max()) / max(float(b.float().abs().max()), 1e-30)
        print(f"{name}: max |grouped - looped| / max |looped| = {difference:.2e}")


if __name__ == "__main__":
    main()
