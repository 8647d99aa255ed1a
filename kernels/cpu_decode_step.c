/* A whole decode step of a bfloat16 Llama-shaped model in one call: the token ids' embedding rows
 * (gathered, and dequantized where the engine stores int8 / int6 codes), the rotary cos / sin rows
 * of their positions from tables built once per engine, every decoder layer
 * (tritium_decode_layers_bf16, kernels/cpu_decode_layer.c) and the final RMSNorm
 * (tritium_add_rms_norm_bf16, kernels/cpu_glue.c). The ctypes side is kernels/decode_step.py.
 *
 * Each value is rounded where the per-op path rounds it (backend/models/decoder.py _embed_rows and
 * _scale_embedding, kernels/rotary_ref.rotary_tables, ops.rms_norm), so the result is the same bits:
 *   int8 / int6 rows: bf16(c * s [/ input_scale]), s the row's scale (or its group's), float32;
 *   bf16 rows: copied;
 *   then, with an embedding multiplier m (rounded to bf16 by the caller): bf16(float(x) * m).
 * A row's result depends on its own id and position only (batch invariance). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_simd.h"
#include "cpu_f16.h"
#include "cpu_step_warm.h"

#define HEAD_MAX_ROWS 32 /* rows of a step at most (kernels/decode_step.py) */

enum { EMB_NONE = 0, EMB_BF16 = 1, EMB_I8 = 2, EMB_I8_PANELS = 3, EMB_I6_PANELS = 4 };
enum { SCALE_F32 = 0, SCALE_BF16 = 1, SCALE_F16 = 2 };

