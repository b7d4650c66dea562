# ruff: noqa
"""FSDP015, the correct way: the output layer has its own weight under pipeline parallelism."""

from torch import nn
from torch.distributed.pipelining import PipelineStage


class Model(nn.Module):
    def __init__(self, vocab, dim):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.output.bias = None  # not a tie


def build(rank, device):
    model = Model(128, 64)
    return PipelineStage(model, rank, 2, device)
