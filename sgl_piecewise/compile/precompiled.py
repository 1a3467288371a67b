"""A compile saved whole, so a later process starts without Dynamo or Inductor.

With ``CompileOptions(cache_dir=...)`` the first process saves the split
graph, the graph inputs' sources and each distinct Inductor piece under a
key of the model (``model_key``); a later process with that key calls the
graph directly. A traced file or guarded constant that changed since makes
the entry stale. Entries are pickles: the directory is trusted like
Inductor's cache. docs/ARCHITECTURE.md, "Saved compiles".
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
from sgl_piecewise.graphs.weight_guard import watches_assignments
from sgl_piecewise.internals import dynamo_trace
from sgl_piecewise.version import __version__

logger = logging.getLogger("sgl_piecewise.compile")

FORMAT = 1  # bumped whenever SavedCompile's layout changes
_SIMPLE = (bool, int, float, str, type(None), torch.dtype, torch.device)


@dataclass
class SavedCompile:
    """What a later process needs to rebuild a compiled graph (pieces: ``piece_<i>.bin``)."""

    graph: bytes  # the split Dynamo graph, pickled
    splitting: Tuple[str, ...]  # names of its splitting (attention) pieces
    inputs: GraphInputs
    token_axis: TokenAxis
    static_specs: Tuple[Any, ...]  # (shape, stride, dtype, device) per weight input, as traced
    pieces: Dict[str, int]  # compiled piece name -> artifact file index
    returns_tuple: Dict[str, bool]  # compiled piece name -> does its graph return a tuple
    num_artifacts: int
    sources: Dict[str, str]  # traced file -> sha256 of its contents
    output: str = "first"  # "first": the call returns the graph's only output; "tuple": all of them
    # Dynamo's guards on constants, (source, value): checked at the look-up.
    constants: Tuple[Tuple[str, Any], ...] = ()


def model_key(model: torch.nn.Module, args: Sequence[Any], options: Any) -> str:
    """Hex digest of what a saved compile depends on: versions, device, options, the model's
    modules (class, plain attributes, hooks) and weights, and the call's tensors."""
    parts: List[str] = [
        f"format {FORMAT}",
        __version__,
        torch.__version__,
        triton_version(),
        sys.version,
        repr(dataclasses.replace(options, cache_dir=None)),
        f"grad {torch.is_grad_enabled()}",
        f"default dtype {torch.get_default_dtype()}",
        f"deterministic {torch.are_deterministic_algorithms_enabled()}",
        tensor_parallel_id(),
    ]
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
    """How many hooks of each kind ``owner`` holds; the library's own watch of
    weight assignments is left out (installed mid-process, it runs in no forward)."""
    tables = sorted(name for name, value in vars(owner).items() if "hooks" in name and isinstance(value, dict))
    counts = {name: sum(not watches_assignments(hook) for hook in getattr(owner, name).values()) for name in tables}
    return ",".join(f"{name}={n}" for name, n in counts.items())


def _plain_attributes(module: torch.nn.Module) -> str:
    """The attributes a trace may bake in as constants: plain values, dataclasses of them."""
    items = []
    for name, value in sorted(vars(module).items()):
        if name.startswith("_") and name != "training":
            continue
        plain_sequence = isinstance(value, (tuple, list)) and all(isinstance(v, _SIMPLE) for v in value)
        config = dataclasses.is_dataclass(value) and not isinstance(value, type)
        if isinstance(value, _SIMPLE) or plain_sequence or config:
            items.append(f"{name}={value!r}")
    return ";".join(items)


def traced_sources() -> Dict[str, str] | str:
    """sha256 of every file Dynamo traced for the graph being compiled, or why unknown."""
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
    """Why the graph being compiled is not the whole traced call, or None."""
    try:
        modified = dynamo_trace.mutated_existing_objects()
    except Exception as exc:  # internals of Dynamo: unknown means "do not save"
        return f"cannot tell whether the trace has side effects ({type(exc).__name__}: {exc})"
    return f"the trace has {modified} side effects (mutated attributes, globals or cells)" if modified else None


def pickled_split(split_gm: torch.fx.GraphModule, drop: Sequence[str] = ()) -> bytes:
    """The split module pickled without node metadata (unpicklable, unread) and
    without the pieces in ``drop`` (saved as artifacts of their own)."""
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
    """The first constant guard ``(source, value)`` that ``model(*args)`` no longer
    meets or that cannot be read without Dynamo, described; None when all hold."""
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


def entry_dir(cache_dir: str, key: str) -> str:
    return os.path.join(cache_dir, f"graph-{key}")


def save(cache_dir: str, key: str, saved: SavedCompile, artifacts: Sequence[Any]) -> None:
    """Write the artifacts, then the entry, atomically: a reader finds a whole entry or none."""
    directory = entry_dir(cache_dir, key)
    os.makedirs(directory, exist_ok=True)
    for i, artifact in enumerate(artifacts):
        artifact.save(path=_piece_path(directory, i), format="binary")
    write_atomically(os.path.join(directory, "entry.pkl"), pickle.dumps(saved))


def _piece_path(directory: str, index: int) -> str:
    return os.path.join(directory, f"piece_{index}.bin")


def load_entry(cache_dir: str, key: str) -> Optional[SavedCompile]:
    """The entry saved under ``key``, or None (none, stale or damaged: logged, never raised)."""
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
    """The Inductor pieces of ``saved``, or None (missing or damaged: logged, never raised)."""
    if not saved.num_artifacts:  # eager pieces: saved in the graph
        return []
    directory = entry_dir(cache_dir, key)
    try:
        from sgl_piecewise.internals import inductor  # imports Inductor (seconds)

        return [inductor.load_artifact(_piece_path(directory, i)) for i in range(saved.num_artifacts)]
    except Exception as exc:
        logger.warning("saved compile %s: expected loadable pieces, got %s; tracing afresh", directory, exc)
        return None
