/* Weight-only int8 GEMMs: y (M, N) = x (M, K) (q * scale)^T, and the int8 / int4 -> bfloat16
 * conversions that feed tritium_bf16_gemm (cpu_gemm_bf16.c) for big batches.
 *
 * x bfloat16 (M, K), q int8 (N, K) with a float32 scale per output channel, y float32.
 * Each block of weights is converted once per call and multiplies every row of x (several rows on
 * avx512 / avx2: panel_gemm below; portable: up to MR rows per conversion), so a batch's rows
 * share the conversion. Every output is reduced in the order of tritium_bf16_gemm on the same
 * path (cpu_gemm_bf16.c): a weight dequantized to bfloat16 first and multiplied there gives the
 * same bits as these fused kernels, so a layer may switch between them by batch size.
 *   avx512: 32 weights per step to bfloat16, VDPBF16PS (32 products, float32 sums).
 *   avx2:   16 weights per step widened to float32 in the even / odd layout of cpu_simd.h, FMA.
 *   generic: 16 float32 lanes per step in portable C (lane i takes k = 16 j + i).
 * torch's _weight_int8pack_mm is faster for one row on AVX512-BF16 hosts, about 1.5x slower
 * from 8 rows on (measured on SmolLM2's shapes). Requires K % 32 == 0 (the Python side checks).
 * Threads: OpenMP over blocks of output channels, on the runtime torch itself uses.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_f16.h"
#include "cpu_simd.h"
#include "cpu_split.h"

#define MR 8   /* rows of x per pass: MR partial + MR total accumulators stay in registers */
#define NB 16  /* output channels per parallel work item */

/* Dequantized weight values, shared by the fused kernels and the conversions (so both round the
 * same way): grouped int8 q * s + z in float32 (one FMA on the SIMD paths, a product and a sum on
 * the portable one), rounded to bfloat16. */
#if defined(TRITIUM_AVX512)
static inline __m512bh cvt_i8x32_bf16(__m256i w8) {
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(w8)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(w8, 1)));
    return _mm512_cvtne2ps_pbh(hi, lo); /* low 16 lanes from lo: k order kept */
}

/* 32 int8 (k order) -> bf16(q * s + z) */
INLINE __m512bh deq_i8x32(__m256i q, __m512 s, __m512 z) {
    __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))), s, z);
    __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))), s, z);
    return _mm512_cvtne2ps_pbh(hi, lo);
}

/* 16 bytes of nibbles (k = 2j low, 2j + 1 high) -> 32 int8 values q - 8, in k order. */
static inline __m256i nibbles_to_i8x32(const uint8_t *p) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m128i mask = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    return _mm256_set_m128i(_mm_sub_epi8(_mm_unpackhi_epi8(lo, hi), eight),
                            _mm_sub_epi8(_mm_unpacklo_epi8(lo, hi), eight));
}

/* One output channel n for MR_ rows of x (a compile-time count, so the accumulators live in
 * registers): out[r] = sum_k x[r][k] w[n][k]. */
INLINE void w8_rows(const uint16_t *x, int64_t K, const int8_t *wn, float *out, const int MR_) {
    __m512 acc[MR];
    for (int r = 0; r < MR_; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __m512bh wv = cvt_i8x32_bf16(_mm256_loadu_si256((const __m256i *)(wn + k)));
        for (int r = 0; r < MR_; r++)
            acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512((const void *)(x + r * K + k)), wv);
    }
    for (int r = 0; r < MR_; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
}

/* Group-wise scales: each block of 32 weights is dequantized once, w = q * scale[g] + zero[g]
 * in float32 rounded to bfloat16 (the rounding of the prefill path, tritium_int8g_to_bf16), and
 * multiplies MR_ rows of x with VDPBF16PS: the same inner loop as w8_rows. pn: this channel's
 * (scale, zero) pairs, or scales only when NZ == 1, contiguous over groups. */
INLINE void w8g_rows(const uint16_t *x, int64_t K, int64_t G, const int8_t *wn, const float *pn,
                     const int NZ, float *out, const int MR_) {
    __m512 acc[MR];
    for (int r = 0; r < MR_; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < K; g0 += G, pn += NZ) {
        const __m512 s = _mm512_set1_ps(pn[0]), z = _mm512_set1_ps(NZ == 2 ? pn[1] : 0.0f);
        for (int64_t k = g0; k < g0 + G; k += 32) {
            __m512bh wv = deq_i8x32(_mm256_loadu_si256((const __m256i *)(wn + k)), s, z);
            for (int r = 0; r < MR_; r++)
                acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512((const void *)(x + r * K + k)), wv);
        }
    }
    for (int r = 0; r < MR_; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
}

