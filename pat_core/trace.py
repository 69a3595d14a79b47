"""Request traces replayed as a continuous-batching decode loop: one block table per step.

A trace is a JSON-lines file, one request a line (the Mooncake trace format)::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, ..., 13]}

``timestamp`` is the arrival time in ms, ``input_length`` the prompt tokens, ``output_length``
the generated tokens, and ``hash_ids`` one id per ``block_tokens``-token block of the prompt
(512 in that trace): two requests hold the same KV for a prompt block exactly when their
leading ids agree up to and including that block.

:func:`replay` turns the requests into decode steps the way a paged serving engine with
prefix caching would (vLLM, SGLang):

* requests arrive by timestamp and wait in a first-come-first-served queue;
* admission (at the start of a step) takes the queue head while the batch has room
  (``max_batch``) and the KV cache can hold the request's whole life (``kv_pages``);
  a request that would not fit even in an empty cache is rejected (counted, never run);
* a request's full prompt blocks are looked up by their hash-id prefix: blocks already
  resident are shared (same page ids, reference counted), the others get fresh pages;
  the prompt's partial last block and every generated token go to pages of its own (the
  request writes into them, so they cannot be shared);
* every step, every running request appends one token (a fresh page when its last one is full)
  and attends over its whole KV: step ``k`` (1-based) of a request sees
  ``input_length + k`` tokens; a request leaves after ``output_length`` steps and its pages
  (shared ones when no running request still uses them) return to a free list, which hands out
  the most recently freed page first;
* the clock advances ``step_ms`` per step and jumps to the next arrival when nothing runs.

Prefill is not modelled: a request's prompt KV appears at admission at no cost, and
admission does not wait for it.  Admission reserves the request's final page count, so a
running request never runs out of pages and nothing is preempted.

The generator yields a :class:`DecodeStep` (block table, ``seq_lens``, request ids, cache
occupancy) per step; it depends on nothing but NumPy, so the simulator's report
(``python -m sim trace``) and GPU benchmarks share it.  :func:`snapshot_steps` picks ``k``
steps spread evenly over a replay.
"""
from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace.

    ``rid``: index in the loaded list (arrival order); ``line``: 1-based line in the file;
    ``arrival_ms``: float; ``hash_ids``: tuple of ints, one per prompt block.
    """

    rid: int
    line: int
    arrival_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple


@dataclass(frozen=True)
class ReplayConfig:
    """Engine limits of a replay.

    page_size : tokens per KV page.
    block_tokens : tokens per hash-id block of the trace (a multiple of ``page_size``).
    max_batch : most requests decoding at once.
    kv_pages : KV-cache capacity in pages (one layer's page ids: ``0 .. kv_pages - 1``).
    step_ms : simulated time of one decode step.
    """

    page_size: int = 16
    block_tokens: int = 512
    max_batch: int = 256
    kv_pages: int = 32768
    step_ms: float = 25.0

    def __post_init__(self):
        for name in ("page_size", "block_tokens", "max_batch", "kv_pages"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.block_tokens % self.page_size:
            raise ValueError(f"block_tokens = {self.block_tokens} is not a multiple of "
                             f"page_size = {self.page_size}")
        if not (isinstance(self.step_ms, (int, float)) and math.isfinite(self.step_ms)
                and self.step_ms > 0):
            raise ValueError(f"step_ms must be a positive number, got {self.step_ms!r}")


@dataclass
class DecodeStep:
    """One decode step of a replay.

    Attributes
    ----------
    step : 0-based step index.
    time_ms : simulated clock at the step.
    request_ids : int64 ``[B]``, :attr:`TraceRequest.rid` of each row, in admission order.
    block_table : int32 ``[B, max_pages]``, page ids; ``-1`` past each row's used pages.
    seq_lens : int32 ``[B]``, KV tokens each request attends over this step (``>= 1``).
    decode_index : int32 ``[B]``, which of its ``output_length`` steps this is (1-based).
    page_size : tokens per page.
    used_pages : pages holding KV after this step's appends.
    reserved_pages : pages promised to running requests (``>= used_pages``, ``<= kv_pages``).
    unique_tokens : distinct KV tokens the batch reads (shared blocks counted once).
    queued : requests waiting for admission.
    admitted, finished : rids that joined at this step / leave after it.
    """

    step: int
    time_ms: float
    request_ids: np.ndarray
    block_table: np.ndarray
    seq_lens: np.ndarray
    decode_index: np.ndarray
    page_size: int
    used_pages: int
    reserved_pages: int
    unique_tokens: int
    queued: int
    admitted: list = field(default_factory=list)
    finished: list = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def read_tokens(self) -> int:
        """KV tokens read by a kernel that reads every request's KV on its own."""
        return int(self.seq_lens.astype(np.int64).sum())


@dataclass
class ReplayStats:
    """Counters a replay fills in as it goes (pass one to :func:`replay`)."""

    steps: int = 0
    admitted: int = 0
    finished: int = 0
    rejected: list = field(default_factory=list)   # rids larger than the whole cache
    max_used_pages: int = 0
    max_batch_seen: int = 0
    end_ms: float = 0.0


# ---------------------------------------------------------------------------- loading
def load_trace(path, *, start_ms: float = 0.0, end_ms: float | None = None,
               sample: float = 1.0, seed: int = 0, max_requests: int | None = None,
               block_tokens: int = 512) -> list:
    """Read a trace file into :class:`TraceRequest` objects sorted by arrival.

    Keeps requests arriving in ``[start_ms, end_ms)``; ``sample`` (``0 < sample <= 1``) keeps
    each of those with that probability (fixed ``seed``: the same subset every time), then
    ``max_requests`` keeps the earliest.  ``hash_ids`` must hold
    ``ceil(input_length / block_tokens)`` ids.  A malformed line raises ``ValueError`` naming
    the file and the line.
    """
    if not (0.0 < sample <= 1.0):
        raise ValueError(f"sample must lie in (0, 1], got {sample}")
    # NaN compares false with everything: it would keep every request instead of failing
    for name, v in (("start_ms", start_ms), ("end_ms", end_ms)):
        if v is not None and not math.isfinite(v):
            raise ValueError(f"{name} must be a finite number, got {v}")
    if max_requests is not None and (isinstance(max_requests, bool) or max_requests < 0):
        raise ValueError(f"max_requests must be None or an int >= 0, got {max_requests!r}")
    if end_ms is not None and end_ms <= start_ms:
        raise ValueError(f"end_ms = {end_ms} must exceed start_ms = {start_ms}")
    rng = np.random.default_rng(seed)
    out = []
    with open(path) as fh:
        for lineno, text in enumerate(fh, 1):
            if not text.strip():
                continue
            r = _parse_line(text, path, lineno, block_tokens)
            keep = rng.random() < sample if sample < 1.0 else True   # draw for every line
            if r[0] < start_ms or (end_ms is not None and r[0] >= end_ms) or not keep:
                continue
            out.append((r[0], lineno, r))
    out.sort(key=lambda x: (x[0], x[1]))
    if max_requests is not None:
        out = out[:max_requests]
    return [TraceRequest(rid=i, line=ln, arrival_ms=r[0], input_length=r[1],
                         output_length=r[2], hash_ids=r[3]) for i, (_, ln, r) in enumerate(out)]


def _parse_line(text: str, path, lineno: int, block_tokens: int):
    where = f"{path}, line {lineno}"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids")
               if k not in obj]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) \
            or ts < 0:
        raise ValueError(f"{where}: timestamp must be a number >= 0, got {ts!r}")
    vals = []
    for k in ("input_length", "output_length"):
        v = obj[k]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{where}: {k} must be an integer >= 1, got {v!r}")
        vals.append(v)
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool)
                                            for h in ids):
        raise ValueError(f"{where}: hash_ids must be a list of integers")
    want = -(-vals[0] // block_tokens)
    if len(ids) != want:
        raise ValueError(f"{where}: input_length {vals[0]} needs {want} hash_ids of "
                         f"{block_tokens} tokens, got {len(ids)}")
    return float(ts), vals[0], vals[1], tuple(ids)


# ---------------------------------------------------------------------------- the engine
class _Block:
    """A resident full prompt block: its pages, its users, its place in the prefix trie."""

    __slots__ = ("key", "parent", "children", "pages", "refs")

    def __init__(self, key, parent, pages):
        self.key, self.parent, self.pages = key, parent, pages
        self.children = {}
        self.refs = 0


class _Running:
    __slots__ = ("req", "blocks", "pages", "npages", "seq_len", "done", "lifetime_private",
                 "n_shared_pages")

    def __init__(self, req, blocks, pages, npages, seq_len, lifetime_private, n_shared_pages):
        self.req, self.blocks, self.pages, self.npages = req, blocks, pages, npages
        self.seq_len, self.done = seq_len, 0
        self.lifetime_private, self.n_shared_pages = lifetime_private, n_shared_pages


class _Engine:
    def __init__(self, cfg: ReplayConfig):
        self.cfg = cfg
        self.free = list(range(cfg.kv_pages - 1, -1, -1))   # pop() hands out 0, 1, 2, ...
        self.root = _Block(None, None, None)
        self.shared_pages = 0        # pages of resident shared blocks
        self.reserved_private = 0    # lifetime private pages of running requests
        self.used_private = 0
        self.shared_excess = 0       # sum over resident blocks of (users - 1)

    @property
    def used(self) -> int:
        return self.shared_pages + self.used_private

    @property
    def reserved(self) -> int:
        return self.shared_pages + self.reserved_private

    def _alloc(self, n: int) -> list:
        if n > len(self.free):       # the reservation rule makes this unreachable
            raise RuntimeError("KV cache overcommitted")
        got = self.free[-n:][::-1] if n else []
        del self.free[len(self.free) - n:]
        return got

    def need(self, req: TraceRequest):
        """(new shared pages, lifetime private pages, full blocks) ``req`` would take now."""
        cfg = self.cfg
        nfull = req.input_length // cfg.block_tokens
        node, new = self.root, 0
        per_block = cfg.block_tokens // cfg.page_size
        for i in range(nfull):
            node = node.children.get(req.hash_ids[i]) if node is not None else None
            if node is None:
                new += per_block
        private_tokens = req.input_length + req.output_length - nfull * cfg.block_tokens
        return new, -(-private_tokens // cfg.page_size), nfull

    def admit(self, req: TraceRequest, lifetime_private: int, nfull: int) -> _Running:
        cfg = self.cfg
        per_block = cfg.block_tokens // cfg.page_size
        total_pages = nfull * per_block + lifetime_private
        pages = np.full(total_pages, -1, dtype=np.int32)
        node, blocks = self.root, []
        for i in range(nfull):
            h = req.hash_ids[i]
            child = node.children.get(h)
            if child is None:
                child = _Block(h, node, np.asarray(self._alloc(per_block), dtype=np.int32))
                node.children[h] = child
                self.shared_pages += per_block
            else:
                self.shared_excess += 1
            child.refs += 1
            blocks.append(child)
            pages[i * per_block:(i + 1) * per_block] = child.pages
            node = child
        nshared = nfull * per_block
        rem = req.input_length - nfull * cfg.block_tokens
        first = -(-rem // cfg.page_size)
        pages[nshared:nshared + first] = self._alloc(first)
        self.used_private += first
        self.reserved_private += lifetime_private
        return _Running(req, blocks, pages, nshared + first, req.input_length, lifetime_private,
                        nshared)

    def append_token(self, run: _Running) -> None:
        run.seq_len += 1
        run.done += 1
        if run.seq_len > run.npages * self.cfg.page_size:
            run.pages[run.npages] = self._alloc(1)[0]
            run.npages += 1
            self.used_private += 1

    def release(self, run: _Running) -> None:
        private = run.pages[run.n_shared_pages:run.npages]
        self.free.extend(int(p) for p in private[::-1])
        self.used_private -= private.shape[0]
        self.reserved_private -= run.lifetime_private
        for blk in reversed(run.blocks):          # leaf first: a parent outlives its children
            blk.refs -= 1
            if blk.refs == 0:
                del blk.parent.children[blk.key]
                self.free.extend(int(p) for p in blk.pages[::-1])
                self.shared_pages -= blk.pages.shape[0]
            else:
                self.shared_excess -= 1


def replay(requests, config: ReplayConfig | None = None, *, max_steps: int | None = None,
           stats: ReplayStats | None = None, tables=True) -> Iterator[DecodeStep]:
    """Yield the :class:`DecodeStep` of every decode step of ``requests`` (sorted by arrival,
    as :func:`load_trace` returns them) under ``config``.  See the module docstring for the
    rules.  ``max_steps`` stops early; ``stats`` (a :class:`ReplayStats`) is updated as the
    replay goes; ``tables=False`` skips building ``block_table`` (it is then ``None``) for a
    cheap pass that only counts or schedules, and a set of step indices builds it for those
    steps only."""
    cfg = config or ReplayConfig()
    if max_steps is not None and max_steps < 0:
        raise ValueError(f"max_steps must be >= 0, got {max_steps}")
    st = stats if stats is not None else ReplayStats()
    reqs = list(requests)
    for a, b in zip(reqs, reqs[1:]):
        if b.arrival_ms < a.arrival_ms:
            raise ValueError(f"requests must be sorted by arrival (rid {b.rid} comes before "
                             f"rid {a.rid})")
    eng = _Engine(cfg)
    queue: deque = deque()
    running: list = []
    nxt, n = 0, len(reqs)
    now = reqs[0].arrival_ms if reqs else 0.0
    step = 0
    while nxt < n or queue or running:
        if max_steps is not None and step >= max_steps:
            break
        while nxt < n and reqs[nxt].arrival_ms <= now:
            queue.append(reqs[nxt])
            nxt += 1
        admitted = []
        while queue and len(running) < cfg.max_batch:
            req = queue[0]
            new_shared, private, nfull = eng.need(req)
            full_life = nfull * (cfg.block_tokens // cfg.page_size) + private
            if full_life > cfg.kv_pages:
                st.rejected.append(req.rid)
                queue.popleft()
                continue
            if eng.reserved + new_shared + private > cfg.kv_pages:
                break                                 # first come, first served: wait
            queue.popleft()
            running.append(eng.admit(req, private, nfull))
            admitted.append(req.rid)
        if not running:
            if nxt < n:
                now = max(now, reqs[nxt].arrival_ms)  # idle: jump to the next arrival
            continue
        for run in running:
            eng.append_token(run)
        B = len(running)
        seq = np.fromiter((r.seq_len for r in running), dtype=np.int32, count=B)
        table = None
        if tables is True or (tables is not False and step in tables):
            width = max(r.npages for r in running)
            table = np.full((B, width), -1, dtype=np.int32)
            for i, r in enumerate(running):
                table[i, :r.npages] = r.pages[:r.npages]
        finished = [r.req.rid for r in running if r.done == r.req.output_length]
        read = int(seq.astype(np.int64).sum())
        yield DecodeStep(
            step=step, time_ms=now,
            request_ids=np.fromiter((r.req.rid for r in running), dtype=np.int64, count=B),
            block_table=table, seq_lens=seq,
            decode_index=np.fromiter((r.done for r in running), dtype=np.int32, count=B),
            page_size=cfg.page_size, used_pages=eng.used, reserved_pages=eng.reserved,
            unique_tokens=read - eng.shared_excess * cfg.block_tokens, queued=len(queue),
            admitted=admitted, finished=finished)
        st.steps += 1
        st.admitted += len(admitted)
        st.max_used_pages = max(st.max_used_pages, eng.used)
        st.max_batch_seen = max(st.max_batch_seen, B)
        if finished:
            keep = []
            for r in running:
                if r.done == r.req.output_length:
                    eng.release(r)
                    st.finished += 1
                else:
                    keep.append(r)
            running = keep
        step += 1
        now += cfg.step_ms
        st.end_ms = now


def snapshot_steps(requests, k: int, config: ReplayConfig | None = None, *,
                   max_steps: int | None = None) -> list:
    """``k`` decode steps spread evenly over the replay of ``requests`` (first and last step
    included when ``k >= 2``), with their block tables: two passes, the first only counts."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    total = sum(1 for _ in replay(requests, config, max_steps=max_steps, tables=False))
    if total == 0:
        return []
    want = set(np.unique(np.linspace(0, total - 1, num=min(k, total)).round().astype(int))
               .tolist())
    return [s for s in replay(requests, config, max_steps=max_steps, tables=want)
            if s.step in want]
