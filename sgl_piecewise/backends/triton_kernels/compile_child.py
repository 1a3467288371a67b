"""Our Triton kernels compiled in a child process, ahead of their first launch.

From empty caches, a piecewise start-up compiles the extend kernel at its
first launch: after Dynamo's trace and Inductor's piece compiles, on the
main thread, about 1 s (MLIR and LLVM passes, ``ptxas``; docs/BENCHMARKS.md).
Compiled on a background thread of the process instead (tried, not kept),
the compile held the GIL for part of its time and slowed Dynamo's trace by
about as much. A child process has a GIL of its own. Started when the
backend is built, it compiles the launches the start-up is predicted to make
(``extend.predicted_start_up_compiles``) into Triton's on-disk cache, where
the parent's first launch finds them.

The child compiles through ``JITFunction.warmup`` with every tensor given as
its dtype (a 16-byte aligned pointer), as ``FastLauncher``'s compiles ahead
do, for the architecture of the parent's card, which it is told: Triton's
driver is answered the device, stream and architecture it would ask the
card for, and loads nothing onto one, so the child opens no CUDA context (a
context would take device memory the parent may be about to reserve). It
inherits the environment: Triton's cache directory and options. A
prediction that misses costs only the child's time: the parent compiles
what it launches, as it did without the child. A first launch of a kernel
the child is compiling waits for it (:func:`wait_for_child`) rather than
compiling it a second time; one the child has not begun yet is compiled in
the process, as without the child. The child runs at a lower priority than
the parent and Inductor's compile workers: its compiles are needed last.

A triton backend over CUDA pools starts the child for its pool's shapes
and dtype; a child starts only for compiles no child of the process was
given (a second backend of the same shapes starts none). Started earlier,
while the model's weights were drawn on the host, the child slowed that
draw by about as much as it saved the start-up (docs/BENCHMARKS.md). Set
``SGL_PIECEWISE_COMPILE_CHILD=0`` to compile everything in the process
(``1``, the default, starts children; another value is refused).

The protocol: the parent writes one JSON object to the child's stdin,
``{"capability": [9, 0], "compiles": [{"kernel": "module:name", "args": [...],
"meta": {...}}, ...]}``, a tensor argument as ``{"dtype": "bfloat16"}``; the
child answers ``start <i>`` as it begins each compile, in order, and
``done <i>`` or ``failed <i> <why>`` as it ends it, then ``context <0|1|?>``:
whether it holds a CUDA context (it must not; ``?`` where no CUDA driver
can tell).
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from sgl_piecewise.errors import InvalidInputError

logger = logging.getLogger("sgl_piecewise.triton")

ENV_SWITCH = "SGL_PIECEWISE_COMPILE_CHILD"

# A first launch waits at most this long for the child's compile of its
# kernel, then compiles it itself (a child stuck on a loaded host).
WAIT_SECONDS = 30.0

Compile = Tuple[Sequence[Any], Dict[str, Any]]  # (arguments, tensors as dtypes; constexprs and options)


class _Child:
    """A running child: its process, and an event per compile it was given,
    set when it answers for that compile (or exits)."""

    def __init__(self, process: subprocess.Popen, compiles: List[Tuple[str, Dict[str, Any]]]):
        self.process = process
        self.compiles = compiles  # (kernel name, meta) per compile, in the order given
        self.started_compiles: set = set()  # indexes the child has begun
        self.answers: Dict[int, str] = {}
        self.opened_context: Optional[bool] = None  # None until answered, or where it could not tell
        self.started = time.perf_counter()
        self.seconds: Optional[float] = None  # from its start to its exit
        self.events = [threading.Event() for _ in compiles]
        self.reader = threading.Thread(target=self._read, name="sgl-piecewise-compile-child", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        try:
            for line in self.process.stdout:
                word, _, rest = line.strip().partition(" ")
                if word == "start":
                    self.started_compiles.add(int(rest))
                elif word in ("done", "failed"):
                    index, _, why = rest.partition(" ")
                    self.answers[int(index)] = word if word == "done" else f"failed: {why}"
                    self.events[int(index)].set()
                elif word == "context":
                    self.opened_context = {"0": False, "1": True}.get(rest)  # "?": no driver to ask
        except (ValueError, IndexError, OSError) as exc:  # a garbled answer: stop listening, stop waiting
            logger.debug("compile child: unreadable answer: %s", exc)
        finally:
            for event in self.events:
                event.set()  # exited or garbled: nothing more to wait for
            self.process.stdout.close()
            self.process.wait()
            self.seconds = time.perf_counter() - self.started

    def wait(self, kernel: str, meta: Dict[str, Any], timeout: float) -> bool:
        """Wait until the child answered for each compile of ``kernel`` under
        ``meta`` that it has begun (or exited); whether it answered for
        them all. False at once where it began none: the caller compiles it
        sooner itself."""
        begun = [
            i
            for i, (name, m) in enumerate(self.compiles)
            if name == kernel and m == meta and (i in self.started_compiles or self.events[i].is_set())
        ]
        answered = [self.events[i].wait(timeout) and i in self.answers for i in begun]
        return bool(answered) and all(answered)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()  # Triton writes a cache entry whole or not at all


_children: List[_Child] = []
_given: set = set()  # every compile handed to a child of this process, encoded
_lock = threading.Lock()


def kernel_name(fn: Any) -> str:
    """``module:name`` of a ``@triton.jit`` function, as the child imports it."""
    return f"{fn.fn.__module__}:{fn.fn.__name__}"


def _encode(arg: Any) -> Any:
    if isinstance(arg, torch.dtype):
        return {"dtype": str(arg).removeprefix("torch.")}
    if isinstance(arg, (bool, int, float)):
        return arg
    raise TypeError(f"expected a dtype, int or float argument, got {type(arg).__name__}")


def _triton_cache_dir() -> Optional[str]:
    try:
        from triton import knobs
    except ImportError:  # an older Triton: the child reads the same environment
        return None
    return knobs.cache.dir


def _switched_on() -> bool:
    value = os.environ.get(ENV_SWITCH, "1")
    if value not in ("0", "1"):
        raise InvalidInputError(f"{ENV_SWITCH}: expected 0 (compile in the process) or 1 (the default), got {value!r}")
    return value == "1"


def compile_in_child(fn: Any, compiles: Sequence[Compile], device: torch.device) -> bool:
    """Start a child compiling those of ``compiles`` of the ``@triton.jit``
    kernel ``fn`` (for ``device``'s architecture) that no child of this
    process was given yet, unless switched off. Returns whether one started;
    raises ``InvalidInputError`` where the switch is neither 0 nor 1."""
    if not _switched_on() or device.type != "cuda":
        return False
    name = kernel_name(fn)
    try:
        encoded = [{"kernel": name, "args": [_encode(a) for a in args], "meta": meta} for args, meta in compiles]
        keys = [json.dumps(e, sort_keys=True) for e in encoded]
        capability = list(torch.cuda.get_device_capability(device))
    except (TypeError, ValueError, RuntimeError, AssertionError) as exc:  # JSON cannot carry it, or no card
        logger.debug("compile child for %s: %s", name, exc)
        return False
    with _lock:
        new = [(e, key) for e, key in zip(encoded, keys) if key not in _given]
        if not new:
            return False
        child = _start_child(capability, [e for e, _ in new])
        if child is None:
            return False
        _given.update(key for _, key in new)
        _children.append(child)
        return True


def _start_child(capability: List[int], compiles: List[Dict[str, Any]]) -> Optional[_Child]:
    env = dict(os.environ)
    # The parent's import path, in its order: the child imports the same
    # kernels, Triton and torch (their sources are part of Triton's cache key).
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if isinstance(p, str) and p)
    cache_dir = _triton_cache_dir()
    if cache_dir:
        env["TRITON_CACHE_DIR"] = cache_dir  # set in the process, maybe not in its environment
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, env=env, text=True,
        )  # fmt: skip
        process.stdin.write(json.dumps({"capability": capability, "compiles": compiles}))
        process.stdin.close()
    except OSError as exc:  # no interpreter to start: compile in the process
        logger.debug("compile child did not start: %s", exc)
        return None
    child = _Child(process, [(c["kernel"], c["meta"]) for c in compiles])
    atexit.register(child.stop)
    return child


def wait_for_child(fn: Any, meta: Dict[str, Any], timeout: float = WAIT_SECONDS) -> bool:
    """Before compiling ``fn`` under ``meta`` in the process: wait for the
    children's compiles of it that they have begun (Triton's cache then
    holds them). Returns whether there were any and all were answered."""
    if not _children:
        return False
    name = kernel_name(fn)
    waited = [child.wait(name, meta, timeout) for child in list(_children)]
    return any(waited)


def child_answers() -> List[Dict[str, Any]]:
    """Each child's answers so far, in the order they started: ``answers``
    by compile index, ``opened_context``, and ``seconds`` from its start to
    its exit (None while it runs)."""
    return [{"answers": dict(c.answers), "opened_context": c.opened_context, "seconds": c.seconds} for c in _children]


# ---- the child --------------------------------------------------------------
def _decode(arg: Any) -> Any:
    return getattr(torch, arg["dtype"]) if isinstance(arg, dict) else arg


def _kernel(name: str) -> Any:
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


def _compile_for(capability: Sequence[int]) -> None:
    """Point Triton's driver at ``capability`` and no card: the device and
    stream a launch would look up, and the card's architecture, are answered
    here, so compiling touches no CUDA API that opens a context."""
    from triton.runtime import driver

    active = driver.active
    for name in ("get_current_device", "get_current_stream", "get_device_capability"):
        if not hasattr(active, name):  # a Triton whose driver looks them up otherwise: do not guess
            raise RuntimeError(f"expected Triton's driver to have {name}, got {type(active).__name__} without it")
    active.get_current_device = lambda: 0
    active.get_current_stream = lambda device=None: 0
    active.get_device_capability = lambda device=None: tuple(capability)


def _compile_all(request: Dict[str, Any]) -> None:
    _compile_for(request["capability"])
    for i, spec in enumerate(request["compiles"]):
        print(f"start {i}", flush=True)
        try:
            _kernel(spec["kernel"]).warmup(*map(_decode, spec["args"]), grid=(1,), **spec["meta"])
            print(f"done {i}", flush=True)
        except Exception as exc:  # noqa: BLE001 - reported; the parent compiles it itself
            print(f"failed {i} {_one_line(exc)}", flush=True)


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"


def _opened_context() -> str:
    """Whether this process holds the first card's primary CUDA context,
    asked of the driver itself ("?" without one)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "?"
    device, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    if cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(device), 0):
        return "?"
    if cuda.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active)):
        return "?"
    return str(int(bool(active.value)))


def _main() -> None:
    if hasattr(os, "nice"):
        os.nice(10)  # behind the parent and its compile workers: its compiles are needed last
    request = json.load(sys.stdin)
    try:
        _compile_all(request)
    except Exception as exc:  # noqa: BLE001 - no Triton driver: every compile fails, reported
        for i in range(len(request.get("compiles", []))):
            print(f"failed {i} {_one_line(exc)}", flush=True)
    print(f"context {_opened_context()}", flush=True)


if __name__ == "__main__":
    _main()
