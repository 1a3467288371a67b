"""A compile saved whole, so a later process starts without Dynamo or Inductor.

With ``CompileOptions(cache_dir=...)``, the first process that compiles a
model with piecewise graphs saves, under a key of the model:

* the Dynamo graph, split (attention in its out variant), pickled;
* where each graph input comes from (``direct_call.py``), the token axis and
  the trace's shape, stride, dtype and device of every weight;
* each distinct compiled piece as an Inductor artifact
  (``torch._inductor.standalone_compile``, through ``internals/inductor.py``);
* a hash of every source file Dynamo traced.

A later process looks the key up before Dynamo runs. On a hit it splits the
saved graph, loads the pieces and calls the graph directly: no trace, no
AOTAutograd, no Inductor compile. The key covers what the graph and its
kernels depend on: this library's, torch's, Triton's and Python's versions,
the device (name and compute capability), the options, the grad mode, and
the model: every module's class, plain attributes (a config, an ``eps``)
and hooks, torch's global module hooks (not the library's own watch of
weight assignments),
every parameter's and buffer's name, shape, stride, dtype and device, and the
call's tensors. A traced source file that changed since the save, or a
constant Dynamo guarded on (a module attribute the trace read, checked by
its source) that differs now, makes the entry stale: the model traces
afresh and the entry is replaced. So a changed model, dtype, torch or GPU
never loads a stale compile. The directory is trusted like Inductor's
cache: its entries are pickles.

Nothing is saved for a compile that cannot be replayed this way, with the
reason logged: a constant guard of the trace that cannot be read without
Dynamo (a module-level value), a graph input that is no argument,
parameter or buffer, a trace with side effects (an attribute set in
``forward``), a result other than the graph's outputs, a graph that holds
only for some token counts (a Python branch on the count: Dynamo's shape
guards were kept), graphs off, or the ``tensorrt`` piece compiler. Such a
model traces in every process (Inductor's own cache still helps). So does
every model on a torch whose trace state cannot be read
(``internals/dynamo_trace.py``): the traced files and the side effects
are then unknown.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import logging
import os
import pickle
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx

from sgl_piecewise.compile.artifacts import device_id, tensor_parallel_id, triton_version, write_atomically
from sgl_piecewise.compile.direct_call import GraphInputs
from sgl_piecewise.compile.token_axis import TokenAxis
from sgl_piecewise.internals import dynamo_trace
from sgl_piecewise.version import __version__

logger = logging.getLogger("sgl_piecewise.compile")

FORMAT = 1  # bumped whenever SavedCompile's layout changes
_SIMPLE = (bool, int, float, str, type(None), torch.dtype, torch.device)


@dataclass
class SavedCompile:
    """What a later process needs to rebuild a compiled graph (the pieces'
    artifacts are files beside it, ``piece_<i>.bin``)."""

    graph: bytes  # the split Dynamo graph (attention in its out variant), pickled without node metadata
    splitting: Tuple[str, ...]  # names of its splitting (attention) pieces
    inputs: GraphInputs
    token_axis: TokenAxis
    static_specs: Tuple[Any, ...]  # (shape, stride, dtype, device) per weight input, as traced
    pieces: Dict[str, int]  # compiled piece name -> artifact file index
    returns_tuple: Dict[str, bool]  # compiled piece name -> does its graph return a tuple
    num_artifacts: int
    sources: Dict[str, str]  # traced file -> sha256 of its contents
    output: str = "first"  # "first": the call returns the graph's only output; "tuple": all of them
    # Dynamo's guards on constants of the trace, (source, value): checked at
    # the look-up, where Dynamo no longer runs.
    constants: Tuple[Tuple[str, Any], ...] = ()


# ---- the key -------------------------------------------------------------
def model_key(model: torch.nn.Module, args: Sequence[Any], options: Any) -> str:
    """Hex digest of everything a saved compile depends on (module docstring)."""

    parts: List[str] = [
        f"format {FORMAT}", __version__, torch.__version__, triton_version(), sys.version,
        repr(dataclasses.replace(options, cache_dir=None)), f"grad {torch.is_grad_enabled()}",
        f"default dtype {torch.get_default_dtype()}", f"deterministic {torch.are_deterministic_algorithms_enabled()}",
        tensor_parallel_id(),
    ]  # fmt: skip
    for a in args:
        parts.append(f"arg {a.dtype} {tuple(a.shape[1:])} {a.dim()} {device_id(a.device)}")
    parts.append(f"global hooks {_hook_counts(torch.nn.modules.module)}")
    for name, module in model.named_modules(remove_duplicate=False):
        kind = f"{type(module).__module__}.{type(module).__qualname__}"
        parts.append(f"module {name} {kind} {_plain_attributes(module)} hooks {_hook_counts(module)}")
    for kind, named in (("param", model.named_parameters), ("buffer", model.named_buffers)):
        for name, t in named(remove_duplicate=False):
            layout = f"{tuple(t.shape)} {t.stride()} {t.dtype} {device_id(t.device)} {t.requires_grad}"
            parts.append(f"{kind} {name} {layout}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _hook_counts(owner: Any) -> str:
    """How many hooks of each kind ``owner`` (a module, or torch's module of
    global hooks) holds: a trace runs the hooks there were, and a hook
    added since needs a trace of its own. The library's own watch of weight
    assignments is not counted: it runs in no forward, and it is installed
    at the first graph capture or compiled call of a process, so the same
    model's key would differ before and after it."""
    from sgl_piecewise.graphs.weight_guard import watches_assignments  # runners/ builds on compile/

    tables = sorted(name for name, value in vars(owner).items() if "hooks" in name and isinstance(value, dict))
    counts = {name: sum(not watches_assignments(hook) for hook in getattr(owner, name).values()) for name in tables}
    return ",".join(f"{name}={n}" for name, n in counts.items())


