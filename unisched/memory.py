"""What each worker holds over time, derived from a Timeline.

One definition serves simulated and measured timelines alike (the simulator
enforces memory limits incrementally with the same rules):

- activations: the input of (stage s, batch b) is held from the start of
  F(s, b) to the end of its backward, *on the backward's worker* -- a worker
  that stores an activation for a forward run elsewhere holds it from the
  forward's start.  With a split backward, the input-gradient pass frees the
  fraction ``input_grad_frees`` and the weight-gradient pass the rest.
- weights: the stages a worker is the weight worker of, for the whole step
  and the optimizer step at its end; for a stage held in shards
  (``Timeline.weight_shards``), its shard on each holder instead.
- fetched: a fetched copy of a stage's weights (or of a shard), from the
  fetch's start to the end of the last item on that worker and stage before
  the next fetch for another item; and, on the weight worker, the flat copy
  it serves a whole stage from: made as the step starts (a rank's program
  serves first) and let go between two of its items, once the fetch has
  arrived (a shard is sent as it is held, without a copy).
- gradients: a fetched stage's gradient, from the start of the worker's
  first gradient pass of the stage after its previous return until it has
  been sent back to the weight worker.  The pass makes it as it runs,
  beside the fetched weights, which go when the pass ends: counted from
  its end, the two would never meet.
- weight_gradients: the gradient of a stage a worker holds the weights of,
  from the end of its first gradient pass of the stage (or the arrival of
  the first gradient returned to it, if earlier) to the optimizer step
  (during that pass it grows as the pass frees its stash, which is counted
  until the pass ends); and the buffer a returned gradient arrives in,
  which the weight worker posts and takes in between two of its items:
  from the start of the item it runs when the gradient is sent to the end
  of the one it runs when the gradient arrives.
- workspace: what a backward pass (either half of a split one) holds only
  while it runs (``Costs.backward_workspace_bytes``: a parameter's fresh
  gradient before it joins the accumulated one, the activations'
  gradients), on its worker from its start to its end; none for the pass
  that starts a fetched stage's gradient, whose parameters' gradients are
  that gradient, counted from the pass's start.
- optimizer: a stage's optimizer state (``Costs.optimizer_bytes``), on each
  of its weight workers (or its shard on each holder) for the whole step,
  like the weights.

In bytes, these are what a rank of the executor really holds, given Costs
with the stage's ``weight_bytes`` (parameters), ``stash_bytes`` (what a
forward keeps for its backward: its input, and the tensors autograd saves
when the graph is kept), ``backward_workspace_bytes`` and
``optimizer_bytes``; the last two are read from the Costs a timeline was
simulated with (a measured timeline has none: they count 0).  Not counted:
the messages in flight between stages, the output a forward hands on.  In
units (one per stash, stage or buffer) workspace and optimizer state count
nothing.

Intervals are half-open, so an item that frees memory at time t and one that
takes memory at t never overlap.
"""

from __future__ import annotations

import numpy as np

from unisched import dataflow
from unisched.timeline import MemoryCurve, Timeline, as_timeline
from unisched.work import FORWARD, Direction

MEMORY_KINDS = ("activations", "weights", "fetched", "gradients", "weight_gradients", "workspace", "optimizer")


def memory_curves(timeline: Timeline, kind: str = "total", unit: str = "bytes") -> list[MemoryCurve]:
    """Per-worker step curves of ``kind`` ("total" or one of ``MEMORY_KINDS``)
    in ``unit`` ("bytes", or "units": one per stash, stage or buffer)."""
    timeline = as_timeline(timeline, "memory_curves")
    if unit not in ("bytes", "units"):
        raise ValueError(f"unit must be 'bytes' or 'units', got {unit!r}")
    kinds = MEMORY_KINDS if kind == "total" else (kind,)
    if any(k not in MEMORY_KINDS for k in kinds):
        raise ValueError(f"kind must be 'total' or one of {MEMORY_KINDS}, got {kind!r}")
    pieces = [_HOLDS[k](timeline, unit == "bytes") for k in kinds]
    workers = np.concatenate([p[0] for p in pieces])
    starts = np.concatenate([p[1] for p in pieces])
    ends = np.concatenate([p[2] for p in pieces])
    amounts = np.concatenate([p[3] for p in pieces])
    return step_curves(timeline.num_workers, workers, starts, ends, amounts)


