/* Paged decode attention on every path of cpu_simd.h: one new token per sequence, bfloat16
 * q and KV cache, read in place from the cache blocks through the block table (no gather copy).
 *
 * For query head h of a decode row with context positions [lo, len):
 *     out_h = sum_j softmax_j(s_j) v_j,   s_j = scale * q_h . k_j
 * and with a soft-cap c > 0 (Gemma 2's attn_logit_softcapping) s_j = c * tanh(scale * q_h . k_j / c),
 * computed in float32 with the online softmax of FlashAttention (Dao et al., 2022) over chunks
 * of CHUNK keys. The grp query heads that share a KV head (GQA, HF repeat_kv order: query head
 * h reads KV head h / grp) are handled together, so each key and value is read once for them.
 * Work items are rows, spread over threads with OpenMP.
 *
 * Layouts: q, out (T, Hq, D); k_cache, v_cache (num_blocks, block_size, Hkv, D);
 * block_tables (B, table_stride) int32. Any D (the last 32 / 16 lanes of a head masked);
 * Hq <= MAXH, Hq * D <= MAXQD.
 *
 * AVX512-BF16 scores keys with VDPBF16PS and exp512; AVX2 and the portable path convert q to
 * float32 once per row and widen each key and value to float32 (8 lanes with FMA on AVX2, 16
 * portable lanes elsewhere), with the same chunked online softmax (exp256 / exp_poly). AVX2's
 * blocked rows (cpu_attention_tile.h) take tiles of a prompt's rows (the same bits).
 *
 * Prefill rows use this kernel too (a query token at position p is a row over keys [lo, p]): a
 * row's result depends only on its query and its keys, in chunks of CHUNK counted from lo, never
 * on the other rows of the step (batch invariance).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_simd.h"

#define MAXH 64      /* query heads */
#define MAXQD 8192   /* query heads x head_dim */
#define CHUNK 64

#if defined(TRITIUM_AVX512)
/* One decode row, query heads [r0, r1) (every head: 0, hq): the keys of a position are contiguous
 * over the KV heads in the cache (Hkv * D values), so the row's cache lines are read once, in
 * order, for all its heads. Each head's scores, softmax and sums are its own (no value crosses
 * heads), so a head's bits do not depend on the range it is computed in. */
