/* Batch-invariant GEMMs: y (M, N) float32 = x (M, K) bf16 @ W^T, on every path of cpu_simd.h.
 *
 * Every output y[m][n] is reduced in one order that depends on K only, never on M, on the tile
 * a row falls in or on the thread count ("Defeating Nondeterminism in LLM Inference", Thinking
 * Machines Lab, 2025: fix the reduction order per row, not per batch): one 16-lane float32
 * accumulator gathers VDPBF16PS products over k in steps of 32 (the last step masked when
 * K % 32 != 0), then _mm512_reduce_add_ps sums the lanes in a fixed tree. On AVX2 (no bf16 dot
 * product) bf16 is widened to float32 in registers with shifts: 8 float32 lanes take the even and
 * the odd elements of each block of 16 (cpu_simd.h), FMA, a fixed 8-lane tree. The portable path
 * keeps 16 float32 lanes per output (lane i takes k = 16 j + i) and sum16. The tiles below (MRB rows
 * x NR channels; on avx512 6 x 4, their 16-lane sums taken 16 at a time by reduce16 in the tree of
 * _mm512_reduce_add_ps), the work items (MC rows x NB channels) and the bf16 output
 * (tritium_bf16_gemm_bf16) only decide which outputs are computed together and where they go.
 *
 * The same inner order as w8_rows / w8g_rows in cpu_gemm.c: a weight dequantized to bfloat16
 * first (tritium_int8_to_bf16, _int8g_to_bf16, _int4_to_bf16) and multiplied here gives the same
 * bits as the fused int8 kernels, so a layer may switch between them by batch size.
 *
 * tritium_bf16_gemm: W bf16 (N, K). tritium_w4_gemm: W = bf16((q - 8) * scale + zero) from the
 * int4 layout of tritium_int4_to_bf16 (no g_idx), dequantized 32 weights at a time; K % 32 == 0
 * and G % 32 == 0. Threads: OpenMP over blocks of output channels. Weight rows are prefetched a
 * few cache lines ahead: a decode streams every weight from memory once per step, and without
 * the hints the one-row kernel ran at half oneDNN's speed on SmolLM2's down_proj.
 */
#include <stdint.h>
#include <stdlib.h>

#include "cpu_f16.h"
#include "cpu_simd.h"

#define NB 32  /* output channels per parallel work item */
#define MR 4   /* rows of x per tile */
#define MC 96  /* rows of x per work item (several rows): 96 x K bf16 stays in L2 */

#if defined(TRITIUM_AVX512)
#define NR 4   /* output channels per tile: MRB * NR accumulators + NR weights stay in registers */
#define MRB 6  /* rows of x per bf16 tile: 24 accumulators, 4 weights and one x in 32 zmm */
#define NR1 16 /* channels of the one-row kernel */

INLINE __m512bh load_bh(const uint16_t *p, __mmask32 m) {
    return (__m512bh)_mm512_maskz_loadu_epi16(m, (const void *)p);
}

/* 16 horizontal sums at once, each in _mm512_reduce_add_ps's tree (GCC and clang: lane i + i+8,
 * then j + j+4, then (0+2, 1+3), then the two halves), so every sum has the bits of a separate
 * reduce: a[0..15] -> lane 4q + j holds the sum of a[4j + q] (a 4 x 4 transpose). */
