# ruff: noqa
"""FSDP014, the correct way: the blocks keep their global names (an nn.ModuleDict keyed by index)."""

from torch import nn
from torch.distributed.pipelining import PipelineStage


class Model(nn.Module):
    def __init__(self, n_layers):
        super().__init__()
        # New blocks in a list is the model's own definition, not a renumbering.
        self.norms = nn.ModuleList([nn.LayerNorm(8) for _ in range(n_layers)])
        self.layers = nn.ModuleDict({str(i): nn.Linear(8, 8) for i in range(n_layers)})


def build(rank, device):
    model = Model(8)
    for name in list(model.layers.keys()):
        if int(name) // 4 != rank:
            del model.layers[name]  # layers.4 stays layers.4 on stage 1
    return PipelineStage(model, rank, 2, device)