def step_curves(num_workers: int, workers, starts, ends, amounts) -> list[MemoryCurve]:
    """Sum of half-open holds ``[start, end)`` per worker, as step curves."""
    keep = ends > starts
    workers, starts, ends, amounts = workers[keep], starts[keep], ends[keep], amounts[keep]
    ev_worker = np.concatenate([workers, workers])
    ev_time = np.concatenate([starts, ends])
    ev_delta = np.concatenate([amounts, -amounts])
    order = np.lexsort((ev_delta, ev_time, ev_worker))
    ev_worker, ev_time, ev_delta = ev_worker[order], ev_time[order], ev_delta[order]
    curves = []
    bounds = np.searchsorted(ev_worker, np.arange(num_workers + 1))
    for w in range(num_workers):
        lo, hi = bounds[w], bounds[w + 1]
        times, level = ev_time[lo:hi], np.cumsum(ev_delta[lo:hi])
        last_at_time = np.append(times[1:] != times[:-1], True) if hi > lo else np.zeros(0, bool)
        times, level = times[last_at_time], level[last_at_time]
        curves.append(MemoryCurve(np.concatenate([[0.0], times]), np.concatenate([[0.0], np.maximum(level, 0.0)])))
    return curves


def peak_activations(timeline: Timeline) -> list[float]:
    """Most stashed inputs each worker holds at once (the seed's definition)."""
    return [c.peak for c in memory_curves(timeline, "activations", "units")]


# ---------------------------------------------------------------------- holds
def _activation_holds(t: Timeline, in_bytes: bool):
    key = t.batch * t.num_stages + t.stage
    n = t.num_batches * t.num_stages
    fwd_start = np.full(n, np.nan)
    is_f = t.direction == FORWARD
    fwd_start[key[is_f]] = t.start[is_f]
    size = t.stash_bytes[t.stage] if in_bytes else np.ones(len(t))
    share = dataflow.stash_share_array(t.direction, t.split_backward, t.input_grad_frees)
    rows = np.flatnonzero(t.direction != FORWARD)
    starts = fwd_start[key[rows]]
    known = ~np.isnan(starts)
    rows, starts = rows[known], starts[known]
    return t.worker[rows], starts, t.end[rows], (size * share)[rows]


def _weight_holds(t: Timeline, in_bytes: bool):
    workers, stages, fraction = weights_held(t)
    amounts = t.weight_bytes[stages] * fraction if in_bytes else np.ones(len(stages))
    return workers, *_whole_step(t, len(workers)), amounts


def _optimizer_holds(t: Timeline, in_bytes: bool):
    """A stage's optimizer state, beside its weights of truth on each weight worker."""
    workers, stages, fraction = weights_held(t)
    return workers, *_whole_step(t, len(workers)), _per_stage(t, "optimizer_bytes", in_bytes)[stages] * fraction


def weights_held(t: Timeline) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(worker, stage, fraction) of the weights of truth each worker holds:
    a whole stage on each of its weight workers, or one shard on each
    holder of a stage held in shards (``Timeline.weight_shards``)."""
    pairs = np.unique(np.stack([t.weight_worker, t.stage]), axis=1) if len(t) else np.zeros((2, 0), int)
    if not t.weight_shards:
        return pairs[0], pairs[1], np.ones(pairs.shape[1])
    held = {}
    for w, s in pairs.T.tolist():
        holders = t.weight_shards.get((s, w), (w,))
        held.update({(h, s): dataflow.shard_fraction(len(holders)) for h in holders})
    workers, stages = (np.array(column, dtype=int).reshape(-1) for column in zip(*held) or ((), ()))
    return workers, stages, np.array(list(held.values()), dtype=float)


def own_share(t: Timeline, rows: np.ndarray) -> np.ndarray:
    """Per row: the fraction of its stage's weights of truth its worker
    holds (0: none; a shard of a sharded stage; 1: it is the weight worker)."""
    own = (~dataflow.fetches_weights(t.worker[rows], t.weight_worker[rows])).astype(float)
    if not t.weight_shards:
        return own
    W = t.num_workers
    groups = sorted(t.weight_shards.items())
    codes = np.array([s * W + w for (s, w), _ in groups])  # sorted: one per sharded (stage, weight worker)
    sizes = np.array([len(holders) for _, holders in groups])
    held = np.array([code * W + h for code, (_, holders) in zip(codes.tolist(), groups) for h in holders])
    code = t.stage[rows] * W + t.weight_worker[rows]
    sharded = np.flatnonzero(np.isin(code, codes))
    mine = np.isin(code[sharded] * W + t.worker[rows][sharded], held)
    own[sharded] = np.where(mine, dataflow.shard_fraction(sizes[np.searchsorted(codes, code[sharded])]), 0.0)
    return own


def _whole_step(t: Timeline, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Starts and ends of ``n`` holds that last from the step's start to its optimizer step."""
    begin = min(float(t.start.min(initial=0.0)), 0.0)
    return np.full(n, begin), np.full(n, _optimizer_step(t))


def _optimizer_step(t: Timeline) -> float:
    """When weights of truth and their gradients are let go: just after the
    step's last event, so that the optimizer step finds them together."""
    return float(np.nextafter(t.latency, np.inf))


