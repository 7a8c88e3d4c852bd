/* The FFN of one layer for the single-token step (included by decode.c after its buffers and norms):
 * the rows of a dense layer or MoE expert (ffn_rows: predictor, ReLU gate cut, magnitude threshold),
 * the sparse fp16/int down rows or a dense GGUF down (dense_down), and the sum over threads. */
#ifndef TDM_FFN_H
#define TDM_FFN_H

#define FFN_SLICE 32 /* neurons per slice; dealt to threads in turn under a magnitude threshold (sparsity is
                        * uneven), one run per thread where every neuron is kept (slice_range); with a dense
                        * down, FFN_UNITs of slices shared out with stealing (units.h) */

/* The down projection as one GEMV over its d rows, GGUF blocks read in place (kquants.h): the kept h
 * of every neuron (0 elsewhere: the neurons the sparse rows would add) quantized like any input.
 * Reads fewer bytes than the sparse fp16 rows where sparsity is low (GELU). */
static void dense_down(const tdm_model *m, const tdm_layer *L, shared_bufs *sb, thread_bufs *tb, int64_t *units,
                       int t, int nt, int64_t n_act) {
    int64_t d = m->d;
    for (int64_t i = 0; i < n_act; i++) sb->hfull[tb->idx[i]] = tb->h[i];
    sb->counts[t] += n_act;
#pragma omp barrier
    quantize_q8(sb->hfull, L->n_ff > 0 ? L->n_ff : m->n_ff, &tb->x, (float)m->residual_ratio);
    unit_queue rows = row_units(units, 3, d, ROW_UNIT, t, nt);
    for (int64_t lo, hi; next_rows(&rows, &lo, &hi);)
        dot_rows(&L->down, lo, hi - lo, &tb->x, sb->delta + lo);
#pragma omp barrier
    for (int64_t i = 0; i < n_act; i++) sb->hfull[tb->idx[i]] = 0.0f; /* every thread read it: zero again */
    for (int64_t k = 0; k < d; k++) tb->xn[k] = sb->delta[k] + (L->down_bias ? L->down_bias[k] : 0.0f);
    add_output(m, L->ffn_out_norm, tb->res, tb->xn, tb->xn);
}

/* One FFN's rows: a dense layer's (its predictor and threshold) or a MoE expert's (moe.h). */
typedef struct {
    const tdm_weight *gate, *up, *down_t;
    const float *up_bias; /* [n_ff] or NULL */
    int64_t n_ff;
    float threshold;      /* |h| > threshold is computed; < 0: all */
    const tdm_predictor *pred;
    const tdm_weight *down; /* non-NULL: a dense down (dense_down adds the rows); NULL: down_t rows summed here */
} ffn_view;

static ffn_view layer_ffn(const tdm_model *m, const tdm_layer *L) {
    ffn_view f = {&L->gate, &L->up, &L->down_t, L->up_bias, L->n_ff > 0 ? L->n_ff : m->n_ff, (float)L->threshold,
                  L->pred && L->pred->rank > 0 ? L->pred : NULL, L->down.data ? &L->down : NULL};
    return f;
}

/* The FFN_SLICE neurons from b0: up (and gate) rows, activation, the kept h appended at n_act; returns n_act */
static int64_t ffn_slice(const tdm_model *m, const ffn_view *F, const qvec *x, int64_t b0, float *hbuf, int32_t *idx,
                         int64_t n_act) {
    int64_t b1 = b0 + FFN_SLICE < F->n_ff ? b0 + FFN_SLICE : F->n_ff, n = b1 - b0;
    float g[FFN_SLICE], u[FFN_SLICE], h[FFN_SLICE], thr = F->threshold;
    dot_rows(F->up, b0, n, x, u);
    if (F->up_bias)
        for (int64_t i = 0; i < n; i++) u[i] += F->up_bias[b0 + i];
    if (m->gated) dot_rows(F->gate, b0, n, x, g);
    activate(m->act, (float)m->act_alpha, m->gated, g, u, h, n);
    for (int64_t i = 0; i < n; i++) {
        hbuf[n_act] = h[i]; /* kept when it passes the threshold (branch-free compaction) */
        idx[n_act] = (int32_t)(b0 + i);
        n_act += fabsf(h[i]) > thr;
    }
    return n_act;
}