INLINE __m512 reduce16(const __m512 *a) {
    __m512 c[8], e[4], g[2];
    for (int i = 0; i < 8; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)));
    for (int i = 0; i < 4; i++)
        e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)));
    for (int i = 0; i < 2; i++)
        g[i] = _mm512_add_ps(_mm512_shuffle_ps(e[2 * i], e[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(e[2 * i], e[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_ps(g[0], g[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(g[0], g[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* out[r][c] = x[r] . w[c] over K for MR_ rows and NR_ channels (compile-time counts). */
INLINE void bf16_tile(const uint16_t *x, const uint16_t *w, int64_t K, float *out, int64_t ldo,
                      const int MR_, const int NR_) {
    __m512 acc[MRB][NR];
    for (int r = 0; r < MR_; r++)
        for (int c = 0; c < NR_; c++) acc[r][c] = _mm512_setzero_ps();
    const int64_t K32 = K / 32 * 32;
    for (int64_t k = 0; k < K32; k += 32) { /* whole blocks of 32: plain loads */
        __m512bh wv[NR];
        for (int c = 0; c < NR_; c++) wv[c] = (__m512bh)_mm512_loadu_si512((const void *)(w + c * K + k));
        for (int r = 0; r < MR_; r++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + r * K + k));
            for (int c = 0; c < NR_; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
        }
    }
    if (K32 < K) { /* the last K % 32 values, masked (zeros add exact zeros, as before) */
        const __mmask32 m = (__mmask32)((1u << (K - K32)) - 1);
        __m512bh wv[NR];
        for (int c = 0; c < NR_; c++) wv[c] = load_bh(w + c * K + K32, m);
        for (int r = 0; r < MR_; r++) {
            __m512bh xv = load_bh(x + r * K + K32, m);
            for (int c = 0; c < NR_; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
        }
    }
    if (NR_ == 4) { /* per 4 rows: a[4c + r] -> lane 4r + c, so row r's 4 sums are quarter r */
        for (int r0 = 0; r0 < MR_; r0 += 4) {
            __m512 a[16];
            for (int c = 0; c < 4; c++)
                for (int r = 0; r < 4; r++) a[4 * c + r] = r0 + r < MR_ ? acc[r0 + r][c] : _mm512_setzero_ps();
            __m512 s = reduce16(a);
            float *o = out + r0 * ldo;
            if (r0 + 0 < MR_) _mm_storeu_ps(o, _mm512_extractf32x4_ps(s, 0));
            if (r0 + 1 < MR_) _mm_storeu_ps(o + ldo, _mm512_extractf32x4_ps(s, 1));
            if (r0 + 2 < MR_) _mm_storeu_ps(o + 2 * ldo, _mm512_extractf32x4_ps(s, 2));
            if (r0 + 3 < MR_) _mm_storeu_ps(o + 3 * ldo, _mm512_extractf32x4_ps(s, 3));
        }
        return;
    }
    for (int r = 0; r < MR_; r++)
        for (int c = 0; c < NR_; c++) out[r * ldo + c] = _mm512_reduce_add_ps(acc[r][c]);
}

/* One row of x against NC channels: the decode case, where the weight streams from memory and
 * more independent accumulators (and weight streams) keep the loads in flight. Same per-output
 * order as bf16_tile. */
INLINE void bf16_row(const uint16_t *x, const uint16_t *w, int64_t K, float *out, const int NC) {
    __m512 acc[NR1];
    for (int c = 0; c < NC; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        const __mmask32 m = K - k >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << (K - k)) - 1);
        __m512bh xv = load_bh(x + k, m);
        for (int c = 0; c < NC; c++) {
            _mm_prefetch((const char *)(w + c * K + k + 8 * 32), _MM_HINT_T0); /* 8 lines ahead */
            acc[c] = _mm512_dpbf16_ps(acc[c], xv, load_bh(w + c * K + k, m));
        }
    }
    if (NC == 16) { /* lane 4q + j holds channel 4j + q: permute back to channel order */
        const __m512i idx = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
        _mm512_storeu_ps(out, _mm512_permutexvar_ps(idx, reduce16(acc)));
        return;
    }
    for (int c = 0; c < NC; c++) out[c] = _mm512_reduce_add_ps(acc[c]);
}

/* 16 bytes of nibbles (k = 2j low, 2j + 1 high) -> 32 int8 values q - 8, in k order. */
static inline __m256i w4_nibbles(const uint8_t *p) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m128i mask = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    return _mm256_set_m128i(_mm_sub_epi8(_mm_unpackhi_epi8(lo, hi), eight),
                            _mm_sub_epi8(_mm_unpacklo_epi8(lo, hi), eight));
}

/* One channel n for MR_ rows: each block of 32 weights dequantized once (as tritium_int4_to_bf16
 * does) and shared by the rows; the accumulation as in bf16_tile. */
INLINE void w4_rows(const uint16_t *x, int64_t K, int64_t G, const uint8_t *wn, const uint16_t *scale,
                    const uint16_t *zero, int64_t N, float *out, int64_t ldo, const int MR_) {
    __m512 acc[MR];
    for (int r = 0; r < MR_; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        const int64_t g = k / G;
        const __m512 s = _mm512_set1_ps(f16_to_f32(scale[g * N])), z = _mm512_set1_ps(f16_at(zero, g * N));
        _mm_prefetch((const char *)(wn + k / 2 + 256), _MM_HINT_T0);
        __m256i q = w4_nibbles(wn + k / 2);
        __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))), s, z);
        __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))), s, z);
        __m512bh wv = _mm512_cvtne2ps_pbh(hi, lo);
        for (int r = 0; r < MR_; r++)
            acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512((const void *)(x + r * K + k)), wv);
    }
    for (int r = 0; r < MR_; r++) out[r * ldo] = _mm512_reduce_add_ps(acc[r]);
}

