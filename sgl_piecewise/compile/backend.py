"""The ``sgl_piecewise`` Dynamo backend: splits the graph around attention
(``split.py``), compiles each piece (``piece_compiler.py``) and, with CUDA
graphs on, pads each call to a capture size and replays per-piece graphs
(``piece_graphs.py``); docs/ARCHITECTURE.md, "Compile"."""

from __future__ import annotations

import contextlib
import logging
import operator
import pickle
from dataclasses import replace
from typing import Any, Dict, Iterator, Mapping, Optional, Sequence, Set, Tuple, Union

import torch
import torch.fx

from sgl_piecewise.compile import artifacts, precompiled
from sgl_piecewise.compile.direct_call import GraphInputs, describe_inputs
from sgl_piecewise.compile.options import CompileOptions
from sgl_piecewise.compile.piece_compiler import PieceCompiler
from sgl_piecewise.compile.piece_graphs import Phase, PieceGraphs, StaticInputsMoved, StepState, pointer_getter
from sgl_piecewise.compile.split import bypass_dispatcher, split_graph, split_items, to_out_variant
from sgl_piecewise.compile.stacked_linears import stack_linears
from sgl_piecewise.compile.token_axis import TokenAxis, find_token_axis
from sgl_piecewise.compile.token_guards import TokenShapeGuards
from sgl_piecewise.errors import InvalidInputError, StaleGraphError
from sgl_piecewise.graphs.buffer_registry import (
    CudaGraphBufferRegistry,
    FillContext,
    PaddingPolicy,
)
from sgl_piecewise.graphs.capture import frozen_gc, shared_capture
from sgl_piecewise.graphs.counters import counters
from sgl_piecewise.internals import dynamo_backend

logger = logging.getLogger("sgl_piecewise.compile")


def sgl_piecewise_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    mode: Optional[str] = None,
    options: Optional[Mapping[str, Any]] = None,
):
    """The function ``torch.compile`` finds under the name ``sgl_piecewise``."""
    return SglPiecewiseBackend(CompileOptions.from_compile_args(mode, options))(gm, example_inputs)


class SglPiecewiseBackend:
    """A configured backend: ``torch.compile`` refuses ``mode`` and ``options`` at once."""

    def __init__(
        self,
        options: Optional[CompileOptions] = None,
        *,
        token_guards: Optional[TokenShapeGuards] = None,
        **kwargs: Any,
    ):
        if options is not None and kwargs:
            raise InvalidInputError(f"expected CompileOptions or keyword options, got both ({sorted(kwargs)})")
        self.options = options or CompileOptions.from_compile_args(None, kwargs)
        self.modules: list = []  # every PiecewiseModule built, for inspection
        self.token_guards = token_guards  # told of each compile's inputs (CompiledModel's guard filter)
        self._call: Optional[Tuple[torch.nn.Module, tuple]] = None  # see calling()

    @contextlib.contextmanager
    def calling(self, model: torch.nn.Module, args: tuple) -> Iterator[None]:
        """A call of ``model`` on ``args`` that may compile: a piecewise module
        compiled inside it keeps them, to be called without Dynamo later."""
        self._call = (model, args)
        try:
            yield
        finally:
            self._call = None

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        if self.token_guards is not None:
            self.token_guards.begin_compile(*_fake_inputs(list(example_inputs)))
        stack_linears(gm, example_inputs)
        if not self.options.split_graph:
            return compile_whole(gm, list(example_inputs), self.options)
        module = PiecewiseModule.compile(gm, list(example_inputs), self.options, self._call)
        self.modules.append(module)
        return module


def compile_whole(gm: torch.fx.GraphModule, example_inputs: list, options: CompileOptions) -> Any:
    """The graph compiled in one piece, attention an opaque op inside it, for
    a graph runner to record whole (``CompileOptions(split_graph=False)``)."""
    fake_mode, fake = _fake_inputs(example_inputs)
    with reused_artifacts(gm, fake, options, _device(example_inputs)), fake_mode:
        return PieceCompiler(options.piece_compiler, share_identical=False)(gm, fake)


