"""EPL seed, data parallelism: ``with epl.replicate(device_count=1): model()``
on every device.  Run: ``python examples/epl_data_parallel.py --world 2``."""

import torch
from epl_common import main, mlp
from torch import nn

from unisched import epl


def build(world: int):
    epl.init()
    with epl.replicate(device_count=1):
        mlp(6, 16, 3)
    return torch.randn(8, 6), torch.randint(0, 3, (8,)), nn.CrossEntropyLoss()


if __name__ == "__main__":
    main(build, world=2, doc=__doc__)
