/* A whole decode step of a bfloat16 Llama-shaped model in one call: the token ids' embedding rows
 * (gathered, and dequantized where the engine stores int8 / int6 codes), the rotary cos / sin rows
 * of their positions from tables built once per engine, every decoder layer
 * (tritium_decode_layers_bf16, kernels/cpu_decode_layer.c) and the final RMSNorm
 * (tritium_add_rms_norm_bf16, kernels/cpu_glue.c). The ctypes side is kernels/decode_step.py.
 *
 * Each value is rounded where the per-op path rounds it (backend/models/decoder.py _embed_rows and
 * _scale_embedding, kernels/rotary_ref.rotary_tables, ops.rms_norm), so the result is the same bits:
 *   int8 / int6 rows: bf16(c * s [/ input_scale]), s the row's scale (or its group's), float32;
 *   bf16 rows: copied;
 *   then, with an embedding multiplier m (rounded to bf16 by the caller): bf16(float(x) * m).
 * A row's result depends on its own id and position only (batch invariance). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_simd.h"
#include "cpu_f16.h"

enum { EMB_NONE = 0, EMB_BF16 = 1, EMB_I8 = 2, EMB_I8_PANELS = 3, EMB_I6_PANELS = 4 };
enum { SCALE_F32 = 0, SCALE_BF16 = 1, SCALE_F16 = 2 };

static inline float scale_at(const void *s, int64_t dtype, int64_t i) {
    if (dtype == SCALE_F32) return ((const float *)s)[i];
    const uint16_t h = ((const uint16_t *)s)[i];
    return dtype == SCALE_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

typedef struct {
    int64_t kind;         /* EMB_*; EMB_NONE: the caller passes the embedded rows */
    int64_t vocab, group; /* group 0: one scale per row, scale (V,); else scale (K / group, V) */
    const void *w;        /* (V, H) bf16 | (V, H) int8 | i8dot panels | int6 panels */
    const void *scale;
    int64_t scale_dtype;  /* SCALE_*: the stored scales, widened to float32 exactly */
    const float *input_scale; /* (H,) or NULL: the AWQ-scaled tied head's lookup divides by it */
    float mult;
    int64_t scaled;       /* whether to multiply by mult */
    const uint16_t *cos, *ssin; /* (max_pos, D) bf16: rotary_tables of every position */
    int64_t max_pos;
    const uint16_t *norm; /* (H,) the final norm's weight */
} tritium_step_front_t;

int tritium_decode_layers_bf16(const void *layers, int64_t num_layers, int64_t T, int64_t H, int64_t hq,
                               int64_t hkv, int64_t D, int64_t I, float eps, float scale, float residual_mult,
                               uint16_t *hidden, uint16_t *residual, int64_t has_residual, const uint16_t *cos,
                               const uint16_t *ssin, const int64_t *slots, const int32_t *block_tables,
                               int64_t table_stride, const int64_t *rows, int64_t nrows, int64_t BS, float *ws_f32,
                               uint16_t *ws_bf16, int64_t threads);
void tritium_add_rms_norm_bf16(const uint16_t *x, const uint16_t *res, const uint16_t *w, float eps, int64_t T,
                               int64_t H, uint16_t *out, uint16_t *res_out);
void tritium_head6_rows(const uint8_t *w, const int64_t *ids, int64_t T, int64_t K, int8_t *out);

/* The signed codes (H) of row `id` of 8-bit integer-dot panels (kernels/i8dot_pack.py: codes
 * (P, H / 32, 8, 16, 4), [p, b, i, j, e] the code of row 16 p + j, input 32 b + 4 i + e). */
static void panel_row(const uint8_t *w, int64_t id, int64_t H, int8_t *out) {
    const int64_t KB = H / 32, p = id / 16, j = id % 16;
    for (int64_t b = 0; b < KB; b++)
        for (int i = 0; i < 8; i++)
            memcpy(out + 32 * b + 4 * i, w + (((p * KB + b) * 8 + i) * 16 + j) * 4, 4);
}

/* Row `id`'s embedding (H) in bf16; codes: an H-byte scratch. */
static void embed_row(const tritium_step_front_t *f, int64_t id, int64_t H, int8_t *codes, uint16_t *out) {
    if (f->kind == EMB_BF16) {
        memcpy(out, (const uint16_t *)f->w + id * H, sizeof(uint16_t) * (size_t)H);
    } else {
        const int8_t *c = codes;
        if (f->kind == EMB_I8) c = (const int8_t *)f->w + id * H;
        else if (f->kind == EMB_I8_PANELS) panel_row((const uint8_t *)f->w, id, H, codes);
        else tritium_head6_rows((const uint8_t *)f->w, &id, 1, H, codes);
        for (int64_t k = 0; k < H; k++) {
            const float s = scale_at(f->scale, f->scale_dtype, f->group ? (k / f->group) * f->vocab + id : id);
            float v = (float)c[k] * s;
            if (f->input_scale) v = v / f->input_scale[k];
            out[k] = f32_to_bf16(v);
        }
    }
    if (f->scaled)
        for (int64_t k = 0; k < H; k++) out[k] = f32_to_bf16(bf16_to_f32(out[k]) * f->mult);
}

/* The step over T rows: ids, pos (T,) int64 (ignored, with hidden_in (T, H) the embedded rows,
 * where the front's kind is EMB_NONE). h, r (T, H) and cos, ssin (T, D) are scratch; out (T, H)
 * receives the final norm's output. The other arguments are tritium_decode_layers_bf16's.
 * Returns 0; -1 when scratch memory ran out; -2 an id outside [0, vocab); -3 a position outside
 * [0, max_pos). */
int tritium_decode_step_bf16(const tritium_step_front_t *f, const void *layers, int64_t num_layers,
                             const int64_t *ids, const int64_t *pos, const uint16_t *hidden_in, int64_t T,
                             int64_t H, int64_t hq, int64_t hkv, int64_t D, int64_t I, float eps, float scale,
                             float residual_mult, uint16_t *h, uint16_t *r, uint16_t *cos, uint16_t *ssin,
                             const int64_t *slots, const int32_t *block_tables, int64_t table_stride,
                             const int64_t *rows, int64_t nrows, int64_t BS, float *ws_f32, uint16_t *ws_bf16,
                             int64_t threads, uint16_t *out) {
    for (int64_t t = 0; t < T; t++) {
        if (pos[t] < 0 || pos[t] >= f->max_pos) return -3;
        if (f->kind != EMB_NONE && (ids[t] < 0 || ids[t] >= f->vocab)) return -2;
    }
    if (f->kind == EMB_NONE) {
        memcpy(h, hidden_in, sizeof(uint16_t) * (size_t)(T * H));
    } else {
        int8_t *codes = (int8_t *)malloc((size_t)H);
        if (!codes) return -1;
        for (int64_t t = 0; t < T; t++) embed_row(f, ids[t], H, codes, h + t * H);
        free(codes);
    }
    for (int64_t t = 0; t < T; t++) {
        memcpy(cos + t * D, f->cos + pos[t] * D, sizeof(uint16_t) * (size_t)D);
        memcpy(ssin + t * D, f->ssin + pos[t] * D, sizeof(uint16_t) * (size_t)D);
    }
    if (tritium_decode_layers_bf16(layers, num_layers, T, H, hq, hkv, D, I, eps, scale, residual_mult, h, r, 0, cos,
                                   ssin, slots, block_tables, table_stride, rows, nrows, BS, ws_f32, ws_bf16,
                                   threads))
        return -1;
    tritium_add_rms_norm_bf16(h, r, f->norm, eps, T, H, out, r);
    return 0;
}