def _workspace_holds(t: Timeline, in_bytes: bool):
    """Each backward pass's transient working memory, while it runs; none
    for a pass that starts a fetched stage's gradient (it writes the
    parameters' gradients in place, counted as that gradient from its start)."""
    backward = t.direction != FORWARD
    makers = _makers(t)[1]
    backward[makers[makers >= 0]] = False  # -1: a returned gradient whose maker was not found
    rows = np.flatnonzero(backward)
    return t.worker[rows], t.start[rows], t.end[rows], _per_stage(t, "backward_workspace_bytes", in_bytes)[t.stage[rows]]


def _per_stage(t: Timeline, name: str, in_bytes: bool) -> np.ndarray:
    """A per-stage size from the Costs the timeline was simulated with (zeros
    without them, or in units)."""
    if not in_bytes or t.costs is None:
        return np.zeros(t.num_stages)
    return t.costs.per_stage(name, t.num_stages)


def _fetched_holds(t: Timeline, in_bytes: bool):
    tr = t.transfers
    rows = np.flatnonzero(tr.of_kind("weights"))
    ends = np.empty(len(rows))
    S = max(t.num_stages, 1)
    item_key = t.worker * S + t.stage
    by_key = np.lexsort((t.start, item_key))  # items grouped by (worker, stage), each group in start order
    sorted_keys = item_key[by_key]
    for group in _groups(tr.dst[rows], tr.stage[rows]):
        fetches = rows[group]
        fetches = fetches[np.argsort(tr.start[fetches], kind="stable")]
        key = tr.dst[fetches[0]] * S + tr.stage[fetches[0]]
        items = by_key[np.searchsorted(sorted_keys, key, "left"):np.searchsorted(sorted_keys, key, "right")]
        next_fetch = _next_fetch(tr, fetches)
        last = np.searchsorted(t.start[items], next_fetch, side="left") - 1
        running_end = np.maximum.accumulate(t.end[items]) if len(items) else np.zeros(0)
        fetch_ends = np.where(last >= 0, running_end[np.maximum(last, 0)] if len(items) else 0.0, tr.end[fetches])
        ends[np.searchsorted(rows, fetches)] = np.maximum(fetch_ends, tr.end[fetches])
    amounts = tr.nbytes[rows] if in_bytes else np.ones(len(rows))
    fetched = tr.dst[rows], tr.start[rows], ends, amounts
    whole = rows[~np.isin(tr.stage[rows], [stage for stage, _ in t.weight_shards])]  # a shard is sent as it is
    whole_amounts = tr.nbytes[whole] if in_bytes else np.ones(len(whole))
    served = (tr.src[whole], _whole_step(t, len(whole))[0], _between_items(t, tr.src[whole], tr.end[whole], before=False),
              whole_amounts)
    return tuple(np.concatenate([a, b]) for a, b in zip(fetched, served))


def _next_fetch(tr, fetches: np.ndarray) -> np.ndarray:
    """Per fetch (rows of one worker and stage, by start): when the next
    fetch for another item starts (inf: none).  The shards an item gathers
    are one fetch."""
    serves = tr.batch[fetches] * len(Direction) + tr.direction[fetches]
    items, which = np.unique(serves, return_inverse=True)
    first = np.full(len(items), np.inf)
    np.minimum.at(first, which.reshape(-1), tr.start[fetches])
    starts = np.append(np.sort(first), np.inf)
    return starts[np.searchsorted(starts, first[which.reshape(-1)], side="right")]


def _weight_gradient_holds(t: Timeline, in_bytes: bool):
    """Gradients of a worker's weights of truth, and returned ones arriving."""
    pieces = [_own_gradient_holds(t, in_bytes), _returned_holds(t, in_bytes)]
    return tuple(np.concatenate([piece[i] for piece in pieces]) for i in range(4))


def _gradient_passes(t: Timeline) -> np.ndarray:
    return np.flatnonzero(t.direction == dataflow.gradient_pass(t.split_backward))


def _own_gradient_holds(t: Timeline, in_bytes: bool):
    """A weight worker's gradient of its stage (of its shard, for a stage
    held in shards): from the first gradient that reaches it (its own pass,
    or one returned) to the end of the step."""
    first: dict[tuple[int, int], float] = {}
    rows = _gradient_passes(t)
    own = rows[own_share(t, rows) > 0]
    for w, s, end in zip(t.worker[own].tolist(), t.stage[own].tolist(), t.end[own].tolist()):
        first[(w, s)] = min(first.get((w, s), np.inf), end)
    tr = t.transfers
    back = np.flatnonzero(tr.of_kind("weight_gradient"))
    taken = _between_items(t, tr.dst[back], tr.end[back], before=False)
    for w, s, end in zip(tr.dst[back].tolist(), tr.stage[back].tolist(), taken.tolist()):
        first[(w, s)] = min(first.get((w, s), np.inf), end)
    keys = list(first)
    workers = np.array([w for w, _ in keys], dtype=int)
    stages = np.array([s for _, s in keys], dtype=int)
    holders, held_stages, fractions = weights_held(t)
    held = dict(zip(zip(holders.tolist(), held_stages.tolist()), fractions.tolist()))
    fraction = np.array([held.get(k, 1.0) for k in keys])
    amounts = t.weight_bytes[stages] * fraction if in_bytes else np.ones(len(keys))
    return workers, np.array([first[k] for k in keys], dtype=float), np.full(len(keys), _optimizer_step(t)), amounts