def _plain_attributes(module: torch.nn.Module) -> str:
    """The module's attributes that a trace may bake in as constants: plain
    values and dataclasses of them (a config)."""
    items = []
    for name, value in sorted(vars(module).items()):
        if name.startswith("_") and name != "training":
            continue
        plain_sequence = isinstance(value, (tuple, list)) and all(isinstance(v, _SIMPLE) for v in value)
        config = dataclasses.is_dataclass(value) and not isinstance(value, type)
        if isinstance(value, _SIMPLE) or plain_sequence or config:
            items.append(f"{name}={value!r}")
    return ";".join(items)


# ---- what the trace tells ---------------------------------------------------
def traced_sources() -> Dict[str, str] | str:
    """sha256 of every file Dynamo traced for the graph being compiled, or
    why they cannot be known."""
    try:
        codes = dynamo_trace.traced_code()
    except dynamo_trace.TraceUnreadable as exc:
        return f"the traced files cannot be read ({exc})"
    except (AttributeError, RuntimeError, AssertionError) as exc:
        return f"this torch does not list the traced code ({exc})"
    if not codes:
        return "the tracing context lists no traced code"
    sources = {}
    for path in sorted({code.co_filename for code in codes}):
        digest = _file_digest(path)
        if digest is None:
            return f"traced code from {path}, which is no readable file"
        sources[path] = digest
    return sources