static void decode_row(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                       const int32_t *table, int64_t lo, int64_t len, int64_t hq, int64_t hkv,
                       int64_t D, int64_t BS, float scale, float softcap, int64_t r0, int64_t r1, uint16_t *out) {
    const int64_t grp = hq / hkv, dv = (D + 15) / 16, dp = (D + 31) / 32, DP = 16 * dv;
    const int64_t h0 = r0 / grp, h1 = (r1 - 1) / grp + 1; /* the KV heads of query heads [r0, r1) */
    const int64_t pf0 = (h0 * D * 2) & ~(int64_t)63, pf1 = h1 * D * 2; /* their bytes in a cache slot */
    /* lanes of the last 32-wide (dot) and 16-wide (value) chunk of a head */
    const __mmask32 mlast = D % 32 ? (__mmask32)((1u << (D % 32)) - 1) : 0xFFFFFFFFu;
    const __mmask16 vlast = D % 16 ? (__mmask16)((1u << (D % 16)) - 1) : 0xFFFF;
    __m512bh qv[MAXQD / 32 + MAXH];        /* q rows as bf16 pairs for VDPBF16PS */
    float o[MAXQD + 16 * MAXH], m[MAXH], l[MAXH], s[MAXH][CHUNK];
    for (int64_t r = r0; r < r1; r++)
        for (int64_t c = 0; c < dp; c++)
            qv[r * dp + c] = (__m512bh)_mm512_maskz_loadu_epi16(c == dp - 1 ? mlast : 0xFFFFFFFFu,
                                                                (const void *)(q + r * D + 32 * c));
    for (int64_t d = 0; d < hq * DP; d++) o[d] = 0.0f;
    for (int64_t r = 0; r < hq; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    const int64_t row = hkv * D; /* elements of one cache slot: every KV head of one position */
    for (int64_t j0 = lo; j0 < len; j0 += CHUNK) {
        const int64_t nj = len - j0 < CHUNK ? len - j0 : CHUNK;
        int64_t j = 0;
        /* 16 keys at once: one reduce16 gives their 16 sums, each in _mm512_reduce_add_ps's tree */
        for (; j + 16 <= nj; j += 16) {
            const uint16_t *kp[16];
            for (int t = 0; t < 16; t++) {
                const int64_t pos = j0 + j + t;
                kp[t] = k_cache + ((int64_t)table[pos / BS] * BS + pos % BS) * row;
                if (pos + 16 < len) { /* the next block of keys, every head */
                    const char *nk = (const char *)(k_cache + ((int64_t)table[(pos + 16) / BS] * BS + (pos + 16) % BS) * row);
                    for (int64_t b = pf0; b < pf1; b += 64) _mm_prefetch(nk + b, _MM_HINT_T0);
                }
            }
            for (int64_t r = r0; r < r1; r++) {
                    const int64_t h = r / grp;
                    __m512 acc[16];
                    for (int t = 0; t < 16; t++) acc[t] = _mm512_setzero_ps();
                    for (int64_t c = 0; c < dp; c++)
                        for (int t = 0; t < 16; t++)
                            acc[t] = _mm512_dpbf16_ps(acc[t], qv[r * dp + c],
                                                      (__m512bh)_mm512_maskz_loadu_epi16(
                                                          c == dp - 1 ? mlast : 0xFFFFFFFFu,
                                                          (const void *)(kp[t] + h * D + 32 * c)));
                    /* lane 4q + i holds key 4i + q: back to key order, then scaled */
                    const __m512i idx = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
                    _mm512_storeu_ps(&s[r][j], _mm512_mul_ps(_mm512_permutexvar_ps(idx, reduce16(acc)),
                                                             _mm512_set1_ps(scale)));
                    if (softcap > 0.0f)
                        for (int t = 0; t < 16; t++) s[r][j + t] = softcap * tanhf(s[r][j + t] / softcap);
                }
        }
        for (; j < nj; j++) {
            const int64_t pos = j0 + j;
            const uint16_t *kp = k_cache + ((int64_t)table[pos / BS] * BS + pos % BS) * row;
            if (j + 4 < nj) { /* the next positions may sit in another block: prefetch them */
                const int64_t p4 = pos + 4;
                const char *nk = (const char *)(k_cache + ((int64_t)table[p4 / BS] * BS + p4 % BS) * row);
                for (int64_t b = pf0; b < pf1; b += 64) _mm_prefetch(nk + b, _MM_HINT_T0);
            }
            for (int64_t r = r0; r < r1; r++) {
                    const int64_t h = r / grp;
                    __m512 acc = _mm512_setzero_ps();
                    for (int64_t c = 0; c < dp; c++)
                        acc = _mm512_dpbf16_ps(acc, qv[r * dp + c],
                                               (__m512bh)_mm512_maskz_loadu_epi16(
                                                   c == dp - 1 ? mlast : 0xFFFFFFFFu,
                                                   (const void *)(kp + h * D + 32 * c)));
                    const float sc = _mm512_reduce_add_ps(acc) * scale;
                    s[r][j] = softcap > 0.0f ? softcap * tanhf(sc / softcap) : sc;
                }
        }
        for (int64_t r = r0; r < r1; r++) {
            __m512 vm = _mm512_set1_ps(m[r]); /* max in registers: its order does not change it */
            for (int64_t j = 0; j < nj; j += 16)
                vm = _mm512_mask_max_ps(vm, nj - j >= 16 ? 0xFFFF : (__mmask16)((1u << (nj - j)) - 1), vm,
                                        _mm512_loadu_ps(&s[r][j]));
            const float mx = _mm512_reduce_max_ps(vm);
            const float corr = expf(m[r] - mx); /* 0 on the first chunk (m = -inf) */
            __m512 vmx = _mm512_set1_ps(mx), sum = _mm512_setzero_ps();
            for (int64_t j = 0; j < nj; j += 16) {
                __mmask16 k = nj - j >= 16 ? 0xFFFF : (__mmask16)((1u << (nj - j)) - 1);
                __m512 e = _mm512_maskz_mov_ps(k, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, &s[r][j]), vmx)));
                _mm512_mask_storeu_ps(&s[r][j], k, e);
                sum = _mm512_add_ps(sum, e);
            }
            l[r] = l[r] * corr + _mm512_reduce_add_ps(sum);
            m[r] = mx;
            __m512 vc = _mm512_set1_ps(corr);
            for (int64_t c = 0; c < dv; c++)
                _mm512_storeu_ps(&o[r * DP + 16 * c], _mm512_mul_ps(_mm512_loadu_ps(&o[r * DP + 16 * c]), vc));
        }
        for (int64_t j = 0; j < nj; j++) {
            const int64_t pos = j0 + j;
            const uint16_t *vp = v_cache + ((int64_t)table[pos / BS] * BS + pos % BS) * row;
            if (j + 4 < nj) {
                const int64_t p4 = pos + 4;
                const char *nv = (const char *)(v_cache + ((int64_t)table[p4 / BS] * BS + p4 % BS) * row);
                for (int64_t b = pf0; b < pf1; b += 64) _mm_prefetch(nv + b, _MM_HINT_T0);
            }
            for (int64_t h = h0; h < h1; h++)
                for (int64_t c = 0; c < dv; c++) {
                    __m256i raw = _mm256_maskz_loadu_epi16(c == dv - 1 ? vlast : 0xFFFF,
                                                           (const void *)(vp + h * D + 16 * c));
                    __m512 vv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
                    for (int64_t r = h * grp > r0 ? h * grp : r0; r < (h + 1) * grp && r < r1; r++) {
                        float *op = &o[r * DP + 16 * c];
                        _mm512_storeu_ps(op, _mm512_fmadd_ps(_mm512_set1_ps(s[r][j]), vv, _mm512_loadu_ps(op)));
                    }
                }
        }
    }
    for (int64_t r = r0; r < r1; r++) {
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        for (int64_t d = 0; d < D; d++) out[r * D + d] = f32_to_bf16(o[r * DP + d] * inv);
    }
}

