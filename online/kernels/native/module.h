/* The module path's kernels (online/kernels/ffn.py: QuantizedLinear / QuantizedFFN for a few tokens,
 * predictor-gated rows, the CPU tier): row dot products with FLOAT activations (no Q8 quantization of x,
 * unlike the decode step), the sparse down projection and the fused FFN, over every packed format.
 * Rows split over `threads` static OpenMP chunks; the down projection sums per-chunk partials in chunk
 * order afterwards (deterministic, no races). Included by decode.c only, at its end (rows.h, dequant.h and act_fn before it). */
#ifndef TANDEM_MODULE_H
#define TANDEM_MODULE_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include "fdot.h"

static int64_t module_scratch(const tdm_weight *w) { return w->cols + w->cols / 16 + 16; } /* a row + its scales */

static int reads_group_sums(const tdm_weight *w) {
    return (w->kind == KIND_I4 && w->group == 32) || w->kind == KIND_I4H || w->kind == KIND_Q4K;
}

/* xsum [T][cols / 32]: each token's sums over blocks of 32 (int4 groups' minimum terms) */
static float *group_sums(const float *x, int64_t T, int64_t xs, int64_t cols) {
    int64_t ng = cols / 32;
    float *s = (float *)malloc((size_t)(T * ng + 1) * sizeof(float));
    for (int64_t t = 0; s && t < T; t++)
        for (int64_t g = 0; g < ng; g++) {
            float a = 0.0f;
            for (int k = 0; k < 32; k++) a += x[t * xs + 32 * g + k];
            s[t * ng + g] = a;
        }
    return s;
}

/* y [T, n] = x [T, cols] W[rows]^T (rows NULL: rows 0 .. n-1). Returns 0, or -1 when out of memory. */
int64_t tdm_gemv_rows(const tdm_weight *w, const int64_t *rows, int64_t n, int64_t T, const float *x, float *y,
                      int64_t threads) {
    float *xsum = reads_group_sums(w) ? group_sums(x, T, w->cols, w->cols) : NULL;
    int failed = reads_group_sums(w) && xsum == NULL;
    if (!failed)
#pragma omp parallel num_threads((int)(threads > 0 ? threads : 1))
    {
        int th = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t lo = n * th / nt, hi = n * (th + 1) / nt;
        float *buf = (float *)malloc((size_t)module_scratch(w) * sizeof(float));
        if (!buf) failed = 1;
        if (buf) fdot_rows(w, rows ? rows + lo : NULL, lo, hi - lo, T, x, w->cols, xsum, y + lo, n, buf);
        free(buf);
    }
    free(xsum);
    return failed ? -1 : 0;
}

/* ----- sparse down projection: y [T, d] += sum over selected neurons of h * W[i] ----- */

/* the row axpys of rows.h read this weight (else: dequantize the row and add it as float) */
static int axpy_reads(const tdm_weight *w) {
    if (w->kind == KIND_Q4K || (w->kind == KIND_I4 && w->group != 32)) return 0;
    return w->kind != KIND_F16 || w->cols % 8 == 0;
}

/* acc [cols] += sum_j h[j] W[idx[j]] (m rows) */
static void add_rows(const tdm_weight *w, const int32_t *idx, const float *h, int64_t m, float *acc, float *buf) {
#ifdef TDM_SIMD
    if (w->kind == KIND_I8) { /* per-row int8 rows four at a time (acc loaded and stored once per four) */
        int64_t j = 0, n = w->cols;
        for (; j + 4 <= m; j += 4) {
            const int8_t *q[4];
            __m256 a[4];
            for (int k = 0; k < 4; k++)
                q[k] = (const int8_t *)(w->data + idx[j + k] * w->row_bytes),
                a[k] = _mm256_set1_ps(h[j + k] * w->scale[idx[j + k] * w->scale_stride]);
            int64_t c = 0;
            for (; c + 8 <= n; c += 8) {
                __m256 s01 = _mm256_fmadd_ps(a[1], i8x8(q[1] + c), _mm256_mul_ps(a[0], i8x8(q[0] + c)));
                __m256 s23 = _mm256_fmadd_ps(a[3], i8x8(q[3] + c), _mm256_mul_ps(a[2], i8x8(q[2] + c)));
                _mm256_storeu_ps(acc + c, _mm256_add_ps(_mm256_loadu_ps(acc + c), _mm256_add_ps(s01, s23)));
            }
            for (; c < n; c++)
                for (int k = 0; k < 4; k++) acc[c] += h[j + k] * w->scale[idx[j + k] * w->scale_stride] * (float)q[k][c];
        }
        for (; j < m; j++) axpy_row(w, idx[j], h[j], acc);
        return;
    }
#endif
    if (axpy_reads(w)) {
        axpy_rows(w, idx, h, m, acc);
        return;
    }
    for (int64_t j = 0; j < m; j++) {
        tdm_dequantize_rows(w, idx[j], 1, buf);
        for (int64_t k = 0; k < w->cols; k++) acc[k] += h[j] * buf[k];
    }
}

