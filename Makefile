# kvmix: one Makefile for the demo, the tests, the benchmarks and the CUDA kernel pack.
#   make demo        build and run examples/quickstart
#   make eval        build build/kvmix-eval (the reference-model runner and quality harness) and
#                    build/kvmix-calibrate (captures to a per-tag bit allocation)
#   make test        header compile checks (gcc and clang, every -O level), host tests under
#                    ASan+UBSan, fuzz smoke runs, model tests (when $(SHARED)/models exists),
#                    nvcc build of the kernel pack
#   make test-cuda   GPU tests (needs an sm_90 GPU)
#   make bench       CPU benchmarks
#   make fuzz        libFuzzer targets (clang)
#   make format-check

CC ?= cc
CXX ?= c++
SHARED ?= ../shared
BUILD := build

WARN := -Wall -Wextra -Werror -pedantic
# No fused multiply-add contraction: the CPU references define exact float arithmetic.
CFLAGS := -std=c11 $(WARN) -O2 -ffp-contract=off
# -O2 keeps every UBSan check and costs the sanitized tests and fuzz runs a third less time than -O1.
SANITIZE := -O2 -g -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
LDLIBS := -lm
# The runner reads JSON (safetensors headers, configs, policies) through the system cJSON.
EVAL_LDLIBS := -lcjson -lm -lpthread
LLAMA_SRC := examples/llama.c examples/llama.h kvmix.h
# The kvmix-backed cache and the policies (it compiles the kvmix implementation).
KV_SRC := examples/kvmix_kv.c examples/kvmix_kv.h examples/json_number.h kvmix.h
# The template-tag tools: spec JSON (it compiles the kvmix implementation) and tokenizer.json.
TAG_SRC := examples/tag_spec_json.c examples/tag_spec_json.h examples/hf_tokenizer.c \
	examples/hf_tokenizer.h kvmix.h
TAG_LDLIBS := -lcjson -lm
# The intent residual's weight documents (they take tag_spec_json.c's error messages, file reading
# and kvmix implementation).
RESIDUAL_JSON := examples/intent_residual_json.c examples/intent_residual_json.h
RESIDUAL_SRC := $(RESIDUAL_JSON) examples/tag_spec_json.c examples/tag_spec_json.h kvmix.h
TAG_TOOLS := $(BUILD)/kvmix-tag $(BUILD)/kvmix-tagspec

NVCC ?= $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
NVCCFLAGS := -std=c++17 -O3 -gencode=arch=compute_90,code=sm_90 -Xcompiler -Wall,-Wextra,-Werror
CUDA_ARCHS := 80 86 89 100 120
CUDA_ARCH_CHECKS := $(foreach a,$(CUDA_ARCHS),$(BUILD)/kvmix_cuda_sm$(a).o)

UNIT_SRC := tests/harness.c $(sort $(wildcard tests/unit_*.c))
FUZZ_RUNS ?= 20000
FUZZ_TARGETS := formats view payload safetensors policy tags tagspec allocation probe residual
FUZZ_RUNNERS := $(patsubst %,$(BUILD)/fuzz_%_run,$(FUZZ_TARGETS))
MODEL_TESTS := $(BUILD)/model_test_llama $(BUILD)/model_test_tags $(BUILD)/model_test_calibrate \
	$(BUILD)/model_test_probe $(BUILD)/model_test_evict $(BUILD)/model_test_eval

.PHONY: all demo eval test test-cuda bench fuzz format-check clean header-checks cuda-build \
	pd-transfer pd-nccl refmodel-check sweep-check

all: cuda-build pd-transfer pd-nccl $(BUILD)/kvmix-probe $(BUILD)/quickstart $(BUILD)/cache_loop $(BUILD)/kvmix-eval $(BUILD)/kvmix-calibrate $(BUILD)/unit_tests \
	$(BUILD)/bench_formats $(BUILD)/bench_bits $(TAG_TOOLS) $(BUILD)/bench_tags

$(BUILD):
	mkdir -p $(BUILD)

# ---- demo -----------------------------------------------------------------------------------
$(BUILD)/quickstart: examples/quickstart.c kvmix.h | $(BUILD)
	$(CC) $(CFLAGS) $< -o $@ $(LDLIBS)

demo: $(BUILD)/quickstart
	./$(BUILD)/quickstart

$(BUILD)/cache_loop: examples/cache_loop.c kvmix.h | $(BUILD)
	$(CC) $(CFLAGS) $< -o $@ $(LDLIBS)

# ---- reference-model runner and quality harness ----------------------------------------------
EVAL_TAG_SRC := examples/tag_spec_json.c examples/tag_allocation.c
TRANSFER_SRC := examples/transfer_plan.c
# examples/pd_nccl's host-side rules (roles, the sender's schedule, frames), unit-tested on the CPU
PD_NCCL_PLAN_SRC := examples/pd_nccl_plan.c
# The budgeted-eviction driver and the hand-over's runner-free parts (over the CPU runner here;
# evict_gpu.c and transfer_gpu.c add the GPU's).
EVICT_SRC := examples/evict_driver.c
HANDOVER_SRC := examples/transfer_driver.c
# answers scored by question distance (long-session traces)
QUESTION_SRC := examples/question_score.c
$(BUILD)/kvmix-eval: examples/kvmix_eval.c $(LLAMA_SRC) $(KV_SRC) $(EVAL_TAG_SRC) $(TRANSFER_SRC) \
		$(EVICT_SRC) $(HANDOVER_SRC) $(QUESTION_SRC) examples/evict_driver.h \
		examples/transfer_driver.h examples/question_score.h examples/tag_allocation.h \
		examples/tag_spec_json.h $(RESIDUAL_JSON) | $(BUILD)
	$(CC) $(CFLAGS) -I. -Iexamples -DTAG_SPEC_JSON_NO_KVMIX_IMPLEMENTATION examples/kvmix_eval.c \
		examples/llama.c examples/kvmix_kv.c $(EVAL_TAG_SRC) $(TRANSFER_SRC) $(EVICT_SRC) \
		$(HANDOVER_SRC) $(QUESTION_SRC) examples/intent_residual_json.c -o $@ $(EVAL_LDLIBS)

