/* Integer-dot quantized GEMM for small batches (W8A8 and W4A8): y (M, N) = xhat (M, K) W^T.
 *
 * Activations: each row of x (bfloat16) is quantized on its own, per block of 32 values, to int8
 * with a float32 scale: d = amax / 127, q = round_half_even(x * (127 / amax)) (q = 0 when
 * amax = 0); xhat = d q. A row's codes depend on that row alone, so a row's result never depends
 * on the other rows of the call (batch invariance, docs/determinism.md).
 *
 * Weights (repacked at load by kernels/i8dot_pack.py) in panels of 16 output channels: per panel
 * and block of 32 inputs, 8 vectors of 64 bytes, vector i holding k = 4 i .. 4 i + 3 of each of the
 * 16 channels (int8: signed codes c; int4: nibbles u = c + 8, the low nibble of vector i, k = 4 i +
 * e, and the high nibble k + 16), then per block a float16 scale d and, for asymmetric layers, a
 * float16 zero z of each channel, and per output channel a float32 power of two r: w = r (c d + z).
 *
 * y[m][n] = r[n] sum_b (T[m][n][b] d[n][b] xd[m][b] + xd[m][b] S[m][b] z[n][b]), with
 * T = sum_k c_k q_k over block b (exact in int32), S = sum_k q_k the block's code sum, the sum over
 * b in block order for every row and channel (fixed by K: batch invariance).
 * int4 with folded zeros (bits == FOLD4; i8dot_pack.py): z holds int16 zc per channel and block,
 * the codes are c = 8 u + zc - 128 and there is no float zero term: y = r sum_b T d xd.
 * A block's weights are loaded once per tile of up to 8 rows (AVX-512 folded int4: once per pass of
 * two tiles, up to 16 rows; cpu_i8dot_avx512.h); a row's 4 codes are broadcast
 * against the 16 channels, so each integer lane sums one channel's whole block and no horizontal
 * sum is left: AVX-512 VNNI (VPDPBUSD: weights as unsigned u = c + 128 or the int4 nibble, the
 * offset's share off S subtracted exactly in int32 by starting the sum from -off S), AVX2
 * (int8: VPSIGNB / VPMADDUBSW / VPMADDWD with |c| and sign(x, c); int4: VPMADDUBSW on the
 * nibbles, 8 products summed in int16, one VPMADDWD) and portable C the compiler vectorizes.
 * K % 32 == 0.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define QB 32  /* activation and weight block */
#define FOLD4 0x14 /* bits: int4 nibbles, z the folded zeros zc (int16) */
#define MR 8   /* rows of x per pass over a channel */
#ifndef PFB
#define PFB 8192 /* bytes of weight requested ahead of the block read, into L2 (hint T1) */
#endif
#define PFB_HUGE 2048 /* the same on 2 MiB pages, AVX-512 int8, 1-2 rows (tritium_i8dot_huge_pages) */
#define INLINE static inline __attribute__((always_inline))

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define I8DOT_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define I8DOT_AVX2 1
#endif

#include "cpu_q8.h" /* quantize_row, tritium_q8_quantize */
#include "cpu_split.h"
#define SPLIT_SEG_ROWS MR /* rows up to which a team splits the panels in contiguous shares */

/* ---------------------------------------------------------------- per-path panel kernels */

/* How far ahead the panels ask for weight lines. On 4 KiB pages the hardware prefetchers stop at
 * every page, and 8 KB ahead measured best on both paths; on 2 MiB pages (kernels/hugepages.py)
 * they run on, and the AVX-512 int8 loop at 1-2 rows read fastest asking 2 KB ahead (8 KB: 0.75x
 * of that; at two rows no software prefetch at all: panel_rows2), while with more rows (3: 0.95x,
 * 4: 0.65x, 8: 0.75x at 2 KB), its int4 loop (twice the work per byte; 0.85x; T0: 0.9x) and the AVX2 loops (0.55x) still want 8 KB (client/bench/gemv_bench.py).
 * Speed only: the results do not depend on it. */
#if defined(I8DOT_AVX512)
static int64_t pf_bytes = PFB;
#endif

/* on != 0: the packed weights the kernels will read lie on 2 MiB pages (the process's choice,
 * made once at load by kernels/hugepages.py's caller); also tells the bf16 GEMM. */
void tritium_bf16_huge_pages(int64_t on); /* cpu_gemm_bf16.c: its one-row GEMV's choice */
void tritium_i8dot_huge_pages(int64_t on) {
    tritium_bf16_huge_pages(on);
#if defined(I8DOT_AVX512)
    pf_bytes = on ? PFB_HUGE : PFB;
#else
    (void)on;
#endif
}

