"""Whole-model and breakable graphs read the weights where capture found
them: ``WeightGuard`` turns a weight moved since into an error, not stale
output.

A CUDA graph records device addresses. Piecewise graphs take the weights as
graph inputs and capture a new set of graphs for weights at new addresses
(``compile/backend.py``). Whole-model and breakable graphs record the model
itself, so after a weight moved they would go on reading the memory it left.
Weights updated in place (``load_state_dict``, ``copy_``) keep their
addresses, and every replay reads them as updated.

At capture the guard notes every parameter and buffer of the model (by weak
reference: it keeps none alive) and its address. A weight has moved when its
address changed (``.data =``, ``set_``, a dtype or device conversion), when
the model dropped it, or when any of the model's modules had a parameter,
buffer or submodule assigned since capture (a weight replaced by a new
tensor, ``load_state_dict(assign=True)``), which torch's module registration
hooks report. :meth:`WeightGuard.check_first` looks at the first and last
weights and the assignments only, a few hundred nanoseconds: runners call it
before a replay, so converting or reloading the model never lets a graph
run. :meth:`WeightGuard.check` looks at every weight, 0.1–0.2 µs each
(21.5–29.3 µs for the 171 of the 0.5B shape on the H200 hosts measured,
docs/BENCHMARKS.md):
runners call it right after launching a step's last graph, while the card
runs it, and raise before the output is returned. A single weight moved
behind the model's back is then caught after that step ran: its output is
dropped, but the new tokens' K/V it wrote came from the stale weights, so
the step must be run again once the graphs are captured again.
"""

from __future__ import annotations

import itertools
import weakref
from typing import List, Optional

import torch

from sgl_piecewise.errors import StaleGraphError

_data_ptr = torch.Tensor.data_ptr
_deref = weakref.ref.__call__

# module -> the guards watching it; entries go with their modules.
_watchers: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.WeakSet]" = weakref.WeakKeyDictionary()
_hooks_installed = False


def _on_assignment(module: torch.nn.Module, name: str, value: object) -> None:
    """torch's module registration hooks: a watched module had a parameter,
    buffer or submodule assigned (the one it holds already is no change)."""
    guards = _watchers.get(module)
    if guards and not any(held.get(name) is value for held in (module._parameters, module._buffers, module._modules)):
        for guard in guards:
            guard.note_assignment(module, name)
    return None  # keep the value being registered


def watches_assignments(hook: object) -> bool:
    """Is ``hook`` the library's own registration hook (it changes nothing
    a forward does)?"""
    return hook is _on_assignment


def watch_assignments(model: torch.nn.Module, watcher: object) -> None:
    """From now on, ``watcher.note_assignment(module, name)`` whenever a
    parameter, buffer or submodule ``name`` is assigned to one of
    ``model``'s modules (its modules now; ``watcher`` is held weakly)."""
    _install_hooks()
    for module in model.modules():
        _watchers.setdefault(module, weakref.WeakSet()).add(watcher)


def _install_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    from torch.nn.modules import module as nn_module

    nn_module.register_module_parameter_registration_hook(_on_assignment)
    nn_module.register_module_buffer_registration_hook(_on_assignment)
    nn_module.register_module_module_registration_hook(_on_assignment)
    _hooks_installed = True


class WeightGuard:
    """The addresses of ``model``'s parameters and buffers when its graphs
    were captured; ``graphs`` names them in errors."""

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
