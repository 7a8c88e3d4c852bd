/* MoE layers in the fused step (Mixtral, Qwen2-MoE), single- and multi-token alike: the router in
 * float (every thread routes its own copy of the token: no barrier), softmax over all experts, the
 * top k (ties: the lower expert id), renormalised when norm_topk; then each selected expert in
 * ascending id through ffn_rows (the dense layers' row code: sparse where the activation makes exact
 * zeros), summed over the threads and scaled by its weight, then the shared expert times
 * sigmoid(gate . x). The arithmetic order is tandem.core.ffn.dense.moe_forward's (route, combine in
 * ascending expert order, shared expert last). All experts are read from RAM: the GPU tier's expert
 * cache and prefetch (online/experts) stay outside this step. An expert with a dense down ([d, n_ff], a
 * GGUF file's blocks read in place) sums its kept h through it as dense_down does for a dense layer
 * (h quantized whole, the d rows shared out): a second barrier.
 *
 * Scratch after the step's own (tdm_work_bytes, tdm_batch_work_bytes): a second [threads, d] partial
 * buffer (experts alternate between it and the step's, so one barrier per expert suffices), two [n_ff]
 * dense-down inputs (alternating alike: zeroed by their writers after the second barrier), and each
 * thread's [d] accumulator and expert output and its quantized h. Included by decode.c after ffn_rows. */
#ifndef TANDEM_MOE_H
#define TANDEM_MOE_H

typedef struct {               /* one expert (or the shared expert); NULL biases: none */
    tdm_weight gate, up, down_t; /* [n_ff, d] each (down_t: rows = neurons; unused with a dense down) */
    const float *up_bias, *down_bias;
    int64_t n_ff;
    tdm_weight down;             /* [d, n_ff] dense down (data NULL: the down_t rows) */
} tdm_expert;

typedef struct tdm_moe {
    int64_t n_experts, top_k, norm_topk;
    const float *router;       /* [n_experts, d] float32 */
    const tdm_expert *experts; /* [n_experts] */
    const tdm_expert *shared;  /* NULL: no shared expert */
    const float *shared_gate;  /* [d]: the shared expert's output times sigmoid(shared_gate . x) */
    double threshold;          /* the experts' |h| threshold (< 0: every neuron) */
} tdm_moe;

/* this thread's [d] accumulator and output, and its quantized [n_ff] h (dense downs) */
static int64_t moe_thread_bytes(const tdm_model *m) {
    int64_t n = m->n_ff;
    return 2 * align64(4 * m->d) + 4 * align64(4 * (n / QB + 1)) + 2 * align64(n);
}

static int64_t moe_bytes(const tdm_model *m) {
    return align64(4 * m->threads * m->d) + 2 * align64(4 * m->n_ff) + m->threads * moe_thread_bytes(m);
}

typedef struct {
    float *partial_b, *acc, *y; /* [threads, d] shared; this thread's [d], [d] */
    float *hfull[2];            /* shared [n_ff] dense-down inputs, zero between experts (parity) */
    qvec hq;                    /* this thread's quantized h of a dense down */
} moe_bufs;

static moe_bufs moe_get(const tdm_model *m, uint8_t *base, int t) {
    int64_t n = m->n_ff;
    moe_bufs b;
    b.partial_b = (float *)base;
    base += align64(4 * m->threads * m->d);
    b.hfull[0] = (float *)base;
    b.hfull[1] = (float *)(base + align64(4 * n));
    base += 2 * align64(4 * n) + t * moe_thread_bytes(m);
    b.acc = (float *)base; base += align64(4 * m->d);
    b.y = (float *)base; base += align64(4 * m->d);
    b.hq.d = (float *)base; base += align64(4 * (n / QB + 1));
    b.hq.dr = (float *)base; base += align64(4 * (n / QB + 1));
    b.hq.s = (float *)base; base += align64(4 * (n / QB + 1));
    b.hq.flagged = (int32_t *)base; base += align64(4 * (n / QB + 1));
    b.hq.q = (int8_t *)base; base += align64(n);
    b.hq.r = (int8_t *)base;
    return b;
}

/* the dense-down inputs zeroed (before a step's parallel region: the single and the batch step place their
 * scratch differently, so the other's buffers may lie where these do) */
static void moe_clear(const tdm_model *m, uint8_t *base) {
    memset(base + align64(4 * m->threads * m->d), 0, 2 * (size_t)align64(4 * m->n_ff));
}

