/* model_check.h - what the standalone model tests (test_tags.c, test_calibrate.c) share: pass and
 * fail counters with a CHECK that prints the first 40 failures, a whole-file reader and a
 * command runner. Each test program includes it in exactly one file. */
#ifndef KVMIX_TESTS_MODEL_CHECK_H
#define KVMIX_TESTS_MODEL_CHECK_H

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>

static int n_passed, n_failed;

static inline bool check_at(bool ok, int line, const char *what) {
    if (ok)
        n_passed++;
    else {
        n_failed++;
        if (n_failed < 40) printf("FAIL line %d: %s\n", line, what);
    }
    return ok;
}
#define CHECK(cond)          check_at((cond), __LINE__, #cond)
#define CHECK_MSG(cond, msg) check_at((cond), __LINE__, (msg))

/* The whole file, NUL-terminated (malloc'd), its size in *n (may be NULL); NULL on failure. */
static inline char *read_file(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (f == NULL) return NULL;
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = size >= 0 ? (char *)malloc((size_t)size + 1) : NULL;
    if (buf != NULL && fread(buf, 1, (size_t)size, f) != (size_t)size) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (buf != NULL) buf[size] = 0;
    if (buf != NULL && n != NULL) *n = (size_t)size;
    return buf;
}

/* Runs cmd through the shell; returns its exit status (-1 when it cannot start) and its stdout,
 * NUL-terminated and malloc'd, in *out (NULL when out of memory; pass out NULL to drop it). */
static inline int run_command(const char *cmd, char **out) {
    FILE *p = popen(cmd, "r");
    if (p == NULL) return -1;
    size_t cap = 1 << 14, n = 0, got;
    char *buf = (char *)malloc(cap + 1);
    while (buf != NULL && (got = fread(buf + n, 1, cap - n, p)) > 0) {
        n += got;
        if (n == cap) {
            char *bigger = (char *)realloc(buf, cap * 2 + 1);
            if (bigger == NULL) free(buf);
            buf = bigger;
            cap *= 2;
        }
    }
    int status = pclose(p);
    if (buf != NULL) buf[n] = 0;
    if (out != NULL)
        *out = buf;
    else
        free(buf);
    return status;
}

/* run_command's status as the program's exit status (-1 when it did not exit normally). */
static inline int run_command_exit(const char *cmd, char **out) {
    int status = run_command(cmd, out);
    return status != -1 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

#endif /* KVMIX_TESTS_MODEL_CHECK_H */
