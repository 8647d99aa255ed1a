/* The AVX2 panel kernel of the integer-dot GEMM (cpu_gemm_i8dot.c, which includes this file on its
 * AVX2 path only; acts_t, aidx, load4, QB, MR, PFB, FOLD4 and INLINE are defined there). */
#ifndef TRITIUM_CPU_I8DOT_AVX2_H
#define TRITIUM_CPU_I8DOT_AVX2_H

#define OFF8 0 /* signed int8 codes through the sign trick */
#define OFF4 8
#define OFF4F (-1) /* folded int4: xz = S as a float (act_row), for the (zc - 128) S term */
/* As AVX-512, per half panel of 8 channels (h): int8 through VPSIGNB / VPMADDUBSW (|c| times
 * sign(x, c): |c| <= 128, |x| <= 127, pair sums fit int16; |c| once per block for all rows) and
 * VPMADDWD; int4 unsigned nibbles u <= 15: the 8 VPMADDUBSW products of a block summed in int16
 * (8 x 2 x 15 x 127 < 2^15), then one VPMADDWD, started from -8 S; folded int4: the same nibble
 * sum U, then T / 8 = U + (zc - 128) / 8 S in one float FMA, exact (every term a multiple of 1/8
 * below 2^17: 20 significant bits), times 8 d: the real product T d of the other paths, so the
 * same rounding and bits as float(T) d. */
/* Block b of half panel h (8 channels) for MR_ rows: f[r] += this block's share of row m0 + r. */
INLINE void half_block(const acts_t *A, int64_t m0, const uint8_t *wp, const uint16_t *dp, const uint16_t *zp,
                       int64_t b, __m256 *f, const int BITS, const int MR_, const int h) {
    const int64_t K = A->K, KB = K / QB;
    const __m256i ones = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(0x0f);
    __m256i a[8];
    const uint8_t *p = wp + b * (BITS == 8 ? 512 : 256) + 32 * h;
    if (BITS == 8) {
        if (h == 0) /* the pass of half 0 brings the lines of both halves */
            for (int i = 0; i < 8; i++) _mm_prefetch((const char *)(p + PFB + 64 * i), _MM_HINT_T1);
        for (int i = 0; i < 8; i++) a[i] = _mm256_abs_epi8(_mm256_loadu_si256((const __m256i *)(p + 64 * i)));
    } else {
        if (h == 0)
            for (int i = 0; i < 4; i++) _mm_prefetch((const char *)(p + PFB + 64 * i), _MM_HINT_T1);
        for (int i = 0; i < 4; i++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 64 * i));
            a[i] = _mm256_and_si256(v, m4);
            a[i + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        }
    }
    const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dp + b * 16 + 8 * h)));
    const int ZF = BITS == FOLD4, ZP = zp && !ZF; /* folded zeros: integer; else a float zero term */
    const __m256 zv = ZP ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(zp + b * 16 + 8 * h)))
                         : _mm256_setzero_ps();
    /* folded: (zc - 128) / 8 and 8 d, exact */
    const __m256 zc8 = ZF ? _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(
                                 _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(zp + b * 16 + 8 * h))),
                                 _mm256_set1_epi32(128))), _mm256_set1_ps(0.125f))
                          : _mm256_setzero_ps();
    const __m256 dv8 = _mm256_mul_ps(dv, _mm256_set1_ps(8.0f));
    const int64_t at = aidx(KB, m0, b); /* m0 % MR == 0: row r's codes at (at + r) QB */
    for (int r = 0; r < MR_; r++) {
        const int64_t ai = at + r;
        const int8_t *x = A->xq + ai * QB;
        __m256i t;
        if (BITS == 8) {
            t = _mm256_setzero_si256();
            for (int i = 0; i < 8; i++) {
                const __m256i c = _mm256_loadu_si256((const __m256i *)(p + 64 * i));
                const __m256i s = _mm256_sign_epi8(_mm256_set1_epi32(load4(x + 4 * i)), c);
                t = _mm256_add_epi32(t, _mm256_madd_epi16(_mm256_maddubs_epi16(a[i], s), ones));
            }
        } else {
            __m256i s16 = _mm256_maddubs_epi16(a[0], _mm256_set1_epi32(load4(x)));
            for (int i = 1; i < 8; i++)
                s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(a[i], _mm256_set1_epi32(load4(x + 4 * i))));
            if (ZF) { /* xz = S: T / 8 exactly, times 8 d */
                const __m256 t8 = _mm256_fmadd_ps(zc8, _mm256_set1_ps(A->xz[ai]),
                                                  _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones)));
                f[r] = _mm256_fmadd_ps(_mm256_mul_ps(t8, dv8), _mm256_set1_ps(A->xd[ai]), f[r]);
                continue;
            }
            t = _mm256_add_epi32(_mm256_madd_epi16(s16, ones), _mm256_set1_epi32(A->xo[ai]));
        }
        f[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(t), dv), _mm256_set1_ps(A->xd[ai]), f[r]);
        if (ZP) f[r] = _mm256_fmadd_ps(_mm256_set1_ps(A->xz[ai]), zv, f[r]);
    }
}

/* Up to 2 rows: both halves of each block in one pass over the panel (the weight read once, in
 * order); more rows: one pass per half (the rows' accumulators and a block's 8 vectors fill the
 * registers). The same operations per channel in the same order either way. */
INLINE void panel(const acts_t *A, int64_t m0, const uint8_t *wp, const uint16_t *dp, const uint16_t *zp,
                  float *out, const int BITS, const int MR_) {
    const int64_t KB = A->K / QB;
    __m256 f[2][MR];
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < MR_; r++) f[h][r] = _mm256_setzero_ps();
    if (MR_ <= 2) {
        for (int64_t b = 0; b < KB; b++) {
            half_block(A, m0, wp, dp, zp, b, f[0], BITS, MR_, 0);
            half_block(A, m0, wp, dp, zp, b, f[1], BITS, MR_, 1);
        }
    } else {
        for (int64_t b = 0; b < KB; b++) half_block(A, m0, wp, dp, zp, b, f[0], BITS, MR_, 0);
        for (int64_t b = 0; b < KB; b++) half_block(A, m0, wp, dp, zp, b, f[1], BITS, MR_, 1);
    }
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < MR_; r++) _mm256_storeu_ps(out + 16 * r + 8 * h, f[h][r]);
}

#endif
