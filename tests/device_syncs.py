"""Counting, on the CPU, the operations that would make the host wait for a CUDA device.

On a GPU torch.cuda's sync debug mode names every host sync; the CPU has none to name, so `DeviceSyncs`
counts the operations that synchronize on CUDA as they pass, by kind and by the source line that made them:

- at the dispatcher (`TorchDispatchMode`): `aten._local_scalar_dense` (`.item()`, `int()`, `bool()`,
  `float()` of a tensor), `aten.nonzero`, `aten.masked_select`, an `aten.index` / `aten.index_put_` with a
  boolean mask (a nonzero inside), and an `aten._to_copy` / `aten.copy_` whose source and destination devices
  differ, unless asked not to block;
- above it (`TorchFunctionMode`), what a CPU tensor does without reaching the dispatcher: `.tolist()`,
  `.cpu()` and `.numpy()` (on CUDA a device-to-host copy), `torch.tensor` / `torch.as_tensor` of host values
  with a `device` named (on CUDA a blocking copy from pageable memory), and `.to(device)` / `.copy_` of a
  tensor made on the host (a factory given no device) while counting.

Both modes are thread-local: a teacher prefetcher's own thread (its own CUDA stream) is not counted. A sync
is named by the innermost four frames outside torch and this module ("file:line < file:line < ..."); one made
by torch's own code (the per-tensor AdamW's reads of its step counts on the CPU, where CUDA runs a fused
kernel) carries " (torch)" and is left out of `syncs`.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

TORCH_DIR = str(Path(torch.__file__).parent)
# How torch hands an operation to a mode: passed over, so that the caller of the operation is the one named.
_MACHINERY = tuple(str(Path(TORCH_DIR, name)) for name in ("overrides.py", "utils/_python_dispatch.py", "_ops.py",
                                                             "utils/_pytree.py", "_tensor.py", "_compile.py",
                                                             "_dynamo/eval_frame.py"))
_HERE = __file__
_aten = torch.ops.aten
_SCALAR_READS = {_aten._local_scalar_dense.default}
_NONZERO = {_aten.nonzero.default, _aten.masked_select.default}
_MASKED = {_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default}
_COPIES = {_aten._to_copy.default, _aten.copy_.default}
_HOST_READS = {torch.Tensor.tolist: "tolist", torch.Tensor.cpu: "cpu", torch.Tensor.numpy: "numpy"}
_FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.tensor, torch.as_tensor,
              torch.scalar_tensor, torch.eye}
_FROM_HOST_VALUES = {torch.tensor, torch.as_tensor}


def _where(depth: int = 4) -> tuple[str, bool]:
    """The innermost `depth` frames outside torch and this module, innermost first ("file:line < file:line"),
    and whether the frame that called into torch was torch's own."""
    frame, torch_called, lines = sys._getframe(2), None, []
    while frame is not None and len(lines) < depth:
        name = frame.f_code.co_filename
        if name != _HERE and not name.startswith(_MACHINERY):
            inside_torch = name.startswith(TORCH_DIR)
            torch_called = inside_torch if torch_called is None else torch_called
            if not inside_torch:
                lines.append(f"{Path(name).name}:{frame.f_lineno}")
        frame = frame.f_back
    return " < ".join(lines) or "?", bool(torch_called)


class _Dispatched(TorchDispatchMode):
    def __init__(self, counter: DeviceSyncs) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = None
        if func in _SCALAR_READS:
            kind = "_local_scalar_dense"
        elif func in _NONZERO:
            kind = func.__name__.split(".")[0]
        elif func in _MASKED and any(index is not None and index.dtype in (torch.bool, torch.uint8)
                                     for index in args[1]):
            kind = f"{func.__name__.split('.')[0]} (boolean mask)"
        elif func in _COPIES and not kwargs.get("non_blocking", False):
            source = args[1] if func is _aten.copy_.default else args[0]
            destination = args[0].device if func is _aten.copy_.default else kwargs.get("device", source.device)
            if torch.device(destination) != source.device:
                kind = f"{func.__name__.split('.')[0]} {source.device.type}->{torch.device(destination).type}"
        if kind is not None:
            self.counter.add(kind)
        return func(*args, **kwargs)


class _Functions(TorchFunctionMode):
    def __init__(self, counter: DeviceSyncs) -> None:
        super().__init__()
        self.counter = counter
        self.host_made = WeakIdKeyDictionary()  # tensors a factory made on the host while counting

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_READS and args[0].device.type == "cpu":
            self.counter.add(_HOST_READS[func])
        elif func in _FROM_HOST_VALUES and kwargs.get("device") is not None and args and not isinstance(
                args[0], torch.Tensor):
            self.counter.add(f"torch.{func.__name__}(host values, device=)")
        elif func in (torch.Tensor.to, torch.Tensor.copy_) and not kwargs.get("non_blocking", False):
            source = args[1] if func is torch.Tensor.copy_ else args[0]
            moves = func is torch.Tensor.copy_ or any(isinstance(arg, (torch.device, str, torch.Tensor))
                                                      for arg in (*args[1:], kwargs.get("device")))
            if moves and source in self.host_made:
                self.counter.add(f"{func.__name__} of a host-made tensor")
        result = func(*args, **kwargs)
        if func in _FACTORIES and kwargs.get("device") is None and isinstance(result, torch.Tensor) and not (
                func in _FROM_HOST_VALUES and args and isinstance(args[0], torch.Tensor)):
            self.host_made[result] = True
        return result


class DeviceSyncs:
    """Counts by "kind @ file:line" the operations that synchronize on CUDA while it is entered (module
    docstring); `syncs` leaves out torch's own."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self._modes: list = []

    def add(self, kind: str) -> None:
        where, torch_own = _where()
        self.counts[f"{kind} @ {where}" + (" (torch)" if torch_own else "")] += 1

    def syncs(self) -> Counter:
        """The counted syncs of code outside torch (and of torch called from it), by "kind @ file:line"."""
        return Counter({key: count for key, count in self.counts.items() if not key.endswith(" (torch)")})

    def __enter__(self) -> DeviceSyncs:
        self._modes = [_Functions(self), _Dispatched(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
