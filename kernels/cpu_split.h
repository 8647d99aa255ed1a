/* How the per-op kernels share a call's work items among the threads of a team: claimed
 * (`schedule(dynamic, chunk)`, one atomic add per claim), not cut in fixed halves. On a host whose
 * cores the server's other threads (delivery, tritonserver, the client) take for a moment, a
 * static split makes the whole op wait for the preempted thread's half; with claims the other
 * thread takes the items that are left. Which thread computes an item never changes its
 * arithmetic or order (each item writes its own outputs), so the bits are those of one thread.
 *
 * split_chunk: items per claim, enough that one claim covers about SPLIT_MACS multiply-adds
 * (tens of us of work against tens to hundreds of ns for the claim), and at most a quarter of a
 * thread's share, so a team of T threads makes at least 4 T claims and the tail stays short. */
#ifndef TRITIUM_CPU_SPLIT_H
#define TRITIUM_CPU_SPLIT_H

#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define SPLIT_MACS (1 << 22)

static inline int64_t split_chunk(int64_t items, int64_t macs_per_item) {
#ifdef _OPENMP
    const int64_t nt = omp_in_parallel() ? 1 : omp_get_max_threads();
#else
    const int64_t nt = 1;
#endif
    int64_t c = macs_per_item > 0 ? (SPLIT_MACS + macs_per_item - 1) / macs_per_item : 1;
    const int64_t cap = items / (4 * nt);
    if (c > cap) c = cap;
    return c < 1 ? 1 : c;
}

#endif
