/* The decoder layers of a step in one native call: for a few rows (decode, small batches), the
 * Python dispatch between a layer's dozen ops costs about as much as their arithmetic, so the
 * whole layer loop of a Llama-shaped model runs here, over the paged bfloat16 KV cache:
 *
 *     x, r = add_rms_norm(h, r, input_norm)         tritium_add_rms_norm_bf16
 *     qkv  = bf16(x Wqkv^T) (+ b)                   the layer's GEMM kind, rounded once
 *     q    = rope(qkv.q); cache <- rope(k), v       tritium_rope_kv_write_bf16
 *     a    = paged_attention(q, cache)              tritium_paged_decode_bf16
 *     h    = bf16(a Wo^T) (+ b) (* residual multiplier, Granite)
 *     x, r = add_rms_norm(h, r, post_attn_norm)
 *     g    = bf16(x Wgu^T) (+ b);  m = silu(g.gate) * g.up   tritium_silu_mul_bf16
 *     h    = bf16(m Wdown^T) (+ b) (* residual multiplier)
 *
 * Every step is a call of the kernel the per-op path (kernels/ops.py, cpu_linear.py) runs for
 * the same op, with the same roundings, so the result is bit for bit the per-op path's, on every
 * ISA path (this file has no SIMD of its own: it compiles into each path's library and calls that
 * path's kernels), and keeps their batch invariance.
 *
 * Bias add as torch does for bfloat16 tensors: bf16(float(y) + float(b)); Granite's residual
 * multiplier on the o and down outputs likewise, bf16(float(y) * m), as torch multiplies a bf16
 * tensor by a Python float.
 */
#include <stdint.h>
#include <string.h>

#include "cpu_simd.h"

/* The kernels this file calls (cpu_gemm.c, cpu_gemm_bf16.c, cpu_glue.c, cpu_decode_attention.c). */
void tritium_bf16_gemm(const uint16_t *x, const uint16_t *w, float *y, int64_t M, int64_t N, int64_t K);
void tritium_w8a16_gemm(const uint16_t *x, const int8_t *w, const float *scale, float *y, int64_t M, int64_t N,
                        int64_t K);
void tritium_w8g_gemm(const uint16_t *x, const int8_t *w, const float *params, int64_t nz, float *y, int64_t M,
                      int64_t N, int64_t K, int64_t G);
void tritium_w4_gemm(const uint16_t *x, const uint8_t *w4, const uint16_t *scale, const uint16_t *zero, float *y,
                     int64_t M, int64_t N, int64_t K, int64_t G);
void tritium_add_rms_norm_bf16(const uint16_t *x, const uint16_t *res, const uint16_t *w, float eps, int64_t T,
                               int64_t H, uint16_t *out, uint16_t *res_out);
void tritium_rope_kv_write_bf16(const uint16_t *qkv, const uint16_t *cos, const uint16_t *ssin, const int64_t *slot,
                                int64_t T, int64_t hq, int64_t hkv, int64_t D, uint16_t *q_out, uint16_t *k_cache,
                                uint16_t *v_cache);
void tritium_silu_mul_bf16(const uint16_t *x, int64_t T, int64_t n, uint16_t *out);
void tritium_paged_decode_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                               const int32_t *block_tables, int64_t table_stride, const int64_t *tok,
                               const int64_t *seq, const int64_t *lo, const int64_t *len, int64_t nrows,
                               int64_t hq, int64_t hkv, int64_t D, int64_t BS, float scale, float softcap,
                               uint16_t *out);

/* A linear layer's weight as cpu_linear.CpuLinear holds it (kernels/decode_layer.py fills these). */
enum { LIN_BF16 = 0, LIN_INT8 = 1, LIN_INT8G = 2, LIN_INT4 = 3 };
typedef struct {
    int64_t kind, n, k, group, nz;
    const void *w;        /* bf16 (N, K) | int8 (N, K) | nibbles uint8 (N, K / 2) */
    const float *scale;   /* LIN_INT8: (N,); LIN_INT4: float16 bits (K / G, N) */
    const float *zero;    /* LIN_INT4: float16 bits (K / G, N), NULL when symmetric */
    const float *params;  /* LIN_INT8G: (N, K / G, nz) */
    const uint16_t *bias; /* bf16 (N,) or NULL */
} tritium_linear_t;

typedef struct {
    const uint16_t *input_norm, *post_attn_norm; /* (H,) */
    uint16_t *k_cache, *v_cache;                 /* (num_blocks, BS, Hkv, D) */
    tritium_linear_t qkv, o, gate_up, down;
} tritium_decoder_layer_t;

