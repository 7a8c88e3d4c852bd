/* The FFN of one layer for T tokens (included by batch.h): each token's kept neurons (batch_keep), a
 * dense GGUF down (batch_dense_down), MoE layers token by token (batch_moe), and the rows read once for
 * every token (batch_ffn). Every token's arithmetic is the single-token step's (ffn.h). */
#ifndef TDM_BATCH_FFN_H
#define TDM_BATCH_FFN_H

/* token i's |h| > threshold neurons appended to its list (branch-free compaction, as ffn_block) */
static void batch_keep(batch_thread *tb, const tdm_model *m, int64_t i, const float *h, const int32_t *rows,
                       int64_t b0, int64_t n, float thr) {
    float *hi = tb->h + i * m->n_ff;
    int32_t *ii = tb->idx + i * m->n_ff;
    int64_t k = tb->n_act[i];
    for (int64_t j = 0; j < n; j++) {
        hi[k] = h[j];
        ii[k] = rows ? rows[j] : (int32_t)(b0 + j);
        k += fabsf(h[j]) > thr;
    }
    tb->n_act[i] = k;
}

/* dense_down (decode.c) for T tokens: each token's quantized h as the single step's, the rows read once */
static void batch_dense_down(const tdm_model *m, const tdm_layer *L, int64_t T, batch_shared *sb, batch_thread *tb,
                             int t, int nt, int64_t *units) {
    int64_t d = m->d, F = m->n_ff, lo, hi;
    for (int64_t i = 0; i < T; i++) {
        for (int64_t j = 0; j < tb->n_act[i]; j++) sb->hfull[i * F + tb->idx[i * F + j]] = tb->h[i * F + j];
        sb->counts[t] += tb->n_act[i];
    }
#pragma omp barrier
    for (int64_t i = 0; i < T; i++)
        quantize_q8(sb->hfull + i * F, L->n_ff > 0 ? L->n_ff : F, tb->x + i, (float)m->residual_ratio);
    unit_queue rows = row_units(units, 3, d, ROW_UNIT, t, nt);
    while (next_rows(&rows, &lo, &hi)) dot_rows_multi(&L->down, lo, hi - lo, tb->x, T, sb->delta + lo, d);
#pragma omp barrier
    for (int64_t i = 0; i < T; i++) {
        for (int64_t j = 0; j < tb->n_act[i]; j++) sb->hfull[i * F + tb->idx[i * F + j]] = 0.0f;
        for (int64_t k = 0; k < d; k++) tb->xn[k] = sb->delta[i * d + k] + (L->down_bias ? L->down_bias[k] : 0.0f);
        add_output(m, L->ffn_out_norm, tb->res + i * d, tb->xn, tb->xn);
    }
}

/* a MoE layer token by token (moe.h), each as the single-token step computes it */
static void batch_moe(const tdm_model *m, const tdm_layer *L, const tdm_batch *B, batch_shared *sb,
                      batch_thread *tb, int t, int nt) {
    int64_t T = B->n_tokens, d = m->d, n_in = max_in(m);
    moe_bufs mb = moe_get(m, m->work + batch_shared_bytes(m, T, B->span) + m->threads * batch_thread_bytes(m, T, B->span), t);
    int parity = 0;
    for (int64_t i = 0; i < T; i++) {
        batch_norm_quantize(m, tb->res + i * d, L->ffn_norm, L->ffn_norm_bias, tb->xn + i * n_in, tb->x + i);
        moe_token(m, L, tb->x + i, tb->xn + i * n_in, tb->res + i * d, tb->h, tb->idx, sb->partial, &mb, &parity,
                  &sb->counts[t], t, nt);
    }
}

/* one slice of FFN_SLICE neurons from b0 for all T tokens: up (and gate) rows, activation, each token's kept h */
static void batch_slice(const tdm_model *m, const tdm_layer *L, int64_t T, batch_thread *tb, int64_t b0, int64_t nf,
                        float thr) {
    int64_t n = b0 + FFN_SLICE < nf ? FFN_SLICE : nf - b0;
    float g[T * FFN_SLICE], u[T * FFN_SLICE], h[FFN_SLICE];
    dot_rows_multi(&L->up, b0, n, tb->x, T, u, FFN_SLICE);
    if (L->up_bias)
        for (int64_t i = 0; i < T; i++)
            for (int64_t j = 0; j < n; j++) u[i * FFN_SLICE + j] += L->up_bias[b0 + j];
    if (m->gated) dot_rows_multi(&L->gate, b0, n, tb->x, T, g, FFN_SLICE);
    for (int64_t i = 0; i < T; i++) {
        activate(m->act, (float)m->act_alpha, m->gated, g + i * FFN_SLICE, u + i * FFN_SLICE, h, n);
        batch_keep(tb, m, i, h, NULL, b0, n, thr);
    }
}

