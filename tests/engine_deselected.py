"""The one list of the engines' own tests that are not run against kvstore's adapters, and why.

Everything else the engines' test files hold runs, and must pass (tests/test_vllm_contract.py,
tests/test_sglang_contract.py). A test belongs here only when it is about another tier's or
backend's internals, never because kvstore fails it.
"""

from __future__ import annotations

# vLLM's tests/v1/kv_offload/tiering/ (tests/vllm_tier_shim.py, tests/test_vllm_contract.py):
# node ids relative to that folder ("[...]" names one parametrization) -> why not run. All are
# tests of the fs tier's own machinery (its C extension, O_DIRECT, thread pool, file errors);
# the test named in each reason checks the same contract for KVStoreTier.
VLLM_DESELECTED: dict[str, str] = {
    "test_fs_tier.py::test_invalid_path_raises_at_construction":
        "checks that the fs tier writes its config.json under root_dir at construction; "
        "KVStoreTier connects lazily (a daemon may start after the engine) and has no files",
    "test_fs_tier.py::test_shutdown_discards_pending_tasks":
        "inspects the fs tier's DualQueueThreadPool queues and threads (_pool._load_q, "
        "_store_q, _threads); KVStoreTier's shutdown lets jobs in flight finish within their "
        "deadlines, so no copy is cut mid-chunk (tiering/base.py asks only that it release "
        "its resources)",
    "test_fs_tier.py::test_store_load_roundtrip_without_o_direct":
        "the fs tier's O_DIRECT probe and buffered fallback (_use_o_direct)",
    "test_fs_tier.py::test_wait_idle_blocks_until_tasks_complete":
        "a unit test of the fs tier's DualQueueThreadPool alone",
    "test_fs_tier.py::test_batch_lookup_c_extension":
        "a unit test of the fs tier's fs_io_C.batch_lookup extension alone",
    "test_fs_tier.py::test_store_load_data_integrity[True-0]":
        "the fs tier's C-extension path (use_c_ext=True); the same test runs with False",
    "test_fs_tier.py::test_store_load_data_integrity[True-1]":
        "the fs tier's C-extension path (use_c_ext=True); the same test runs with False",
    "test_fs_tier.py::test_store_load_data_integrity[True-2]":
        "the fs tier's C-extension path (use_c_ext=True); the same test runs with False",
    "test_fs_tier.py::test_store_load_data_integrity[True-5]":
        "the fs tier's C-extension path (use_c_ext=True); the same test runs with False",
    "test_fs_tier.py::test_batch_lookup_dispatch[True]":
        "the fs tier's C-extension path (use_c_ext=True); the same test runs with False",
    "test_fs_tier.py::test_out_of_bounds_block_id_smoke[True]":
        "the fs tier's C-extension path (use_c_ext=True); the same test runs with False",
    "test_fs_tier.py::test_failed_load_corrects_verdict_and_removes_corrupt_file[True]":
        "the fs tier's C-extension path (use_c_ext=True); the same test runs with False",
    "test_fs_tier.py::test_batched_partial_load_failure_keeps_loaded_blocks[True]":
        "the fs tier's C-extension path (use_c_ext=True); the same test runs with False",
    "test_fs_tier.py::test_batched_load_first_block_fails_marks_whole_batch[True]":
        "the fs tier's C-extension path (use_c_ext=True); the same test runs with False",
    "test_fs_tier.py::test_transient_load_failure_leaves_file[True]":
        "how the fs tier classifies open() errors (ELOOP vs a short read) before deleting a "
        "file; KVStoreTier's transient failures (daemon down or hung) fail the job and drop "
        "nothing: tests/test_vllm_manager.py::test_daemon_hung_fails_jobs_and_misses",
    "test_fs_tier.py::test_transient_load_failure_leaves_file[False]":
        "how the fs tier classifies open() errors (ELOOP vs a short read) before deleting a "
        "file; KVStoreTier's transient failures (daemon down or hung) fail the job and drop "
        "nothing: tests/test_vllm_manager.py::test_daemon_hung_fails_jobs_and_misses",
    "test_fs_tier.py::test_mixed_job_results_emit_event_only_for_successful_job":
        "fails a job by patching the fs tier's block writer (batch_store_block); the same "
        "contract for KVStoreTier: tests/test_vllm_tier.py::"
        "test_kv_events_only_for_stored_jobs_and_found_removals",
    "test_fs_tier.py::test_partially_failed_store_emits_no_event":
        "fails a job by patching the fs tier's block writer (batch_store_block); the same "
        "contract for KVStoreTier: tests/test_vllm_tier.py::"
        "test_kv_events_only_for_stored_jobs_and_found_removals",
    # vLLM 0.33 and later
    "test_fs_tier.py::test_failed_load_after_abort_does_not_break_newer_probe":
        "a regression test of the fs tier's per-request lookup probes (a new request's "
        "first lookup always probes, RETRY); KVStoreTier answers from a node-wide cache of "
        "recent answers, and a failed load's keys answer MISS: tests/test_vllm_manager.py::"
        "test_corrupt_block_fails_its_job_and_is_recomputed",
}
# Deselected tests that first appear in a later vLLM than 0.32: name -> (major, minor).
VLLM_SINCE: dict[str, tuple[int, int]] = {
    "test_fs_tier.py::test_failed_load_after_abort_does_not_break_newer_probe": (0, 33),
}

# SGLang's in-wheel storage/mooncake_store/test_mooncake_store.py (tests/sglang_contract.py,
# tests/test_sglang_contract.py), run as its own __main__ runs it, with the backend swapped.
SGLANG_DESELECTED: dict[str, str] = {
    "test_mooncake_store.py::test_single_operation":
        "Mooncake's object API: it stores a 4 KiB object under a key through set(key, "
        "target_location=<pointer>, target_sizes=4096) in a pool whose pages are 8 KiB. "
        "kvstore's backend stores SGLang's pages, one block per whole page, which is all "
        "SGLang's cache controller ever passes (flat pages, or batch_*_v1 host indices)",
}