/* int4 through a table: the 16 values bf16((q - 8) s + z) of a group, computed once (the same FMA
 * and rounding as w4_rows and tritium_int4_to_bf16, so the same bits), then 32 codes looked up with
 * one VPERMW. 16 bytes of nibbles -> 32 16-bit codes in k order: byte j's low nibble to 16-bit
 * lane 2j, its high nibble to lane 2j + 1. */
static inline __m512i w4_codes16(const uint8_t *p) {
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm512_and_si512(_mm512_or_si512(v, _mm512_slli_epi32(v, 12)), _mm512_set1_epi32(0x000F000F));
}
static inline __m512i w4_table(float s, float z) { /* in the low 16 lanes (VPERMW reads only those) */
    const __m512 q8 = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    return _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(q8, _mm512_set1_ps(s), _mm512_set1_ps(z))));
}
static inline __m512bh w4_lookup(const uint8_t *p, __m512i table) {
    return (__m512bh)_mm512_permutexvar_epi16(w4_codes16(p), table);
}

/* One row against NC_ channels (decode): w4_rows' order per output, NC_ independent accumulator
 * chains and weight streams (one chain per output left the one-row GEMV bound by VDPBF16PS
 * latency); each group's table built once per channel. */
#define NC1 8
INLINE void w4_cols(const uint16_t *x, int64_t K, int64_t G, const uint8_t *wn, const uint16_t *scale,
                    const uint16_t *zero, int64_t N, float *out, const int NC_) {
    __m512 acc[NC1];
    __m512i table[NC1];
    for (int c = 0; c < NC_; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        if (k % G == 0)
            for (int c = 0; c < NC_; c++)
                table[c] = w4_table(f16_to_f32(scale[k / G * N + c]), f16_at(zero, k / G * N + c));
        const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + k));
        for (int c = 0; c < NC_; c++) {
            const uint8_t *p = wn + c * (K / 2) + k / 2;
            _mm_prefetch((const char *)(p + 256), _MM_HINT_T0);
            acc[c] = _mm512_dpbf16_ps(acc[c], xv, w4_lookup(p, table[c]));
        }
    }
    for (int c = 0; c < NC_; c++) out[c] = _mm512_reduce_add_ps(acc[c]);
}
#define HAVE_W4_COLS 1

#elif defined(TRITIUM_AVX2)
#define NR 2   /* MR * NR accumulators + 2 NR widened weights in the 16 ymm registers */
#define NR1 8

/* The last K % 16 values of a row, zero-padded to a block of 16 (zeros add exact zeros). */
INLINE const uint16_t *tail16(const uint16_t *p, int64_t n, uint16_t *buf) {
    for (int i = 0; i < 16; i++) buf[i] = i < n ? p[i] : 0;
    return buf;
}

INLINE void bf16_tile(const uint16_t *x, const uint16_t *w, int64_t K, float *out, int64_t ldo,
                      const int MR_, const int NR_) {
    __m256 acc[MR][NR];
    for (int r = 0; r < MR_; r++)
        for (int c = 0; c < NR_; c++) acc[r][c] = _mm256_setzero_ps();
    const int64_t K16 = K / 16 * 16;
    for (int64_t k = 0; k < K16; k += 16) {
        __m256 we[NR], wo[NR];
        for (int c = 0; c < NR_; c++) {
            PREFETCH(w + c * K + k + 8 * 32);
            __m256i v = load256(w + c * K + k);
            we[c] = bf16_even(v);
            wo[c] = bf16_odd(v);
        }
        for (int r = 0; r < MR_; r++) {
            __m256i xv = load256(x + r * K + k);
            __m256 xe = bf16_even(xv), xo = bf16_odd(xv);
            for (int c = 0; c < NR_; c++) acc[r][c] = _mm256_fmadd_ps(xo, wo[c], _mm256_fmadd_ps(xe, we[c], acc[r][c]));
        }
    }
    if (K16 < K) {
        uint16_t bx[16], bw[16];
        for (int c = 0; c < NR_; c++) {
            __m256i v = load256(tail16(w + c * K + K16, K - K16, bw));
            for (int r = 0; r < MR_; r++)
                acc[r][c] = dot16_eo(acc[r][c], tail16(x + r * K + K16, K - K16, bx), bf16_even(v), bf16_odd(v));
        }
    }
    for (int r = 0; r < MR_; r++)
        for (int c = 0; c < NR_; c++) out[r * ldo + c] = hsum8(acc[r][c]);
}

