"""bench/hf_gpu.py: an HF engine reusing a prefix another process stored in the gpu tier.

The bench is meant for a GPU, where it runs once; here it runs whole on the daemon's CPU device
(a real daemon, a real shared-memory device slab, separate producer and consumer processes, the
same client code), so a mistake in its flow or its checks shows before that one run. Speed is
not tested: on the tiny model the figures mean nothing. What must hold is the proof: every
prefix block loaded, the loaded KV bit-identical to a recompute, the same greedy tokens.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "hf_gpu.py"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.hf_gpu import BLOCK_TOKENS, SHAPES  # noqa: E402
from bench.hf_gpu_engine import _engine, _hf_view, engine_forwards  # noqa: E402


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    # CUDA hidden, so on a GPU machine too these take the paths they test.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "client")]),
               CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=timeout, stdin=subprocess.DEVNULL)


def test_cpu_device_run_reuses_the_stored_prefix_bit_for_bit(tmp_path: Path) -> None:
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (`make dev` installs it)")
    out_file = tmp_path / "hf_gpu.json"
    r = _run("--device", "cpu", "--tokens", "256", "--quick", "--out", str(out_file),
             timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["bench"] == "hf_gpu" and out["backend"] == "cpu" and "error" not in out
    assert (out["tokens"], out["prefix_tokens"], out["block_tokens"]) == (256, 224, 32)
    assert out["producer"]["stored"] == 7 and out["producer"]["per_tier"]["gpu"] == 7
    assert out["per_tier_before"]["gpu"] == 7          # the consumer found them in the gpu tier
    assert out["blocks_loaded"] == out["prefix_blocks"] == 7
    assert out["prefix_bytes"] == 7 * out["block_bytes"]
    assert out["hf_gpu_kv_equal"] is True and out["hf_gpu_outputs_equal"] is True
    assert out["weights_equal"] and out["kv_loaded_equals_producer"]
    assert out["first_tokens_agree"] and out["max_abs_logit_diff"] == 0.0
    assert len(out["tokens_reuse"]) == out["steps"]
    # No CUDA here: the eager engine is the headline, the graphed one says why it did not run.
    assert out["engine"] == "eager" and out["graphs"] == {"skipped": "no CUDA device"}
    assert out["hf_gpu_ttft_speedup_8k"] == out["eager"]["speedup"] > 0
    for key in ("hf_gpu_ttft_reuse_ms", "hf_gpu_ttft_recompute_ms", "hf_gpu_ttft_speedup_8k",
                "load_ms", "load_GBps"):
        assert out[key] > 0, key
    # Nothing reached the gpu tier but the producer's store: no promotion from host.
    assert out["gpu_counters"].get("bytes_host_to_gpu", 0) == 0
    assert out["targets"] == {"hf_gpu_ttft_speedup_8k": 5.0, "hf_gpu_outputs_equal": True}
    assert json.loads(out_file.read_text()) == out


def test_without_cuda_the_default_run_prints_one_skip_line() -> None:
    r = _run(timeout=120)
    assert r.returncode == 0, r.stderr[-4000:]
    lines = r.stdout.splitlines()
    assert len(lines) == 1, r.stdout
    out = json.loads(lines[0])
    assert out["bench"] == "hf_gpu" and "skipped" in out["cuda"]


# Ops that on a CUDA device wait for the device (a value read back, an output whose size
# depends on data) or upload host data: a CUDA graph capture refuses each of them.
_HOST_SYNCS = ("aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.equal",
               "aten.nonzero", "aten.masked_select", "aten._unique", "aten.unique",
               "aten.repeat_interleave")


class _CaptureHazards(TorchDispatchMode):
    """Lists what a forward does that a CUDA graph capture refuses, found on the CPU: the
    graphed engine of bench/hf_gpu.py runs only on a GPU, once, so a forward that syncs (a new
    transformers version, a change to kvstore_client.hf) must show here first."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = str(func)
        if name.startswith(_HOST_SYNCS):
            self.found.append(name)
        elif name.startswith("aten.lift_fresh") and args[0].numel() > 0:
            self.found.append(f"{name} of host data {tuple(args[0].shape)}")
        return func(*args, **(kwargs or {}))


def test_graphed_engine_forwards_do_nothing_a_cuda_graph_capture_refuses() -> None:
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (`make dev` installs it)")
    import torch

    _, model, _ = _engine({"device": "cpu", "shape": SHAPES["cpu"], "max_positions": 512,
                           "dtype": "bfloat16"})
    cfg = model.config
    prefix, n = 4 * BLOCK_TOKENS, 5 * BLOCK_TOKENS
    blocks = [torch.randn((prefix // BLOCK_TOKENS, BLOCK_TOKENS, cfg.num_key_value_heads,
                           cfg.head_dim), dtype=torch.bfloat16)
              for _ in range(2 * cfg.num_hidden_layers)]
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    suffix_forward, full_forward = engine_forwards(model, [_hf_view(b) for b in blocks], ids,
                                                   prefix)
    with torch.inference_mode():
        for name, fn in (("suffix", lambda: suffix_forward()[0]), ("full", full_forward)):
            watch = _CaptureHazards()
            with watch:
                logits = fn()
            assert watch.found == [], f"{name} forward: {watch.found}"
            assert logits.shape == (cfg.vocab_size,) and torch.isfinite(logits).all()
        # The watch sees what it looks for.
        watch = _CaptureHazards()
        with watch:
            x = torch.ones(3)
            x.sum().item()
            torch.tensor([1, 2])
            bool(x.any())
        assert watch.found == ["aten.item.default",
                               "aten.lift_fresh.default of host data (2,)",
                               "aten.is_nonzero.default"], watch.found
