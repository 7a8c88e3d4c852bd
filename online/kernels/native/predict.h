/* Predictor-gated sparse FFN rows for the decode step (PowerInfer / Deja Vu): a low-rank scorer
 * z = relu(W1 x + b1), score = W2 z + b2 picks the neurons whose gate/up rows (and down rows) are
 * read; layers whose activation makes exact zeros (ReLU, FATReLU, dReLU) also skip the up row
 * wherever the gate already zeroes h. Included by decode.c only (after rows.h). */
#ifndef TANDEM_PREDICT_H
#define TANDEM_PREDICT_H
#include <stdint.h>

#include "rows.h"

typedef struct {
    int64_t rank;          /* hidden width of the scorer */
    tdm_weight w1, w2;     /* [rank, d], [n_ff, rank]: int8 rows, or fp32 (rank % 32 != 0, tests) */
    const float *b1, *b2;  /* [rank], [n_ff] */
    double threshold;      /* a neuron is predicted active when its score >= threshold (a logit) */
    float *z;              /* [rank] shared scratch */
    uint8_t *scratch;      /* tdm_pred_scratch_bytes(rank, threads): each thread's quantized z */
    int64_t *predicted;    /* [threads] rows predicted active, summed over calls */
    int64_t *computed;     /* [threads] up rows computed (after the gate cut), summed over calls */
} tdm_predictor;

static int64_t pred_align(int64_t n) { return (n + 63) & ~(int64_t)63; }

static int64_t pred_thread_bytes(int64_t rank) {
    return 2 * pred_align(rank) + 4 * pred_align(4 * (rank / QB + 1));
}

int64_t tdm_pred_scratch_bytes(int64_t rank, int64_t threads) { return threads * pred_thread_bytes(rank) + 64; }

/* z = relu(W1 x + b1), rows dealt over the threads; after the barrier every thread quantizes all of z
 * into its own buffers for the W2 dot products. */
static void predict_hidden(const tdm_predictor *P, const qvec *x, int t, int nt, float residual_ratio, qvec *zq) {
    int64_t lo = P->rank * t / nt, hi = P->rank * (t + 1) / nt, nb = P->rank / QB + 1;
    dot_rows(&P->w1, lo, hi - lo, x, P->z + lo);
    for (int64_t r = lo; r < hi; r++) {
        float v = P->z[r] + P->b1[r];
        P->z[r] = v > 0.0f ? v : 0.0f;
    }
#pragma omp barrier
    uint8_t *p = (uint8_t *)(((uintptr_t)P->scratch + 63) & ~(uintptr_t)63) + t * pred_thread_bytes(P->rank);
    zq->f = P->z;
    zq->q = (int8_t *)p; p += pred_align(P->rank);
    zq->r = (int8_t *)p; p += pred_align(P->rank);
    zq->d = (float *)p; p += pred_align(4 * nb);
    zq->dr = (float *)p; p += pred_align(4 * nb);
    zq->s = (float *)p; p += pred_align(4 * nb);
    zq->flagged = (int32_t *)p;
    zq->n_flagged = 0;
    if (P->w2.kind != KIND_F32) quantize_q8(P->z, P->rank, zq, residual_ratio);
}

/* Neurons b0 .. b0+n-1 (n <= 64): the candidate rows (predicted active, or all with a predictor-less
 * gate cut), their gate values, then up only where the gate does not already zero h (gate_cut:
 * h = 0 unless g > cut). Fills rows/g/u compacted; returns how many. */
static int64_t sparse_rows(const tdm_predictor *P, const tdm_weight *gate, const tdm_weight *up, int64_t gated,
                           int gate_cut, float cut, int64_t b0, int64_t n, const qvec *zq, const qvec *x,
                           int32_t *rows, float *g, float *u, int t) {
    float s[64];
    int64_t k = 0, kept = 0;
    if (P) {
        dot_rows(&P->w2, b0, n, zq, s);
        for (int64_t i = 0; i < n; i++) {
            rows[k] = (int32_t)(b0 + i);
            k += s[i] + P->b2[b0 + i] >= (float)P->threshold;
        }
        P->predicted[t] += k;
        if (gated)
            for (int64_t j = 0; j < k; j++) g[j] = dot_row(gate, rows[j], x);
    } else {
        dot_rows(gate, b0, n, x, s);
        for (int64_t i = 0; i < n; i++) {
            rows[k] = (int32_t)(b0 + i);
            g[k] = s[i];
            k += s[i] > cut;
        }
    }
    for (int64_t j = 0; j < k; j++) {
        if (gated && gate_cut && !(g[j] > cut)) continue;
        rows[kept] = rows[j];
        g[kept] = g[j];
        u[kept] = dot_row(up, rows[j], x);
        kept++;
    }
    if (P) P->computed[t] += kept;
    return kept;
}

#endif
