/* Multi-LoRA delta on CPU: y[i] += B[s_i] (A[s_i] x[i]) for every row i whose adapter slot s_i >= 0,
 * every row of a step in one call per linear (the CPU side of the Punica / S-LoRA segmented
 * kernels of lora_triton.py; the torch reference is kernels/lora_ref.py).
 *
 * Layouts (lora_ref.py): x (T, K) and y (T, N) contiguous rows; a (S, R, K): per slot the adapter's
 * A; bt (S, R, N): per slot its B transposed with the LoRA scale folded in (zero rows past its
 * rank); ranks (S) int64: the rank each slot uses on this linear (<= R; 0: no adapter here);
 * slots (T) int64, -1 for a row without an adapter. x, y, a and bt are all bfloat16 (bf16 = 1)
 * or all float32 (bf16 = 0).
 *
 * Rows are grouped by slot (as Punica's segments) in blocks of up to RB rows, so each weight
 * vector loaded serves every row of the block; the rows stay independent: per row, t = A x in
 * float32 (the shrink: each t[r] a dot product over K, 16 partial sums k mod 16 added in a fixed
 * tree, then the K % 16 tail in order), then for each output n delta = sum over r < rank of
 * t[r] bt[r][n], r ascending, in float32 (the expand), and y[n] = y[n] + delta rounded once to
 * y's dtype. Each row's operations are the same whichever rows share its block, so its result
 * depends on its own x, its slot's weights and rank, K and N only, never on the other rows of
 * the step (docs/determinism.md). Blocks run in parallel (OpenMP) when the step has enough work.
 * Paths (kernels/cpu_isa.py): AVX-512 and AVX2 use FMAs; the portable path multiplies and adds.
 */
#include <stdint.h>
#include <stdlib.h>
#include "cpu_simd.h"

#define LORA_MAX_RANK 1024
#define RB 4 /* rows of one slot per block */

