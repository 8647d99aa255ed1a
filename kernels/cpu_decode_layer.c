/* The decoder layers of a step in one native call: for a few rows (decode, small batches), the
 * Python dispatch between a layer's dozen ops costs about as much as their arithmetic, so the
 * whole layer loop of a Llama-shaped model runs here, over the paged bfloat16 KV cache:
 *
 *     x, r = add_rms_norm(h, r, input_norm)         tritium_add_rms_norm_bf16
 *     qkv  = bf16(x Wqkv^T) (+ b)                   the layer's GEMM kind, rounded once
 *     q    = rope(qkv.q); cache <- rope(k), v       tritium_rope_kv_write_bf16
 *     a    = paged_attention(q, cache)              tritium_paged_decode_bf16
 *     h    = bf16(a Wo^T) (+ b) (* residual multiplier, Granite)
 *     x, r = add_rms_norm(h, r, post_attn_norm)
 *     g    = bf16(x Wgu^T) (+ b);  m = silu(g.gate) * g.up   tritium_silu_mul_bf16
 *     h    = bf16(m Wdown^T) (+ b) (* residual multiplier)
 *
 * Every step is a call of the kernel the per-op path (kernels/ops.py, cpu_linear.py) runs for
 * the same op, with the same roundings, so the result is bit for bit the per-op path's, on every
 * ISA path (this file has no SIMD of its own: it compiles into each path's library and calls that
 * path's kernels), and keeps their batch invariance.
 *
 * Bias add as torch does for bfloat16 tensors: bf16(float(y) + float(b)); Granite's residual
 * multiplier on the o and down outputs likewise, bf16(float(y) * m), as torch multiplies a bf16
 * tensor by a Python float.
 *
 * Threads: with one thread (or an int4 linear and several threads) every kernel above runs as it
 * does per op (its own OpenMP parallel region). With several threads, the whole step is ONE
 * parallel region: each thread takes a static share of each GEMM's output channels (in units of
 * 32) and of attention's rows (by keys to read; fewer rows than threads: by query heads), or with
 * TRITIUM_STEP_CLAIM=1 the threads claim each GEMM's chunks of 32-channel units from a counter of
 * that op, and attention's (row, query heads) items likewise (every channel is computed by the
 * same code and in the same order as in the whole GEMM: the bits depend neither on the thread
 * count nor on which thread computes it; claiming is off by default: slower on a quiet host), and
 * meet at a barrier between ops (cpu_step_sync.h: it spins, with TRITIUM_STEP_PREFETCH prefetching,
 * then sleeps); each thread runs the norms and SiLU on every row itself, rotary splits the rows.
 * A fork/join per op costs a futex wake-up each when idle threads sleep (OMP_WAIT_POLICY=PASSIVE,
 * as servers run); the step wakes its threads once. int4 weights keep their scales as (K / G, N),
 * which a column slice cannot address, so they take the per-op regions. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* syscall() */
#endif
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_simd.h"
#include "cpu_step_sync.h"
#include "cpu_step_attention.h"
#include "cpu_step_profile.h"

/* The kernels this file calls (cpu_gemm.c, cpu_gemm_bf16.c, cpu_glue.c, cpu_decode_attention.c). */
void tritium_bf16_gemm(const uint16_t *x, const uint16_t *w, float *y, int64_t M, int64_t N, int64_t K);
void tritium_w8a16_gemm(const uint16_t *x, const int8_t *w, const float *scale, float *y, int64_t M, int64_t N,
                        int64_t K);
void tritium_w8g_gemm(const uint16_t *x, const int8_t *w, const float *params, int64_t nz, float *y, int64_t M,
                      int64_t N, int64_t K, int64_t G);
void tritium_w4_gemm(const uint16_t *x, const uint8_t *w4, const uint16_t *scale, const uint16_t *zero, float *y,
                     int64_t M, int64_t N, int64_t K, int64_t G);
void tritium_add_rms_norm_bf16(const uint16_t *x, const uint16_t *res, const uint16_t *w, float eps, int64_t T,
                               int64_t H, uint16_t *out, uint16_t *res_out);
