/* The AVX2 path's bf16 dot products and tiles (included by cpu_gemm_bf16.c on hosts with AVX2 and
 * FMA but not AVX-512; MR, NR, NR1, PFB, PFB1 are its). No bf16 dot product: bf16 is widened to
 * float32 in registers with shifts, 8 float32 lanes taking the even and the odd elements of each
 * block of 16 (cpu_simd.h bf16_even / bf16_odd), acc = fma(x_odd, w_odd, fma(x_even, w_even, acc))
 * per block, the last K % 16 zero-padded, then hsum8's fixed 8-lane tree: one order per output,
 * fixed by K. */
#ifndef TRITIUM_CPU_GEMM_BF16_AVX2_H
#define TRITIUM_CPU_GEMM_BF16_AVX2_H
#include "cpu_simd.h"
#ifndef BF2_HINT4
#define BF2_HINT4 _MM_HINT_T0 /* bf16_tile4 (the 1-2-row GEMV): T0 1.2-1.35x T1 on 2 MiB pages */
#endif

/* The last K % 16 values of a row, zero-padded to a block of 16 (zeros add exact zeros). */
INLINE const uint16_t *tail16(const uint16_t *p, int64_t n, uint16_t *buf) {
    for (int i = 0; i < 16; i++) buf[i] = i < n ? p[i] : 0;
    return buf;
}

/* hsum8 of 8 accumulators as 4 pairs (a0 a1 to oa[0], oa[1]; b0 b1 to ob; c to oc; d to od): the
 * same adds as hsum8 on each (lanes i and i + 4 first, then (t0 + t2) + (t1 + t3)), 8 at a time in
 * 12 shuffles and 8 adds instead of 8 scalar trees of 5 steps each. */
