"""Conversions between user tensors (torch or NumPy) and raw bytes.

torch is imported lazily: the daemon handles bytes only and starts without it.
Non-contiguous inputs are copied to a contiguous tensor first (documented behaviour);
CUDA tensors are copied to host memory.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import InvalidArgument
from .units import PAGE

__all__ = ["TensorSpec", "to_bytes", "from_bytes", "aligned_empty", "out_bytes", "is_tensor"]


@dataclass(slots=True, frozen=True)
class TensorSpec:
    kind: str  # "torch" | "numpy"
    dtype: str  # torch dtype name without "torch." / numpy dtype name
    shape: tuple[int, ...]
    nbytes: int


_DTYPE_NAMES: dict[np.dtype, str] = {}
_TORCH_DTYPE_NAMES: dict[Any, str] = {}


def _torch():
    import torch

    return torch


def is_tensor(obj: Any) -> bool:
    if isinstance(obj, np.ndarray):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def cuda_source(obj: Any) -> tuple[Any, TensorSpec] | None:
    """For a CUDA tensor: (a contiguous tensor whose ``data_ptr()`` holds the bytes, its
    spec), with the producing stream synchronised; None for anything else."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(obj, torch.Tensor) or obj.device.type != "cuda":
        return None
    t = obj.detach().resolve_conj().resolve_neg().contiguous()
    torch.cuda.current_stream(t.device).synchronize()
    return t, TensorSpec("torch", str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numel() * t.element_size())


def to_bytes(obj: Any) -> tuple[np.ndarray, TensorSpec]:
    """A uint8 view (copy only when needed) of ``obj``'s bytes, and its spec."""
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject or obj.dtype.fields is not None:
            raise InvalidArgument(f"cannot store a NumPy array of dtype {obj.dtype}: only plain numeric/bool dtypes")
        arr = obj
        if not arr.dtype.isnative:
            arr = arr.astype(arr.dtype.newbyteorder("="))
        if not arr.flags.c_contiguous:
            arr = arr.copy(order="C")  # (np.ascontiguousarray would make a 0-d array 1-d)
        name = _DTYPE_NAMES.get(arr.dtype)
        if name is None:
            name = _DTYPE_NAMES[arr.dtype] = arr.dtype.name  # dtype.name is computed in Python each time
        spec = TensorSpec("numpy", name, tuple(int(s) for s in arr.shape), int(arr.nbytes))
        return arr.reshape(-1).view(np.uint8), spec
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(obj, torch.Tensor):
        raise InvalidArgument(f"expected a torch.Tensor or numpy.ndarray, got {type(obj).__name__}")
    t = obj.detach()
    if t.device.type == "meta":
        raise InvalidArgument(f"cannot store a meta tensor (shape {tuple(t.shape)}, {t.dtype}): it has no data; "
                              "materialize it first, e.g. torch.empty_like(t, device='cpu') or module.to_empty()")
    if t.layout != torch.strided:
        raise InvalidArgument(f"cannot store a tensor with layout {t.layout}; call .to_dense() first")
    if t.is_quantized:
        raise InvalidArgument("cannot store a quantized tensor; dequantize it first")
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    name = _TORCH_DTYPE_NAMES.get(t.dtype)
    if name is None:
        name = _TORCH_DTYPE_NAMES[t.dtype] = str(t.dtype).removeprefix("torch.")
    spec = TensorSpec("torch", name, tuple(t.shape), t.numel() * t.element_size())
    if spec.nbytes == 0:
        return np.empty(0, np.uint8), spec
    return t.reshape(-1).view(torch.uint8).numpy(), spec


