/* The blocked paged-attention rows of cpu_decode_attention.c on the AVX2 path, D % 8 == 0
 * (included there after its dot_qk / exp_sub_sum / axpy_v; the portable path keeps its one-row
 * kernel: the same blocking in portable C took 1.19x its time on decode rows). A chunk's keys
 * (then values), every KV head, are widened to float32 once into kf (contiguous reads, prefetched
 * ahead: widen_rows) and shared by the query heads and by every row of a tile: a prompt's
 * consecutive positions of one sequence (decode_tile_blocked). Four keys are scored at once
 * (eight independent FMA chains), a head's output stays in registers across the chunk's values,
 * the running max is taken in registers. Every score, softmax and output value is computed by
 * the same operations in the same order as dot_qk / exp_sub_sum / axpy_v in decode_row_plain:
 * the blocking changes which values are computed together, never a result's bits. */
#ifndef TRITIUM_CPU_ATTENTION_TILE_H
#define TRITIUM_CPU_ATTENTION_TILE_H

#define MAXROWB 1024 /* KV heads x head_dim of the blocked row */
#if defined(TRITIUM_AVX2)
/* t[k] = the hsum8 tree of a[k] (((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))) for four
 * vectors at once; out[k] = t[k] * scale */
INLINE void hsum8x4(__m256 a, __m256 b, __m256 c, __m256 d, float scale, float *out) {
    __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
    __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(c, d, 0x20), _mm256_permute2f128_ps(c, d, 0x31));
    __m256 x = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, 0x44), _mm256_shuffle_ps(ab, cd, 0xEE));
    __m256 h = _mm256_hadd_ps(x, x); /* lanes 0, 1, 4, 5: a, c, b, d */
    __m256 t = _mm256_permutevar8x32_ps(h, _mm256_setr_epi32(0, 4, 1, 5, 0, 4, 1, 5));
    _mm_storeu_ps(out, _mm_mul_ps(_mm256_castps256_ps128(t), _mm_set1_ps(scale)));
}
/* s[j] = scale * q . kf[j] for j < nj (kf: nj rows of D float32, ld apart) */
static void score_block(const float *q, const float *kf, int64_t nj, int64_t D, int64_t ld, float scale, float *s) {
    const int64_t D16 = D / 16 * 16;
    int64_t j = 0;
    for (; j + 4 <= nj; j += 4) {
        const float *k0 = kf + j * ld, *k1 = k0 + ld, *k2 = k1 + ld, *k3 = k2 + ld;
        __m256 e0 = _mm256_setzero_ps(), e1 = e0, e2 = e0, e3 = e0, o0 = e0, o1 = e0, o2 = e0, o3 = e0;
        for (int64_t d = 0; d < D16; d += 16) {
            const __m256 qe = _mm256_loadu_ps(q + d), qo = _mm256_loadu_ps(q + d + 8);
            e0 = _mm256_fmadd_ps(qe, _mm256_loadu_ps(k0 + d), e0);
            e1 = _mm256_fmadd_ps(qe, _mm256_loadu_ps(k1 + d), e1);
            e2 = _mm256_fmadd_ps(qe, _mm256_loadu_ps(k2 + d), e2);
            e3 = _mm256_fmadd_ps(qe, _mm256_loadu_ps(k3 + d), e3);
            o0 = _mm256_fmadd_ps(qo, _mm256_loadu_ps(k0 + d + 8), o0);
            o1 = _mm256_fmadd_ps(qo, _mm256_loadu_ps(k1 + d + 8), o1);
            o2 = _mm256_fmadd_ps(qo, _mm256_loadu_ps(k2 + d + 8), o2);
            o3 = _mm256_fmadd_ps(qo, _mm256_loadu_ps(k3 + d + 8), o3);
        }
        if (D16 < D) { /* D % 16 == 8: the last block goes to the even accumulator, as in dot_qk */
            const __m256 qe = _mm256_loadu_ps(q + D16);
            e0 = _mm256_fmadd_ps(qe, _mm256_loadu_ps(k0 + D16), e0);
            e1 = _mm256_fmadd_ps(qe, _mm256_loadu_ps(k1 + D16), e1);
            e2 = _mm256_fmadd_ps(qe, _mm256_loadu_ps(k2 + D16), e2);
            e3 = _mm256_fmadd_ps(qe, _mm256_loadu_ps(k3 + D16), e3);
        }
        hsum8x4(_mm256_add_ps(e0, o0), _mm256_add_ps(e1, o1), _mm256_add_ps(e2, o2), _mm256_add_ps(e3, o3),
                scale, s + j);
    }
    for (; j < nj; j++) {
        const float *k0 = kf + j * ld;
        __m256 e0 = _mm256_setzero_ps(), o0 = e0;
        int64_t d = 0;
        for (; d < D16; d += 16) {
            e0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k0 + d), e0);
            o0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), _mm256_loadu_ps(k0 + d + 8), o0);
        }
        if (d < D) e0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k0 + d), e0);
        s[j] = hsum8(_mm256_add_ps(e0, o0)) * scale;
    }
}
/* o[d] = fma(p[j], vf[j][d], o[d]) for j = 0 .. nj - 1 in order, 64 then 8 lanes at a time */
static void pv_block(float *o, const float *p, const float *vf, int64_t nj, int64_t D, int64_t ld) {
    int64_t c = 0;
    for (; c + 64 <= D; c += 64) {
        __m256 a[8];
        for (int i = 0; i < 8; i++) a[i] = _mm256_loadu_ps(o + c + 8 * i);
        for (int64_t j = 0; j < nj; j++) {
            const __m256 pj = _mm256_set1_ps(p[j]);
            const float *v = vf + j * ld + c;
            for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8 * i), a[i]);
        }
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(o + c + 8 * i, a[i]);
    }
    for (; c < D; c += 8) {
        __m256 a = _mm256_loadu_ps(o + c);
        for (int64_t j = 0; j < nj; j++) a = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(vf + j * ld + c), a);
        _mm256_storeu_ps(o + c, a);
    }
}
/* max(m, s[0 .. n - 1]) in registers (the order of a max does not change its value) */
INLINE float max_run(const float *s, int64_t n, float m) {
    __m256 v = _mm256_set1_ps(m);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(s + j));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    float mx = _mm_cvtss_f32(h);
    for (; j < n; j++) mx = s[j] > mx ? s[j] : mx;
    return mx;
}
#define PFD 8 /* positions the prefetch runs ahead */
INLINE void prefetch_row(const uint16_t *cache, const int32_t *table, int64_t pos, int64_t row, int64_t BS) {
    const uint16_t *p = cache + ((int64_t)table[pos / BS] * BS + pos % BS) * row;
    for (int64_t b = 0; b < row; b += 32) PREFETCH(p + b);
}
/* kf[j] = cache position j0 + j (every KV head, row values), widened to float32, for j < nj.
 * Prefetches (positions < end): this cache PFD positions ahead where ahead > 0, and position
 * pos + pf_ahead of pf_cache (the values while the keys are widened, the next chunk's keys while
 * the values are), so each chunk's first positions are not read cold. */