/* Per call, per row m and block b: xq codes, xd scale, xz = xd S (S the block's code sum), xo =
 * -off S (off: the offset of the path's unsigned weight codes, 0 where the path uses signed codes). */
typedef struct {
    const int8_t *xq;
    const float *xd, *xz;
    const int32_t *xo;
    int64_t K;
} acts_t;

/* The scratch holds the rows of a tile of MR rows interleaved: per tile, per block b, the MR rows'
 * 32 codes one after the other (and their xd, xz, xo), so a tile's block is one short stretch. */
INLINE int64_t aidx(int64_t KB, int64_t m, int64_t b) { return ((m / MR) * KB + b) * MR + m % MR; }

INLINE int32_t load4(const void *p) { int32_t v; memcpy(&v, p, 4); return v; }

#if defined(I8DOT_AVX512)
#include "cpu_i8dot_avx512.h" /* dpbusd_b, panel_z, panel, panel16 */

#elif defined(I8DOT_AVX2)
#include "cpu_i8dot_avx2.h" /* half_block, panel */
#define PASS_ROWS(bits) MR
#define panel16(A, m0, wp, dp, zp, out, R) ((void)0) /* PASS_ROWS == MR: never called */

#else /* portable C: signed codes */
#define PASS_ROWS(bits) MR
#define panel16(A, m0, wp, dp, zp, out, R) ((void)0) /* PASS_ROWS == MR: never called */
#define OFF8 0
#define OFF4 0
#define OFF4F 0
/* A block's codes are put back in channel order (c[j][k], once per block for all rows), so each
 * channel's block dot is a contiguous 32-term integer reduction the compiler vectorizes. */
static __attribute__((noinline)) void dots16(const int8_t (*restrict c)[QB], const int8_t *restrict x,
                                             int32_t *restrict t) {
    for (int j = 0; j < 16; j++) {
        int32_t s = 0;
        for (int k = 0; k < QB; k++) s += (int32_t)c[j][k] * x[k];
        t[j] = s;
    }
}

INLINE void panel(const acts_t *A, int64_t m0, const uint8_t *wp, const uint16_t *dp, const uint16_t *zp,
                  float *out, const int BITS, const int MR_) {
    const int64_t K = A->K, KB = K / QB;
    float f[MR][16];
    memset(f, 0, sizeof f);
    for (int64_t b = 0; b < KB; b++) {
        int8_t c[16][QB]; /* channel j, k: 4-byte words moved, int4 nibbles split over 16 bytes at once */
        if (BITS == 8) {
            const uint8_t *p = wp + b * 512;
            for (int i = 0; i < 8; i++)
                for (int j = 0; j < 16; j++) memcpy(&c[j][4 * i], p + 64 * i + 4 * j, 4);
        } else {
            const uint8_t *p = wp + b * 256;
            uint8_t cb[16][QB / 2];
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 16; j++) memcpy(&cb[j][4 * i], p + 64 * i + 4 * j, 4);
            for (int j = 0; j < 16; j++)
                for (int k = 0; k < QB / 2; k++) {
                    /* folded: c = 8 u + zc - 128 (zc 0..135: -128..127); else c = u - 8 */
                    const int zc = BITS == FOLD4 ? (int)zp[b * 16 + j] : 0;
                    c[j][k] = (int8_t)(BITS == FOLD4 ? 8 * (cb[j][k] & 0x0f) + zc - 128 : (cb[j][k] & 0x0f) - 8);
                    c[j][k + QB / 2] = (int8_t)(BITS == FOLD4 ? 8 * (cb[j][k] >> 4) + zc - 128 : (cb[j][k] >> 4) - 8);
                }
        }
        const int ZP = zp && BITS != FOLD4;
        float dv[16], zv[16];
        for (int j = 0; j < 16; j++) dv[j] = f16_to_f32(dp[b * 16 + j]), zv[j] = ZP ? f16_to_f32(zp[b * 16 + j]) : 0.0f;
        for (int r = 0; r < MR_; r++) {
            const int64_t m = m0 + r;
            const int64_t ai = aidx(KB, m, b);
            const int8_t *x = A->xq + ai * QB;
            const float xd = A->xd[ai], xz = A->xz[ai];
            int32_t t[16];
            dots16((const int8_t(*)[QB])c, x, t);
            for (int j = 0; j < 16; j++) f[r][j] = (float)t[j] * dv[j] * xd + f[r][j];
            if (ZP)
                for (int j = 0; j < 16; j++) f[r][j] = xz * zv[j] + f[r][j];
        }
    }
    for (int r = 0; r < MR_; r++) memcpy(out + 16 * r, f[r], sizeof f[r]);
}
#endif

