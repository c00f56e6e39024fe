"""What each forward claims and each backward pass releases, on which worker,
against which limit: the memory model of the simulator as flat arrays.

A forward's stash is kept by the workers that run its backward passes
(each keeps the share its pass frees, :func:`unisched.dataflow.stash_shares`);
the forward claims those shares when it starts, each backward pass releases
its share when it ends.  :func:`stash_accounts` computes that for every item
at once (numpy, no loop over items) and checks the limits;
:meth:`StashAccounts.as_lists` gives the per-item tuples the Python engine
reads (``Problem.limit``, ``claims``, ``releases_of``), and the arrays are
what the compiled greedy reads (:mod:`unisched.simulate.fast`).
"""

from __future__ import annotations

import reprlib
from typing import NamedTuple

import numpy as np

from unisched import dataflow
from unisched.errors import ShapeError

_EPS = 1e-9


class StashAccounts(NamedTuple):
    """Claims and releases, CSR by item, and the per-worker limits.

    A forward parked on a storage worker waits in the queue of the pair
    (storage, its compute worker): ``claim_pair`` names that queue per
    claim, the pairs of storage w are ``pair_ptr[w]:pair_ptr[w + 1]`` and
    ``pair_base`` is where each pair's queue starts in one shared array."""

    limit: np.ndarray
    claim_ptr: np.ndarray
    claim_worker: np.ndarray
    claim_amount: np.ndarray
    claim_pair: np.ndarray
    pair_ptr: np.ndarray
    pair_base: np.ndarray
    release_ptr: np.ndarray
    release_worker: np.ndarray
    release_amount: np.ndarray
    release_owner: np.ndarray
    release_base: np.ndarray

    def as_lists(self) -> tuple[list, list, list]:
        """(limit, claims, releases_of) as the Python engine reads them: per
        item a tuple of (worker, amount) claims, or of (worker, amount, owner)
        releases, or None."""
        claims = _per_item(self.claim_ptr, self.claim_worker.tolist(), self.claim_amount.tolist())
        releases = _per_item(self.release_ptr, self.release_worker.tolist(), self.release_amount.tolist(),
                             self.release_owner.tolist())
        return self.limit.tolist(), claims, releases


