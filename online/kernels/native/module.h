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

/* ----- float dot products of one weight row with one token ----- */
static float fdot_f32(const float *restrict w, const float *restrict x, int64_t n) {
    int64_t k = 0;
    float s = 0.0f;
#ifdef TDM_SIMD
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    for (; k + 16 <= n; k += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
    }
    for (; k + 8 <= n; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
    s = hsum8(_mm256_add_ps(a0, a1));
#endif
    for (; k < n; k++) s += w[k] * x[k];
    return s;
}

#ifdef TDM_SIMD
static float fdot_f16(const uint16_t *w, const float *x, int64_t n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) {
        a0 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + k))), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + k + 8))), _mm256_loadu_ps(x + k + 8), a1);
    }
    for (; k + 8 <= n; k += 8)
        a0 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + k))), _mm256_loadu_ps(x + k), a0);
    float s = hsum8(_mm256_add_ps(a0, a1));
    for (; k < n; k++) s += f16_value(w[k]) * x[k];
    return s;
}

static inline __m256 i8x8(const int8_t *q) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q))); }

static float fdot_i8(const int8_t *q, const float *x, int64_t n) { /* per-row int8: times the row scale by the caller */
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) {
        a0 = _mm256_fmadd_ps(i8x8(q + k), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(i8x8(q + k + 8), _mm256_loadu_ps(x + k + 8), a1);
    }
    for (; k + 8 <= n; k += 8) a0 = _mm256_fmadd_ps(i8x8(q + k), _mm256_loadu_ps(x + k), a0);
    float s = hsum8(_mm256_add_ps(a0, a1));
    for (; k < n; k++) s += (float)q[k] * x[k];
    return s;
}

/* Q8_0 blocks: sum_b s[b] (q_b . x_b) */
static float fdot_q8b(const int8_t *q, const float *s, const float *x, int64_t nb) {
    __m256 t0 = _mm256_setzero_ps(), t1 = t0;
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *qb = q + 32 * b;
        const float *xb = x + 32 * b;
        __m256 a = _mm256_mul_ps(i8x8(qb), _mm256_loadu_ps(xb));
        __m256 c = _mm256_mul_ps(i8x8(qb + 8), _mm256_loadu_ps(xb + 8));
        a = _mm256_fmadd_ps(i8x8(qb + 16), _mm256_loadu_ps(xb + 16), a);
        c = _mm256_fmadd_ps(i8x8(qb + 24), _mm256_loadu_ps(xb + 24), c);
        __m256 sv = _mm256_set1_ps(s[b]);
        if (b & 1) t1 = _mm256_fmadd_ps(sv, _mm256_add_ps(a, c), t1);
        else t0 = _mm256_fmadd_ps(sv, _mm256_add_ps(a, c), t0);
    }
    return hsum8(_mm256_add_ps(t0, t1));
}

/* int4 groups of 32 (w = d q + m): sum_g d[g] (q_g . x_g) + m[g] xsum[g] */
static float fdot_q4g32(const uint8_t *p, const float *d, const float *m, const float *x, const float *xsum, int64_t ng) {
    __m256 t0 = _mm256_setzero_ps(), t1 = t0;
    float msum = 0.0f;
    for (int64_t g = 0; g < ng; g++) {
        __m256 q[4];
        const float *xg = x + 32 * g;
        q4_lanes(p + 16 * g, q);
        __m256 a = _mm256_mul_ps(q[0], _mm256_loadu_ps(xg)), c = _mm256_mul_ps(q[1], _mm256_loadu_ps(xg + 8));
        a = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xg + 16), a);
        c = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xg + 24), c);
        __m256 dv = _mm256_set1_ps(d[g]);
        if (g & 1) t1 = _mm256_fmadd_ps(dv, _mm256_add_ps(a, c), t1);
        else t0 = _mm256_fmadd_ps(dv, _mm256_add_ps(a, c), t0);
        msum += m[g] * xsum[g];
    }
    return hsum8(_mm256_add_ps(t0, t1)) + msum;
}
#endif

/* out[t * os] = W[r] . x[t] for t < T (x rows xs apart; xsum [T][cols / 32]: group sums for int4 g32).
 * buf: cols + cols / 16 floats of scratch (a dequantized row, or a row's widened scales). */
static void fdot_row_tokens(const tdm_weight *w, int64_t r, int64_t T, const float *x, int64_t xs, const float *xsum,
                            float *out, int64_t os, float *buf) {
    int64_t cols = w->cols, ss = w->scale_stride, kind = w->kind;
    const uint8_t *row = w->data + r * w->row_bytes;
#ifdef TDM_SIMD
    int64_t ng = cols / 32;
    if (kind == KIND_F32 || kind == KIND_F16 || kind == KIND_I8) {
        for (int64_t t = 0; t < T; t++) {
            const float *xt = x + t * xs;
            out[t * os] = kind == KIND_F32 ? fdot_f32((const float *)row, xt, cols)
                        : kind == KIND_F16 ? fdot_f16((const uint16_t *)row, xt, cols)
                        : fdot_i8((const int8_t *)row, xt, cols) * w->scale[r * ss];
        }
        return;
    }
    if (kind == KIND_I8B || kind == KIND_I8H) {
        const float *s = w->scale + r * ss;
        if (kind == KIND_I8H) f16_row((const uint16_t *)w->scale + r * ss, ng, buf), s = buf;
        for (int64_t t = 0; t < T; t++) out[t * os] = fdot_q8b((const int8_t *)row, s, x + t * xs, ng);
        return;
    }
    if ((kind == KIND_I4 && w->group == 32) || kind == KIND_I4H || kind == KIND_Q4K) {
        const float *d = w->scale + r * ss, *m = w->minimum + r * ss;
        if (kind != KIND_I4) expand_scales(w, r, 1, buf, buf + ng), d = buf, m = buf + ng;
        for (int64_t t = 0; t < T; t++) out[t * os] = fdot_q4g32(row, d, m, x + t * xs, xsum + t * ng, ng);
        return;
    }
#endif
    tdm_dequantize_rows(w, r, 1, buf); /* the rest (int4 groups of 64; every format without AVX2) */
    for (int64_t t = 0; t < T; t++) out[t * os] = fdot_f32(buf, x + t * xs, cols);
}

static int64_t module_scratch(const tdm_weight *w) { return w->cols + w->cols / 16 + 16; }

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
        for (int64_t j = lo; j < hi && buf; j++)
            fdot_row_tokens(w, rows ? rows[j] : j, T, x, w->cols, xsum, y + j, n, buf);
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
            for (int64_t j = 0; j < len && up; j++) {
                int64_t i = rows ? rows[lo + j] : lo + j;
                fdot_row_tokens(up, i, T, x, in, xsum, hu + j, len + 1, buf);
                if (gate) fdot_row_tokens(gate, i, T, x, in, xsum, hg + j, len + 1, buf);
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