eval: $(BUILD)/kvmix-eval $(BUILD)/kvmix-calibrate

# ---- calibration: runner captures -> per-tag distortion table -> bit allocation ----------------
# llama.c is its kvmix implementation; tag_spec_json.c is built without one.
CALIB_SRC := examples/kvmix_calibrate.c $(LLAMA_SRC) examples/tag_spec_json.c \
	examples/tag_spec_json.h examples/tag_allocation.c examples/tag_allocation.h
CALIB_CC := -I. -Iexamples -DTAG_SPEC_JSON_NO_KVMIX_IMPLEMENTATION examples/kvmix_calibrate.c \
	examples/llama.c examples/tag_spec_json.c examples/tag_allocation.c
$(BUILD)/kvmix-calibrate: $(CALIB_SRC) | $(BUILD)
	$(CC) $(CFLAGS) $(CALIB_CC) -o $@ $(EVAL_LDLIBS)
# The same under the sanitizers, for the calibration model test.
$(BUILD)/kvmix-calibrate-san: $(CALIB_SRC) | $(BUILD)
	$(CC) -std=c11 $(WARN) -ffp-contract=off $(SANITIZE) $(CALIB_CC) -o $@ $(EVAL_LDLIBS)

# ---- template tags: kvmix-tag (ids in, tags out) and kvmix-tagspec (tokenizer.json -> spec) ----
$(BUILD)/kvmix-tag: examples/kvmix_tag.c $(TAG_SRC) | $(BUILD)
	$(CC) $(CFLAGS) -I. -Iexamples examples/kvmix_tag.c examples/tag_spec_json.c \
		examples/hf_tokenizer.c -o $@ $(TAG_LDLIBS)
$(BUILD)/kvmix-tagspec: examples/kvmix_tagspec.c $(TAG_SRC) | $(BUILD)
	$(CC) $(CFLAGS) -I. -Iexamples examples/kvmix_tagspec.c examples/tag_spec_json.c \
		examples/hf_tokenizer.c -o $@ $(TAG_LDLIBS)

# ---- tests ----------------------------------------------------------------------------------
# The header must compile as C99, C11 and C++, and with KVMIX_STATIC, under $(WARN).
$(BUILD)/check_c99: tests/compile_check.c kvmix.h | $(BUILD)
	$(CC) -std=c99 $(WARN) $< -o $@ $(LDLIBS)
$(BUILD)/check_c11: tests/compile_check.c kvmix.h | $(BUILD)
	$(CC) -std=c11 $(WARN) $< -o $@ $(LDLIBS)
$(BUILD)/check_cpp: tests/compile_check.c kvmix.h | $(BUILD)
	$(CXX) -std=c++11 $(WARN) -x c++ $< -o $@ $(LDLIBS)
$(BUILD)/check_static: tests/compile_check.c kvmix.h | $(BUILD)
	$(CC) -std=c99 $(WARN) -DKVMIX_STATIC $< -o $@ $(LDLIBS)
# the core alone (KVMIX_NO_POLICY), as C and as C++
$(BUILD)/check_core: tests/compile_check.c kvmix.h | $(BUILD)
	$(CC) -std=c99 $(WARN) -DKVMIX_NO_POLICY -DKVMIX_STATIC $< -o $@ $(LDLIBS)
$(BUILD)/check_core_cpp: tests/compile_check.c kvmix.h | $(BUILD)
	$(CXX) -std=c++11 $(WARN) -x c++ -DKVMIX_NO_POLICY $< -o $@ $(LDLIBS)

HEADER_CHECKS := $(BUILD)/check_c99 $(BUILD)/check_c11 $(BUILD)/check_cpp $(BUILD)/check_static \
	$(BUILD)/check_core $(BUILD)/check_core_cpp

# ... and build warning-free at every optimization level with gcc and clang: flow warnings such
# as maybe-uninitialized appear only once the optimizer inlines (compile_check.c calls the cache).
# Objects only: the programs above run. Named build/warn_<compiler>_<language>_<level>.o.
WARN_LEVELS := O0 O1 O2 O3 Os
WARN_COMPILERS := gcc clang
WARN_LANGS := c99 c11 cpp
WARN_CHECKS := $(foreach c,$(WARN_COMPILERS),$(foreach l,$(WARN_LANGS),$(foreach o,$(WARN_LEVELS),\
	$(BUILD)/warn_$(c)_$(l)_$(o).o)))
