"""`kvstore demo`: waits for its daemon and says so, reports why a daemon did not start, runs end
to end, and says plainly when the machine is too loaded to show a speedup."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest

from kvstore_demo.chat import MIN_SHOWN_SPEEDUP, TurnResult, speedup_verdict, temporary_daemon
from tests import optional_deps

optional_deps.module("transformers")


def test_temporary_daemon_says_what_it_waits_for():
    said: list[str] = []
    # say_every_s=0: it speaks at its first look, before a process just spawned can serve (the
    # daemon now starts in ~0.1 s on a quiet machine: a longer interval could pass silently).
    with temporary_daemon({"host.capacity": "32MiB", "ssd.capacity": "64MiB"}, say=said.append,
                          say_every_s=0.0) as address:
        assert address.startswith("unix:")
    assert said and all("waiting for the temporary kvstore daemon to start" in s for s in said)
    assert any("it last said:" in s for s in said)


def test_temporary_daemon_that_cannot_start_says_why():
    with pytest.raises(RuntimeError) as ei:
        with temporary_daemon({"host.capacity": "lots"}):
            pass
    msg = str(ei.value)
    assert "exited with code 2" in msg and "host.capacity" in msg and "'lots'" in msg


def _turn(n: int, reused: int, base: float, kv: float) -> TurnResult:
    return TurnResult(n, 256 * n, reused, base, kv, 0.01, 0.0)


def test_speedup_verdict():
    fast = [_turn(1, 0, 0.1, 0.1), _turn(2, 240, 0.2, 0.05), _turn(3, 480, 0.3, 0.06)]
    median, text = speedup_verdict(fast)
    assert median == pytest.approx(4.5) and "median TTFT speedup 4.5x" in text
    assert "720 tokens" in text
    loaded = [_turn(1, 0, 0.1, 0.1), _turn(2, 240, 0.2, 0.21), _turn(3, 480, 0.3, 0.29)]
    median, text = speedup_verdict(loaded)
    assert median < MIN_SHOWN_SPEEDUP and "too loaded" in text and "720 tokens" in text
    assert speedup_verdict([_turn(1, 0, 0.1, 0.1)])[0] is None


def test_demo_end_to_end(tmp_path):
    plot = tmp_path / "ttft.png"
    res = subprocess.run(
        [sys.executable, "-m", "kvstore", "demo", "--model", "tiny", "--turns", "3",
         "--system-tokens", "64", "--user-tokens", "48", "--reply-tokens", "4", "--repeats",
         "1", "--plot", str(plot), "--json"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    turns = json.loads(res.stdout.strip().splitlines()[-1])
    assert turns[0]["reused_tokens"] == 0
    # The conversation grows: each turn's context is the previous one + its 4-token reply + a
    # 48-token user message, and reuse covers the previous context and reply, not just the
    # 64-token system prompt: the full 16-token blocks of the tokens whose KV was computed (the
    # previous prompt + all reply tokens but the last, which was never fed back), no more.
    for prev, cur in itertools.pairwise(turns):
        assert cur["context_tokens"] == prev["context_tokens"] + 4 + 48, turns
        assert cur["reused_tokens"] == (prev["context_tokens"] + 3) // 16 * 16, turns
    assert turns[2]["reused_tokens"] > turns[1]["reused_tokens"] > 64
    assert "median TTFT speedup" in res.stdout or "no speedup shown" in res.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_history_keeps_only_kv_computed_from_its_tokens():
    """The trained chat cuts the reply at <|im_end|> (id 2 in SmolLM2) and appends <|im_end|>
    and a newline (id 198): only the prefix the cache's tokens share with that history is
    stored, so no KV is ever served for tokens it was not computed from."""
    from kvstore_demo.chat import chat_reply, shared_prefix

    end, suffix = 2, [2, 198]
    prompt = [5, 6, 7]

    def storable(raw: list[int]) -> tuple[list[int], int]:
        computed = (prompt + raw)[:len(prompt) + len(raw) - 1]   # the last token is not fed
        history = prompt + chat_reply(raw, end, suffix)
        return history, shared_prefix(history, computed)

    # it ended with <|im_end|> and a newline, both computed: the whole history has KV
    assert storable([10, 11, 2, 198, 12]) == ([5, 6, 7, 10, 11, 2, 198], 7)
    # it ended, then went on with something else: the appended newline has no KV
    assert storable([10, 11, 2, 13, 12]) == ([5, 6, 7, 10, 11, 2, 198], 6)
    # cut off by the token limit: the last reply token and the appended ones have no KV
    assert storable([10, 11, 12]) == ([5, 6, 7, 10, 11, 12, 2, 198], 5)
    assert shared_prefix([1, 2], [1, 2, 3]) == 2 and shared_prefix([], [1]) == 0
