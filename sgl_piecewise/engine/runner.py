"""``ModelRunner``: the KV pool, an attention backend and a model, driven step
by step (``runners/dispatch.py`` picks each step's path); ``generate`` runs
greedy decoding for a batch of token-id prompts.

The eager path calls ``model_forward(input_ids, positions)``, the model unless
replaced by a callable of the same signature (a ``torch.compile``d model),
with the token axis marked dynamic.
"""

from __future__ import annotations

import collections
import logging
import numbers
import time
from typing import Callable, Collection, Deque, List, NamedTuple, Optional, Sequence, Union

import torch
from tqdm.auto import tqdm

from sgl_piecewise.backends.base import AttentionBackend
from sgl_piecewise.backends.factory import backend_names, create_backend
from sgl_piecewise.backends.reference import ReferenceBackend
from sgl_piecewise.batch_checks import check_batch
from sgl_piecewise.checks import check_positive_int
from sgl_piecewise.distributed import prepare_communication, tensor_parallel
from sgl_piecewise.errors import InvalidInputError, InvalidTypeError, KVPoolExhaustedError
from sgl_piecewise.forward import ForwardBatch, ForwardMode
from sgl_piecewise.graphs.counters import counters
from sgl_piecewise.memory import KVPool, ReqToTokenPool, allocate_requests
from sgl_piecewise.runners.dispatch import CaptureReport, capture_graphs, check_policy, graph_step
from sgl_piecewise.runners.eager import run_model
from sgl_piecewise.runners.protocols import Graphs, StepGraphs, TokenGraphs
from sgl_piecewise.transfer import to_device

BackendFactory = Callable[[ReqToTokenPool, KVPool], AttentionBackend]
logger = logging.getLogger("sgl_piecewise")

AUTO_PROGRESS_MIN_STEPS = 128  # generate(progress=None) shows a bar from this many steps
# KV pool budget when neither num_slots nor kv_cache_gib is given.
DEFAULT_KV_FREE_FRACTION = 0.3  # of the CUDA device's free memory at construction
DEFAULT_CPU_KV_GIB = 1.0
STEP_STATS_MAXLEN = 4096  # step_stats keeps the most recent steps only


class StepStat(NamedTuple):
    """Wall time of one step (logits included), and its path: a ``forward_step``
    call, or in ``generate`` from reading the step before to reading this one."""

    mode: str
    batch_size: int
    num_tokens: int
    seconds: float
    path: str = "eager"  # whole_model, piecewise, breakable, eager or model_forward


