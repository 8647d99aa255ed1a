/* Batch-invariant GEMMs: y (M, N) float32 = x (M, K) bf16 @ W^T, on every path of cpu_simd.h.
 *
 * Every output y[m][n] is reduced in one order that depends on K only, never on M, on the tile
 * a row falls in or on the thread count ("Defeating Nondeterminism in LLM Inference", Thinking
 * Machines Lab, 2025: fix the reduction order per row, not per batch): one 16-lane float32
 * accumulator gathers VDPBF16PS products over k in steps of 32 (the last step masked when
 * K % 32 != 0), then _mm512_reduce_add_ps sums the lanes in a fixed tree. On AVX2 (no bf16 dot
 * product) bf16 is widened to float32 in registers with shifts: 8 float32 lanes take the even and
 * the odd elements of each block of 16 (cpu_simd.h), FMA, a fixed 8-lane tree. The portable path
 * keeps 16 float32 lanes per output (lane i takes k = 16 j + i) and sum16. The tiles below (MRB rows
 * x NR channels; on avx512 6 x 4, their 16-lane sums taken 16 at a time by reduce16 in the tree of
 * _mm512_reduce_add_ps), the work items (MC rows x NB channels) and the bf16 output
 * (tritium_bf16_gemm_bf16) only decide which outputs are computed together and where they go.
 *
 * The same inner order as w8_rows / w8g_rows in cpu_gemm.c: a weight dequantized to bfloat16
 * first (tritium_int8_to_bf16, _int8g_to_bf16, _int4_to_bf16) and multiplied here gives the same
 * bits as the fused int8 kernels, so a layer may switch between them by batch size.
 *
 * tritium_bf16_gemm: W bf16 (N, K); tritium_bf16_panel: the tiles over one block of channels
 * (the int4 GEMM of cpu_gemm_w4.c runs them on its dequantized panels). Threads: OpenMP over
 * blocks of output channels (a plain loop where the team would have one thread). A decode streams
 * every weight from memory once per step, as short rows read several at once, which the hardware
 * prefetchers do not run ahead of: one row asks for each line PFB1 bytes before reading it, two
 * to six rows PFB (without: the one-row kernel streamed at 0.4x (avx2) and 0.65x (avx512) of a
 * plain read). Tuned on weights on 2 MiB pages (as the native step keeps them): bf16_row at 32 KB
 * streamed 3-6 % faster than at 16 KB (tuned on 4 KiB pages), 48 KB as 32 KB, 4-8 KB 25-35 %
 * slower; the tiles (two rows, and the avx2 row in bf16_tile4) 2-8 % slower at 32 KB than at
 * 16 KB (gemv_bench, docs/benchmarks.md). The hint: T1 for bf16_row and tiles of 3+ rows, T0 for
 * tiles of 1-2 rows (avx512 two rows 1.2-1.3x T1, avx2 bf16_tile4 1.2-1.35x; bf16_row 0.7-0.8x
 * with T0). On 2 MiB pages (tritium_i8dot_huge_pages) the avx512 one-row GEMV runs as 1 x 4
 * tiles, 8 KB ahead, T0: 1.18x bf16_row there; on 4 KiB pages 0.88x, so bf16_row stays there.
 */
#include <stdint.h>

#include "cpu_simd.h"
#include "cpu_split.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define NB 32  /* output channels per parallel work item */
#define MR 4   /* rows of x per tile */
#define MC 96  /* rows of x per work item (several rows): 96 x K bf16 stays in L2 */
#ifndef PFB
#define PFB 16384 /* bytes of weight requested ahead of the one read (streaming tiles, 2-6 rows) */
#endif
#ifndef SPLIT_SEG_ROWS
#define SPLIT_SEG_ROWS MRB /* rows up to which a team splits the channels in contiguous shares */
#endif
#ifndef BF_HINT_TILE2
#define BF_HINT_TILE2 _MM_HINT_T0 /* the same for tiles of 1-2 rows */
#endif
#ifndef ROW_PFB
#define ROW_PFB 8192 /* the one-row tile's distance on 2 MiB pages (16 KB, 32 KB: 0.97x) */
#endif
#ifndef PFB1
#define PFB1 32768 /* the same for bf16_row (one row; on avx2 only a block's last 1-3 channels) */
#endif

