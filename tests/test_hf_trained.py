"""Reuse through a real daemon on the trained SmolLM2 with real text
(kvstore_demo/trained_model.py):
lossless reuse gives the same logits, lossy codecs keep the model's next-token choices. The
random-weight tests in test_hf.py stay for speed; these judge what a real model does (its sharp
heads are what lossy codecs get wrong). Skipped where the model is not installed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from kvstore_client.hf import (
    PrefixCacheRunner,
    cache_to_canonical,
    canonical_to_cache,
    compare_distributions,
    forward_with_cache,
    full_prefill,
    greedy_decode,
    teacher_forced_logits,
)

from kvstore_demo import trained_model
from kvstore_demo.text import document
from tests.test_hf import _evict_host

BT = 16
STEPS = 32
pytestmark = pytest.mark.timeout(1200)   # model load: minutes on a busy box


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tests.daemon import cleanup, start_daemon

    d = start_daemon(tmp_path_factory.mktemp("hf-trained"), {"host.capacity": "256MiB",
                                                             "ssd.capacity": "1GiB"})
    try:
        yield d
    finally:
        cleanup(d)


@pytest.fixture(scope="module")
def client(daemon: Any) -> Any:
    from kvstore_client import connect

    with connect(daemon.address) as c:
        yield c


@pytest.fixture(scope="module")
def smollm() -> Any:
    if not trained_model.available():
        pytest.skip(f"SmolLM2 not installed: {trained_model.INSTALL_HINT}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield trained_model.load()
    finally:
        torch.set_num_threads(threads)


def _prompt(tok: Any, tokens: int, start: int) -> torch.Tensor:
    return torch.tensor(tok(document(6, start=start), add_special_tokens=False).input_ids[:tokens])


def test_lossless_reuse_is_bit_exact_on_the_trained_model(client: Any, smollm: Any) -> None:
    model, tok = smollm
    runner = PrefixCacheRunner.create(client, model, "test-smollm-lossless", block_tokens=BT)
    prompt = _prompt(tok, 300, 0)
    ref, ref_cache = full_prefill(model, prompt)
    assert runner.store(prompt, ref_cache) == 300 // BT
    res = runner.prefill(prompt, store=False)
    assert res.reused_tokens == 288
    local = canonical_to_cache(cache_to_canonical(ref_cache, 0, 288), model.config)
    same_work = forward_with_cache(model, prompt[288:], local, 288)
    assert torch.equal(res.logits, same_work)              # kvstore returned the KV bit for bit
    assert float((res.logits - ref).abs().max()) <= 1e-3   # vs a full prefill: rounding only


@pytest.mark.parametrize("codec,top1", [("int8", 1.0), ("fp8_e4m3", 0.96)])
def test_lossy_codecs_keep_the_trained_models_choices(client: Any, daemon: Any, smollm: Any,
                                                     codec: str, top1: float) -> None:
    model, tok = smollm
    runner = PrefixCacheRunner.create(client, model, f"test-smollm-{codec}", codec=codec,
                                      block_tokens=BT)
    prompt = _prompt(tok, 410, 3)
    ref_first, ref_cache = full_prefill(model, prompt)
    stored = canonical_to_cache(cache_to_canonical(ref_cache), model.config)
    ref_tokens, ref_logits = greedy_decode(model, ref_first, ref_cache, STEPS)
    runner.store(prompt, stored)
    _evict_host(client, daemon)                  # demoted to SSD through the codec
    res = runner.prefill(prompt, store=False)
    assert res.reused_tokens == 400               # whole blocks, the last token computed
    got = compare_distributions(ref_logits, teacher_forced_logits(model, res.logits, res.cache,
                                                                  ref_tokens))
    assert got["max_abs"] > 0, "identical logits: the blocks did not go through the lossy codec"
    assert got["top1"] >= top1 and got["mean_kl"] <= 1e-2, got
