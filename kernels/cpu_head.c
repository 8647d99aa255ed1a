/* The LM head of int6 embeddings, integer-dot (W6A8): y (M, N) = xhat (M, K) W^T, read at 6 bits.
 *
 * Activations: quantized per row and block of 32 by the integer-dot kernels' own function
 * (tritium_q8_quantize, kernels/cpu_gemm_i8dot.c): xhat = xd q, q int8, so a row's codes depend
 * on that row alone (batch invariance, docs/determinism.md).
 *
 * Weights (repacked at load by kernels/head_pack.py) in panels of 16 output channels (vocabulary
 * rows): per panel and block of 32 inputs, 6 vectors of 64 bytes holding the unsigned codes
 * u = c + 32 (0..63) of the 16 channels, byte [v, j, e] of channel j:
 *   v = 0..3: low nibble = u & 15 at k = 4 v + e, high nibble = u & 15 at k = 4 v + e + 16;
 *   v = 4, 5: bits 2 t, 2 t + 1 = u >> 4 at k = 4 (4 (v - 4) + t) + e, t = 0..3.
 * That is 6 bits per weight; per channel and group of G inputs (G a multiple of 32) a float16
 * scale d, 16 channels side by side, and per channel a float32 power of two r: w = r c d.
 *
 * y[m][n] = r[n] sum_b T[m][n][b] d[n][g(b)] xd[m][b], T = sum_k c_k q_k over block b (exact int32),
 * the sum over b in block order (fixed by K). Per block the 8 slices of 4 inputs are rebuilt as bytes
 * u once per tile of up to 8 rows (AVX-512: once per pass of up to 16 rows, two tiles) and a row's
 * 4 codes are broadcast against the 16 channels (no horizontal sums): AVX-512 VNNI (VPDPBUSD on u, started from -32 S, S the block's code sum), AVX2
 * (VPMADDUBSW on u, two slices summed in int16: 2 x 2 x 63 x 127 < 2^15, then VPMADDWD), portable C
 * (u rebuilt in channel order as 32-bit words, 4 codes each, then per channel a 32-term dot). The float32 steps are those of cpu_gemm_i8dot.c's panels on each path, so an int6
 * head gives the same bits as its codes widened to int8 and run through tritium_i8dot_gemm.
 * K % 32 == 0, G % 32 == 0, K % G == 0.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_f16.h" /* f16_to_f32 */
#include "cpu_split.h"

#define QB 32 /* activation block */
#define MR 8  /* rows of x per pass over a panel */
#define VB 384 /* bytes of a panel's block: 6 x 64 */
#define INLINE static inline __attribute__((always_inline))

void tritium_q8_quantize(const uint16_t *x, int64_t M, int64_t K, int8_t *xq, float *xd, int32_t *xs);

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define HEAD_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HEAD_AVX2 1
#endif

typedef struct {
    const int8_t *xq;
    const float *xd;
    const int32_t *xo; /* -32 S: the codes are unsigned (u = c + 32) on every path */
    int64_t K, bpg;    /* bpg: blocks of 32 per scale group */
} acts_t;

INLINE int32_t load4(const void *p) { int32_t v; memcpy(&v, p, 4); return v; }

#if defined(HEAD_AVX512)
#define OFF 32
#define TILE (2 * MR) /* rows per pass over a panel: panel16 */
/* the high bits of slice 4 h + t, moved to bits 4, 5 of each byte */
INLINE __m512i hi2_512(__m512i h, const int t) {
    const __m512i m2 = _mm512_set1_epi8(0x30);
    switch (t) {
    case 0: return _mm512_and_si512(_mm512_slli_epi16(h, 4), m2);
    case 1: return _mm512_and_si512(_mm512_slli_epi16(h, 2), m2);
    case 2: return _mm512_and_si512(h, m2);
    default: return _mm512_and_si512(_mm512_srli_epi16(h, 2), m2);
    }
}

/* t + the dot of u's unsigned bytes with the 4 signed codes at p in every lane: the codes as an
 * embedded broadcast of VPDPBUSD's memory operand (as cpu_gemm_i8dot.c's panels). */
INLINE __m512i dpbusd_b(__m512i t, __m512i u, const int8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(t) : "v"(u), "m"(*(const int32_t *)p));
    return t;
}

