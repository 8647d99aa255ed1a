/* Integer-dot quantized GEMM for small batches (W8A8 and W4A8): y (M, N) = xhat (M, K) W^T.
 *
 * Activations: each row of x (bfloat16) is quantized on its own, per block of 32 values, to int8
 * with a float32 scale: d = amax / 127, q = round_half_even(x * (127 / amax)) (q = 0 when
 * amax = 0); xhat = d q. A row's codes depend on that row alone, so a row's result never depends
 * on the other rows of the call (batch invariance, docs/determinism.md).
 *
 * Weights (repacked at load by kernels/i8dot_pack.py): unsigned codes u with a per-kind offset
 * (int8: u = c + 128 in one byte; int4: u = nibble, c = u - 8, two per byte, byte j of a block of
 * 32 holding k = j in its low and k = j + 16 in its high nibble), per block of 32 a float16 scale
 * d and, for asymmetric layers, a float16 zero z, and per output channel a float32 power of two
 * r: w = r (c d + z).
 *
 * y[m][n] = r[n] (sum_b xd[m][b] d[n][b] T[m][n][b] + sum_b xd[m][b] S[m][b] z[n][b]), with
 * T = sum_k c_k q_k over block b (exact in int32) and S = sum_k q_k the block's code sum.
 * The integer dot products: AVX-512 VNNI (VPDPBUSD: unsigned weight codes u times signed
 * activation codes, U = T + offset S exact in int32, the offset's share taken out with the zero
 * term: sum_b xd S (z - offset d)), AVX2 (VPMADDUBSW + VPMADDWD; int8 weights through the sign
 * trick so that no pair sum saturates, int4 as AVX-512), and portable C the compiler vectorizes.
 * The float sums run in an order fixed by K.
 * K % 32 == 0.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define QB 32  /* activation and weight block */
#define MR 8   /* rows of x per pass over a channel */
#define NB 16  /* output channels per parallel work item */
#define INLINE static inline __attribute__((always_inline))

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define I8DOT_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define I8DOT_AVX2 1
#endif

static inline float bf16_to_f32(uint16_t b) {
    union { uint32_t u; float f; } v = {(uint32_t)b << 16};
    return v.f;
}

static inline float half_to_f32(uint16_t h) { /* IEEE binary16 -> float32, exact */
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    union { uint32_t u; float f; } v;
    if (e == 0) {
        const float f = (float)m * 5.9604644775390625e-08f; /* 2^-24 */
        return sign ? -f : f;
    }
    v.u = sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112u) << 23) | (m << 13));
    return v.f;
}

/* ---------------------------------------------------------------- activation quantization */

/* One row: xq (K) codes, xd (K/32) scales, xs (K/32) code sums. The AVX2 form (also taken by the
 * AVX-512 build) computes the same values: the same float32 product, rounded half to even by
 * VROUNDPS, clamped, the absolute maximum taken exactly. */
static void quantize_row(const uint16_t *x, int64_t K, int8_t *xq, float *xd, int32_t *xs) {
#if defined(__AVX2__) && defined(__FMA__)
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
        _mm256_storeu_si256((__m256i *)(xq + b * QB),
                            _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
        xd[b] = amax / 127.0f;
        xs[b] = _mm_cvtsi128_si32(s4);
    }
#else
    for (int64_t b = 0; b < K / QB; b++) {
        const uint16_t *xb = x + b * QB;
        int8_t *qb = xq + b * QB;
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
        xd[b] = amax / 127.0f;
        xs[b] = s;
    }
#endif
}

/* The quantization alone (tests compare it with the torch definition). */
void tritium_q8_quantize(const uint16_t *x, int64_t M, int64_t K, int8_t *xq, float *xd, int32_t *xs) {
    for (int64_t m = 0; m < M; m++)
        quantize_row(x + m * K, K, xq + m * K, xd + m * (K / QB), xs + m * (K / QB));
}

/* ---------------------------------------------------------------- per-path block dots */