INLINE void hsum8x8(__m256 a0, __m256 a1, __m256 b0, __m256 b1, __m256 c0, __m256 c1, __m256 d0, __m256 d1,
                    float *oa, float *ob, float *oc, float *od) {
    /* t: [t(P) | t(Q)], t_i = v_i + v_{i+4}, for (P, Q) = (a0, c0), (a1, c1), (b0, d0), (b1, d1) */
    const __m256 ta = _mm256_add_ps(_mm256_permute2f128_ps(a0, c0, 0x20), _mm256_permute2f128_ps(a0, c0, 0x31));
    const __m256 tb = _mm256_add_ps(_mm256_permute2f128_ps(a1, c1, 0x20), _mm256_permute2f128_ps(a1, c1, 0x31));
    const __m256 tc = _mm256_add_ps(_mm256_permute2f128_ps(b0, d0, 0x20), _mm256_permute2f128_ps(b0, d0, 0x31));
    const __m256 td = _mm256_add_ps(_mm256_permute2f128_ps(b1, d1, 0x20), _mm256_permute2f128_ps(b1, d1, 0x31));
    /* u: per 128-bit half [u0(P), u1(P), u0(P'), u1(P')], u0 = t0 + t2, u1 = t1 + t3 */
    const __m256 u01 = _mm256_add_ps(_mm256_shuffle_ps(ta, tb, _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm256_shuffle_ps(ta, tb, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 u23 = _mm256_add_ps(_mm256_shuffle_ps(tc, td, _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm256_shuffle_ps(tc, td, _MM_SHUFFLE(3, 2, 3, 2)));
    /* u0 + u1: [a0 a1 b0 b1 | c0 c1 d0 d1] */
    const __m256 s = _mm256_add_ps(_mm256_shuffle_ps(u01, u23, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm256_shuffle_ps(u01, u23, _MM_SHUFFLE(3, 1, 3, 1)));
    const __m128 lo = _mm256_castps256_ps128(s), hi = _mm256_extractf128_ps(s, 1);
    _mm_storel_pi((__m64 *)oa, lo);
    _mm_storeh_pi((__m64 *)ob, lo);
    _mm_storel_pi((__m64 *)oc, hi);
    _mm_storeh_pi((__m64 *)od, hi);
}

INLINE void bf16_tile(const uint16_t *x, const uint16_t *w, int64_t K, float *out, int64_t ldo,
                      const char *pf, const int MR_, const int NR_) {
    __m256 acc[MR][NR];
    for (int r = 0; r < MR_; r++)
        for (int c = 0; c < NR_; c++) acc[r][c] = _mm256_setzero_ps();
    const int64_t K16 = K / 16 * 16;
    for (int64_t k = 0; k < K16; k += 16) {
        __m256 we[NR], wo[NR];
        if (pf) _mm_prefetch(pf + k / 16 * NR_ * 32, _MM_HINT_T1); /* NR_ / 2 lines per step */
        for (int c = 0; c < NR_; c++) {
            if (!pf) PREFETCH(w + c * K + k + 8 * 32);
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
    if (MR_ == 4 && NR_ == 2) { /* the full tile: its 8 sums at once, each in hsum8's order */
        hsum8x8(acc[0][0], acc[0][1], acc[1][0], acc[1][1], acc[2][0], acc[2][1], acc[3][0], acc[3][1], out,
                out + ldo, out + 2 * ldo, out + 3 * ldo);
        return;
    }
    for (int r = 0; r < MR_; r++)
        for (int c = 0; c < NR_; c++) out[r * ldo + c] = hsum8(acc[r][c]);
}

/* Up to 2 rows x 4 channels where the weight streams (a few rows): bf16_tile's order per output,
 * 8 accumulator chains (2 x 2 left the FMA latency exposed: half the cache-resident speed), each
 * weight widened once for both rows; pf as bf16_tile (2 lines per step of 16). */
INLINE void bf16_tile4(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t K, float *out, int64_t ldo,
                       const char *pf, const int MR_) {
    __m256 acc[2][4];
    for (int r = 0; r < MR_; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm256_setzero_ps();
    const int64_t K16 = K / 16 * 16;
    for (int64_t k = 0; k < K16; k += 16) {
        _mm_prefetch(pf + k / 16 * 128, BF2_HINT4);
        _mm_prefetch(pf + k / 16 * 128 + 64, BF2_HINT4);
        __m256 xe[2], xo[2];
        for (int r = 0; r < MR_; r++) {
            __m256i xv = load256(x + r * ldx + k);
            xe[r] = bf16_even(xv), xo[r] = bf16_odd(xv);
        }
        for (int c = 0; c < 4; c++) {
            __m256i v = load256(w + c * K + k);
            __m256 we = bf16_even(v), wo = bf16_odd(v);
            for (int r = 0; r < MR_; r++) acc[r][c] = _mm256_fmadd_ps(xo[r], wo, _mm256_fmadd_ps(xe[r], we, acc[r][c]));
        }
    }
    if (K16 < K) {
        uint16_t bx[16], bw[16];
        for (int c = 0; c < 4; c++) {
            __m256i v = load256(tail16(w + c * K + K16, K - K16, bw));
            for (int r = 0; r < MR_; r++)
                acc[r][c] = dot16_eo(acc[r][c], tail16(x + r * ldx + K16, K - K16, bx), bf16_even(v), bf16_odd(v));
        }
    }
    for (int r = 0; r < MR_; r++)
        for (int c = 0; c < 4; c++) out[r * ldo + c] = hsum8(acc[r][c]);
}

INLINE void bf16_row(const uint16_t *x, const uint16_t *w, int64_t K, float *out, const int NC) {
    __m256 acc[NR1];
    for (int c = 0; c < NC; c++) acc[c] = _mm256_setzero_ps();
    const int64_t K16 = K / 16 * 16;
    /* as on AVX-512, NC / 2 lines per step of 16, PFB1 bytes ahead (without: 0.4x read speed) */
    const char *next = (const char *)w + PFB1;
    for (int64_t k = 0; k < K16; k += 16) {
        __m256i xv = load256(x + k);
        __m256 xe = bf16_even(xv), xo = bf16_odd(xv);
        const char *pf = next + (k / 16) * NC * 32;
        for (int c = 0; c < NC; c++) {
            if (c % 2 == 0) _mm_prefetch(pf + c * 32, _MM_HINT_T1);
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

#endif
