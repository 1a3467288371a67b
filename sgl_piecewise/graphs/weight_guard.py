"""Whole-model and breakable graphs read weights at their capture addresses:
``WeightGuard`` makes a weight moved or assigned since then an error, not stale
output. Runners call :meth:`WeightGuard.check_first` before a replay and
:meth:`WeightGuard.check` after a step's last launch (that step must run again).
"""

from __future__ import annotations

import itertools
import weakref
from typing import List, Optional

import torch
from torch.nn.modules import module as nn_module

from sgl_piecewise.errors import StaleGraphError

_data_ptr = torch.Tensor.data_ptr
_deref = weakref.ref.__call__

# module -> the guards watching it; entries go with their modules.
_watchers: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.WeakSet]" = weakref.WeakKeyDictionary()
_hooks_installed = False


def _on_assignment(module: torch.nn.Module, name: str, value: object) -> None:
    """Registration hook: note an assignment to a watched module (re-assigning the same object is none)."""
    guards = _watchers.get(module)
    if guards and not any(held.get(name) is value for held in (module._parameters, module._buffers, module._modules)):
        for guard in guards:
            guard.note_assignment(module, name)
    return None  # keep the value being registered


def watches_assignments(hook: object) -> bool:
    """Is ``hook`` the library's own registration hook (it changes nothing a forward does)?"""
    return hook is _on_assignment


def watch_assignments(model: torch.nn.Module, watcher: object) -> None:
    """Call ``watcher.note_assignment(module, name)`` on every assignment to
    ``model``'s current modules; ``watcher`` is held weakly."""
    _install_hooks()
    for module in model.modules():
        _watchers.setdefault(module, weakref.WeakSet()).add(watcher)


def _install_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    nn_module.register_module_parameter_registration_hook(_on_assignment)
    nn_module.register_module_buffer_registration_hook(_on_assignment)
    nn_module.register_module_module_registration_hook(_on_assignment)
    _hooks_installed = True


class WeightGuard:
    """``model``'s weight addresses at capture; ``graphs`` names them in errors."""

    def __init__(self, model: torch.nn.Module, graphs: str):
        unique = {}  # id -> (name, tensor): a tied weight once
        for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
            unique.setdefault(id(tensor), (name, tensor))
        self.graphs = graphs
        self._names = [name for name, _ in unique.values()]
        self._refs = [weakref.ref(tensor) for _, tensor in unique.values()]
        self._ptrs: List[Optional[int]] = [tensor.data_ptr() for _, tensor in unique.values()]
        self.assigned: Optional[str] = None  # what was assigned to a watched module, if anything
        self._module_names: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()
        for module_name, module in model.named_modules(remove_duplicate=False):
            self._module_names.setdefault(module, module_name)
        watch_assignments(model, self)

    def note_assignment(self, module: torch.nn.Module, name: str) -> None:
        """A parameter, buffer or submodule ``name`` was assigned to ``module``."""
        if self.assigned is None:
            prefix = self._module_names.get(module)
            self.assigned = f"{prefix}.{name} assigned" if prefix else f"{name} assigned"

    def check_first(self) -> None:
        """The first and last weights in place, nothing assigned."""
        if self.assigned is not None:
            self._raise_if_moved()
        for i in (0, -1) if self._refs else ():
            tensor = self._refs[i]()
            if tensor is None or tensor.data_ptr() != self._ptrs[i]:
                self._raise_if_moved()

    def check(self) -> None:
        """Every weight in place, nothing assigned."""
        try:  # mapped in C: this runs every step, over every weight
            moved = self.assigned is not None or list(map(_data_ptr, map(_deref, self._refs))) != self._ptrs
        except TypeError:  # a weight the model dropped: data_ptr of None
            moved = True
        if moved:
            self._raise_if_moved()

    def _addresses(self) -> List[Optional[int]]:
        return [None if t is None else t.data_ptr() for t in map(_deref, self._refs)]

    def _raise_if_moved(self) -> None:
        now = self._addresses()
        moved = [name for name, a, b in zip(self._names, now, self._ptrs) if a != b]
        if self.assigned is None and not moved:
            return
        what = ", ".join(moved[:3]) + (f" and {len(moved) - 3} more" if len(moved) > 3 else "")
        got = "; ".join(filter(None, [f"{what} moved or dropped" if moved else "", self.assigned]))
        raise StaleGraphError(
            f"{self.graphs}: expected the model's weights at the addresses they had at capture, got {got}; "
            f"update weights in place (load_state_dict, copy_) or capture the graphs again"
        )
