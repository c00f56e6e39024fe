"""What the ranks tell each other outside the training tensors (set-up
verdicts, clocks, the shape probe's layouts, calibrated costs) travels as
UTF-8 JSON in uint8 tensors, so no rank ever unpickles bytes from a peer.

A gather sends every rank's length first, then the bytes padded to the
longest; a broadcast sends the length, then the bytes.  Torch dtypes travel
by name and pytree structures as torch's own JSON TreeSpec encoding.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from unisched.errors import ShapeError


def _encode(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj).encode("utf-8")), dtype=torch.uint8)


def _decode(data: torch.Tensor) -> Any:
    return json.loads(bytes(data.tolist()).decode("utf-8"))


def all_gather_json(obj: Any, group, world_size: int) -> list[Any]:
    """Every rank's ``obj`` (a JSON value), in rank order, on every rank."""
    mine = _encode(obj)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(lengths, torch.tensor([mine.numel()], dtype=torch.int64), group=group)
    longest = max(int(n) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:mine.numel()] = mine
    everyone = [torch.empty(longest, dtype=torch.uint8) for _ in range(world_size)]
    dist.all_gather(everyone, padded, group=group)
    return [_decode(data[:int(n)]) for data, n in zip(everyone, lengths)]


def broadcast_json(obj: Any, src: int, group) -> Any:
    """``obj`` (a JSON value) of rank ``src``, on every rank (others pass anything)."""
    mine = _encode(obj) if dist.get_rank() == src else torch.empty(0, dtype=torch.uint8)
    length = torch.tensor([mine.numel()], dtype=torch.int64)
    dist.broadcast(length, src=src, group=group)
    data = mine if dist.get_rank() == src else torch.empty(int(length), dtype=torch.uint8)
    dist.broadcast(data, src=src, group=group)
    return _decode(data)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    """The dtype :func:`dtype_name` named; anything else is refused."""
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ShapeError(f"a peer named an unknown dtype {name!r}; run the same torch version on every rank")
    return dtype


def spec_dumps(spec: pytree.TreeSpec) -> str:
    """A pytree structure as torch's JSON; a named tuple class is registered
    for it under its module and name first."""
    _register_named_tuples(spec)
    return pytree.treespec_dumps(spec)


def spec_loads(text: str) -> pytree.TreeSpec:
    """The structure :func:`spec_dumps` wrote; a named tuple class is looked
    up among the modules this rank has already imported (nothing is imported)."""
    for name in _named_tuple_names(json.loads(text)):
        if name not in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE:
            module, _, qualname = name.rpartition(":")
            cls = sys.modules.get(module)
            for part in qualname.split("."):
                cls = getattr(cls, part, None)
            if not (isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields")):
                raise ShapeError(f"a stage returns a named tuple {name} that this rank has not imported; "
                                 f"import its module on every rank")
            pytree._register_namedtuple(cls, serialized_type_name=name)
    return pytree.treespec_loads(text)


def _register_named_tuples(spec: pytree.TreeSpec) -> None:
    if spec.type is pytree.namedtuple and spec.context not in pytree.SUPPORTED_SERIALIZED_TYPES:
        cls = spec.context
        pytree._register_namedtuple(cls, serialized_type_name=f"{cls.__module__}:{cls.__qualname__}")
    for child in spec.children():
        _register_named_tuples(child)


def _named_tuple_names(node: Any) -> list[str]:
    """The serialized names of named tuple classes in a TreeSpec's JSON."""
    found = []
    if isinstance(node, dict):
        if node.get("type") == "collections.namedtuple":
            found.append(str(node["context"]))
        for value in node.values():
            found += _named_tuple_names(value)
    elif isinstance(node, list):
        for value in node:
            found += _named_tuple_names(value)
    return found


def built_json(built: dict) -> dict:
    """What a rank built, per stage (parameter shapes, state dict specs,
    weight bytes, buffer specs), as JSON for the set-up agreement."""
    return {str(s): [[list(shape) for shape in shapes],
                     {name: [list(shape), dtype_name(dtype)] for name, (shape, dtype) in specs.items()},
                     nbytes, [[list(shape), dtype_name(dtype)] for shape, dtype in buffers]]
            for s, (shapes, specs, nbytes, buffers) in built.items()}


def built_from_json(data: dict) -> dict:
    """The stages :func:`built_json` wrote, keyed by stage index again."""
    return {int(s): ([tuple(shape) for shape in shapes],
                     {name: (torch.Size(shape), dtype_of(dtype)) for name, (shape, dtype) in specs.items()},
                     float(nbytes), [(tuple(shape), dtype_of(dtype)) for shape, dtype in buffers])
            for s, (shapes, specs, nbytes, buffers) in data.items()}
