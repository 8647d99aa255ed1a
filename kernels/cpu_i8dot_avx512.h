/* The AVX-512 VNNI panel kernels of the integer-dot GEMM (cpu_gemm_i8dot.c, which includes this
 * file on its AVX-512 path only; acts_t, aidx, QB, MR, PFB, FOLD4, pf_bytes and INLINE are defined
 * there). */
#ifndef TRITIUM_CPU_I8DOT_AVX512_H
#define TRITIUM_CPU_I8DOT_AVX512_H

#define OFF8 128 /* int8 codes: u = c ^ 0x80 = c + 128 for VPDPBUSD's unsigned operand */
#define OFF4 8
#define OFF4F 128 /* folded int4: the byte 8 u + zc = c + 128 */
/* One panel of 16 channels, rows m0 .. m0 + MR_ - 1: out (MR_, 16) = sum_b (T d) xd + xz z.
 * Each block's weights are loaded (and widened) once into 8 registers of 16 channels x 4 k and used
 * for every row: T of a row = 8 VPDPBUSD with the row's 4 codes broadcast, started from -off S.
 * The rows' T chains are interleaved (vector i of every row, then i + 1: MR_ independent chains
 * in flight) and the accumulators stay in registers; ZP (0: no zero term, 1: the float zero term,
 * 2: folded int4, each weight byte 8 u + zc; 3: folded int4 for 1-2 rows, the nibbles' sums U, then
 * T = 8 U + (zc - 128) S per row: the same integer, fewer unpacking operations) is fixed at compile
 * time. Each row's operations and their order are those of one row alone. */
/* t + the dot of u's unsigned bytes with the 4 signed codes at p in every lane: the codes as an
 * embedded broadcast of VPDPBUSD's memory operand (GCC emits a separate VPBROADCASTD otherwise). */
INLINE __m512i dpbusd_b(__m512i t, __m512i u, const int8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(t) : "v"(u), "m"(*(const int32_t *)p));
    return t;
}

/* A folded int4 block (the 256 bytes of nibbles at p, the 16 channels' zc at z) as the 8 vectors
 * of bytes 8 u + zc (= c + 128) that VPDPBUSD takes. */
INLINE void unpack_fold4(const uint8_t *p, const uint16_t *z, __m512i *u) {
    const __m512i m78 = _mm512_set1_epi8(0x78);
    /* byte 4 j + e of each 128-bit lane L takes channel 4 L + j of the broadcast 16 zc bytes */
    const __m512i zrep = _mm512_set_epi32(0x0f0f0f0f, 0x0e0e0e0e, 0x0d0d0d0d, 0x0c0c0c0c, 0x0b0b0b0b, 0x0a0a0a0a,
                                          0x09090909, 0x08080808, 0x07070707, 0x06060606, 0x05050505, 0x04040404,
                                          0x03030303, 0x02020202, 0x01010101, 0x00000000);
    /* zc of the 16 channels, each byte 4 times: the lanes' 4 k */
    const __m512i zc = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm256_cvtepi16_epi8(_mm256_loadu_si256((const __m256i *)z))), zrep);
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        const __m512i v = _mm512_loadu_si512((const void *)(p + 64 * i));
        u[i] = _mm512_add_epi8(_mm512_and_si512(_mm512_slli_epi16(v, 3), m78), zc);
        u[i + 4] = _mm512_add_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 1), m78), zc);
    }
}

INLINE void panel_z(const acts_t *A, int64_t m0, const uint8_t *wp, const uint16_t *dp, const uint16_t *zp,
                    float *out, const int BITS, const int MR_, const int ZP, const int NOPF) {
    const int64_t K = A->K, KB = K / QB, pf = BITS == 8 && MR_ <= 2 ? pf_bytes : PFB;
    __m512 f[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR_; r++) f[r] = _mm512_setzero_ps();
    const __m512i flip = _mm512_set1_epi8((char)0x80), m4 = _mm512_set1_epi8(0x0f);
    const int64_t t0 = aidx(KB, m0, 0); /* m0 % MR == 0: row r of block b at t0 + b MR + r */
    const int8_t *x0 = A->xq + t0 * QB;
    const int32_t *xo = A->xo + t0;
    const float *xd = A->xd + t0, *xz = A->xz + t0;
    for (int64_t b = 0; b < KB; b++) {
        __m512i u[8];
        if (BITS == 8) {
            const uint8_t *p = wp + b * 512;
            if (!NOPF) {
#pragma GCC unroll 8
                for (int i = 0; i < 8; i++) _mm_prefetch((const char *)(p + pf + 64 * i), _MM_HINT_T1);
            }
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++) u[i] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(p + 64 * i)), flip);
        } else {
            const uint8_t *p = wp + b * 256;
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) _mm_prefetch((const char *)(p + pf + 64 * i), _MM_HINT_T1);
            if (ZP == 2) {
                unpack_fold4(p, zp + b * 16, u);
            } else {
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++) {
                    const __m512i v = _mm512_loadu_si512((const void *)(p + 64 * i));
                    u[i] = _mm512_and_si512(v, m4);
                    u[i + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                }
            }
        }
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dp + b * 16)));
        __m512i t[MR];
