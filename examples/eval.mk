# Makefile fragment for the reference Llama runner and the quality harness.
# Include it from the top-level Makefile; every output goes under build/.
#   make build/kvmix-eval        the harness CLI
#   make eval-test               unit + quality tests (needs ../shared/models/kvm-small.safetensors)
#   make eval-test-sanitize      the same tests under AddressSanitizer + UBSan
#   make eval-fuzz-driver        the safetensors/capture fuzz target as a plain deterministic driver
#   make build/fuzz-safetensors  the libFuzzer target (clang)

CC ?= cc
EVAL_CFLAGS ?= -std=c11 -Wall -Wextra -Werror -pedantic -O2
EVAL_LDLIBS := -lcjson -lm -lpthread
EVAL_SAN := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all
EVAL_FUZZ_CC ?= clang
EVAL_DEPS := examples/llama.c examples/llama.h

build/kvmix-eval: examples/kvmix_eval.c $(EVAL_DEPS)
	@mkdir -p build
	$(CC) $(EVAL_CFLAGS) -o $@ examples/kvmix_eval.c examples/llama.c $(EVAL_LDLIBS)

build/test-llama: tests/test_llama.c $(EVAL_DEPS)
	@mkdir -p build
	$(CC) $(EVAL_CFLAGS) -Iexamples -o $@ tests/test_llama.c examples/llama.c $(EVAL_LDLIBS)

build/test-llama-san: tests/test_llama.c $(EVAL_DEPS)
	@mkdir -p build
	$(CC) $(EVAL_CFLAGS) -g $(EVAL_SAN) -Iexamples -o $@ tests/test_llama.c examples/llama.c $(EVAL_LDLIBS)

build/fuzz-safetensors-driver: tests/fuzz_safetensors.c $(EVAL_DEPS)
	@mkdir -p build
	$(CC) $(EVAL_CFLAGS) -g $(EVAL_SAN) -DFUZZ_DRIVER -Iexamples -o $@ tests/fuzz_safetensors.c examples/llama.c $(EVAL_LDLIBS)

build/fuzz-safetensors: tests/fuzz_safetensors.c $(EVAL_DEPS)
	@mkdir -p build
	$(EVAL_FUZZ_CC) $(EVAL_CFLAGS) -g -fsanitize=fuzzer,address,undefined -Iexamples -o $@ tests/fuzz_safetensors.c examples/llama.c $(EVAL_LDLIBS)

.PHONY: eval-test eval-test-sanitize eval-fuzz-driver
eval-test: build/test-llama build/fuzz-safetensors-driver
	./build/test-llama
	./build/fuzz-safetensors-driver

eval-test-sanitize: build/test-llama-san
	./build/test-llama-san

eval-fuzz-driver: build/fuzz-safetensors-driver
	./build/fuzz-safetensors-driver
