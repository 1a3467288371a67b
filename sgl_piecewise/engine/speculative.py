"""Greedy speculative decoding: the target's greedy output (exact in float32)
in fewer target steps. Per request, with ``x`` the newest output token at
position ``p`` (the target holds K/V below ``p``, the draft up to ``p``, and
the draft's first proposal ``d1`` is known), each round runs ``k - 1`` draft
DECODE steps for ``d2 .. dk``, one TARGET_VERIFY step over ``[x, d1 .. dk]``
scoring ``g0 .. gk``, keeps ``d1 .. dj, gj`` for the longest agreeing ``j``,
and one DRAFT_EXTEND_V2 step over those, padded to ``k + 1`` with ``gj``,
which gives the next ``d1``. Each model maps a window of ``k + 1`` fresh
slots per round and gives back the rejected ones. docs/ARCHITECTURE.md,
"Speculative decoding".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch
from tqdm.auto import tqdm

from sgl_piecewise.checks import check_positive_int
from sgl_piecewise.engine.runner import ModelRunner
from sgl_piecewise.errors import InvalidInputError, InvalidTypeError, KVPoolExhaustedError
from sgl_piecewise.forward import ForwardBatch, ForwardMode, SpecInfo
from sgl_piecewise.memory import allocate_requests


@dataclass
class SpeculativeStats:
    """Counts of one run; ``accepted`` counts before truncation at ``max_new_tokens``."""

    num_draft_tokens: int
    rounds: int = 0  # verify steps
    proposed: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


@dataclass
class SpeculativeOutput:
    tokens: List[List[int]]
    stats: SpeculativeStats


def speculative_generate(
    target: ModelRunner,
    draft: ModelRunner,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    num_draft_tokens: int,
    progress: Optional[bool] = None,
) -> SpeculativeOutput:
    """Greedy-decode ``max_new_tokens`` tokens per prompt with ``target``,
    ``num_draft_tokens`` proposed per round by ``draft`` (a ``ModelRunner`` of its
    own); inputs and room are checked before anything is allocated."""
    prompts = _check_inputs(target, draft, prompts, max_new_tokens, num_draft_tokens)
    run = _Run(target, draft, prompts, max_new_tokens, num_draft_tokens)
    try:
        return run.generate(progress)
    finally:
        run.release()


def _check_inputs(target, draft, prompts, max_new_tokens, k) -> List[List[int]]:
    if not isinstance(draft, ModelRunner):
        raise InvalidTypeError(f"draft: expected a ModelRunner over the draft model, got {type(draft).__name__}")
    if draft is target:
        raise InvalidInputError(
            "draft: expected a ModelRunner of its own (its own KV pool), got the target's runner; "
            "for the target as its own draft, build a second ModelRunner over the same model"
        )
    k = check_positive_int("num_draft_tokens", k)
    check_positive_int("max_new_tokens", max_new_tokens)
    if draft.config.vocab_size != target.config.vocab_size:
        raise InvalidInputError(
            f"draft: expected the target's vocabulary ({target.config.vocab_size} tokens), "
            f"got a draft of {draft.config.vocab_size}"
        )
    prompts = target._check_prompts(prompts)
    # The target writes up to p + k with p <= len + max_new - 2, the draft up to p + k + 1.
    for who, runner, extra in (("target", target, k - 1), ("draft", draft, k)):
        longest = max(len(p) for p in prompts)
        need = longest + max_new_tokens + extra
        if need > runner.max_context_len:
            raise InvalidInputError(
                f"{who}: expected max_context_len >= {need} (longest prompt {longest} + max_new_tokens "
                f"{max_new_tokens} + {extra} for the speculative window), got {runner.max_context_len}"
            )
        _check_room(who, runner, prompts, max_new_tokens + extra)
    return prompts


def _check_room(who: str, runner, prompts: List[List[int]], extra: int) -> None:
    if len(prompts) > runner.req_to_token_pool.available:
        raise KVPoolExhaustedError(
            f"{who} request table: expected room for {len(prompts)} requests, got "
            f"{runner.req_to_token_pool.available} free; pass fewer prompts or a larger max_reqs"
        )
    needed = sum(len(p) + extra for p in prompts)
    if needed > runner.kv_pool.available:
        raise KVPoolExhaustedError(
            f"{who} KV pool exhausted: expected {needed} free slots for this run, got "
            f"{runner.kv_pool.available} of {runner.kv_pool.num_slots}; pass fewer or shorter prompts, "
            f"fewer new or draft tokens, or a larger num_slots"
        )


def _agreeing_prefix(drafts: List[int], scores: List[int]) -> int:
    """The longest ``j`` with ``drafts[i] == scores[i]`` for every ``i < j``."""
    j = 0
    while j < len(drafts) and drafts[j] == scores[j]:
        j += 1
    return j


@dataclass
class _Requests:
    out: List[List[int]]
    pos: List[int]  # p
    first_draft: List[int] = field(default_factory=list)


class _Run:
    def __init__(self, target, draft, prompts: List[List[int]], max_new_tokens: int, k: int):
        self.target, self.draft, self.prompts = target, draft, prompts
        self.max_new_tokens, self.k, self.width = max_new_tokens, k, k + 1
        self.stats = SpeculativeStats(k)
        self.rows_target: Optional[torch.Tensor] = None
        self.rows_draft: Optional[torch.Tensor] = None

    def generate(self, progress: Optional[bool]) -> SpeculativeOutput:
        lens = [len(p) for p in self.prompts]
        bs = len(lens)
        self.rows_target, target_loc = allocate_requests(
            self.target.req_to_token_pool, self.target.kv_pool, [0] * bs, lens
        )
        self.rows_draft, draft_loc = allocate_requests(
            self.draft.req_to_token_pool, self.draft.kv_pool, [0] * bs, [n + 1 for n in lens]
        )
        first = self._prefill(self.target, self.rows_target, [list(p) for p in self.prompts], target_loc)
        reqs = _Requests(out=[[t] for t in first], pos=list(lens))
        active = [i for i in range(bs) if self.max_new_tokens > 1]
        if active:
            reqs.first_draft = self._prefill(
                self.draft, self.rows_draft, [p + [t] for p, t in zip(self.prompts, first)], draft_loc
            )
        show = self.max_new_tokens >= 128 if progress is None else progress
        with tqdm(total=bs * self.max_new_tokens, initial=bs, desc="speculative", unit="tok", disable=not show) as bar:
            while active:
                before = sum(len(o) for o in reqs.out)
                active = self._round(reqs, active)
                bar.update(sum(len(o) for o in reqs.out) - before)
        return SpeculativeOutput(reqs.out, self.stats)

    def _prefill(self, runner, rows: torch.Tensor, seqs: List[List[int]], loc: torch.Tensor) -> List[int]:
        """One EXTEND step over whole sequences; the greedy next token of each."""
        ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int64, device=runner.device)
        batch = ForwardBatch.build(ForwardMode.EXTEND, ids, rows, [0] * len(seqs), [len(s) for s in seqs], loc)
        return runner.forward_step(batch).argmax(dim=-1).tolist()

    def _round(self, reqs: _Requests, active: List[int]) -> List[int]:
        """Draft, verify, extend the draft; return the requests still unfinished."""
        k = self.k
        pos = [reqs.pos[i] for i in active]
        rows_t, rows_d = self.rows_target[active], self.rows_draft[active]
        window_t = self._map_window(self.target, rows_t, pos)  # positions p .. p+k
        window_d = self._map_window(self.draft, rows_d, [p + 1 for p in pos])  # p+1 .. p+k+1
        drafts = self._propose(rows_d, pos, window_d, [reqs.first_draft[i] for i in active])
        scores = self._verify(rows_t, pos, window_t, [reqs.out[i][-1] for i in active], drafts)
        accepted = [_agreeing_prefix(d, g[:k]) for d, g in zip(drafts, scores)]
        self.stats.rounds += 1
        self.stats.proposed += k * len(active)
        self.stats.accepted += sum(accepted)
        # The target keeps x, d1 .. dj (positions p .. p+j): give back p+j+1 .. p+k.
        self._unmap(self.target, rows_t, [p + j + 1 for p, j in zip(pos, accepted)], [k - j for j in accepted])
        going = []
        for n, (i, j) in enumerate(zip(active, accepted)):
            new = drafts[n][:j] + [scores[n][j]]
            reqs.out[i].extend(new[: self.max_new_tokens - len(reqs.out[i])])
            if len(reqs.out[i]) < self.max_new_tokens:
                going.append(n)
        if going:
            blocks = [drafts[n][: accepted[n]] + [scores[n][accepted[n]]] * (k - accepted[n] + 1) for n in going]
            self._extend_draft(
                reqs, [active[n] for n in going], rows_d[going], window_d[going], blocks, [accepted[n] for n in going]
            )
        return [active[n] for n in going]

    def _map_window(self, runner, rows: torch.Tensor, starts: List[int]) -> torch.Tensor:
        """``[b, k+1]`` fresh slots recorded at positions ``starts[i] ..`` of ``rows[i]``."""
        slots = runner.kv_pool.alloc(len(starts) * self.width).view(len(starts), self.width)
        try:
            runner.req_to_token_pool.write_block(rows, starts, slots)
        except BaseException:
            runner.kv_pool.free(slots)
            raise
        return slots

    def _unmap(self, runner, rows: torch.Tensor, starts: List[int], counts: List[int]) -> None:
        """Give back the slots of positions ``starts[i] .. starts[i] + counts[i] - 1`` of ``rows[i]``."""
        pairs = [(r, s + o) for r, s, c in zip(rows.tolist(), starts, counts) for o in range(c)]
        if pairs:
            slots = runner.req_to_token_pool.unmap([r for r, _ in pairs], [c for _, c in pairs])
            runner.kv_pool.free(slots)

    def _propose(self, rows_d, pos: List[int], window_d: torch.Tensor, first: List[int]) -> List[List[int]]:
        """``d1 .. dk`` per request: ``d1`` is known, ``k - 1`` DECODE steps add the rest."""
        drafts = [[d] for d in first]
        for i in range(1, self.k):  # d_i at position p+i (window column i-1) -> d_{i+1}
            ids = torch.tensor([d[-1] for d in drafts], dtype=torch.int64, device=self.draft.device)
            batch = ForwardBatch.build(
                ForwardMode.DECODE, ids, rows_d, [p + i for p in pos], [1] * len(pos), window_d[:, i - 1].contiguous()
            )
            for d, t in zip(drafts, self.draft.forward_step(batch).argmax(dim=-1).tolist()):
                d.append(t)
        return drafts

    def _verify(self, rows_t, pos: List[int], window_t: torch.Tensor, last: List[int], drafts) -> List[List[int]]:
        """The target's greedy token after each of ``[x, d1 .. dk]``: ``[b][k+1]``."""
        w = self.width
        ids = torch.tensor(
            [t for x, d in zip(last, drafts) for t in [x, *d]], dtype=torch.int64, device=self.target.device
        )
        batch = ForwardBatch.build(
            ForwardMode.TARGET_VERIFY,
            ids,
            rows_t,
            pos,
            [w] * len(pos),
            window_t.reshape(-1),
            SpecInfo(num_tokens_per_req=w),
        )
        return self.target.forward_step(batch, every_token=True).argmax(dim=-1).view(-1, w).tolist()

    def _extend_draft(self, reqs: _Requests, idx: List[int], rows_d, window_d, blocks, accepted) -> None:
        """DRAFT_EXTEND_V2 over ``blocks`` (``[d1 .. dj, gj]`` padded with ``gj``
        to ``k+1``) at positions ``p+1 ..``; the draft's next ``d1`` from row ``j``."""
        k, w = self.k, self.width
        pos = [reqs.pos[i] for i in idx]
        device = self.draft.device
        ids = torch.tensor([t for b in blocks for t in b], dtype=torch.int64, device=device)
        accept = torch.tensor([j + 1 for j in accepted], dtype=torch.int32, device=device)
        spec = SpecInfo(num_tokens_per_req=w, accept_lengths=accept)
        batch = ForwardBatch.build(
            ForwardMode.DRAFT_EXTEND_V2, ids, rows_d, [p + 1 for p in pos], [w] * len(pos), window_d.reshape(-1), spec
        )
        nxt = self.draft.forward_step(batch).argmax(dim=-1).tolist()
        # The draft keeps d1 .. dj, gj (positions p+1 .. p+j+1): give back p+j+2 .. p+k+1.
        self._unmap(self.draft, rows_d, [p + j + 2 for p, j in zip(pos, accepted)], [k - j for j in accepted])
        for i, j, d in zip(idx, accepted, nxt):
            reqs.pos[i] += j + 1
            reqs.first_draft[i] = d

    def release(self) -> None:
        """Give back every row and every slot its row maps, in both runners."""
        try:
            _release(self.target, self.rows_target)
        finally:
            _release(self.draft, self.rows_draft)


def _release(runner, rows: Optional[torch.Tensor]) -> None:
    if rows is None:
        return
    rows = rows.tolist()
    runner.kv_pool.free(runner.req_to_token_pool.mapped_slots(rows))
    runner.req_to_token_pool.free(rows)