static inline float scale_at(const void *s, int64_t dtype, int64_t i) {
    if (dtype == SCALE_F32) return ((const float *)s)[i];
    const uint16_t h = ((const uint16_t *)s)[i];
    return dtype == SCALE_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

typedef struct {
    int64_t kind;         /* EMB_*; EMB_NONE: the caller passes the embedded rows */
    int64_t vocab, group; /* group 0: one scale per row, scale (V,); else scale (K / group, V) */
    const void *w;        /* (V, H) bf16 | (V, H) int8 | i8dot panels | int6 panels */
    const void *scale;
    int64_t scale_dtype;  /* SCALE_*: the stored scales, widened to float32 exactly */
    const float *input_scale; /* (H,) or NULL: the AWQ-scaled tied head's lookup divides by it */
    float mult;
    int64_t scaled;       /* whether to multiply by mult */
    const uint16_t *cos, *ssin; /* (max_pos, D) bf16: rotary_tables of every position */
    int64_t max_pos;
    const uint16_t *norm; /* (H,) the final norm's weight */
} tritium_step_front_t;

int tritium_decode_layers_bf16(const void *layers, int64_t num_layers, int64_t T, int64_t H, int64_t hq,
                               int64_t hkv, int64_t D, int64_t I, float eps, float scale, float residual_mult,
                               uint16_t *hidden, uint16_t *residual, int64_t has_residual, const uint16_t *cos,
                               const uint16_t *ssin, const int64_t *slots, const int32_t *block_tables,
                               int64_t table_stride, const int64_t *rows, int64_t nrows, int64_t BS, float *ws_f32,
                               uint16_t *ws_bf16, int64_t threads);
void tritium_add_rms_norm_bf16(const uint16_t *x, const uint16_t *res, const uint16_t *w, float eps, int64_t T,
                               int64_t H, uint16_t *out, uint16_t *res_out);
void tritium_head6_rows(const uint8_t *w, const int64_t *ids, int64_t T, int64_t K, int8_t *out);
void tritium_bf16_gemm(const uint16_t *x, const uint16_t *w, float *y, int64_t M, int64_t N, int64_t K);
int tritium_i8dot_gemm(const uint16_t *x, const uint8_t *w, const uint16_t *d, const uint16_t *z, const float *r,
                       float *y, int64_t M, int64_t N, int64_t K, int64_t bits);
int tritium_head6_gemm(const uint16_t *x, const uint8_t *w, const uint16_t *d, const float *r, float *y, int64_t M,
                       int64_t N, int64_t K, int64_t group);

enum { HEAD_NONE = 0, HEAD_I8DOT = 1, HEAD_HEAD6 = 2, HEAD_BF16 = 3 };

/* The LM head as backend/models/decoder.py compute_logits runs it on CPU: x centred first where the
 * head is (bf16(x - in_mean)), the GEMM's float32 output rounded to bf16 (the module's output
 * dtype), widened, plus out_mean where the head is centred. */
typedef struct {
    int64_t kind;           /* HEAD_* */
    int64_t n, param;       /* vocab; i8dot: the code width; head6: the group size */
    const void *w, *d, *z, *r; /* i8dot / head6: codes, d, z (or NULL), r; bf16: w (N, H) */
    const float *in_mean, *out_mean; /* (H,) / (N,) or NULL */
} tritium_step_head_t;

/* Channels [n0, n1) of the head's GEMM for the rows x (T, H) into y (T, n1 - n0) (a thread's
 * share: each channel gets the code and sum order of the whole GEMM; n0 a multiple of 32).
 * Returns 0, or -1 out of memory. */
static int head_cols(const tritium_step_head_t *hd, const uint16_t *x, int64_t T, int64_t H, float *y, int64_t n0,
                     int64_t n1) {
    const int64_t n = n1 - n0, kb = H / 32;
    if (n <= 0) return 0;
    if (hd->kind == HEAD_I8DOT) {
        const int64_t wrow = hd->param == 8 ? H : H / 2;
        return tritium_i8dot_gemm(x, (const uint8_t *)hd->w + n0 * wrow, (const uint16_t *)hd->d + n0 * kb,
                                  hd->z ? (const uint16_t *)hd->z + n0 * kb : NULL, (const float *)hd->r + n0, y, T,
                                  n, H, hd->param);
    }
    if (hd->kind == HEAD_HEAD6) /* panels of 16 channels: 6 x 64 bytes a block of 32; (K / G) x 16 scales */
        return tritium_head6_gemm(x, (const uint8_t *)hd->w + n0 / 16 * kb * 384,
                                  (const uint16_t *)hd->d + n0 * (H / hd->param), (const float *)hd->r + n0, y, T, n,
                                  H, hd->param);
    tritium_bf16_gemm(x, (const uint16_t *)hd->w + n0 * H, y, T, n, H);
    return 0;
}

/* y (T, n), channels [n0, n0 + n), into logits (T, N) as the module rounds them: bf16, widened,
 * plus out_mean where the head is centred. y may be the logits' own slice (T == 1). */
static void head_round(const tritium_step_head_t *hd, const float *y, int64_t T, int64_t n0, int64_t n,
                       float *logits) {
    for (int64_t t = 0; t < T; t++) {
        const float *yr = y + t * n;
        float *o = logits + t * hd->n + n0;
        if (hd->out_mean)
            for (int64_t i = 0; i < n; i++) o[i] = bf16_roundf(yr[i]) + hd->out_mean[n0 + i];
        else
            for (int64_t i = 0; i < n; i++) o[i] = bf16_roundf(yr[i]);
    }
}

/* The first maximal index of y over [i0, i1), a NaN counting as the maximum (the first NaN; *nan
 * then 1), as backend/sampler.argmax_rows over a whole row. */
static int64_t argmax_range(const float *y, int64_t i0, int64_t i1, int *nan) {
    int64_t best = i0;
    float m = y[i0];
    *nan = 0;
    if (m != m) return *nan = 1, i0;
    for (int64_t i = i0 + 1; i < i1; i++) {
        if (y[i] != y[i]) return *nan = 1, i;
        if (y[i] > m) m = y[i], best = i;
    }
    return best;
}

/* TRITIUM_STEP_HEAD_SPLIT (read each step; 1, the default; 0 for A/B benches): with several threads
 * the head runs in one parallel region where thread i takes the i-th share of the vocabulary (in
 * units of 32 channels), rounds it and finds each row's maximum over it, instead of one GEMM of
 * claimed panels followed by the rounding and the argmax on the calling thread alone. The same
 * bits either way: each channel's sum order is the whole GEMM's, and the shares' maxima are
 * combined in order (the first NaN, else the first maximum). A step whose layers claimed their
 * pieces (TRITIUM_STEP_CLAIM=1, or =auto after a long barrier wait: a thread had lost its core)
 * claims the head's panels too. */
#define HEAD_MAX_THREADS 64
int tritium_decode_layers_claimed(void);
static int head_split(void) {
    const char *e = getenv("TRITIUM_STEP_HEAD_SPLIT");
    return !(e && !strcmp(e, "0")) && !tritium_decode_layers_claimed();
}

#ifdef _OPENMP
/* The split head (above) on `threads` threads; T <= HEAD_MAX_ROWS. Returns 0, or -1 out of memory. */
static int head_shares(const tritium_step_head_t *hd, const uint16_t *x, int64_t T, int64_t H, float *logits,
                       int64_t *tokens, int64_t threads) {
    int64_t best[HEAD_MAX_THREADS][HEAD_MAX_ROWS];
    int isnan_[HEAD_MAX_THREADS][HEAD_MAX_ROWS], rc = 0, nt = 1;
    const int64_t N = hd->n, units = (N + 31) / 32;
#pragma omp parallel num_threads((int)threads) reduction(| : rc)
    {
        omp_set_num_threads(1); /* the kernels' own regions nested in this one get one thread */
        const int tid = omp_get_thread_num(), n_t = omp_get_num_threads();
        if (tid == 0) nt = n_t;
        const int64_t n0 = units * tid / n_t * 32, e1 = units * (tid + 1) / n_t * 32, n1 = e1 < N ? e1 : N;
        if (n1 > n0) {
            float *y = T == 1 ? logits + n0 : (float *)malloc(sizeof(float) * (size_t)(T * (n1 - n0)));
            if (!y || head_cols(hd, x, T, H, y, n0, n1)) {
                rc = 1;
            } else {
                head_round(hd, y, T, n0, n1 - n0, logits);
                for (int64_t t = 0; t < T; t++) best[tid][t] = argmax_range(logits + t * N, n0, n1, &isnan_[tid][t]);
            }
            if (T != 1) free(y);
        }
    }
    if (rc) return -1;
    for (int64_t t = 0; t < T; t++) { /* the shares in order: the first NaN, else the first maximum */
        int64_t b = -1;
        for (int i = 0; i < nt; i++) {
            if (units * (i + 1) / nt == units * i / nt) continue; /* an empty share */
            const int64_t c = best[i][t];
            if (isnan_[i][t]) {
                b = c;
                break;
            }
            if (b < 0 || logits[t * N + c] > logits[t * N + b]) b = c;
        }
        tokens[t] = b;
    }
    return 0;
}
#endif

/* logits (T, N) of the rows x (T, H) and each row's argmax into tokens (T,); xc: (T, H) scratch.
 * Returns 0, or -1 out of memory. */
static int head_logits(const tritium_step_head_t *hd, const uint16_t *x, int64_t T, int64_t H, uint16_t *xc,
                       float *logits, int64_t *tokens, int64_t threads) {
    if (hd->in_mean) {
        for (int64_t t = 0; t < T; t++)
            for (int64_t k = 0; k < H; k++) xc[t * H + k] = f32_to_bf16(bf16_to_f32(x[t * H + k]) - hd->in_mean[k]);
        x = xc;
    }
#ifdef _OPENMP
    if (threads > 1 && threads <= HEAD_MAX_THREADS && T <= HEAD_MAX_ROWS && !omp_in_parallel() && head_split())
        return head_shares(hd, x, T, H, logits, tokens, threads);
#endif
    (void)threads;
    if (head_cols(hd, x, T, H, logits, 0, hd->n)) return -1;
    head_round(hd, logits, T, 0, hd->n, logits);
    for (int64_t t = 0; t < T; t++) {
        int nan;
        tokens[t] = argmax_range(logits + t * hd->n, 0, hd->n, &nan);
    }
    return 0;
}

/* The signed codes (H) of row `id` of 8-bit integer-dot panels (kernels/i8dot_pack.py: codes
 * (P, H / 32, 8, 16, 4), [p, b, i, j, e] the code of row 16 p + j, input 32 b + 4 i + e). */
static void panel_row(const uint8_t *w, int64_t id, int64_t H, int8_t *out) {
    const int64_t KB = H / 32, p = id / 16, j = id % 16;
    for (int64_t b = 0; b < KB; b++)
        for (int i = 0; i < 8; i++)
            memcpy(out + 32 * b + 4 * i, w + (((p * KB + b) * 8 + i) * 16 + j) * 4, 4);
}

/* Row `id`'s embedding (H) in bf16; codes: an H-byte scratch. */
static void embed_row(const tritium_step_front_t *f, int64_t id, int64_t H, int8_t *codes, uint16_t *out) {
    if (f->kind == EMB_BF16) {
        memcpy(out, (const uint16_t *)f->w + id * H, sizeof(uint16_t) * (size_t)H);
    } else {
        const int8_t *c = codes;
        if (f->kind == EMB_I8) c = (const int8_t *)f->w + id * H;
        else if (f->kind == EMB_I8_PANELS) panel_row((const uint8_t *)f->w, id, H, codes);
        else tritium_head6_rows((const uint8_t *)f->w, &id, 1, H, codes);
        for (int64_t k = 0; k < H; k++) {
            const float s = scale_at(f->scale, f->scale_dtype, f->group ? (k / f->group) * f->vocab + id : id);
            float v = (float)c[k] * s;
            if (f->input_scale) v = v / f->input_scale[k];
            out[k] = f32_to_bf16(v);
        }
    }
    if (f->scaled)
        for (int64_t k = 0; k < H; k++) out[k] = f32_to_bf16(bf16_to_f32(out[k]) * f->mult);
}

/* TRITIUM_STEP_PROFILE=1 (thread CPU time) or wall: the calling thread's time in the lookup and
 * rotary rows plus the final norm, and in the head plus the argmax (step_profile prints them). */
static int64_t prof_step_ns[2];

static int64_t prof_clock(void) {
    const char *e = getenv("TRITIUM_STEP_PROFILE");
    const int on = !e ? 0 : !strcmp(e, "1") ? 1 : !strcmp(e, "wall") ? 2 : 0;
    if (!on) return 0;
    struct timespec t;
    clock_gettime(on == 2 ? CLOCK_MONOTONIC : CLOCK_THREAD_CPUTIME_ID, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* out[2]: nanoseconds in the lookup + final norm and in the head + argmax since the last call, then reset. */
void tritium_decode_step_profile(int64_t *out) {
    out[0] = prof_step_ns[0], out[1] = prof_step_ns[1];
    prof_step_ns[0] = prof_step_ns[1] = 0;
}

static int step(const tritium_step_front_t *f, const void *layers, int64_t num_layers, const int64_t *ids,
                const int64_t *pos, const uint16_t *hidden_in, int64_t T, int64_t H, int64_t hq, int64_t hkv,
                int64_t D, int64_t I, float eps, float scale, float residual_mult, uint16_t *h, uint16_t *r,
                uint16_t *cos, uint16_t *ssin, const int64_t *slots, const int32_t *block_tables,
                int64_t table_stride, const int64_t *rows, int64_t nrows, int64_t BS, float *ws_f32,
                uint16_t *ws_bf16, int64_t threads, uint16_t *out, const tritium_step_head_t *head, float *logits,
                int64_t *tokens);

/* The step over T rows: ids, pos (T,) int64 (ignored, with hidden_in (T, H) the embedded rows,
 * where the front's kind is EMB_NONE). h, r (T, H) and cos, ssin (T, D) are scratch; out (T, H)
 * receives the final norm's output. With a head (not NULL), logits (T, N) float32 receive every
 * row's logits and tokens (T,) int64 each row's argmax. The other arguments are
 * tritium_decode_layers_bf16's. Returns 0; -1 when scratch memory ran out; -2 an id outside
 * [0, vocab); -3 a position outside [0, max_pos); -4 TRITIUM_STEP_WARM_MIB not an integer in
 * [0, 64] (cpu_step_warm.h). */
int tritium_decode_step_bf16(const tritium_step_front_t *f, const void *layers, int64_t num_layers,
                             const int64_t *ids, const int64_t *pos, const uint16_t *hidden_in, int64_t T,
                             int64_t H, int64_t hq, int64_t hkv, int64_t D, int64_t I, float eps, float scale,
                             float residual_mult, uint16_t *h, uint16_t *r, uint16_t *cos, uint16_t *ssin,
                             const int64_t *slots, const int32_t *block_tables, int64_t table_stride,
                             const int64_t *rows, int64_t nrows, int64_t BS, float *ws_f32, uint16_t *ws_bf16,
                             int64_t threads, uint16_t *out, const tritium_step_head_t *head, float *logits,
                             int64_t *tokens) {
    const long warm_to = warm_mib();
    if (warm_to < 0) return -4;
    warm_step_begin();
    const int rc = step(f, layers, num_layers, ids, pos, hidden_in, T, H, hq, hkv, D, I, eps, scale, residual_mult,
                        h, r, cos, ssin, slots, block_tables, table_stride, rows, nrows, BS, ws_f32, ws_bf16, threads,
                        out, head, logits, tokens);
    warm_step_end(warm_to);
    return rc;
}

static int step(const tritium_step_front_t *f, const void *layers, int64_t num_layers, const int64_t *ids,
                const int64_t *pos, const uint16_t *hidden_in, int64_t T, int64_t H, int64_t hq, int64_t hkv,
                int64_t D, int64_t I, float eps, float scale, float residual_mult, uint16_t *h, uint16_t *r,
                uint16_t *cos, uint16_t *ssin, const int64_t *slots, const int32_t *block_tables,
                int64_t table_stride, const int64_t *rows, int64_t nrows, int64_t BS, float *ws_f32,
                uint16_t *ws_bf16, int64_t threads, uint16_t *out, const tritium_step_head_t *head, float *logits,
                int64_t *tokens) {
    int64_t t0 = prof_clock();
    for (int64_t t = 0; t < T; t++) {
        if (pos[t] < 0 || pos[t] >= f->max_pos) return -3;
        if (f->kind != EMB_NONE && (ids[t] < 0 || ids[t] >= f->vocab)) return -2;
    }
    if (f->kind == EMB_NONE) {
        memcpy(h, hidden_in, sizeof(uint16_t) * (size_t)(T * H));
    } else {
        int8_t *codes = (int8_t *)malloc((size_t)H);
        if (!codes) return -1;
        for (int64_t t = 0; t < T; t++) embed_row(f, ids[t], H, codes, h + t * H);
        free(codes);
    }
    for (int64_t t = 0; t < T; t++) {
        memcpy(cos + t * D, f->cos + pos[t] * D, sizeof(uint16_t) * (size_t)D);
        memcpy(ssin + t * D, f->ssin + pos[t] * D, sizeof(uint16_t) * (size_t)D);
    }
    int64_t t1 = prof_clock();
    if (t0) prof_step_ns[0] += t1 - t0;
    if (tritium_decode_layers_bf16(layers, num_layers, T, H, hq, hkv, D, I, eps, scale, residual_mult, h, r, 0, cos,
                                   ssin, slots, block_tables, table_stride, rows, nrows, BS, ws_f32, ws_bf16,
                                   threads))
        return -1;
    t0 = prof_clock();
    tritium_add_rms_norm_bf16(h, r, f->norm, eps, T, H, out, r);
    t1 = prof_clock();
    if (t0) prof_step_ns[0] += t1 - t0;
    if (!head) return 0;
    if (head_logits(head, out, T, H, h, logits, tokens, threads)) return -1;
    if (t1) prof_step_ns[1] += prof_clock() - t1;
    return 0;
}
