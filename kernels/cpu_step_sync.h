/* Synchronisation of the native decode step's threads (kernels/cpu_decode_layer.c): the barrier
 * between ops and the work counters its threads claim each op's pieces from. Included once. */
#ifndef TRITIUM_CPU_STEP_SYNC_H
#define TRITIUM_CPU_STEP_SYNC_H
#include <limits.h>
#include <sched.h>
#include <stdint.h>
#include <time.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* A barrier for the threads of one parallel region: spin (the others are usually microseconds
 * away: thread 0 runs a norm or the attention while the rest wait), then sleep on a futex (one of
 * them lost its core to another process): a spinning thread would keep the core its peer needs.
 * The spin is bounded by time, not by a count of pause instructions, whose latency differs from
 * CPU to CPU by 20x (and a guest's pause loop may exit to the hypervisor): waking a sleeping
 * thread costs tens of microseconds in a VM, more than most ops of a small step take, so a spin
 * of a few microseconds slept at almost every barrier and made two threads slower than one on
 * an idle host; on a busy one long spins made them slower still (backend/thread_policy.py then
 * picks one thread). */
typedef struct {
    int count, gen, sleepers;
} step_barrier_t;

/* The spin budget adapts: doubled after a wait that ended within BARRIER_MAX_NS (spinning or
 * not: a longer spin would have met the peers without a futex wake-up), halved after a longer
 * one (a peer had lost its core: spinning on only keeps a core from whoever took it), between
 * BARRIER_MIN_NS and BARRIER_MAX_NS (0.3 ms: longer than any op of a step of <= 32 rows
 * here). Shared by the process's steps; a stale value costs speed, never correctness. */
#define BARRIER_MIN_NS 2000
#define BARRIER_MAX_NS 300000
static int64_t barrier_spin_ns = BARRIER_MAX_NS;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void futex_wait(int *addr, int val) {
#ifdef __linux__
    syscall(SYS_futex, addr, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
#else
    (void)addr, (void)val;
    sched_yield();
#endif
}

/* The longest piece this thread took of the op it just finished, set by the claimers (0: none):
 * when its peers run, the last of them arrives within about one piece, so a wait much longer
 * means one lost its core, and the spin stops to hand the core back. */
static __thread int64_t piece_ns;
/* TRITIUM_STEP_SHARE_SPIN (read each step; 0 off): a static share's GEMM time bounds the spin likewise. */
static int step_share_spin;
/* Waits at a barrier longer than STEP_LONG_WAIT_NS (a peer lost its core: no op of a step of <= 32
 * rows runs that long here), counted process-wide for TRITIUM_STEP_CLAIM=auto. */
#define STEP_LONG_WAIT_NS 200000
static int64_t step_long_waits;
#define PIECE_SPIN(ns) (3 * (ns) + 5000)

/* barrier() for a thread that asks, while it waits, for the first bytes of its share of the next
 * op's weights in L2 ([pf, pf + pf_bytes), one 64-byte line per spin): the memory bus keeps
 * streaming weights while the last thread finishes the op, and the next op starts hot. A thread
 * that arrives last prefetches nothing; a wait that turns into a sleep stops prefetching. */
static void barrier_pf(step_barrier_t *b, int nt, const char *pf, int64_t pf_bytes) {
    if (nt == 1) return;
    const int gen = __atomic_load_n(&b->gen, __ATOMIC_ACQUIRE);
    if (__atomic_add_fetch(&b->count, 1, __ATOMIC_ACQ_REL) == nt) {
        __atomic_store_n(&b->count, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&b->gen, gen + 1, __ATOMIC_SEQ_CST);
#ifdef __linux__
        if (__atomic_load_n(&b->sleepers, __ATOMIC_SEQ_CST))
            syscall(SYS_futex, &b->gen, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
#endif
        return;
    }
    const int64_t global = __atomic_load_n(&barrier_spin_ns, __ATOMIC_RELAXED), piece = piece_ns;
    const int64_t budget = piece > 0 && PIECE_SPIN(piece) < global ? PIECE_SPIN(piece) : global;
    piece_ns = 0;
    const int64_t start = now_ns(), until = start + budget;
    const char *pf_end = pf ? pf + pf_bytes : NULL;
    int64_t seen = start; /* the clock at the last check */
    for (int spins = 1;; spins++) {
        if (__atomic_load_n(&b->gen, __ATOMIC_ACQUIRE) != gen) {
            if (seen - start > STEP_LONG_WAIT_NS) __atomic_add_fetch(&step_long_waits, 1, __ATOMIC_RELAXED);
            if (global < BARRIER_MAX_NS)
                __atomic_store_n(&barrier_spin_ns, global * 2 < BARRIER_MAX_NS ? global * 2 : BARRIER_MAX_NS,
                                 __ATOMIC_RELAXED);
            return;
        }
        if (pf < pf_end) {
            __builtin_prefetch(pf, 0, 2);
            pf += 64;
        }
#if defined(__x86_64__) || defined(__i386__)
        else
            __builtin_ia32_pause();
#endif
        if ((spins & 63) == 0 && (seen = now_ns()) > until) break;
    }
    __atomic_add_fetch(&b->sleepers, 1, __ATOMIC_SEQ_CST);
    while (__atomic_load_n(&b->gen, __ATOMIC_SEQ_CST) == gen) futex_wait(&b->gen, gen);
    __atomic_sub_fetch(&b->sleepers, 1, __ATOMIC_SEQ_CST);
    /* the whole wait: within the longest spin, a longer spin would have met the peer (grow);
     * beyond it, the peer had lost its core (shrink) */
    const int64_t waited = now_ns() - start, next = waited <= BARRIER_MAX_NS ? 2 * global : global / 2;
    if (waited > STEP_LONG_WAIT_NS) __atomic_add_fetch(&step_long_waits, 1, __ATOMIC_RELAXED);
    __atomic_store_n(&barrier_spin_ns,
                     next > BARRIER_MAX_NS ? BARRIER_MAX_NS : next < BARRIER_MIN_NS ? BARRIER_MIN_NS : next,
                     __ATOMIC_RELAXED);
}

static void barrier(step_barrier_t *b, int nt) { barrier_pf(b, nt, NULL, 0); }

/* Work claiming: the threads take an op's pieces (a GEMM's chunks of output channels, attention's
 * (row, query heads) items) from one counter, in increasing order, until it passes the count; a
 * thread that lost its core holds the others at the next barrier for the piece it is in, not for
 * a fixed share. Which thread computes a piece never changes its bits: each piece runs the code
 * and the sum order it runs in the whole op. One counter per op of a step, on its own cache line,
 * zeroed before the step's parallel region. */
typedef struct {
    int64_t next;
    char pad[64 - sizeof(int64_t)];
} step_counter_t;

static inline int64_t claim_next(step_counter_t *c) { return __atomic_fetch_add(&c->next, 1, __ATOMIC_RELAXED); }

#endif