/* ---------------------------------------------------------------- the GEMM */

#include "cpu_rows.h" /* DISPATCH */

/* Panel p (16 channels) for all M rows, PASS_ROWS(bits) at a time (a tile of MR, or two tiles in
 * one pass: avx512 folded int4), scaled by r into y. */
static void panel_rows(const acts_t *A, const uint8_t *w, const uint16_t *d, const uint16_t *z, const float *r,
                       float *y, int64_t M, int64_t N, int64_t bits, int64_t p) {
    const int64_t K = A->K, KB = K / QB, pbytes = 16 * (bits == 8 ? K : K / 2);
    const int64_t n0 = 16 * p, nn = N - n0 < 16 ? N - n0 : 16;
    const uint8_t *wp = w + p * pbytes;
    const uint16_t *dp = d + p * 16 * KB, *zp = z ? z + p * 16 * KB : NULL;
    for (int64_t m0 = 0; m0 < M;) {
        const int64_t left = M - m0, mr = left < PASS_ROWS(bits) ? left : PASS_ROWS(bits);
        float out[2 * MR * 16];
        if (mr > MR) { /* folded int4 on avx512: two tiles in one pass */
#define PQ(R) panel16(A, m0, wp, dp, zp, out, R)
            DISPATCH(PQ, mr - MR)
        } else if (bits == 8) {
#define P8(R) panel(A, m0, wp, dp, zp, out, 8, R)
            DISPATCH(P8, mr)
        } else if (bits == FOLD4) {
#define PF(R) panel(A, m0, wp, dp, zp, out, FOLD4, R)
            DISPATCH(PF, mr)
        } else {
#define P4(R) panel(A, m0, wp, dp, zp, out, 4, R)
            DISPATCH(P4, mr)
        }
        for (int64_t i = 0; i < mr; i++)
            for (int64_t j = 0; j < nn; j++) y[(m0 + i) * N + n0 + j] = out[16 * i + j] * r[n0 + j];
        m0 += mr;
    }
}

#if defined(I8DOT_AVX512)
/* panel_rows for 2 rows of int8 codes on 2 MiB pages: no software prefetch (the hardware
 * prefetchers alone read 1.07-1.14x faster there). A function of its own: the same choice
 * inside panel_rows cost its one-row loop 4-10 % (code placement). */
static __attribute__((noinline)) void panel_rows2(const acts_t *A, const uint8_t *w, const uint16_t *d,
                                                  const uint16_t *z, const float *r, float *y, int64_t N, int64_t p) {
    const int64_t K = A->K, KB = K / QB, n0 = 16 * p, nn = N - n0 < 16 ? N - n0 : 16;
    const uint8_t *wp = w + p * 16 * K;
    const uint16_t *dp = d + p * 16 * KB, *zp = z ? z + p * 16 * KB : NULL;
    float out[2 * 16];
    if (zp) panel_z(A, 0, wp, dp, zp, out, 8, 2, 1, 1);
    else panel_z(A, 0, wp, dp, zp, out, 8, 2, 0, 1);
    for (int64_t i = 0; i < 2; i++)
        for (int64_t j = 0; j < nn; j++) y[i * N + n0 + j] = out[16 * i + j] * r[n0 + j];
}
#define ROWS2(M, bits) ((M) == 2 && (bits) == 8 && pf_bytes == PFB_HUGE)
#else
#define panel_rows2(A, w, d, z, r, y, N, p) ((void)0)
#define ROWS2(M, bits) 0
#endif

/* Row m of x into the scratch: codes, scales, xz = xd S (off -1: S), xo = -off S (S the block's
 * code sum). */
static void act_row(const uint16_t *x, int64_t K, int32_t off, int8_t *xq, float *xd, float *xz, int32_t *xo,
                    int64_t m) {
    const int64_t KB = K / QB, a0 = aidx(KB, m, 0);
    quantize_row(x + m * K, K, xq + a0 * QB, xd + a0, xo + a0, MR * QB, MR); /* xo: S for now */
    for (int64_t b = 0; b < KB; b++) {
        const int64_t ai = a0 + b * MR;
        xz[ai] = off == -1 ? (float)xo[ai] : xd[ai] * (float)xo[ai]; /* -1: S itself (AVX2 folded) */
        xo[ai] *= -off;
    }
}

