# Makefile fragment for the reference Llama runner and the quality harness; the top-level
# Makefile includes it. Every output goes under build/. Needs libcjson (Debian libcjson-dev).
#   make build/kvmix-eval            the harness CLI
#   make eval-test                   runner tests + fuzz driver (reads ../shared/models, ../shared/data)
#   make eval-test-sanitize          the same under AddressSanitizer + UndefinedBehaviorSanitizer
#   make build/fuzz_safetensors      the libFuzzer target (clang)
# build/model_test_llama takes the shared directory as its argument, and
# build/fuzz_safetensors_run a mutation count, like the other model tests and fuzz drivers.

CC ?= cc
EVAL_SHARED ?= ../shared
EVAL_CFLAGS ?= -std=c11 -Wall -Wextra -Werror -pedantic -O2 -ffp-contract=off
EVAL_LDLIBS := -lcjson -lm -lpthread
EVAL_SAN := -g -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
EVAL_FUZZ_CC ?= clang
EVAL_DEPS := examples/llama.c examples/llama.h

build/kvmix-eval: examples/kvmix_eval.c $(EVAL_DEPS)
	@mkdir -p build
	$(CC) $(EVAL_CFLAGS) -o $@ examples/kvmix_eval.c examples/llama.c $(EVAL_LDLIBS)

build/model_test_llama: tests/test_llama.c $(EVAL_DEPS)
	@mkdir -p build
	$(CC) $(EVAL_CFLAGS) -Iexamples -o $@ tests/test_llama.c examples/llama.c $(EVAL_LDLIBS)

build/model_test_llama_san: tests/test_llama.c $(EVAL_DEPS)
	@mkdir -p build
	$(CC) $(EVAL_CFLAGS) $(EVAL_SAN) -Iexamples -o $@ tests/test_llama.c examples/llama.c \
		$(EVAL_LDLIBS)

# The fuzz target as a plain driver (no libFuzzer needed), under the sanitizers.
build/fuzz_safetensors_run: tests/fuzz_safetensors.c $(EVAL_DEPS)
	@mkdir -p build
	$(CC) $(EVAL_CFLAGS) $(EVAL_SAN) -DFUZZ_DRIVER -Iexamples -o $@ tests/fuzz_safetensors.c \
		examples/llama.c $(EVAL_LDLIBS)

build/fuzz_safetensors: tests/fuzz_safetensors.c $(EVAL_DEPS)
	@mkdir -p build
	$(EVAL_FUZZ_CC) $(EVAL_CFLAGS) -g -fsanitize=fuzzer,address,undefined -Iexamples -o $@ \
		tests/fuzz_safetensors.c examples/llama.c $(EVAL_LDLIBS)

.PHONY: eval-test eval-test-sanitize
eval-test: build/model_test_llama build/fuzz_safetensors_run
	./build/model_test_llama $(EVAL_SHARED)
	./build/fuzz_safetensors_run 20000

eval-test-sanitize: build/model_test_llama_san build/fuzz_safetensors_run
	./build/model_test_llama_san $(EVAL_SHARED)
	./build/fuzz_safetensors_run 20000