def aligned_empty(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 buffer (so NVMe reads can land in it with O_DIRECT)."""
    raw = np.empty(nbytes + PAGE, dtype=np.uint8)
    off = (-raw.ctypes.data) % PAGE
    return raw[off:off + nbytes]


def from_bytes(u8: np.ndarray, spec: TensorSpec) -> Any:
    """A tensor of ``spec`` viewing ``u8`` (no copy)."""
    if spec.kind == "numpy":
        dt = np.dtype(spec.dtype)
        if spec.nbytes == 0:
            return np.empty(spec.shape, dtype=dt)
        return u8[:spec.nbytes].view(dt).reshape(spec.shape)
    torch = _torch()
    if spec.nbytes and spec.dtype in _NUMPY_NATIVE:
        # the view built in NumPy, one torch call: torch ops release the GIL, and getting
        # it back can wait on any other thread of the process (the store's I/O workers)
        return torch.from_numpy(u8[:spec.nbytes].view(spec.dtype).reshape(spec.shape))
    dt = torch_dtype(spec.dtype)
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=dt)
    return torch.from_numpy(u8[:spec.nbytes]).view(dt).reshape(spec.shape)


_NUMPY_NATIVE = frozenset({"float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool",
                           "complex64", "complex128"})
"""torch dtypes that NumPy has under the same name (bfloat16, float8 and the like it has not)."""


def torch_dtype(name: str):
    torch = _torch()
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise InvalidArgument(f"unknown torch dtype {name!r}")
    return dt


def cuda_out(out: Any, spec: TensorSpec) -> bool:
    """Is ``out`` a CUDA tensor (validated for an object of ``spec``)?"""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(out, torch.Tensor) or out.device.type != "cuda":
        return False
    got_dtype, got_n = str(out.dtype).removeprefix("torch."), out.numel() * out.element_size()
    if got_dtype != spec.dtype or got_n != spec.nbytes:
        raise InvalidArgument(f"out must be {spec.dtype} with {spec.nbytes} bytes (shape {list(spec.shape)}), "
                              f"got {got_dtype} with {got_n}")
    if not out.is_contiguous():
        raise InvalidArgument("out must be contiguous")
    return True


def out_bytes(out: Any, spec: TensorSpec) -> np.ndarray:
    """Validate ``out`` for an object of ``spec`` and return a writable uint8 view of it."""
    if isinstance(out, np.ndarray):
        got_dtype, got_n = out.dtype.name, int(out.nbytes)
        ok_layout = out.flags.c_contiguous and out.flags.writeable
        view = (lambda: out.reshape(-1).view(np.uint8))
    else:
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(out, torch.Tensor):
            raise InvalidArgument(f"out must be a torch.Tensor or numpy.ndarray, got {type(out).__name__}")
        if out.device.type != "cpu":
            raise InvalidArgument(f"out must be a CPU or CUDA tensor, got one on {out.device}")
        if out.requires_grad and torch.is_grad_enabled():
            raise InvalidArgument("out requires grad: bytes copied into it would change it behind autograd's back; "
                                  "pass out=t.detach() or call under torch.no_grad()")
        got_dtype, got_n = str(out.dtype).removeprefix("torch."), out.numel() * out.element_size()
        ok_layout = out.is_contiguous() and out.layout == torch.strided

        def view() -> np.ndarray:
            # written behind autograd's back: its version moves, so a backward that saved it
            # raises autograd's own error, as after an in-place copy_
            torch.autograd.graph.increment_version(out)
            return out.detach().reshape(-1).view(torch.uint8).numpy() if got_n else np.empty(0, np.uint8)
    if got_dtype != spec.dtype:
        raise InvalidArgument(f"out has dtype {got_dtype}, the object is {spec.dtype}")
    if got_n != spec.nbytes:
        raise InvalidArgument(f"out holds {got_n} bytes, the object has {spec.nbytes} (shape {list(spec.shape)})")
    if not ok_layout:
        raise InvalidArgument("out must be contiguous and writable")
    dst = view()
    if not dst.flags.writeable:  # e.g. the tensor of an 'r' check-out: a read-only mapping
        raise InvalidArgument("out is read-only (an 'r' check-out's tensor?); pass a writable tensor")
    return dst