#if defined(TRITIUM_AVX512)
#define NR 4   /* output channels per tile: MRB * NR accumulators + NR weights stay in registers */
#define MRB 6  /* rows of x per bf16 tile: 24 accumulators, 4 weights and one x in 32 zmm */
#define NR1 16 /* channels of the one-row kernel */

INLINE __m512bh load_bh(const uint16_t *p, __mmask32 m) {
    return (__m512bh)_mm512_maskz_loadu_epi16(m, (const void *)p);
}

/* out[r][c] = x[r] . w[c] over K for MR_ rows and NR_ channels (compile-time counts). pf: where
 * the weight streams (a few rows), the address of the lines to request for step 0 (one line per
 * channel and step, as bf16_row), else NULL. */
INLINE void bf16_tile(const uint16_t *x, const uint16_t *w, int64_t K, float *out, int64_t ldo,
                      const char *pf, const int MR_, const int NR_) {
    __m512 acc[MRB][NR];
    for (int r = 0; r < MR_; r++)
        for (int c = 0; c < NR_; c++) acc[r][c] = _mm512_setzero_ps();
    const int64_t K32 = K / 32 * 32;
    for (int64_t k = 0; k < K32; k += 32) { /* whole blocks of 32: plain loads */
        __m512bh wv[NR];
        if (pf)
            for (int c = 0; c < NR_; c++) {
                if (MR_ <= 2) _mm_prefetch(pf + (k / 32 * NR_ + c) * 64, BF_HINT_TILE2);
                else _mm_prefetch(pf + (k / 32 * NR_ + c) * 64, _MM_HINT_T1);
            }
        for (int c = 0; c < NR_; c++) wv[c] = (__m512bh)_mm512_loadu_si512((const void *)(w + c * K + k));
        for (int r = 0; r < MR_; r++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + r * K + k));
            for (int c = 0; c < NR_; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
        }
    }
    if (K32 < K) { /* the last K % 32 values, masked (zeros add exact zeros, as before) */
        const __mmask32 m = (__mmask32)((1u << (K - K32)) - 1);
        __m512bh wv[NR];
        for (int c = 0; c < NR_; c++) wv[c] = load_bh(w + c * K + K32, m);
        for (int r = 0; r < MR_; r++) {
            __m512bh xv = load_bh(x + r * K + K32, m);
            for (int c = 0; c < NR_; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
        }
    }
    if (NR_ == 4) { /* per 4 rows: a[4c + r] -> lane 4r + c, so row r's 4 sums are quarter r */
        for (int r0 = 0; r0 < MR_; r0 += 4) {
            __m512 a[16];
            for (int c = 0; c < 4; c++)
                for (int r = 0; r < 4; r++) a[4 * c + r] = r0 + r < MR_ ? acc[r0 + r][c] : _mm512_setzero_ps();
            __m512 s = reduce16(a);
            float *o = out + r0 * ldo;
            if (r0 + 0 < MR_) _mm_storeu_ps(o, _mm512_extractf32x4_ps(s, 0));
            if (r0 + 1 < MR_) _mm_storeu_ps(o + ldo, _mm512_extractf32x4_ps(s, 1));
            if (r0 + 2 < MR_) _mm_storeu_ps(o + 2 * ldo, _mm512_extractf32x4_ps(s, 2));
            if (r0 + 3 < MR_) _mm_storeu_ps(o + 3 * ldo, _mm512_extractf32x4_ps(s, 3));
        }
        return;
    }
    for (int r = 0; r < MR_; r++)
        for (int c = 0; c < NR_; c++) out[r * ldo + c] = _mm512_reduce_add_ps(acc[r][c]);
}

/* One row of x against NC channels: the decode case, where the weight streams from memory and
 * more independent accumulators (and weight streams) keep the loads in flight. Same per-output
 * order as bf16_tile. */
