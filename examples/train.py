"""Train a small MLP or transformer under any registered strategy, one process per worker.

    torchrun --nproc-per-node 4 examples/train.py --strategy gpipe
    torchrun --nproc-per-node 4 examples/train.py --strategy zb_h1 --model transformer --check
    torchrun --nproc-per-node 4 examples/train.py --plan plan.json --timeline step.html

The models, data and loop live in ``unisched.execute.example`` so that
``unisched run`` can launch the same thing from an installed package; the
heart of it is::

    schedule = unisched.simulate(W, S, B, unisched.policies.get(name, num_workers=W, num_stages=S, num_batches=B))
    trainer = unisched.Trainer(stages, schedule, loss_fn, lambda p: torch.optim.SGD(p, lr=0.05))
    for step in range(steps):
        loss = trainer.step(inputs, targets)       # the full batch; split into B micro-batches
    state = trainer.gather_state_dict()            # {"<stage>.<name>": tensor} on every rank
"""

from unisched.execute.example import main

if __name__ == "__main__":
    raise SystemExit(main())