def stash_accounts(num_workers: int, memory_limit, items: dataflow.Items, compute: np.ndarray, stage: np.ndarray,
                   sizes: np.ndarray | None, input_grad_frees: float) -> StashAccounts | None:
    """Every item's claims and releases under ``memory_limit`` (None: no
    limit, no accounts).  ``sizes``: a stash's bytes per stage, or None to
    count stashes."""
    if memory_limit is None:
        return None
    W = num_workers
    limit = _limits(memory_limit, W)
    n, D = len(compute), len(items.dirs)
    amount = np.ones(int(stage.max(initial=0)) + 1) if sizes is None else np.asarray(sizes, dtype=float)
    forward = np.arange(0, n, D)  # the D passes of one (batch, stage) have consecutive ids (dataflow.Items)
    shares = dataflow.stash_shares(items.split_backward, input_grad_frees)

    # the releases: every backward pass frees its share on the worker that runs it
    holders = [compute[forward + k] for k in range(1, D)]
    amounts = [amount[stage[forward]] * shares[d] for d in items.dirs[1:]]
    release_ptr = np.arange(n + 1) * (D - 1) // D  # ids below i that are backward passes: i - ceil(i / D)
    release_worker = np.stack(holders, axis=1).reshape(-1)
    release_amount = np.stack(amounts, axis=1).reshape(-1)
    release_owner = np.repeat(forward, D - 1)

    # the claims: per forward, the shares summed per holder, holders in pass order
    claim_worker, claim_amount, claim_count = _claims(holders, amounts)
    claim_ptr = np.zeros(n + 1, np.int64)
    per_item = np.zeros(n, np.int64)
    per_item[forward] = claim_count
    np.cumsum(per_item, out=claim_ptr[1:])
    _check_one_stash_fits(claim_worker, claim_amount, claim_ptr, limit, stage, sizes is not None)

    claimant = np.repeat(compute, per_item)
    pairs, claim_pair, per_pair = unique_codes(claim_worker * W + claimant, W * W, return_inverse=True,
                                               return_counts=True)
    pair_ptr = np.zeros(W + 1, np.int64)
    np.cumsum(np.bincount(pairs // W, minlength=W), out=pair_ptr[1:])
    return StashAccounts(
        limit=limit,
        claim_ptr=claim_ptr,
        claim_worker=claim_worker,
        claim_amount=claim_amount,
        claim_pair=claim_pair.reshape(-1).astype(np.int64),
        pair_ptr=pair_ptr,
        pair_base=region_starts(per_pair),
        release_ptr=release_ptr,
        release_worker=release_worker,
        release_amount=release_amount,
        release_owner=release_owner,
        release_base=region_starts(np.bincount(release_worker, minlength=W)),
    )


def _limits(memory_limit, num_workers: int) -> np.ndarray:
    refused = ShapeError(f"memory_limit must be a number or one number per worker, got {reprlib.repr(memory_limit)}")
    if any(isinstance(v, (str, bytes, bool, np.bool_)) for v in np.ravel(np.asarray(memory_limit, dtype=object))):
        raise refused  # numpy would read "4", b"1" and True as numbers
    try:
        limits = np.asarray(memory_limit, dtype=float)
    except (TypeError, ValueError, OverflowError):
        raise refused from None
    if limits.ndim == 0:
        limits = np.full(num_workers, float(limits))
    else:
        if limits.shape != (num_workers,):
            given = f"{limits.size} entries" if limits.ndim == 1 else f"shape {limits.shape}"
            raise ShapeError(f"memory_limit has {given} but there are {num_workers} workers; give one number, "
                             "or a flat list of one per worker")
    if np.any(limits < 0) or np.any(np.isnan(limits)):
        raise ShapeError(f"memory_limit must be >= 0, got {reprlib.repr(memory_limit)}")
    return limits


def _claims(holders: list[np.ndarray], amounts: list[np.ndarray]):
    """Per forward, (holder, amount) of its claims in pass order, one per
    distinct holder (a holder of several passes claims their sum): flat
    columns and the count per forward."""
    if len(holders) == 1:
        return holders[0], amounts[0], np.ones(len(holders[0]), np.int64)
    (first, second), (a1, a2) = holders, amounts
    together = first == second
    count = np.where(together, 1, 2)
    worker = np.stack([first, second], axis=1)
    amount = np.stack([np.where(together, a1 + a2, a1), a2], axis=1)
    keep = np.stack([np.ones(len(first), bool), ~together], axis=1)
    return worker[keep], amount[keep], count


def _check_one_stash_fits(worker, amount, claim_ptr, limit, stage, in_bytes: bool) -> None:
    """A worker whose limit cannot hold one forward's stash could never run it."""
    too_big = np.flatnonzero(amount > limit[worker] + _EPS)
    if not len(too_big):
        return
    c = int(too_big[0])
    holder, need = int(worker[c]), float(amount[c])
    s = int(stage[np.searchsorted(claim_ptr, c, side="right") - 1])
    raise ShapeError(
        f"memory_limit {limit[holder]:g} of worker {holder} cannot hold even one stash of stage {s} "
        f"({need:g} {'bytes' if in_bytes else 'activation units'}); raise it to at least {need:g}"
    )


def region_starts(sizes: np.ndarray) -> np.ndarray:
    """Where each region starts when regions of ``sizes`` lie one after another."""
    base = np.zeros(len(sizes), np.int64)
    np.cumsum(sizes[:-1], out=base[1:])
    return base


def unique_codes(codes: np.ndarray, span: int, return_index: bool = False, return_inverse: bool = False,
                 return_counts: bool = False) -> tuple[np.ndarray, ...]:
    """``np.unique(codes, return_index=..., return_inverse=...,
    return_counts=...)`` of integer codes in ``0..span-1``, by counting
    instead of sorting where ``span`` is not much larger than ``codes``."""
    codes = np.asarray(codes, dtype=np.int64)
    n = len(codes)
    if span > max(4 * n, 1 << 16):
        found = np.unique(codes, return_index=return_index, return_inverse=return_inverse,
                          return_counts=return_counts)
        found = found if isinstance(found, tuple) else (found,)
        return tuple(a.reshape(-1) for a in found)
    counts = np.bincount(codes, minlength=span)
    values = np.flatnonzero(counts)
    found = [values]
    if return_index:
        first = np.empty(span, np.int64)
        first[codes[::-1]] = np.arange(n - 1, -1, -1)  # the earliest occurrence is written last
        found.append(first[values])
    if return_inverse:
        found.append((np.cumsum(counts > 0) - 1)[codes])
    if return_counts:
        found.append(counts[values])
    return tuple(found)


def _per_item(ptr: np.ndarray, *columns: list) -> list:
    rows = list(zip(*columns))
    bounds = ptr.tolist()
    return [tuple(rows[a:b]) if b > a else None for a, b in zip(bounds[:-1], bounds[1:])]