/* the top_k experts of x [d] in ascending id, with their weights */
static void moe_route(const tdm_moe *M, const float *x, int64_t d, int32_t *sel, float *w) {
    int64_t E = M->n_experts, k = M->top_k;
    float p[E], mx = -INFINITY, sum = 0.0f;
    uint8_t taken[E];
    for (int64_t e = 0; e < E; e++) {
        p[e] = dot_f32(M->router + e * d, x, d);
        mx = p[e] > mx ? p[e] : mx;
        taken[e] = 0;
    }
    for (int64_t e = 0; e < E; e++) {
        p[e] = expf(p[e] - mx);
        sum += p[e];
    }
    for (int64_t e = 0; e < E; e++) p[e] /= sum;
    float total = 0.0f;
    for (int64_t j = 0; j < k; j++) { /* descending probability, ties to the lower id (torch.topk's order) */
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++)
            if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
        taken[best] = 1;
        sel[j] = (int32_t)best;
        w[j] = p[best];
        total += w[j];
    }
    if (M->norm_topk)
        for (int64_t j = 0; j < k; j++) w[j] /= total;
    for (int64_t j = 1; j < k; j++) /* ascending expert id: the combine order */
        for (int64_t i = j; i > 0 && sel[i - 1] > sel[i]; i--) {
            int32_t s = sel[i]; sel[i] = sel[i - 1]; sel[i - 1] = s;
            float v = w[i]; w[i] = w[i - 1]; w[i - 1] = v;
        }
}

/* y [d] = the expert on x, summed over the threads (+ its down bias); one barrier (a dense down: two; hfull
 * is zero on entry and on return, and was last read before a barrier this thread has passed since) */
static void moe_expert(const tdm_model *m, const tdm_expert *X, float thr, const qvec *x, float *hbuf, int32_t *idx,
                       float *partial, float *hfull, qvec *hq, float *y, int64_t *count, int t, int nt) {
    int64_t d = m->d;
    ffn_view F = {&X->gate, &X->up, &X->down_t, X->up_bias, X->n_ff, thr, NULL, X->down.data ? &X->down : NULL};
    int64_t n_act = ffn_rows(m, &F, x, hbuf, idx, partial + t * d, NULL, t, nt);
    *count += n_act;
    if (F.down) { /* dense_down's arithmetic: h whole, quantized by every thread, its share of the d rows */
        int64_t lo, hi;
        for (int64_t i = 0; i < n_act; i++) hfull[idx[i]] = hbuf[i];
#pragma omp barrier
        hq->f = hfull;
        quantize_q8(hfull, X->n_ff, hq, (float)m->residual_ratio);
        row_chunk(d, t, nt, &lo, &hi);
        if (hi > lo) dot_rows(&X->down, lo, hi - lo, hq, partial + lo);
#pragma omp barrier
        for (int64_t i = 0; i < n_act; i++) hfull[idx[i]] = 0.0f;
        for (int64_t k = 0; k < d; k++) y[k] = partial[k] + (X->down_bias ? X->down_bias[k] : 0.0f);
        return;
    }
#pragma omp barrier
    for (int64_t k = 0; k < d; k++) {
        float a = X->down_bias ? X->down_bias[k] : 0.0f;
        for (int j = 0; j < nt; j++) a += partial[j * d + k];
        y[k] = a;
    }
}

/* one token's MoE FFN on its normalized input (x quantized, xn float) added to its residual res;
 * *parity alternates the partial buffers (kept across the tokens of a multi-token step) */
static void moe_token(const tdm_model *m, const tdm_layer *L, const qvec *x, const float *xn, float *res,
                      float *hbuf, int32_t *idx, float *partial_a, moe_bufs *mb, int *parity, int64_t *count,
                      int t, int nt) {
    const tdm_moe *M = L->moe;
    int32_t sel[M->top_k];
    float w[M->top_k], thr = (float)M->threshold;
    moe_route(M, xn, m->d, sel, w);
    for (int64_t k = 0; k < m->d; k++) mb->acc[k] = 0.0f;
    for (int64_t j = 0; j < M->top_k; j++) {
        moe_expert(m, M->experts + sel[j], thr, x, hbuf, idx, *parity ? mb->partial_b : partial_a, mb->hfull[*parity],
                   &mb->hq, mb->y, count, t, nt);
        *parity ^= 1;
        for (int64_t k = 0; k < m->d; k++) mb->acc[k] += mb->y[k] * w[j];
    }
    if (M->shared) {
        moe_expert(m, M->shared, thr, x, hbuf, idx, *parity ? mb->partial_b : partial_a, mb->hfull[*parity], &mb->hq,
                   mb->y, count, t, nt);
        *parity ^= 1;
        float s = 1.0f / (1.0f + expf(-dot_f32(M->shared_gate, xn, m->d)));
        for (int64_t k = 0; k < m->d; k++) mb->acc[k] += s * mb->y[k];
    }
    add_output(m, L->ffn_out_norm, res, mb->acc, mb->y);
}

static void moe_block(const tdm_model *m, const tdm_layer *L, shared_bufs *sb, thread_bufs *tb, int t, int nt) {
    moe_bufs mb = moe_get(m, m->work + shared_bytes(m) + m->threads * thread_bytes(m), t);
    int parity = 0;
    norm_and_quantize(m, tb->res, L->ffn_norm, L->ffn_norm_bias, tb);
    moe_token(m, L, &tb->x, tb->xn, tb->res, tb->h, tb->idx, sb->partial, &mb, &parity, &sb->counts[t], t, nt);
}

#endif