void tritium_rope_kv_write_bf16(const uint16_t *qkv, const uint16_t *cos, const uint16_t *ssin, const int64_t *slot,
                                int64_t T, int64_t hq, int64_t hkv, int64_t D, uint16_t *q_out, uint16_t *k_cache,
                                uint16_t *v_cache);
void tritium_silu_mul_bf16(const uint16_t *x, int64_t T, int64_t n, uint16_t *out);
int tritium_i8dot_gemm(const uint16_t *x, const uint8_t *w, const uint16_t *d, const uint16_t *z, const float *r,
                       float *y, int64_t M, int64_t N, int64_t K, int64_t bits);
void tritium_paged_decode_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                               const int32_t *block_tables, int64_t table_stride, const int64_t *tok,
                               const int64_t *seq, const int64_t *lo, const int64_t *len, int64_t nrows,
                               int64_t hq, int64_t hkv, int64_t D, int64_t BS, float scale, float softcap,
                               uint16_t *out);
/* A linear layer's weight as cpu_linear.CpuLinear holds it (kernels/decode_layer.py fills these). */
enum { LIN_BF16 = 0, LIN_INT8 = 1, LIN_INT8G = 2, LIN_INT4 = 3, LIN_I8DOT = 4 };
typedef struct {
    int64_t kind, n, k, group, nz; /* LIN_I8DOT: group = bits (8 or 4) */
    const void *w;        /* bf16 (N, K) | int8 (N, K) | nibbles uint8 (N, K / 2) | i8dot codes */
    const float *scale;   /* LIN_INT8: (N,); LIN_INT4: float16 bits (K / G, N); LIN_I8DOT: r (N,) */
    const float *zero;    /* LIN_INT4: float16 bits (K / G, N), NULL when symmetric */
    const float *params;  /* LIN_INT8G: (N, K / G, nz) */
    const uint16_t *bias; /* bf16 (N,) or NULL */
    const uint16_t *d16, *z16; /* LIN_I8DOT: float16 block scales / zeros (N, K / 32); z16 may be NULL */
} tritium_linear_t;

typedef struct {
    const uint16_t *input_norm, *post_attn_norm; /* (H,) */
    uint16_t *k_cache, *v_cache;                 /* (num_blocks, BS, Hkv, D) */
    tritium_linear_t qkv, o, gate_up, down;
} tritium_decoder_layer_t;

/* Output channels [n0, n1) of out (T, N) bf16 = bf16(x (T, K) W^T) (+ bias) (* mult unless
 * mult == 1); y: float32 scratch of T * (n1 - n0). Returns 0, or -1 when i8dot's scratch
 * allocation failed. */
static int linear_cols(const tritium_linear_t *L, const uint16_t *x, int64_t T, float *y, uint16_t *out, float mult,
                       int64_t n0, int64_t n1) {
    const int64_t N = L->n, K = L->k, n = n1 - n0;
    int rc = 0;
    if (n <= 0) return 0;
    switch (L->kind) {
    case LIN_BF16: tritium_bf16_gemm(x, (const uint16_t *)L->w + n0 * K, y, T, n, K); break;
    case LIN_INT8: tritium_w8a16_gemm(x, (const int8_t *)L->w + n0 * K, L->scale + n0, y, T, n, K); break;
    case LIN_INT8G:
        tritium_w8g_gemm(x, (const int8_t *)L->w + n0 * K, L->params + n0 * (K / L->group) * L->nz, L->nz, y, T, n,
                         K, L->group);
        break;
    case LIN_I8DOT: {
        const int64_t kb = K / 32, wrow = L->group == 8 ? K : K / 2;
        rc = tritium_i8dot_gemm(x, (const uint8_t *)L->w + n0 * wrow, L->d16 + n0 * kb,
                                L->z16 ? L->z16 + n0 * kb : NULL, L->scale + n0, y, T, n, K, L->group);
        break;
    }
    default: /* int4: the whole GEMM (its (K / G, N) scales are not sliced by channel) */
        tritium_w4_gemm(x, (const uint8_t *)L->w, (const uint16_t *)L->scale, (const uint16_t *)L->zero, y, T, N, K,
                        L->group);
        break;
    }
    for (int64_t t = 0; t < T; t++) {
        const float *yr = y + t * n;
        uint16_t *o = out + t * N + n0;
        const uint16_t *b = L->bias ? L->bias + n0 : NULL;
        if (b)
            for (int64_t j = 0; j < n; j++) o[j] = f32_to_bf16(bf16_roundf(yr[j]) + bf16_to_f32(b[j]));
        else
            for (int64_t j = 0; j < n; j++) o[j] = f32_to_bf16(yr[j]);
        if (mult != 1.0f)
            for (int64_t j = 0; j < n; j++) o[j] = f32_to_bf16(bf16_to_f32(o[j]) * mult);
    }
    return rc;
}