/* 32 weights of a grouped int8 row from k on -> bf16 */
INLINE void int8g_block(const int8_t *q, float s, float z, uint16_t *out) {
    _mm512_storeu_si512((void *)out, (__m512i)deq_i8x32(_mm256_loadu_si256((const __m256i *)q),
                                                        _mm512_set1_ps(s), _mm512_set1_ps(z)));
}
INLINE void int8_block(const int8_t *q, uint16_t *out) {
    _mm512_storeu_si512((void *)out, (__m512i)cvt_i8x32_bf16(_mm256_loadu_si256((const __m256i *)q)));
}
/* 32 int4 weights (16 bytes of nibbles) -> bf16((q - 8) * s + z) */
INLINE void int4_block(const uint8_t *b, float s, float z, uint16_t *out) {
    _mm512_storeu_si512((void *)out, (__m512i)deq_i8x32(nibbles_to_i8x32(b), _mm512_set1_ps(s), _mm512_set1_ps(z)));
}

#elif defined(TRITIUM_AVX2)
/* One row of x against NC_ channels (several rows: one row at a time where panel_gemm cannot
 * allocate): per output the order of the bf16 GEMM, NC_ independent accumulator chains, so the
 * FMA latency does not bound a one-row GEMV. pn: channel 0's parameters, per_n floats per channel. */
#define NC1 8
INLINE void w8_cols(const uint16_t *x, int64_t K, const int8_t *wn, float *out, const int NC_) {
    __m256 acc[NC1];
    for (int c = 0; c < NC_; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        __m256i xv = load256(x + k);
        __m256 xe = bf16_even(xv), xo = bf16_odd(xv);
        for (int c = 0; c < NC_; c++) {
            __m256 we, wo;
            PREFETCH(wn + c * K + k + 512);
            i8x16_eo(wn + c * K + k, &we, &wo);
            acc[c] = _mm256_fmadd_ps(xo, wo, _mm256_fmadd_ps(xe, we, acc[c]));
        }
    }
    for (int c = 0; c < NC_; c++) out[c] = hsum8(acc[c]);
}

INLINE void w8g_cols(const uint16_t *x, int64_t K, int64_t G, const int8_t *wn, const float *pn, int64_t per_n,
                     const int NZ, float *out, const int NC_) {
    __m256 acc[NC1];
    for (int c = 0; c < NC_; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const int64_t g = k / G;
        __m256i xv = load256(x + k);
        __m256 xe = bf16_even(xv), xo = bf16_odd(xv);
        for (int c = 0; c < NC_; c++) {
            const float *p = pn + c * per_n + g * NZ;
            const __m256 s = _mm256_set1_ps(p[0]), z = _mm256_set1_ps(NZ == 2 ? p[1] : 0.0f);
            __m256 we, wo;
            PREFETCH(wn + c * K + k + 512);
            i8x16_eo(wn + c * K + k, &we, &wo);
            we = bf16_round8(_mm256_fmadd_ps(we, s, z));
            wo = bf16_round8(_mm256_fmadd_ps(wo, s, z));
            acc[c] = _mm256_fmadd_ps(xo, wo, _mm256_fmadd_ps(xe, we, acc[c]));
        }
    }
    for (int c = 0; c < NC_; c++) out[c] = hsum8(acc[c]);
}
#define HAVE_COLS 1

INLINE void int8g_block(const int8_t *q, float s, float z, uint16_t *out) {
    const __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(z);
    for (int h = 0; h < 32; h += 16) {
        __m256 e, o;
        i8x16_eo(q + h, &e, &o);
        store_eo_bf16(out + h, _mm256_fmadd_ps(e, vs, vz), _mm256_fmadd_ps(o, vs, vz));
    }
}
INLINE void int8_block(const int8_t *q, uint16_t *out) {
    for (int h = 0; h < 32; h += 16) {
        __m256 e, o;
        i8x16_eo(q + h, &e, &o);
        store_eo_bf16(out + h, e, o);
    }
}
INLINE void int4_block(const uint8_t *b, float s, float z, uint16_t *out) {
    const __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(z);
    for (int h = 0; h < 32; h += 16) {
        __m256 e, o;
        i4x16_eo(b + h / 2, &e, &o);
        store_eo_bf16(out + h, _mm256_fmadd_ps(e, vs, vz), _mm256_fmadd_ps(o, vs, vz));
    }
}