class ModelRunner:
    """Own the pools, the backend and the model; run steps and greedy generation.

    ``model``: anything with ``config``, ``forward(input_ids, positions)`` and
    ``compute_logits``; the KV pool takes its parameters' dtype and device.
    ``max_context_len``: at most (and by default) ``max_position_embeddings``.
    KV pool size: ``num_slots``, or a budget ``kv_cache_gib`` (default
    ``DEFAULT_KV_FREE_FRACTION`` of a CUDA device's free memory,
    ``DEFAULT_CPU_KV_GIB`` on the CPU), capped at ``max_reqs * max_context_len``.
    ``graphs``: the graph policy (``runners.dispatch.POLICIES``), captured by
    ``capture_graphs()``; ``use_graphs`` installs graph runners built by hand.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_reqs: int = 8,
        max_context_len: Optional[int] = None,
        num_slots: Optional[int] = None,
        kv_cache_gib: Optional[float] = None,
        backend: Union[str, BackendFactory] = ReferenceBackend,
        debug_checks: bool = False,
        graphs: str = "none",
    ):
        self.graphs = check_policy(graphs)
        config = model.config
        if max_context_len is None:
            max_context_len = config.max_position_embeddings
        check_positive_int("max_context_len", max_context_len)
        if max_context_len > config.max_position_embeddings:
            raise InvalidInputError(
                f"max_context_len: expected at most the model's max_position_embeddings "
                f"({config.max_position_embeddings}), got {max_context_len}"
            )
        check_positive_int("max_reqs", max_reqs)
        param = next(model.parameters())
        self.model = model
        self.config = config
        self.device, self.dtype = param.device, param.dtype
        self.num_heads, self.num_kv_heads = attention_heads(model)
        num_slots = self._kv_slots(num_slots, kv_cache_gib, max_reqs, max_context_len)
        self.req_to_token_pool = ReqToTokenPool(max_reqs, max_context_len, self.device)
        self.kv_pool = KVPool(
            num_slots,
            config.num_hidden_layers,
            self.num_kv_heads,
            config.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self.backend = _make_backend(backend, self.num_heads, self.req_to_token_pool, self.kv_pool)
        self.debug_checks = bool(debug_checks)
        self.model_forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = model
        self._step_graphs: Optional[StepGraphs] = None
        self._token_graphs: Optional[TokenGraphs] = None
        self.step_stats: Deque[StepStat] = collections.deque(maxlen=STEP_STATS_MAXLEN)

    @property
    def max_context_len(self) -> int:
        return self.req_to_token_pool.max_context_len

    @property
    def step_graphs(self) -> Optional[StepGraphs]:
        """The whole-model graphs every step asks first, or None (see ``use_graphs``)."""
        return self._step_graphs

    @property
    def token_graphs(self) -> Optional[TokenGraphs]:
        """The piecewise or breakable graphs, or None (see ``use_graphs``)."""
        return self._token_graphs

    def use_graphs(self, graphs: Graphs, *, progress: bool = True) -> Graphs:
        """Capture ``graphs`` (unless captured already) and serve later steps from
        them, in place of the graphs of their kind; return them.

        ``graphs``: a runner built for this ModelRunner, whole-model (``axis``
        "batch", becomes ``step_graphs``) or token-axis (piecewise or breakable,
        ``axis`` "tokens", becomes ``token_graphs``). A capture that raises
        installs nothing.
        """
        axis = getattr(graphs, "axis", None)
        if axis not in ("batch", "tokens"):
            raise InvalidInputError(
                f"graphs: expected a graph runner (CudaGraphRunner, PiecewiseCudaGraphRunner or "
                f"BreakableCudaGraphRunner), got {type(graphs).__name__}"
            )
        if graphs.model_runner is not self:
            raise InvalidInputError(
                f"graphs: expected a {type(graphs).__name__} built for this ModelRunner, got one built for another"
            )
        if not graphs.captured:
            graphs.capture(progress=progress)
        if axis == "batch":
            self._step_graphs = graphs
        else:
            self._token_graphs = graphs
        return graphs

    @property
    def kv_bytes_per_slot(self) -> int:
        """K and V of one token over every layer (this rank's KV heads)."""
        c = self.config
        return 2 * c.num_hidden_layers * self.num_kv_heads * c.head_dim * self.dtype.itemsize

    def _kv_slots(self, num_slots: Optional[int], kv_cache_gib: Optional[float], max_reqs: int, context: int) -> int:
        """The KV pool's slot count: given, or what the memory budget holds."""
        if num_slots is not None:
            if kv_cache_gib is not None:
                raise InvalidInputError(f"expected num_slots or kv_cache_gib, got both ({num_slots}, {kv_cache_gib})")
            check_positive_int("num_slots", num_slots)
            every = tensor_parallel().all_gather_object(num_slots)
            if any(n != num_slots for n in every):
                raise InvalidInputError(
                    f"num_slots: expected the same count on every tensor-parallel rank, got {every}"
                )
            return num_slots
        budget, source = self._kv_budget(kv_cache_gib)
        full = max_reqs * context
        # Every tensor-parallel rank allocates the same slots: the least any rank's memory allows.
        slots = min(tensor_parallel().all_gather_object(min(full, int(budget // self.kv_bytes_per_slot))))
        if slots < 1:
            raise InvalidInputError(
                f"KV budget: expected room for at least one token ({self.kv_bytes_per_slot} bytes), "
                f"got {budget / 2**30:.3g} GiB ({source})"
            )
        logger.info(
            "KV pool: %d slots, %.2f GiB (budget: %s; %d requests at %d tokens would need %d slots)",
            slots,
            slots * self.kv_bytes_per_slot / 2**30,
            source,
            max_reqs,
            context,
            full,
        )
        return slots

    def _kv_budget(self, kv_cache_gib: Optional[float]) -> tuple[float, str]:
        """``(bytes, where the figure comes from)``."""
        if kv_cache_gib is not None:
            if isinstance(kv_cache_gib, bool) or not isinstance(kv_cache_gib, (int, float)) or not kv_cache_gib > 0:
                raise InvalidInputError(f"kv_cache_gib: expected a positive number, got {kv_cache_gib!r}")
            return kv_cache_gib * 2**30, f"kv_cache_gib={kv_cache_gib}"
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return free * DEFAULT_KV_FREE_FRACTION, f"{DEFAULT_KV_FREE_FRACTION:.0%} of the {free / 2**30:.1f} GiB free"
        return DEFAULT_CPU_KV_GIB * 2**30, f"default {DEFAULT_CPU_KV_GIB} GiB on {self.device.type}"

    def capture_graphs(
        self,
        progress: bool = True,
        *,
        capture_bs: Optional[Sequence[int]] = None,
        capture_sizes: Optional[Sequence[int]] = None,
        piece_compiler: str = "inductor",
    ) -> CaptureReport:
        """Capture the graphs the policy needs; say what was built.

        ``capture_bs``: whole-model batch sizes (default:
        ``runners.whole_model.default_capture_bs``); ``capture_sizes``: token
        counts of the piecewise or breakable graphs.
        """
        # Symmetric memory for small all-reduces, which a capture cannot allocate.
        tokens = self.req_to_token_pool.max_reqs * self.max_context_len
        prepare_communication(tokens, self.config.hidden_size, self.dtype, self.device)
        return capture_graphs(
            self, progress=progress, capture_bs=capture_bs, capture_sizes=capture_sizes, piece_compiler=piece_compiler
        )

    @torch.no_grad()
    def forward_step(self, batch: ForwardBatch, *, every_token: bool = False) -> torch.Tensor:
        """Run one step; ``[bs, vocab]`` float32 logits of each request's last new
        token, or with ``every_token`` ``[num_tokens, vocab]`` of every real token."""
        start = time.perf_counter()
        logits, path = self._queue_step(batch, every_token)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # wall time of the work, not of the launches
        self._record_step(batch, path, time.perf_counter() - start)
        return logits

    @torch.no_grad()
    def _queue_step(self, batch: ForwardBatch, every_token: bool = False) -> tuple[torch.Tensor, str]:
        """Check ``batch`` and queue its step on the device; its logits (not
        waited for) and its path."""
        check_batch(batch, self.req_to_token_pool, self.kv_pool, debug_checks=self.debug_checks)
        hidden, path, why = graph_step(self, batch)
        if hidden is None:
            path = "eager" if self.model_forward is self.model else "model_forward"
            hidden = self.run_model(self.model_forward, batch)
        counters.step_paths[(path, why)] += 1
        logits = (
            self.model.compute_logits(hidden[: batch.num_tokens])
            if every_token
            else self.last_token_logits(hidden, batch)
        )
        return logits, path

    def _record_step(self, batch: ForwardBatch, path: str, seconds: float) -> None:
        mode = batch.forward_mode.name
        self.step_stats.append(StepStat(mode, batch.batch_size, batch.num_tokens, seconds, path))

    def run_model(
        self, forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], batch: ForwardBatch
    ) -> torch.Tensor:
        """Hidden states ``[num_tokens, H]`` of ``forward`` on ``batch``'s real
        tokens with eager attention metadata."""
        return run_model(forward, batch, self.backend, self.debug_checks)

    def last_token_logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """``[bs, vocab]`` logits of each request's last new token from ``hidden [T, H]``
        (in DRAFT_EXTEND_V2 with ``accept_lengths``, its last accepted one)."""
        lens, spec = batch.extend_seq_lens_cpu, batch.spec_info
        uniform = lens and lens[0] > 0 and lens.count(lens[0]) == len(lens) and lens[0] * len(lens) == hidden.shape[0]
        if uniform and not (batch.forward_mode.is_draft_extend_v2() and spec is not None):
            # As many new rows per request: a strided view, no index built on the device.
            return self.model.compute_logits(hidden[lens[0] - 1 :: lens[0]])
        new = batch.extend_seq_lens.to(torch.int64)
        ends = torch.cumsum(new, dim=0)  # [bs]
        if batch.forward_mode.is_draft_extend_v2() and spec is not None and spec.accept_lengths is not None:
            last = ends - new + spec.accept_lengths.to(ends) - 1
        else:
            last = ends - 1
        return self.model.compute_logits(hidden[last])

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        progress: Optional[bool] = None,
        *,
        eos_token_ids: Collection[int] = (),
    ) -> List[List[int]]:
        """Greedy-decode up to ``max_new_tokens`` tokens for each prompt; return the new tokens.

        A request finishes at ``max_new_tokens`` or at one of ``eos_token_ids``
        (kept as its last token). Room for the whole run is checked first;
        everything is freed by the end, on error too.

        Each step is queued before the tokens of the one before it are read, so
        the host prepares a step while the device runs the last (as SGLang's
        overlap scheduler): a request that reaches its EOS rides along one more
        step, whose token is dropped, and its row and slots are freed as its
        EOS is read. ``step_stats`` times each step from the last one's tokens to its own.
        """
        prompts = self._check_prompts(prompts)
        check_positive_int("max_new_tokens", max_new_tokens)
        eos = self._check_eos(eos_token_ids)
        self._check_room(prompts, max_new_tokens)
        run = _Requests(self, [len(p) for p in prompts], max_new_tokens, eos)
        show = max_new_tokens >= AUTO_PROGRESS_MIN_STEPS if progress is None else progress
        # A backend that cannot prepare a step while another runs has each step read first.
        ahead = self.backend.prepares_ahead
        try:
            ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64)
            (ids,) = to_device((ids,), self.device)
            step = self._queue_greedy(run.prefill(ids), list(range(len(prompts))))
            with tqdm(total=max_new_tokens - 1, desc="decode", disable=not show) as bar:
                while step is not None:
                    if not ahead:
                        run.read(step)
                    going = run.going(step.requests)
                    after = self._queue_greedy(run.decode(going, step.next_ids(going)), going) if going else None
                    if ahead:
                        run.read(step)
                    bar.update(after is not None)
                    step = after
            return run.out
        finally:
            run.free_all()

    def _queue_greedy(self, batch: ForwardBatch, requests: List[int]) -> "_QueuedStep":
        """Queue ``batch``'s step and its greedy tokens' way to the host."""
        logits, path = self._queue_step(batch)
        return _QueuedStep(batch, path, requests, logits.argmax(dim=-1))

    def _check_eos(self, eos_token_ids: Collection[int]) -> frozenset:
        vocab = self.config.vocab_size
        if isinstance(eos_token_ids, (str, bytes)) or not isinstance(eos_token_ids, Collection):
            raise InvalidTypeError(f"eos_token_ids: expected a collection of int token ids, got {eos_token_ids!r}")
        for t in eos_token_ids:
            if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab:
                raise InvalidInputError(f"eos_token_ids: expected token ids in [0, {vocab}), got {t!r}")
        return frozenset(int(t) for t in eos_token_ids)

    def _alloc_decode_slots(self, rows: torch.Tensor, positions: List[int]) -> torch.Tensor:
        """One fresh slot per request (host), recorded at its new token's position."""
        loc = self.kv_pool.alloc(len(positions))  # [bs]
        try:
            self.req_to_token_pool.write_next(rows, positions, loc)
        except BaseException:
            self.kv_pool.free(loc)
            raise
        return loc

    def _check_prompts(self, prompts: Sequence[Sequence[int]]) -> List[List[int]]:
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise InvalidTypeError(f"prompts: expected a list of lists of token ids, got {type(prompts).__name__}")
        if not prompts:
            raise InvalidInputError("prompts: expected at least one prompt, got an empty list")
        vocab = self.config.vocab_size
        checked = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
                raise InvalidTypeError(f"prompts[{i}]: expected a list of int token ids, got {type(prompt).__name__}")
            if not prompt:
                raise InvalidInputError(f"prompts[{i}]: expected at least one token, got an empty prompt")
            for t in prompt:
                if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                    raise InvalidTypeError(f"prompts[{i}]: expected int token ids, got {t!r} ({type(t).__name__})")
                if not 0 <= t < vocab:
                    raise InvalidInputError(f"prompts[{i}]: expected token ids in [0, {vocab}), got {t}")
            checked.append([int(t) for t in prompt])
        return checked

    def _check_room(self, prompts: List[List[int]], max_new_tokens: int) -> None:
        """Everything that could fail mid-run, checked before any allocation."""
        for i, prompt in enumerate(prompts):
            if len(prompt) + max_new_tokens > self.max_context_len:
                raise InvalidInputError(
                    f"prompts[{i}]: expected prompt + max_new_tokens <= max_context_len "
                    f"({self.max_context_len}), got {len(prompt)} + {max_new_tokens}; "
                    f"shorten the prompt or ask for fewer tokens"
                )
        if len(prompts) > self.req_to_token_pool.available:
            raise KVPoolExhaustedError(
                f"request table: expected room for {len(prompts)} requests, got "
                f"{self.req_to_token_pool.available} free; pass fewer prompts or a larger max_reqs"
            )
        # The last generated token is never fed back, so it needs no KV slot.
        needed = sum(len(p) + max_new_tokens - 1 for p in prompts)
        if needed > self.kv_pool.available:
            raise KVPoolExhaustedError(
                f"KV pool exhausted: expected {needed} free slots for this run, got "
                f"{self.kv_pool.available} of {self.kv_pool.num_slots}; pass fewer or shorter "
                f"prompts, fewer new tokens, or a larger num_slots"
            )


def attention_heads(model: torch.nn.Module) -> tuple[int, int]:
    """``(query heads, KV heads)`` this process holds: a sharded model's local ones, else all."""
    config = model.config
    return (
        getattr(model, "num_local_heads", config.num_attention_heads),
        getattr(model, "num_local_kv_heads", config.num_key_value_heads),
    )


def _make_backend(backend, num_heads: int, req_pool: ReqToTokenPool, kv_pool: KVPool) -> AttentionBackend:
    if isinstance(backend, str):
        if backend not in backend_names():
            raise InvalidInputError(f"backend: expected one of {list(backend_names())} or a factory, got {backend!r}")
        return create_backend(backend, req_pool, kv_pool, num_q_heads=num_heads)
    if not callable(backend):
        raise InvalidTypeError(
            f"backend: expected a backend name or a factory (req_to_token_pool, kv_pool) -> backend, "
            f"got {type(backend).__name__}"
        )
    built = backend(req_pool, kv_pool)
    if not isinstance(built, AttentionBackend):
        raise InvalidTypeError(f"backend factory: expected an AttentionBackend, got {type(built).__name__}")
    return built


class _QueuedStep:
    """A greedy step queued on the device: its requests in batch order, their
    next tokens on the device and, once the step has run, on the host."""

    def __init__(self, batch: ForwardBatch, path: str, requests: List[int], next_ids: torch.Tensor):
        self.batch, self.path, self.requests = batch, path, requests
        self._next_ids = next_ids  # [bs] int64
        self._ready: Optional[torch.cuda.Event] = None
        if next_ids.device.type == "cuda":
            # Pinned, so the copy waits for nothing the host does; read once _ready has passed.
            self._host = torch.empty(next_ids.shape, dtype=next_ids.dtype, pin_memory=True)
            self._host.copy_(next_ids, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = next_ids
        self._tokens: Optional[List[int]] = None

    def next_ids(self, requests: List[int]) -> torch.Tensor:
        """The device's next tokens of ``requests``, a subsequence of this step's."""
        if requests == self.requests:
            return self._next_ids
        rows = {r: i for i, r in enumerate(self.requests)}
        (index,) = to_device((torch.tensor([rows[r] for r in requests], dtype=torch.int64),), self._next_ids.device)
        return self._next_ids[index]

    def tokens(self) -> List[int]:
        """This step's next tokens on the host, waiting for the step if it has not run yet."""
        if self._tokens is None:
            if self._ready is not None:
                self._ready.synchronize()
            self._tokens = self._host.tolist()
        return self._tokens


class _Requests:
    """The requests of one ``generate`` run: rows and KV slots, freed as each finishes."""

    def __init__(self, runner: ModelRunner, prompt_lens: List[int], max_new_tokens: int, eos: frozenset):
        self.runner = runner
        self.prompt_lens = prompt_lens
        self.max_new_tokens = max_new_tokens
        self.eos = eos
        self.out: List[List[int]] = [[] for _ in prompt_lens]  # each request's new tokens
        self._last_read = time.perf_counter()
        self.rows: List[int] = []
        self.slots: List[List[torch.Tensor]] = [[] for _ in prompt_lens]
        self.queued = [0] * len(prompt_lens)  # steps queued for each request: tokens made or coming
        self.done = [False] * len(prompt_lens)

    def prefill(self, ids: torch.Tensor) -> ForwardBatch:
        bs, lens = len(self.prompt_lens), self.prompt_lens
        rows, loc = allocate_requests(self.runner.req_to_token_pool, self.runner.kv_pool, [0] * bs, lens)
        self.rows = rows.tolist()
        for i, part in enumerate(torch.split(loc, lens)):
            self.slots[i].append(part)
            self.queued[i] = 1
        return ForwardBatch.build(ForwardMode.EXTEND, ids, rows, [0] * bs, lens, loc)

    def going(self, requests: List[int]) -> List[int]:
        """Those of ``requests`` that get another step: not finished as far as
        the host knows (an EOS still on its way is not), and short of ``max_new_tokens``."""
        return [i for i in requests if not self.done[i] and self.queued[i] < self.max_new_tokens]

    def decode(self, requests: List[int], next_ids: torch.Tensor) -> ForwardBatch:
        prefix = [self.prompt_lens[i] + self.queued[i] - 1 for i in requests]  # tokens cached
        rows = torch.tensor([self.rows[i] for i in requests], dtype=torch.int64)
        loc = self.runner._alloc_decode_slots(rows, prefix)
        for j, i in enumerate(requests):
            self.slots[i].append(loc[j : j + 1])
            self.queued[i] += 1
        return ForwardBatch.build(ForwardMode.DECODE, next_ids, rows, prefix, [1] * len(prefix), loc)

    def read(self, step: _QueuedStep) -> None:
        """Take ``step``'s tokens, waiting for it if need be; its ``StepStat``
        times it from the step read before it."""
        tokens = step.tokens()
        now = time.perf_counter()
        self.runner._record_step(step.batch, step.path, now - self._last_read)
        self._last_read = now
        self.take(step.requests, tokens)

    def take(self, requests: List[int], tokens: List[int]) -> None:
        """Append each unfinished request's new token; free those it finishes.
        A finished request's token (its ride-along step) is dropped."""
        for i, t in zip(requests, tokens):
            if self.done[i]:
                continue
            self.out[i].append(t)
            if t in self.eos or len(self.out[i]) == self.max_new_tokens:
                self.done[i] = True
                self._free(i)

    def _free(self, i: int) -> None:
        # A step still queued may write this request's slots: any later user of
        # them is queued after it, so the device's order keeps them apart.
        if self.slots[i]:
            self.runner.kv_pool.free(torch.cat(self.slots[i]))
            self.slots[i] = []
        if i < len(self.rows) and self.rows[i] >= 0:
            self.runner.req_to_token_pool.free([self.rows[i]])
            self.rows[i] = -1

    def free_all(self) -> None:
        for i in range(len(self.prompt_lens)):
            self._free(i)