warn_cc = $(if $(filter gcc,$(1)),$(if $(filter cpp,$(2)),g++,gcc),$(if $(filter cpp,$(2)),clang++,clang))
warn_std = $(if $(filter cpp,$(1)),-std=c++11 -x c++,-std=$(1))
$(BUILD)/warn_%.o: tests/compile_check.c kvmix.h | $(BUILD)
	$(call warn_cc,$(word 1,$(subst _, ,$*)),$(word 2,$(subst _, ,$*))) \
		$(call warn_std,$(word 2,$(subst _, ,$*))) $(WARN) -$(word 3,$(subst _, ,$*)) -c $< -o $@
# ... and with the fast decode's AVX2 loops compiled in (x86-64-v3, where the host is x86-64)
X86_64 := $(filter x86_64,$(shell uname -m))
# ... and the AVX-512 loops (x86-64-v4)
# ... and the plain build kept to its portable loops (KVMIX_NO_CPU_DISPATCH)
AVX2_CHECKS := $(if $(X86_64),$(foreach c,$(WARN_COMPILERS),$(foreach l,$(WARN_LANGS),\
	$(BUILD)/avx2_$(c)_$(l).o $(BUILD)/avx512_$(c)_$(l).o $(BUILD)/portable_$(c)_$(l).o)))
$(BUILD)/avx2_%.o: tests/compile_check.c kvmix.h | $(BUILD)
	$(call warn_cc,$(word 1,$(subst _, ,$*)),$(word 2,$(subst _, ,$*))) \
		$(call warn_std,$(word 2,$(subst _, ,$*))) $(WARN) -O2 -march=x86-64-v3 -c $< -o $@
$(BUILD)/avx512_%.o: tests/compile_check.c kvmix.h | $(BUILD)
	$(call warn_cc,$(word 1,$(subst _, ,$*)),$(word 2,$(subst _, ,$*))) \
		$(call warn_std,$(word 2,$(subst _, ,$*))) $(WARN) -O2 -march=x86-64-v4 -c $< -o $@
$(BUILD)/portable_%.o: tests/compile_check.c kvmix.h | $(BUILD)
	$(call warn_cc,$(word 1,$(subst _, ,$*)),$(word 2,$(subst _, ,$*))) \
		$(call warn_std,$(word 2,$(subst _, ,$*))) $(WARN) -O2 -DKVMIX_NO_CPU_DISPATCH -c $< -o $@
header-checks: $(HEADER_CHECKS) $(WARN_CHECKS) $(AVX2_CHECKS)

# ARCH_FLAGS: empty, or -march=x86-64-v3 / -v4 for the _avx2 / _avx512 builds below
$(BUILD)/unit_tests $(BUILD)/unit_tests_avx2 $(BUILD)/unit_tests_avx512 $(BUILD)/unit_tests_portable: $(UNIT_SRC) $(TRANSFER_SRC) $(PD_NCCL_PLAN_SRC) \
		tests/harness.h tests/device_arena_scenario.h examples/transfer_plan.h \
		examples/pd_nccl_plan.h kvmix.h | $(BUILD)
	$(CC) -std=c11 $(WARN) -ffp-contract=off $(ARCH_FLAGS) $(SANITIZE) -I. -Iexamples $(UNIT_SRC) \
		$(TRANSFER_SRC) $(PD_NCCL_PLAN_SRC) -o $@ $(LDLIBS)

# The same units, and fuzz_view, built for x86-64-v3 and -v4, where the fast decode takes its
# AVX2 and AVX-512 loops; the wrapper runs them on a CPU that has them. The plain build takes the
# AVX2 loops where the CPU has them (KVMIX__AVX2_DISPATCH); _portable keeps it to the loops of
# every CPU.
$(BUILD)/unit_tests_avx2 $(BUILD)/fuzz_view_avx2: ARCH_FLAGS := -march=x86-64-v3
$(BUILD)/unit_tests_avx512 $(BUILD)/fuzz_view_avx512: ARCH_FLAGS := -march=x86-64-v4
$(BUILD)/unit_tests_portable $(BUILD)/fuzz_view_portable: ARCH_FLAGS := -DKVMIX_NO_CPU_DISPATCH
$(BUILD)/fuzz_view_avx2 $(BUILD)/fuzz_view_avx512 $(BUILD)/fuzz_view_portable: tests/fuzz_view.c tests/fuzz_driver.c \
		tests/fuzz_invariants.h tests/fuzz_limits.h kvmix.h | $(BUILD)
	$(FUZZ_RUN_CC)

$(BUILD)/unit_%_run: tests/unit_simd.sh $(BUILD)/unit_tests_% $(BUILD)/fuzz_view_% | $(BUILD)
	cp tests/unit_simd.sh $@ && chmod +x $@

# The intent residual's weight reader and writer on good and bad documents.
$(BUILD)/test_residual_json: tests/test_residual_json.c $(RESIDUAL_SRC) | $(BUILD)
	$(CC) -std=c11 $(WARN) $(SANITIZE) -I. -Iexamples tests/test_residual_json.c \
		examples/intent_residual_json.c examples/tag_spec_json.c -o $@ $(TAG_LDLIBS)

# The cache example runs as a test too, under the sanitizers.
$(BUILD)/example_cache_loop: examples/cache_loop.c kvmix.h | $(BUILD)
	$(CC) -std=c11 $(WARN) $(SANITIZE) $< -o $@ $(LDLIBS)

