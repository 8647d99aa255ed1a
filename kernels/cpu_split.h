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

/* Claims by contiguous shares (the few-row GEMVs, which stream their weights from memory): the
 * items are cut into one contiguous segment per thread, each with its own counter; thread t
 * claims chunks from segment t in order, then, when that is done, from segments t + 1, t + 2, ...
 * (helping a thread that was preempted). So each core streams one contiguous stretch of the
 * weight, as two independent processes would, instead of interleaved chunks of one matrix, and a
 * preempted thread's share is still taken by the other. Inside a parallel region, with a
 * split_seg_t shared by the team and set up by split_seg_init before the region:
 *     for (int64_t k = 0, lo, hi; split_seg_next(&s, tid, &k, &lo, &hi);) for (i = lo; i < hi; i++) ...
 * Every item is computed exactly once, the same way whatever thread takes it. */
#define SPLIT_SEGS 8
typedef struct {
    struct { int64_t next, end; char pad[48]; } seg[SPLIT_SEGS]; /* one cache line per counter */
    int64_t nseg, chunk;
} split_seg_t;

static inline void split_seg_init(split_seg_t *s, int64_t items, int64_t nseg, int64_t chunk) {
    if (nseg > SPLIT_SEGS) nseg = SPLIT_SEGS;
    if (nseg < 1) nseg = 1;
    s->nseg = nseg;
    s->chunk = chunk < 1 ? 1 : chunk;
    for (int64_t i = 0; i < nseg; i++) {
        s->seg[i].next = items * i / nseg;
        s->seg[i].end = items * (i + 1) / nseg;
    }
}

/* The next chunk [lo, hi) for thread tid; *k: how many segments it has finished (start at 0).
 * Returns 0 when every segment is claimed. */
static inline int split_seg_next(split_seg_t *s, int64_t tid, int64_t *k, int64_t *lo, int64_t *hi) {
    for (; *k < s->nseg; ++*k) {
        const int64_t g = (tid + *k) % s->nseg;
        if (__atomic_load_n(&s->seg[g].next, __ATOMIC_RELAXED) >= s->seg[g].end) continue;
        const int64_t i = __atomic_fetch_add(&s->seg[g].next, s->chunk, __ATOMIC_RELAXED);
        if (i < s->seg[g].end) {
            *lo = i;
            *hi = i + s->chunk < s->seg[g].end ? i + s->chunk : s->seg[g].end;
            return 1;
        }
    }
    return 0;
}

#endif