/* x bfloat16 (M, K); w, d, z in panels of 16 channels (kernels/i8dot_pack.py: codes int8 (P, K/32,
 * 8, 16, 4) when bits == 8, nibbles (P, K/32, 4, 16, 4) when bits == 4 or FOLD4; d, z float16 bits
 * (P, K/32, 16), z NULL: symmetric; FOLD4: z the int16 folded zeros zc (P, K/32, 16)),
 * P = ceil(N / 16); r float32 (N,); y float32 (M, N). Returns 0, or -1 when the scratch memory
 * cannot be allocated. */
int tritium_i8dot_gemm(const uint16_t *x, const uint8_t *w, const uint16_t *d, const uint16_t *z, const float *r,
                       float *y, int64_t M, int64_t N, int64_t K, int64_t bits) {
    const int64_t KB = K / QB;
    const int32_t off = bits == 8 ? OFF8 : bits == FOLD4 ? OFF4F : OFF4;
    /* scratch: codes, scales, xd x S, -off S */
    const int64_t Mp = (M + MR - 1) / MR * MR; /* whole tiles (rows past M unused) */
    const size_t bytes = (size_t)Mp * (size_t)(K + 12 * KB) + 64;
    char *mem = (char *)malloc(bytes);
    if (!mem) return -1;
    int8_t *xq = (int8_t *)mem;
    float *xd = (float *)(mem + (size_t)Mp * K);
    float *xz = xd + Mp * KB;
    int32_t *xo = (int32_t *)(xz + Mp * KB);
    const acts_t A = {xq, xd, xz, xo, K};
    const int64_t P = (N + 15) / 16;
#ifdef _OPENMP
    /* a team of one thread (inside the native step's region, or one thread allowed) costs about
     * 0.9 us a call: a plain loop then */
    if (P > 1 && !omp_in_parallel() && omp_get_max_threads() > 1) {
        const int64_t pchunk = split_chunk(P, M * 16 * K); /* cpu_split.h */
        if (M <= SPLIT_SEG_ROWS) {
            /* a few rows (the decode GEMVs): each thread quantizes the rows into its own scratch
             * (no barrier between the steps) and streams its own contiguous share of the panels,
             * then helps with the other's (split_seg_next) */
            const int64_t nt = omp_get_max_threads() < SPLIT_SEGS ? omp_get_max_threads() : SPLIT_SEGS;
            const size_t stride = (bytes + 63) / 64 * 64; /* each thread's scratch on its own lines */
            char *all = (char *)realloc(mem, stride * (size_t)nt);
            if (!all) {
                free(mem);
                return -1;
            }
            split_seg_t sg;
            split_seg_init(&sg, P, nt, pchunk);
#pragma omp parallel num_threads(nt)
            {
                const int64_t tid = omp_get_thread_num();
                int8_t *tq = (int8_t *)(all + stride * (size_t)tid);
                float *td = (float *)(tq + (size_t)Mp * K), *tz = td + Mp * KB;
                int32_t *to = (int32_t *)(tz + Mp * KB);
                const acts_t At = {tq, td, tz, to, K};
                for (int64_t m = 0; m < M; m++) act_row(x, K, off, tq, td, tz, to, m);
                const int two = ROWS2(M, bits);
                for (int64_t k = 0, lo, hi; split_seg_next(&sg, tid, &k, &lo, &hi);)
                    for (int64_t p = lo; p < hi; p++) {
                        if (two) panel_rows2(&At, w, d, z, r, y, N, p);
                        else panel_rows(&At, w, d, z, r, y, M, N, bits, p);
                    }
            }
            free(all);
            return 0;
        }
        const int64_t rchunk = split_chunk(M, 64 * K);
#pragma omp parallel
        {
#pragma omp for schedule(dynamic, rchunk)
            for (int64_t m = 0; m < M; m++) act_row(x, K, off, xq, xd, xz, xo, m);
#pragma omp for schedule(dynamic, pchunk)
            for (int64_t p = 0; p < P; p++) panel_rows(&A, w, d, z, r, y, M, N, bits, p);
        }
        free(mem);
        return 0;
    }
#endif
    for (int64_t m = 0; m < M; m++) act_row(x, K, off, xq, xd, xz, xo, m);
    if (ROWS2(M, bits))
        for (int64_t p = 0; p < P; p++) panel_rows2(&A, w, d, z, r, y, N, p);
    else
        for (int64_t p = 0; p < P; p++) panel_rows(&A, w, d, z, r, y, M, N, bits, p);
    free(mem);
    return 0;
}