# Model tests take the shared folder as their argument (tests/run_all.sh passes it).
$(BUILD)/model_test_llama: tests/test_llama.c tests/test_policy.c tests/test_policy.h $(LLAMA_SRC) \
		$(KV_SRC) $(EVAL_TAG_SRC) | $(BUILD)
	$(CC) -std=c11 $(WARN) -ffp-contract=off $(SANITIZE) -I. -Iexamples \
		-DTAG_SPEC_JSON_NO_KVMIX_IMPLEMENTATION tests/test_llama.c tests/test_policy.c \
		examples/llama.c examples/kvmix_kv.c $(EVAL_TAG_SRC) -o $@ $(EVAL_LDLIBS)
# Budgeted eviction on the CPU runner, over kvm-small traces.
$(BUILD)/model_test_evict: tests/test_evict.c tests/model_check.h $(LLAMA_SRC) $(KV_SRC) \
		$(EVAL_TAG_SRC) $(EVICT_SRC) examples/evict_driver.h | $(BUILD)
	$(CC) -std=c11 $(WARN) -ffp-contract=off $(SANITIZE) -I. -Iexamples -Itests \
		-DTAG_SPEC_JSON_NO_KVMIX_IMPLEMENTATION tests/test_evict.c examples/llama.c \
		examples/kvmix_kv.c $(EVAL_TAG_SRC) $(EVICT_SRC) -o $@ $(EVAL_LDLIBS)
# Tags on the reference traces and the real tokenizers; it runs the tools too.
$(BUILD)/model_test_tags: tests/test_tags.c tests/model_check.h $(TAG_SRC) $(TAG_TOOLS) | $(BUILD)
	$(CC) -std=c11 $(WARN) $(SANITIZE) -DBUILD_DIR='"$(BUILD)"' -I. -Iexamples tests/test_tags.c \
		examples/tag_spec_json.c examples/hf_tokenizer.c -o $@ $(TAG_LDLIBS)

# Captures two short traces with kvmix-eval and calibrates them with the sanitized kvmix-calibrate.
$(BUILD)/model_test_calibrate: tests/test_calibrate.c tests/model_check.h kvmix.h $(BUILD)/kvmix-eval \
		$(BUILD)/kvmix-calibrate-san | $(BUILD)
	$(CC) -std=c11 $(WARN) $(SANITIZE) -DBUILD_DIR='"$(BUILD)"' -I. tests/test_calibrate.c -o $@ \
		-lcjson -lm

# Fuzz targets as plain programs (no libFuzzer needed) that run N seeded inputs. gcc leaves
# float-to-integer overflow out of -fsanitize=undefined (clang has it): named here, so the smoke
# runs see what the libFuzzer builds see.
FUZZ_SANITIZE := $(SANITIZE) -fsanitize=float-cast-overflow
FUZZ_RUN_CC = $(CC) -std=c11 $(WARN) $(FUZZ_SANITIZE) $(ARCH_FLAGS) -I. $< tests/fuzz_driver.c -o $@ \
	$(LDLIBS)
$(BUILD)/fuzz_%_run: tests/fuzz_%.c tests/fuzz_driver.c tests/fuzz_invariants.h tests/fuzz_limits.h \
		kvmix.h | $(BUILD)
	$(FUZZ_RUN_CC)
$(BUILD)/fuzz_safetensors_run: tests/fuzz_safetensors.c tests/fuzz_seed_driver.h tests/fuzz_limits.h $(LLAMA_SRC) \
		| $(BUILD)
	$(CC) -std=c11 $(WARN) $(FUZZ_SANITIZE) -DFUZZ_DRIVER -Iexamples tests/fuzz_safetensors.c \
		examples/llama.c -o $@ $(EVAL_LDLIBS)
$(BUILD)/fuzz_allocation_run: tests/fuzz_allocation.c tests/fuzz_seed_driver.h tests/fuzz_limits.h $(EVAL_TAG_SRC) \
		examples/tag_allocation.h | $(BUILD)
	$(CC) -std=c11 $(WARN) $(FUZZ_SANITIZE) -DFUZZ_DRIVER -I. -Iexamples tests/fuzz_allocation.c \
		$(EVAL_TAG_SRC) -o $@ $(TAG_LDLIBS)
$(BUILD)/fuzz_probe_run: tests/fuzz_probe.c tests/fuzz_seed_driver.h tests/fuzz_limits.h examples/tier_probe.c \
		examples/tier_probe.h examples/json_number.h examples/tag_spec_json.c | $(BUILD)
	$(CC) -std=c11 $(WARN) $(FUZZ_SANITIZE) -DFUZZ_DRIVER -I. -Iexamples tests/fuzz_probe.c \
		examples/tier_probe.c examples/tag_spec_json.c -o $@ $(TAG_LDLIBS)
$(BUILD)/fuzz_tagspec_run: tests/fuzz_tagspec.c tests/fuzz_seed_driver.h tests/fuzz_limits.h $(TAG_SRC) | $(BUILD)
	$(CC) -std=c11 $(WARN) $(FUZZ_SANITIZE) -DFUZZ_DRIVER -I. -Iexamples tests/fuzz_tagspec.c \
		examples/tag_spec_json.c -o $@ $(TAG_LDLIBS)
$(BUILD)/fuzz_residual_run: tests/fuzz_residual.c tests/fuzz_seed_driver.h tests/fuzz_limits.h \
		$(RESIDUAL_SRC) | $(BUILD)
	$(CC) -std=c11 $(WARN) $(FUZZ_SANITIZE) -DFUZZ_DRIVER -I. -Iexamples tests/fuzz_residual.c \
		examples/intent_residual_json.c examples/tag_spec_json.c -o $@ $(TAG_LDLIBS)