@contextlib.contextmanager
def reused_artifacts(gm: torch.fx.GraphModule, fake: list, options: CompileOptions, device: torch.device):
    """With ``options.cache_dir``: load this graph's artifacts, or save them after compiling."""
    if options.cache_dir is None:
        yield
        return
    key = artifacts.artifact_key(artifacts.graph_key(gm, fake), replace(options, cache_dir=None), device)
    loaded = artifacts.load_artifacts(options.cache_dir, key)
    yield
    if not loaded:
        artifacts.save_artifacts(options.cache_dir, key)


def _device(example_inputs: Sequence[Any]) -> torch.device:
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


def _fake_inputs(example_inputs: list):
    """Dynamo's fake mode and the inputs in it: converting the real inputs
    returns the fakes Dynamo memoised, symbolic dims included."""
    mode = dynamo_backend.detect_fake_mode()
    return mode, [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]


def _returns_tuple(gm: torch.fx.GraphModule) -> bool:
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    return isinstance(output.args[0], (tuple, list))


def _single_output(loaded: Any) -> Any:
    """A loaded artifact returns a list even where its piece returns one value."""

    def single(*args):
        out = loaded(*args)
        return out[0] if isinstance(out, (list, tuple)) else out

    return single


def _tensor_spec(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.dtype, t.device


def _piece_static_args(split_gm: torch.fx.GraphModule, name: str) -> list:
    """Per argument of piece ``name``: does it come straight from a graph input?"""
    (call,) = [n for n in split_gm.graph.nodes if n.op == "call_module" and n.target == name]
    return [isinstance(a, torch.fx.Node) and a.op == "placeholder" for a in call.args]


def _install_piece(split_gm: torch.fx.GraphModule, piece: Any, compiled: Any, state: StepState) -> None:
    """Make the split module call ``compiled``, or a splitting piece's own code."""
    # Into __dict__: the split module's self.<name>(...) then skips nn.Module's call machinery.
    if piece.is_splitting_op:
        bypass_dispatcher(piece.graph)
        split_gm.__dict__[piece.name] = piece.graph.forward
    else:
        split_gm.__dict__[piece.name] = PieceGraphs(
            piece.name, compiled, state, _piece_static_args(split_gm, piece.name)
        )


def _one_producer_each(split_gm: torch.fx.GraphModule) -> bool:
    """Does every piece read the outputs of at most one other piece?"""
    for node in split_gm.graph.nodes:
        if node.op != "call_module":
            continue
        producers = set()
        for arg in node.all_input_nodes:
            source = arg.args[0] if arg.op == "call_function" and arg.target is operator.getitem else arg
            if source.op == "call_module":
                producers.add(source)
        if len(producers) > 1:
            return False
    return True


class _CompilePieces(torch.fx.Interpreter):
    """Runs the split module on fake inputs, compiling each piece with the
    arguments it gets. A piece identical to an earlier one reuses its fake
    outputs, where no piece reads two pieces' outputs (shared fakes would
    look like one tensor to it)."""

    def __init__(self, split_gm, pieces, compiler, state):
        super().__init__(split_gm)
        self.pieces = {p.name: p for p in pieces}
        self.compiler = compiler
        self.state = state
        self.compiled: Dict[str, Any] = {}  # piece name -> what it was compiled to
        self._outputs: Dict[str, Any] = {}  # structural key -> that piece's fake outputs
        self._share_runs = _one_producer_each(split_gm)

    def call_module(self, target, args, kwargs):
        piece = self.pieces[target]
        key = None if piece.is_splitting_op else self.compiler.key(piece.graph, args)
        shared = key if self._share_runs else None
        if shared is not None and shared in self._outputs:
            result = self._outputs[shared]
        else:
            # Through the module call, so a splitting op reaches its fake
            # implementation; under Dynamo's Python dispatcher, as the trace ran:
            # a C++ composite (a 3-D float32 matmul on CUDA) would otherwise fix
            # the token count the trace left symbolic.
            with dynamo_backend.python_dispatcher():
                result = super().call_module(target, args, kwargs)
            if shared is not None:
                self._outputs[shared] = result
        if not piece.is_splitting_op:
            self.compiled[target] = self.compiler(piece.graph, args, key)
        _install_piece(self.module, piece, self.compiled.get(target), self.state)
        return result


class PiecewiseModule:
    """What the backend returns to Dynamo: the split, compiled, graphed model."""

    def __init__(
        self,
        split_gm,
        pieces,
        token_axis: TokenAxis,
        example_inputs: list,
        options: CompileOptions,
        static_specs: Optional[tuple] = None,
    ):
        self.options = options
        self.token_axis = token_axis
        self.split_gm, self.pieces = split_gm, pieces
        device = _device(example_inputs)
        self.state = StepState(use_cuda=device.type == "cuda", debug_checks=options.debug_checks)
        # Why graphs are off for this graph although they were asked for (None: they run).
        self.graphs_reason = self._graphs_unavailable_reason() if options.cudagraphs else None
        graphs = options.cudagraphs and self.graphs_reason is None
        self.registry = self._build_registry(example_inputs, device) if graphs else None
        # Graphs per set of weight addresses: docs/ARCHITECTURE.md, "Graph sets per weight addresses".
        tokens = set(self.token_axis.tensor_inputs)
        self.static_inputs = tuple(
            i for i, x in enumerate(example_inputs) if isinstance(x, torch.Tensor) and i not in tokens
        )
        # What the trace assumed of them: a new set is checked against it.
        self.static_specs = static_specs or tuple(_tensor_spec(example_inputs[i]) for i in self.static_inputs)
        self._static_pointers = pointer_getter(self.static_inputs)
        self.graph_sets: Dict[Tuple[int, ...], int] = {}
        self._last_graph_set: Optional[int] = None  # the graph set the last step ran on
        # Per token input: (argument index, its registry buffer).
        self._token_buffers = (
            [(i, self.registry.get_slot(f"input{i}").buffer) for i in self.token_axis.tensor_inputs]
            if self.registry is not None
            else []
        )
        self._padded_views: Dict[int, list] = {}
        self._fill_contexts: Dict[Tuple[int, int], FillContext] = {}  # (tokens, padded) -> its fill's sizes
        self._token_slots = [(f"input{i}", i) for i, _ in self._token_buffers]  # registry slot, argument index
        self._token_outputs = frozenset(self.token_axis.tensor_outputs)
        self.captured: Set[Tuple[int, int]] = set()  # (graph set, size)
        self.warmed_up = False
        if graphs and self.state.use_cuda:
            self.state.capture = shared_capture(device)
        # Set by ``compile``: how to call it without Dynamo (``direct_call.py``);
        # to_save: (SavedCompile, artifacts) for a later process.
        self.direct_inputs: Optional[GraphInputs] = None
        self.keep_outputs = False
        self.last_outputs: Optional[Sequence[Any]] = None
        self.to_save: Optional[tuple] = None

    @classmethod
    def compile(
        cls, gm: torch.fx.GraphModule, example_inputs: list, options: CompileOptions, call: Optional[tuple] = None
    ) -> "PiecewiseModule":
        """Split and compile Dynamo's graph; ``call``: the traced ``(model, args)``, if known."""
        counters.graphs_split += 1
        to_out_variant(gm)
        token_axis = find_token_axis(gm, example_inputs)
        split_gm, pieces = split_graph(gm)
        module = cls(split_gm, pieces, token_axis, example_inputs, options)
        direct = module._direct_inputs(example_inputs, call)
        if not isinstance(direct, str):
            module.direct_inputs, module.keep_outputs = direct, True
        elif call is not None:
            logger.info("graph not callable without Dynamo: %s", direct)
        saved = module._saved_compile(direct)
        device = _device(example_inputs)
        fake_mode, fake = _fake_inputs(example_inputs)
        keep = saved is not None
        compiler = PieceCompiler(options.piece_compiler, options.share_identical_pieces, keep_artifacts=keep)
        # A compile that is saved whole needs no separate Inductor artifacts.
        artifacts_ctx = contextlib.nullcontext() if saved else reused_artifacts(gm, fake, options, device)
        interpreter = _CompilePieces(split_gm, pieces, compiler, module.state)
        with artifacts_ctx, fake_mode:
            interpreter.run(*fake)
        if saved is not None:
            index = {id(a): i for i, a in enumerate(compiler.artifacts)}
            saved.pieces = {name: index[id(c)] for name, c in interpreter.compiled.items() if id(c) in index}
            saved.num_artifacts = len(compiler.artifacts)
            module.to_save = (saved, compiler.artifacts)
        return module

    @classmethod
    def from_saved(
        cls, saved: "precompiled.SavedCompile", artifacts: list, inputs: list, options: CompileOptions
    ) -> "PiecewiseModule":
        """The module a former process saved; ``inputs``: this call's graph inputs."""
        split_gm = pickle.loads(saved.graph)
        pieces = split_items(split_gm, set(saved.splitting))
        module = cls(split_gm, pieces, saved.token_axis, inputs, options, saved.static_specs)
        for piece in pieces:
            if piece.is_splitting_op:
                compiled = None
            elif options.piece_compiler == "eager":
                compiled = piece.graph
            else:
                artifact = artifacts[saved.pieces[piece.name]]
                compiled = artifact if saved.returns_tuple[piece.name] else _single_output(artifact)
            _install_piece(split_gm, piece, compiled, module.state)
        return module

    def _direct_inputs(self, example_inputs: list, call: Optional[tuple]) -> Union[GraphInputs, str]:
        """Where each graph input comes from in ``call``, or why Dynamo must stay."""
        if call is None:
            return "the call that traced it is unknown"
        model, args = call
        inputs = describe_inputs(example_inputs, model, args, self.token_axis)  # or why not
        reasons = (
            self.registry is None and f"graphs are off ({self.graphs_reason or 'cudagraphs=False'})",
            isinstance(inputs, str) and inputs,
            precompiled.side_effects(),
        )
        return next((r for r in reasons if r), inputs)

    def _saved_compile(self, direct: Union[GraphInputs, str]):
        """With ``options.cache_dir``, a SavedCompile to fill in as the pieces compile, or None."""
        if self.options.cache_dir is None:
            return None
        sources = precompiled.traced_sources()  # or why not
        reasons = (
            isinstance(direct, str) and direct,
            self.options.piece_compiler == "tensorrt" and "the tensorrt piece compiler makes no saveable artifacts",
            isinstance(sources, str) and sources,
        )
        reason = next((r for r in reasons if r), None)
        if reason is not None:
            logger.info("compile not saved for a start without Dynamo: %s", reason)
            return None
        compiled = [p for p in self.pieces if not p.is_splitting_op]
        # Inductor's pieces are saved as artifacts of their own; eager ones are their graphs.
        artifacts = [p.name for p in compiled] if self.options.piece_compiler == "inductor" else []
        return precompiled.SavedCompile(
            graph=precompiled.pickled_split(self.split_gm, drop=artifacts),
            splitting=tuple(p.name for p in self.pieces if p.is_splitting_op),
            returns_tuple={p.name: _returns_tuple(p.graph) for p in compiled},
            inputs=direct,
            token_axis=self.token_axis,
            static_specs=self.static_specs,
            pieces={},
            num_artifacts=0,
            sources=sources,
        )

    # ---- set-up -----------------------------------------------------------
    def _graphs_unavailable_reason(self) -> Optional[str]:
        if self.token_axis.unsupported:
            logger.warning("CUDA graphs off for this graph: %s", self.token_axis.unsupported)
            return f"unsupported dynamic shape: {self.token_axis.unsupported}"
        if not self.token_axis.tensor_inputs:
            return "no input has a token axis"
        return None

    def _build_registry(self, example_inputs: list, device: torch.device) -> CudaGraphBufferRegistry:
        max_tokens = max(self.options.capture_sizes)
        registry = CudaGraphBufferRegistry(max_bs=1, max_num_tokens=max_tokens, device=device)
        for i in self.token_axis.tensor_inputs:
            x = example_inputs[i]
            rest = tuple(x.shape[1:])
            # Padded rows compute on zeros: in range for every embedding and rope table.
            registry.register_slot(
                f"input{i}",
                lambda bs, nt, rest=rest: (nt, *rest),
                x.dtype,
                "tokens",
                padding_policy=PaddingPolicy.ZERO,
            )
        return registry

    # ---- run --------------------------------------------------------------
    def __call__(self, *args: Any) -> Any:
        out = self._forward(args)
        if self.keep_outputs:
            self.last_outputs = out
        return out

    def _forward(self, args: tuple) -> Any:
        if not self.options.cudagraphs:
            return self._run(Phase.RUN, args)
        if self.graphs_reason is not None:
            counters.fallback(self.graphs_reason)
            return self._run(Phase.RUN, args)
        n = self._num_tokens(args)
        padded = self.options.padded_size(n)
        if padded is None:
            counters.fallback(f"{n} tokens: above the largest capture size {max(self.options.capture_sizes)}")
            return self._run(Phase.RUN, args)
        padded_args = self._pad(args, n, padded)
        self.state.num_tokens, self.state.padded_tokens = n, padded
        # Guess the last step's graph set; each piece checks its own weights before its replay.
        guess = self._last_graph_set
        if guess is not None and (guess, padded) in self.captured:
            self._select(guess, padded)
            try:
                return self._unpad(self._run(Phase.REPLAY, padded_args), n)
            except StaticInputsMoved:
                # A weight moved: run the step again on the graph set of these addresses.
                counters.steps_rerun += 1
        graph_set = self._last_graph_set = self._graph_set(args)
        self._select(graph_set, padded)
        if self.state.replay_key in self.captured:
            out = self._run(Phase.REPLAY, padded_args)
        else:
            out = self._warmup_and_capture(padded_args)
        return self._unpad(out, n)

    def _select(self, graph_set: int, padded: int) -> None:
        self.state.graph_set, self.state.replay_key = graph_set, (graph_set, padded)

    def _graph_set(self, args) -> int:
        """The graph set of these static-input (weight) addresses."""
        key = self._static_pointers(args)
        graph_set = self.graph_sets.get(key)
        if graph_set is None:
            self._check_static_inputs(args)
            graph_set = self.graph_sets[key] = len(self.graph_sets)
            if graph_set:
                logger.info(
                    "static graph inputs (weights) at new addresses: capturing graph set %d for them", graph_set
                )
        return graph_set

    def _check_static_inputs(self, args) -> None:
        """Weights at new addresses must match the trace (a call without Dynamo relies on this)."""
        for i, spec in zip(self.static_inputs, self.static_specs):
            if _tensor_spec(args[i]) != spec:
                raise StaleGraphError(
                    f"graph input {i}: expected a tensor of (shape, stride, dtype, device) {spec} as traced, "
                    f"got {_tensor_spec(args[i])}"
                )

    def _run(self, phase: Phase, args) -> Any:
        self.state.phase = phase
        try:
            return self.split_gm.forward(*args)
        finally:
            self.state.phase = Phase.RUN

    def _warmup_and_capture(self, padded_args) -> Any:
        # One warm-up per module: the kernels are the same for every token count.
        if not self.warmed_up:
            capture = self.state.capture
            if capture is not None:
                capture.warmup(lambda: self._run(Phase.WARMUP, padded_args))
            else:
                self._run(Phase.WARMUP, padded_args)
            self.warmed_up = True
        with frozen_gc():
            out = self._run(Phase.CAPTURE, padded_args)
        self.captured.add(self.state.replay_key)
        return out

    def _num_tokens(self, args) -> int:
        counts = {args[i].shape[0] for i in self.token_axis.tensor_inputs}
        if len(counts) != 1:
            inputs = list(self.token_axis.tensor_inputs)
            raise InvalidInputError(f"token-axis inputs {inputs}: expected one token count, got {sorted(counts)}")
        return counts.pop()

    def _pad(self, args, n: int, padded: int) -> list:
        """The call's arguments, each token input copied into its static buffer
        and padded with zeros to ``padded`` rows by the registry's fill."""
        padded_args = list(args)
        ctx = self._fill_contexts.get((n, padded))
        if ctx is None:  # at most one per token count up to the largest capture size
            ctx = self._fill_contexts[(n, padded)] = FillContext(0, 0, n, padded)
        self.registry.fill_from({name: args[i] for name, i in self._token_slots}, ctx)
        views = self._padded_views.get(padded)
        if views is None:
            views = self._padded_views[padded] = [buf[:padded] for _, buf in self._token_buffers]
        for (i, _), view in zip(self._token_buffers, views):
            padded_args[i] = view
        for i in self.token_axis.symint_inputs:
            padded_args[i] = padded
        return padded_args

    def _unpad(self, out: Any, n: int) -> Any:
        """Real rows only, copied out of the pool the next replay overwrites."""
        token_outputs = self._token_outputs
        values = out if isinstance(out, (tuple, list)) else (out,)
        result = [
            (v[:n] if i in token_outputs else v).clone() if isinstance(v, torch.Tensor) else v
            for i, v in enumerate(values)
        ]
        return type(out)(result) if isinstance(out, (tuple, list)) else result[0]