INLINE void bf16_row(const uint16_t *x, const uint16_t *w, int64_t K, float *out, const int NC) {
    __m256 acc[NR1];
    for (int c = 0; c < NC; c++) acc[c] = _mm256_setzero_ps();
    const int64_t K16 = K / 16 * 16;
    for (int64_t k = 0; k < K16; k += 16) {
        __m256i xv = load256(x + k);
        __m256 xe = bf16_even(xv), xo = bf16_odd(xv);
        for (int c = 0; c < NC; c++) {
            PREFETCH(w + c * K + k + 8 * 32);
            __m256i v = load256(w + c * K + k);
            acc[c] = _mm256_fmadd_ps(xo, bf16_odd(v), _mm256_fmadd_ps(xe, bf16_even(v), acc[c]));
        }
    }
    if (K16 < K) {
        uint16_t bx[16], bw[16];
        tail16(x + K16, K - K16, bx);
        for (int c = 0; c < NC; c++) {
            __m256i v = load256(tail16(w + c * K + K16, K - K16, bw));
            acc[c] = dot16_eo(acc[c], bx, bf16_even(v), bf16_odd(v));
        }
    }
    for (int c = 0; c < NC; c++) out[c] = hsum8(acc[c]);
}

INLINE void w4_rows(const uint16_t *x, int64_t K, int64_t G, const uint8_t *wn, const uint16_t *scale,
                    const uint16_t *zero, int64_t N, float *out, int64_t ldo, const int MR_) {
    __m256 acc[MR];
    for (int r = 0; r < MR_; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const int64_t g = k / G;
        const __m256 s = _mm256_set1_ps(f16_to_f32(scale[g * N])), z = _mm256_set1_ps(f16_at(zero, g * N));
        PREFETCH(wn + k / 2 + 256);
        __m256 we, wo;
        i4x16_eo(wn + k / 2, &we, &wo);
        we = bf16_round8(_mm256_fmadd_ps(we, s, z));
        wo = bf16_round8(_mm256_fmadd_ps(wo, s, z));
        for (int r = 0; r < MR_; r++) acc[r] = dot16_eo(acc[r], x + r * K + k, we, wo);
    }
    for (int r = 0; r < MR_; r++) out[r * ldo] = hsum8(acc[r]);
}

/* One row against NC_ channels (decode): w4_rows' order, NC_ independent accumulator chains. */
#define NC1 8
INLINE void w4_cols(const uint16_t *x, int64_t K, int64_t G, const uint8_t *wn, const uint16_t *scale,
                    const uint16_t *zero, int64_t N, float *out, const int NC_) {
    __m256 acc[NC1];
    for (int c = 0; c < NC_; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const int64_t g = k / G;
        __m256i xv = load256(x + k);
        __m256 xe = bf16_even(xv), xo = bf16_odd(xv);
        for (int c = 0; c < NC_; c++) {
            const __m256 s = _mm256_set1_ps(f16_to_f32(scale[g * N + c])), z = _mm256_set1_ps(f16_at(zero, g * N + c));
            __m256 we, wo;
            PREFETCH(wn + c * (K / 2) + k / 2 + 256);
            i4x16_eo(wn + c * (K / 2) + k / 2, &we, &wo);
            we = bf16_round8(_mm256_fmadd_ps(we, s, z));
            wo = bf16_round8(_mm256_fmadd_ps(wo, s, z));
            acc[c] = _mm256_fmadd_ps(xo, wo, _mm256_fmadd_ps(xe, we, acc[c]));
        }
    }
    for (int c = 0; c < NC_; c++) out[c] = hsum8(acc[c]);
}
#define HAVE_COLS 1
#define HAVE_W4_COLS 1