/* The 8 slices of 4 inputs of one block (VB bytes at p) rebuilt as the bytes u = c + 32. */
INLINE void widen_block(const uint8_t *p, __m512i *u) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    const __m512i h0 = _mm512_loadu_si512((const void *)(p + 256)), h1 = _mm512_loadu_si512((const void *)(p + 320));
    for (int i = 0; i < 4; i++) {
        const __m512i v = _mm512_loadu_si512((const void *)(p + 64 * i));
        u[i] = _mm512_or_si512(_mm512_and_si512(v, m4), hi2_512(h0, i));
        u[i + 4] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), m4), hi2_512(h1, i));
    }
}

INLINE void panel(const acts_t *A, int64_t m0, const uint8_t *wp, const uint16_t *dp, float *out, const int MR_) {
    const int64_t K = A->K, KB = K / QB;
    __m512 f[MR];
    for (int r = 0; r < MR_; r++) f[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < KB; b++) {
        const uint8_t *p = wp + b * VB;
        for (int i = 0; i < 6; i++) _mm_prefetch((const char *)(p + 4 * VB + 64 * i), _MM_HINT_T0);
        __m512i u[8];
        widen_block(p, u);
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dp + (b / A->bpg) * 16)));
        for (int r = 0; r < MR_; r++) {
            const int64_t m = m0 + r;
            const int8_t *x = A->xq + m * K + b * QB;
            __m512i t = _mm512_set1_epi32(A->xo[m * KB + b]);
            for (int i = 0; i < 8; i++) t = _mm512_dpbusd_epi32(t, u[i], _mm512_set1_epi32(load4(x + 4 * i)));
            f[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(t), dv), _mm512_set1_ps(A->xd[m * KB + b]), f[r]);
        }
    }
    for (int r = 0; r < MR_; r++) _mm512_storeu_ps(out + 16 * r, f[r]);
}

/* Rows m0 .. m0 + 8 + MRB - 1 (two tiles) of one panel in one pass: each block rebuilt once for
 * both (the rebuild costs about a third of a tile's work), then the first tile's 8 rows, their T
 * chains interleaved, then the second's MRB; per row the operations of panel, in its order. */
INLINE void panel16(const acts_t *A, int64_t m0, const uint8_t *wp, const uint16_t *dp, float *out, const int MRB) {
    const int64_t K = A->K, KB = K / QB;
    __m512 f[2 * MR];
#pragma GCC unroll 16
    for (int r = 0; r < MR + MRB; r++) f[r] = _mm512_setzero_ps();
    const int8_t *x0 = A->xq + m0 * K;
    const int32_t *xo = A->xo + m0 * KB;
    const float *xd = A->xd + m0 * KB;
    for (int64_t b = 0; b < KB; b++) {
        __m512i u[8];
        const uint8_t *p = wp + b * VB;
#pragma GCC unroll 6
        for (int i = 0; i < 6; i++) _mm_prefetch((const char *)(p + 4 * VB + 64 * i), _MM_HINT_T0);
        widen_block(p, u);
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dp + (b / A->bpg) * 16)));
#pragma GCC unroll 2
        for (int g = 0; g < 2; g++) {
            const int R0 = g * MR, NR = g ? MRB : MR;
            __m512i t[MR];
#pragma GCC unroll 8
            for (int r = 0; r < NR; r++) t[r] = _mm512_set1_epi32(xo[(R0 + r) * KB + b]);
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++)
#pragma GCC unroll 8
                for (int r = 0; r < NR; r++) t[r] = dpbusd_b(t[r], u[i], x0 + (R0 + r) * K + b * QB + 4 * i);
#pragma GCC unroll 8
            for (int r = 0; r < NR; r++)
                f[R0 + r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(t[r]), dv),
                                            _mm512_set1_ps(xd[(R0 + r) * KB + b]), f[R0 + r]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR + MRB; r++) _mm512_storeu_ps(out + 16 * r, f[r]);
}

#elif defined(HEAD_AVX2)
#define OFF 32
#define TILE MR
INLINE __m256i hi2_256(__m256i h, const int t) {
    const __m256i m2 = _mm256_set1_epi8(0x30);
    switch (t) {
    case 0: return _mm256_and_si256(_mm256_slli_epi16(h, 4), m2);
    case 1: return _mm256_and_si256(_mm256_slli_epi16(h, 2), m2);
    case 2: return _mm256_and_si256(h, m2);
    default: return _mm256_and_si256(_mm256_srli_epi16(h, 2), m2);
    }
}

