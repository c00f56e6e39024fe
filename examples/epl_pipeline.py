"""EPL seed, pipeline parallelism: two stages, ``pipeline.num_micro_batch`` 4;
on 4 devices EPL adds two-way data parallelism over the pipeline.
Run: ``python examples/epl_pipeline.py --world 4``."""

import torch
from epl_common import main, mlp
from torch import nn

from unisched import epl


def build(world: int):
    config = epl.Config({"pipeline.num_micro_batch": 4})
    epl.init(config)
    with epl.replicate(device_count=1, name="stage_0"):
        mlp(6, 12, 12, last_activation=True)  # model_part1()
    with epl.replicate(device_count=1, name="stage_1"):
        mlp(12, 8, 3)  # model_part2()
    return torch.randn(16, 6), torch.randint(0, 3, (16,)), nn.CrossEntropyLoss()


if __name__ == "__main__":
    main(build, world=4, doc=__doc__)
