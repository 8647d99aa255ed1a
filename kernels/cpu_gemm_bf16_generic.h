/* The portable path's bf16 dot products and tiles (included by cpu_gemm_bf16.c on hosts with
 * neither AVX-512 nor AVX2): 16 float32 lanes per output, lane i takes k = 16 j + i, sum16 at the
 * end, so every output has one order fixed by K. */
#ifndef TRITIUM_CPU_GEMM_BF16_GENERIC_H
#define TRITIUM_CPU_GEMM_BF16_GENERIC_H
#include "cpu_simd.h"

/* x . w over K. Kept out of line and free of prefetch hints: both made GCC give up vectorizing. */
static __attribute__((noinline)) float dot_bf16(const uint16_t *x, const uint16_t *w, int64_t K) {
    float acc[16] = {0};
    int64_t k = 0;
    for (; k + 16 <= K; k += 16)
        for (int i = 0; i < 16; i++) acc[i] += bf16_to_f32(x[k + i]) * bf16_to_f32(w[k + i]);
    for (int i = 0; k + i < K; i++) acc[i] += bf16_to_f32(x[k + i]) * bf16_to_f32(w[k + i]);
    return sum16(acc);
}

/* Two rows x two channels: four outputs in dot_bf16's lanes and order (so its bits), each
 * widened block of x and of w used twice. Fixed counts and out of line, so GCC vectorizes it. */
static __attribute__((noinline)) void tile22(const uint16_t *restrict x, const uint16_t *restrict w, int64_t K,
                                             float *restrict out, int64_t ldo) {
    float a00[16] = {0}, a01[16] = {0}, a10[16] = {0}, a11[16] = {0};
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        float x0[16], x1[16], w0[16], w1[16];
        for (int i = 0; i < 16; i++) {
            x0[i] = bf16_to_f32(x[k + i]), x1[i] = bf16_to_f32(x[K + k + i]);
            w0[i] = bf16_to_f32(w[k + i]), w1[i] = bf16_to_f32(w[K + k + i]);
        }
        for (int i = 0; i < 16; i++) {
            a00[i] += x0[i] * w0[i], a01[i] += x0[i] * w1[i];
            a10[i] += x1[i] * w0[i], a11[i] += x1[i] * w1[i];
        }
    }
    for (int i = 0; k + i < K; i++) {
        const float x0 = bf16_to_f32(x[k + i]), x1 = bf16_to_f32(x[K + k + i]);
        const float w0 = bf16_to_f32(w[k + i]), w1 = bf16_to_f32(w[K + k + i]);
        a00[i] += x0 * w0, a01[i] += x0 * w1, a10[i] += x1 * w0, a11[i] += x1 * w1;
    }
    out[0] = sum16(a00), out[1] = sum16(a01), out[ldo] = sum16(a10), out[ldo + 1] = sum16(a11);
}

INLINE void bf16_tile(const uint16_t *x, const uint16_t *w, int64_t K, float *out, int64_t ldo,
                      const char *pf, const int MR_, const int NR_) {
    (void)pf; /* no prefetch hints in the portable loops (they stop GCC vectorizing) */
    int r = 0;
    if (NR_ == 2)
        for (; r + 2 <= MR_; r += 2) tile22(x + r * K, w, K, out + r * ldo, ldo);
    for (; r < MR_; r++)
        for (int c = 0; c < NR_; c++) out[r * ldo + c] = dot_bf16(x + r * K, w + c * K, K);
}

INLINE void bf16_row(const uint16_t *x, const uint16_t *w, int64_t K, float *out, const int NC) {
    for (int c = 0; c < NC; c++) out[c] = dot_bf16(x, w + c * K, K);
}
#endif