/* channels 8 h .. 8 h + 7 of the panel */
INLINE void half_panel(const acts_t *A, int64_t m0, const uint8_t *wp, const uint16_t *dp, float *out,
                       const int MR_, const int h) {
    const int64_t K = A->K, KB = K / QB;
    __m256 f[MR];
    for (int r = 0; r < MR_; r++) f[r] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(0x0f);
    for (int64_t b = 0; b < KB; b++) {
        const uint8_t *p = wp + b * VB + 32 * h;
        for (int i = 0; i < 6; i++) _mm_prefetch((const char *)(p + 4 * VB + 64 * i), _MM_HINT_T0);
        __m256i u[8];
        const __m256i h0 = _mm256_loadu_si256((const __m256i *)(p + 256)), h1 = _mm256_loadu_si256((const __m256i *)(p + 320));
        for (int i = 0; i < 4; i++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 64 * i));
            u[i] = _mm256_or_si256(_mm256_and_si256(v, m4), hi2_256(h0, i));
            u[i + 4] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), hi2_256(h1, i));
        }
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dp + (b / A->bpg) * 16 + 8 * h)));
        for (int r = 0; r < MR_; r++) {
            const int64_t m = m0 + r;
            const int8_t *x = A->xq + m * K + b * QB;
            __m256i t = _mm256_set1_epi32(A->xo[m * KB + b]);
            for (int i = 0; i < 8; i += 2) {
                const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(u[i], _mm256_set1_epi32(load4(x + 4 * i))),
                                                     _mm256_maddubs_epi16(u[i + 1], _mm256_set1_epi32(load4(x + 4 * i + 4))));
                t = _mm256_add_epi32(t, _mm256_madd_epi16(s16, ones));
            }
            f[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(t), dv), _mm256_set1_ps(A->xd[m * KB + b]), f[r]);
        }
    }
    for (int r = 0; r < MR_; r++) _mm256_storeu_ps(out + 16 * r + 8 * h, f[r]);
}

INLINE void panel(const acts_t *A, int64_t m0, const uint8_t *wp, const uint16_t *dp, float *out, const int MR_) {
    half_panel(A, m0, wp, dp, out, MR_, 0);
    half_panel(A, m0, wp, dp, out, MR_, 1);
}

#else /* portable C: unsigned codes u, T = sum u q - 32 S as on the SIMD paths */
#define OFF 32
#define TILE MR
static __attribute__((noinline)) void dots16(const uint8_t (*restrict c)[QB], const int8_t *restrict x,
                                             int32_t *restrict t) {
    for (int j = 0; j < 16; j++) {
        int32_t s = 0;
        for (int k = 0; k < QB; k++) s += (int32_t)c[j][k] * x[k];
        t[j] = s;
    }
}

/* A block's codes u in channel order, 4 at a time as 32-bit words (one word holds k = 4 i .. 4 i + 3). */
static __attribute__((noinline)) void unpack_block(const uint8_t *restrict p, uint8_t (*restrict c)[QB]) {
    for (int j = 0; j < 16; j++) {
        uint32_t h0, h1;
        memcpy(&h0, p + 256 + 4 * j, 4);
        memcpy(&h1, p + 320 + 4 * j, 4);
        for (int i = 0; i < 4; i++) {
            uint32_t w;
            memcpy(&w, p + 64 * i + 4 * j, 4);
            const uint32_t a = (w & 0x0f0f0f0fu) | (((h0 >> (2 * i)) & 0x03030303u) << 4);
            const uint32_t z = ((w >> 4) & 0x0f0f0f0fu) | (((h1 >> (2 * i)) & 0x03030303u) << 4);
            memcpy(&c[j][4 * i], &a, 4);
            memcpy(&c[j][4 * i + 16], &z, 4);
        }
    }
}

INLINE void panel(const acts_t *A, int64_t m0, const uint8_t *wp, const uint16_t *dp, float *out, const int MR_) {
    const int64_t K = A->K, KB = K / QB;
    float f[MR][16];
    memset(f, 0, sizeof f);
    for (int64_t b = 0; b < KB; b++) {
        uint8_t c[16][QB];
        unpack_block(wp + b * VB, c);
        float dv[16];
        for (int j = 0; j < 16; j++) dv[j] = f16_to_f32(dp[(b / A->bpg) * 16 + j]);
        for (int r = 0; r < MR_; r++) {
            const int64_t m = m0 + r;
            const float xd = A->xd[m * KB + b];
            int32_t t[16];
            dots16((const uint8_t(*)[QB])c, A->xq + m * K + b * QB, t);
            for (int j = 0; j < 16; j++) t[j] += A->xo[m * KB + b];
            for (int j = 0; j < 16; j++) f[r][j] = (float)t[j] * dv[j] * xd + f[r][j];
        }
    }
    for (int r = 0; r < MR_; r++) memcpy(out + 16 * r, f[r], sizeof f[r]);
}
#endif