#else
#if defined(TRITIUM_AVX2)
/* q (float32) . k (bf16) over D: two 8-lane accumulators (blocks of 8 alternate between them, so
 * the FMA latency is paid half as often), added, a fixed tree, then the D % 8 tail. */
INLINE float dot_qk(const float *q, const uint16_t *k, int64_t D) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    const int64_t D8 = D / 8 * 8;
    int64_t d = 0;
    for (; d + 16 <= D8; d += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), bf16x8_to_f32(k + d), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), bf16x8_to_f32(k + d + 8), acc1);
    }
    if (d < D8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), bf16x8_to_f32(k + d), acc0);
    float s = hsum8(_mm256_add_ps(acc0, acc1));
    for (int64_t d = D8; d < D; d++) s += q[d] * bf16_to_f32(k[d]);
    return s;
}
/* o += p v over D */
INLINE void axpy_v(float *o, float p, const uint16_t *v, int64_t D) {
    const __m256 vp = _mm256_set1_ps(p);
    const int64_t D8 = D / 8 * 8;
    for (int64_t d = 0; d < D8; d += 8)
        _mm256_storeu_ps(o + d, _mm256_fmadd_ps(vp, bf16x8_to_f32(v + d), _mm256_loadu_ps(o + d)));
    for (int64_t d = D8; d < D; d++) o[d] += p * bf16_to_f32(v[d]);
}
/* s[j] = exp(s[j] - mx) for j < n; returns their sum (8 lanes, fixed tree, then the tail) */
INLINE float exp_sub_sum(float *s, int64_t n, float mx) {
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 sum = _mm256_setzero_ps();
    const int64_t n8 = n / 8 * 8;
    for (int64_t j = 0; j < n8; j += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), vmx));
        _mm256_storeu_ps(s + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    float t = hsum8(sum);
    for (int64_t j = n8; j < n; j++) {
        s[j] = exp_poly(s[j] - mx);
        t += s[j];
    }
    return t;
}
#else
INLINE float dot_qk(const float *q, const uint16_t *k, int64_t D) {
    float acc[16] = {0};
    const int64_t D16 = D / 16 * 16;
    for (int64_t d = 0; d < D16; d += 16)
        for (int i = 0; i < 16; i++) acc[i] += q[d + i] * bf16_to_f32(k[d + i]);
    float s = sum16(acc);
    for (int64_t d = D16; d < D; d++) s += q[d] * bf16_to_f32(k[d]);
    return s;
}
INLINE void axpy_v(float *o, float p, const uint16_t *v, int64_t D) {
    for (int64_t d = 0; d < D; d++) o[d] += p * bf16_to_f32(v[d]);
}
INLINE float exp_sub_sum(float *s, int64_t n, float mx) {
    float t = 0.0f;
    for (int64_t j = 0; j < n; j++) s[j] = exp_poly(s[j] - mx);
    for (int64_t j = 0; j < n; j++) t += s[j];
    return t;
}
#endif