#else /* portable C: 16 float32 lanes, lane i takes k = 16 j + i; sum16 at the end */
/* acc[r] += x[r][0:16] . wv for mr rows (out of line: inlined, GCC did not vectorize it) */
static __attribute__((noinline)) void rows_dot16(float (*restrict acc)[16], const uint16_t *restrict x, int64_t K,
                                                 const float *restrict wv, int mr) {
    for (int r = 0; r < mr; r++)
        for (int i = 0; i < 16; i++) acc[r][i] += bf16_to_f32(x[r * K + i]) * wv[i];
}

INLINE void w8_rows(const uint16_t *x, int64_t K, const int8_t *wn, float *out, const int MR_) {
    float acc[MR][16] = {{0}};
    for (int64_t k = 0; k < K; k += 16) {
        float wv[16];
        for (int i = 0; i < 16; i++) wv[i] = (float)wn[k + i];
        rows_dot16(acc, x + k, K, wv, MR_);
    }
    for (int r = 0; r < MR_; r++) out[r] = sum16(acc[r]);
}

INLINE void w8g_rows(const uint16_t *x, int64_t K, int64_t G, const int8_t *wn, const float *pn,
                     const int NZ, float *out, const int MR_) {
    float acc[MR][16] = {{0}};
    for (int64_t g0 = 0; g0 < K; g0 += G, pn += NZ) {
        const float s = pn[0], z = NZ == 2 ? pn[1] : 0.0f;
        for (int64_t k = g0; k < g0 + G; k += 16) {
            float wv[16];
            for (int i = 0; i < 16; i++) wv[i] = deq((float)wn[k + i], s, z);
            rows_dot16(acc, x + k, K, wv, MR_);
        }
    }
    for (int r = 0; r < MR_; r++) out[r] = sum16(acc[r]);
}

INLINE void int8g_block(const int8_t *q, float s, float z, uint16_t *out) {
    for (int i = 0; i < 32; i++) out[i] = f32_to_bf16(deq((float)q[i], s, z));
}
INLINE void int8_block(const int8_t *q, uint16_t *out) {
    for (int i = 0; i < 32; i++) out[i] = f32_to_bf16((float)q[i]);
}
INLINE void int4_block(const uint8_t *b, float s, float z, uint16_t *out) {
    for (int i = 0; i < 16; i++) {
        out[2 * i] = f32_to_bf16(deq((float)((b[i] & 0x0F) - 8), s, z));
        out[2 * i + 1] = f32_to_bf16(deq((float)((b[i] >> 4) - 8), s, z));
    }
}
#endif

#if defined(TRITIUM_AVX512) || defined(TRITIUM_AVX2)
/* Several rows on the SIMD paths: NP channels at a time are dequantized to bfloat16 (the blocks
 * above, so the rounding of the conversions) into a buffer per thread, and tritium_bf16_tiles
 * (cpu_gemm_bf16.c) multiplies them by all M rows in its register tiles: the bits of the fused
 * kernels (the same weights, the same per-output order), at the bf16 GEMM's speed plus one
 * conversion per weight and call. params NULL: per-channel int8 (exact in bf16), scaled after.
 * Returns 0 where the buffers cannot be allocated (the caller then runs the fused kernels). */
#define NP 8
void tritium_bf16_tiles(const uint16_t *x, int64_t M, const uint16_t *w, int64_t nc, int64_t K, float *y,
                        int64_t ldy);
