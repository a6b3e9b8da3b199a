"""Wire format: nested values as a JSON structure spec plus one flat byte buffer of tensor data.

A nested value (dicts, lists, tuples, tensors, int / float / str / bool / None) is split into a spec that
describes the structure, dtypes and shapes, and the list of its tensor leaves. The spec travels as UTF-8
JSON in a uint8 tensor, versioned and validated before anything is allocated: peer data is never
unpickled. The leaves travel as one uint8 buffer with each leaf at an aligned offset, so a route costs
one data collective whatever the number of leaves and dtypes.

Before the spec travels a one-word header: the spec's length in bytes, or SAME_SPEC when the spec is
byte-for-byte the one sent last time on the same route. Both ends of a route remember that spec (the
receiver keeps it decoded and validated), so a route whose structure, shapes and dtypes repeat costs
one tiny broadcast plus the data broadcast per call.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import numpy
import torch

WIRE_VERSION = 1
# Every leaf starts at a multiple of this many bytes, so the receiver can view it in its dtype in place.
_ALIGNMENT = 16
# A spec describing more than this is rejected as corrupt rather than allocated.
MAX_PAYLOAD_BYTES = 1 << 42
MAX_SPEC_BYTES = 1 << 24
# Header word meaning "the spec sent last time on this route, again" (a real spec is never empty).
SAME_SPEC = 0

_DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
        torch.complex64, torch.complex128, torch.uint16, torch.uint32, torch.uint64,
        torch.float8_e4m3fn, torch.float8_e5m2,
    )
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_SCALARS = (int, float, str, bool, type(None))


class WireFormatError(ValueError):
    """A structure spec that is malformed, of an unknown version, or describes an impossible payload."""


class SenderError(RuntimeError):
    """The sender had nothing valid to send and sent the reason instead (see `encode_error`)."""


def tree_spec(value: Any, tensors: list[torch.Tensor]) -> Any:
    """Describe a nested value while extracting tensor leaves without copies.

    Args:
        value: nested dicts, lists, tuples, scalars (int, float, str, bool, None) and tensors of any shape.
        tensors: output list; each tensor leaf is appended (the leaf itself, not a copy) in traversal order.

    Returns:
        JSON-compatible metadata: {"tensor": index, "dtype": name, "shape": [...]} for a tensor,
        {"dict": [[key, spec], ...]}, {"list": [...]}, {"tuple": [...]}, {"value": scalar}.
    """
    if isinstance(value, torch.Tensor):
        if value.dtype not in _DTYPE_NAMES:
            raise TypeError(f"cannot send a tensor of dtype {value.dtype}")
        tensors.append(value)
        return {"tensor": len(tensors) - 1, "dtype": _DTYPE_NAMES[value.dtype], "shape": list(value.shape)}
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, _SCALARS):
                raise TypeError(f"cannot send a dict key of type {type(key).__name__}: {key!r}")
        return {"dict": [[key, tree_spec(item, tensors)] for key, item in value.items()]}
    if isinstance(value, (list, tuple)):
        kind = "tuple" if isinstance(value, tuple) else "list"
        return {kind: [tree_spec(item, tensors) for item in value]}
    if isinstance(value, _SCALARS):
        return {"value": value}
    raise TypeError(f"cannot send a value of type {type(value).__name__}")


def tree_from_spec(spec: Any, tensors: list[torch.Tensor]) -> Any:
    """Rebuild a nested value from tensor leaves described by `tree_spec`.

    The leaves must have the recorded shapes and dtypes; the result aliases them (no copies).
    """
    if "tensor" in spec:
        tensor = tensors[spec["tensor"]]
        if _DTYPE_NAMES.get(tensor.dtype) != spec["dtype"] or list(tensor.shape) != spec["shape"]:
            raise ValueError(
                f"leaf {spec['tensor']} is {tensor.dtype} {list(tensor.shape)}, "
                f"spec says {spec['dtype']} {spec['shape']}"
            )
        return tensor
    if "dict" in spec:
        return {key: tree_from_spec(item, tensors) for key, item in spec["dict"]}
    if "list" in spec:
        return [tree_from_spec(item, tensors) for item in spec["list"]]
    if "tuple" in spec:
        return tuple(tree_from_spec(item, tensors) for item in spec["tuple"])
    return spec["value"]


def _children(node: Any) -> list[Any]:
    if "dict" in node:
        return [item for _, item in node["dict"]]
    return node.get("list") or node.get("tuple") or []


def leaf_specs(spec: Any) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """The (dtype, shape) of every tensor leaf of a spec, in leaf (traversal) order."""
    if "tensor" in spec:
        return [(_DTYPES[spec["dtype"]], tuple(spec["shape"]))]
    return [leaf for child in _children(spec) for leaf in leaf_specs(child)]


def spec_bytes(spec: Any) -> bytes:
    """The spec as a versioned UTF-8 JSON document (what `encode_spec` puts in a tensor)."""
    return json.dumps({"version": WIRE_VERSION, "tree": spec}, separators=(",", ":")).encode()


def bytes_tensor(data: bytes) -> torch.Tensor:
    """`data` as a 1-D uint8 tensor (a copy: the tensor owns its memory)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def encode_spec(spec: Any) -> torch.Tensor:
    """The spec as a versioned UTF-8 JSON document in a 1-D uint8 tensor."""
    return bytes_tensor(spec_bytes(spec))