INLINE float ld1(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

INLINE void st1(void *p, int64_t i, float v, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}


#if defined(TRITIUM_AVX512)
INLINE __m512 ld16(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16x16_to_f32((const uint16_t *)p + i) : _mm512_loadu_ps((const float *)p + i);
}
#elif defined(TRITIUM_AVX2)
INLINE __m256 ld8(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16x8_to_f32((const uint16_t *)p + i) : _mm256_loadu_ps((const float *)p + i);
}
INLINE void st8(void *p, int64_t i, __m256 v, int bf16) {
    if (bf16)
        store_bf16x8((uint16_t *)p + i, v);
    else
        _mm256_storeu_ps((float *)p + i, v);
}
#endif

/* t[m][r] = x_m . w_r over K for the block's m < nm rows and r < rank (see the file comment) */
INLINE void shrink(const void *const *xs, int nm, const void *a, int64_t k, int64_t rank, int bf16,
                   float (*t)[LORA_MAX_RANK]) {
    const int64_t es = bf16 ? 2 : 4, k16 = k - k % 16;
    for (int64_t r = 0; r < rank; r++) {
        const char *w = (const char *)a + r * k * es;
        float part[RB][16];
#if defined(TRITIUM_AVX512)
        __m512 acc[RB];
        for (int m = 0; m < RB; m++) acc[m] = _mm512_setzero_ps();
        for (int64_t i = 0; i < k16; i += 16) {
            __m512 wv = ld16(w, i, bf16);
            for (int m = 0; m < nm; m++) acc[m] = _mm512_fmadd_ps(ld16(xs[m], i, bf16), wv, acc[m]);
        }
        for (int m = 0; m < nm; m++) _mm512_storeu_ps(part[m], acc[m]);
#elif defined(TRITIUM_AVX2)
        __m256 lo[RB], hi[RB];
        for (int m = 0; m < RB; m++) lo[m] = hi[m] = _mm256_setzero_ps();
        for (int64_t i = 0; i < k16; i += 16) {
            __m256 wl = ld8(w, i, bf16), wh = ld8(w, i + 8, bf16);
            for (int m = 0; m < nm; m++) {
                lo[m] = _mm256_fmadd_ps(ld8(xs[m], i, bf16), wl, lo[m]);
                hi[m] = _mm256_fmadd_ps(ld8(xs[m], i + 8, bf16), wh, hi[m]);
            }
        }
        for (int m = 0; m < nm; m++) {
            _mm256_storeu_ps(part[m], lo[m]);
            _mm256_storeu_ps(part[m] + 8, hi[m]);
        }
#else
        for (int m = 0; m < nm; m++) {
            for (int l = 0; l < 16; l++) part[m][l] = 0.0f;
            for (int64_t i = 0; i < k16; i += 16)
                for (int l = 0; l < 16; l++) part[m][l] += ld1(xs[m], i + l, bf16) * ld1(w, i + l, bf16);
        }
#endif
        for (int m = 0; m < nm; m++) {
            float s = sum16(part[m]);
            for (int64_t i = k16; i < k; i++) s += ld1(xs[m], i, bf16) * ld1(w, i, bf16);
            t[m][r] = s;
        }
    }
}

/* y_m[0:N] += sum_{r < rank} t[m][r] bt[r][0:N] (r ascending), rounded once to y's dtype.
 * Columns go in chunks of NC: within a chunk the accumulators stay in L1 while bt is read row
 * after row (r outer, so bt streams from memory in order); each output's sum is the same
 * sequence of operations as with r innermost. */
#define NC 4096
INLINE void expand(void *const *ys, int nm, const void *bt, int64_t n, int64_t rank, int bf16,
                   float (*t)[LORA_MAX_RANK]) {
    float acc[RB][NC] __attribute__((aligned(64)));
    for (int64_t j0 = 0; j0 < n; j0 += NC) {
        const int64_t w = n - j0 < NC ? n - j0 : NC, w16 = w - w % 16;
        for (int m = 0; m < nm; m++)
            for (int64_t j = 0; j < w; j++) acc[m][j] = 0.0f;
        for (int64_t r = 0; r < rank; r++) {
            const int64_t row = r * n + j0;
            int64_t j = 0;
#if defined(TRITIUM_AVX512)
            for (; j < w16; j += 16) {
                __m512 bv = ld16(bt, row + j, bf16);
                for (int m = 0; m < nm; m++)
                    _mm512_store_ps(acc[m] + j, _mm512_fmadd_ps(_mm512_set1_ps(t[m][r]), bv, _mm512_load_ps(acc[m] + j)));
            }
#elif defined(TRITIUM_AVX2)
            for (; j < w16; j += 8) {
                __m256 bv = ld8(bt, row + j, bf16);
                for (int m = 0; m < nm; m++)
                    _mm256_store_ps(acc[m] + j, _mm256_fmadd_ps(_mm256_set1_ps(t[m][r]), bv, _mm256_load_ps(acc[m] + j)));
            }
#else
            for (int m = 0; m < nm; m++) {
                const float tr = t[m][r];
                if (bf16) {
                    const uint16_t *bp = (const uint16_t *)bt + row;
                    for (int64_t q = 0; q < w16; q++) acc[m][q] += tr * bf16_to_f32(bp[q]);
                } else {
                    const float *bp = (const float *)bt + row;
                    for (int64_t q = 0; q < w16; q++) acc[m][q] += tr * bp[q];
                }
            }
            j = w16;
#endif
            for (; j < w; j++)
                for (int m = 0; m < nm; m++) acc[m][j] += t[m][r] * ld1(bt, row + j, bf16);
        }
        for (int m = 0; m < nm; m++) {
            int64_t j = 0;
#if defined(TRITIUM_AVX512)
            for (; j < w16; j += 16) {
                if (bf16) {
                    uint16_t *yp = (uint16_t *)ys[m] + j0 + j;
                    _mm256_storeu_si256((__m256i *)yp, f32x16_to_bf16(_mm512_add_ps(bf16x16_to_f32(yp), _mm512_load_ps(acc[m] + j))));
                } else {
                    float *yp = (float *)ys[m] + j0 + j;
                    _mm512_storeu_ps(yp, _mm512_add_ps(_mm512_loadu_ps(yp), _mm512_load_ps(acc[m] + j)));
                }
            }
#elif defined(TRITIUM_AVX2)
            for (; j < w16; j += 8) st8(ys[m], j0 + j, _mm256_add_ps(ld8(ys[m], j0 + j, bf16), _mm256_load_ps(acc[m] + j)), bf16);
#endif
            for (; j < w; j++) st1(ys[m], j0 + j, ld1(ys[m], j0 + j, bf16) + acc[m][j], bf16);
        }
    }
}

static int lora_rows(const void *x, void *y, const void *a, const void *bt, const int64_t *ranks,
                     const int64_t *slots, int64_t rows, int64_t k, int64_t n, int64_t num_slots, int64_t r_n,
                     int bf16) {
    const int64_t es = bf16 ? 2 : 4;
    /* rows sorted by slot (counting sort, stable), then blocks of up to RB rows of one slot */
    int64_t *order = malloc(sizeof(int64_t) * (rows + 1) * 2 + sizeof(int64_t) * (num_slots + 1));
    if (!order) return -2;
    int64_t *block = order + rows + 1, *start = block + rows + 1, nb = 0, work = 0;
    for (int64_t s = 0; s <= num_slots; s++) start[s] = 0;
    for (int64_t i = 0; i < rows; i++)
        if (slots[i] >= 0 && ranks[slots[i]] > 0) start[slots[i] + 1]++;
    for (int64_t s = 0; s < num_slots; s++) start[s + 1] += start[s];
    for (int64_t i = 0; i < rows; i++)
        if (slots[i] >= 0 && ranks[slots[i]] > 0) order[start[slots[i]]++] = i;
    int64_t m = start[num_slots - 1]; /* rows with an adapter on this linear, now sorted */
    for (int64_t i = 0; i < m; i++)
        if (i == 0 || slots[order[i]] != slots[order[i - 1]] || i - block[nb - 1] == RB) block[nb++] = i;
    block[nb] = m;
    for (int64_t b = 0; b < nb; b++) work += (block[b + 1] - block[b]) * ranks[slots[order[block[b]]]] * (k + n);
#pragma omp parallel for schedule(static) if (nb > 1 && work >= (1 << 22))
    for (int64_t b = 0; b < nb; b++) {
        float t[RB][LORA_MAX_RANK];
        const void *xs[RB];
        void *ys[RB];
        int nm = (int)(block[b + 1] - block[b]);
        int64_t s = slots[order[block[b]]], rank = ranks[s];
        for (int q = 0; q < nm; q++) {
            int64_t i = order[block[b] + q];
            xs[q] = (const char *)x + i * k * es;
            ys[q] = (char *)y + i * n * es;
        }
        shrink(xs, nm, (const char *)a + s * r_n * k * es, k, rank, bf16, t);
        expand(ys, nm, (const char *)bt + s * r_n * n * es, n, rank, bf16, t);
    }
    free(order);
    return 0;
}

/* Returns 0; -1 when R exceeds LORA_MAX_RANK or a slot's rank exceeds R or a row's slot is out of
 * range (nothing written); -2 when out of memory. */
int tritium_lora_add(const void *x, void *y, const void *a, const void *bt, const int64_t *ranks,
                     const int64_t *slots, int64_t rows, int64_t k, int64_t n, int64_t num_slots, int64_t r_n,
                     int64_t bf16) {
    if (r_n > LORA_MAX_RANK || r_n < 0 || num_slots < 1) return -1;
    for (int64_t s = 0; s < num_slots; s++)
        if (ranks[s] < 0 || ranks[s] > r_n) return -1;
    for (int64_t i = 0; i < rows; i++)
        if (slots[i] >= num_slots) return -1;
    return bf16 ? lora_rows(x, y, a, bt, ranks, slots, rows, k, n, num_slots, r_n, 1)
                : lora_rows(x, y, a, bt, ranks, slots, rows, k, n, num_slots, r_n, 0);
}