$(BUILD)/fuzz_policy_run: tests/fuzz_policy.c tests/fuzz_seed_driver.h tests/fuzz_limits.h $(LLAMA_SRC) $(KV_SRC) \
		| $(BUILD)
	$(CC) -std=c11 $(WARN) $(FUZZ_SANITIZE) -DFUZZ_DRIVER -I. -Iexamples tests/fuzz_policy.c \
		examples/kvmix_kv.c examples/llama.c -o $@ $(EVAL_LDLIBS)

# The INT4 tolerance probe of a model (needle trials through the CPU runner), its verdict as JSON.
$(BUILD)/kvmix-probe: examples/kvmix_probe.c examples/tier_probe.c examples/tier_probe.h \
		examples/tag_spec_json.c $(LLAMA_SRC) $(KV_SRC) $(TRANSFER_SRC) | $(BUILD)
	$(CC) $(CFLAGS) -I. -Iexamples -DTAG_SPEC_JSON_NO_KVMIX_IMPLEMENTATION examples/kvmix_probe.c \
		examples/tier_probe.c examples/tag_spec_json.c examples/llama.c examples/kvmix_kv.c \
		$(TRANSFER_SRC) -o $@ $(EVAL_LDLIBS)

# The CPU runner's hand-over and eviction through build/kvmix-eval's command line.
$(BUILD)/model_test_eval: tests/test_eval.c tests/model_check.h $(BUILD)/kvmix-eval | $(BUILD)
	$(CC) -std=c11 $(WARN) $(SANITIZE) -DBUILD_DIR='"$(BUILD)"' -I. tests/test_eval.c -o $@ \
		-lcjson -lm

$(BUILD)/model_test_probe: tests/test_probe.c tests/model_check.h $(BUILD)/kvmix-probe | $(BUILD)
	$(CC) -std=c11 $(WARN) $(SANITIZE) -DBUILD_DIR='"$(BUILD)"' -I. tests/test_probe.c -o $@

# The prefill-to-decode example over UCX (libucx-dev), where pkg-config finds it; its model test
# runs the sanitized build on loopback.
UCX_LIBS := $(shell pkg-config --libs ucx 2>/dev/null)
PD_SRC := examples/pd_transfer.c $(LLAMA_SRC) $(KV_SRC) $(TRANSFER_SRC) examples/transfer_plan.h
PD_BUILD = -I. -Iexamples examples/pd_transfer.c examples/llama.c examples/kvmix_kv.c \
	$(TRANSFER_SRC) -o $@ $(UCX_LIBS) $(EVAL_LDLIBS)
ifeq ($(strip $(UCX_LIBS)),)
pd-transfer:
	@echo "UCX not found (libucx-dev): examples/pd_transfer not built"
else
pd-transfer: $(BUILD)/pd_transfer $(BUILD)/model_test_pd_transfer
$(BUILD)/pd_transfer: $(PD_SRC) | $(BUILD)
	$(CC) $(CFLAGS) $(PD_BUILD)
$(BUILD)/pd_transfer-san: $(PD_SRC) | $(BUILD)
	$(CC) -std=c11 $(WARN) -ffp-contract=off $(SANITIZE) $(PD_BUILD)
$(BUILD)/model_test_pd_transfer: tests/test_pd_transfer.c tests/model_check.h \
		$(BUILD)/pd_transfer-san | $(BUILD)
	$(CC) -std=c11 $(WARN) $(SANITIZE) -DBUILD_DIR='"$(BUILD)"' -I. tests/test_pd_transfer.c -o $@
endif

ifeq ($(strip $(NVCC)),)
cuda-build:
	@echo "nvcc not found: CUDA kernel pack and GPU runner not built (host parts are complete without it)"
else
cuda-build: $(BUILD)/kvmix_cuda.o $(BUILD)/kvmix-eval-cuda $(BUILD)/test_gpu_llama $(BUILD)/test_cuda \
	$(BUILD)/bench_serve $(CUDA_ARCH_CHECKS)

# The pack compiles with -Werror for every architecture it serves: Ampere and Ada run the portable
# decode path, Hopper the bulk-copy one, Blackwell the portable one (kvmix_cuda.cu, KVMIX__BULK).
$(BUILD)/kvmix_cuda_sm%.o: kvmix_cuda.cu kvmix_cuda.h kvmix.h | $(BUILD)
	$(NVCC) -std=c++17 -O3 -gencode=arch=compute_$*,code=sm_$* -Xcompiler -Wall,-Wextra,-Werror \
		-c kvmix_cuda.cu -o $@

# the GPU runner: kvmix-eval built with gpu_llama (cuBLAS from the toolkit)
$(BUILD)/gpu_llama.o: examples/gpu_llama.cu examples/gpu_llama.h examples/kvmix_kv.h \
		examples/llama.h kvmix_cuda.h kvmix.h | $(BUILD)
	$(NVCC) $(NVCCFLAGS) -I. -Iexamples -c $< -o $@