def _file_digest(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def side_effects() -> Optional[str]:
    """Why the graph being compiled is not the whole of the traced call (the
    trace sets attributes, globals or cells), or None when it is."""
    try:
        modified = dynamo_trace.mutated_existing_objects()
    except Exception as exc:  # internals of Dynamo: unknown means "do not save"
        return f"cannot tell whether the trace has side effects ({type(exc).__name__}: {exc})"
    return f"the trace has {modified} side effects (mutated attributes, globals or cells)" if modified else None


def pickled_split(split_gm: torch.fx.GraphModule, drop: Sequence[str] = ()) -> bytes:
    """The split module pickled without node metadata (Dynamo's holds
    unpicklable tracing state; nothing after the split reads it), and
    without the pieces named in ``drop`` (saved as artifacts of their own:
    unpickling a ``GraphModule`` traces its code anew, which a warm start
    need not pay for a piece it never runs)."""
    graphs = [m for m in split_gm.modules() if isinstance(m, torch.fx.GraphModule)]
    metas = [[node.meta for node in m.graph.nodes] for m in graphs]
    dropped = {name: split_gm._modules[name] for name in drop}
    try:
        for m in graphs:
            for node in m.graph.nodes:
                node.meta = {}
        split_gm._modules.update({name: torch.nn.Module() for name in drop})
        return pickle.dumps(split_gm)
    finally:
        split_gm._modules.update(dropped)
        for m, kept in zip(graphs, metas):
            for node, meta in zip(m.graph.nodes, kept):
                node.meta = meta


def changed_constant(
    constants: Sequence[Tuple[str, Any]], model: torch.nn.Module, args: Sequence[Any]
) -> Optional[str]:
    """The first of Dynamo's constant guards, ``(source, value)``, that
    ``model(*args)`` no longer meets, or cannot be read without Dynamo
    (a module-level global), described; None when all hold."""
    names = list(inspect.signature(model.forward).parameters)
    local = {"self": model, **dict(zip(names, args))}
    scope = {"L": local, **local}
    for source, value in constants:
        try:
            now = eval(source, {"__builtins__": {}}, scope)  # a Dynamo source: attribute and item access
        except Exception as exc:
            return f"guard on {source} cannot be checked without Dynamo ({type(exc).__name__})"
        if type(now) is not type(value) or now != value:
            return f"{source} is {now!r}, traced as {value!r}"
    return None


# ---- files ---------------------------------------------------------------
def entry_dir(cache_dir: str, key: str) -> str:
    return os.path.join(cache_dir, f"graph-{key}")


def save(cache_dir: str, key: str, saved: SavedCompile, artifacts: Sequence[Any]) -> None:
    """Write the artifacts, then the entry: the entry file is written last and
    atomically, so a reader finds a whole entry or none."""
    directory = entry_dir(cache_dir, key)
    os.makedirs(directory, exist_ok=True)
    for i, artifact in enumerate(artifacts):
        artifact.save(path=_piece_path(directory, i), format="binary")
    write_atomically(os.path.join(directory, "entry.pkl"), pickle.dumps(saved))


def _piece_path(directory: str, index: int) -> str:
    return os.path.join(directory, f"piece_{index}.bin")


def load_entry(cache_dir: str, key: str) -> Optional[SavedCompile]:
    """The entry saved under ``key``, or None (none saved, a traced file
    changed, or a damaged file: logged, never raised). Its pieces load
    apart (``load_pieces``), once the entry is known to hold."""
    directory = entry_dir(cache_dir, key)
    path = os.path.join(directory, "entry.pkl")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            saved = pickle.load(f)
        if not isinstance(saved, SavedCompile):
            raise TypeError(f"expected a SavedCompile, got {type(saved).__name__}")
    except Exception as exc:
        logger.warning("saved compile %s: expected a readable entry, got %s; tracing afresh", path, exc)
        return None
    changed = [p for p, digest in saved.sources.items() if _file_digest(p) != digest]
    if changed:
        logger.info("saved compile %s is stale: %s changed since; tracing afresh", directory, changed[0])
        return None
    return saved


def load_pieces(cache_dir: str, key: str, saved: SavedCompile) -> Optional[List[Any]]:
    """The Inductor pieces of the entry ``saved`` under ``key``, or None
    (a file missing or damaged: logged, never raised)."""
    if not saved.num_artifacts:  # eager pieces: saved in the graph
        return []
    directory = entry_dir(cache_dir, key)
    try:
        from sgl_piecewise.internals import inductor  # imports Inductor (seconds)

        return [inductor.load_artifact(_piece_path(directory, i)) for i in range(saved.num_artifacts)]
    except Exception as exc:
        logger.warning("saved compile %s: expected loadable pieces, got %s; tracing afresh", directory, exc)
        return None
