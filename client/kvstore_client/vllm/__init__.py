"""kvstore for vLLM: a secondary tier for vLLM's tiered KV offloading, and a CPU copy worker.

Enabled by configuration alone (docs/vllm.md):

    kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "cpu_bytes_to_use": 1 << 30,
            "secondary_tiers": [{"type": "KVStoreTier",
                                 "module_path": "kvstore_client.vllm.tier",
                                 "address": "/run/kvstore/kvstore.sock"}]}}

One module per concern, as vLLM's own `tiering/` folder: `compat` (which vLLM this runs on),
`keyspace` (whose block hashes these are), `identity` (the namespace an engine's blocks live in),
`lookups` (non-blocking per-key lookups), `tier` (the SecondaryTierManager), `cpu_worker` (the
CPU-to-CPU offloading worker vLLM lacks on CPU platforms). Nothing here imports vLLM until a
vLLM process loads the tier.
"""
