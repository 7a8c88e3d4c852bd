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
    /* [2 n_ff, cols]: gate row r at row 2r, up row r at 2r + 1, so a predicted neuron's two rows are one
     * contiguous read (sparse_rows' paired pass); data NULL: gate and up are read apart (the layer's) */
    tdm_weight gate_up;
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

#define SPARSE_SLICE 256 /* neurons per slice of the sparse path (rows are gathered four at a time) */

#ifdef TDM_SIMD
/* Gathered rows are fetched GATHER_AHEAD groups of four ahead of the group being computed: one group's
 * compute (~0.1 us for a 2048-wide int4 row) is less than a memory round trip, so with the next group
 * only, the rows arrive late (bench: gathered rows at a third of the read bandwidth). */
#define GATHER_AHEAD 4

/* the group GATHER_AHEAD on from the group at i (NULL past the list: the last groups fetch nothing) */
static inline const int32_t *gather_next(const int32_t *rows, int64_t i, int64_t n) {
    int64_t a = i + 4 * GATHER_AHEAD;
    return a + 4 <= n ? rows + a : NULL;
}

/* the first lines of the rows the first groups compute while nothing fetches them */
static inline void gather_prime(const tdm_weight *w, const int32_t *rows, int64_t n) {
    for (int64_t j = 0; j < 4 * GATHER_AHEAD && j < n; j++) {
        const char *r = (const char *)(w->data + rows[j] * w->row_bytes);
        _mm_prefetch(r, _MM_HINT_T0);
        _mm_prefetch(r + 64, _MM_HINT_T0);
    }
}

/* out[k] = W[rows[k]] . x for four arbitrary rows of int4 groups of 32 (dot4_i4g32 with gathered
 * rows); fetches the first lines of the four rows at next[] meanwhile (NULL: none). */
static void dot4_i4g32_idx(const tdm_weight *w, const int32_t *rows, const int32_t *next, const float *dx,
                           const float *mx, const qvec *x, float *out) {
    int64_t rb = w->row_bytes, ss = w->scale_stride, ng = w->cols / 32;
    const uint8_t *p[4];
    const float *d[4], *m[4];
    for (int k = 0; k < 4; k++) { /* dx, mx: the four rows' expanded scales ([4][ng], blocks.h), or NULL */
        p[k] = w->data + rows[k] * rb;
        d[k] = dx ? dx + k * ng : w->scale + rows[k] * ss;
        m[k] = mx ? mx + k * ng : w->minimum + rows[k] * ss;
    }
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t g = 0; g < ng; g++) {
        if (next && (g & 3) == 0)
            for (int k = 0; k < 4; k++) _mm_prefetch((const char *)(w->data + next[k] * rb + 16 * g), _MM_HINT_T0);
        if (next && !dx && (g & 15) == 0)
            for (int k = 0; k < 4; k++) {
                _mm_prefetch((const char *)(w->scale + next[k] * ss + g), _MM_HINT_T0);
                _mm_prefetch((const char *)(w->minimum + next[k] * ss + g), _MM_HINT_T0);
            }
        __m256i xv = _mm256_loadu_si256((const __m256i *)(x->q + 32 * g));
        float xd = x->d[g];
        for (int k = 0; k < 4; k++)
            acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(d[k][g] * xd), dot32_u8s8(nibbles32(p[k] + 16 * g), xv), acc[k]);
    }
    for (int64_t f = 0; f < x->n_flagged; f++) { /* the residual of outlier blocks */
        int64_t g = x->flagged[f];
        __m256i xv = _mm256_loadu_si256((const __m256i *)(x->r + 32 * g));
        for (int k = 0; k < 4; k++)
            acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(d[k][g] * x->dr[g]), dot32_u8s8(nibbles32(p[k] + 16 * g), xv), acc[k]);
    }
    __m256 s[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t g = 0;
    for (; g + 8 <= ng; g += 8) { /* the minimum terms: m . block sums */
        __m256 xs = _mm256_loadu_ps(x->s + g);
        for (int k = 0; k < 4; k++) s[k] = _mm256_fmadd_ps(_mm256_loadu_ps(m[k] + g), xs, s[k]);
    }
    _mm_storeu_ps(out, _mm_add_ps(hsum4x8(acc[0], acc[1], acc[2], acc[3]), hsum4x8(s[0], s[1], s[2], s[3])));
    for (; g < ng; g++)
        for (int k = 0; k < 4; k++) out[k] += m[k][g] * x->s[g];
}
#endif