/* out (T, N) bf16 = bf16(x (T, K) W^T) (+ bias) (* mult unless mult == 1), y: float32 scratch of T * N. */
static void linear(const tritium_linear_t *L, const uint16_t *x, int64_t T, float *y, uint16_t *out, float mult) {
    const int64_t N = L->n, K = L->k;
    switch (L->kind) {
    case LIN_BF16: tritium_bf16_gemm(x, (const uint16_t *)L->w, y, T, N, K); break;
    case LIN_INT8: tritium_w8a16_gemm(x, (const int8_t *)L->w, L->scale, y, T, N, K); break;
    case LIN_INT8G: tritium_w8g_gemm(x, (const int8_t *)L->w, L->params, L->nz, y, T, N, K, L->group); break;
    default: tritium_w4_gemm(x, (const uint8_t *)L->w, (const uint16_t *)L->scale, (const uint16_t *)L->zero, y, T, N, K, L->group); break;
    }
    for (int64_t t = 0; t < T; t++) {
        const float *yr = y + t * N;
        uint16_t *o = out + t * N;
        if (L->bias)
            for (int64_t n = 0; n < N; n++) o[n] = f32_to_bf16(bf16_roundf(yr[n]) + bf16_to_f32(L->bias[n]));
        else
            for (int64_t n = 0; n < N; n++) o[n] = f32_to_bf16(yr[n]);
        if (mult != 1.0f)
            for (int64_t n = 0; n < N; n++) o[n] = f32_to_bf16(bf16_to_f32(o[n]) * mult);
    }
}

static int64_t max3(int64_t a, int64_t b, int64_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* Sizes of the scratch the caller passes, for T rows: float32 and bf16 element counts. */
void tritium_decode_layers_workspace(int64_t T, int64_t H, int64_t hq, int64_t hkv, int64_t D, int64_t I,
                                     int64_t *f32_elems, int64_t *bf16_elems) {
    const int64_t nqkv = (hq + 2 * hkv) * D;
    *f32_elems = T * max3(nqkv, H, 2 * I);
    *bf16_elems = T * (H + nqkv + 2 * hq * D + 3 * I);
}

/* Runs layers[0 .. num_layers) over T rows. hidden (T, H) holds the layer input and receives the
 * last layer's output; residual (T, H) likewise (ignored on input when has_residual is 0: the
 * first layer's residual is its input). cos / ssin (T, D): rotary_tables of the rows' positions;
 * slots (T,): cache slot of each row's new key; rows (4, nrows) int64: token row, block-table
 * row, first key, context length of each attention row (attention_cpu.CpuAttentionPlan). */
void tritium_decode_layers_bf16(const tritium_decoder_layer_t *layers, int64_t num_layers, int64_t T, int64_t H,
                                int64_t hq, int64_t hkv, int64_t D, int64_t I, float eps, float scale,
                                float residual_mult, uint16_t *hidden, uint16_t *residual, int64_t has_residual, const uint16_t *cos,
                                const uint16_t *ssin, const int64_t *slots, const int32_t *block_tables,
                                int64_t table_stride, const int64_t *rows, int64_t nrows, int64_t BS,
                                float *ws_f32, uint16_t *ws_bf16) {
    const int64_t nqkv = (hq + 2 * hkv) * D;
    uint16_t *x = ws_bf16, *qkv = x + T * H, *q = qkv + T * nqkv, *attn = q + T * hq * D, *gu = attn + T * hq * D,
             *act = gu + T * 2 * I;
    const int64_t *tok = rows, *seq = rows + nrows, *lo = rows + 2 * nrows, *len = rows + 3 * nrows;
    for (int64_t l = 0; l < num_layers; l++) {
        const tritium_decoder_layer_t *L = layers + l;
        tritium_add_rms_norm_bf16(hidden, has_residual || l ? residual : NULL, L->input_norm, eps, T, H, x, residual);
        linear(&L->qkv, x, T, ws_f32, qkv, 1.0f);
        tritium_rope_kv_write_bf16(qkv, cos, ssin, slots, T, hq, hkv, D, q, L->k_cache, L->v_cache);
        tritium_paged_decode_bf16(q, L->k_cache, L->v_cache, block_tables, table_stride, tok, seq, lo, len, nrows,
                                  hq, hkv, D, BS, scale, 0.0f, attn);
        linear(&L->o, attn, T, ws_f32, hidden, residual_mult);
        tritium_add_rms_norm_bf16(hidden, residual, L->post_attn_norm, eps, T, H, x, residual);
        linear(&L->gate_up, x, T, ws_f32, gu, 1.0f);
        tritium_silu_mul_bf16(gu, T, I, act);
        linear(&L->down, act, T, ws_f32, hidden, residual_mult);
    }
}