static int panel_gemm(const uint16_t *x, const int8_t *w, const float *scale, const float *params, int64_t nz,
                      float *y, int64_t M, int64_t N, int64_t K, int64_t G) {
#ifdef _OPENMP
    const int nt = omp_get_max_threads();
#else
    const int nt = 1;
#endif
    uint16_t *bufs = (uint16_t *)malloc((size_t)nt * NP * K * sizeof(uint16_t));
    if (!bufs) return 0;
    const int64_t npanels = (N + NP - 1) / NP, per_n = params ? (K / G) * nz : 0;
    const int64_t chunk = split_chunk(npanels, M * NP * K); /* claimed panels (cpu_split.h) */
#pragma omp parallel for schedule(dynamic, chunk)
    for (int64_t p = 0; p < npanels; p++) {
#ifdef _OPENMP
        uint16_t *buf = bufs + (size_t)omp_get_thread_num() * NP * K;
#else
        uint16_t *buf = bufs;
#endif
        const int64_t n0 = p * NP, nc = N - n0 < NP ? N - n0 : NP;
        for (int64_t c = 0; c < nc; c++) {
            const int8_t *q = w + (n0 + c) * K;
            if (params) {
                const float *pn = params + (n0 + c) * per_n;
                for (int64_t k = 0; k < K; k += 32) {
                    const float *pg = pn + k / G * nz;
                    int8g_block(q + k, pg[0], nz == 2 ? pg[1] : 0.0f, buf + c * K + k);
                }
            } else {
                for (int64_t k = 0; k < K; k += 32) int8_block(q + k, buf + c * K + k);
            }
        }
        tritium_bf16_tiles(x, M, buf, nc, K, y + n0, N);
        if (!params)
            for (int64_t m = 0; m < M; m++)
                for (int64_t c = 0; c < nc; c++) y[m * N + n0 + c] *= scale[n0 + c];
    }
    free(bufs);
    return 1;
}
#define PANEL(M) ((M) >= 2)
#else
#define PANEL(M) 0
static int panel_gemm(const uint16_t *x, const int8_t *w, const float *scale, const float *params, int64_t nz,
                      float *y, int64_t M, int64_t N, int64_t K, int64_t G) {
    (void)x, (void)w, (void)scale, (void)params, (void)nz, (void)y, (void)M, (void)N, (void)K, (void)G;
    return 0;
}
#endif

#include "cpu_rows.h" /* DISPATCH */

void tritium_w8a16_gemm(const uint16_t *x, const int8_t *w, const float *scale, float *y,
                        int64_t M, int64_t N, int64_t K) {
    if (PANEL(M) && panel_gemm(x, w, scale, 0, 0, y, M, N, K, 32)) return;
    const int64_t nblocks = (N + NB - 1) / NB, chunk = split_chunk(nblocks, M * NB * K);
#pragma omp parallel for schedule(dynamic, chunk)
    for (int64_t nb = 0; nb < nblocks; nb++) {
        const int64_t n1 = (nb + 1) * NB < N ? (nb + 1) * NB : N;
#ifdef HAVE_COLS
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = nb * NB; n < n1; n += NC1) {
                float out[NC1];
                const int nc = n1 - n < NC1 ? (int)(n1 - n) : NC1;
                if (nc == NC1) w8_cols(x + m * K, K, w + n * K, out, NC1);
                else w8_cols(x + m * K, K, w + n * K, out, nc);
                for (int c = 0; c < nc; c++) y[m * N + n + c] = out[c] * scale[n + c];
            }
#else
        /* rows outer, channels inner: MR rows of x and NB rows of w both stay in L1 */
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int64_t mr = M - m0 < MR ? M - m0 : MR;
            for (int64_t n = nb * NB; n < n1; n++) {
                float out[MR];
#define W8(R) w8_rows(x + m0 * K, K, w + n * K, out, R)
                DISPATCH(W8, mr)
                for (int r = 0; r < mr; r++) y[(m0 + r) * N + n] = out[r] * scale[n];
            }
        }
#endif
    }
}

/* y (M, N) float32 = x (M, K) bf16 @ bf16(q * scale[n][k / G] + zero[n][k / G])^T; params
 * (N, K/G, nz) float32: (scale, zero) pairs when nz == 2, scales only when nz == 1 (zero 0),
 * laid out per channel so a channel's parameters are read in order; G % 32 == 0. */