def encode_error(message: str) -> torch.Tensor:
    """A spec document that carries a sender's error instead of a value: receivers raise SenderError."""
    data = json.dumps({"version": WIRE_VERSION, "error": message}).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def checked_spec_length(length: int) -> int:
    """`length` if it is a plausible spec size, else WireFormatError (checked before allocating).

    SAME_SPEC (0) is not a length: the caller handles it before asking.
    """
    if not 0 < length <= MAX_SPEC_BYTES:
        raise WireFormatError(f"structure spec length {length} is outside 1..{MAX_SPEC_BYTES}")
    return length


def decode_spec(data: torch.Tensor) -> Any:
    """Parse and validate a spec made by `encode_spec`.

    Raises:
        WireFormatError: for anything malformed, before any tensor is allocated.
        SenderError: with the sender's message if it sent `encode_error`.
    """
    try:
        document = json.loads(data.cpu().numpy().tobytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise WireFormatError(f"structure spec is not valid JSON: {error}") from None
    except RecursionError:  # json's parser recurses once per level: a spec nested deeper than Python's limit
        raise WireFormatError("structure spec is nested more than 64 levels deep") from None
    if isinstance(document, dict) and set(document) == {"version", "error"}:
        raise SenderError(str(document["error"]))
    if not isinstance(document, dict) or document.get("version") != WIRE_VERSION:
        version = document.get("version") if isinstance(document, dict) else None
        raise WireFormatError(f"unknown wire format version {version!r} (this side speaks {WIRE_VERSION})")
    if set(document) != {"version", "tree"}:
        raise WireFormatError(f"unexpected fields in structure spec: {sorted(document)}")
    tree = document["tree"]
    indices: list[int] = []
    _validate_node(tree, indices, depth=0)
    if indices != list(range(len(indices))):
        raise WireFormatError(f"tensor leaf indices {indices[:16]} are not 0..{len(indices) - 1} in order")
    total = sum(nbytes(dtype, shape) for dtype, shape in leaf_specs(tree))
    if total > MAX_PAYLOAD_BYTES:
        raise WireFormatError(f"structure spec describes {total} bytes, more than the limit {MAX_PAYLOAD_BYTES}")
    return tree


def _validate_node(node: Any, indices: list[int], *, depth: int) -> None:
    if depth > 64:
        raise WireFormatError("structure spec is nested more than 64 levels deep")
    is_tensor = isinstance(node, dict) and set(node) == {"tensor", "dtype", "shape"}
    if not isinstance(node, dict) or not (is_tensor or len(node) == 1):
        raise WireFormatError(f"malformed spec node {str(node)[:80]}")
    if "tensor" in node:
        index, dtype, shape = node.get("tensor"), node.get("dtype"), node.get("shape")
        if type(index) is not int:
            raise WireFormatError(f"tensor index must be an integer, got {index!r}")
        if dtype not in _DTYPES:
            raise WireFormatError(f"unknown dtype {dtype!r} in structure spec")
        if not isinstance(shape, list) or any(type(dim) is not int or dim < 0 for dim in shape) or len(shape) > 32:
            raise WireFormatError(f"invalid shape {str(shape)[:80]} in structure spec")
        if math.prod(shape) > MAX_PAYLOAD_BYTES:
            raise WireFormatError(f"shape {shape} is larger than the limit {MAX_PAYLOAD_BYTES} elements")
        indices.append(index)
        return
    ((kind, content),) = node.items()
    if kind == "value":
        if not isinstance(content, _SCALARS):
            raise WireFormatError(f"invalid scalar leaf {str(content)[:80]}")
    elif kind in ("list", "tuple"):
        if not isinstance(content, list):
            raise WireFormatError(f"{kind} node must hold a list")
        for child in content:
            _validate_node(child, indices, depth=depth + 1)
    elif kind == "dict":
        if not isinstance(content, list) or any(not isinstance(item, list) or len(item) != 2 for item in content):
            raise WireFormatError("dict node must hold [key, value] pairs")
        for key, child in content:
            if not isinstance(key, _SCALARS):
                raise WireFormatError(f"invalid dict key {str(key)[:80]}")
            _validate_node(child, indices, depth=depth + 1)
    else:
        raise WireFormatError(f"unknown spec node kind {kind!r}")


def nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of this dtype and shape."""
    return math.prod(shape) * dtype.itemsize


def payload_nbytes(value: Any) -> int:
    """Bytes the data collective of a nested value carries (its tensor leaves, aligned as on the wire)."""
    tensors: list[torch.Tensor] = []
    tree_spec(value, tensors)
    return receive_nbytes(leaves_of(tensors))


def buffer_layout(leaves: list[tuple[torch.dtype, tuple[int, ...]]]) -> tuple[list[int], int]:
    """Aligned byte offset of each leaf in the flat buffer, and the buffer's total size."""
    offsets, end = [], 0
    for dtype, shape in leaves:
        offsets.append(end)
        end += -(-nbytes(dtype, shape) // _ALIGNMENT) * _ALIGNMENT
    return offsets, end


def leaves_of(tensors: list[torch.Tensor]) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """The (dtype, shape) of each tensor."""
    return [(tensor.dtype, tuple(tensor.shape)) for tensor in tensors]


def packs_in_place(tensors: list[torch.Tensor], device: torch.device) -> bool:
    """Whether `pack_leaves` sends these leaves from their own memory (one contiguous leaf on `device`)."""
    return len(tensors) == 1 and tensors[0].is_contiguous() and tensors[0].device == device


def pack_leaves(tensors: list[torch.Tensor], device: torch.device, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy the leaves into one uint8 buffer on `device`; a single contiguous leaf is used in place.

    `out`: a uint8 buffer of exactly the packed size to copy into instead of allocating one.
    """
    if packs_in_place(tensors, device):
        return _as_bytes(tensors[0])
    offsets, total = buffer_layout(leaves_of(tensors))
    if out is None:
        buffer = torch.empty(total, dtype=torch.uint8, device=device)
    elif out.dtype != torch.uint8 or out.shape != (total,) or out.device != device:
        raise ValueError(f"out must be a uint8 buffer of {total} bytes on {device}, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    else:
        buffer = out
    for tensor, offset in zip(tensors, offsets):
        flat = _as_bytes(tensor)
        buffer[offset : offset + flat.numel()].copy_(flat)
    return buffer


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The leaf's bytes as a 1-D uint8 tensor (a view where possible)."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() <= 1 and flat.stride(-1) != 1:
        # torch calls a tensor of 0 or 1 elements contiguous whatever its stride, but a dtype view needs 1.
        flat = flat.as_strided(flat.shape, (1,))
    return flat.contiguous().view(torch.uint8)


def unpack_leaves(buffer: torch.Tensor, leaves: list[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
    """Views of `buffer` (made by `pack_leaves` for the same leaves) in each leaf's dtype and shape."""
    if len(leaves) == 1:
        dtype, shape = leaves[0]
        return [buffer[: nbytes(dtype, shape)].view(dtype).reshape(shape)]
    offsets, _ = buffer_layout(leaves)
    return [
        buffer[offset : offset + nbytes(dtype, shape)].view(dtype).reshape(shape)
        for (dtype, shape), offset in zip(leaves, offsets)
    ]


def receive_nbytes(leaves: list[tuple[torch.dtype, tuple[int, ...]]]) -> int:
    """Size of the buffer `pack_leaves` produces for these leaves."""
    if len(leaves) == 1:
        return nbytes(*leaves[0])
    return buffer_layout(leaves)[1]


def receive_buffer(leaves: list[tuple[torch.dtype, tuple[int, ...]]], device: torch.device) -> torch.Tensor:
    """An empty uint8 buffer the size `pack_leaves` produces for these leaves."""
    return torch.empty(receive_nbytes(leaves), dtype=torch.uint8, device=device)


def to_bytes(value: Any) -> bytes:
    """A nested value as one self-describing byte string (a file or an HTTP body): the spec's length as an
    8-byte little-endian word, the spec (`spec_bytes`), then the packed tensor bytes (`pack_leaves`), each
    leaf little-endian (the byte order of every host torch runs on; a big-endian host is refused)."""
    if sys.byteorder != "little":
        raise RuntimeError("meshkd's byte strings are little-endian: this host is big-endian")
    tensors: list[torch.Tensor] = []
    spec = spec_bytes(tree_spec(value, tensors))
    data = pack_leaves([tensor.detach().cpu() for tensor in tensors], torch.device("cpu")) if tensors else None
    return b"".join([len(spec).to_bytes(8, "little"), spec, data.numpy().tobytes() if data is not None else b""])


def host_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """An empty uint8 host buffer of `nbytes` to copy to `device` from: pinned for a CUDA device, so that the copy
    runs without the host waiting (pinning needs CUDA: pageable elsewhere)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")


def _moved(buffer: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A `host_buffer` on `device`: one copy, the host not waiting for it on a GPU (torch's pinned-memory allocator
    keeps the buffer until its copy has run; later work on the same stream runs after it)."""
    return buffer.to(device, non_blocking=device.type == "cuda")


def to_device(value: Any, device: torch.device) -> Any:
    """A nested value with its tensor leaves on `device` in one copy: packed into one `host_buffer`, moved, and cut
    into its leaves there (views of the moved buffer). A value whose leaves are all on `device` is returned as
    it is."""
    tensors: list[torch.Tensor] = []
    spec = tree_spec(value, tensors)
    if all(tensor.device == device for tensor in tensors):
        return value
    leaves = leaves_of(tensors)
    offsets, total = buffer_layout(leaves)
    buffer = host_buffer(total, device)
    for tensor, offset in zip(tensors, offsets):
        flat = _as_bytes(tensor.cpu())
        buffer[offset : offset + flat.numel()].copy_(flat)
    return tree_from_spec(spec, unpack_leaves(_moved(buffer, device), leaves))


def from_bytes(data: bytes, *, device: torch.device | None = None) -> Any:
    """The value `to_bytes` made; WireFormatError naming what is wrong with any other byte string, checked
    before a tensor is allocated. The tensors own their memory, on `device` (None: the host): the tensor bytes
    are read into one `host_buffer` and moved in one copy, then cut into the leaves there."""
    if len(data) < 8:
        raise WireFormatError(f"{len(data)} bytes are too few for a spec length")
    length = checked_spec_length(int.from_bytes(data[:8], "little"))
    if len(data) < 8 + length:
        raise WireFormatError(f"spec length {length} exceeds the {len(data) - 8} bytes that follow it")
    tree = decode_spec(bytes_tensor(data[8 : 8 + length]))
    leaves = leaf_specs(tree)
    expected = receive_nbytes(leaves) if leaves else 0
    if len(data) - 8 - length != expected:
        raise WireFormatError(f"the spec describes {expected} bytes of tensors, {len(data) - 8 - length} follow it")
    device = device or torch.device("cpu")
    tensors = []
    if leaves:
        buffer = host_buffer(expected, device)
        if expected:
            buffer.numpy()[:] = numpy.frombuffer(data, dtype=numpy.uint8, offset=8 + length)
        tensors = unpack_leaves(_moved(buffer, device), leaves)
    return tree_from_spec(tree, tensors)