static void widen_rows(const uint16_t *cache, const int32_t *table, int64_t j0, int64_t nj, int64_t end,
                       int64_t row, int64_t BS, float *kf, int64_t ahead, const uint16_t *pf_cache,
                       int64_t pf_ahead, int64_t c0, int64_t c1) {
    for (int64_t j = 0; j < nj; j++) {
        const int64_t pos = j0 + j;
        const uint16_t *kp = cache + ((int64_t)table[pos / BS] * BS + pos % BS) * row;
        if (ahead && pos + ahead < end) prefetch_row(cache, table, pos + ahead, row, BS);
        if (pos + pf_ahead < end) prefetch_row(pf_cache, table, pos + pf_ahead, row, BS);
        for (int64_t d = c0; d < c1; d += 8) _mm256_storeu_ps(kf + j * row + d, bf16x8_to_f32(kp + d));
    }
}
static __thread float kf_tls[CHUNK * MAXROWB]; /* one chunk of keys or values, float32 */
#define TILE_FLOATS 65536 /* the running state of a tile's rows */
#define TILE_MAX 16       /* rows per tile */
static __thread float tile_tls[TILE_FLOATS];

/* Rows per tile for these shapes: each row keeps q and o (Hq * D), its scores (Hq * CHUNK), m, l */
static int64_t tile_rows(int64_t hq, int64_t D) {
    const int64_t t = TILE_FLOATS / (2 * hq * D + hq * CHUNK + 2 * hq);
    return t < 1 ? 1 : t > TILE_MAX ? TILE_MAX : t;
}