/* This thread's share of one FFN on the quantized input x: its slices' kept neurons (h, idx: [n_ff]
 * scratch), their down rows summed into part [d] (zeroed here). Returns the neurons kept. With a dense
 * down (F->down) the slices go out with stealing on `units` (the caller scatters each h to its neuron). */
static int64_t ffn_rows(const tdm_model *m, const ffn_view *F, const qvec *x, float *hbuf, int32_t *idx,
                        float *part, int64_t *units, int t, int nt) {
    int64_t n_act = 0, n_ff = F->n_ff;
    float alpha = (float)m->act_alpha, thr = F->threshold;
    /* predicted rows (predict.h); exact-zero activations also skip up rows their gate zeroes */
    const tdm_predictor *P = F->pred;
    int zero_act = m->act == ACT_RELU || m->act == ACT_FATRELU || m->act == ACT_DRELU;
    int gate_cut = m->gated && zero_act && thr >= 0.0f;
    qvec zq;
    if (P) predict_hidden(P, x, t, nt, (float)m->residual_ratio, &zq);
    if (P || gate_cut) { /* g in hbuf, rows in idx: both compacted in place below (n_act <= i) */
        float u[(n_ff / (nt * SPARSE_SLICE) + 1) * SPARSE_SLICE]; /* this thread's slices */
        int64_t n = sparse_rows(P, F->gate, F->up, m->gated, gate_cut, m->act == ACT_FATRELU ? alpha : 0.0f, n_ff, &zq,
                                x, idx, hbuf, u, t, nt);
        if (F->up_bias)
            for (int64_t i = 0; i < n; i++) u[i] += F->up_bias[idx[i]];
        activate(m->act, alpha, m->gated, hbuf, u, hbuf, n);
        for (int64_t i = 0; i < n; i++) {
            float h = hbuf[i];
            hbuf[n_act] = h;
            idx[n_act] = idx[i];
            n_act += fabsf(h) > thr;
        }
    }
    int64_t s0, s1, step; /* down rows summed per thread: every neuron kept (thr < 0), each thread its own run */
    slice_range(n_ff, FFN_SLICE, thr < 0.0f, t, nt, &s0, &s1, &step);
    if (!(P || gate_cut) && F->down && units) {
        unit_queue slices = row_units(units, 4, n_ff, FFN_UNIT, t, nt);
        for (int64_t lo, hi; next_rows(&slices, &lo, &hi);)
            for (int64_t b0 = lo; b0 < hi; b0 += FFN_SLICE)
                n_act = ffn_slice(m, F, x, b0, hbuf, idx, n_act);
    } else
        for (int64_t b0 = s0; !(P || gate_cut) && b0 < s1; b0 += step) n_act = ffn_slice(m, F, x, b0, hbuf, idx, n_act);
    if (F->down) return n_act; /* the caller's dense_down adds them */
    for (int64_t k = 0; k < m->d; k++) part[k] = 0.0f;
    axpy_rows(F->down_t, idx, hbuf, n_act, part);
    return n_act;
}

static void moe_block(const tdm_model *m, const tdm_layer *L, shared_bufs *sb, thread_bufs *tb, int t, int nt);
static void moe_clear(const tdm_model *m, uint8_t *base);

static void ffn_block(const tdm_model *m, const tdm_layer *L, shared_bufs *sb, thread_bufs *tb, int64_t *units, int t,
                      int nt) {
    if (L->moe) {
        moe_block(m, L, sb, tb, t, nt);
        return;
    }
    int64_t d = m->d;
    float *part = sb->partial + t * d;
    norm_and_quantize(m, tb->res, L->ffn_norm, L->ffn_norm_bias, tb);
    ffn_view F = layer_ffn(m, L);
    int64_t n_act = ffn_rows(m, &F, &tb->x, tb->h, tb->idx, part, units, t, nt);
    if (F.down) {
        dense_down(m, L, sb, tb, units, t, nt, n_act);
        return;
    }
    sb->counts[t] += n_act;
#pragma omp barrier
    for (int64_t k = 0; k < d; k++) {
        float a = L->down_bias ? L->down_bias[k] : 0.0f;
        for (int j = 0; j < nt; j++) a += sb->partial[j * d + k];
        tb->xn[k] = a; /* the FFN output summed over the threads (xn is free again) */
    }
    add_output(m, L->ffn_out_norm, tb->res, tb->xn, tb->xn);
}

#endif
