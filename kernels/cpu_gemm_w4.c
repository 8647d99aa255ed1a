/* int4 weight-only GEMM: y (M, N) float32 = x (M, K) bf16 @ bf16((q - 8) * scale + zero)^T, the int4
 * layout of tritium_int4_to_bf16 (cpu_gemm.c; no g_idx) with its float16 scales (and zeros; NULL in
 * the symmetric layout) read as stored. Every weight is dequantized to bfloat16 exactly as
 * tritium_int4_to_bf16 does it and every output reduced in tritium_bf16_gemm's order (cpu_gemm_bf16.c),
 * so this gives the bits of conversion + bf16 GEMM for every row count and a layer may switch
 * between them by batch size; a row's bits never depend on the other rows.
 *   one row:  NC1 channels at a time (independent accumulator chains, weight prefetch); on avx512
 *             each group's 16 possible bf16 values are computed once and 32 codes looked up with
 *             one VPERMW.
 *   rows > 1: each block of NB channels is dequantized once into a bf16 panel and
 *             tritium_bf16_panel runs the bf16 GEMM's tiles over all rows on it.
 * K % 32 == 0 and G % 32 == 0. Threads: OpenMP over blocks of output channels.
 */
#include <stdint.h>
#include <stdlib.h>

#include "cpu_f16.h"
#include "cpu_simd.h"
#include "cpu_split.h"

#define NB 32 /* output channels per parallel work item (as tritium_bf16_gemm) */
#define MR 4  /* rows of x the portable w4_rows can take (it serves one row here) */

void tritium_bf16_panel(const uint16_t *x, const uint16_t *w, float *y, int64_t M, int64_t nc, int64_t K,
                        int64_t ldy);

#if defined(TRITIUM_AVX512)
/* int4 through a table: the 16 values bf16((q - 8) s + z) of a group, computed once (the same FMA
 * and rounding as tritium_int4_to_bf16, so the same bits), then 32 codes looked up with
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

/* One row against NC_ channels (decode): tritium_bf16_gemm's order per output, NC_ independent accumulator
 * chains and weight streams (one chain per output left the one-row GEMV bound by VDPBF16PS
 * latency); each group's table built once per channel. */
#define NC1 8
INLINE void w4_cols(const uint16_t *x, int64_t K, int64_t G, const uint8_t *wn, const uint16_t *scale,
                    const uint16_t *zero, int64_t N, float *out, const int NC_) {
    __m512 acc[NC1];
    __m512i table[NC1];
    for (int c = 0; c < NC_; c++) acc[c] = _mm512_setzero_ps(), table[c] = _mm512_setzero_si512();
    for (int64_t k = 0; k < K; k += 32) {
        if (k % G == 0) { /* this group's parameters of the NC_ channels: contiguous float16 */
            const int64_t g0 = k / G * N;
            float sv[NC1], zv[NC1];
            if (NC_ == NC1) {
                _mm256_storeu_ps(sv, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + g0))));
                _mm256_storeu_ps(zv, zero ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(zero + g0)))
                                          : _mm256_setzero_ps());
            } else {
                for (int c = 0; c < NC_; c++) sv[c] = f16_to_f32(scale[g0 + c]), zv[c] = f16_at(zero, g0 + c);
            }
            for (int c = 0; c < NC_; c++) table[c] = w4_table(sv[c], zv[c]);
        }
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
/* One row against NC_ channels (decode): tritium_bf16_gemm's order, NC_ independent accumulator chains. */
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
#define HAVE_W4_COLS 1

#else /* portable C: 16 float32 lanes per output (lane i takes k = 16 j + i), sum16 at the end */
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
    const int64_t nblocks = (N + NB - 1) / NB, chunk = split_chunk(nblocks, M * NB * K);
#pragma omp parallel
    {
        uint16_t *panel = (uint16_t *)malloc((size_t)(NB * K) * sizeof(uint16_t));
#pragma omp for schedule(dynamic, chunk)
        for (int64_t nb = 0; nb < nblocks; nb++) {
            const int64_t n0 = nb * NB, n1 = n0 + NB < N ? n0 + NB : N;
            w4_panel(w4, scale, zero, n0, n1 - n0, N, K, G, panel);
            tritium_bf16_panel(x, panel, y + n0, M, n1 - n0, K, N);
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
    const int64_t nblocks = (N + NB - 1) / NB, chunk = split_chunk(nblocks, NB * K);
#pragma omp parallel for schedule(dynamic, chunk)
    for (int64_t nb = 0; nb < nblocks; nb++) {
        const int64_t n1 = (nb + 1) * NB < N ? (nb + 1) * NB : N;
#ifdef HAVE_W4_COLS
        for (int64_t n = nb * NB; n < n1; n += NC1) {
            const int nc = n1 - n < NC1 ? (int)(n1 - n) : NC1;
            if (nc == NC1) w4_cols(x, K, G, w4 + n * (K / 2), scale + n, zero ? zero + n : 0, N, y + n, NC1);
            else w4_cols(x, K, G, w4 + n * (K / 2), scale + n, zero ? zero + n : 0, N, y + n, nc);
        }
#else
        for (int64_t n = nb * NB; n < n1; n++)
            w4_rows(x, K, G, w4 + n * (K / 2), scale + n, zero ? zero + n : 0, N, y + n, N, 1);
#endif
    }
}