#if defined(I8DOT_AVX512)
/* 64 weight codes (two blocks) as unsigned bytes in k order. */
INLINE __m512i load_u64(const uint8_t *wn, int64_t k, const int BITS) {
    if (BITS == 8) return _mm512_loadu_si512((const void *)(wn + k));
    const __m256i v = _mm256_loadu_si256((const __m256i *)(wn + k / 2)), m4 = _mm256_set1_epi8(0x0f);
    const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    /* [A lo, B lo, A hi, B hi] -> [A lo, A hi, B lo, B hi] (128-bit lanes) */
    const __m512i t = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    return _mm512_shuffle_i64x2(t, t, _MM_SHUFFLE(3, 1, 2, 0));
}

INLINE __m256i load_u32(const uint8_t *wn, int64_t k, const int BITS) {
    if (BITS == 8) return _mm256_loadu_si256((const __m256i *)(wn + k));
    const __m128i v = _mm_loadu_si128((const __m128i *)(wn + k / 2)), m4 = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4));
}

/* out[r] = sum_b xd[r][b] d[b] U[r][b] for MR_ rows, U = sum_k u_k q_k the unsigned codes' dot
 * (the offset's share, off x S, is taken out with the zero term); xdx: each block's xd repeated
 * in its 8 lanes. */
#define UNSIGNED_DOT(bits) 1
INLINE void dot_rows(const int8_t *xq, const float *xdx, int64_t K, const uint8_t *wn,
                     const uint16_t *dn, float *out, const int BITS, const int MR_) {
    __m512 acc[MR];
    __m256 acc8[MR];
    for (int r = 0; r < MR_; r++) acc[r] = _mm512_setzero_ps(), acc8[r] = _mm256_setzero_ps();
    const int64_t K4 = K / 4, K64 = K / 64 * 64;
    for (int64_t k = 0; k < K64; k += 64) {
        const int64_t b = k / QB;
        const __m512i w = load_u64(wn, k, BITS);
        const __m512 dv = _mm512_cvtph_ps(_mm256_set_m128i(_mm_set1_epi16((short)dn[b + 1]),
                                                           _mm_set1_epi16((short)dn[b])));
        for (int r = 0; r < MR_; r++) {
            const __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w,
                                                  _mm512_loadu_si512((const void *)(xq + r * K + k)));
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(t), dv), _mm512_loadu_ps(xdx + r * K4 + k / 4),
                                     acc[r]);
        }
    }
    if (K64 < K) { /* one block left */
        const int64_t k = K64, b = k / QB;
        const __m256i w = load_u32(wn, k, BITS);
        const __m256 dv = _mm256_set1_ps(_cvtsh_ss(dn[b]));
        for (int r = 0; r < MR_; r++) {
            const __m256i t = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w,
                                                  _mm256_loadu_si256((const __m256i *)(xq + r * K + k)));
            acc8[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(t), dv), _mm256_loadu_ps(xdx + r * K4 + k / 4),
                                      acc8[r]);
        }
    }
    for (int r = 0; r < MR_; r++) {
        const __m256 h = _mm256_add_ps(_mm256_add_ps(_mm512_castps512_ps256(acc[r]),
                                                     _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1))),
                                       acc8[r]);
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        out[r] = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
    }
}

/* sum_b xz[b] z[b] over nb blocks (xz = xd x code sum). */
static inline float zero_term(const float *xz, const uint16_t *zn, int64_t nb) {
    __m512 acc = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 16 <= nb; b += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(xz + b), _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(zn + b))), acc);
    float s = _mm512_reduce_add_ps(acc);
    for (; b < nb; b++) s += xz[b] * _cvtsh_ss(zn[b]);
    return s;
}

#elif defined(I8DOT_AVX2)
#define UNSIGNED_DOT(bits) ((bits) == 4) /* int8: the sign trick gives T itself */
INLINE __m256i load_u32(const uint8_t *wn, int64_t k, const int BITS) {
    if (BITS == 8) return _mm256_loadu_si256((const __m256i *)(wn + k));
    const __m128i v = _mm_loadu_si128((const __m128i *)(wn + k / 2)), m4 = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4));
}

