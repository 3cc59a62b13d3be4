"""The serving benchmark's workload: multi-turn conversations from the Mooncake trace, as
token-id prompts a small CPU engine serves in minutes.

Why conversations and not the whole trace: what a cache-aware router changes is where a
follow-up turn lands relative to the node that holds its history, so the workload is the
trace's conversations (requests that extend an earlier request's prompt), in the trace's own
arrival order, interleaved as they arrive. One-off requests would cost every setup the same full
prefill and only dilute the figures; they are left out.

How a conversation is found: the trace names each 512-token block of a prompt by a prefix hash
(`hash_ids`), so request B continues request A when B's ids start with at least two of A's
(the first id alone is a system prompt many unrelated requests share). A conversation is a
first request and everything that continues it, transitively, in arrival order.

How the prompts are made: each trace block id becomes `tokens_per_block` token ids drawn from
a generator seeded by the id, so two prompts share the tokens the trace says they share; a
prompt is cut to its input length scaled by tokens_per_block / 512 (the last block is
partial, as in the trace). A partial last block gets a new id in the next turn only because
the turn appended text to it, so the text of the block that replaces it starts with the
partial block's text: when B continues A and B's block at A's last, partial position has a
new id, that block's tokens are A's partial tail (itself made this way, where A's block
continued an earlier one) and then fresh tokens seeded by the new id. Without that, every
follow-up would recompute its parent's partial tail, about as many tokens as the turn adds.
Output lengths are not replayed: every request asks for the same few greedy tokens (decoding
costs time and does not change time to first token).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

TRACE_NAME = "conversation_trace.jsonl"
TRACE_BLOCK_TOKENS = 512        # the trace's block size
VOCAB_LOW, VOCAB_HIGH = 3, 8000  # token ids drawn from here (the model's vocabulary is 8192)
MIN_SHARED_IDS = 2              # ids a continuation shares with its parent, at least
TOKEN_SEED = 26                 # the generator's seed beside each block id


@dataclass
class Request:
    index: int              # position in the replay
    conversation: int       # 0.. in order of first arrival
    turn: int               # 0 = the conversation's first request
    trace_line: int         # 0-based line of the trace
    timestamp_ms: int
    tokens: list[int] = field(repr=False)


def find_trace(explicit: str = "", root: Path | None = None) -> Path:
    """The conversation trace: `explicit` (a file or a folder holding it) if given, else
    `$KVS_TRACES_DIR`, else a `shared/traces` folder beside the checkout or beside any folder
    above it. Raises FileNotFoundError naming every place it looked."""
    looked: list[Path] = []

    def candidates() -> Iterable[Path]:
        if explicit:
            yield Path(explicit)
            return
        env = os.environ.get("KVS_TRACES_DIR", "")
        if env:
            yield Path(env)
        here = (root or Path(__file__).resolve().parents[1]).resolve()
        for folder in (here, *here.parents):
            yield folder / "shared" / "traces"

    for c in candidates():
        path = c / TRACE_NAME if c.is_dir() or c.suffix != ".jsonl" else c
        looked.append(path)
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the Mooncake conversation trace ({TRACE_NAME}) was not found; looked at: "
        + ", ".join(str(p) for p in looked)
        + ". Pass --trace FILE or set KVS_TRACES_DIR to the folder that holds it.")


def load_trace(path: Path) -> list[dict]:
    rows = []
    with open(path) as f:
        for n, line in enumerate(f):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ids = row["hash_ids"]
                int(row["input_length"])
                int(row["timestamp"])
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n + 1}: not a Mooncake trace row ({e})") from None
            if not isinstance(ids, list) or not ids:
                raise ValueError(f"{path}:{n + 1}: hash_ids must be a non-empty list")
            rows.append(row)
    return rows


def parents(rows: Sequence[dict]) -> list[tuple[int, int]]:
    """For each trace line, the earlier line it continues and how many leading ids they share:
    the last line holding the longest prefix of its ids, of at least MIN_SHARED_IDS ids;
    (-1, 0) for a line that continues none."""
    last_with: dict[tuple[int, ...], int] = {}      # id prefix -> last line that had it
    found: list[tuple[int, int]] = []
    for j, row in enumerate(rows):
        ids = tuple(row["hash_ids"])
        found.append((-1, 0))
        for k in range(len(ids), MIN_SHARED_IDS - 1, -1):
            parent = last_with.get(ids[:k])
            if parent is not None:
                found[j] = (parent, k)
                break
        for k in range(1, len(ids) + 1):
            last_with[ids[:k]] = j
    return found


def conversations(rows: Sequence[dict]) -> list[list[int]]:
    """Trace line numbers grouped by conversation, each in arrival order; conversations in
    order of their first request."""
    root = list(range(len(rows)))
    for j, (parent, _) in enumerate(parents(rows)):
        if parent >= 0:
            root[j] = root[parent]
    groups: dict[int, list[int]] = {}
    for j in range(len(rows)):
        groups.setdefault(root[j], []).append(j)
    return [groups[r] for r in sorted(groups)]


def scaled_length(row: dict, tokens_per_block: int) -> int:
    return max(1, row["input_length"] * tokens_per_block // TRACE_BLOCK_TOKENS)


def fresh_tokens(block_id: int, tokens_per_block: int) -> np.ndarray:
    rng = np.random.default_rng([TOKEN_SEED, int(block_id)])
    return rng.integers(VOCAB_LOW, VOCAB_HIGH, tokens_per_block, dtype=np.int64)


class BlockTokens:
    """The token ids of each trace block: fresh tokens seeded by its id, but for a block that
    replaces the partial last block of the request its request continues, which starts with
    that partial block's tokens (the turn appended text to it)."""

    def __init__(self, rows: Sequence[dict], tokens_per_block: int):
        self.tokens_per_block = tokens_per_block
        # block id -> (the block id it continues, how many of that block's tokens it keeps)
        self.stems: dict[int, tuple[int, int]] = {}
        self._made: dict[int, np.ndarray] = {}
        for j, (parent, k) in enumerate(parents(rows)):
            if parent < 0:
                continue
            a, b = rows[parent]["hash_ids"], rows[j]["hash_ids"]
            if k != len(a) - 1 or len(b) <= k or b[k] in self.stems:
                continue            # not a replaced last block, or already made
            tail = scaled_length(rows[parent], tokens_per_block) - k * tokens_per_block
            if 0 < tail < tokens_per_block and not self._leads_to(a[k], b[k]):
                self.stems[b[k]] = (a[k], tail)

    def _leads_to(self, block_id: int, target: int) -> bool:
        """Whether `block_id`'s chain of continued blocks reaches `target` (a trace whose
        ids would make a block continue itself is taken as it stands, without the stem)."""
        seen = set()
        while block_id not in seen:
            if block_id == target:
                return True
            seen.add(block_id)
            if block_id not in self.stems:
                return False
            block_id = self.stems[block_id][0]
        return True

    def __call__(self, block_id: int) -> np.ndarray:
        made = self._made.get(block_id)
        if made is None:
            chain = [block_id]                      # the block, what it continues, ...
            while chain[-1] in self.stems and self.stems[chain[-1]][0] not in self._made:
                chain.append(self.stems[chain[-1]][0])
            for h in reversed(chain):
                t = fresh_tokens(h, self.tokens_per_block)
                if h in self.stems:
                    stem, n = self.stems[h]
                    t[:n] = self._made[stem][:n]
                self._made[h] = t
            made = self._made[block_id]
        return made


