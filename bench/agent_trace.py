"""A synthetic agent trace: long shared templates, many multi-turn sessions, short outputs.

Writes the trace format of :mod:`pat_core.trace` (one JSON object a line: ``timestamp`` in
ms, ``input_length``, ``output_length`` and ``hash_ids``, one id per ``block_tokens``-token
block of the prompt), so ``bench/trace_replay.py prepare`` and ``python -m sim trace`` replay
it as they replay the conversation trace::

    python bench/agent_trace.py --out agent.jsonl [--sessions 800 --seed 0 ...]

The model (every default is a :class:`AgentTraceConfig` field; the CLI has a flag for each):

* **Templates.**  ``templates`` (3) prompt templates, each a system prompt common to all of
  them (``system_tokens`` = 1024: the first two blocks carry the same ids in every request)
  followed by its own tool definitions, ``template_tokens`` = 4096-10240 tokens in all (the
  range of an agent framework's system prompt plus a few dozen tool schemas; template ``i`` is
  drawn uniformly from the ``i``-th of ``templates`` equal slices of that range, so the
  lengths spread over it, and the lengths are then shuffled so popularity is not tied to
  length).  A session picks template ``i`` with weight ``1 / (i + 1)`` (one popular
  agent, a tail of others), so every template is shared by many sessions at once.
* **Sessions.**  ``sessions`` (800) sessions start as a Poisson process of
  ``session_rate`` (4 per second); each runs ``turns`` = 4-20 turns (uniform), the range of a
  tool-using task from a lookup to a long edit-and-test loop.
* **Prompts grow.**  A session's token stream is its template, then per turn the new message
  (turn 0: the task statement, log-normal with median ``task_tokens`` = 300; later turns: a
  tool result such as a search hit, a file excerpt or a test log, median ``message_tokens`` =
  400, spread ``message_sigma`` = 1.0 so that one in ~100 exceeds 4k tokens, both clipped to
  ``message_clip`` = 20-6000 tokens: from a status line to a file dump) and then the turn's
  output.  Turn ``t``'s prompt is the
  stream up to and including message ``t``: the template, the whole history (earlier messages
  and outputs) and the new message.  The stream only grows, so a block that is full in one
  turn's prompt holds the same tokens in every later turn and keeps its id: a session shares
  its own history with its earlier turns.  Blocks wholly inside the template carry the
  template's ids; a prompt's partly filled last block gets an id of its own (its content
  changes when the stream grows).  A block is ``block_tokens`` = 512 tokens, the block of the
  conversation trace.
* **Outputs** are short: a tool call (a JSON call with its arguments and a line of
  reasoning), log-normal with median ``output_tokens`` = 80 (spread ``output_sigma`` = 0.8),
  clipped to ``output_clip`` = 30-400; the last turn (the answer) has median
  ``answer_tokens`` = 200 in the same clip.  Short outputs keep requests in the batch for a
  few seconds only, so the batch turns over quickly, as it does for agent traffic.
* **Timing.**  A turn arrives ``output_length * step_ms`` (25 ms, one decode step a token, as
  :class:`pat_core.trace.ReplayConfig` runs by default) after the previous turn arrived, plus
  a think time for the tool or user: log-normal, median ``think_ms`` = 1500 ms, spread
  ``think_sigma`` = 1.0 (a tool call of a second or two, a slow one now and then).
* **Branches.**  With probability ``branch_prob`` (0.1) a turn after the first fans out into
  2-``max_branches`` (4) requests that arrive together: parallel sub-tasks (or samples) over
  the same history, each with its own new message.  Branch 0 continues the session; the next
  turn waits for the slowest branch.  This gives decode steps a third sharing level (common
  system prompt, template, session history), as agent frameworks that fork work do.

Load.  A turn decodes for ~3 s (116 tokens on average at 25 ms) and then thinks for ~2.5 s
(the log-normal's mean), so a session decodes about half its life; it lives ~12 turns,
~65 s; at 4 sessions per second ~260 sessions are active and, with branches, ~160 requests
decode at once.  The defaults aim at decode steps of 30-200 requests under
``ReplayConfig(max_batch=256, kv_pages=98304)``: prompts average ~13k tokens, of which ~7k
are template (the seed-0 templates hold 8276, 5400 and 6697 tokens, most popular first), so
the steady state holds 55-70k pages of 16 tokens (below the cache: admission never waits for
KV) and reads each step's KV ~2.3 times over (unique/read ~0.43).  800 sessions start over
~200 s; after ~60 s of ramp-up the batch stays at 150-200 until sessions stop starting, then
drains in ~100 s (11,405 requests, ~12.8k decode steps, replayed in a few seconds of CPU).

Everything is drawn from one ``numpy.random.default_rng(seed)``: a seed gives the same trace
on every machine.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class AgentTraceConfig:
    """Parameters of :func:`generate` (see the module docstring for why each default).

    Token counts are prompt/output tokens; ``*_clip`` are inclusive ``(low, high)`` bounds;
    ``*_sigma`` are the log-normal spreads (standard deviation of the log).
    """

    sessions: int = 800
    seed: int = 0
    session_rate: float = 4.0            # session starts per second (Poisson)
    templates: int = 3
    system_tokens: int = 1024            # common to every template
    template_tokens: tuple = (4096, 10240)
    turns: tuple = (4, 20)
    task_tokens: float = 300.0           # turn 0's message (median)
    message_tokens: float = 400.0        # a tool result / user message (median)
    message_sigma: float = 1.0
    message_clip: tuple = (20, 6000)
    output_tokens: float = 80.0          # a tool call (median)
    answer_tokens: float = 200.0         # the last turn's answer (median)
    output_sigma: float = 0.8
    output_clip: tuple = (30, 400)
    think_ms: float = 1500.0             # tool / user time between turns (median)
    think_sigma: float = 1.0
    step_ms: float = 25.0                # decode time of one output token
    branch_prob: float = 0.1
    max_branches: int = 4
    block_tokens: int = 512

    def __post_init__(self):
        for name in ("sessions", "templates", "max_branches", "block_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name in ("template_tokens", "turns", "message_clip", "output_clip"):
            lo, hi = getattr(self, name)
            if not (1 <= lo <= hi):
                raise ValueError(f"{name} must be (low, high) with 1 <= low <= high, "
                                 f"got {(lo, hi)!r}")
        if not 0 <= self.system_tokens <= self.template_tokens[0]:
            raise ValueError(f"system_tokens = {self.system_tokens} must lie in "
                             f"[0, {self.template_tokens[0]}] (the shortest template)")
        if not 0.0 <= self.branch_prob <= 1.0:
            raise ValueError(f"branch_prob must lie in [0, 1], got {self.branch_prob}")
        for name in ("session_rate", "task_tokens", "message_tokens", "output_tokens",
                     "answer_tokens", "think_ms", "step_ms"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")


class _Ids:
    """Hands out fresh hash ids 0, 1, 2, ..."""

    def __init__(self):
        self.next = 0

    def take(self, n: int = 1) -> list:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _lognormal(rng, median: float, sigma: float, clip) -> int:
    return int(np.clip(round(median * float(np.exp(sigma * rng.standard_normal()))), *clip))


def generate(config: AgentTraceConfig | None = None) -> list:
    """The trace's requests as dicts ``{"timestamp", "input_length", "output_length",
    "hash_ids"}`` (ints; ``hash_ids`` a list of ``ceil(input_length / block_tokens)`` ints),
    sorted by timestamp (ties: session, turn, branch)."""
    return [r for *_, r in generate_labelled(config)]


def generate_labelled(config: AgentTraceConfig | None = None) -> list:
    """:func:`generate`'s requests, each as ``(session, turn, branch, record)`` (ints and the
    record dict), in the same order."""
    cfg = config or AgentTraceConfig()
    rng = np.random.default_rng(cfg.seed)
    bt = cfg.block_tokens
    ids = _Ids()
    system = ids.take(cfg.system_tokens // bt)
    lo, hi = cfg.template_tokens
    slices = (np.arange(cfg.templates) + rng.random(cfg.templates)) / cfg.templates
    tmpl_len = [int(n) for n in rng.permutation(np.round(lo + slices * (hi - lo)))]
    tmpl_ids = [system + ids.take(n // bt - len(system)) for n in tmpl_len]
    weights = 1.0 / np.arange(1, cfg.templates + 1)
    weights /= weights.sum()

    rows = []          # (timestamp, session, turn, branch, record)
    start = 0.0
    for s in range(cfg.sessions):
        start += float(rng.exponential(1e3 / cfg.session_rate))
        tpl = int(rng.choice(cfg.templates, p=weights))
        n_turns = int(rng.integers(cfg.turns[0], cfg.turns[1] + 1))
        stream_ids = list(tmpl_ids[tpl])     # ids of the stream's full blocks so far
        length = tmpl_len[tpl]               # tokens in the stream so far
        t = start
        for turn in range(n_turns):
            n_branch = 1
            if turn > 0 and rng.random() < cfg.branch_prob:
                n_branch = int(rng.integers(2, cfg.max_branches + 1))
            last = turn == n_turns - 1
            outs, grow = [], 0               # grow: what branch 0 adds to the stream
            for b in range(n_branch):
                msg = _lognormal(rng, cfg.task_tokens if turn == 0 else cfg.message_tokens,
                                 cfg.message_sigma, cfg.message_clip)
                out = _lognormal(rng, cfg.answer_tokens if last else cfg.output_tokens,
                                 cfg.output_sigma, cfg.output_clip)
                prompt = length + msg
                full = prompt // bt
                if b == 0:                   # the session's own stream: ids kept for good
                    stream_ids += ids.take(full - len(stream_ids))
                    hash_ids = stream_ids[:full]
                else:                        # a side branch shares only the history's blocks
                    shared = min(length // bt, len(stream_ids))
                    hash_ids = stream_ids[:shared] + ids.take(full - shared)
                hash_ids = hash_ids + (ids.take(1) if prompt % bt else [])
                rows.append((int(round(t)), s, turn, b, dict(
                    timestamp=int(round(t)), input_length=prompt, output_length=out,
                    hash_ids=hash_ids)))
                outs.append(out)
                if b == 0:
                    grow = msg + out
            length += grow
            t += max(outs) * cfg.step_ms + _lognormal(rng, cfg.think_ms, cfg.think_sigma,
                                                      (1, 10 ** 9))
    rows.sort(key=lambda r: r[:4])
    return [r[1:] for r in rows]


def write_jsonl(records, path) -> None:
    """Write ``records`` (dicts) one JSON object a line."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")