#else /* portable C: 16 float32 lanes per output (lane i takes k = 16 j + i), sum16 at the end */
#define NR 2
#define NR1 4

/* x . w over K. Kept out of line and free of prefetch hints: both made GCC give up vectorizing. */
static __attribute__((noinline)) float dot_bf16(const uint16_t *x, const uint16_t *w, int64_t K) {
    float acc[16] = {0};
    int64_t k = 0;
    for (; k + 16 <= K; k += 16)
        for (int i = 0; i < 16; i++) acc[i] += bf16_to_f32(x[k + i]) * bf16_to_f32(w[k + i]);
    for (int i = 0; k + i < K; i++) acc[i] += bf16_to_f32(x[k + i]) * bf16_to_f32(w[k + i]);
    return sum16(acc);
}

INLINE void bf16_tile(const uint16_t *x, const uint16_t *w, int64_t K, float *out, int64_t ldo,
                      const int MR_, const int NR_) {
    for (int r = 0; r < MR_; r++)
        for (int c = 0; c < NR_; c++) out[r * ldo + c] = dot_bf16(x + r * K, w + c * K, K);
}

INLINE void bf16_row(const uint16_t *x, const uint16_t *w, int64_t K, float *out, const int NC) {
    for (int c = 0; c < NC; c++) out[c] = dot_bf16(x, w + c * K, K);
}

/* acc[r] += x[r][0:16] . wv for mr rows (out of line, as dot_bf16) */
static __attribute__((noinline)) void rows_dot16(float (*restrict acc)[16], const uint16_t *restrict x, int64_t K,
                                                 const float *restrict wv, int mr) {
    for (int r = 0; r < mr; r++)
        for (int i = 0; i < 16; i++) acc[r][i] += bf16_to_f32(x[r * K + i]) * wv[i];
}

static __attribute__((noinline)) void w4_rows(const uint16_t *x, int64_t K, int64_t G, const uint8_t *wn,
                                              const uint16_t *scale, const uint16_t *zero, int64_t N, float *out,
                                              int64_t ldo, const int MR_) {
    float acc[MR][16] = {{0}};
    for (int64_t k = 0; k < K; k += 16) {
        const int64_t g = k / G;
        const float s = f16_to_f32(scale[g * N]), z = f16_at(zero, g * N);
        float lo[8], hi[8], wv[16];
        for (int i = 0; i < 8; i++) {
            lo[i] = deq((float)((wn[k / 2 + i] & 0x0F) - 8), s, z);
            hi[i] = deq((float)((wn[k / 2 + i] >> 4) - 8), s, z);
        }
        for (int i = 0; i < 8; i++) {
            wv[2 * i] = lo[i];
            wv[2 * i + 1] = hi[i];
        }
        rows_dot16(acc, x + k, K, wv, MR_);
    }
    for (int r = 0; r < MR_; r++) out[r * ldo] = sum16(acc[r]);
}
#endif

#define TILE(R, C) bf16_tile(x + m0 * K, w + n * K, K, yo + (m0 - ym) * ldy + (n - yn), ldy, R, C)
#ifdef MRB
#define ROWS(C)                                                                  \
    switch (mr) {                                                                \
    case 1: TILE(1, C); break; case 2: TILE(2, C); break;                        \
    case 3: TILE(3, C); break; case 4: TILE(4, C); break;                        \
    case 5: TILE(5, C); break; default: TILE(6, C); break;                       \
    }
#else
#define MRB MR
#define ROWS(C)                                                                  \
    switch (mr) {                                                                \
    case 1: TILE(1, C); break; case 2: TILE(2, C); break;                        \
    case 3: TILE(3, C); break; default: TILE(4, C); break;                       \
    }
#endif

/* float32 -> bfloat16 as torch's vectorized conversion does it (the per-op path's .to(bfloat16)):
 * round to nearest even, any NaN -> 0xFFFF. */