$(BUILD)/kvmix-eval-cuda: examples/kvmix_eval.c $(LLAMA_SRC) $(KV_SRC) $(EVAL_TAG_SRC) $(BUILD)/gpu_llama.o \
		$(BUILD)/kvmix_cuda.o examples/evict_driver.c examples/evict_driver.h examples/evict_gpu.c \
		$(TRANSFER_SRC) examples/transfer_driver.c examples/transfer_driver.h examples/transfer_gpu.c \
		examples/transfer_plan.h $(QUESTION_SRC) examples/question_score.h $(RESIDUAL_JSON) | $(BUILD)
	$(CC) $(CFLAGS) -DKVMIX_EVAL_CUDA -I. -Iexamples -c examples/kvmix_eval.c -o $(BUILD)/eval_cuda_main.o
	$(CC) $(CFLAGS) -I. -Iexamples -c examples/intent_residual_json.c -o $(BUILD)/eval_cuda_residual.o
	$(CC) $(CFLAGS) -I. -Iexamples -c $(QUESTION_SRC) -o $(BUILD)/eval_cuda_question.o
	$(CC) $(CFLAGS) -I. -Iexamples -c examples/evict_driver.c -o $(BUILD)/eval_cuda_evict.o
	$(CC) $(CFLAGS) -I. -Iexamples -c examples/evict_gpu.c -o $(BUILD)/eval_cuda_evict_gpu.o
	$(CC) $(CFLAGS) -I. -Iexamples -c examples/transfer_driver.c -o $(BUILD)/eval_cuda_transfer.o
	$(CC) $(CFLAGS) -I. -Iexamples -c examples/transfer_gpu.c -o $(BUILD)/eval_cuda_transfer_gpu.o
	$(CC) $(CFLAGS) -I. -Iexamples -c examples/transfer_plan.c -o $(BUILD)/eval_cuda_plan.o
	$(CC) $(CFLAGS) -I. -Iexamples -c examples/llama.c -o $(BUILD)/eval_cuda_llama.o
	$(CC) $(CFLAGS) -I. -Iexamples -c examples/kvmix_kv.c -o $(BUILD)/eval_cuda_kv.o
	$(CC) $(CFLAGS) -I. -Iexamples -DTAG_SPEC_JSON_NO_KVMIX_IMPLEMENTATION -c \
		examples/tag_spec_json.c -o $(BUILD)/eval_cuda_spec.o
	$(CC) $(CFLAGS) -I. -Iexamples -c examples/tag_allocation.c -o $(BUILD)/eval_cuda_alloc.o
	$(NVCC) $(BUILD)/eval_cuda_main.o $(BUILD)/eval_cuda_llama.o $(BUILD)/eval_cuda_kv.o \
		$(BUILD)/eval_cuda_spec.o $(BUILD)/eval_cuda_alloc.o $(BUILD)/eval_cuda_evict.o \
		$(BUILD)/eval_cuda_evict_gpu.o $(BUILD)/eval_cuda_transfer.o \
		$(BUILD)/eval_cuda_transfer_gpu.o $(BUILD)/eval_cuda_plan.o $(BUILD)/eval_cuda_question.o \
		$(BUILD)/eval_cuda_residual.o $(BUILD)/gpu_llama.o $(BUILD)/kvmix_cuda.o -o $@ -lcublas \
		$(EVAL_LDLIBS)

# It runs build/kvmix-eval and build/kvmix-eval-cuda as the CPU and GPU runners' whole-trace oracle.
$(BUILD)/test_gpu_llama: tests/test_gpu_llama.c tests/model_check.h $(BUILD)/kvmix-eval-cuda \
		$(BUILD)/kvmix-eval | $(BUILD)
	$(CC) $(CFLAGS) -DBUILD_DIR='"$(BUILD)"' -I. -Iexamples -Itests -c tests/test_gpu_llama.c \
		-o $(BUILD)/test_gpu_llama.o
	$(NVCC) $(BUILD)/test_gpu_llama.o $(BUILD)/eval_cuda_llama.o $(BUILD)/eval_cuda_kv.o \
		$(BUILD)/eval_cuda_spec.o $(BUILD)/eval_cuda_alloc.o $(BUILD)/gpu_llama.o \
		$(BUILD)/kvmix_cuda.o -o $@ -lcublas $(EVAL_LDLIBS)

$(BUILD)/bench_serve: bench/bench_serve.c $(BUILD)/kvmix-eval-cuda | $(BUILD)
	$(CC) $(CFLAGS) -I. -Iexamples -c bench/bench_serve.c -o $(BUILD)/bench_serve.o
	$(NVCC) $(BUILD)/bench_serve.o $(BUILD)/eval_cuda_llama.o $(BUILD)/eval_cuda_kv.o \
		$(BUILD)/gpu_llama.o $(BUILD)/kvmix_cuda.o -o $@ -lcublas $(EVAL_LDLIBS)

test-gpu-model: $(BUILD)/test_gpu_llama
	./$(BUILD)/test_gpu_llama $(SHARED)

$(BUILD)/kvmix_cuda.o: kvmix_cuda.cu kvmix_cuda.h kvmix.h | $(BUILD)
	$(NVCC) $(NVCCFLAGS) -c kvmix_cuda.cu -o $@
	$(CC) -std=c99 $(WARN) -fsyntax-only -x c kvmix_cuda.h
endif

# Prefill on some GPUs, decode on others over NCCL (examples/pd_nccl.cu), where the toolkit has
# NCCL; bench/pd_nccl_check.sh runs it on a machine with two GPUs.
NCCL_HEADER := $(if $(strip $(NVCC)),$(wildcard $(dir $(NVCC))../include/nccl.h))
ifeq ($(strip $(NCCL_HEADER)),)
pd-nccl:
	@echo "nvcc or NCCL not found (nccl.h beside nvcc): examples/pd_nccl not built"