/* One FFN for T tokens (x [T, d]) over the neurons rows[0..n) (NULL: 0..n-1): h = act(gate . x + gb) *
 * (up . x + ub) (gate NULL: act(up . x + ub)); where |h| > threshold, y [T, d] = sum h * down_t[i]
 * (threshold < 0: every listed neuron). Biases NULL when absent. Returns the (token, neuron) pairs
 * used, or -1 when out of memory. With up == NULL (and gate NULL), h [T, n] is given instead (the plain
 * sparse down projection). */
int64_t tdm_ffn_fused(const tdm_weight *gate, const tdm_weight *up, const tdm_weight *down_t, int64_t T,
                      const float *x, const float *h_in, int64_t act, double alpha, double threshold,
                      const float *gate_bias, const float *up_bias, const int64_t *rows, int64_t n, float *y,
                      int64_t threads) {
    int64_t d = down_t->cols, in = up ? up->cols : 0;
    int nt_max = (int)(threads > 0 ? threads : 1);
    float *partial = (float *)calloc((size_t)nt_max * T * d + 1, sizeof(float));
    int64_t counts[nt_max];
    int used = 1, failed = partial == NULL;
    int sums = (up && reads_group_sums(up)) || (gate && reads_group_sums(gate));
    float *xsum = sums && !failed ? group_sums(x, T, in, in) : NULL; /* gate and up read the same x */
    if (sums && !xsum) failed = 1;
    for (int i = 0; i < nt_max; i++) counts[i] = 0;
    if (!failed)
#pragma omp parallel num_threads(nt_max)
    {
        int th = omp_get_thread_num(), nt = omp_get_num_threads();
        if (th == 0) used = nt;
        int64_t lo = n * th / nt, hi = n * (th + 1) / nt, len = hi - lo, scratch = up ? module_scratch(up) : 0;
        if (module_scratch(down_t) > scratch) scratch = module_scratch(down_t);
        float *buf = (float *)malloc((size_t)(scratch + 2 * T * (len + 1)) * sizeof(float));
        int32_t *idx = (int32_t *)malloc((size_t)(len + 1) * sizeof(int32_t));
        if (!buf || !idx) failed = 1;
        else {
            float *hu = buf + scratch, *hg = hu + T * (len + 1), *hv = hg; /* hv reuses hg after the activation */
            if (up) fdot_rows(up, rows ? rows + lo : NULL, lo, len, T, x, in, xsum, hu, len + 1, buf);
            if (gate) fdot_rows(gate, rows ? rows + lo : NULL, lo, len, T, x, in, xsum, hg, len + 1, buf);
            for (int64_t j = 0; j < len && up; j++) {
                int64_t i = rows ? rows[lo + j] : lo + j;
                for (int64_t t = 0; t < T; t++) {
                    float u = hu[t * (len + 1) + j] + (up_bias ? up_bias[i] : 0.0f);
                    float g = gate ? hg[t * (len + 1) + j] + (gate_bias ? gate_bias[i] : 0.0f) : u;
                    hu[t * (len + 1) + j] = act_fn(act, (float)alpha, g, gate ? u : 1.0f);
                }
            }
            for (int64_t t = 0; t < T; t++) {
                const float *ht = up ? hu + t * (len + 1) : h_in + t * n + lo;
                int64_t m = 0;
                for (int64_t j = 0; j < len; j++)
                    if (fabsf(ht[j]) > (float)threshold || threshold < 0.0) {
                        idx[m] = (int32_t)(rows ? rows[lo + j] : lo + j);
                        hv[m++] = ht[j];
                    }
                counts[th] += m;
                add_rows(down_t, idx, hv, m, partial + ((int64_t)th * T + t) * d, buf);
            }
        }
        free(buf);
        free(idx);
    }
    free(xsum);
    if (failed) {
        free(partial);
        return -1;
    }
    int64_t total = 0;
    for (int64_t t = 0; t < T; t++)
        for (int64_t k = 0; k < d; k++) {
            float a = 0.0f;
            for (int c = 0; c < used; c++) a += partial[((int64_t)c * T + t) * d + k];
            y[t * d + k] = a;
        }
    for (int c = 0; c < used; c++) total += counts[c];
    free(partial);
    return total;
}

#endif
