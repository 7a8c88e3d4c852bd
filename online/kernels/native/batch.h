/* The multi-token decode step: T tokens (several of one sequence, or of several sequences) through
 * the whole model in one OpenMP region, every weight row read once per step for all T tokens
 * (rows_multi.h). Token i's logits, KV rows and FFN counts are bit-identical to tdm_decode on a
 * contiguous cache holding its sequence: the same per-token quantization, the same arithmetic for
 * every row whichever thread computes it (heads, attention, output rows and a dense down's slices are
 * shared out with stealing: next_unit in units.h), the same attention arithmetic (positions
 * addressed through the token's block table), and where down rows are summed per thread, the same
 * slices per thread, down-row order and cross-thread partial-sum order as the single step.
 *
 * KV: layer l's k_cache/v_cache are [n_kv, kv_rows, hd]; token i's position p is row
 * tables[i * table_stride + p / block_tokens] * block_tokens + p % block_tokens. Tokens of one
 * sequence see each other causally: q/k/v of all T first, KV written, barrier, then attention.
 * Included at the end of decode.c. */
#ifndef TANDEM_BATCH_H
#define TANDEM_BATCH_H

#include <stdlib.h>

#include "rows_multi.h"

typedef struct {
    int64_t n_tokens;        /* T >= 1 */
    const int64_t *tokens;   /* [T] token ids */
    const int64_t *pos;      /* [T] positions */
    const int32_t *tables;   /* [T, table_stride] block ids */
    int64_t table_stride, block_tokens, kv_rows;
    int64_t span;            /* max(pos) + 1 */
    const uint8_t *want;     /* [T] 1: this token's logits are wanted */
    float *logits;           /* [sum(want), vocab] */
} tdm_batch;

typedef struct {
    float *qkv, *attn, *delta, *partial; /* [T, q+2kv], [T, q], [T, d], [threads, T, d] */
    int32_t *rowmap;                     /* [T, span]: the KV row of each position of token i's sequence */
    int64_t *counts;                     /* [threads] */
    float *hfull;                        /* [T, n_ff] the dense down's inputs (zero between layers) */
    int64_t *units;                      /* [n_layers * UNIT_PHASES + 1, threads, UNIT_STRIDE] phase counters */
} batch_shared;

typedef struct {
    float *res, *xn, *h, *scores; /* [T, d], [T, max_in], [T, n_ff], [group_heads, span] */
    float *parts;                 /* [group_heads, segments of span, hd + 2] attention parts (attend_parts.h) */
    int32_t *idx;                 /* [T, n_ff] */
    int64_t *n_act;               /* [T] */
    qvec *x;                      /* [T] */
} batch_thread;

static int64_t batch_shared_bytes(const tdm_model *m, int64_t T, int64_t span) {
    int64_t q = m->n_heads * m->head_dim, kv = m->n_kv * m->head_dim;
    return align64(4 * T * (q + 2 * kv)) + align64(4 * T * q) + align64(4 * T * m->d)
           + align64(4 * m->threads * T * m->d) + align64(4 * T * span) + align64(8 * m->threads)
           + align64(4 * T * m->n_ff) + align64(unit_bytes(m));
}

static int64_t batch_thread_bytes(const tdm_model *m, int64_t T, int64_t span) {
    int64_t n = max_in(m), nb = n / QB + 1;
    return align64(4 * T * m->d) + align64(4 * T * n) + 2 * align64(4 * T * m->n_ff)
           + align64(4 * span * group_heads(m))
           + align64(4 * group_heads(m) * max_segments(span) * PART_FLOATS(m->head_dim)) + align64(8 * T)
           + align64((int64_t)sizeof(qvec) * T) + T * (2 * align64(n) + 4 * align64(4 * nb));
}

int64_t tdm_batch_work_bytes(const tdm_model *m, int64_t T, int64_t span) {
    return batch_shared_bytes(m, T, span) + m->threads * batch_thread_bytes(m, T, span) + moe_bytes(m);
}

static batch_shared batch_get_shared(const tdm_model *m, int64_t T, int64_t span) {
    int64_t q = m->n_heads * m->head_dim, kv = m->n_kv * m->head_dim;
    uint8_t *p = m->work;
    batch_shared s;
    s.qkv = (float *)p; p += align64(4 * T * (q + 2 * kv));
    s.attn = (float *)p; p += align64(4 * T * q);
    s.delta = (float *)p; p += align64(4 * T * m->d);
    s.partial = (float *)p; p += align64(4 * m->threads * T * m->d);
    s.rowmap = (int32_t *)p; p += align64(4 * T * span);
    s.counts = (int64_t *)p; p += align64(8 * m->threads);
    s.hfull = (float *)p; p += align64(4 * T * m->n_ff);
    s.units = (int64_t *)p;
    return s;
}