else
pd-nccl: $(BUILD)/pd_nccl
$(BUILD)/pd_nccl: examples/pd_nccl.cu $(PD_NCCL_PLAN_SRC) examples/pd_nccl_plan.h \
		$(BUILD)/kvmix-eval-cuda | $(BUILD)
	$(CC) $(CFLAGS) -I. -c $(PD_NCCL_PLAN_SRC) -o $(BUILD)/pd_nccl_plan.o
	$(NVCC) $(NVCCFLAGS) -I. -Iexamples -c examples/pd_nccl.cu -o $(BUILD)/pd_nccl.o
	$(NVCC) $(BUILD)/pd_nccl.o $(BUILD)/pd_nccl_plan.o $(BUILD)/eval_cuda_llama.o \
		$(BUILD)/eval_cuda_kv.o $(BUILD)/eval_cuda_spec.o $(BUILD)/eval_cuda_alloc.o \
		$(BUILD)/eval_cuda_plan.o $(BUILD)/gpu_llama.o $(BUILD)/kvmix_cuda.o -o $@ -lcublas \
		-lnccl $(EVAL_LDLIBS)
endif

UNIT_AVX2 := $(if $(X86_64),$(BUILD)/unit_avx2_run $(BUILD)/unit_avx512_run $(BUILD)/unit_portable_run)
test: $(HEADER_CHECKS) $(WARN_CHECKS) $(AVX2_CHECKS) $(BUILD)/unit_tests $(UNIT_AVX2) \
	$(BUILD)/example_cache_loop \
	$(BUILD)/test_residual_json $(FUZZ_RUNNERS) $(MODEL_TESTS) $(TAG_TOOLS) cuda-build pd-transfer \
	pd-nccl refmodel-check sweep-check
	@FUZZ_TIMEOUT=$(FUZZ_TIMEOUT) FUZZ_RSS_MB=$(FUZZ_RSS_MB) sh tests/run_all.sh "$(BUILD)" \
		"$(SHARED)" $(FUZZ_RUNS) $(HEADER_CHECKS) $(BUILD)/unit_tests $(UNIT_AVX2) \
		$(BUILD)/example_cache_loop $(BUILD)/test_residual_json $(FUZZ_RUNNERS)

# The GPU tests carry compute_80 PTX beside the sm_90 code: CUDA_FORCE_PTX_JIT=1 makes a Hopper
# device compile and run the portable path (test-cuda runs both).
$(BUILD)/test_cuda: tests/test_cuda.cu tests/device_arena_scenario.h kvmix_cuda.cu kvmix_cuda.h kvmix.h | $(BUILD)
	$(NVCC) $(NVCCFLAGS) -gencode=arch=compute_80,code=compute_80 -I. tests/test_cuda.cu \
		kvmix_cuda.cu -o $@

# The long-session eval set is what its seeds generate, with valid answer spans (bench/refmodel).
refmodel-check:
	python3 bench/refmodel/test_longtrace.py
	python3 bench/refmodel/test_longdata.py
	python3 bench/refmodel/test_residual_data.py

# The quality sweeps' handling of failed and odd arms and their tables, over fake runners.
sweep-check:
	python3 bench/sweep_selfcheck.py

test-cuda: $(BUILD)/test_cuda
	./$(BUILD)/test_cuda
	CUDA_FORCE_PTX_JIT=1 ./$(BUILD)/test_cuda

# ---- benchmarks -----------------------------------------------------------------------------
$(BUILD)/bench_formats: bench/bench_formats.c bench/bench_common.h kvmix.h | $(BUILD)
	$(CC) $(CFLAGS) -DKVMIX_BENCH_CFLAGS='"$(CC) $(CFLAGS)"' -I. $< -o $@ $(LDLIBS)

$(BUILD)/bench_cache: bench/bench_cache.c kvmix.h | $(BUILD)
	$(CC) $(CFLAGS) -I. $< -o $@ $(LDLIBS)

$(BUILD)/bench_bits: bench/bench_bits.c kvmix.h | $(BUILD)
	$(CC) $(CFLAGS) -I. $< -o $@ $(LDLIBS)

$(BUILD)/bench_alloc: bench/bench_alloc.c bench/bench_common.h kvmix.h | $(BUILD)
	$(CC) $(CFLAGS) -DKVMIX_BENCH_CFLAGS='"$(CC) $(CFLAGS)"' -I. $< -o $@ $(LDLIBS)

$(BUILD)/bench_tags: bench/bench_tags.c bench/bench_common.h kvmix.h | $(BUILD)
	$(CC) $(CFLAGS) -DKVMIX_BENCH_CFLAGS='"$(CC) $(CFLAGS)"' -I. $< -o $@ $(LDLIBS)

# The fast CPU decode as a user builds it for speed: this machine's vector units, FMA allowed.
BENCH_CPU_FLAGS ?= -O2 -march=native -ffp-contract=fast
$(BUILD)/bench_cpu_decode: bench/bench_cpu_decode.c bench/bench_common.h kvmix.h | $(BUILD)
	$(CC) -std=c11 $(WARN) $(BENCH_CPU_FLAGS) -DKVMIX_BENCH_CFLAGS='"$(CC) $(BENCH_CPU_FLAGS)"' -I. \
		$< -o $@ -lm -lpthread