def _gradient_holds(t: Timeline, in_bytes: bool):
    """A fetched stage's gradient: from the start of the pass that starts
    making it (:func:`_makers`) until it has been sent back."""
    rows, makers = _makers(t)
    tr = t.transfers
    starts = np.where(makers >= 0, np.minimum(t.start[makers], tr.start[rows]), tr.start[rows])
    amounts = tr.nbytes[rows] if in_bytes else np.ones(len(rows))
    return tr.src[rows], starts, tr.end[rows], amounts


def _makers(t: Timeline) -> tuple[np.ndarray, np.ndarray]:
    """The returned gradients (rows of the transfers) and, for each, the
    item that starts making it: the sender's first gradient pass of the
    stage after the one whose gradient it sent back before (-1: none found)."""
    tr = t.transfers
    rows = np.flatnonzero(tr.of_kind("weight_gradient"))
    makers = np.full(len(rows), -1)
    passes = _gradient_passes(t)
    for group in _groups(tr.src[rows], tr.stage[rows]):
        group = group[np.argsort(tr.start[rows[group]], kind="stable")]
        mine = passes[(t.worker[passes] == tr.src[rows[group[0]]]) & (t.stage[passes] == tr.stage[rows[group[0]]])]
        mine = mine[np.argsort(t.start[mine], kind="stable")]
        position = {b: i for i, b in enumerate(t.batch[mine].tolist())}
        first, made = 0, {}
        for g in group.tolist():
            batch = int(tr.batch[rows[g]])
            if batch in made:  # another shard of a gradient already sent
                makers[g] = made[batch]
                continue
            if first < len(mine):
                makers[g] = made[batch] = mine[first]
            first = position.get(batch, first - 1) + 1
    return rows, makers


def _returned_holds(t: Timeline, in_bytes: bool):
    """The buffer a returned gradient arrives in, on the weight worker, from
    when that worker posts its receive until it takes it in: between two of
    its items, so from the start of the item it runs when the gradient is
    sent to the end of the item it runs when it arrives (:func:`_between_items`)."""
    tr = t.transfers
    rows = np.flatnonzero(tr.of_kind("weight_gradient"))
    amounts = tr.nbytes[rows] if in_bytes else np.ones(len(rows))
    posted = _between_items(t, tr.dst[rows], tr.start[rows], before=True)
    return tr.dst[rows], posted, _between_items(t, tr.dst[rows], tr.end[rows], before=False), amounts


def _between_items(t: Timeline, workers: np.ndarray, times: np.ndarray, before: bool) -> np.ndarray:
    """Where each worker, which acts between its items, does what falls at
    each time: the start (``before``) or the end of the item it runs then
    (one that starts at that time included: the worker has begun it), or
    that time if it runs none."""
    out = np.asarray(times, dtype=float).copy()
    by_worker = np.lexsort((t.start, t.worker))
    bounds = np.searchsorted(t.worker[by_worker], np.arange(t.num_workers + 1))
    for w in np.unique(workers).tolist():
        mine = by_worker[bounds[w]:bounds[w + 1]]
        if not len(mine):
            continue
        asked = np.flatnonzero(workers == w)
        at = np.maximum(np.searchsorted(t.start[mine], out[asked], side="right") - 1, 0)  # the last item started
        running = (t.start[mine][at] <= out[asked]) & (t.end[mine][at] > out[asked])
        out[asked] = np.where(running, (t.start if before else t.end)[mine][at], out[asked])
    return out


def _groups(first: np.ndarray, second: np.ndarray):
    """Index arrays of the rows sharing each (first, second) value."""
    if not len(first):
        return []
    keys = first * (int(second.max()) + 1) + second
    order = np.argsort(keys, kind="stable")
    cuts = np.flatnonzero(np.diff(keys[order])) + 1
    return np.split(order, cuts)


_HOLDS = {
    "activations": _activation_holds,
    "weights": _weight_holds,
    "fetched": _fetched_holds,
    "gradients": _gradient_holds,
    "weight_gradients": _weight_gradient_holds,
    "workspace": _workspace_holds,
    "optimizer": _optimizer_holds,
}
Timeline.register_view("memory", memory_curves)