INLINE void dot_rows(const int8_t *xq, const float *xd, int64_t K, const uint8_t *wn,
                     const uint16_t *dn, float *out, const int BITS, const int MR_) {
    __m256 acc[MR];
    for (int r = 0; r < MR_; r++) acc[r] = _mm256_setzero_ps();
    const int64_t KB = K / QB;
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    for (int64_t k = 0; k < K; k += QB) {
        const int64_t b = k / QB;
        const float d = _cvtsh_ss(dn[b]);
        const __m256i u = load_u32(wn, k, BITS);
        /* int8: signed codes c = u - 128, |c| times sign(c) x (|c| <= 128, |x| <= 127: pair sums fit int16) */
        const __m256i c = BITS == 8 ? _mm256_xor_si256(u, flip) : u;
        const __m256i a = BITS == 8 ? _mm256_abs_epi8(c) : u;
        for (int r = 0; r < MR_; r++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + r * K + k));
            __m256i t;
            if (BITS == 8) {
                t = _mm256_madd_epi16(_mm256_maddubs_epi16(a, _mm256_sign_epi8(x, c)), ones);
            } else {
                t = _mm256_madd_epi16(_mm256_maddubs_epi16(a, x), ones); /* unsigned codes: U */
            }
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(xd[r * KB + b] * d), acc[r]);
        }
    }
    for (int r = 0; r < MR_; r++) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        out[r] = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
    }
}

/* int8 weights (W8A8 on AVX2): dot_rows with each block's scale product taken as one vector
 * multiply by the row's lane-repeated scales (xdx, as on AVX-512) instead of a scalar product and
 * a broadcast per row and block; the weight scale is widened once per block for all rows: per
 * block (T d) xd, the products of the AVX-512 path, in an order fixed by K. */
INLINE void dot_rows8(const int8_t *xq, const float *xdx, int64_t K, const uint8_t *wn, const uint16_t *dn,
                      float *out, const int MR_) {
    __m256 acc[MR];
    for (int r = 0; r < MR_; r++) acc[r] = _mm256_setzero_ps();
    const int64_t K4 = K / 4;
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    for (int64_t k = 0; k < K; k += QB) {
        const __m256 dv = _mm256_set1_ps(_cvtsh_ss(dn[k / QB]));
        const __m256i c = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(wn + k)), flip);
        const __m256i a = _mm256_abs_epi8(c);
        for (int r = 0; r < MR_; r++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + r * K + k));
            const __m256i t = _mm256_madd_epi16(_mm256_maddubs_epi16(a, _mm256_sign_epi8(x, c)), ones);
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(t), dv), _mm256_loadu_ps(xdx + r * K4 + k / 4),
                                     acc[r]);
        }
    }
    for (int r = 0; r < MR_; r++) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        out[r] = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
    }
}
#define HAVE_ROWS8 1

static inline float zero_term(const float *xz, const uint16_t *zn, int64_t nb) {
    __m256 acc = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(xz + b), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(zn + b))), acc);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    float t = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
    for (; b < nb; b++) t += xz[b] * _cvtsh_ss(zn[b]);
    return t;
}

#else /* portable C */
#define UNSIGNED_DOT(bits) 0
INLINE void dot_rows(const int8_t *xq, const float *xd, int64_t K, const uint8_t *wn,
                     const uint16_t *dn, float *out, const int BITS, const int MR_) {
    float acc[MR] = {0};
    const int64_t KB = K / QB;
    for (int64_t b = 0; b < KB; b++) {
        int8_t c[QB];
        if (BITS == 8) {
            for (int i = 0; i < QB; i++) c[i] = (int8_t)(wn[b * QB + i] ^ 0x80u);
        } else {
            const uint8_t *p = wn + b * (QB / 2);
            for (int i = 0; i < QB / 2; i++) {
                c[i] = (int8_t)((p[i] & 0x0f) - 8);
                c[i + QB / 2] = (int8_t)((p[i] >> 4) - 8);
            }
        }
        const float d = half_to_f32(dn[b]);
        for (int r = 0; r < MR_; r++) {
            const int8_t *x = xq + r * K + b * QB;
            int32_t t = 0;
            for (int i = 0; i < QB; i++) t += (int32_t)c[i] * x[i];
            acc[r] += (float)t * (xd[r * KB + b] * d);
        }
    }
    for (int r = 0; r < MR_; r++) out[r] = acc[r];
}