/* Thread `tid` of `nt`: its share of the output channels, in units of 32 (a bound is a multiple
 * of 32 or N, so each channel meets the same tiles as in the whole GEMM). */
static int linear_part(const tritium_linear_t *L, const uint16_t *x, int64_t T, float *ws, uint16_t *out, float mult,
                       int tid, int nt) {
    if (L->kind == LIN_INT4) return tid == 0 ? linear_cols(L, x, T, ws, out, mult, 0, L->n) : 0;
    const int64_t units = (L->n + 31) / 32;
    int64_t n0 = units * tid / nt * 32, n1 = units * (tid + 1) / nt * 32;
    n1 = n1 < L->n ? n1 : L->n;
    return linear_cols(L, x, T, ws + T * n0, out, mult, n0, n1 < n0 ? n0 : n1);
}

/* Chunks per thread a GEMM's output units (32 channels) are cut into when the threads claim them:
 * enough that a preempted thread leaves little behind, few enough that each call of a kernel
 * still streams a long run of weights (a chunk of a 576-channel GEMM on two threads: 64 channels).
 * Steps of more rows take half as many: each call quantizes its rows' activations again (W8A8 /
 * W4A8) and starts its tiles' weights cold, a cost that grows with the rows. */
#define CLAIM_CHUNKS 4
#define CLAIM_CHUNKS_ROWS 2 /* above CLAIM_FEW_ROWS rows */
#define CLAIM_FEW_ROWS 4
#define STEP_COUNTERS 6 /* a layer's: qkv, attention, o, gate_up, down, RoPE rows */

static int64_t row_bytes(const tritium_linear_t *L) { /* of one output channel's weights */
    return L->kind == LIN_BF16 ? 2 * L->k : L->kind == LIN_I8DOT && L->group == 4 ? L->k / 2 : L->k;
}
/* Asks for the weights of channels [n0, n0 + 32) in L2 (a chunk's first unit: the kernels request
 * their weights ahead inside a call, so without this a chunk would start cold). */
static void prefetch_unit(const tritium_linear_t *L, int64_t n0) {
    const int64_t rowb = row_bytes(L), n = L->n - n0 < 32 ? L->n - n0 : 32;
    const char *p = (const char *)L->w + n0 * rowb, *e = p + n * rowb;
    for (; p < e; p += 64) __builtin_prefetch(p, 0, 2);
}

/* TRITIUM_STEP_PREFETCH (KiB, read each step; 0, the default: off): how much of its static share
 * of the next GEMM's weights a thread waiting at the barrier before it asks for (barrier_pf); the
 * claimed schedule (c not NULL) does not know its next chunk. Returns the share's first byte. */
