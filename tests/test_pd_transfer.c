/* The prefill-to-decode example over UCX on loopback (examples/pd_transfer.c, built with
 * ASan/UBSan as pd_transfer-san), with kvm-small on a trace of SHARED/data/eval-dev.jsonl:
 *   - a clean run at b = 0.46: both workers exit 0, every layer ingested, the realized budget
 *     within 0.01 of 0.46, the cold tokens upgraded while decoding, agreement 1.0 with the
 *     untransferred run (greedy, 48 tokens: the tiers keep this short prompt's answer);
 *   - layer 0 sent broken first (cut short, an invalid tier, another layer's payload): the
 *     decode side refuses it with the reason, its cache unchanged, and the run still succeeds;
 *   - b = 0.35 (below all-INT8): INT8 + INT4, still agreeing at least 0.9; b = 0.3, below
 *     all-INT4, is refused (this example sends every token);
 *   - bad options: exit status 2.
 * Usage: test_pd_transfer SHARED_DIR (from the repository root). Prints "N passed, N failed". */
#define _POSIX_C_SOURCE 200809L
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef BUILD_DIR
#define BUILD_DIR "build"
#endif
#define TOOL  BUILD_DIR "/pd_transfer-san"
#define QUIET "ASAN_OPTIONS=exitcode=86 UBSAN_OPTIONS=exitcode=86 "

#include "model_check.h"

static int run(const char *shared, const char *args, char **out) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             QUIET TOOL " --model %s/models/kvm-small.safetensors --data %s/data/eval-dev.jsonl "
                        "--text 3 --prompt-tokens 400 --generate 48 %s 2>&1",
             shared, shared, args);
    return run_command_exit(cmd, out);
}

static void test_clean(const char *shared) {
    char *out = NULL;
    double b = 0.0, agreement = 0.0;
    CHECK(run(shared, "--budget 0.46", &out) == 0);
    const char *sent = out ? strstr(out, "bytes sent (") : NULL;
    const char *agree = out ? strstr(out, "decode: agreement with the untransferred run ") : NULL;
    CHECK(sent && sscanf(sent, "bytes sent (%lf", &b) == 1 && b > 0.45 && b <= 0.47);
    CHECK(agree &&
          sscanf(agree, "decode: agreement with the untransferred run %lf", &agreement) == 1 &&
          agreement == 1.0);
    CHECK(out && strstr(out, "decode: 4 layers ingested"));
    CHECK(out && strstr(out, "cold tokens upgraded") && strstr(out, ": ok\n"));
    CHECK(out && strstr(out, "pd_transfer: prefill ok, decode ok"));
    CHECK(out && !strstr(out, "refused"));
    free(out);
}

static void test_injected(const char *shared) {
    const char *modes[] = {"truncate", "corrupt", "mismatch"};
    const char *reasons[] = {"buffer too small", "byte layout", "another layer or shape"};
    for (int i = 0; i < 3; i++) {
        char args[64], *out = NULL;
        snprintf(args, sizeof args, "--inject %s", modes[i]);
        CHECK_MSG(run(shared, args, &out) == 0, modes[i]);
        CHECK_MSG(out && strstr(out, "decode: layer 0: payload refused") && strstr(out, reasons[i]),
                  modes[i]);
        CHECK_MSG(out && strstr(out, "cache unchanged: yes"), modes[i]);
        CHECK_MSG(out && strstr(out, "decode: 4 layers ingested"), modes[i]);
        free(out);
    }
}

static void test_int4_and_options(const char *shared) {
    char *out = NULL;
    double agreement = 0.0;
    CHECK(run(shared, "--budget 0.35 --min-agreement 0.9", &out) == 0);
    const char *agree = out ? strstr(out, "decode: agreement with the untransferred run ") : NULL;
    CHECK(agree &&
          sscanf(agree, "decode: agreement with the untransferred run %lf", &agreement) == 1 &&
          agreement >= 0.9);
    CHECK(out && strstr(out, ", INT4 0;") == NULL); /* the mix has INT4 */
    free(out);
    CHECK(run(shared, "--budget 0.3", &out) == 1);
    CHECK(out && strstr(out, "below all-INT4"));
    free(out);
    const char *bad[] = {"--budget 0", "--inject loud", "--generate 0", "--budget"};
    for (int i = 0; i < 4; i++) {
        CHECK_MSG(run(shared, bad[i], &out) == 2, bad[i]);
        free(out);
        out = NULL;
    }
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: test_pd_transfer SHARED_DIR\n");
        return 2;
    }
    test_clean(argv[1]);
    test_injected(argv[1]);
    test_int4_and_options(argv[1]);
    printf("%d passed, %d failed\n", n_passed, n_failed);
    return n_failed == 0 ? 0 : 1;
}