static inline float zero_term(const float *xz, const uint16_t *zn, int64_t nb) {
    float s = 0.0f;
    for (int64_t b = 0; b < nb; b++) s += xz[b] * half_to_f32(zn[b]);
    return s;
}
#endif

/* ---------------------------------------------------------------- the GEMM */

#define DISPATCH(CALL, mr)                                   \
    switch (mr) {                                            \
    case 1: CALL(1); break; case 2: CALL(2); break;          \
    case 3: CALL(3); break; case 4: CALL(4); break;          \
    case 5: CALL(5); break; case 6: CALL(6); break;          \
    case 7: CALL(7); break; default: CALL(8); break;         \
    }

/* x bfloat16 (M, K); w: int8 codes u = c + 128 (N, K) when bits == 8, int4 nibbles (N, K/2)
 * when bits == 4; d, z float16 bits (N, K/32) (z NULL: symmetric); r float32 (N,); y float32
 * (M, N). Returns 0, or -1 when the scratch memory cannot be allocated. */
int tritium_i8dot_gemm(const uint16_t *x, const uint8_t *w, const uint16_t *d, const uint16_t *z, const float *r,
                       float *y, int64_t M, int64_t N, int64_t K, int64_t bits) {
    const int64_t KB = K / QB, K4 = K / 4;
    const int32_t off = bits == 8 ? 128 : 8;
    /* scratch: codes, per-lane scales (AVX-512, AVX2 int8), per-block scales, xd x S, S */
    const size_t bytes = (size_t)M * (size_t)(K + 4 * K4 + 4 * KB + 4 * KB + 4 * KB) + 64;
    char *mem = (char *)malloc(bytes);
    if (!mem) return -1;
    int8_t *xq = (int8_t *)mem;
    float *xdx = (float *)(mem + (size_t)M * K);
    float *xd = xdx + M * K4;
    float *xz = xd + M * KB;
    int32_t *xs = (int32_t *)(xz + M * KB);
    for (int64_t m = 0; m < M; m++) {
        quantize_row(x + m * K, K, xq + m * K, xd + m * KB, xs + m * KB);
        for (int64_t b = 0; b < KB; b++) {
            xz[m * KB + b] = xd[m * KB + b] * (float)xs[m * KB + b];
            for (int i = 0; i < 8; i++) xdx[m * K4 + b * 8 + i] = xd[m * KB + b];
        }
    }
#if defined(I8DOT_AVX512)
    const float *xsc = xdx; /* per-lane scales */
#else
    const float *xsc = xd;  /* per-block scales */
#endif
    const int64_t xstride = xsc == xdx ? K4 : KB;
    const int64_t wrow = bits == 8 ? K : K / 2;
    const int64_t nblocks = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < nblocks; nb++) {
        const int64_t n1 = (nb + 1) * NB < N ? (nb + 1) * NB : N;
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int64_t mr = M - m0 < MR ? M - m0 : MR;
            for (int64_t n = nb * NB; n < n1; n++) {
                float out[MR];
                if (bits == 8) {
#ifdef HAVE_ROWS8
#define D8(R) dot_rows8(xq + m0 * K, xdx + m0 * K4, K, w + n * wrow, d + n * KB, out, R)
#else
#define D8(R) dot_rows(xq + m0 * K, xsc + m0 * xstride, K, w + n * wrow, d + n * KB, out, 8, R)
#endif
                    DISPATCH(D8, mr)
                } else {
#define D4(R) dot_rows(xq + m0 * K, xsc + m0 * xstride, K, w + n * wrow, d + n * KB, out, 4, R)
                    DISPATCH(D4, mr)
                }
                for (int64_t i = 0; i < mr; i++) {
                    float zt = z ? zero_term(xz + (m0 + i) * KB, z + n * KB, KB) : 0.0f;
                    if (UNSIGNED_DOT(bits)) zt -= (float)off * zero_term(xz + (m0 + i) * KB, d + n * KB, KB);
                    y[(m0 + i) * N + n] = (out[i] + zt) * r[n];
                }
            }
        }
    }
    free(mem);
    return 0;
}