static void batch_ffn(const tdm_model *m, const tdm_layer *L, const tdm_batch *B, batch_shared *sb,
                      batch_thread *tb, int t, int nt, int64_t *units) {
    if (L->moe) {
        batch_moe(m, L, B, sb, tb, t, nt);
        return;
    }
    int64_t T = B->n_tokens, d = m->d, n_in = max_in(m), nf = L->n_ff > 0 ? L->n_ff : m->n_ff; /* rows; stride m->n_ff */
    float alpha = (float)m->act_alpha, thr = (float)L->threshold;
    const float *ub = L->up_bias;
    for (int64_t i = 0; i < T; i++) {
        batch_norm_quantize(m, tb->res + i * d, L->ffn_norm, L->ffn_norm_bias, tb->xn + i * n_in, tb->x + i);
        tb->n_act[i] = 0;
    }
    const tdm_predictor *P = L->pred && L->pred->rank > 0 ? L->pred : NULL;
    int zero_act = m->act == ACT_RELU || m->act == ACT_FATRELU || m->act == ACT_DRELU;
    int gate_cut = m->gated && zero_act && thr >= 0.0f;
    int64_t g0, g1, gstep;
    slice_range(nf, SPARSE_SLICE, 1, t, nt, &g0, &g1, &gstep); /* candidate_rows' gate-cut slices */
    for (int64_t b0 = g0; !P && gate_cut && b0 < g1; b0 += gstep) {
        /* the gate cut without a predictor: every gate row for all T tokens at once, then each
         * token's up rows where its gate passes (sparse_rows with P = NULL, token by token) */
        int64_t n = b0 + SPARSE_SLICE < nf ? SPARSE_SLICE : nf - b0;
        float cut = m->act == ACT_FATRELU ? alpha : 0.0f, gs[T * SPARSE_SLICE];
        dot_rows_multi(&L->gate, b0, n, tb->x, T, gs, SPARSE_SLICE);
        for (int64_t i = 0; i < T; i++) {
            float g[SPARSE_SLICE], u[SPARSE_SLICE], h[SPARSE_SLICE];
            int32_t rows[SPARSE_SLICE];
            int64_t k = 0;
            for (int64_t j = 0; j < n; j++) {
                rows[k] = (int32_t)(b0 + j);
                g[k] = gs[i * SPARSE_SLICE + j];
                k += g[k] > cut;
            }
            dot_rows_idx(&L->up, rows, k, tb->x + i, u);
            if (ub)
                for (int64_t j = 0; j < k; j++) u[j] += ub[rows[j]];
            activate(m->act, alpha, m->gated, g, u, h, k);
            batch_keep(tb, m, i, h, rows, b0, k, thr);
        }
    }
    for (int64_t i = 0; P && i < T; i++) { /* predicted rows: token by token (ffn_rows' sparse pass) */
        int64_t cap = (nf / (nt * SPARSE_SLICE) + 1) * SPARSE_SLICE; /* this thread's slices */
        float g[cap], u[cap];
        int32_t rows[cap];
        qvec zq;
        predict_hidden(P, tb->x + i, t, nt, (float)m->residual_ratio, &zq);
        int64_t n = sparse_rows(P, &L->gate, &L->up, m->gated, gate_cut, m->act == ACT_FATRELU ? alpha : 0.0f, nf, &zq,
                                tb->x + i, rows, g, u, t, nt);
        if (ub)
            for (int64_t j = 0; j < n; j++) u[j] += ub[rows[j]];
        activate(m->act, alpha, m->gated, g, u, g, n);
        batch_keep(tb, m, i, g, rows, 0, n, thr);
#pragma omp barrier /* P->z is the next token's */
    }
    if (!(P || gate_cut) && L->down.data) { /* a dense down scatters each kept h to its neuron: which thread
                                             * computes a slice does not matter, so they go out with stealing */
        unit_queue slices = row_units(units, 4, nf, FFN_UNIT, t, nt);
        for (int64_t lo, hi; next_rows(&slices, &lo, &hi);)
            for (int64_t b0 = lo; b0 < hi; b0 += FFN_SLICE)
                batch_slice(m, L, T, tb, b0, nf, thr);
    } else if (!(P || gate_cut)) { /* the down rows summed per thread below: ffn_rows' slices, as the single step */
        int64_t s0, s1, step;
        slice_range(nf, FFN_SLICE, thr < 0.0f, t, nt, &s0, &s1, &step);
        for (int64_t b0 = s0; b0 < s1; b0 += step) batch_slice(m, L, T, tb, b0, nf, thr);
    }
    if (L->down.data) {
        batch_dense_down(m, L, T, sb, tb, t, nt, units);
        return;
    }
    float *part = sb->partial + t * T * d; /* [T, d] this thread's down-projection sums */
    for (int64_t k = 0; k < T * d; k++) part[k] = 0.0f;
    int64_t same = 1; /* tokens whose active rows equal token 0's (all of them in a dense FFN) */
    while (same < T && tb->n_act[same] == tb->n_act[0]
           && !memcmp(tb->idx + same * m->n_ff, tb->idx, 4 * tb->n_act[0]))
        same++;
    axpy_rows_multi(&L->down_t, tb->idx, tb->h, m->n_ff, tb->n_act[0], same, part, d);
    for (int64_t i = same; i < T; i++)
        axpy_rows(&L->down_t, tb->idx + i * m->n_ff, tb->h + i * m->n_ff, tb->n_act[i], part + i * d);
    for (int64_t i = 0; i < T; i++) sb->counts[t] += tb->n_act[i];
#pragma omp barrier
    for (int64_t i = 0; i < T; i++) {
        for (int64_t k = 0; k < d; k++) {
            float a = L->down_bias ? L->down_bias[k] : 0.0f;
            for (int j = 0; j < nt; j++) a += sb->partial[(j * T + i) * d + k];
            tb->xn[k] = a; /* token i's FFN output (xn is free again) */
        }
        add_output(m, L->ffn_out_norm, tb->res + i * d, tb->xn, tb->xn);
    }
}

#endif