static inline uint16_t out_bf16(float f) {
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return 0xFFFFu;
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* y (float32) or, where y16 is given instead, y16 (bf16: each float32 result rounded once with
 * out_bf16, the bits .to(torch.bfloat16) gives the float32 result). */
static void bf16_gemm(const uint16_t *x, const uint16_t *w, float *y, uint16_t *y16, int64_t M, int64_t N,
                      int64_t K) {
    const int64_t nblocks = (N + NB - 1) / NB;
    if (M == 1) {
#pragma omp parallel for schedule(static)
        for (int64_t nb = 0; nb < nblocks; nb++) {
            const int64_t n1 = (nb + 1) * NB < N ? (nb + 1) * NB : N;
            float buf[NB];
            for (int64_t n = nb * NB; n < n1; n += NR1) {
                const int64_t nc = n1 - n < NR1 ? n1 - n : NR1;
                float *o = y16 ? buf + (n - nb * NB) : y + n;
                if (nc == NR1) bf16_row(x, w + n * K, K, o, NR1);
                else bf16_row(x, w + n * K, K, o, (int)nc);
            }
            if (y16)
                for (int64_t n = nb * NB; n < n1; n++) y16[n] = out_bf16(buf[n - nb * NB]);
        }
        return;
    }
    /* Several rows: work items are (chunk of MC rows, block of NB channels), chunk-major, so a
     * chunk of x stays in L2 while the blocks of W go by (a prompt's whole x does not fit). */
    const int64_t nchunks = (M + MC - 1) / MC;
#pragma omp parallel for schedule(static)
    for (int64_t item = 0; item < nchunks * nblocks; item++) {
        const int64_t nb = item % nblocks, c0 = item / nblocks * MC;
        const int64_t c1 = c0 + MC < M ? c0 + MC : M;
        const int64_t n1 = (nb + 1) * NB < N ? (nb + 1) * NB : N;
        float buf[MC * NB];
        /* where the tiles write: y itself, or a float32 block of this item for y16 */
        float *yo = y16 ? buf : y;
        const int64_t ym = y16 ? c0 : 0, yn = y16 ? nb * NB : 0, ldy = y16 ? NB : N;
        /* the tiles read a few weight rows at a time, too few loads in flight to stream the
         * weight at memory speed; ask for the whole next block in L2 first */
        if (nb + 1 < nblocks) {
            const int64_t e1 = (nb + 2) * NB < N ? (nb + 2) * NB : N;
            const char *p0 = (const char *)(w + n1 * K), *p1 = (const char *)(w + e1 * K);
            for (const char *p = p0; p < p1; p += 64) __builtin_prefetch(p, 0, 2);
        }
        for (int64_t m0 = c0; m0 < c1; m0 += MRB) {
            const int64_t mr = c1 - m0 < MRB ? c1 - m0 : MRB;
            int64_t n = nb * NB;
            for (; n + NR <= n1; n += NR) ROWS(NR)
            for (; n < n1; n++) ROWS(1)
        }
        if (y16)
            for (int64_t m = c0; m < c1; m++)
                for (int64_t n = nb * NB; n < n1; n++) y16[m * N + n] = out_bf16(buf[(m - c0) * NB + n - nb * NB]);
    }
}

void tritium_bf16_gemm(const uint16_t *x, const uint16_t *w, float *y, int64_t M, int64_t N, int64_t K) {
    bf16_gemm(x, w, y, 0, M, N, K);
}

/* The same products rounded to bfloat16 in the kernel: y16 (M, N) bf16. */
void tritium_bf16_gemm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y16, int64_t M, int64_t N, int64_t K) {
    bf16_gemm(x, w, 0, y16, M, N, K);
}

/* Channels n0 .. n0 + nc of the int4 weight dequantized to bf16 (nc, K), each value rounded as
 * tritium_int4_to_bf16 rounds it (cpu_gemm.c), so a tile over the panel gives bf16_gemm's bits. */