#define STEP_PREFETCH_KIB 0 /* no gain measured here on a quiet host (0.94-1.01x, noise +-5 %) */
static int64_t step_pf_bytes;
static const char *share_head(const tritium_linear_t *L, int tid, int nt, const step_counter_t *c, int64_t *bytes) {
    *bytes = 0;
    if (c || !L || L->kind == LIN_INT4 || step_pf_bytes <= 0) return NULL;
    const int64_t units = (L->n + 31) / 32, rb = row_bytes(L), n0 = units * tid / nt * 32;
    const int64_t n1 = units * (tid + 1) / nt * 32 < L->n ? units * (tid + 1) / nt * 32 : L->n;
    *bytes = n1 <= n0 ? 0 : (n1 - n0) * rb < step_pf_bytes ? (n1 - n0) * rb : step_pf_bytes;
    return (const char *)L->w + n0 * rb;
}

/* TRITIUM_STEP_CLAIM=auto: whether this step claims, i.e. a barrier wait of one of the last
 * AUTO_CLAIM_STEPS steps of several threads exceeded STEP_LONG_WAIT_NS (a thread lost its core:
 * claiming lets its peer take what is left of each op); static shares otherwise, the faster on a
 * quiet host. Both schedules give the same bits, so the switch between steps changes none. */
#define AUTO_CLAIM_STEPS 32
static int step_claimed; /* whether the last step of several threads claimed (the head follows it) */
int tritium_decode_layers_claimed(void) { return step_claimed; }
static int auto_claim(void) {
    static int64_t quiet_steps = AUTO_CLAIM_STEPS + 1; /* steps since the last long wait */
    quiet_steps = __atomic_exchange_n(&step_long_waits, 0, __ATOMIC_RELAXED) ? 0 : quiet_steps + 1;
    return quiet_steps <= AUTO_CLAIM_STEPS;
}

/* The channels of a GEMM claimed chunk by chunk from counter c (NULL: linear_part's static
 * share). A chunk's bounds are multiples of 32 (or N), as linear_part's. A thread claims its next
 * chunk as it starts one, and asks for that chunk's first weights while it computes this one (so
 * it holds at most two chunks when it loses its core). */
static int linear_run(const tritium_linear_t *L, const uint16_t *x, int64_t T, float *ws, uint16_t *out, float mult,
                      int tid, int nt, step_counter_t *c) {
    if (!c || L->kind == LIN_INT4) {
        if (!step_share_spin || nt == 1) return linear_part(L, x, T, ws, out, mult, tid, nt);
        const int64_t t0 = now_ns(); /* the share is this thread's piece: a peer later by much more lost its core */
        const int rc = linear_part(L, x, T, ws, out, mult, tid, nt);
        piece_ns = now_ns() - t0;
        return rc;
    }
    const int64_t cpt = T <= CLAIM_FEW_ROWS ? CLAIM_CHUNKS : CLAIM_CHUNKS_ROWS;
    const int64_t units = (L->n + 31) / 32, per = (units + cpt * nt - 1) / (cpt * nt);
    const int64_t chunks = (units + per - 1) / per;
    int rc = 0;
    int64_t t = now_ns(), longest = 0;
    for (int64_t k = claim_next(c), next; k < chunks; k = next) {
        next = claim_next(c);
        if (next < chunks) prefetch_unit(L, next * per * 32);
        const int64_t n0 = k * per * 32, n1 = (k + 1) * per * 32 < L->n ? (k + 1) * per * 32 : L->n;
        rc |= linear_cols(L, x, T, ws + T * n0, out, mult, n0, n1);
        const int64_t t1 = now_ns();
        longest = t1 - t > longest ? t1 - t : longest, t = t1;
    }
    piece_ns = longest;
    return rc;
}

static int64_t max3(int64_t a, int64_t b, int64_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }
/* Sizes of the scratch the caller passes, for T rows: float32 and bf16 element counts. */
void tritium_decode_layers_workspace(int64_t T, int64_t H, int64_t hq, int64_t hkv, int64_t D, int64_t I,
                                     int64_t *f32_elems, int64_t *bf16_elems) {
    const int64_t nqkv = (hq + 2 * hkv) * D;
    *f32_elems = T * max3(nqkv, H, 2 * I);
    *bf16_elems = T * (H + nqkv + 2 * hq * D + 3 * I);
}