static batch_thread batch_get_thread(const tdm_model *m, int64_t T, int64_t span, int t) {
    int64_t n = max_in(m), nb = n / QB + 1;
    uint8_t *p = m->work + batch_shared_bytes(m, T, span) + t * batch_thread_bytes(m, T, span);
    batch_thread b;
    b.res = (float *)p; p += align64(4 * T * m->d);
    b.xn = (float *)p; p += align64(4 * T * n);
    b.h = (float *)p; p += align64(4 * T * m->n_ff);
    b.idx = (int32_t *)p; p += align64(4 * T * m->n_ff);
    b.scores = (float *)p; p += align64(4 * span * group_heads(m));
    b.parts = (float *)p; p += align64(4 * group_heads(m) * max_segments(span) * PART_FLOATS(m->head_dim));
    b.n_act = (int64_t *)p; p += align64(8 * T);
    b.x = (qvec *)p; p += align64((int64_t)sizeof(qvec) * T);
    for (int64_t i = 0; i < T; i++) {
        qvec *v = b.x + i;
        v->f = b.xn + i * n;
        v->q = (int8_t *)p; p += align64(n);
        v->r = (int8_t *)p; p += align64(n);
        v->d = (float *)p; p += align64(4 * nb);
        v->dr = (float *)p; p += align64(4 * nb);
        v->s = (float *)p; p += align64(4 * nb);
        v->flagged = (int32_t *)p; p += align64(4 * nb);
        v->n_flagged = 0;
    }
    return b;
}

static void batch_norm_quantize(const tdm_model *m, const float *x, const float *w, const float *b, float *xn,
                                qvec *v) {
    model_norm(m, xn, x, w, b);
    v->f = xn;
    quantize_q8(xn, m->d, v, (float)m->residual_ratio);
}

static void batch_attention(const tdm_model *m, const tdm_layer *L, const tdm_batch *B, batch_shared *sb,
                            batch_thread *tb, int64_t *units, int t, int nt) {
    int64_t T = B->n_tokens, hd = m->head_dim, qn = m->n_heads * hd, width = qn + 2 * m->n_kv * hd, lo, hi;
    int64_t n = max_in(m), span = B->span, half = m->kv_half != 0;
    for (int64_t i = 0; i < T; i++) batch_norm_quantize(m, tb->res + i * m->d, L->attn_norm, L->attn_norm_bias, tb->xn + i * n, tb->x + i);
    unit_queue heads = phase_units(units, 0, m->n_heads + 2 * m->n_kv, t, nt);
    for (int64_t u; (u = next_unit(&heads)) >= 0;) { /* q heads, then k heads, then v heads */
        int64_t r0;
        const tdm_weight *w = qkv_unit(m, L, u, &r0);
        dot_rows_multi(w, r0, hd, tb->x, T, sb->qkv + u * hd, width);
        for (int64_t i = 0; i < T; i++) {
            float *v = sb->qkv + i * width + u * hd;
            int64_t pos = B->pos[i], row = sb->rowmap[i * span + pos];
            if (L->qkv_bias)
                for (int64_t k = 0; k < hd; k++) v[k] += L->qkv_bias[u * hd + k];
            qk_head(m, L, u, pos, v);
            if (u >= m->n_heads + m->n_kv)
                kv_store(kv_at(L->v_cache, (u - m->n_heads - m->n_kv) * B->kv_rows + row, hd, half), v, hd, half);
            else if (u >= m->n_heads)
                kv_store(kv_at(L->k_cache, (u - m->n_heads) * B->kv_rows + row, hd, half), v, hd, half);
        }
    }
#pragma omp barrier
    int64_t rep = m->n_heads / m->n_kv, per = group_heads(m), parts = (rep + per - 1) / per;
    unit_queue groups = phase_units(units, 1, m->n_kv * T * parts, t, nt);
    for (int64_t e; (e = next_unit(&groups)) >= 0;) { /* e = (KV group, token, part of the group's heads):
                                                        * those heads of one token together, its rows read once */
        int64_t c = e % parts, i = (e / parts) % T, g = e / (parts * T), h = g * rep + c * per, pos = B->pos[i];
        int64_t n_q = rep - c * per < per ? rep - c * per : per;
        attend_group(kv_at(L->k_cache, g * B->kv_rows, hd, half), kv_at(L->v_cache, g * B->kv_rows, hd, half),
                     sb->rowmap + i * span, window_start(m, L, pos), pos, hd, (float)m->attn_scale,
                     sb->qkv + i * width + h * hd, n_q, sb->attn + i * qn + h * hd, tb->scores, span, half, tb->parts);
    }
#pragma omp barrier
    for (int64_t i = 0; i < T; i++) {
        tb->x[i].f = sb->attn + i * qn;
        quantize_q8(sb->attn + i * qn, qn, tb->x + i, (float)m->residual_ratio);
    }
    unit_queue rows = row_units(units, 2, m->d, ROW_UNIT, t, nt);
    while (next_rows(&rows, &lo, &hi)) {
        dot_rows_multi(&L->o, lo, hi - lo, tb->x, T, sb->delta + lo, m->d);
        if (L->o_bias)
            for (int64_t i = 0; i < T; i++)
                for (int64_t r = lo; r < hi; r++) sb->delta[i * m->d + r] += L->o_bias[r];
    }
#pragma omp barrier
    for (int64_t i = 0; i < T; i++) add_output(m, L->attn_out_norm, tb->res + i * m->d, sb->delta + i * m->d, tb->xn);
}

