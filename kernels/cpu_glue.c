/* The element-wise steps between a decoder layer's GEMMs, for bfloat16 activations on CPU, one
 * call each instead of several ATen ops: residual add + RMSNorm, RoPE + KV-cache write, SiLU-mul.
 * Each computes in float32 and rounds to bfloat16 where the torch reference does (noted at each
 * step), so results match rms_norm_ref / rotary_ref / silu_mul_ref to bf16 rounding. Rows are
 * independent: a batched row equals the same row alone. Vector widths: H, D / 2 and n must be
 * multiples of 16 (the Python side checks). Every row is computed the same way whatever the
 * number of rows (batch invariance: prefill rows and decode rows take this one path); rows are
 * spread over OpenMP threads only from GLUE_PARALLEL_ROWS rows on (small steps stay on one).
 * Paths (cpu_simd.h): 16 float32 lanes on AVX-512, 8 on AVX2 (bf16 widened with shifts, FMA where
 * the AVX-512 code has one), portable C elsewhere; the same roundings on every path.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_simd.h"

#define GLUE_PARALLEL_ROWS 32
#define GLUE_CHUNK 16 /* rows per claim: claimed, not halved (cpu_split.h says why) */

#if defined(TRITIUM_AVX512)
static inline void store_bf16(uint16_t *p, __m512 x) { _mm256_storeu_si256((__m256i *)p, f32x16_to_bf16(x)); }

/* res_out = bf16(x + res) (x itself when res is NULL);
 * out = bf16(w * bf16(r / sqrt(mean(r^2) + eps))), r = res_out in float32. */
void tritium_add_rms_norm_bf16(const uint16_t *x, const uint16_t *res, const uint16_t *w, float eps,
                               int64_t T, int64_t H, uint16_t *out, uint16_t *res_out) {
#pragma omp parallel for if (T >= GLUE_PARALLEL_ROWS) schedule(dynamic, GLUE_CHUNK)
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
#pragma omp parallel for if (T >= GLUE_PARALLEL_ROWS) schedule(dynamic, GLUE_CHUNK)
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
#pragma omp parallel for if (T >= GLUE_PARALLEL_ROWS) schedule(dynamic, GLUE_CHUNK)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = x + t * 2 * n, *u = g + n;
        for (int64_t i = 0; i < n; i += 16) {
            __m512 a = bf16x16_to_f32(g + i);
            __m512 s = bf16_round(_mm512_div_ps(a, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), a)))));
            store_bf16(out + t * n + i, _mm512_mul_ps(s, bf16x16_to_f32(u + i)));
        }
    }
}

#else
#if defined(TRITIUM_AVX2)
#define VL 8
typedef __m256 vf;
INLINE vf vload(const uint16_t *p) { return bf16x8_to_f32(p); }
INLINE void vstore(uint16_t *p, vf x) { store_bf16x8(p, x); }
INLINE vf vround(vf x) { return bf16_round8(x); }
INLINE vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
INLINE vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
INLINE vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
INLINE vf vset(float f) { return _mm256_set1_ps(f); }
INLINE vf vsilu(vf a) { return _mm256_div_ps(a, _mm256_add_ps(vset(1.0f), exp256(_mm256_sub_ps(vset(0.0f), a)))); }
INLINE float vsum(vf a) { return hsum8(a); }
#else /* portable: 16-lane float32 arrays in a struct, loops the compiler vectorizes */
#define VL 16
typedef struct { float v[16]; } vf;
INLINE vf vload(const uint16_t *p) { vf r; for (int i = 0; i < 16; i++) r.v[i] = bf16_to_f32(p[i]); return r; }
INLINE void vstore(uint16_t *p, vf x) { for (int i = 0; i < 16; i++) p[i] = f32_to_bf16(x.v[i]); }
INLINE vf vround(vf x) { for (int i = 0; i < 16; i++) x.v[i] = bf16_roundf(x.v[i]); return x; }
INLINE vf vadd(vf a, vf b) { for (int i = 0; i < 16; i++) a.v[i] += b.v[i]; return a; }
INLINE vf vmul(vf a, vf b) { for (int i = 0; i < 16; i++) a.v[i] *= b.v[i]; return a; }
INLINE vf vfma(vf a, vf b, vf c) { for (int i = 0; i < 16; i++) c.v[i] += a.v[i] * b.v[i]; return c; }
INLINE vf vset(float f) { vf r; for (int i = 0; i < 16; i++) r.v[i] = f; return r; }
INLINE vf vsilu(vf a) { for (int i = 0; i < 16; i++) a.v[i] = a.v[i] / (1.0f + exp_poly(-a.v[i])); return a; }
INLINE float vsum(vf a) { return sum16(a.v); }
#endif

