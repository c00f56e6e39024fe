"""The seed notebook's code cells, with only the import lines changed
(``parallelsim`` -> ``unisched``).  ``run_seed_cells()`` executes them and
returns every simulation they made, in order."""

import unisched
from unisched import ComputeAndWeightWorkers, Work

simulations = []


def run_seed_cells():
    simulations.clear()
    parallelsim = _Recorder()

    # In [31]
    num_workers = 6
    num_stages = 6
    num_batches = 6

    def DistributedDataParallel(w: Work):
        return ComputeAndWeightWorkers(w.batch, w.batch)

    assert num_batches == num_workers

    parallelsim.simulate(num_workers, num_stages, num_batches, DistributedDataParallel)

    # In [32]
    def FullyShardedDistributedDataParallel(w: Work):
        return ComputeAndWeightWorkers(w.batch, w.stage % num_workers)

    assert num_batches == num_workers

    parallelsim.simulate(num_workers, num_stages, num_batches, FullyShardedDistributedDataParallel)

    # In [33]
    num_stages = 6
    num_workers = 6
    num_batches = 12

    def GPipe(w: Work):
        return ComputeAndWeightWorkers(w.stage, w.stage)

    assert num_stages == num_workers

    parallelsim.simulate(
        num_workers,
        num_stages,
        num_batches,
        GPipe,
        parallelsim.OldestStageFirst(num_stages, num_batches),
    )

    # In [34]
    parallelsim.simulate(num_workers, num_stages, num_batches, GPipe)

    # In [35]
    def CuckooParallelism(work: Work) -> ComputeAndWeightWorkers:
        if (
            work.direction == parallelsim.Direction.BACKWARD
            and work.stage < num_stages // 2 + 2
            and work.batch < num_batches // 2 - 2
        ):
            return ComputeAndWeightWorkers(num_workers - work.stage - 1, work.stage)
        return ComputeAndWeightWorkers(work.stage, work.stage)

    parallelsim.simulate(num_workers, num_stages, num_batches, CuckooParallelism)

    # In [36]
    group_size = 3

    def LoopedPipelineParallelism(w: Work):
        def h(x, y):
            return (group_size * y % num_workers) + (x % group_size)

        worker = h(w.stage, w.batch)
        return ComputeAndWeightWorkers(worker, worker)

    parallelsim.simulate(num_workers, num_stages, num_batches, LoopedPipelineParallelism)

    # In [37]
    group_size = 3

    def FullyShardedLoopedPipelineParallelism(w: Work):
        def h(x, y):
            return (group_size * y % num_workers) + (x % group_size)

        return ComputeAndWeightWorkers(h(w.stage, w.batch), h(w.stage, w.stage))

    parallelsim.simulate(num_workers, num_stages, num_batches, FullyShardedLoopedPipelineParallelism)
    return list(simulations)


class _Recorder:
    """Stands where the notebook's ``parallelsim`` module stood: unisched,
    with each simulation kept for the test to inspect."""

    Direction = unisched.Direction
    OldestStageFirst = unisched.OldestStageFirst
    OldestBatchFirst = unisched.OldestBatchFirst

    @staticmethod
    def simulate(*args, **kwargs):
        result = unisched.simulate(*args, **kwargs)
        simulations.append(result)
        return result