def summary(records, block_tokens: int = 512) -> dict:
    """Counts of a trace: requests, mean input/output tokens, the share of distinct full
    prompt blocks (position, id) that occur in more than one request, duration in s."""
    seen = {}
    for r in records:
        for k, h in enumerate(r["hash_ids"][:r["input_length"] // block_tokens]):
            seen[(k, h)] = seen.get((k, h), 0) + 1
    return dict(requests=len(records),
                mean_input=float(np.mean([r["input_length"] for r in records])),
                mean_output=float(np.mean([r["output_length"] for r in records])),
                shared_block_fraction=sum(c > 1 for c in seen.values()) / max(len(seen), 1),
                duration_s=(records[-1]["timestamp"] - records[0]["timestamp"]) / 1e3
                if records else 0.0)


def _pair(text: str) -> tuple:
    lo, _, hi = text.partition(",")
    return (int(lo), int(hi or lo))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output .jsonl")
    defaults = AgentTraceConfig()
    for f in fields(AgentTraceConfig):
        v = getattr(defaults, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(v, tuple):
            ap.add_argument(flag, type=_pair, default=v, metavar="LOW,HIGH",
                            help=f"default {v[0]},{v[1]}")
        else:
            ap.add_argument(flag, type=type(v), default=v, help=f"default {v}")
    args = ap.parse_args(argv)
    try:
        cfg = AgentTraceConfig(**{f.name: getattr(args, f.name) for f in fields(AgentTraceConfig)})
    except ValueError as e:
        ap.error(str(e))
    recs = generate(cfg)
    write_jsonl(recs, args.out)
    s = summary(recs, cfg.block_tokens)
    print(f"{s['requests']} requests over {s['duration_s']:.0f} s -> {args.out}: mean input "
          f"{s['mean_input']:.0f}, mean output {s['mean_output']:.0f} tokens, "
          f"{s['shared_block_fraction']:.0%} of distinct prompt blocks in more than one request")
    return 0


if __name__ == "__main__":
    sys.exit(main())