#include "cpu_rows.h" /* DISPATCH */

#if defined(HEAD_AVX512)
/* Rows m0 .. m0 + mr - 1 (9..16) of one panel through panel16, scaled by r into y: a function of
 * its own (inlined into the panel loop, it slowed the 8-row tiles there by 5-10 %: code placement). */
static __attribute__((noinline)) void pass16(const acts_t *A, int64_t m0, const uint8_t *wp, const uint16_t *dp,
                                             const float *r, float *y, int64_t N, int64_t n0, int64_t nn, int64_t mr) {
    float out[2 * MR * 16];
#define P16(R) panel16(A, m0, wp, dp, out, R)
    DISPATCH(P16, mr - MR)
    for (int64_t i = 0; i < mr; i++)
        for (int64_t j = 0; j < nn; j++) y[(m0 + i) * N + n0 + j] = out[16 * i + j] * r[n0 + j];
}
#else
#define pass16(A, m0, wp, dp, r, y, N, n0, nn, mr) ((void)0) /* TILE == MR: never called */
#endif

/* x bfloat16 (M, K); w (P, K/32, 6, 16, 4) bytes, d float16 bits (P, K/G, 16), r float32 (N,),
 * P = ceil(N / 16); y float32 (M, N). The panels (vocabulary) are split over the OpenMP threads.
 * Returns 0, or -1 when the scratch memory cannot be allocated. */
int tritium_head6_gemm(const uint16_t *x, const uint8_t *w, const uint16_t *d, const float *r, float *y,
                       int64_t M, int64_t N, int64_t K, int64_t G) {
    const int64_t KB = K / QB;
    char *mem = (char *)malloc((size_t)M * (size_t)(K + 8 * KB) + 64);
    if (!mem) return -1;
    int8_t *xq = (int8_t *)mem;
    float *xd = (float *)(mem + (size_t)M * K);
    int32_t *xo = (int32_t *)(xd + M * KB);
    tritium_q8_quantize(x, M, K, xq, xd, xo); /* xo: the code sums S for now */
    for (int64_t i = 0; i < M * KB; i++) xo[i] *= -OFF;
    const acts_t A = {xq, xd, xo, K, G / QB};
    const int64_t P = (N + 15) / 16, pbytes = KB * VB, pd = 16 * (K / G), chunk = split_chunk(P, M * 16 * K);
#pragma omp parallel for schedule(dynamic, chunk) /* claimed panels (cpu_split.h) */
    for (int64_t p = 0; p < P; p++) {
        const int64_t n0 = 16 * p, nn = N - n0 < 16 ? N - n0 : 16;
        for (int64_t m0 = 0; m0 < M;) {
            const int64_t left = M - m0, mr = left < TILE ? left : TILE;
            if (mr > MR) pass16(&A, m0, w + p * pbytes, d + p * pd, r, y, N, n0, nn, mr);
            else {
                float out[MR * 16];
#define P6(R) panel(&A, m0, w + p * pbytes, d + p * pd, out, R)
                DISPATCH(P6, mr)
                for (int64_t i = 0; i < mr; i++)
                    for (int64_t j = 0; j < nn; j++) y[(m0 + i) * N + n0 + j] = out[16 * i + j] * r[n0 + j];
            }
            m0 += mr;
        }
    }
    free(mem);
    return 0;
}

/* The lookup from the same codes: rows ids (T) of the int6 panels as signed int8 codes (T, K). */
void tritium_head6_rows(const uint8_t *w, const int64_t *ids, int64_t T, int64_t K, int8_t *out) {
    const int64_t KB = K / QB;
    for (int64_t t = 0; t < T; t++) {
        const int64_t p = ids[t] / 16, j = ids[t] % 16;
        for (int64_t b = 0; b < KB; b++) {
            const uint8_t *q = w + (p * KB + b) * VB;
            int8_t *o = out + t * K + b * QB;
            for (int e = 0; e < 4; e++) {
                const uint8_t h0 = q[256 + 4 * j + e], h1 = q[320 + 4 * j + e];
                for (int i = 0; i < 4; i++) {
                    const uint8_t v = q[64 * i + 4 * j + e];
                    o[4 * i + e] = (int8_t)(((v & 15) | (((h0 >> (2 * i)) & 3) << 4)) - 32);
                    o[4 * i + e + 16] = (int8_t)(((v >> 4) | (((h1 >> (2 * i)) & 3) << 4)) - 32);
                }
            }
        }
    }
}
