"""The vLLM releases the adapter is tested against, and the environment each runs in.

The Makefile builds each environment (`vllm-env`, `vllm033-env`) and fetches each release's own
tests (`vllm-tests`); client/kvstore_client/vllm/compat.py refuses any other release.
"""

MATRIX = {"0.32.0": ".venv-vllm", "0.33.0": ".venv-vllm033"}