#include "cpu_attention_tile.h" /* the blocked rows: decode_tile_blocked */

/* One decode row, query heads [r0, r1), as the AVX-512 kernel: GQA groups read each key and value once. */
static void decode_row_plain(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                       const int32_t *table, int64_t lo, int64_t len, int64_t hq, int64_t hkv,
                       int64_t D, int64_t BS, float scale, float softcap, int64_t r0, int64_t r1, uint16_t *out) {
    const int64_t grp = hq / hkv, row = hkv * D, h0 = r0 / grp, h1 = (r1 - 1) / grp + 1;
    float qf[MAXQD], o[MAXQD], m[MAXH], l[MAXH], s[MAXH][CHUNK];
    for (int64_t d = 0; d < hq * D; d++) {
        qf[d] = bf16_to_f32(q[d]);
        o[d] = 0.0f;
    }
    for (int64_t r = 0; r < hq; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    for (int64_t j0 = lo; j0 < len; j0 += CHUNK) {
        const int64_t nj = len - j0 < CHUNK ? len - j0 : CHUNK;
        for (int64_t j = 0; j < nj; j++) {
            const int64_t pos = j0 + j;
            const uint16_t *kp = k_cache + ((int64_t)table[pos / BS] * BS + pos % BS) * row;
            if (j + 4 < nj) { /* the next positions may sit in another block: prefetch them */
                const int64_t p4 = pos + 4;
                const uint16_t *nk = k_cache + ((int64_t)table[p4 / BS] * BS + p4 % BS) * row;
                for (int64_t b = h0 * D; b < h1 * D; b += 32) PREFETCH(nk + b);
            }
            for (int64_t r = r0; r < r1; r++) {
                    const int64_t h = r / grp;
                    const float sc = dot_qk(qf + r * D, kp + h * D, D) * scale;
                    s[r][j] = softcap > 0.0f ? softcap * tanhf(sc / softcap) : sc;
                }
        }
        for (int64_t r = r0; r < r1; r++) {
            float mx = m[r];
            for (int64_t j = 0; j < nj; j++) mx = s[r][j] > mx ? s[r][j] : mx;
            const float corr = expf(m[r] - mx); /* 0 on the first chunk (m = -inf) */
            l[r] = l[r] * corr + exp_sub_sum(s[r], nj, mx);
            m[r] = mx;
            for (int64_t d = 0; d < D; d++) o[r * D + d] *= corr;
        }
        for (int64_t j = 0; j < nj; j++) {
            const int64_t pos = j0 + j;
            const uint16_t *vp = v_cache + ((int64_t)table[pos / BS] * BS + pos % BS) * row;
            if (j + 4 < nj) {
                const int64_t p4 = pos + 4;
                const uint16_t *nv = v_cache + ((int64_t)table[p4 / BS] * BS + p4 % BS) * row;
                for (int64_t b = h0 * D; b < h1 * D; b += 32) PREFETCH(nv + b);
            }
            for (int64_t r = r0; r < r1; r++) {
                    const int64_t h = r / grp;
                    axpy_v(o + r * D, s[r][j], vp + h * D, D);
                }
        }
    }
    for (int64_t r = r0; r < r1; r++) {
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        for (int64_t d = 0; d < D; d++) out[r * D + d] = f32_to_bf16(o[r * D + d] * inv);
    }
}

static void decode_row(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                       const int32_t *table, int64_t lo, int64_t len, int64_t hq, int64_t hkv,
                       int64_t D, int64_t BS, float scale, float softcap, int64_t r0, int64_t r1, uint16_t *out) {
    decode_row_plain(q, k_cache, v_cache, table, lo, len, hq, hkv, D, BS, scale, softcap, r0, r1, out);
}
#endif

/* rows: for each decode row i, q/out row tok[i], block-table row seq[i], keys [lo[i], len[i]).
 * The AVX2 blocked rows take tiles of rows: a run of rows of one sequence with one lo and lengths
 * one apart (a prompt chunk's consecutive positions), up to tile_rows(), shares each chunk's
 * widened keys and values; a row's bits do not depend on its tile (decode_tile_blocked). */
void tritium_paged_decode_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                               const int32_t *block_tables, int64_t table_stride, const int64_t *tok,
                               const int64_t *seq, const int64_t *lo, const int64_t *len, int64_t nrows,
                               int64_t hq, int64_t hkv, int64_t D, int64_t BS, float scale, float softcap,
                               uint16_t *out) {
#if defined(TRITIUM_AVX2)
    if (D % 8 == 0 && hkv * D <= MAXROWB) {
        const int64_t tmax = tile_rows(hq, D);
        int64_t ntiles = 0;
        int64_t *start = (int64_t *)malloc((size_t)(nrows + 1) * sizeof(int64_t));
        if (start) {
            for (int64_t i = 0; i < nrows; i++)
                if (!(i > 0 && i - start[ntiles - 1] < tmax && seq[i] == seq[i - 1] && lo[i] == lo[i - 1] &&
                      len[i] == len[i - 1] + 1))
                    start[ntiles++] = i;
            start[ntiles] = nrows;
#pragma omp parallel for schedule(dynamic, 1)
            for (int64_t t = 0; t < ntiles; t++) {
                const int64_t i = start[t];
                decode_tile_blocked(q, tok + i, start[t + 1] - i, k_cache, v_cache, block_tables + seq[i] * table_stride,
                                    lo[i], len[i], hq, hkv, D, BS, scale, softcap, 0, hq, out);
            }
            free(start);
            return;
        }
    }
#endif
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < nrows; i++) {
        const int64_t off = tok[i] * hq * D;
        decode_row(q + off, k_cache, v_cache, block_tables + seq[i] * table_stride, lo[i], len[i], hq, hkv, D,
                   BS, scale, softcap, 0, hq, out + off);
    }
}

/* Query heads [r0, r1) of one decode row (tok, seq, lo, len as one entry of the arrays above),
 * computed by the code tritium_paged_decode_bf16 runs for that row, on the calling thread: the
 * same bits, head by head (kernels/cpu_decode_layer.c splits a step's attention into such items). */
void tritium_paged_decode_heads_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                                     const int32_t *block_tables, int64_t table_stride, int64_t tok, int64_t seq,
                                     int64_t lo, int64_t len, int64_t hq, int64_t hkv, int64_t D, int64_t BS,
                                     float scale, float softcap, int64_t r0, int64_t r1, uint16_t *out) {
    if (r1 <= r0) return;
#if defined(TRITIUM_AVX2)
    if (D % 8 == 0 && hkv * D <= MAXROWB) {
        decode_tile_blocked(q, &tok, 1, k_cache, v_cache, block_tables + seq * table_stride, lo, len, hq, hkv, D, BS,
                            scale, softcap, r0, r1, out);
        return;
    }
#endif
    const int64_t off = tok * hq * D;
    decode_row(q + off, k_cache, v_cache, block_tables + seq * table_stride, lo, len, hq, hkv, D, BS, scale, softcap,
               r0, r1, out + off);
}