INLINE void bf16_row(const uint16_t *x, const uint16_t *w, int64_t K, float *out, const int NC) {
    __m512 acc[NR1];
    for (int c = 0; c < NC; c++) acc[c] = _mm512_setzero_ps();
    /* the NC rows of this tile are one contiguous block of NC K / 32 steps of 64 bytes; step s
     * requests the NC lines PFB1 + 64 NC s bytes past the block's start, so consecutive tiles ask
     * for every line of the weight once, PFB1 bytes before it is read, into L2 (the hint T1: into
     * L1, the lines of the next tiles evicted the tile being read) */
    const char *next = (const char *)w + PFB1;
    for (int64_t k = 0; k < K; k += 32) {
        const __mmask32 m = K - k >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << (K - k)) - 1);
        __m512bh xv = load_bh(x + k, m);
        const char *pf = next + (k / 32) * NC * 64;
        for (int c = 0; c < NC; c++) {
            _mm_prefetch(pf + c * 64, _MM_HINT_T1);
            acc[c] = _mm512_dpbf16_ps(acc[c], xv, load_bh(w + c * K + k, m));
        }
    }
    if (NC == 16) { /* lane 4q + j holds channel 4j + q: permute back to channel order */
        const __m512i idx = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
        _mm512_storeu_ps(out, _mm512_permutexvar_ps(idx, reduce16(acc)));
        return;
    }
    for (int c = 0; c < NC; c++) out[c] = _mm512_reduce_add_ps(acc[c]);
}


#elif defined(TRITIUM_AVX2)
#define NR 2   /* MR * NR accumulators + 2 NR widened weights in the 16 ymm registers */
#define NR1 8

#include "cpu_gemm_bf16_avx2.h" /* tail16, bf16_tile, bf16_tile4, bf16_row */

#else /* portable C: 16 float32 lanes per output (lane i takes k = 16 j + i), sum16 at the end */
#define NR 2
#define NR1 4

#include "cpu_gemm_bf16_generic.h" /* dot_bf16, tile22, bf16_tile, bf16_row */

#endif

#ifndef MRB
#define MRB MR
#endif
#define TILE(R, C) bf16_tile(x + m0 * K, w + n * K, K, y + m0 * ldy + n, ldy, pfb ? (const char *)(w + n * K) + pfb : 0, R, C)
#define ROWS(C)                                                                  \
    switch (mr) {                                                                \
    case 1: TILE(1, C); break; case 2: TILE(2, C); break;                        \
    case 3: TILE(3, C); break; case 4: TILE(4, C); break;                        \
    case 5: TILE(MRB < 5 ? MRB : 5, C); break;                                   \
    default: TILE(MRB < 6 ? MRB : 6, C); break;                                  \
    }

/* y[m][c] (rows ldy apart) = x[m] . w[c] for m < M, c < nc in the tiles above, one thread.
 * Also called by the fused int8 kernels (cpu_gemm.c) on a block of channels they dequantized
 * to bfloat16, so a batch's rows share each conversion and get tritium_bf16_gemm's bits. */
static void tiles(const uint16_t *x, int64_t M, const uint16_t *w, int64_t nc, int64_t K, float *y, int64_t ldy,
                  int64_t pfb) {
    for (int64_t m0 = 0; m0 < M; m0 += MRB) {
        const int64_t mr = M - m0 < MRB ? M - m0 : MRB;
        int64_t n = 0;
#if defined(TRITIUM_AVX2)
        if (pfb && mr <= 2) /* streaming, 1-2 rows: 4 channels at a time */
            for (; n + 4 <= nc; n += 4) {
                const char *pf = (const char *)(w + n * K) + pfb;
                if (mr == 1) bf16_tile4(x + m0 * K, K, w + n * K, K, y + m0 * ldy + n, ldy, pf, 1);
                else bf16_tile4(x + m0 * K, K, w + n * K, K, y + m0 * ldy + n, ldy, pf, 2);
            }
#endif
        for (; n + NR <= nc; n += NR) ROWS(NR)
        for (; n < nc; n++) ROWS(1)
    }
}

void tritium_bf16_tiles(const uint16_t *x, int64_t M, const uint16_t *w, int64_t nc, int64_t K, float *y,
                        int64_t ldy) {
    tiles(x, M, w, nc, K, y, ldy, 0);
}

/* float32 -> bfloat16 as torch's vectorized conversion does it (the per-op path's .to(bfloat16)):
 * round to nearest even, any NaN -> 0xFFFF. */
