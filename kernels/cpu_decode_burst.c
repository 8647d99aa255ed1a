/* A decode burst: up to K greedy decode steps in one native call (kernels/cpu_decode_step.c's whole
 * step, argmax included, run K times). After step k every row's argmax becomes its next input id,
 * its position advances by one, its new key's slot is read from its block table, and its attention
 * row reads one more key (the first key moves with a sliding window). Each step is exactly
 * tritium_decode_step_bf16 on the values K separate calls would pass, so the bits are theirs.
 * The ctypes side is kernels/decode_step.py (DecodeStep.run_burst); who may burst:
 * backend/decode_burst.py.
 *
 * The burst ends after the step where any row produced one of its stop ids (the caller's EOS and
 * stop token ids of that row), or after K steps (the caller's K already stops at every row's token
 * budget). Rows are a decode-only step's: token row t is attention row t and reads block-table
 * row t. */
#include <stdint.h>
#include <string.h>

#define BURST_MAX_ROWS 32 /* HEAD_MAX_ROWS of cpu_decode_step.c, NATIVE_STEP_MAX_ROWS */

int tritium_decode_step_bf16(const void *f, const void *layers, int64_t num_layers, const int64_t *ids,
                             const int64_t *pos, const uint16_t *hidden_in, int64_t T, int64_t H, int64_t hq,
                             int64_t hkv, int64_t D, int64_t I, float eps, float scale, float residual_mult,
                             uint16_t *h, uint16_t *r, uint16_t *cos, uint16_t *ssin, const int64_t *slots,
                             const int32_t *block_tables, int64_t table_stride, const int64_t *rows, int64_t nrows,
                             int64_t BS, float *ws_f32, uint16_t *ws_bf16, int64_t threads, uint16_t *out,
                             const void *head, float *logits, int64_t *tokens);

/* The burst over T rows (T <= BURST_MAX_ROWS), from the first step's ids, pos, slots (T,) and
 * attention rows (4, T): token row, block-table row, first key, key count (rows[t] = t, the
 * table row t). window: the sliding window (0: none): first key = max(key count - window, 0).
 * stop_ids / stop_off (T + 1): row t's stop ids are stop_ids[stop_off[t] .. stop_off[t + 1]).
 * tokens_out (K, T) int64: step k's argmax of row t at [k * T + t]. The other arguments are
 * tritium_decode_step_bf16's (a head is required; the lookup must be the call's own: hidden_in
 * NULL). The inputs are not modified. Returns the steps run (1 .. K), or tritium_decode_step_bf16's
 * error (< 0); -5: rows not a decode-only step's, T or K out of range, a position past the block
 * tables' width. */
int tritium_decode_burst_bf16(const void *f, const void *layers, int64_t num_layers, const int64_t *ids,
                              const int64_t *pos, int64_t T, int64_t H, int64_t hq, int64_t hkv, int64_t D,
                              int64_t I, float eps, float scale, float residual_mult, uint16_t *h, uint16_t *r,
                              uint16_t *cos, uint16_t *ssin, const int64_t *slots, const int32_t *block_tables,
                              int64_t table_stride, const int64_t *rows, int64_t BS, float *ws_f32,
                              uint16_t *ws_bf16, int64_t threads, uint16_t *out, const void *head, float *logits,
                              int64_t K, int64_t window, const int64_t *stop_ids, const int64_t *stop_off,
                              int64_t *tokens_out) {
    int64_t cur_ids[BURST_MAX_ROWS], cur_pos[BURST_MAX_ROWS], cur_slots[BURST_MAX_ROWS];
    int64_t cur_rows[4 * BURST_MAX_ROWS];
    if (T < 1 || T > BURST_MAX_ROWS || K < 1 || !head || BS < 1) return -5;
    for (int64_t t = 0; t < T; t++) {
        /* a decode-only step: token row t is attention row t of table row t, its key count pos + 1 */
        if (rows[t] != t || rows[T + t] != t || rows[3 * T + t] != pos[t] + 1) return -5;
        if ((pos[t] + K - 1) / BS >= table_stride) return -5;
    }
    memcpy(cur_ids, ids, sizeof(int64_t) * (size_t)T);
    memcpy(cur_pos, pos, sizeof(int64_t) * (size_t)T);
    memcpy(cur_slots, slots, sizeof(int64_t) * (size_t)T);
    memcpy(cur_rows, rows, sizeof(int64_t) * (size_t)(4 * T));
    for (int64_t k = 0; k < K; k++) {
        int64_t *tok = tokens_out + k * T;
        const int rc = tritium_decode_step_bf16(f, layers, num_layers, cur_ids, cur_pos, NULL, T, H, hq, hkv, D, I,
                                                eps, scale, residual_mult, h, r, cos, ssin, cur_slots, block_tables,
                                                table_stride, cur_rows, T, BS, ws_f32, ws_bf16, threads, out, head,
                                                logits, tok);
        if (rc) return rc;
        int stop = 0;
        for (int64_t t = 0; t < T; t++)
            for (int64_t j = stop_off[t]; j < stop_off[t + 1]; j++)
                if (stop_ids[j] == tok[t]) stop = 1;
        if (stop || k + 1 == K) return (int)(k + 1);
        for (int64_t t = 0; t < T; t++) { /* the next step's inputs, as the caller would write them */
            const int64_t p = ++cur_pos[t], len = ++cur_rows[3 * T + t];
            cur_ids[t] = tok[t];
            cur_slots[t] = (int64_t)block_tables[t * table_stride + p / BS] * BS + p % BS;
            cur_rows[2 * T + t] = window > 0 && len > window ? len - window : 0;
        }
    }
    return (int)K;
}
