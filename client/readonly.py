"""Read-only views of the shared arena for ``r`` check-outs.

The client maps the arena twice: read-write (puts, ``rw``/``w`` check-outs, copies out
of the arena) and read-only (``PROT_READ``), and builds an ``r`` check-out's tensor
over the second mapping. So a write through it can never reach the object's bytes:
the CPU refuses it. Only how the refusal shows differs:

- NumPy arrays over read-only memory are not writeable: a write raises ``ValueError``
  ("assignment destination is read-only").
- torch has no read-only tensors (``torch.from_numpy`` warns that writing is undefined
  behaviour, and it is a SIGSEGV). The tensor is therefore a ``ReadOnlyTensor``: a
  ``torch.Tensor`` subclass whose ``__torch_function__`` raises ``ReadOnlyView`` for an
  in-place op (``add_``, ``copy_``, ``t[i] = x``, ``t += x``), an ``out=`` that names it,
  and hands out views of it (``view``, ``reshape``, slices, ``detach``, ``numpy()``) as
  read-only too. Everything else it computes is a plain tensor. A write that goes
  around torch (a raw pointer through ``data_ptr()``, a C extension) still faults
  the writing process, and only it.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import numpy as np
import torch

from tierstore.errors import ReadOnlyView

__all__ = ["ReadOnlyTensor", "read_only"]

_INPLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                              "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                              "__irshift__", "__imatmul__"})
_HARMLESS = frozenset({"requires_grad_", "retain_grad", "share_memory_"})
"""Ops named like in-place ones that change no byte of the tensor's memory."""

_MESSAGE = ("the tensor of an 'r' check-out is read-only ({op}); check the object out 'rw' (or 'w' to "
            "overwrite it) to write to it, or clone() it for a private copy")


class ReadOnlyTensor(torch.Tensor):
    """A tensor over the arena's read-only mapping (see the module docstring)."""

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        """A private, writable copy (a plain tensor), as ``clone()`` gives."""
        import copy

        return copy.deepcopy(self.as_subclass(torch.Tensor), memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Saved (``torch.save``, pickle) as the plain tensor it views: what loads is a copy."""
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        first = args[0] if args else None
        if isinstance(first, (tuple, list)):  # torch._foreach_add_(tensors, ...) and the like
            first = next((x for x in first if isinstance(x, ReadOnlyTensor)), None)
        if isinstance(first, ReadOnlyTensor):
            if (name.endswith("_") and name not in _HARMLESS
                    and not name.startswith("__")) or name in _INPLACE_DUNDERS:
                raise ReadOnlyView(_MESSAGE.format(op=name))
            at = _inplace_index(func)  # F.relu(t, inplace=True) writes t from inside, unseen here
            if at is not None and kwargs.get("inplace", args[at] if len(args) > at else False):
                raise ReadOnlyView(_MESSAGE.format(op=f"{name}(inplace=True)"))
        out = kwargs.get("out")
        for o in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(o, ReadOnlyTensor):
                raise ReadOnlyView(_MESSAGE.format(op=f"{name}(out=...)"))
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
            ptrs = {a.untyped_storage().data_ptr() for a in _tensors(args, kwargs)}
            return _protect(result, ptrs)


@functools.lru_cache(maxsize=None)
def _inplace_index(func: Any) -> int | None:
    """Position of a Python function's ``inplace`` parameter (``torch.nn.functional``), or None."""
    try:
        params = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):  # a builtin: its writes are its name's trailing "_"
        return None
    return params.index("inplace") if "inplace" in params else None


def _tensors(args: tuple, kwargs: dict) -> list[ReadOnlyTensor]:
    found = [a for a in args if isinstance(a, ReadOnlyTensor)]
    for a in args:
        if isinstance(a, (tuple, list)):
            found.extend(x for x in a if isinstance(x, ReadOnlyTensor))
    found.extend(v for v in kwargs.values() if isinstance(v, ReadOnlyTensor))
    return found


def _protect(result: Any, ptrs: set[int]) -> Any:
    """(subclass handling off) Results that alias read-only memory become read-only too."""
    if isinstance(result, torch.Tensor):
        if not ptrs or result.device.type != "cpu" or result.layout != torch.strided \
                or result.untyped_storage().data_ptr() not in ptrs:
            return result
        return result if isinstance(result, ReadOnlyTensor) else result.as_subclass(ReadOnlyTensor)
    if isinstance(result, np.ndarray):
        if ptrs:
            result.flags.writeable = False
        return result
    if isinstance(result, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in result):
        return type(result)(_protect(x, ptrs) for x in result)
    return result


def read_only(t: Any) -> Any:
    """``t`` (a tensor or array over read-only memory) as the read-only view handed out."""
    if isinstance(t, torch.Tensor) and not isinstance(t, ReadOnlyTensor):
        return t.as_subclass(ReadOnlyTensor)
    return t
