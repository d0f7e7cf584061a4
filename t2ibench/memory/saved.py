"""Counting what a step keeps: the bytes autograd saves for backward, by storage, and the bytes of
the storages ops create and free (the step's peak), on any device, the meta device included."""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass


def storage_key(tensor: torch.Tensor) -> int:
    """Identity of a tensor's storage (views share it); valid while the storage lives."""
    return tensor.untyped_storage()._cdata


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """The tensors in nested tuples, lists and dicts (what ops take and return); faster than pytree.
    A tensor subclass (torchao's float8 tensors) stands for the tensors it holds."""
    if isinstance(tree, torch.Tensor):
        if is_traceable_wrapper_subclass(tree):
            return [t for name in tree.__tensor_flatten__()[0] for t in tensors_in(getattr(tree, name))]
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [t for item in tree for t in tensors_in(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in tensors_in(item)]
    return []


class SavedForBackward:
    """Bytes autograd keeps for backward, by storage: `with SavedForBackward(exclude) as saved: ...`.

    `exclude`: storage keys not to count (parameters: they are weights). The hooks hand every saved
    tensor back unchanged, so the step still runs its backward. Inside a checkpointed block the
    checkpoint's own hooks are the innermost and keep nothing: what is counted there is what the
    checkpoint saves, the block's inputs.
    """

    def __init__(self, exclude: set[int]):
        self.exclude = exclude
        self.storages: dict[int, tuple[int, torch.Tensor]] = {}  # key -> (bytes, a tensor keeping it alive)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        for inner in tensors_in(tensor):
            key = storage_key(inner)
            if key not in self.exclude and key not in self.storages:
                self.storages[key] = (inner.untyped_storage().nbytes(), inner)
        return tensor

    def __enter__(self) -> "SavedForBackward":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def bytes(self, keys: set[int] | None = None) -> int:
        """Bytes of the saved storages (only those in `keys` when given)."""
        return sum(n for k, (n, _) in self.storages.items() if keys is None or k in keys)


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages ops create that are still alive, and their peak, since entering.

    Storages that existed before (parameters, buffers) are not counted. A storage is forgotten when
    its last tensor goes (a weakref on the storage object, which PyTorch keeps as long as the storage).
    """

    def __init__(self):
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._known: set[int] = set()

    def mark(self) -> int:
        """Restart the peak from what is alive now; returns that."""
        self.peak_bytes = self.live_bytes
        return self.live_bytes

    def _free(self, key: int, nbytes: int) -> None:
        self._known.discard(key)
        self.live_bytes -= nbytes

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._known:
            return
        self._known.add(key)
        nbytes = storage.nbytes()
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(storage, self._free, key, nbytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = {storage_key(t) for t in tensors_in((args, kwargs or {}))}
        out = func(*args, **(kwargs or {}))
        for tensor in tensors_in(out):
            if storage_key(tensor) not in before:  # not a view or an in-place result of an input
                self._track(tensor)
        return out
