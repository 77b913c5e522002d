"""Dense arrays on the wire: raw little-endian bytes + dtype + shape (card.v1.Tensor)."""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Sequence

import torch

from card.engine.shared.errors import InvalidArgument
from card.v1 import common_pb2

DTYPES: dict[str, torch.dtype] = {
    "int64": torch.int64,
    "int32": torch.int32,
    "float64": torch.float64,
    "bool": torch.bool,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_NAMES = {v: k for k, v in DTYPES.items()}

if sys.byteorder != "little":  # every supported host (x86-64, arm64) is little-endian
    raise ImportError("card.common.tensors assumes a little-endian host")


def _dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise InvalidArgument(
            f"unsupported tensor dtype {name!r}; expected one of {', '.join(DTYPES)}"
        ) from None


def to_tensor_msg(x: torch.Tensor | Sequence[int] | Sequence[float], dtype: str) -> common_pb2.Tensor:
    """Encode a tensor or a flat sequence as ``dtype`` (converted if it differs)."""
    td = _dtype(dtype)
    t = x.detach() if isinstance(x, torch.Tensor) else torch.tensor(list(x), dtype=td)
    t = t.to("cpu", td).contiguous()
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return common_pb2.Tensor(dtype=dtype, shape=list(t.shape), data=data)


def from_tensor_msg(msg: common_pb2.Tensor) -> torch.Tensor:
    """Decode to a CPU tensor; InvalidArgument when the byte count does not match the shape."""
    td = _dtype(msg.dtype)
    shape = list(msg.shape)
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"tensor shape {shape} has a negative dimension")
    count = math.prod(shape)
    itemsize = torch.empty(0, dtype=td).element_size()
    if len(msg.data) != count * itemsize:
        raise InvalidArgument(
            f"tensor of dtype {msg.dtype} and shape {shape} needs {count * itemsize} bytes, "
            f"got {len(msg.data)}"
        )
    if count == 0:
        return torch.empty(shape, dtype=td)
    return torch.frombuffer(bytearray(msg.data), dtype=torch.uint8).view(td).reshape(shape)


def ids_to_msg(ids: Sequence[int]) -> common_pb2.Tensor:
    """Token or node ids as an int64 [n] tensor (no torch round trip: this is the hot path)."""
    return common_pb2.Tensor(dtype="int64", shape=[len(ids)], data=array("q", ids).tobytes())


def ids_from_msg(msg: common_pb2.Tensor) -> list[int]:
    """Ids from a 1-D integer tensor; an unset message is the empty list."""
    return ids_array_from_msg(msg).tolist()


def ids_array_from_msg(msg: common_pb2.Tensor) -> array[int]:
    """``ids_from_msg`` as an array, not yet listed (a bound may read its length first)."""
    if not msg.dtype and not msg.shape and not msg.data:
        return array("q")
    if msg.dtype not in ("int64", "int32"):
        raise InvalidArgument(f"ids must be an int64 or int32 tensor, got dtype {msg.dtype!r}")
    if len(msg.shape) != 1:
        raise InvalidArgument(f"ids must be a 1-D tensor, got shape {list(msg.shape)}")
    code, size = ("q", 8) if msg.dtype == "int64" else ("i", 4)
    if len(msg.data) != msg.shape[0] * size:
        raise InvalidArgument(
            f"ids tensor of shape {list(msg.shape)} needs {msg.shape[0] * size} bytes, got {len(msg.data)}"
        )
    values = array(code)
    values.frombytes(msg.data)
    return values