#include "batch_ffn.h" /* one layer's FFN for T tokens */

/* T tokens through the whole model (see the top of this file); logits of the wanted tokens in token
 * order. Returns the FFN neurons computed (summed over tokens and layers). */
int64_t tdm_decode_batch(const tdm_model *m, const tdm_batch *B) {
    int64_t T = B->n_tokens, span = B->span, d = m->d, n_in = max_in(m);
    batch_shared sb = batch_get_shared(m, T, span);
    int nt = (int)m->threads;
    for (int j = 0; j < nt; j++) sb.counts[j] = 0;
    memset(sb.hfull, 0, 4 * (size_t)(T * m->n_ff));
    moe_clear(m, m->work + batch_shared_bytes(m, T, span) + m->threads * batch_thread_bytes(m, T, span));
    int64_t n_want = 0;
    for (int64_t i = 0; i < T; i++) n_want += B->want[i] != 0;
    memset(sb.units, 0, (size_t)unit_bytes(m));
#pragma omp parallel num_threads(nt)
    {
        int t = omp_get_thread_num(), n = omp_get_num_threads();
        batch_thread tb = batch_get_thread(m, T, span, t);
        for (int64_t i = t; i < T; i += n) { /* each token's rows, positions 0..pos */
            int32_t *map = sb.rowmap + i * span;
            const int32_t *table = B->tables + i * B->table_stride;
            int64_t bt = B->block_tokens;
            for (int64_t b = 0, p = 0; p <= B->pos[i]; b++) /* block by block: no division per position */
                for (int64_t o = 0; o < bt && p <= B->pos[i]; o++, p++) map[p] = (int32_t)(table[b] * bt + o);
        }
        for (int64_t i = 0; i < T; i++) {
            embed_row(m, B->tokens[i], tb.res + i * d);
            add_position(m, B->pos[i], tb.res + i * d);
        }
#pragma omp barrier
        for (int64_t l = 0; l < m->n_layers; l++) {
            int64_t *units = layer_units(sb.units, l, n);
            batch_attention(m, &m->layers[l], B, &sb, &tb, units, t, n);
            batch_ffn(m, &m->layers[l], B, &sb, &tb, t, n, units);
        }
        if (n_want > 0) {
            int64_t w = 0, lo, hi;
            for (int64_t i = 0; i < T; i++) /* the wanted tokens' final norms, packed to the front */
                if (B->want[i]) {
                    batch_norm_quantize(m, tb.res + i * d, m->final_norm, m->final_norm_bias, tb.xn + w * n_in, tb.x + w);
                    w++;
                }
            unit_queue head = row_units(layer_units(sb.units, m->n_layers, n), 0, m->vocab, HEAD_UNIT, t, n);
            while (next_rows(&head, &lo, &hi)) {
                dot_rows_multi(&m->head, lo, hi - lo, tb.x, n_want, B->logits + lo, m->vocab);
                for (int64_t i = 0; i < n_want; i++) softcap(m, B->logits + i * m->vocab + lo, hi - lo);
            }
        }
    }
    int64_t total = 0;
    for (int j = 0; j < nt; j++) total += sb.counts[j];
    return total;
}

/* Self-check for the tests: out[i * n + j] = W[r0 + j] . x[i] (x: [T, cols]) with dot_rows_multi. */
void tdm_dot_rows_multi(const tdm_weight *w, int64_t r0, int64_t n, int64_t T, const float *x, double residual_ratio,
                        float *out) {
    int64_t cols = w->cols, nb = cols / QB + 1;
    qvec *v = (qvec *)malloc((size_t)T * sizeof(qvec));
    int8_t *q = (int8_t *)malloc((size_t)(2 * T * cols));
    float *f = (float *)malloc((size_t)(3 * T * nb) * sizeof(float));
    int32_t *flagged = (int32_t *)malloc((size_t)(T * nb) * sizeof(int32_t));
    if (v && q && f && flagged) {
        for (int64_t i = 0; i < T; i++) {
            qvec e = {x + i * cols, q + 2 * i * cols, q + (2 * i + 1) * cols, f + 3 * i * nb, f + (3 * i + 1) * nb,
                      f + (3 * i + 2) * nb, flagged + i * nb, 0};
            v[i] = e;
            if (cols % QB == 0) quantize_q8(x + i * cols, cols, v + i, (float)residual_ratio);
        }
        dot_rows_multi(w, r0, n, v, T, out, n);
    }
    free(v), free(q), free(f), free(flagged);
}

#endif
