/* Per-input limits for the plain fuzz drivers (tests/fuzz_driver.c, tests/fuzz_seed_driver.h), in
 * libFuzzer's spelling so that `make fuzz` and the smoke runs take the same flags:
 *
 *     -timeout=S          an input that runs S seconds or more fails the run (default 10);
 *     -rss_limit_mb=M     an input after which the process holds more than M MiB fails the run
 *                         (default 2048; 0 turns the check off).
 *
 * A failing input is written to ./timeout-NAME-I or ./oom-NAME-I (NAME the program, I the
 * input's number) before the program exits with status 70 (timeout) or 71 (memory), so a slow
 * or greedy input is a finding to keep, as a crash is. The timeout is an alarm, so an input that
 * never returns is caught too; its handler uses only async-signal-safe calls.
 * A program that includes this header must define _POSIX_C_SOURCE (200809L) before any system
 * header.
 */
#ifndef KVMIX_FUZZ_LIMITS_H
#define KVMIX_FUZZ_LIMITS_H

#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

static struct {
    long timeout_s, rss_limit_mb;
    const char *name;
    const uint8_t *data; /* the input running now */
    size_t size;
    long index;
} fuzz_limits = {10, 2048, "fuzz", NULL, 0, 0};

/* Parses -timeout=S or -rss_limit_mb=M; returns 1 when arg was one of them. */
static int fuzz_limits_arg(const char *arg) {
    char *end;
    long v;
    if (strncmp(arg, "-timeout=", 9) == 0) {
        v = strtol(arg + 9, &end, 10);
        if (*end == 0 && v >= 0) fuzz_limits.timeout_s = v;
        return 1;
    }
    if (strncmp(arg, "-rss_limit_mb=", 14) == 0) {
        v = strtol(arg + 14, &end, 10);
        if (*end == 0 && v >= 0) fuzz_limits.rss_limit_mb = v;
        return 1;
    }
    return 0;
}

/* Writes the running input to ./KIND-NAME-INDEX (async-signal-safe: no stdio, no malloc). */
static void fuzz_limits_save(const char *kind) {
    char path[256], digits[24];
    size_t n = 0, k, d = 0, done = 0;
    long i = fuzz_limits.index;
    int fd;
    for (k = 0; kind[k] && n < 100; k++) path[n++] = kind[k];
    path[n++] = '-';
    for (k = 0; fuzz_limits.name[k] && n < 200; k++) {
        char c = fuzz_limits.name[k];
        path[n++] = c == '/' ? '_' : c;
    }
    path[n++] = '-';
    do digits[d++] = (char)('0' + i % 10);
    while ((i /= 10) > 0 && d < sizeof digits);
    while (d > 0) path[n++] = digits[--d];
    path[n] = 0;
    fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) return;
    while (done < fuzz_limits.size) {
        ssize_t w = write(fd, fuzz_limits.data + done, fuzz_limits.size - done);
        if (w <= 0) break;
        done += (size_t)w;
    }
    close(fd);
    (void)!write(2, "fuzz: input saved as ", 21);
    (void)!write(2, path, n);
    (void)!write(2, "\n", 1);
}

static void fuzz_limits_alarm(int sig) {
    (void)sig;
    (void)!write(2, "fuzz: an input ran past -timeout\n", 33);
    fuzz_limits_save("timeout");
    _exit(70);
}

/* Call once before the first input; name is the program (argv[0], its directory dropped). */
static void fuzz_limits_start(const char *name) {
    struct sigaction sa;
    const char *slash = strrchr(name, '/');
    fuzz_limits.name = slash ? slash + 1 : name;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = fuzz_limits_alarm;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGALRM, &sa, NULL);
}

/* Runs one input under the limits. */
static void fuzz_limits_run(int (*target)(const uint8_t *, size_t), const uint8_t *data,
                            size_t size) {
    struct rusage ru;
    fuzz_limits.data = data;
    fuzz_limits.size = size;
    if (fuzz_limits.timeout_s > 0) alarm((unsigned)fuzz_limits.timeout_s);
    target(data, size);
    alarm(0);
    /* ru_maxrss is the peak in KiB: an input that pushed it past the limit is the one saved */
    if (fuzz_limits.rss_limit_mb > 0 && getrusage(RUSAGE_SELF, &ru) == 0 &&
        ru.ru_maxrss / 1024 > fuzz_limits.rss_limit_mb) {
        fprintf(stderr, "fuzz: peak memory %ld MiB is past -rss_limit_mb=%ld\n",
                (long)(ru.ru_maxrss / 1024), fuzz_limits.rss_limit_mb);
        fuzz_limits_save("oom");
        exit(71);
    }
    fuzz_limits.index++;
}

#endif /* KVMIX_FUZZ_LIMITS_H */
