/* Helpers shared by the native CPU kernels, per instruction-set path (kernels/cpu_isa.py):
 *   TRITIUM_AVX512: AVX-512 F/BW/VL + AVX512-BF16 (16 float32 lanes, VDPBF16PS);
 *   TRITIUM_AVX2:   AVX2 + FMA (8 float32 lanes; bf16 widened to float32 with shifts);
 *   neither:        portable C over small arrays that the compiler vectorizes (any CPU).
 * The scalar helpers (bf16 <-> float32, 16-lane sums) exist on every path. */
#ifndef TRITIUM_CPU_SIMD_H
#define TRITIUM_CPU_SIMD_H
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define TRITIUM_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define TRITIUM_AVX2 1
#endif
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#define INLINE static inline __attribute__((always_inline))

/* ---- scalar (every path) ---- */
INLINE float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40); /* NaN */
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* f rounded to bfloat16 (nearest even), as a float32 */
INLINE float bf16_roundf(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* Sum of 16 lanes in a fixed tree (lane i + lane i + 8, then + 4, + 2, + 1): the portable paths'
 * end of every dot product, so a sum's order depends on nothing but the lane values. */
INLINE float sum16(const float *a) {
    float s8[8], s4[4];
    for (int i = 0; i < 8; i++) s8[i] = a[i] + a[i + 8];
    for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

#if defined(__x86_64__) || defined(_M_X64)
#define PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)
#else
#define PREFETCH(p) __builtin_prefetch((const void *)(p), 0, 3)
#endif

#if defined(TRITIUM_AVX512)
/* exp for float32 lanes: x = n ln2 + r, |r| <= ln2 / 2, degree-6 Taylor polynomial of e^r
 * (relative error < 2e-7), scaled by 2^n with VSCALEFPS. Inputs below -87 give 0. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* 16 horizontal sums at once, each in _mm512_reduce_add_ps's tree (GCC and clang: lane i + i+8,
 * then j + j+4, then (0+2, 1+3), then the two halves), so every sum has the bits of a separate
 * reduce: a[0..15] -> lane 4q + j holds the sum of a[4j + q] (a 4 x 4 transpose). */
static inline __m512 reduce16(const __m512 *a) {
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

static inline __m512 bf16x16_to_f32(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 16 float32 lanes -> bf16 with round-to-nearest-even (VCVTNEPS2BF16), and back. */
static inline __m256i f32x16_to_bf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }
static inline __m512 bf16_round(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(f32x16_to_bf16(x)), 16));
}
#endif

#if defined(TRITIUM_AVX2)
/* The AVX2 dot-product layout: a block of 16 bf16 values is one 256-bit load; its even elements
 * (k = 2i) are lane i of `lo` (shifted up 16 bits) and its odd elements (k = 2i + 1) lane i of `hi`
 * (low 16 bits cleared): two widening instructions per 16 values, no shuffles. Every dot product
 * on this path adds lo products then hi products into 8 float32 lanes, 16 k per step, so a lane's
 * order is fixed by K. */
INLINE __m256 bf16_even(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
INLINE __m256 bf16_odd(__m256i v) {
    return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
}
INLINE __m256i load256(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* 8 consecutive bf16 -> 8 float32 lanes in order (VPMOVZXWD + shift). */
INLINE __m256 bf16x8_to_f32(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* 8 float32 lanes rounded to bf16 (nearest even; weights and activations are never NaN here),
 * packed into 8 uint16 in order. */
INLINE __m256i bf16_rne_bits(__m256 x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
}
INLINE void store_bf16x8(uint16_t *p, __m256 x) {
    __m256i b = bf16_rne_bits(x); /* 8 x 32-bit, value in the low half */
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    _mm_storeu_si128((__m128i *)p, packed);
}
/* x rounded to bf16, kept as float32 (low 16 bits zero): the bits of bf16_rne_bits, masked in place */
INLINE __m256 bf16_round8(__m256 x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xFFFF0000u)));
}
/* 16 int8 (k order) -> float32 in the even / odd layout: e lane i = q[2i], o lane i = q[2i + 1]. */
INLINE void i8x16_eo(const int8_t *p, __m256 *e, __m256 *o) {
    __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    *e = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 16));
    *o = _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 16));
}
/* 8 bytes of nibbles (byte i: k = 2i low, 2i + 1 high) -> q - 8 in the even / odd layout. */
INLINE void i4x16_eo(const uint8_t *p, __m256 *e, __m256 *o) {
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)), eight = _mm256_set1_epi32(8);
    *e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x0F)), eight));
    *o = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b, 4), eight));
}
/* acc += x[0:16] . w in the even / odd layout: even products first, then odd */
INLINE __m256 dot16_eo(__m256 acc, const uint16_t *x, __m256 we, __m256 wo) {
    __m256i xv = load256(x);
    return _mm256_fmadd_ps(bf16_odd(xv), wo, _mm256_fmadd_ps(bf16_even(xv), we, acc));
}
/* even / odd lanes back to 16 bf16 in k order */
INLINE void store_eo_bf16(uint16_t *out, __m256 e, __m256 o) {
    __m256i v = _mm256_or_si256(bf16_rne_bits(e), _mm256_slli_epi32(bf16_rne_bits(o), 16));
    _mm256_storeu_si256((__m256i *)out, v);
}

/* Sum of 8 lanes in a fixed tree: (l0+l4, l1+l5, l2+l6, l3+l7), then pairs. */
INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp for float32 lanes, as exp512: x = n ln2 + r, degree-6 polynomial of e^r, times 2^n built in
 * the exponent bits. Inputs below -87 give about 0 (n >= -126 keeps 2^n normal); above 88, inf
 * is never asked for (softmax and SiLU feed x <= 0 or moderate values). */
INLINE __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    /* 2^n: n + 127 in the exponent field; 88 ln2-units overflow to 2^127 * p, still finite */
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

/* A grouped weight's value q * s + z rounded to bfloat16 (portable path; the SIMD paths use one
 * FMA). The fused GEMMs and the conversions to bfloat16 both call it, so they round alike. */
INLINE float bf16_round_finite(float f) { /* bf16_roundf without the NaN case: vectorizes */
    uint32_t u;
    memcpy(&u, &f, 4);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    memcpy(&f, &u, 4);
    return f;
}
INLINE float deq(float q, float s, float z) { return bf16_round_finite(q * s + z); }

/* exp for the portable path: the same reduction and polynomial as exp512 / exp256, scalar
 * (the compiler vectorizes loops over it where it can). */
INLINE float exp_poly(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    /* round to nearest even by adding and subtracting 1.5 * 2^23 (no SSE4.1 roundps needed;
     * exact for |t| < 2^22, and |t| <= 128 here; IEEE arithmetic, so the compiler keeps both) */
    const float t = x * 1.44269504088896341f;
    float n = (t + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693145751953125f;
    r = r - n * 1.428606765330187045e-06f;
    float p = 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, 4);
    return p * two_n;
}
#endif