/* The same steps as the AVX-512 code above, VL lanes at a time (H, D / 2, n multiples of 16). */
void tritium_add_rms_norm_bf16(const uint16_t *x, const uint16_t *res, const uint16_t *w, float eps,
                               int64_t T, int64_t H, uint16_t *out, uint16_t *res_out) {
#pragma omp parallel for if (T >= GLUE_PARALLEL_ROWS) schedule(dynamic, GLUE_CHUNK)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *xr = x + t * H;
        uint16_t *rr = res_out + t * H;
        vf ss = vset(0.0f);
        for (int64_t i = 0; i < H; i += VL) {
            vf r = vload(xr + i);
            if (res) r = vround(vadd(r, vload(res + t * H + i)));
            vstore(rr + i, r);
            ss = vfma(r, r, ss);
        }
        const vf inv = vset(1.0f / sqrtf(vsum(ss) / (float)H + eps));
        for (int64_t i = 0; i < H; i += VL) {
            vf n = vround(vmul(vload(rr + i), inv));
            vstore(out + t * H + i, vmul(n, vload(w + i)));
        }
    }
}

static inline void rope_head(const uint16_t *x, const uint16_t *cos, const uint16_t *ssin, int64_t D,
                             uint16_t *y) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < D; i += VL) {
        vf xv = vload(x + i);
        vf sw = vload(x + (i < half ? i + half : i - half));
        vf a = vround(vmul(xv, vload(cos + i)));
        vstore(y + i, vfma(sw, vload(ssin + i), a));
    }
}

void tritium_rope_kv_write_bf16(const uint16_t *qkv, const uint16_t *cos, const uint16_t *ssin,
                                const int64_t *slot, int64_t T, int64_t hq, int64_t hkv, int64_t D,
                                uint16_t *q_out, uint16_t *k_cache, uint16_t *v_cache) {
    const int64_t row = (hq + 2 * hkv) * D;
#pragma omp parallel for if (T >= GLUE_PARALLEL_ROWS) schedule(dynamic, GLUE_CHUNK)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *src = qkv + t * row, *c = cos + t * D, *s = ssin + t * D;
        for (int64_t h = 0; h < hq; h++) rope_head(src + h * D, c, s, D, q_out + (t * hq + h) * D);
        uint16_t *kd = k_cache + slot[t] * hkv * D, *vd = v_cache + slot[t] * hkv * D;
        for (int64_t h = 0; h < hkv; h++) rope_head(src + (hq + h) * D, c, s, D, kd + h * D);
        memcpy(vd, src + (hq + hkv) * D, (size_t)(hkv * D) * sizeof(uint16_t));
    }
}

void tritium_silu_mul_bf16(const uint16_t *x, int64_t T, int64_t n, uint16_t *out) {
#pragma omp parallel for if (T >= GLUE_PARALLEL_ROWS) schedule(dynamic, GLUE_CHUNK)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = x + t * 2 * n, *u = g + n;
#if defined(TRITIUM_AVX2)
        for (int64_t i = 0; i < n; i += VL)
            vstore(out + t * n + i, vmul(vround(vsilu(vload(g + i))), vload(u + i)));
#else /* the same steps element by element: a loop gcc vectorizes, where the vf form did not */
        for (int64_t i = 0; i < n; i++) {
            const float a = bf16_to_f32(g[i]);
            const float sa = bf16_round_finite(a / (1.0f + exp_poly(-a)));
            out[t * n + i] = f32_to_bf16(sa * bf16_to_f32(u[i]));
        }
#endif
    }
}
#endif
