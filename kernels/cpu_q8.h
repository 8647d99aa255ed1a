/* Activation quantization of the integer-dot GEMMs (cpu_gemm_i8dot.c): each row of x (bfloat16)
 * on its own, per block of 32 values, to int8 with a float32 scale: d = amax / 127,
 * q = round_half_even(x * (127 / amax)) (q = 0 when amax = 0); xhat = d q. Included once, by
 * cpu_gemm_i8dot.c (QB defined there). */
#ifndef TRITIUM_CPU_Q8_H
#define TRITIUM_CPU_Q8_H

#include "cpu_f16.h" /* f16_to_f32; cpu_simd.h: bf16_to_f32 */

/* ---------------------------------------------------------------- activation quantization */

/* One row: block b's 32 codes at xq + b qs, its scale xd[b ss] and code sum xs[b ss] (qs = 32,
 * ss = 1: contiguous; the GEMM's scratch interleaves the rows of a tile). The AVX-512 and AVX2 forms
 * compute the portable form's values: the same float32 product, rounded half to even (VRNDSCALEPS /
 * VROUNDPS), clamped, the absolute maximum taken exactly. */
static void quantize_row(const uint16_t *x, int64_t K, int8_t *xq, float *xd, int32_t *xs, int64_t qs, int64_t ss) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512 hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
    for (int64_t b = 0; b < K / QB; b++) {
        __m512 v[2];
        for (int i = 0; i < 2; i++)
            v[i] = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + b * QB + 16 * i))), 16));
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
        const __m512 id = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        __m512i sum = _mm512_setzero_si512();
        for (int i = 0; i < 2; i++) {
            const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(v[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m512i q = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi));
            sum = _mm512_add_epi32(sum, q);
            _mm_storeu_si128((__m128i *)(xq + b * qs + 16 * i), _mm512_cvtepi32_epi8(q));
        }
        xd[b * ss] = amax / 127.0f;
        xs[b * ss] = _mm512_reduce_add_epi32(sum);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    for (int64_t b = 0; b < K / QB; b++) {
        __m256 v[4];
        for (int i = 0; i < 4; i++)
            v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(x + b * QB + 8 * i))), 16));
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], absmask), _mm256_and_ps(v[1], absmask)),
                                 _mm256_max_ps(_mm256_and_ps(v[2], absmask), _mm256_and_ps(v[3], absmask)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        __m256i q[4], sum = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
            sum = _mm256_add_epi32(sum, q[i]);
        }
        /* int32 -> int8 in k order: packs work within 128-bit lanes, a permute restores the order */
        const __m256i p16 = _mm256_packs_epi32(q[0], q[1]), p16b = _mm256_packs_epi32(q[2], q[3]);
        const __m256i p8 = _mm256_packs_epi16(p16, p16b);
        _mm256_storeu_si256((__m256i *)(xq + b * qs),
                            _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
        xd[b * ss] = amax / 127.0f;
        xs[b * ss] = _mm_cvtsi128_si32(s4);
    }
#else
    for (int64_t b = 0; b < K / QB; b++) {
        const uint16_t *xb = x + b * QB;
        int8_t *qb = xq + b * qs;
        float v[QB], amax = 0.0f;
        for (int i = 0; i < QB; i++) {
            v[i] = bf16_to_f32(xb[i]);
            amax = fmaxf(amax, fabsf(v[i]));
        }
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t s = 0;
        for (int i = 0; i < QB; i++) {
            float r = nearbyintf(v[i] * id); /* the default rounding mode: half to even */
            r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
            qb[i] = (int8_t)r;
            s += (int32_t)r;
        }
        xd[b * ss] = amax / 127.0f;
        xs[b * ss] = s;
    }
#endif
}

/* The quantization alone (tests compare it with the torch definition). */
void tritium_q8_quantize(const uint16_t *x, int64_t M, int64_t K, int8_t *xq, float *xd, int32_t *xs) {
    for (int64_t m = 0; m < M; m++)
        quantize_row(x + m * K, K, xq + m * K, xd + m * (K / QB), xs + m * (K / QB), QB, 1);
}

#endif