#ifdef TDM_SIMD
/* whether the format has a four-row gathered kernel (dot4_idx) */
static int has_dot4_idx(const tdm_weight *w) {
    return w->kind == KIND_I4H || w->kind == KIND_I8H || w->kind == KIND_Q4K || (w->kind == KIND_I4 && w->group == 32);
}

/* out[0..3] = W[rows[k]] . x for four gathered rows (has_dot4_idx); fetches the rows at next[] (NULL: none) */
static void dot4_idx(const tdm_weight *w, const int32_t *rows, const int32_t *next, const qvec *x, float *out) {
    if (w->kind == KIND_I4H) /* blocks_dot.h: f16 scales widened in registers */
        dot4_i4h_idx(w, rows, next, x, out);
    else if (w->kind == KIND_I8H)
        dot4_i8h_idx(w, rows, next, x, out);
    else if (w->kind == KIND_Q4K) {
        int64_t ng = w->cols / 32;
        float d[4 * ng], m[4 * ng];
        for (int k = 0; k < 4; k++) expand_scales(w, rows[k], 1, d + k * ng, m + k * ng);
        dot4_i4g32_idx(w, rows, next, d, m, x, out);
    } else
        dot4_i4g32_idx(w, rows, next, NULL, NULL, x, out);
}
#endif

/* out[i] = W[rows[i]] . x: four gathered rows at a time where the format has the kernel (Q4_0 / Q4_1,
 * Q8_0, Q4_K, int4), one at a time for the rest (Q5_0, Q5_K, Q6_K, ...). The last one to three rows go
 * through the four-row kernel too (the last row repeated): the scalar row rounds differently, so a row's
 * value would depend on where the list ends (paired_rows and the gate / up passes must agree). */
static void dot_rows_idx(const tdm_weight *w, const int32_t *rows, int64_t n, const qvec *x, float *out) {
    int64_t i = 0;
#ifdef TDM_SIMD
    if (has_dot4_idx(w)) {
        gather_prime(w, rows, n);
        for (; i + 4 <= n; i += 4) dot4_idx(w, rows + i, gather_next(rows, i, n), x, out + i);
        if (i < n) {
            int32_t last[4];
            float o[4];
            for (int k = 0; k < 4; k++) last[k] = rows[i + k < n ? i + k : n - 1];
            dot4_idx(w, last, NULL, x, o);
            for (int k = 0; i + k < n; k++) out[i + k] = o[k];
            return;
        }
    }
#endif
    for (; i < n; i++) out[i] = dot_row(w, rows[i], x);
}

/* Self-check entry (tests/test_gguf_blocks.py): out[i] = W[rows[i]] . x, x quantized as tdm_dot_rows does */
void tdm_dot_rows_idx(const tdm_weight *w, const int32_t *rows, int64_t n, const float *x, double residual_ratio, float *out) {
    int64_t cols = w->cols, nb = cols / QB + 1;
    int8_t q[cols], rq[cols];
    float d[nb], dr[nb], s[nb];
    int32_t flagged[nb];
    qvec v = {x, q, rq, d, dr, s, flagged, 0};
    quantize_q8(x, cols, &v, (float)residual_ratio);
    dot_rows_idx(w, rows, n, &v, out);
}

/* This thread's candidate rows of one FFN, in ascending order over its slices (slice_range: every nt-th
 * slice of the scorer's rows; one run of slices for the gate cut, which reads every gate row): the rows
 * predicted active (the scorer's dense rows, slice by slice), or with a predictor-less gate cut the rows
 * whose gate passes it (g filled as well). Returns how many; rows [n_ff] scratch. */