/* The layer loop as thread `tid` of `nt` runs it (nt == 1: every kernel opens its own parallel
 * region; nt > 1: inside the caller's parallel region, see the top of this file). */
static int layers_thread(const tritium_decoder_layer_t *layers, int64_t num_layers, int64_t T, int64_t H, int64_t hq,
                         int64_t hkv, int64_t D, int64_t I, float eps, float scale, float residual_mult,
                         uint16_t *hidden, uint16_t *residual, int64_t has_residual, const uint16_t *cos,
                         const uint16_t *ssin, const int64_t *slots, const int32_t *block_tables,
                         int64_t table_stride, const int64_t *rows, int64_t nrows, int64_t BS, float *ws_f32,
                         uint16_t *ws_bf16, uint16_t *priv, uint16_t *res_alt, int tid, int nt,
                         step_barrier_t *bar, step_counter_t *ctr, int64_t *roped, const uint32_t *deps) {
    const int64_t nqkv = (hq + 2 * hkv) * D;
    uint16_t *x = ws_bf16, *qkv = x + T * H, *q = qkv + T * nqkv, *attn = q + T * hq * D, *gu = attn + T * hq * D,
             *act = gu + T * 2 * I;
    const int64_t *tok = rows, *seq = rows + nrows, *lo = rows + 2 * nrows, *len = rows + 3 * nrows;
    int rc = 0;
    /* this thread's rows of the small ops (norms, rotary, SiLU: equal counts) and attention rows
     * (balanced by keys to read); each row is computed by the same code whatever thread takes it */
    const int64_t t0 = T * tid / nt, t1 = T * (tid + 1) / nt, nt_rows = t1 - t0;
    int64_t a0, a1;
    attention_share(lo, len, nrows, tid, nt, &a0, &a1);
    const int prof = tid < PROF_THREADS && profiling();
    int64_t tp = prof ? cpu_ns() : 0;
#define TICK(OP)                                                                                                     \
    if (prof) {                                                                                                      \
        const int64_t t_ = cpu_ns();                                                                                 \
        prof_ns[tid][OP] += t_ - tp, tp = t_;                                                                           \
    }
#define BARRIER() BARRIER_TO(NULL)
#define BARRIER_TO(NEXT) /* NEXT: the GEMM after this barrier, whose share a waiting thread prefetches */       \
    {                                                                                                                \
        int64_t pb_;                                                                                                 \
        const char *pf_ = nt > 1 ? share_head(NEXT, tid, nt, c, &pb_) : NULL;                                        \
        barrier_pf(bar, nt, pf_, pf_ ? pb_ : 0);                                                                     \
        if (nt > 1) TICK(OP_WAIT)                                                                                    \
    }
    /* Several threads (red): each runs both norms and the SiLU-mul on every row into its own
     * buffers (priv: x, act, a residual scratch), so the linears that follow read them without
     * waiting for the others: 6 barriers a layer (5 claimed: none after RoPE) instead of 9. Only thread 0 writes the shared
     * residual, alternating between `residual` and res_alt (norm1 reads ra, writes rb; norm2 reads
     * rb, writes ra), so no thread reads rows another is writing; after each layer it is back in
     * `residual`. The same kernel on the same row gives the same bits on every thread. */
    const int red = nt > 1;
    uint16_t *xm = red ? priv : x, *actm = red ? priv + T * H : act, *rs = red ? priv + T * (H + I) : NULL;
    uint16_t *ra = residual, *rb = red ? res_alt : residual;
    const int64_t n0 = red ? 0 : t0, nn = red ? T : nt_rows;
    for (int64_t l = 0; l < num_layers; l++) {
        const tritium_decoder_layer_t *L = layers + l;
        /* this layer's counters (ctr NULL: static shares): qkv, attention, o, gate_up, down */
        step_counter_t *c = ctr ? ctr + STEP_COUNTERS * l : NULL;
        const uint16_t *res_in = has_residual || l ? ra + n0 * H : NULL;
        if (nn)
            tritium_add_rms_norm_bf16(hidden + n0 * H, res_in, L->input_norm, eps, nn, H, xm + n0 * H,
                                      red && tid ? rs : rb + n0 * H);
        TICK(OP_NORM1)
        if (!red) BARRIER()
        rc |= linear_run(&L->qkv, xm, T, ws_f32, qkv, 1.0f, tid, nt, c);
        TICK(OP_QKV)
        BARRIER()
        if (roped) /* rows claimed one by one (the first thread out of the qkv barrier takes them), each
                    * flagged once its q and keys are out: attention items needing only it may start */
            for (int64_t t = claim_next(c + 5); t < T; t = claim_next(c + 5)) {
                tritium_rope_kv_write_bf16(qkv + t * nqkv, cos + t * D, ssin + t * D, slots + t, 1, hq, hkv, D,
                                           q + t * hq * D, L->k_cache, L->v_cache);
                __atomic_store_n(&roped[t], l + 1, __ATOMIC_RELEASE);
            }
        else if (nt_rows)
            tritium_rope_kv_write_bf16(qkv + t0 * nqkv, cos + t0 * D, ssin + t0 * D, slots + t0, nt_rows, hq, hkv, D,
                                       q + t0 * hq * D, L->k_cache, L->v_cache);
        TICK(OP_ROPE)
        if (!roped) BARRIER() /* attention rows read keys other threads may have just written */
        if (c)
            attention_claimed(q, L->k_cache, L->v_cache, block_tables, table_stride, tok, seq, lo, len, nrows, hq, hkv,
                              D, BS, scale, attn, nt, c + 1, roped, deps, l + 1);
        else if (nrows < nt && step_attn_items) /* a single stream: its query heads split between the threads */
            attention_static_items(q, L->k_cache, L->v_cache, block_tables, table_stride, tok, seq, lo, len, nrows, hq,
                                   hkv, D, BS, scale, attn, tid, nt);
        else if (a1 > a0)
            tritium_paged_decode_bf16(q, L->k_cache, L->v_cache, block_tables, table_stride, tok + a0, seq + a0,
                                      lo + a0, len + a0, a1 - a0, hq, hkv, D, BS, scale, 0.0f, attn);
        TICK(OP_ATTN)
        BARRIER_TO(&L->o)
        rc |= linear_run(&L->o, attn, T, ws_f32, hidden, residual_mult, tid, nt, c ? c + 2 : NULL);
        TICK(OP_O)
        BARRIER_TO(&L->gate_up)
        if (nn)
            tritium_add_rms_norm_bf16(hidden + n0 * H, rb + n0 * H, L->post_attn_norm, eps, nn, H, xm + n0 * H,
                                      red && tid ? rs : ra + n0 * H);
        TICK(OP_NORM2)
        if (!red) BARRIER()
        rc |= linear_run(&L->gate_up, xm, T, ws_f32, gu, 1.0f, tid, nt, c ? c + 3 : NULL);
        TICK(OP_GATE_UP)
        BARRIER_TO(&L->down)
        if (nn) tritium_silu_mul_bf16(gu + n0 * 2 * I, nn, I, actm + n0 * I);
        TICK(OP_SILU)
        if (!red) BARRIER()
        rc |= linear_run(&L->down, actm, T, ws_f32, hidden, residual_mult, tid, nt, c ? c + 4 : NULL);
        TICK(OP_DOWN)
        BARRIER_TO(l + 1 < num_layers ? &L[1].qkv : NULL)
    }
    if (prof && tid == 0) prof_calls++;
#undef BARRIER
#undef BARRIER_TO
#undef TICK
    return rc;
}

