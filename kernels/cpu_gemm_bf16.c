/* Batch-invariant GEMMs for x86 CPUs with AVX512-BF16: y (M, N) float32 = x (M, K) bf16 @ W^T.
 *
 * Every output y[m][n] is reduced in one order that depends on K only, never on M, on the tile
 * a row falls in or on the thread count ("Defeating Nondeterminism in LLM Inference", Thinking
 * Machines Lab, 2025: fix the reduction order per row, not per batch): one 16-lane float32
 * accumulator gathers VDPBF16PS products over k in steps of 32 (the last step masked when
 * K % 32 != 0), then _mm512_reduce_add_ps sums the lanes in a fixed tree. The tiles below (MR rows
 * x NR channels) only decide which outputs are computed together.
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
#include <immintrin.h>
#include <stdint.h>

#include "cpu_simd.h"

#define MR 4   /* rows of x per tile */
#define NR 4   /* output channels per tile: MR * NR accumulators + NR weights stay in registers */
#define NB 32  /* output channels per parallel work item */
#define INLINE static inline __attribute__((always_inline))

INLINE __m512bh load_bh(const uint16_t *p, __mmask32 m) {
    return (__m512bh)_mm512_maskz_loadu_epi16(m, (const void *)p);
}

/* out[r][c] = x[r] . w[c] over K for MR_ rows and NR_ channels (compile-time counts). */
INLINE void bf16_tile(const uint16_t *x, const uint16_t *w, int64_t K, float *out, int64_t ldo,
                      const int MR_, const int NR_) {
    __m512 acc[MR][NR];
    for (int r = 0; r < MR_; r++)
        for (int c = 0; c < NR_; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        const __mmask32 m = K - k >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << (K - k)) - 1);
        __m512bh wv[NR];
        for (int c = 0; c < NR_; c++) {
            _mm_prefetch((const char *)(w + c * K + k + 8 * 32), _MM_HINT_T0);
            wv[c] = load_bh(w + c * K + k, m);
        }
        for (int r = 0; r < MR_; r++) {
            __m512bh xv = load_bh(x + r * K + k, m);
            for (int c = 0; c < NR_; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
        }
    }
    for (int r = 0; r < MR_; r++)
        for (int c = 0; c < NR_; c++) out[r * ldo + c] = _mm512_reduce_add_ps(acc[r][c]);
}

/* One row of x against NR1 channels: the decode case, where the weight streams from memory and
 * more independent accumulators (and weight streams) keep the loads in flight. Same per-output
 * order as bf16_tile. */
#define NR1 16
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
    for (int c = 0; c < NC; c++) out[c] = _mm512_reduce_add_ps(acc[c]);
}

#define TILE(R, C) bf16_tile(x + m0 * K, w + n * K, K, y + m0 * N + n, N, R, C)
#define ROWS(C)                                                                  \
    switch (mr) {                                                                \
    case 1: TILE(1, C); break; case 2: TILE(2, C); break;                        \
    case 3: TILE(3, C); break; default: TILE(4, C); break;                       \
    }

void tritium_bf16_gemm(const uint16_t *x, const uint16_t *w, float *y, int64_t M, int64_t N, int64_t K) {
    const int64_t nblocks = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < nblocks; nb++) {
        const int64_t n1 = (nb + 1) * NB < N ? (nb + 1) * NB : N;
        if (M == 1) {
            for (int64_t n = nb * NB; n < n1; n += NR1) {
                const int64_t nc = n1 - n < NR1 ? n1 - n : NR1;
                if (nc == NR1) bf16_row(x, w + n * K, K, y + n, NR1);
                else bf16_row(x, w + n * K, K, y + n, (int)nc);
            }
            continue;
        }
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int64_t mr = M - m0 < MR ? M - m0 : MR;
            for (int64_t n = nb * NB; n < n1; n += NR) {
                switch (n1 - n < NR ? n1 - n : NR) {
                case 1: ROWS(1) break;
                case 2: ROWS(2) break;
                case 3: ROWS(3) break;
                default: ROWS(4) break;
                }
            }
        }
    }
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
INLINE void w4_rows(const uint16_t *x, int64_t K, int64_t G, const uint8_t *wn, const float *scale,
                    const float *zero, int64_t N, float *out, int64_t ldo, const int MR_) {
    __m512 acc[MR];
    for (int r = 0; r < MR_; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        const int64_t g = k / G;
        const __m512 s = _mm512_set1_ps(scale[g * N]), z = _mm512_set1_ps(zero[g * N]);
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

/* y (M, N) float32 = x (M, K) bf16 @ bf16((q - 8) * scale[k / G][n] + zero[k / G][n])^T;
 * w4 (N, K/2) uint8, scale / zero (K/G, N) float32. */
void tritium_w4_gemm(const uint16_t *x, const uint8_t *w4, const float *scale, const float *zero, float *y,
                     int64_t M, int64_t N, int64_t K, int64_t G) {
    const int64_t nblocks = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < nblocks; nb++) {
        const int64_t n1 = (nb + 1) * NB < N ? (nb + 1) * NB : N;
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int64_t mr = M - m0 < MR ? M - m0 : MR;
            for (int64_t n = nb * NB; n < n1; n++) {
#define W4(R) w4_rows(x + m0 * K, K, G, w4 + n * (K / 2), scale + n, zero + n, N, y + m0 * N + n, N, R)
                switch (mr) {
                case 1: W4(1); break; case 2: W4(2); break;
                case 3: W4(3); break; default: W4(4); break;
                }
            }
        }
    }
}
