# deepspeed_ppq: the two commands a fresh machine needs.
#   make demo   the main job (sets everything up first)
#   make test   lint + the whole test suite (sets everything up first)
# Everything lives in .venv with pinned versions (requirements.txt); torch comes from the local wheel.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.ppq-deps

.PHONY: setup build test test-quick lint demo bench clean

setup: $(STAMP) build

$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements.txt
	PPQ_SKIP_NATIVE=1 $(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $(STAMP)

# Incremental native build; the lock lets several shells build at once without clobbering objects.
build: $(STAMP)
	flock /tmp/ppq-build-$(shell id -u).lock $(PY) setup.py -q build_ext --inplace
	$(PY) -c "import deepspeed_ppq.ops as o; o.require_native()"

lint: $(STAMP)
	$(VENV)/bin/ruff check deepspeed_ppq megatron_patches tests benchmarks examples

test: setup lint
	DS_ACCELERATOR=cpu $(PY) -m pytest -q -ra tests

test-quick: setup
	DS_ACCELERATOR=cpu $(PY) -m pytest -q -m "not distributed and not slow" tests

demo: setup
	DS_ACCELERATOR=cpu $(PY) examples/demo/run_demo.py $(DEMO_ARGS)

# Every benchmark, each against its baseline in the same run; results land in benchmarks/results/.
# They take long on a small CPU machine and want a quiet one (check `uptime`).
BENCHES := ops/bench_weights.py quant/bench_adam8bit.py quant/bench_master_free.py p2p/bench_codecs.py e2e/bench_seed_layer.py \
           sim/bench_simulator.py autotune/bench_planner.py p2p/bench_pipeline_comm.py sim/validate_runtime.py \
           autotune/bench_tune.py e2e/bench_quality.py

bench: setup
	for b in $(BENCHES); do echo "== $$b"; DS_ACCELERATOR=cpu $(PY) benchmarks/$$b || exit 1; done

clean:
	rm -rf build *.egg-info deepspeed_ppq/*.so