/* Runs layers[0 .. num_layers) over T rows. hidden (T, H) holds the layer input and receives the
 * last layer's output; residual (T, H) likewise (ignored on input when has_residual is 0: the
 * first layer's residual is its input). cos / ssin (T, D): rotary_tables of the rows' positions;
 * slots (T,): cache slot of each row's new key; rows (4, nrows) int64: token row, block-table
 * row, first key, context length of each attention row (attention_cpu.CpuAttentionPlan).
 * threads: how many threads run the step in one parallel region (<= 1: per-op regions; the
 * caller passes 1 where a linear is int4). Returns 0, or -1 when scratch memory ran out. */
int tritium_decode_layers_bf16(const tritium_decoder_layer_t *layers, int64_t num_layers, int64_t T, int64_t H,
                               int64_t hq, int64_t hkv, int64_t D, int64_t I, float eps, float scale,
                               float residual_mult, uint16_t *hidden, uint16_t *residual, int64_t has_residual,
                               const uint16_t *cos, const uint16_t *ssin, const int64_t *slots,
                               const int32_t *block_tables, int64_t table_stride, const int64_t *rows, int64_t nrows,
                               int64_t BS, float *ws_f32, uint16_t *ws_bf16, int64_t threads) {
    step_barrier_t bar = {0, 0, 0};
    uint32_t *deps = NULL;
    int rc = 0;
#define LAYERS(TID, NT, PRIV, ALT, CTR, RP)                                                                                 \
    layers_thread(layers, num_layers, T, H, hq, hkv, D, I, eps, scale, residual_mult, hidden, residual,           \
                  has_residual, cos, ssin, slots, block_tables, table_stride, rows, nrows, BS, ws_f32, ws_bf16, PRIV, \
                  ALT, TID, NT, &bar, CTR, RP, deps)
#ifdef _OPENMP
    if (threads > 1 && !omp_in_parallel()) {
        /* per thread: x (T, H), act (T, I), a residual scratch (T, H); shared: the other residual */
        const int64_t per = T * (2 * H + I);
        uint16_t *mem = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(per * threads + T * H));
        /* the work counters (TRITIUM_STEP_CLAIM=1, or =auto after a long wait; else the static shares) */
        const char *e = getenv("TRITIUM_STEP_CLAIM");
        const int claim = e && (!strcmp(e, "1") || (!strcmp(e, "auto") && auto_claim()));
        step_claimed = claim;
        e = getenv("TRITIUM_STEP_PREFETCH");
        step_pf_bytes = (e && *e ? atoll(e) : STEP_PREFETCH_KIB) * 1024;
        e = getenv("TRITIUM_STEP_ATTN_ITEMS");
        step_attn_items = !(e && !strcmp(e, "0"));
        e = getenv("TRITIUM_STEP_SHARE_SPIN");
        step_share_spin = !(e && !strcmp(e, "0"));
        const int64_t nc = STEP_COUNTERS * num_layers + 1, nflag = (T * 8 + 63) / 64, ndep = (nrows * 4 + 63) / 64;
        step_counter_t *ctr = !claim ? NULL
                              : (step_counter_t *)calloc((size_t)(nc + nflag + ndep), sizeof(step_counter_t));
        /* with the counters: each row's roped layer (T) and each attention row's rows (nrows) */
        int64_t *roped = ctr ? (int64_t *)(ctr + nc) : NULL;
        deps = ctr ? (uint32_t *)(ctr + nc + nflag) : NULL;
        if (ctr && !attention_deps(slots, T, block_tables, table_stride, rows, rows + nrows, rows + 2 * nrows,
                                   rows + 3 * nrows, nrows, BS, deps))
            roped = NULL;
        if (!mem || (!ctr && claim)) {
            free(mem), free(ctr);
            return -1;
        }
#pragma omp parallel num_threads((int)threads) reduction(| : rc)
        {
            /* this thread's own ICV: the kernels' parallel regions nested in this one get one
             * thread (torch's OpenMP runtime allows nested teams) */
            omp_set_num_threads(1);
            const int tid = omp_get_thread_num();
            rc |= LAYERS(tid, omp_get_num_threads(), mem + per * tid, mem + per * threads, ctr, roped);
        }
        free(mem), free(ctr);
        return rc ? -1 : 0;
    }
#endif
    (void)threads;
    return LAYERS(0, 1, NULL, NULL, NULL, NULL) ? -1 : 0;
#undef LAYERS
}