static void w4_panel(const uint8_t *w4, const uint16_t *scale, const uint16_t *zero, int64_t n0, int64_t nc,
                     int64_t N, int64_t K, int64_t G, uint16_t *panel) {
    for (int64_t c = 0; c < nc; c++) {
        const uint8_t *wn = w4 + (n0 + c) * (K / 2);
        uint16_t *out = panel + c * K;
#if defined(TRITIUM_AVX512)
        __m512i table = _mm512_setzero_si512();
#endif
        for (int64_t k = 0; k < K; k += 32) {
            const int64_t g = k / G;
            const float sf = f16_to_f32(scale[g * N + n0 + c]), zf = f16_at(zero, g * N + n0 + c);
#if defined(TRITIUM_AVX512)
            if (k % G == 0) table = w4_table(sf, zf);
            _mm512_storeu_si512((void *)(out + k), (__m512i)w4_lookup(wn + k / 2, table));
#elif defined(TRITIUM_AVX2)
            const __m256 s = _mm256_set1_ps(sf), z = _mm256_set1_ps(zf);
            for (int h = 0; h < 32; h += 16) {
                __m256 e, o;
                i4x16_eo(wn + (k + h) / 2, &e, &o);
                store_eo_bf16(out + k + h, _mm256_fmadd_ps(e, s, z), _mm256_fmadd_ps(o, s, z));
            }
#else
            for (int i = 0; i < 16; i++) {
                out[k + 2 * i] = f32_to_bf16(deq((float)((wn[k / 2 + i] & 0x0F) - 8), sf, zf));
                out[k + 2 * i + 1] = f32_to_bf16(deq((float)((wn[k / 2 + i] >> 4) - 8), sf, zf));
            }
#endif
        }
    }
}

/* Several rows: each work item (NB channels) dequantizes its weight panel to bf16 once and runs
 * bf16_gemm's tiles over every row on it (the dequantization is shared by all M rows, and the
 * tiles are the bf16 GEMM's: the same bits as tritium_int4_to_bf16 + tritium_bf16_gemm). */
static void w4_gemm_panels(const uint16_t *x, const uint8_t *w4, const uint16_t *scale, const uint16_t *zero,
                           float *y, int64_t M, int64_t N, int64_t K, int64_t G) {
    const int64_t nblocks = (N + NB - 1) / NB;
#pragma omp parallel
    {
        uint16_t *panel = (uint16_t *)malloc((size_t)(NB * K) * sizeof(uint16_t));
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < nblocks; nb++) {
            const int64_t n0 = nb * NB, n1 = n0 + NB < N ? n0 + NB : N;
            w4_panel(w4, scale, zero, n0, n1 - n0, N, K, G, panel);
            for (int64_t m0 = 0; m0 < M; m0 += MRB) {
                const int64_t mr = M - m0 < MRB ? M - m0 : MRB;
                int64_t n = n0;
                const uint16_t *w = panel - n0 * K; /* w + n * K: channel n's row of the panel */
                float *yo = y;
                const int64_t ym = 0, yn = 0, ldy = N;
                for (; n + NR <= n1; n += NR) ROWS(NR)
                for (; n < n1; n++) ROWS(1)
            }
        }
        free(panel);
    }
}

/* y (M, N) float32 = x (M, K) bf16 @ bf16((q - 8) * scale[k / G][n] + zero[k / G][n])^T;
 * w4 (N, K/2) uint8, scale / zero (K/G, N) float16 as stored (widened in registers, exact); zero NULL:
 * the symmetric layout (zero 0). */
void tritium_w4_gemm(const uint16_t *x, const uint8_t *w4, const uint16_t *scale, const uint16_t *zero, float *y,
                     int64_t M, int64_t N, int64_t K, int64_t G) {
    if (M > 1) {
        w4_gemm_panels(x, w4, scale, zero, y, M, N, K, G);
        return;
    }
    const int64_t nblocks = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < nblocks; nb++) {
        const int64_t n1 = (nb + 1) * NB < N ? (nb + 1) * NB : N;
#ifdef HAVE_W4_COLS
        if (M == 1) {
            for (int64_t n = nb * NB; n < n1; n += NC1) {
                const int nc = n1 - n < NC1 ? (int)(n1 - n) : NC1;
                if (nc == NC1) w4_cols(x, K, G, w4 + n * (K / 2), scale + n, zero ? zero + n : 0, N, y + n, NC1);
                else w4_cols(x, K, G, w4 + n * (K / 2), scale + n, zero ? zero + n : 0, N, y + n, nc);
            }
            continue;
        }
#endif
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int64_t mr = M - m0 < MR ? M - m0 : MR;
            for (int64_t n = nb * NB; n < n1; n++) {
#define W4(R) w4_rows(x + m0 * K, K, G, w4 + n * (K / 2), scale + n, zero ? zero + n : 0, N, y + m0 * N + n, N, R)
                switch (mr) {
                case 1: W4(1); break; case 2: W4(2); break;
                case 3: W4(3); break; default: W4(4); break;
                }
            }
        }
    }
}