bench: $(BUILD)/bench_formats $(BUILD)/bench_cache $(BUILD)/bench_bits $(BUILD)/bench_alloc \
		$(BUILD)/bench_tags $(BUILD)/bench_cpu_decode
	./$(BUILD)/bench_formats
	./$(BUILD)/bench_cache
	./$(BUILD)/bench_bits
	./$(BUILD)/bench_alloc
	./$(BUILD)/bench_tags
	./$(BUILD)/bench_cpu_decode

# ---- fuzzing (clang's libFuzzer) -------------------------------------------------------------
FUZZ_SECONDS ?= 60
# -fno-sanitize-recover: a UBSan report ends the run as a finding (libFuzzer saves the input).
LIBFUZZER := clang -std=c11 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
	-fsanitize-coverage-ignorelist=tests/fuzz_coverage_ignore.txt -I. -Iexamples
$(BUILD)/fuzz_%: tests/fuzz_%.c tests/fuzz_invariants.h tests/fuzz_coverage_ignore.txt kvmix.h | $(BUILD)
	$(LIBFUZZER) $< -o $@ $(LDLIBS)
$(BUILD)/fuzz_safetensors: tests/fuzz_safetensors.c $(LLAMA_SRC) | $(BUILD)
	$(LIBFUZZER) tests/fuzz_safetensors.c examples/llama.c -o $@ $(EVAL_LDLIBS)
$(BUILD)/fuzz_allocation: tests/fuzz_allocation.c $(EVAL_TAG_SRC) examples/tag_allocation.h \
		| $(BUILD)
	$(LIBFUZZER) tests/fuzz_allocation.c $(EVAL_TAG_SRC) -o $@ $(TAG_LDLIBS)
$(BUILD)/fuzz_probe: tests/fuzz_probe.c examples/tier_probe.c examples/tag_spec_json.c | $(BUILD)
	$(LIBFUZZER) tests/fuzz_probe.c examples/tier_probe.c examples/tag_spec_json.c -o $@ $(TAG_LDLIBS)
$(BUILD)/fuzz_tagspec: tests/fuzz_tagspec.c $(TAG_SRC) | $(BUILD)
	$(LIBFUZZER) tests/fuzz_tagspec.c examples/tag_spec_json.c -o $@ $(TAG_LDLIBS)
$(BUILD)/fuzz_residual: tests/fuzz_residual.c $(RESIDUAL_SRC) | $(BUILD)
	$(LIBFUZZER) tests/fuzz_residual.c examples/intent_residual_json.c examples/tag_spec_json.c \
		-o $@ $(TAG_LDLIBS)
$(BUILD)/fuzz_policy: tests/fuzz_policy.c $(LLAMA_SRC) $(KV_SRC) | $(BUILD)
	$(LIBFUZZER) tests/fuzz_policy.c examples/kvmix_kv.c examples/llama.c -o $@ $(EVAL_LDLIBS)

# Each target runs FUZZ_SECONDS on its corpus in $(BUILD)/fuzz-corpus/NAME (kept between runs,
# started from the seeds its plain driver writes and from tests/fuzz_regress/NAME). An input that
# runs FUZZ_TIMEOUT seconds or takes the process past FUZZ_RSS_MB MiB is a finding, as a crash
# is: libFuzzer saves it as $(BUILD)/fuzz-findings/NAME-{crash,timeout,oom}-* and the target
# fails. Every target runs; make fuzz fails at the end if any failed.
FUZZ_TIMEOUT ?= 10
FUZZ_RSS_MB ?= 2048
FUZZ_SEEDED := safetensors policy tagspec allocation probe residual
fuzz: $(patsubst %,$(BUILD)/fuzz_%,$(FUZZ_TARGETS)) $(patsubst %,$(BUILD)/fuzz_%_run,$(FUZZ_SEEDED))
	@mkdir -p $(BUILD)/fuzz-findings; failed=; \
	for t in $(FUZZ_TARGETS); do \
		corpus=$(BUILD)/fuzz-corpus/$$t; mkdir -p $$corpus; \
		case " $(FUZZ_SEEDED) " in *" $$t "*) ./$(BUILD)/fuzz_$${t}_run --write-seeds $$corpus;; esac; \
		[ -d tests/fuzz_regress/$$t ] && cp tests/fuzz_regress/$$t/* $$corpus/; \
		echo "== fuzz_$$t: $(FUZZ_SECONDS) s"; \
		./$(BUILD)/fuzz_$$t $$corpus -max_total_time=$(FUZZ_SECONDS) -timeout=$(FUZZ_TIMEOUT) \
			-rss_limit_mb=$(FUZZ_RSS_MB) -print_final_stats=1 \
			-artifact_prefix=$(BUILD)/fuzz-findings/$$t- || failed="$$failed $$t"; \
	done; \
	if [ -n "$$failed" ]; then echo "fuzz: findings in$$failed ($(BUILD)/fuzz-findings)"; exit 1; fi

# ---- style ----------------------------------------------------------------------------------
FORMAT_SRC := kvmix.h $(wildcard kvmix_cuda.h kvmix_cuda.cu examples/*.c examples/*.h examples/*.cu tests/*.c \
	tests/*.h tests/*.cu bench/*.c bench/*.h)
format-check:
	clang-format --dry-run --Werror $(FORMAT_SRC)

clean:
	rm -rf $(BUILD)
