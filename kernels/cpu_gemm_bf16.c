/* Batch-invariant GEMMs: y (M, N) float32 = x (M, K) bf16 @ W^T, on every path of cpu_simd.h.
 *
 * Every output y[m][n] is reduced in one order that depends on K only, never on M, on the tile
 * a row falls in or on the thread count ("Defeating Nondeterminism in LLM Inference", Thinking
 * Machines Lab, 2025: fix the reduction order per row, not per batch): one 16-lane float32
 * accumulator gathers VDPBF16PS products over k in steps of 32 (the last step masked when
 * K % 32 != 0), then _mm512_reduce_add_ps sums the lanes in a fixed tree. On AVX2 (no bf16 dot
 * product) bf16 is widened to float32 in registers with shifts: 8 float32 lanes take the even and
 * the odd elements of each block of 16 (cpu_simd.h), FMA, a fixed 8-lane tree. The portable path
 * keeps 16 float32 lanes per output (lane i takes k = 16 j + i) and sum16. The tiles below (MR rows
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
#include <stdint.h>

#include "cpu_simd.h"

#define NB 32  /* output channels per parallel work item */
#define MR 4   /* rows of x per tile */

#if defined(TRITIUM_AVX512)
#define NR 4   /* output channels per tile: MR * NR accumulators + NR weights stay in registers */
#define NR1 16 /* channels of the one-row kernel */

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

INLINE void w4_rows(const uint16_t *x, int64_t K, int64_t G, const uint8_t *wn, const float *scale,
                    const float *zero, int64_t N, float *out, int64_t ldo, const int MR_) {
    __m256 acc[MR];
    for (int r = 0; r < MR_; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const int64_t g = k / G;
        const __m256 s = _mm256_set1_ps(scale[g * N]), z = _mm256_set1_ps(zero[g * N]);
        PREFETCH(wn + k / 2 + 256);
        __m256 we, wo;
        i4x16_eo(wn + k / 2, &we, &wo);
        we = bf16_round8(_mm256_fmadd_ps(we, s, z));
        wo = bf16_round8(_mm256_fmadd_ps(wo, s, z));
        for (int r = 0; r < MR_; r++) acc[r] = dot16_eo(acc[r], x + r * K + k, we, wo);
    }
    for (int r = 0; r < MR_; r++) out[r * ldo] = hsum8(acc[r]);
}

#else /* portable C: 16 float32 lanes per output, lane i takes k = 16 j + i, then sum16 */
#define NR 2
#define NR1 4

INLINE void bf16_tile(const uint16_t *x, const uint16_t *w, int64_t K, float *out, int64_t ldo,
                      const int MR_, const int NR_) {
    float acc[MR][NR][16] = {{{0}}};
    for (int64_t k = 0; k < K; k += 16) {
        const int n = K - k < 16 ? (int)(K - k) : 16;
        float wv[NR][16];
        for (int c = 0; c < NR_; c++) {
            PREFETCH(w + c * K + k + 8 * 32);
            for (int i = 0; i < 16; i++) wv[c][i] = i < n ? bf16_to_f32(w[c * K + k + i]) : 0.0f;
        }
        for (int r = 0; r < MR_; r++) {
            float xv[16];
            for (int i = 0; i < 16; i++) xv[i] = i < n ? bf16_to_f32(x[r * K + k + i]) : 0.0f;
            for (int c = 0; c < NR_; c++)
                for (int i = 0; i < 16; i++) acc[r][c][i] += xv[i] * wv[c][i];
        }
    }
    for (int r = 0; r < MR_; r++)
        for (int c = 0; c < NR_; c++) out[r * ldo + c] = sum16(acc[r][c]);
}

INLINE void bf16_row(const uint16_t *x, const uint16_t *w, int64_t K, float *out, const int NC) {
    for (int c = 0; c < NC; c++) bf16_tile(x, w + c * K, K, out + c, 1, 1, 1);
}

INLINE void w4_rows(const uint16_t *x, int64_t K, int64_t G, const uint8_t *wn, const float *scale,
                    const float *zero, int64_t N, float *out, int64_t ldo, const int MR_) {
    float acc[MR][16] = {{0}};
    for (int64_t k = 0; k < K; k += 16) {
        const int64_t g = k / G;
        const float s = scale[g * N], z = zero[g * N];
        float wv[16];
        for (int i = 0; i < 8; i++) {
            const uint8_t b = wn[k / 2 + i];
            wv[2 * i] = deq((float)((b & 0x0F) - 8), s, z);
            wv[2 * i + 1] = deq((float)((b >> 4) - 8), s, z);
        }
        for (int r = 0; r < MR_; r++)
            for (int i = 0; i < 16; i++) acc[r][i] += bf16_to_f32(x[r * K + k + i]) * wv[i];
    }
    for (int r = 0; r < MR_; r++) out[r * ldo] = sum16(acc[r]);
}
#endif

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
        /* Several rows: the tiles read a few weight rows at a time, too few loads in flight to
         * stream the weight at memory speed; ask for the whole next block in L2 first. */
        if (nb + 1 < nblocks) {
            const int64_t e1 = (nb + 2) * NB < N ? (nb + 2) * NB : N;
            const char *p0 = (const char *)(w + n1 * K), *p1 = (const char *)(w + e1 * K);
            for (const char *p = p0; p < p1; p += 64) __builtin_prefetch(p, 0, 2);
        }
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int64_t mr = M - m0 < MR ? M - m0 : MR;
            int64_t n = nb * NB;
            for (; n + NR <= n1; n += NR) ROWS(NR)
            for (; n < n1; n++) ROWS(1)
        }
    }
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
