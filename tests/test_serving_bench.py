"""bench/serving.py: the parts that run without engines (the full run starts vLLM engines and
a router for minutes, so it is a benchmark, not a test). `--help`, `--workload-only` on a small
synthetic trace in the Mooncake format, the trace search's error, the conversation extraction
the workload rests on, and `--dry-run`: every setup's harness with stand-in engines and
everything else real (daemons, redis-server, vllm-router)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import serving_workload as workload  # noqa: E402


def _row(ts: int, ids: list[int], length: int) -> dict:
    return {"timestamp": ts, "input_length": length, "output_length": 10, "hash_ids": ids}


def _trace(folder: Path) -> Path:
    """Three conversations of three turns (each turn extends the last one's ids but its last
    block, which is partial but in line 7), one one-off request sharing only the
    system-prompt id 0, and a conversation too long for the prompt limit used below."""
    rows = [
        _row(0, [0, 1, 2], 1300),
        _row(1, [0, 10, 11], 1200),
        _row(2, [0, 99], 700),                     # one-off: shares only id 0
        _row(3, [0, 20, 21, 22], 1800),
        _row(4, [0, 1, 3, 4], 1700),               # continues line 0 (shares 0, 1)
        _row(5, [0, 10, 11, 12], 1900),            # continues line 1
        _row(6, [0, 1, 3, 5, 6], 2300),            # continues line 4
        _row(7, [0, 20, 21, 23, 24], 2560),         # its last block is full
        _row(8, [0, 10, 11, 13, 14], 2400),
        _row(9, [0, 20, 21, 23, 25, 26], 2700),
        _row(10, [0, *range(30, 60)], 15000),      # too long once scaled
        _row(11, [0, *range(30, 60), 61], 15400),
        _row(12, [0, *range(30, 60), 62], 15800),
    ]
    path = folder / workload.TRACE_NAME
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_conversations_and_shared_tokens(tmp_path):
    rows = workload.load_trace(_trace(tmp_path))
    convs = workload.conversations(rows)
    assert convs[:4] == [[0, 4, 6], [1, 5, 8], [2], [3, 7, 9]]
    reqs = workload.build(rows, conversations_n=3, turns=3, tokens_per_block=64,
                          max_prompt_tokens=1000)
    assert [(r.conversation, r.turn, r.trace_line) for r in reqs] == [
        (0, 0, 0), (1, 0, 1), (2, 0, 3), (0, 1, 4), (1, 1, 5), (0, 2, 6), (2, 1, 7),
        (1, 2, 8), (2, 2, 9)]
    by = {(r.conversation, r.turn): r.tokens for r in reqs}
    assert len(by[0, 0]) == 1300 * 64 // 512
    # turn 1 of conversation 0 shares ids 0, 1, and its block 3 replaces turn 0's partial
    # block 2, so it starts with that block's 162 - 128 tokens: all of turn 0, then differs
    assert workload.shared_prefix(by[0, 0], by[0, 1]) == len(by[0, 0]) == 162
    assert by[0, 1][162:164] != by[0, 0][128:130]
    assert workload.shared_prefix(by[0, 1], by[0, 2]) == len(by[0, 1]) == 212
    assert workload.shared_prefix(by[0, 0], by[1, 0]) == 64           # the system prompt
    # a turn that replaces a full last block (line 9 replaces line 7's block 24, and 2560
    # tokens fill 5 blocks) changed its text, not appended to it: it shares only the ids
    assert workload.shared_prefix(by[2, 1], by[2, 2]) == 256 == len(by[2, 1]) - 64
    assert workload.common_prefix(reqs) == by[0, 0][:64]
    # the same ids make the same tokens on every build
    again = workload.build(rows, conversations_n=3, turns=3, tokens_per_block=64,
                           max_prompt_tokens=1000)
    assert [r.tokens for r in again] == [r.tokens for r in reqs]
    with pytest.raises(ValueError, match="only 3 conversations"):
        workload.build(rows, conversations_n=4, turns=3, tokens_per_block=64,
                       max_prompt_tokens=1000)


def test_followups_start_with_the_partial_block_they_extend():
    """On the real trace: a follow-up whose block replaces its parent's partial last block
    (the turn appended text to it) holds all of the parent's tokens, and the --quick
    workload's follow-ups add about what the trace's input lengths say a turn adds."""
    rows = workload.load_trace(trace_path())
    blocks = workload.BlockTokens(rows, 128)
    extended = 0
    for j, (parent, k) in enumerate(workload.parents(rows)):
        a, b = rows[parent]["hash_ids"], rows[j]["hash_ids"]
        if parent < 0 or k != len(a) - 1 or len(b) <= k or rows[parent]["input_length"] % 512 == 0:
            continue
        extended += 1
        pa, pb = workload.prompt(rows[parent], blocks), workload.prompt(rows[j], blocks)
        assert workload.shared_prefix(pa, pb) >= min(len(pa), len(pb)), (parent, j)
    assert extended > 3000
    reqs = workload.build(rows, conversations_n=6, turns=8, tokens_per_block=128,
                          max_prompt_tokens=3064)
    last: dict[int, workload.Request] = {}
    new, grown = [], []
    for r in reqs:
        if r.conversation in last:
            p = last[r.conversation]
            new.append(len(r.tokens) - workload.shared_prefix(p.tokens, r.tokens))
            grown.append((rows[r.trace_line]["input_length"]
                          - rows[p.trace_line]["input_length"]) * 128 // 512)
        last[r.conversation] = r
    assert len(new) == 42
    assert abs(sorted(new)[21] - sorted(grown)[21]) <= 2, (sorted(new), sorted(grown))


def test_find_trace_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("KVS_TRACES_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError) as e:
        workload.find_trace("", root=tmp_path / "checkout")
    msg = str(e.value)
    assert str(tmp_path / "nowhere" / workload.TRACE_NAME) in msg
    assert str(tmp_path / "checkout" / "shared" / "traces" / workload.TRACE_NAME) in msg
    assert "KVS_TRACES_DIR" in msg
    # beside a folder above the checkout, as a worktree sits below the shared folder
    (tmp_path / "shared" / "traces").mkdir(parents=True)
    found = _trace(tmp_path / "shared" / "traces")
    monkeypatch.delenv("KVS_TRACES_DIR")
    assert workload.find_trace("", root=tmp_path / "wt" / "checkout") == found


SETUPS = ["rr_none", "rr_kvstore", "rr_kvstore_redis", "kv_aware", "vllm_native"]


def _bench(*args: str, env: dict[str, str] | None = None,
           timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "serving.py"), *args],
                          capture_output=True, text=True, timeout=timeout, env=env,
                          stdin=subprocess.DEVNULL)


def test_help():
    p = _bench("--help")
    assert p.returncode == 0, p.stderr
    assert "--dry-run" in p.stdout and "--quick" in p.stdout


def test_workload_only_builds_the_workload_and_starts_nothing(tmp_path):
    trace = _trace(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "KVS_TRACES_DIR"}
    # tools that do not exist: describing the workload must not need them
    p = _bench("--workload-only", "--quick", "--trace", str(trace), "--conversations", "3",
               "--turns", "3", "--tokens-per-block", "64", "--router-bin",
               str(tmp_path / "no-router"), "--vllm-python", str(tmp_path / "no-python"),
               env=env)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["workload_only"] is True
    assert out["workload"]["requests"] == 9 and out["workload"]["conversations"] == 3
    assert out["restart_before_request"] == 4
    assert out["setups"] == SETUPS
    bad = _bench("--workload-only", "--trace", str(tmp_path / "missing.jsonl"), env=env)
    assert bad.returncode != 0 and "missing.jsonl" in bad.stderr
    bad = _bench("--workload-only", "--setups", "rr_none,nope", "--trace", str(trace), env=env)
    assert bad.returncode != 0 and "nope" in bad.stderr


def trace_path() -> Path:
    """The Mooncake conversation trace, where tests find it: the folder named by
    KVS_TRACES_DIR, else ../shared/traces beside the checkout. Missing, the test fails."""
    places = []
    if os.environ.get("KVS_TRACES_DIR"):
        places.append(Path(os.environ["KVS_TRACES_DIR"]) / workload.TRACE_NAME)
    places.append(ROOT.parent / "shared" / "traces" / workload.TRACE_NAME)
    for p in places:
        if p.is_file():
            return p
    pytest.fail(f"{workload.TRACE_NAME} not found; looked in: {', '.join(map(str, places))}",
                pytrace=False)


def test_dry_run_wires_every_setup(tmp_path):
    """Every setup's harness end to end on the real trace, in seconds: real kvstore daemons
    (with the kv_aware setup's event relays), a real redis-server, the real vllm-router with
    each setup's arguments, the mid-run restart, the report, the plot and the JSON line; only
    the engines are stand-ins (bench/serving_standin.py). The router must credit cached
    prefixes from the events it hears, with the request body the bench sends (a body field
    vllm-router does not know makes it credit nothing, and kv_aware routing blind)."""
    out_dir = tmp_path / "out"
    p = _bench("--dry-run", "--conversations", "3", "--turns", "3", "--trace",
               str(trace_path()), "--out", str(out_dir), timeout=600)
    assert p.returncode == 0, p.stderr[-6000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["dry_run"] is True and out["setups"] == SETUPS
    assert out["outputs_equal"] is True
    n = out["workload"]["requests"]
    assert n == 9 and out["restart_before_request"] == 4
    for s in SETUPS:
        assert sum(out[f"{s}_requests_per_node"]) == n, s       # each request on one node
        assert out[f"{s}_restarted_node"] in (0, 1), s
        assert out[f"{s}_prefill_tokens"] > 0, s
    for key in ("kv_aware_ttft_p50_vs_rr_kvstore", "kv_aware_ttft_p50_vs_rr_none",
                "kv_aware_prefill_tokens_vs_rr_none", "kv_aware_ttft_p50_vs_vllm_native",
                "rr_kvstore_redis_rps_vs_rr_none", "vllm_native_ttft_p90_vs_rr_none"):
        assert isinstance(out[key], float), key
    assert set(out["targets_met"]) == {"kv_aware_ttft_p50_vs_rr_kvstore",
                                       "kv_aware_ttft_p50_vs_rr_none",
                                       "kv_aware_prefill_tokens_vs_rr_none",
                                       "kv_aware_ttft_p50_vs_vllm_native"}
    # the routers on events heard the engines and credited what they announced
    for s in ("kv_aware", "vllm_native"):
        assert out[f"{s}_router_credited_tokens"] > 0, (s, p.stderr[-3000:])
        streams = out[f"{s}_events"]
        assert set(streams) == {"node0", "node1"}
        assert all(c.get("stored_GPU", 0) > 0 for c in streams.values()), streams
    # what the restart did to the restarted engine's stream: kvstore's relay started it over
    # with AllBlocksCleared; the engine's own stream went back to sequence 0
    def since_restart(setup: str, what: str) -> int:
        node = f"node{out[f'{setup}_restarted_node']}"
        return (out[f"{setup}_events"][node].get(what, 0)
                - out[f"{setup}_events_before_restart"][node].get(what, 0))

    assert since_restart("kv_aware", "cleared") == 1, out["kv_aware_events"]
    assert since_restart("vllm_native", "seq_back") == 1, out["vllm_native_events"]
    for s in ("rr_none", "rr_kvstore", "rr_kvstore_redis"):
        assert out[f"{s}_router_credited_tokens"] is None and out[f"{s}_events"] == {}
    records = json.loads((out_dir / "records.json").read_text())
    assert set(records) == set(SETUPS)
    assert all(len(r["records"]) == n for r in records.values())
    assert (out_dir / "ttft_per_turn.png").stat().st_size > 0


def test_dry_run_replays_arrival_times_with_requests_overlapping(tmp_path):
    """`--in-flight trace`: requests at their (compressed) trace arrival times, each turn
    after its conversation's previous answer, overlapping on stand-ins that take time to
    prefill. Which node served each request comes from the engines' logs of completion ids,
    and must agree with the router's own decisions (worker and prompt length) and with what
    the stand-ins found cached; the restart waits for every request of the first half."""
    out_dir = tmp_path / "out"
    p = _bench("--dry-run", "--conversations", "3", "--turns", "3", "--trace",
               str(trace_path()), "--out", str(out_dir), "--setups", "rr_none,kv_aware",
               "--in-flight", "trace", "--time-scale", "400", timeout=600)
    assert p.returncode == 0, p.stderr[-6000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["in_flight"] == "trace" and out["time_scale"] == 400
    assert out["outputs_equal"] is True
    n, restart_at = out["workload"]["requests"], out["restart_before_request"]
    gap_s = out["gap_ms"] / 1000
    assert out["kv_aware_router_unmatched"] == 0
    assert out["kv_aware_router_credited_tokens"] > 0
    records = json.loads((out_dir / "records.json").read_text())
    common = out["common_prefix_tokens"]
    for s in ("rr_none", "kv_aware"):
        assert out[f"{s}_max_in_flight"] >= 2, s                    # they did overlap
        assert sum(out[f"{s}_requests_per_node"]) == n, s
        recs = records[s]["records"]
        assert out[f"{s}_rps"] == round(n / out[f"{s}_replay_s"], 3) or abs(
            out[f"{s}_rps"] - n / out[f"{s}_replay_s"]) < 0.2 * out[f"{s}_rps"], s
        first = [r for r in recs if r["index"] < restart_at]
        second = [r for r in recs if r["index"] >= restart_at]
        # the quiesce: nothing of the second half went out before the first half answered
        assert max(r["done_s"] for r in first) <= min(r["sent_s"] for r in second), s
        by = {(r["conversation"], r["turn"]): r for r in recs}
        for r in recs:
            prev = by.get((r["conversation"], r["turn"] - 1))
            if prev is not None and (prev["index"] < restart_at) == (r["index"] < restart_at):
                # a user reads the answer, then thinks, before the next turn (the clock
                # leaves the restart out, which came between the halves)
                assert r["sent_s"] >= prev["done_s"] + gap_s * 0.9, (s, r["index"])
            # an unbounded stand-in cache holds more than the shared system prompt only
            # where an earlier turn of the conversation went to the same node
            if r["cached_tokens"] > common:
                assert any(q["node"] == r["node"] for q in recs
                           if q["conversation"] == r["conversation"]
                           and q["turn"] < r["turn"]), (s, r)