static inline uint16_t out_bf16(float f) {
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return 0xFFFFu;
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* on != 0: the weights lie on 2 MiB pages (kernels/hugepages.py; set with the integer-dot
 * kernels' tritium_i8dot_huge_pages): the one-row GEMV then runs as one-row tiles (row_block). */
static int huge_weights;
void tritium_bf16_huge_pages(int64_t on) { huge_weights = on != 0; }

/* Whether a parallel loop of n items gets more than one thread: not inside another team (the
 * native step's region calls the kernels on its threads' channel ranges) nor with one thread
 * allowed; opening a one-thread region cost about 0.9 us a call, a few % of a decode step. */
static int team_pays(int64_t n) {
#ifdef _OPENMP
    return n > 1 && !omp_in_parallel() && omp_get_max_threads() > 1;
#else
    (void)n;
    return 0;
#endif
}

/* One block of NB channels of one row (the decode case) into y, or rounded into y16. */
static void row_block(const uint16_t *x, const uint16_t *w, float *y, uint16_t *y16, int64_t N, int64_t K,
                      int64_t nb) {
    const int64_t n1 = (nb + 1) * NB < N ? (nb + 1) * NB : N;
    float buf[NB];
    int64_t n = nb * NB;
#if defined(TRITIUM_AVX2)
    /* 4 channels at a time as two rows of the same x (bf16_tile4; the second row's sums dropped):
     * from DRAM, 5-10 % faster than bf16_row (about 0.85x a plain read; gemv_bench). Two distinct
     * rows stream at read speed in the same tile, for a reason not found (not the prefetch
     * distance, not x's address). Row 0's bits are bf16_row's. ldx is hidden from the compiler so
     * it keeps both rows' chains. */
    int64_t ldx0 = 0;
    __asm__("" : "+r"(ldx0));
    for (; n + 4 <= n1; n += 4) {
        float o2[8];
        bf16_tile4(x, ldx0, w + n * K, K, o2, 4, (const char *)(w + n * K) + PFB, 2);
        float *o = y16 ? buf + (n - nb * NB) : y + n;
        for (int c = 0; c < 4; c++) o[c] = o2[c];
    }
#endif
#if defined(TRITIUM_AVX512)
    /* on 2 MiB pages: 4 channels at a time in the one-row tile, ROW_PFB ahead with the T0 hint
     * (1.2x bf16_row there, interleaved; on 4 KiB pages 0.88x: bf16_row then). Same bits. */
    if (huge_weights)
        for (; n + 4 <= n1; n += 4)
            bf16_tile(x, w + n * K, K, y16 ? buf + (n - nb * NB) : y + n, 1, (const char *)(w + n * K) + ROW_PFB, 1, 4);
#endif
    for (; n < n1; n += NR1) {
        const int64_t nc = n1 - n < NR1 ? n1 - n : NR1;
        float *o = y16 ? buf + (n - nb * NB) : y + n;
        if (nc == NR1) bf16_row(x, w + n * K, K, o, NR1);
        else bf16_row(x, w + n * K, K, o, (int)nc);
    }
    if (y16)
        for (int64_t n = nb * NB; n < n1; n++) y16[n] = out_bf16(buf[n - nb * NB]);
}

/* Several rows: work items are (chunk of MC rows, block of NB channels), chunk-major, so a chunk
 * of x stays in L2 while the blocks of W go by (a prompt's whole x does not fit). */
static void rows_item(const uint16_t *x, const uint16_t *w, float *y, uint16_t *y16, int64_t M, int64_t N,
                      int64_t K, int64_t item) {
    const int64_t nblocks = (N + NB - 1) / NB;
    const int64_t nb = item % nblocks, c0 = item / nblocks * MC;
    const int64_t c1 = c0 + MC < M ? c0 + MC : M;
    const int64_t n1 = (nb + 1) * NB < N ? (nb + 1) * NB : N;
    float buf[MC * NB];
    /* where the tiles write: y itself, or a float32 block of this item for y16 */
    float *yo = y16 ? buf : y;
    const int64_t ym = y16 ? c0 : 0, yn = y16 ? nb * NB : 0, ldy = y16 ? NB : N;
    /* the tiles read a few weight rows at a time, too few loads in flight to stream the weight at
     * memory speed. A few rows (one row chunk of MRB, each weight read once): the tiles request
     * the lines PFB bytes ahead as they go (as bf16_row); more rows: ask for the whole next block
     * in L2 first */
    const int64_t pfb = M <= MRB ? PFB : 0;
    if (!pfb && nb + 1 < nblocks) {
        const int64_t e1 = (nb + 2) * NB < N ? (nb + 2) * NB : N;
        const char *p0 = (const char *)(w + n1 * K), *p1 = (const char *)(w + e1 * K);
        for (const char *p = p0; p < p1; p += 64) __builtin_prefetch(p, 0, 2);
    }
    tiles(x + c0 * K, c1 - c0, w + nb * NB * K, n1 - nb * NB, K, yo + (c0 - ym) * ldy + (nb * NB - yn), ldy, pfb);
    if (y16)
        for (int64_t m = c0; m < c1; m++)
            for (int64_t n = nb * NB; n < n1; n++) y16[m * N + n] = out_bf16(buf[(m - c0) * NB + n - nb * NB]);
}

/* y (float32) or, where y16 is given instead, y16 (bf16: each float32 result rounded once with
 * out_bf16, the bits .to(torch.bfloat16) gives the float32 result). The items run on the threads
 * of one parallel loop, or in a plain loop where a team would have one thread. */
static void bf16_gemm(const uint16_t *x, const uint16_t *w, float *y, uint16_t *y16, int64_t M, int64_t N,
                      int64_t K) {
    const int64_t nblocks = (N + NB - 1) / NB, items = M == 1 ? nblocks : (M + MC - 1) / MC * nblocks;
    if (!team_pays(items)) {
        for (int64_t i = 0; i < items; i++) {
            if (M == 1) row_block(x, w, y, y16, N, K, i);
            else rows_item(x, w, y, y16, M, N, K, i);
        }
        return;
    }
    /* claimed items (cpu_split.h): an item is NB channels of up to MC rows */
    const int64_t chunk = split_chunk(items, (M < MC ? M : MC) * NB * K);
#ifdef _OPENMP
    if (M <= SPLIT_SEG_ROWS) { /* a few rows, streaming the weight: contiguous shares (cpu_split.h) */
        split_seg_t sg;
        const int64_t nt = omp_get_max_threads() < SPLIT_SEGS ? omp_get_max_threads() : SPLIT_SEGS;
        split_seg_init(&sg, items, nt, chunk);
#pragma omp parallel num_threads(nt)
        {
            const int64_t tid = omp_get_thread_num();
            for (int64_t k = 0, lo, hi; split_seg_next(&sg, tid, &k, &lo, &hi);)
                for (int64_t i = lo; i < hi; i++) {
                    if (M == 1) row_block(x, w, y, y16, N, K, i);
                    else rows_item(x, w, y, y16, M, N, K, i);
                }
        }
        return;
    }
#endif
#pragma omp parallel for schedule(dynamic, chunk)
    for (int64_t i = 0; i < items; i++) {
        if (M == 1) row_block(x, w, y, y16, N, K, i);
        else rows_item(x, w, y, y16, M, N, K, i);
    }
}

void tritium_bf16_gemm(const uint16_t *x, const uint16_t *w, float *y, int64_t M, int64_t N, int64_t K) {
    bf16_gemm(x, w, y, 0, M, N, K);
}

/* The same products rounded to bfloat16 in the kernel: y16 (M, N) bf16. */
void tritium_bf16_gemm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y16, int64_t M, int64_t N, int64_t K) {
    bf16_gemm(x, w, 0, y16, M, N, K);
}

/* y (M, nc) with row stride ldy = x (M, K) @ w (nc, K)^T, one thread: bf16_gemm's tiles (so its
 * bits) over one block of channels, e.g. an int4 weight panel dequantized to bf16 (cpu_gemm_w4.c). */
void tritium_bf16_panel(const uint16_t *x, const uint16_t *w, float *y, int64_t M, int64_t nc, int64_t K,
                        int64_t ldy) {
    tiles(x, M, w, nc, K, y, ldy, 0);
}
