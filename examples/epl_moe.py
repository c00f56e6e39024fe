"""EPL seed, MoE transformer: the default strategy replicates everything built
outside scopes over all devices; the experts' weights are split over them
(each expert's feed-forward pair column/row-parallel).
Run: ``python examples/epl_moe.py --world 2``."""

import torch
from epl_common import main
from torch import nn

from unisched import epl


class AttentionAndGating(nn.Module):
    """Self-attention over the sequence, then a softmax gate over the experts."""

    def __init__(self, dim: int, experts: int):
        super().__init__()
        self.attention = nn.MultiheadAttention(dim, num_heads=2, batch_first=True)
        self.gate = nn.Linear(dim, experts)

    def forward(self, x):
        h = (x + self.attention(x, x, x, need_weights=False)[0]).mean(dim=1)
        return torch.cat([h, torch.softmax(self.gate(h), dim=-1)], dim=-1)


class MOE_Variable_Define(nn.Module):
    """The experts: one feed-forward pair each, mixed by the gate."""

    def __init__(self, dim: int, hidden: int, experts: int):
        super().__init__()
        self.dim = dim
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)) for _ in range(experts)
        )

    def forward(self, x):
        h, gates = x[:, : self.dim], x[:, self.dim :]
        mixed = torch.stack([expert(h) for expert in self.experts], dim=-1)
        return h + (mixed * gates.unsqueeze(1)).sum(dim=-1)


def build(world: int):
    config = epl.Config({"cluster.colocate_split_and_replicate": True})
    epl.init(config)
    total_gpu_num = epl.Env.get().cluster.total_gpu_num

    epl.set_default_strategy(epl.replicate(total_gpu_num))
    AttentionAndGating(8, 4)
    with epl.split(total_gpu_num):
        MOE_Variable_Define(8, 32, 4)
    nn.Linear(8, 10)  # MOE_Calculation_Define(): the output layer
    return torch.randn(16, 5, 8), torch.randint(0, 10, (16,)), nn.CrossEntropyLoss()


if __name__ == "__main__":
    main(build, world=2, doc=__doc__)