#pragma GCC unroll 8
        for (int r = 0; r < MR_; r++) t[r] = ZP == 3 ? _mm512_setzero_si512() : _mm512_set1_epi32(xo[b * MR + r]);
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++)
#pragma GCC unroll 8
            for (int r = 0; r < MR_; r++)
                t[r] = dpbusd_b(t[r], u[i], x0 + (b * MR + r) * QB + 4 * i);
        if (ZP == 3) { /* the nibble sums U: T = 8 U + (zc - 128) S, S = xo / -128 in the low int16 */
            const __m512i zcm = _mm512_sub_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(zp + b * 16))),
                                                 _mm512_set1_epi32(128));
#pragma GCC unroll 8
            for (int r = 0; r < MR_; r++)
                t[r] = _mm512_add_epi32(_mm512_slli_epi32(t[r], 3),
                                        _mm512_madd_epi16(zcm, _mm512_set1_epi32((xo[b * MR + r] / -128) & 0xffff)));
        }
#pragma GCC unroll 8
        for (int r = 0; r < MR_; r++)
            f[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(t[r]), dv), _mm512_set1_ps(xd[b * MR + r]), f[r]);
        if (ZP == 1) {
            const __m512 zv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(zp + b * 16)));
#pragma GCC unroll 8
            for (int r = 0; r < MR_; r++) f[r] = _mm512_fmadd_ps(_mm512_set1_ps(xz[b * MR + r]), zv, f[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR_; r++) _mm512_storeu_ps(out + 16 * r, f[r]);
}

INLINE void panel(const acts_t *A, int64_t m0, const uint8_t *wp, const uint16_t *dp, const uint16_t *zp,
                  float *out, const int BITS, const int MR_) {
    if (BITS == FOLD4) panel_z(A, m0, wp, dp, zp, out, 4, MR_, MR_ <= 2 ? 3 : 2, 0); /* the same integer T */
    else if (zp) panel_z(A, m0, wp, dp, zp, out, BITS, MR_, 1, 0);
    else panel_z(A, m0, wp, dp, zp, out, BITS, MR_, 0, 0);
}

/* Folded int4, rows m0 .. m0 + 8 + MRB - 1 (two tiles of the scratch) of one panel in one pass:
 * each block loaded and unpacked once for both tiles (at 9-16 rows 1.05-1.12x the speed of one
 * pass per tile, the 1-8 row remainder no longer a pass of its own), then the first tile's 8 rows,
 * their T chains interleaved, then the second's MRB; per row the operations of panel_z (ZP 2), in
 * its order, and a 1-2 row tile's ZP 3 gives the same integer T, so the same bits. */
INLINE void panel16(const acts_t *A, int64_t m0, const uint8_t *wp, const uint16_t *dp, const uint16_t *zp,
                    float *out, const int MRB) {
    const int64_t K = A->K, KB = K / QB;
    __m512 f[2 * MR];
#pragma GCC unroll 16
    for (int r = 0; r < MR + MRB; r++) f[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < KB; b++) {
        __m512i u[8];
        const uint8_t *p = wp + b * 256;
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) _mm_prefetch((const char *)(p + PFB + 64 * i), _MM_HINT_T1);
        unpack_fold4(p, zp + b * 16, u);
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dp + b * 16)));
#pragma GCC unroll 2
        for (int g = 0; g < 2; g++) {
            const int R0 = g * MR, NR = g ? MRB : MR;
            const int64_t a0 = aidx(KB, m0 + R0, 0) + b * MR; /* row r of this tile's block b at a0 + r */
            const int8_t *x0 = A->xq + a0 * QB;
            __m512i t[MR];
#pragma GCC unroll 8
            for (int r = 0; r < NR; r++) t[r] = _mm512_set1_epi32(A->xo[a0 + r]);
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++)
#pragma GCC unroll 8
                for (int r = 0; r < NR; r++) t[r] = dpbusd_b(t[r], u[i], x0 + r * QB + 4 * i);
#pragma GCC unroll 8
            for (int r = 0; r < NR; r++)
                f[R0 + r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(t[r]), dv), _mm512_set1_ps(A->xd[a0 + r]),
                                            f[R0 + r]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR + MRB; r++) _mm512_storeu_ps(out + 16 * r, f[r]);
}
#define PASS_ROWS(bits) ((bits) == FOLD4 ? 2 * MR : MR) /* rows per pass over a panel */

#endif