/* n rows of one sequence over keys [lo, len0 + k) for row k (a prompt's consecutive positions;
 * n = 1: a decode row): each chunk's keys and values are widened once for every row of the tile.
 * Row k goes through the chunks [lo, lo + CHUNK), ... up to its own length, each with the
 * operations of a tile of one row, so its bits are those of the row alone. */
static void decode_tile_blocked(const uint16_t *q, const int64_t *tok, int64_t n, const uint16_t *k_cache,
                                const uint16_t *v_cache, const int32_t *table, int64_t lo, int64_t len0,
                                int64_t hq, int64_t hkv, int64_t D, int64_t BS, float scale, float softcap,
                                int64_t r0, int64_t r1, uint16_t *out) {
    const int64_t grp = hq / hkv, row = hkv * D, QD = hq * D, per = 2 * QD + hq * CHUNK + 2 * hq;
    const int64_t c0 = r0 / grp * D, c1 = ((r1 - 1) / grp + 1) * D; /* the KV heads of query heads [r0, r1) */
    const int64_t end = len0 + n - 1;
    float *kf = kf_tls;
    for (int64_t t = 0; t < n; t++) {
        float *qf = tile_tls + t * per, *o = qf + QD, *m = o + QD + hq * CHUNK, *l = m + hq;
        const uint16_t *qt = q + tok[t] * QD;
        for (int64_t d = 0; d < QD; d++) {
            qf[d] = bf16_to_f32(qt[d]);
            o[d] = 0.0f;
        }
        for (int64_t r = 0; r < hq; r++) {
            m[r] = -INFINITY;
            l[r] = 0.0f;
        }
    }
    for (int64_t j0 = lo; j0 < end; j0 += CHUNK) {
        const int64_t njmax = end - j0 < CHUNK ? end - j0 : CHUNK, t0 = j0 - len0 + 1 > 0 ? j0 - len0 + 1 : 0;
        widen_rows(k_cache, table, j0, njmax, end, row, BS, kf, j0 == lo ? PFD : 0, v_cache, 0, c0, c1);
        for (int64_t t = t0; t < n; t++) { /* rows t < t0 end before this chunk */
            float *qf = tile_tls + t * per, *o = qf + QD, *s = o + QD, *m = s + hq * CHUNK, *l = m + hq;
            const int64_t len = len0 + t, nj = len - j0 < CHUNK ? len - j0 : CHUNK;
            for (int64_t r = r0; r < r1; r++) {
                    const int64_t h = r / grp;
                    score_block(qf + r * D, kf + h * D, nj, D, row, scale, s + r * CHUNK);
                    if (softcap > 0.0f)
                        for (int64_t j = 0; j < nj; j++) s[r * CHUNK + j] = softcap * tanhf(s[r * CHUNK + j] / softcap);
                }
            for (int64_t r = r0; r < r1; r++) {
                const float mx = max_run(s + r * CHUNK, nj, m[r]);
                const float corr = expf(m[r] - mx); /* 0 on the first chunk (m = -inf) */
                l[r] = l[r] * corr + exp_sub_sum(s + r * CHUNK, nj, mx);
                m[r] = mx;
                for (int64_t d = 0; d < D; d++) o[r * D + d] *= corr;
            }
        }
        widen_rows(v_cache, table, j0, njmax, end, row, BS, kf, 0, k_cache, CHUNK, c0, c1);
        for (int64_t t = t0; t < n; t++) {
            float *o = tile_tls + t * per + QD, *s = o + QD;
            const int64_t len = len0 + t, nj = len - j0 < CHUNK ? len - j0 : CHUNK;
            for (int64_t r = r0; r < r1; r++)
                    pv_block(o + r * D, s + r * CHUNK, kf + r / grp * D, nj, D, row);
        }
    }
    for (int64_t t = 0; t < n; t++) {
        const float *o = tile_tls + t * per + QD, *l = o + QD + hq * CHUNK + hq;
        uint16_t *ot = out + tok[t] * QD;
        for (int64_t r = r0; r < r1; r++) {
            const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
            for (int64_t d = 0; d < D; d++) ot[r * D + d] = f32_to_bf16(o[r * D + d] * inv);
        }
    }
}
#endif /* TRITIUM_AVX2 */
#endif
