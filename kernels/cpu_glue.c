/* The element-wise steps between a decoder layer's GEMMs, for bfloat16 activations on CPU, one
 * call each instead of several ATen ops: residual add + RMSNorm, RoPE + KV-cache write, SiLU-mul.
 * Each computes in float32 and rounds to bfloat16 where the torch reference does (noted at each
 * step), so results match rms_norm_ref / rotary_ref / silu_mul_ref to bf16 rounding. Rows are
 * independent: a batched row equals the same row alone. Vector widths: H, D / 2 and n must be
 * multiples of 16 (the Python side checks). Every row is computed the same way whatever the
 * number of rows (batch invariance: prefill rows and decode rows take this one path); rows are
 * spread over OpenMP threads only from GLUE_PARALLEL_ROWS rows on (small steps stay on one).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_simd.h"

#define GLUE_PARALLEL_ROWS 32

static inline void store_bf16(uint16_t *p, __m512 x) { _mm256_storeu_si256((__m256i *)p, f32x16_to_bf16(x)); }

/* res_out = bf16(x + res) (x itself when res is NULL);
 * out = bf16(w * bf16(r / sqrt(mean(r^2) + eps))), r = res_out in float32. */
void tritium_add_rms_norm_bf16(const uint16_t *x, const uint16_t *res, const uint16_t *w, float eps,
                               int64_t T, int64_t H, uint16_t *out, uint16_t *res_out) {
#pragma omp parallel for if (T >= GLUE_PARALLEL_ROWS) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *xr = x + t * H;
        uint16_t *rr = res_out + t * H;
        __m512 ss = _mm512_setzero_ps();
        for (int64_t i = 0; i < H; i += 16) {
            __m512 r = bf16x16_to_f32(xr + i);
            if (res) r = bf16_round(_mm512_add_ps(r, bf16x16_to_f32(res + t * H + i)));
            store_bf16(rr + i, r);
            ss = _mm512_fmadd_ps(r, r, ss);
        }
        const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)H + eps));
        for (int64_t i = 0; i < H; i += 16) {
            __m512 n = bf16_round(_mm512_mul_ps(bf16x16_to_f32(rr + i), inv));
            store_bf16(out + t * H + i, _mm512_mul_ps(n, bf16x16_to_f32(w + i)));
        }
    }
}

/* RoPE (rotate-half layout) of one head vector: y = bf16(bf16(x cos) + swap_halves(x) ssin), with
 * the per-token tables cos = [c | c], ssin = [-s | s] (bf16, from rotary_tables). */
static inline void rope_head(const uint16_t *x, const uint16_t *cos, const uint16_t *ssin, int64_t D,
                             uint16_t *y) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < D; i += 16) {
        __m512 xv = bf16x16_to_f32(x + i);
        __m512 sw = bf16x16_to_f32(x + (i < half ? i + half : i - half));
        __m512 a = bf16_round(_mm512_mul_ps(xv, bf16x16_to_f32(cos + i)));
        store_bf16(y + i, _mm512_fmadd_ps(sw, bf16x16_to_f32(ssin + i), a));
    }
}

/* qkv (T, (Hq + 2 Hkv) D): q rotated into q_out (T, Hq, D); k rotated and v copied into cache slot
 * slot[t] of k_cache / v_cache, each (num_blocks * block_size, Hkv, D). */
void tritium_rope_kv_write_bf16(const uint16_t *qkv, const uint16_t *cos, const uint16_t *ssin,
                                const int64_t *slot, int64_t T, int64_t hq, int64_t hkv, int64_t D,
                                uint16_t *q_out, uint16_t *k_cache, uint16_t *v_cache) {
    const int64_t row = (hq + 2 * hkv) * D;
#pragma omp parallel for if (T >= GLUE_PARALLEL_ROWS) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *src = qkv + t * row, *c = cos + t * D, *s = ssin + t * D;
        for (int64_t h = 0; h < hq; h++) rope_head(src + h * D, c, s, D, q_out + (t * hq + h) * D);
        uint16_t *kd = k_cache + slot[t] * hkv * D, *vd = v_cache + slot[t] * hkv * D;
        for (int64_t h = 0; h < hkv; h++) rope_head(src + (hq + h) * D, c, s, D, kd + h * D);
        memcpy(vd, src + (hq + hkv) * D, (size_t)(hkv * D) * sizeof(uint16_t));
    }
}

/* x (T, 2n) = [gate | up]: out (T, n) = bf16(bf16(silu(gate)) * up), silu(a) = a / (1 + e^-a). */
void tritium_silu_mul_bf16(const uint16_t *x, int64_t T, int64_t n, uint16_t *out) {
    const __m512 one = _mm512_set1_ps(1.0f);
#pragma omp parallel for if (T >= GLUE_PARALLEL_ROWS) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = x + t * 2 * n, *u = g + n;
        for (int64_t i = 0; i < n; i += 16) {
            __m512 a = bf16x16_to_f32(g + i);
            __m512 s = bf16_round(_mm512_div_ps(a, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), a)))));
            store_bf16(out + t * n + i, _mm512_mul_ps(s, bf16x16_to_f32(u + i)));
        }
    }
}