static int64_t candidate_rows(const tdm_predictor *P, const tdm_weight *gate, float cut, int64_t n_ff,
                              const qvec *zq, const qvec *x, int32_t *rows, float *g, int t, int nt) {
    float s[SPARSE_SLICE];
    int64_t k = 0, lo, hi, step; /* the gate cut reads every gate row: each thread its own run of slices */
    slice_range(n_ff, SPARSE_SLICE, !P, t, nt, &lo, &hi, &step);
    for (int64_t b0 = lo; b0 < hi; b0 += step) {
        int64_t n = b0 + SPARSE_SLICE < n_ff ? SPARSE_SLICE : n_ff - b0;
        dot_rows(P ? &P->w2 : gate, b0, n, P ? zq : x, s);
        if (P)
            for (int64_t i = 0; i < n; i++) {
                rows[k] = (int32_t)(b0 + i);
                k += s[i] + P->b2[b0 + i] >= (float)P->threshold;
            }
        else
            for (int64_t i = 0; i < n; i++) {
                rows[k] = (int32_t)(b0 + i);
                g[k] = s[i];
                k += s[i] > cut;
            }
    }
    return k;
}

#define PAIR_CHUNK 1024 /* neurons per gathered pass of paired_rows (its index and output buffers: 16 KB of stack) */

/* Gate and up values of the k predicted rows in gathered passes over P->gate_up (rows 2r and 2r + 1: one
 * contiguous read per neuron instead of one in each of two passes; bench: ~10-17% faster reads), then the
 * gate cut as sparse_rows applies it: rows / g / u compacted in place, the count returned. A row's value
 * does not depend on its neighbours in a pass, so the kept rows' g and u are those of the two passes. */
static int64_t paired_rows(const tdm_predictor *P, int gate_cut, float cut, int64_t k, const qvec *x, int32_t *rows,
                           float *g, float *u) {
    int32_t pair[2 * PAIR_CHUNK];
    float out[2 * PAIR_CHUNK];
    int64_t kept = 0;
    for (int64_t j0 = 0; j0 < k; j0 += PAIR_CHUNK) {
        int64_t n = k - j0 < PAIR_CHUNK ? k - j0 : PAIR_CHUNK;
        for (int64_t j = 0; j < n; j++) {
            pair[2 * j] = 2 * rows[j0 + j];
            pair[2 * j + 1] = 2 * rows[j0 + j] + 1;
        }
        dot_rows_idx(&P->gate_up, pair, 2 * n, x, out);
        for (int64_t j = 0; j < n; j++) { /* kept <= j0 + j: compaction in place */
            rows[kept] = rows[j0 + j];
            g[kept] = out[2 * j];
            u[kept] = out[2 * j + 1];
            kept += !gate_cut || out[2 * j] > cut;
        }
    }
    return kept;
}

/* The candidate rows' gate values (predicted rows: gathered here), then up only where the gate does not
 * already zero h (gate_cut: h = 0 unless g > cut): rows / g / u compacted in place, the count returned.
 * Each matrix is read as one gathered pass over all the thread's rows (dot_rows_idx prefetches ahead
 * across the whole list, so no slice starts cold). */
static int64_t sparse_rows(const tdm_predictor *P, const tdm_weight *gate, const tdm_weight *up, int64_t gated,
                           int gate_cut, float cut, int64_t n_ff, const qvec *zq, const qvec *x, int32_t *rows,
                           float *g, float *u, int t, int nt) {
    int64_t k = candidate_rows(P, gate, cut, n_ff, zq, x, rows, g, t, nt), kept = 0;
    if (P) {
        P->predicted[t] += k;
        if (gated && P->gate_up.data) { /* gate and up in one paired pass: every predicted row's up is read */
            kept = paired_rows(P, gate_cut, cut, k, x, rows, g, u);
            P->computed[t] += k;
            return kept;
        }
        if (gated) dot_rows_idx(gate, rows, k, x, g);
    }
    for (int64_t j = 0; j < k; j++) {
        rows[kept] = rows[j];
        g[kept] = g[j];
        kept += !(gated && gate_cut) || g[j] > cut;
    }
    dot_rows_idx(up, rows, kept, x, u);
    if (P) P->computed[t] += kept;
    return kept;
}

#endif
