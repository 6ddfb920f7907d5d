/* The INT4 probe tool (examples/kvmix_probe.c) on kvm-small with SHARED/data/eval-dev.jsonl:
 *   - one needle trial at b = 0.35 passes (the answer after the tiered transfer is the
 *     untransferred one's: kvm-small tolerates INT4, bench/QUALITY.md) and the verdict document
 *     says so, consistently (trials 1, pass 1, passed 1, allow_int4 true), written to --out;
 *   - a budget below all-INT4 (every token would not fit) is an error, exit status 1;
 *   - bad options: exit status 2.
 * Usage: test_probe SHARED_DIR (from the repository root). Prints "N passed, N failed". */
#define _POSIX_C_SOURCE 200809L
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef BUILD_DIR
#define BUILD_DIR "build"
#endif
#define TOOL BUILD_DIR "/kvmix-probe"
#define OUT  BUILD_DIR "/.test-probe.json"

#include "model_check.h"

static int run(const char *shared, const char *args, char **out) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             TOOL " --model %s/models/kvm-small.safetensors --data %s/data/eval-dev.jsonl %s 2>&1",
             shared, shared, args);
    return run_command_exit(cmd, out);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: test_probe SHARED_DIR\n");
        return 2;
    }
    char *out = NULL, *doc = NULL;
    remove(OUT);
    CHECK(run(argv[1], "--trials 1 --pass 1 --seed 5 --out " OUT, &out) == 0);
    CHECK(out && strstr(out, "trial 0: ") && strstr(out, "(pass)"));
    doc = read_file(OUT, NULL);
    CHECK(doc && strstr(doc, "\"kind\":\"kvmix-int4-probe\"") &&
          strstr(doc, "\"model\":\"kvm-small\""));
    CHECK(doc && strstr(doc, "\"trials\":1,\"pass\":1,\"passed\":1,\"allow_int4\":true"));
    free(out), free(doc);
    CHECK(run(argv[1], "--trials 1 --pass 1 --budget 0.3", &out) == 1);
    CHECK(out && strstr(out, "kvmix-probe: the probe did not run"));
    free(out);
    const char *bad[] = {"--trials 2 --pass 3", "--budget 0", "--seed -1", "--trials"};
    for (int i = 0; i < 4; i++) {
        CHECK_MSG(run(argv[1], bad[i], &out) == 2, bad[i]);
        free(out);
    }
    remove(OUT);
    printf("%d passed, %d failed\n", n_passed, n_failed);
    return n_failed == 0 ? 0 : 1;
}
