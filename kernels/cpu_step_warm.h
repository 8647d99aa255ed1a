/* Warming the next decode step's first weights between steps (included by kernels/cpu_decode_step.c
 * only). Between two native steps the caller runs Python (sampling, the scheduler, the server's
 * output): a few hundred microseconds in which the memory bus idles and the step's second core
 * waits. TRITIUM_STEP_WARM_MIB (read each step; 0, the default: off; at most 64) has a background
 * thread read that many MiB of the weights the next step reads first (the first layers' linears,
 * in the step's order, registered by kernels/decode_step.py) into the caches while the caller is
 * away: the lines it reads leave its core's L2 for the shared L3, where the step finds them. It
 * stops at the next step's start (it then checks a flag every 4 KiB), so it never holds a core a
 * step thread needs for longer than that. Reads only: no bits change. Linux only (elsewhere the knob
 * is checked and does nothing). */
#ifndef TRITIUM_CPU_STEP_WARM_H
#define TRITIUM_CPU_STEP_WARM_H
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cpu_step_sync.h" /* futex_wait */

#define WARM_MAX_RANGES 512
#define WARM_MAX_MIB 64
static struct {
    const char *p[WARM_MAX_RANGES];
    int64_t n[WARM_MAX_RANGES];
    int64_t count, bytes; /* ranges registered; bytes to read this time (set before the kick) */
    int gen, stop;        /* kicks so far; the step is running */
    pid_t pid;            /* the process that started the thread (a forked child starts its own) */
    pthread_mutex_t lock;
} warm = {.lock = PTHREAD_MUTEX_INITIALIZER};

static void *warm_main(void *arg) {
    (void)arg;
    int seen = __atomic_load_n(&warm.gen, __ATOMIC_ACQUIRE);
    for (;;) {
        while (__atomic_load_n(&warm.gen, __ATOMIC_ACQUIRE) == seen) futex_wait(&warm.gen, seen);
        seen = __atomic_load_n(&warm.gen, __ATOMIC_ACQUIRE);
        int64_t left = warm.bytes;
        for (int64_t r = 0; r < warm.count && left > 0; r++) {
            const char *p = warm.p[r];
            const int64_t n = warm.n[r] < left ? warm.n[r] : left;
            for (int64_t off = 0; off < n; off += 64) {
                if ((off & 4095) == 0 && __atomic_load_n(&warm.stop, __ATOMIC_RELAXED)) goto done;
                __builtin_prefetch(p + off, 0, 2);
            }
            left -= n;
        }
    done:;
    }
    return NULL;
}

/* Registers the ranges (pairs of address, bytes, in the order the step reads them); count 0 forgets them. */
void tritium_step_warm_set(const int64_t *ranges, int64_t count) {
    pthread_mutex_lock(&warm.lock);
    __atomic_store_n(&warm.stop, 1, __ATOMIC_SEQ_CST);
    count = count < WARM_MAX_RANGES ? count : WARM_MAX_RANGES;
    for (int64_t i = 0; i < count; i++) warm.p[i] = (const char *)(intptr_t)ranges[2 * i], warm.n[i] = ranges[2 * i + 1];
    warm.count = count;
    pthread_mutex_unlock(&warm.lock);
}

/* The step starts: the warming thread stops. */
static void warm_step_begin(void) { __atomic_store_n(&warm.stop, 1, __ATOMIC_SEQ_CST); }

/* TRITIUM_STEP_WARM_MIB: 0 unset, or -1 when it is not an integer in [0, WARM_MAX_MIB]. */
static long warm_mib(void) {
    const char *e = getenv("TRITIUM_STEP_WARM_MIB");
    if (!e || !*e) return 0;
    char *end;
    const long mib = strtol(e, &end, 10);
    return *end || mib < 0 || mib > WARM_MAX_MIB ? -1 : mib;
}

/* The step ends: with mib > 0 and ranges registered, the thread (started on first use) reads the
 * first mib MiB of them. */
static void warm_step_end(long mib) {
#ifndef __linux__
    mib = 0; /* the thread sleeps on a futex between steps: Linux only */
#endif
    if (mib <= 0 || !warm.count) return;
    pthread_mutex_lock(&warm.lock);
    if (warm.pid != getpid()) {
        pthread_t t;
        pthread_attr_t a;
        pthread_attr_init(&a);
        pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &a, warm_main, NULL) == 0) warm.pid = getpid();
        pthread_attr_destroy(&a);
    }
    pthread_mutex_unlock(&warm.lock);
    if (warm.pid != getpid()) return;
    warm.bytes = (int64_t)mib << 20;
    __atomic_store_n(&warm.stop, 0, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&warm.gen, 1, __ATOMIC_SEQ_CST);
#ifdef __linux__
    syscall(SYS_futex, &warm.gen, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
#endif
}
#endif
