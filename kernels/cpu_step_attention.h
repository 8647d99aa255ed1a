/* The native decode step's attention between its threads (included by kernels/cpu_decode_layer.c
 * only): static shares by keys to read, or items claimed from a counter; and which rows of the
 * step an attention row must wait for, so that it can start as soon as those are roped (the
 * step's RoPE + KV write ends without a barrier). */
#ifndef TRITIUM_CPU_STEP_ATTENTION_H
#define TRITIUM_CPU_STEP_ATTENTION_H
#include <sched.h>
#include <stdint.h>

#include "cpu_step_sync.h"

void tritium_paged_decode_heads_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                                     const int32_t *block_tables, int64_t table_stride, int64_t tok, int64_t seq,
                                     int64_t lo, int64_t len, int64_t hq, int64_t hkv, int64_t D, int64_t BS,
                                     float scale, float softcap, int64_t r0, int64_t r1, uint16_t *out);

/* Attention rows [a0, a1) of thread `tid` of `nt`: contiguous, split where the running count of
 * keys to read (len - lo, plus one per row) crosses tid / nt of the total, so a long-context row
 * and many short ones weigh alike. */
static void attention_share(const int64_t *lo, const int64_t *len, int64_t nrows, int tid, int nt, int64_t *a0,
                            int64_t *a1) {
    int64_t total = 0;
    for (int64_t r = 0; r < nrows; r++) total += len[r] - lo[r] + 1;
    int64_t run = 0, r = 0;
    *a0 = *a1 = nrows;
    for (int t = 0; t <= tid + 1 && t <= nt; t++) {
        if (t == nt) break; /* the last bound is nrows */
        while (r < nrows && run * nt < total * t) run += len[r] - lo[r] + 1, r++;
        if (t == tid) *a0 = r;
        if (t == tid + 1) *a1 = r;
    }
}

/* TRITIUM_STEP_ATTN_ITEMS=0 (read each step; A/B benches): a single stream's attention on thread
 * 0 alone under the static shares, not split by heads (attention_static_items). */
static int step_attn_items = 1;

/* The static shares' attention where the step has fewer rows than threads (a single stream): the
 * (row, query head) pairs in order, cut into nt contiguous runs; thread tid computes run tid, a
 * row's heads [r0, r1) in one call (contiguous heads: a KV head's group stays on one thread but
 * at a run's edge). One row's attention runs on every thread; each head's bits are the whole
 * kernel's (tritium_paged_decode_heads_bf16). */
static void attention_static_items(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                                   const int32_t *block_tables, int64_t table_stride, const int64_t *tok,
                                   const int64_t *seq, const int64_t *lo, const int64_t *len, int64_t nrows,
                                   int64_t hq, int64_t hkv, int64_t D, int64_t BS, float scale, uint16_t *out,
                                   int tid, int nt) {
    const int64_t items = nrows * hq, k1 = items * (tid + 1) / nt;
    for (int64_t k = items * tid / nt, e; k < k1; k = e) {
        const int64_t i = k / hq;
        e = (i + 1) * hq < k1 ? (i + 1) * hq : k1;
        tritium_paged_decode_heads_bf16(q, k_cache, v_cache, block_tables, table_stride, tok[i], seq[i], lo[i],
                                        len[i], hq, hkv, D, BS, scale, 0.0f, k - i * hq, e - i * hq, out);
    }
}

/* deps[i] (nrows): bit t set where token row t (T <= 32) writes its key into a block attention row
 * i reads (its block table's entries over keys [lo, len)), and for t = tok[i] (its q row). Returns
 * 0 (the caller keeps the barrier) where the scan would be long: about nrows x blocks x T. */
static int attention_deps(const int64_t *slots, int64_t T, const int32_t *block_tables, int64_t table_stride,
                          const int64_t *tok, const int64_t *seq, const int64_t *lo, const int64_t *len,
                          int64_t nrows, int64_t BS, uint32_t *deps) {
    if (T > 32) return 0;
    int64_t work = 0;
    for (int64_t i = 0; i < nrows; i++) work += ((len[i] - lo[i]) / BS + 2) * T;
    if (work > (1 << 16)) return 0;
    for (int64_t i = 0; i < nrows; i++) {
        uint32_t m = 1u << tok[i];
        const int32_t *table = block_tables + seq[i] * table_stride;
        for (int64_t b = lo[i] / BS; len[i] > lo[i] && b <= (len[i] - 1) / BS; b++)
            for (int64_t t = 0; t < T; t++)
                if (slots[t] / BS == table[b]) m |= 1u << t;
        deps[i] = m;
    }
    return 1;
}

/* Waits until every row in mask m is roped for this layer (roped[t] >= gen, set with release by
 * the thread that roped it): spins, yielding the core after a while (that thread lost its own). */
static void wait_roped(const int64_t *roped, uint32_t m, int64_t gen) {
    for (; m; m &= m - 1) {
        const int t = __builtin_ctz(m);
        for (int n = 0; __atomic_load_n(&roped[t], __ATOMIC_ACQUIRE) < gen; n++) {
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
            if (n > 2000) sched_yield();
        }
    }
}

/* Attention as items claimed from counter c: (row, query heads), in row order. Few rows (fewer
 * than two KV heads' items per thread) split each row by query head, so one row's attention runs
 * on every thread (a KV head's keys are then read once per query head); more rows by KV head
 * (its keys read once). Each head's bits are the whole kernel's (tritium_paged_decode_heads_bf16).
 * roped (not NULL): no barrier after RoPE; item i first waits for the rows in deps[i] to be roped
 * for this layer (roped[t] >= gen). */
static void attention_claimed(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                              const int32_t *block_tables, int64_t table_stride, const int64_t *tok,
                              const int64_t *seq, const int64_t *lo, const int64_t *len, int64_t nrows, int64_t hq,
                              int64_t hkv, int64_t D, int64_t BS, float scale, uint16_t *out, int nt,
                              step_counter_t *c, const int64_t *roped, const uint32_t *deps, int64_t gen) {
    const int64_t w = nrows * hkv >= 2 * nt ? hq / hkv : 1, per = (hq + w - 1) / w, items = nrows * per;
    int64_t t = now_ns(), longest = 0;
    for (int64_t k = claim_next(c); k < items; k = claim_next(c)) {
        const int64_t i = k / per, r0 = k % per * w, r1 = r0 + w < hq ? r0 + w : hq;
        if (roped) wait_roped(roped, deps[i], gen);
        tritium_paged_decode_heads_bf16(q, k_cache, v_cache, block_tables, table_stride, tok[i], seq[i], lo[i],
                                        len[i], hq, hkv, D, BS, scale, 0.0f, r0, r1, out);
        const int64_t t1 = now_ns();
        longest = t1 - t > longest ? t1 - t : longest, t = t1;
    }
    piece_ns = longest;
}

#endif