void tritium_w8g_gemm(const uint16_t *x, const int8_t *w, const float *params, int64_t nz, float *y,
                      int64_t M, int64_t N, int64_t K, int64_t G) {
    if (PANEL(M) && panel_gemm(x, w, 0, params, nz, y, M, N, K, G)) return;
    const int64_t nblocks = (N + NB - 1) / NB, per_n = (K / G) * nz, chunk = split_chunk(nblocks, M * NB * K);
#pragma omp parallel for schedule(dynamic, chunk)
    for (int64_t nb = 0; nb < nblocks; nb++) {
        const int64_t n1 = (nb + 1) * NB < N ? (nb + 1) * NB : N;
#ifdef HAVE_COLS
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = nb * NB; n < n1; n += NC1) {
                const int nc = n1 - n < NC1 ? (int)(n1 - n) : NC1;
                const float *pn = params + n * per_n, *xm = x + m * K;
                float *ym = y + m * N + n;
                if (nz == 2 && nc == NC1) w8g_cols(xm, K, G, w + n * K, pn, per_n, 2, ym, NC1);
                else if (nz == 2) w8g_cols(xm, K, G, w + n * K, pn, per_n, 2, ym, nc);
                else if (nc == NC1) w8g_cols(xm, K, G, w + n * K, pn, per_n, 1, ym, NC1);
                else w8g_cols(xm, K, G, w + n * K, pn, per_n, 1, ym, nc);
            }
#else
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int64_t mr = M - m0 < MR ? M - m0 : MR;
            for (int64_t n = nb * NB; n < n1; n++) {
                float out[MR];
                if (nz == 2) {
#define W8G2(R) w8g_rows(x + m0 * K, K, G, w + n * K, params + n * per_n, 2, out, R)
                    DISPATCH(W8G2, mr)
                } else {
#define W8G1(R) w8g_rows(x + m0 * K, K, G, w + n * K, params + n * per_n, 1, out, R)
                    DISPATCH(W8G1, mr)
                }
                for (int r = 0; r < mr; r++) y[(m0 + r) * N + n] = out[r];
            }
        }
#endif
    }
}

/* Grouped int8 -> bfloat16 (N, K): w = q * scale[k / G, n] (+ zero[k / G, n] when zero is not
 * NULL) in float32, rounded to nearest even; G % 32 == 0. */
void tritium_int8g_to_bf16(const int8_t *w, const float *scale, const float *zero, int64_t N, int64_t K,
                           int64_t G, uint16_t *out) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < K; k += 32) {
            const int64_t g = k / G;
            int8g_block(w + n * K + k, scale[g * N + n], zero ? zero[g * N + n] : 0.0f, out + n * K + k);
        }
}

/* w (N, K) int8 -> out (N, K) bfloat16, exact (|q| <= 127 has 7 significant bits). */
void tritium_int8_to_bf16(const int8_t *w, int64_t n, uint16_t *out) {
    const int64_t whole = n / 32 * 32;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < whole; i += 32) int8_block(w + i, out + i);
    for (int64_t i = whole; i < n; i++) out[i] = f32_to_bf16((float)w[i]); /* tail: exact */
}

/* int4 weight -> bfloat16 (N, K): w = (q - 8) * scale[g] + zero[g] in float32, rounded to nearest
 * even; q from w4 (N, K/2) uint8, low nibble = even k; scale, zero (K/G, N) float16; g = g_idx[k]
 * when g_idx is given (act-order), else k / G (then G % 32 == 0 takes the block path, which
 * rounds as the fused tritium_w4_gemm does); zero NULL: the symmetric layout (zero 0). */
void tritium_int4_to_bf16(const uint8_t *w4, const uint16_t *scale, const uint16_t *zero, const int32_t *g_idx,
                          int64_t N, int64_t K, int64_t G, uint16_t *out) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wn = w4 + n * (K / 2);
        if (!g_idx && G % 32 == 0) {
            for (int64_t k = 0; k < K; k += 32) {
                const int64_t g = k / G;
                int4_block(wn + k / 2, f16_to_f32(scale[g * N + n]), f16_at(zero, g * N + n), out + n * K + k);
            }
            continue;
        }
        for (int64_t k = 0; k < K; k++) {
            const uint8_t b = wn[k / 2];
            const int q = (k & 1) ? (b >> 4) : (b & 0x0F);
            const int64_t g = g_idx ? g_idx[k] : k / G;
            const float v = fmaf((float)(q - 8), f16_to_f32(scale[g * N + n]), f16_at(zero, g * N + n));
            out[n * K + k] = f32_to_bf16(v);
        }
    }
}
