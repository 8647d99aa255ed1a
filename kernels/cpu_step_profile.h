/* The native decode step's per-op timer (included by kernels/cpu_decode_layer.c only). */
#ifndef TRITIUM_CPU_STEP_PROFILE_H
#define TRITIUM_CPU_STEP_PROFILE_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Per-op CPU time of threads 0 and 1 (TRITIUM_STEP_PROFILE=1, =wall: the wall clock; off: one
 * getenv per step and one branch per op): ns summed per op and thread since the last read, barrier
 * waits apart (client/bench/step_profile.py prints them). */
enum { OP_NORM1, OP_QKV, OP_ROPE, OP_ATTN, OP_O, OP_NORM2, OP_GATE_UP, OP_SILU, OP_DOWN, OP_WAIT, OP_COUNT };
#define PROF_THREADS 2
static int64_t prof_ns[PROF_THREADS][OP_COUNT], prof_calls;
static int prof_on;
static int64_t cpu_ns(void) { /* this thread's CPU time, or the wall clock (TRITIUM_STEP_PROFILE=wall) */
    struct timespec t;
    clock_gettime(prof_on == 2 ? CLOCK_MONOTONIC : CLOCK_THREAD_CPUTIME_ID, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static int profiling(void) { /* read at every step: a benchmark may switch it on after the load */
    const char *e = getenv("TRITIUM_STEP_PROFILE");
    prof_on = !e ? 0 : !strcmp(e, "1") ? 1 : !strcmp(e, "wall") ? 2 : 0;
    return prof_on;
}

/* out[OP_COUNT + 1]: thread 0's per-op sums and the count of steps since the last call, then reset
 * (every thread's). */
void tritium_decode_layers_profile(int64_t *out) {
    for (int i = 0; i < OP_COUNT; i++) out[i] = prof_ns[0][i];
    out[OP_COUNT] = prof_calls, prof_calls = 0;
    memset(prof_ns, 0, sizeof(prof_ns));
}

/* out[PROF_THREADS * OP_COUNT + 1]: each thread's per-op sums (thread 0's first), then the count of
 * steps since the last call; then reset. */
void tritium_decode_layers_profile_threads(int64_t *out) {
    memcpy(out, prof_ns, sizeof(prof_ns));
    out[PROF_THREADS * OP_COUNT] = prof_calls, prof_calls = 0;
    memset(prof_ns, 0, sizeof(prof_ns));
}

#endif