def prompt(row: dict, blocks: BlockTokens) -> list[int]:
    n = scaled_length(row, blocks.tokens_per_block)
    return [int(t) for t in np.concatenate([blocks(h) for h in row["hash_ids"]])[:n]]


def build(rows: Sequence[dict], *, conversations_n: int, turns: int, tokens_per_block: int,
          max_prompt_tokens: int) -> list[Request]:
    """The first `conversations_n` conversations (by first arrival) with at least `turns`
    requests whose first `turns` prompts fit `max_prompt_tokens`; their first `turns`
    requests, replayed in trace order."""
    chosen: list[list[int]] = []
    for conv in conversations(rows):
        head = conv[:turns]
        if len(head) < turns:
            continue
        if max(scaled_length(rows[j], tokens_per_block) for j in head) > max_prompt_tokens:
            continue
        chosen.append(head)
        if len(chosen) == conversations_n:
            break
    if len(chosen) < conversations_n:
        raise ValueError(f"the trace has only {len(chosen)} conversations of {turns} turns "
                         f"within {max_prompt_tokens} tokens; {conversations_n} were asked for")
    where = {j: (c, t) for c, conv in enumerate(chosen) for t, j in enumerate(conv)}
    lines = sorted(where, key=lambda j: (rows[j]["timestamp"], j))
    blocks = BlockTokens(rows, tokens_per_block)
    return [Request(index=i, conversation=where[j][0], turn=where[j][1], trace_line=j,
                    timestamp_ms=int(rows[j]["timestamp"]),
                    tokens=prompt(rows[j], blocks))
            for i, j in enumerate(lines)]


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def common_prefix(requests: Sequence[Request]) -> list[int]:
    """The tokens every prompt starts with (the trace's shared system prompt)."""
    if not requests:
        return []
    first = requests[0].tokens
    n = min(shared_prefix(first, r.tokens) for r in requests)
    return list(first[:n])


def describe(requests: Sequence[Request], nodes: int) -> dict:
    """What the workload offers a cache: prompt sizes, how much of each follow-up its
    conversation's earlier prompts already hold, how often round-robin over `nodes` sends a
    follow-up away from the node of the conversation's previous turn, and a follow-up's median
    new tokens: those no earlier prompt of its conversation holds (the least a router can make
    it prefill), and those no earlier prompt of its conversation on its round-robin node holds
    (the least round-robin can make it prefill, with per-node caches that never forget)."""
    seen: dict[int, list[Request]] = {}
    reusable = total = away = followups = 0
    new: list[int] = []
    new_rr: list[int] = []
    for r in requests:
        earlier = seen.setdefault(r.conversation, [])
        total += len(r.tokens)
        if earlier:
            followups += 1
            held = max(shared_prefix(r.tokens, e.tokens) for e in earlier)
            reusable += held
            new.append(len(r.tokens) - held)
            same_node = [e for e in earlier if e.index % nodes == r.index % nodes]
            new_rr.append(len(r.tokens) - max(
                [shared_prefix(r.tokens, e.tokens) for e in same_node], default=0))
            away += (r.index % nodes) != (earlier[-1].index % nodes)
        earlier.append(r)
    lengths = [len(r.tokens) for r in requests]
    return {"requests": len(requests),
            "conversations": len(seen),
            "prompt_tokens": total,
            "prompt_tokens_min": min(lengths),
            "prompt_tokens_max": max(lengths),
            "prompt_tokens_mean": round(total / len(requests), 1),
            "reusable_fraction": round(reusable / total, 3),
            "followups": followups,
            "followups_rr_away": away,
            "followup_new_tokens_p50": float(np.median(new)) if new else 0.0,
            "followup_new_tokens_rr_p50": float(np.median(new_rr)) if new_rr else 0.0}
