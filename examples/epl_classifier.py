"""EPL seed, large-scale image classification: data parallelism for the
ResNet, tensor parallelism for the classifier (sharded over its classes; the
logits are gathered on each group's first device for the loss), both on the
same devices.
Run: ``python examples/epl_classifier.py --world 2`` (or 4: two replicas)."""

import torch
from epl_common import main
from torch import nn

from unisched import epl


class ResNet(nn.Module):
    """A residual network small enough for a CPU: stem, one block, pooled head."""

    def __init__(self, features: int = 16):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, features))

    def forward(self, x):
        h = torch.relu(self.stem(x))
        return self.head(torch.relu(h + self.block(h)))


def build(world: int):
    config = epl.Config({"cluster.colocate_split_and_replicate": True})
    epl.init(config)
    with epl.replicate(2):
        ResNet(16)
    with epl.split(2):
        nn.Linear(16, 100)  # classification(): 100 classes, 50 per device
    return torch.randn(16, 3, 8, 8), torch.randint(0, 100, (16,)), nn.CrossEntropyLoss()


if __name__ == "__main__":
    main(build, world=2, doc=__doc__)
