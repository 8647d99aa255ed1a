/* The integer-dot GEMMs' peak on this core (client/bench/i8dot_bench.py --gops): the core
 * instructions of cpu_gemm_i8dot.c's block kernels in independent chains, nothing else. */
#include <stdint.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define I8DOT_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define I8DOT_AVX2 1
#endif

/* iters rounds of
 * 12 independent chains of the block kernels' core step, form 8 (AVX-512: VPDPBUSD, 64 multiply-adds;
 * AVX2: VPSIGNB + VPMADDUBSW + VPMADDWD + VPADDD, 32) or 4 (AVX-512: VPDPBUSD; AVX2: VPMADDUBSW +
 * VPADDW, 32). Returns the multiply-adds done (a checksum keeps the work), 0 on the portable path. */
int64_t tritium_i8dot_peak(int64_t iters, int64_t form) {
#if defined(I8DOT_AVX512)
    __m512i a[12], u = _mm512_set1_epi8(3), x = _mm512_set1_epi8(1);
    for (int j = 0; j < 12; j++) a[j] = _mm512_set1_epi32(j);
    for (int64_t n = 0; n < iters; n++) {
        __asm__ volatile("" : "+v"(u), "+v"(x));
#pragma GCC unroll 12
        for (int j = 0; j < 12; j++) a[j] = _mm512_dpbusd_epi32(a[j], u, x);
    }
    int64_t s = 0;
    for (int j = 0; j < 12; j++) s += _mm512_reduce_add_epi32(a[j]);
    (void)form;
    return s != 42 ? iters * 12 * 64 : 0;
#elif defined(I8DOT_AVX2)
    __m256i a[12], xs[12], u = _mm256_set1_epi8(3), c = _mm256_set1_epi8(-2);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int j = 0; j < 12; j++) a[j] = _mm256_set1_epi32(j), xs[j] = _mm256_set1_epi8((char)(j + 1));
    for (int64_t n = 0; n < iters; n++) {
        __asm__ volatile("" : "+v"(u), "+v"(c)); /* opaque each round: nothing hoisted */
#pragma GCC unroll 12
        for (int j = 0; j < 12; j++) /* a chain's own operand (in memory): no common subexpression */
            a[j] = form == 8 ? _mm256_add_epi32(a[j], _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_sign_epi8(xs[j], c)), ones))
                             : _mm256_add_epi16(a[j], _mm256_maddubs_epi16(u, xs[j]));
    }
    int64_t s = 0;
    for (int j = 0; j < 12; j++) s += _mm256_extract_epi32(a[j], 0);
    return s != 42 ? iters * 12 * 32 : 0;
#else
    (void)iters, (void)form;
    return 0;
#endif
}
