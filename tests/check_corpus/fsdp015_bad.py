# ruff: noqa
"""FSDP015: tied input and output embeddings in a pipelined model."""

from torch import nn
from torch.distributed.pipelining import PipelineStage


class Model(nn.Module):
    def __init__(self, vocab, dim):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.output.weight = self.tok_embeddings.weight  # expect: FSDP015


def build(rank, device):
    model = Model(128, 64)
    return PipelineStage(model, rank, 2, device)
