/* Attention's value pass: the softmax weights times the value rows, an fma chain per output over the positions
 * in order, held in registers a pass of columns and heads at a time (8 or 16 lanes: the same bits). Included by
 * attention.h only, after the row loaders (kv_load8, attention_wide.h's kv_load16). */
#ifndef TANDEM_ATTENTION_VALUES_H
#define TANDEM_ATTENTION_VALUES_H

#ifdef TDM_SIMD /* the value rows' vectors: 16 lanes where attention_wide.h runs, else 8 */
#ifdef TDM_WIDE_ATTENTION
#define VAL_W 16
#define VAL_HEADS 4 /* heads a pass holds: VAL_HEADS x 4 accumulators + 4 rows' vectors in the 32 registers */
typedef __m512 valvec;
/* n8: only the first eight lanes (a head size of 16k + 8: its last columns), the others zero and not stored */
static inline valvec val_load(const char *row, int64_t c, int half, int n8) {
    return n8 ? _mm512_zextps256_ps512(kv_load8(row, c, half)) : kv_load16(row, c, half);
}
static inline valvec val_fma(float p, valvec v, valvec acc) { return _mm512_fmadd_ps(_mm512_set1_ps(p), v, acc); }
static inline valvec val_zero(void) { return _mm512_setzero_ps(); }
static inline void val_store(float *o, valvec v, int n8) {
    if (n8) _mm256_storeu_ps(o, _mm512_castps512_ps256(v));
    else _mm512_storeu_ps(o, v);
}
#else
#define VAL_W 8
#define VAL_HEADS 2 /* in the 16 registers */
typedef __m256 valvec;
static inline valvec val_load(const char *row, int64_t c, int half, int n8) { return (void)n8, kv_load8(row, c, half); }
static inline valvec val_fma(float p, valvec v, valvec acc) { return _mm256_fmadd_ps(_mm256_set1_ps(p), v, acc); }
static inline valvec val_zero(void) { return _mm256_setzero_ps(); }
static inline void val_store(float *o, valvec v, int n8) { (void)n8, _mm256_storeu_ps(o, v); }
#endif

/* columns [c0, c0 + NC * VAL_W) (N8: [c0, c0 + 8), NC 1) of out + h * hd = sum over s in [start, pos] of p_h[s] V[s]
 * for NH heads, where p_h = scores + h * span: each lane an fma chain over the positions in order, in registers;
 * sums (when not NULL) [h] = the p_h[s] summed in order */
static inline __attribute__((always_inline)) void values_pass(const void *V, const int32_t *rows, int64_t start,
                                                              int64_t pos, int64_t hd, int64_t c0, const int NC,
                                                              const int NH, const int N8, float *out,
                                                              const float *scores, int64_t span, float *sums,
                                                              const int half) {
    valvec acc[VAL_HEADS][4];
    float sm[VAL_HEADS];
    for (int h = 0; h < NH; h++) {
        sm[h] = 0.0f;
        for (int c = 0; c < NC; c++) acc[h][c] = val_zero();
    }
    for (int64_t s = start; s <= pos; s++) {
        const char *row = kv_row(V, rows, s, hd, half);
        valvec v[4];
        for (int c = 0; c < NC; c++) v[c] = val_load(row, c0 + c * VAL_W, half, N8);
        for (int h = 0; h < NH; h++) {
            float p = scores[h * span + s];
            for (int c = 0; c < NC; c++) acc[h][c] = val_fma(p, v[c], acc[h][c]);
            if (sums) sm[h] += p;
        }
    }
    for (int h = 0; h < NH; h++) {
        for (int c = 0; c < NC; c++) val_store(out + h * hd + c0 + c * VAL_W, acc[h][c], N8);
        if (sums) sums[h] = sm[h];
    }
}

#define VALUES_PASS(NC, N8)                                                                                     \
    switch (nh) {                                                                                               \
    case 1: values_pass(V, rows, start, pos, hd, c0, NC, 1, N8, o, p, span, sm, half); break;                 \
    case 2: values_pass(V, rows, start, pos, hd, c0, NC, 2, N8, o, p, span, sm, half); break;                 \
    VALUES_PASS_34(NC, N8)                                                                                      \
    }
#if VAL_HEADS == 4
#define VALUES_PASS_34(NC, N8)                                                                                  \
    case 3: values_pass(V, rows, start, pos, hd, c0, NC, 3, N8, o, p, span, sm, half); break;                 \
    case 4: values_pass(V, rows, start, pos, hd, c0, NC, 4, N8, o, p, span, sm, half); break;
#else
#define VALUES_PASS_34(NC, N8)
#endif
#else
#define VAL_W 8
#define VAL_HEADS 4
#endif

/* out + j * hd = sum over s in [start, pos] of p_j[s] V[s] (unnormalised; p_j = scores + j * span, the n_q <=
 * TDM_MAX_GROUP query heads of one KV group; V: that group's rows; rows: see kv_row) and sums[j] = the p_j[s]
 * summed in key order (sums may be NULL). Each output is an fma chain over the positions in order, whatever the
 * vector width (16 lanes, then 8 of them, then the columns past the last whole vector: fmaf), the head grouping or n_q,
 * so the decode step's and batch.h's tokens are bit-identical, and so are builds with and without AVX-512. A
 * pass holds up to VAL_HEADS heads x 4 vectors of columns in registers and reads their V rows once. */
static inline __attribute__((always_inline)) void values_of(const void *V, const int32_t *rows, int64_t start,
                                                            int64_t pos, int64_t hd, int64_t n_q, float *out,
                                                            const float *scores, int64_t span, float *sums,
                                                            const int half) {
    for (int64_t h0 = 0; h0 < n_q; h0 += VAL_HEADS) {
        int64_t nh = n_q - h0 < VAL_HEADS ? n_q - h0 : VAL_HEADS, c0 = 0;
        float *o = out + h0 * hd, *sm = sums ? sums + h0 : NULL;
        const float *p = scores + h0 * span;
#ifdef TDM_SIMD
        for (; c0 + 4 * VAL_W <= hd; c0 += 4 * VAL_W, sm = NULL) VALUES_PASS(4, 0)
        if (hd - c0 >= 3 * VAL_W) VALUES_PASS(3, 0) else if (hd - c0 >= 2 * VAL_W) VALUES_PASS(2, 0)
        else if (hd - c0 >= VAL_W) VALUES_PASS(1, 0)
        if (hd - c0 >= VAL_W) c0 += (hd - c0) / VAL_W * VAL_W, sm = NULL;
        if (VAL_W == 16 && hd - c0 >= 8) { /* the 512-bit build's last eight columns: half a vector */
            VALUES_PASS(1, 1)
            c0 += 8, sm = NULL;
        }
#endif
        for (int64_t h = 0; h < nh; h++) { /* the last columns (and every column without vectors) */
            if (sm) sm[h] = 0.0f;
            for (int64_t c = c0; c < hd; c++) {
                float acc = 0.0f;
                for (int64_t s = start; s <= pos; s++) {
                    acc = fmaf(p[h * span + s], kv_value(kv_row(V, rows, s, hd, half), c, half), acc);
                    if (sm && c == c0) sm[h] += p[h * span + s];
                }
                o[h * hd + c] = acc;
            }
            if (sm && c0 == hd)
                for (int64_t s = start; s <= pos; s++) sm[h] += p[h * span + s];
        }
    }
}
#undef VALUES_PASS
#undef VALUES_PASS_34
#undef VAL_W
#undef VAL_HEADS

#endif
