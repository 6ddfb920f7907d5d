/* bench_common.h - what the CPU benchmarks share: wall and CPU clocks, the median's comparison,
   the CPU they ran on, and the compiler flags they were built with. Define _POSIX_C_SOURCE
   (199309L) before any include, for clock_gettime under -std=c99/c11. */
#ifndef KVMIX_BENCH_COMMON_H
#define KVMIX_BENCH_COMMON_H

#include <stdio.h>
#include <string.h>
#include <time.h>

#ifndef KVMIX_BENCH_CFLAGS
#define KVMIX_BENCH_CFLAGS "(not recorded: build with -DKVMIX_BENCH_CFLAGS='\"flags\"')"
#endif

static inline double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* CPU time of this process: with wall time it shows whether other processes took the CPU. */
static inline double cpu_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* qsort order of doubles, for medians. */
static inline int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Prints the CPU model and logical CPU count from /proc/cpuinfo (nothing where it is absent). */
static inline void print_cpu(void) {
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[256], model[256] = "unknown";
    int n_cpus = 0;
    if (!f) return;
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "processor", 9) == 0) n_cpus++;
        if (strcmp(model, "unknown") == 0 && strncmp(line, "model name", 10) == 0) {
            char *colon = strchr(line, ':');
            if (colon) {
                snprintf(model, sizeof model, "%s", colon + 2);
                model[strcspn(model, "\n")] = '\0';
            }
        }
    }
    fclose(f);
    printf("  cpu              %s (%d logical cpus; single-threaded benchmark)\n", model, n_cpus);
}

#endif /* KVMIX_BENCH_COMMON_H */
