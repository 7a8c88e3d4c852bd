/* Float-activation row dot products of the module path (module.h): one weight row with one token or a
 * few, over every packed format, with x as float32 (no Q8 quantization, unlike the decode step's rows.h
 * kernels). Four FMA chains per row (FMA latency, not throughput, bounds one chain); several tokens share
 * the widened weights (int8 pairs, int4 rows dequantized once); one token over int8 rows goes four rows
 * at a time. Included by module.h only. */
#ifndef TANDEM_FDOT_H
#define TANDEM_FDOT_H
#include <stdint.h>

/* ----- float dot products of one weight row with one token (four FMA chains: FMA latency, not
 * throughput, bounds one chain) ----- */
#ifdef TDM_SIMD
static inline __m256 i8x8(const int8_t *q) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q))); }
static inline __m256 f16x8(const uint16_t *h) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h)); }

#define TDM_FDOT(NAME, T, LOAD8, SCALAR)                                                               \
    static float NAME(const T *w, const float *x, int64_t n) {                                          \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                                     \
        int64_t k = 0;                                                                                  \
        for (; k + 32 <= n; k += 32) {                                                                  \
            a0 = _mm256_fmadd_ps(LOAD8(w + k), _mm256_loadu_ps(x + k), a0);                             \
            a1 = _mm256_fmadd_ps(LOAD8(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);                     \
            a2 = _mm256_fmadd_ps(LOAD8(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);                   \
            a3 = _mm256_fmadd_ps(LOAD8(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);                   \
        }                                                                                               \
        for (; k + 8 <= n; k += 8) a0 = _mm256_fmadd_ps(LOAD8(w + k), _mm256_loadu_ps(x + k), a0);      \
        float s = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));                   \
        for (; k < n; k++) s += SCALAR(w[k]) * x[k];                                                    \
        return s;                                                                                       \
    }
#define TDM_AS_FLOAT(v) ((float)(v))
TDM_FDOT(fdot_f32, float, _mm256_loadu_ps, TDM_AS_FLOAT)
TDM_FDOT(fdot_f16, uint16_t, f16x8, f16_value)
TDM_FDOT(fdot_i8, int8_t, i8x8, TDM_AS_FLOAT) /* per-row int8: times the row scale by the caller */
#undef TDM_AS_FLOAT
#undef TDM_FDOT

/* per-row int8 for two tokens: each 8 weights widened once for both (four chains per token) */
static void fdot_i8_pair(const int8_t *q, const float *x0, const float *x1, int64_t n, float *o0, float *o1) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) {
        __m256 w0 = i8x8(q + k), w1 = i8x8(q + k + 8);
        a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x0 + k), a0);
        a1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x0 + k + 8), a1);
        b0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x1 + k), b0);
        b1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x1 + k + 8), b1);
    }
    for (; k + 8 <= n; k += 8) {
        __m256 w0 = i8x8(q + k);
        a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x0 + k), a0);
        b0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x1 + k), b0);
    }
    float s0 = hsum8(_mm256_add_ps(a0, a1)), s1 = hsum8(_mm256_add_ps(b0, b1));
    for (; k < n; k++) s0 += (float)q[k] * x0[k], s1 += (float)q[k] * x1[k];
    *o0 = s0, *o1 = s1;
}
#else
static float fdot_f32(const float *restrict w, const float *restrict x, int64_t n) {
    float s = 0.0f;
    for (int64_t k = 0; k < n; k++) s += w[k] * x[k];
    return s;
}
#endif

#ifdef TDM_SIMD
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

/* the 32 codes of a group of 32 as four float vectors in element order (q4_lanes of blocks.h with two
 * widening loads instead of four register shuffles: byte j holds element j low, element 16 + j high) */
static inline void q4_lanes_ld(const uint8_t *p, __m256 out[4]) {
    __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));       /* bytes 0..7 */
    __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))); /* bytes 8..15 */
    const __m256i low = _mm256_set1_epi32(15);
    out[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b0, low));
    out[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b1, low));
    out[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
    out[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
}

/* int4 groups of 32 (w = d q + m): sum_g d[g] (q_g . x_g) + m[g] xsum[g] */
static float fdot_q4g32(const uint8_t *p, const float *d, const float *m, const float *x, const float *xsum, int64_t ng) {
    __m256 t0 = _mm256_setzero_ps(), t1 = t0;
    float msum = 0.0f;
    for (int64_t g = 0; g < ng; g++) {
        __m256 q[4];
        const float *xg = x + 32 * g;
        q4_lanes_ld(p + 16 * g, q);
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
    int64_t cols = w->cols;
#ifdef TDM_SIMD
    int64_t ss = w->scale_stride, kind = w->kind, ng = cols / 32;
    const uint8_t *row = w->data + r * w->row_bytes;
    if (kind == KIND_I8 && T > 1) { /* tokens in pairs: the widened weights shared */
        float sc = w->scale[r * ss], o0, o1;
        int64_t t = 0;
        for (; t + 2 <= T; t += 2) {
            fdot_i8_pair((const int8_t *)row, x + t * xs, x + (t + 1) * xs, cols, &o0, &o1);
            out[t * os] = o0 * sc, out[(t + 1) * os] = o1 * sc;
        }
        if (t < T) out[t * os] = fdot_i8((const int8_t *)row, x + t * xs, cols) * sc;
        return;
    }
    if (T > 1 && ((kind == KIND_I4 && w->group == 32) || kind == KIND_I4H || kind == KIND_Q4K)) {
        float *row_f = buf; /* several tokens: the row as float once (scales behind it), then float dots */
        const float *d = w->scale + r * ss, *m = w->minimum + r * ss;
        if (kind != KIND_I4) expand_scales(w, r, 1, buf + cols, buf + cols + ng), d = buf + cols, m = d + ng;
        for (int64_t g = 0; g < ng; g++) {
            __m256 q[4], dv = _mm256_set1_ps(d[g]), mv = _mm256_set1_ps(m[g]);
            q4_lanes_ld(row + 16 * g, q);
            for (int l = 0; l < 4; l++) _mm256_storeu_ps(row_f + 32 * g + 8 * l, _mm256_fmadd_ps(dv, q[l], mv));
        }
        for (int64_t t = 0; t < T; t++) out[t * os] = fdot_f32(row_f, x + t * xs, cols);
        return;
    }
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
#else
    (void)xsum;
#endif
    tdm_dequantize_rows(w, r, 1, buf); /* the rest (int4 groups of 64; every format without AVX2) */
    for (int64_t t = 0; t < T; t++) out[t * os] = fdot_f32(buf, x + t * xs, cols);
}

#ifdef TDM_SIMD
/* out[k] = W[r[k]] . x for four rows of per-row int8 (KIND_I8) or Q8_0 blocks (KIND_I8B / KIND_I8H), one
 * token: x loaded once for the four rows, one reduction for the four sums */
static void fdot4_i8(const tdm_weight *w, const int64_t r[4], const float *x, float *out) {
    int64_t n = w->cols, ss = w->scale_stride;
    const int8_t *q[4];
    for (int k = 0; k < 4; k++) q[k] = (const int8_t *)(w->data + r[k] * w->row_bytes);
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    if (w->kind == KIND_I8) {
        int64_t c = 0;
        for (; c + 8 <= n; c += 8) {
            __m256 xv = _mm256_loadu_ps(x + c);
            for (int k = 0; k < 4; k++) a[k] = _mm256_fmadd_ps(i8x8(q[k] + c), xv, a[k]);
        }
        _mm_storeu_ps(out, hsum4x8(a[0], a[1], a[2], a[3]));
        for (int k = 0; k < 4; k++) {
            for (int64_t cc = c; cc < n; cc++) out[k] += (float)q[k][cc] * x[cc];
            out[k] *= w->scale[r[k] * ss];
        }
        return;
    }
    int64_t nb = n / 32;
    float sx[4 * nb]; /* the four rows' block scales as float32 (f16 widened once: exact) */
    const float *sk[4];
    for (int k = 0; k < 4; k++) {
        if (w->kind == KIND_I8B) sk[k] = w->scale + r[k] * ss;
        else f16_row((const uint16_t *)w->scale + r[k] * ss, nb, sx + k * nb), sk[k] = sx + k * nb;
    }
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + 32 * b;
        __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8), x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);
        for (int k = 0; k < 4; k++) {
            const int8_t *qb = q[k] + 32 * b;
            __m256 e = _mm256_fmadd_ps(i8x8(qb + 16), x2, _mm256_mul_ps(i8x8(qb), x0));
            __m256 o = _mm256_fmadd_ps(i8x8(qb + 24), x3, _mm256_mul_ps(i8x8(qb + 8), x1));
            a[k] = _mm256_fmadd_ps(_mm256_broadcast_ss(sk[k] + b), _mm256_add_ps(e, o), a[k]);
        }
    }
    _mm_storeu_ps(out, hsum4x8(a[0], a[1], a[2], a[3]));
}
#endif

/* out[t * os + j] = W[row j] . x[t] for j < n (row j: rows[j], or r0 + j when rows is NULL) */
static void fdot_rows(const tdm_weight *w, const int64_t *rows, int64_t r0, int64_t n, int64_t T, const float *x,
                      int64_t xs, const float *xsum, float *out, int64_t os, float *buf) {
    int64_t j = 0;
#ifdef TDM_SIMD
    if (T == 1 && (w->kind == KIND_I8 || w->kind == KIND_I8B || w->kind == KIND_I8H))
        for (; j + 4 <= n; j += 4) {
            int64_t r4[4];
            for (int k = 0; k < 4; k++) r4[k] = rows ? rows[j + k] : r0 + j + k;
            fdot4_i8(w, r4, x, out + j);
        }
#endif
    for (; j < n; j++) fdot_row_tokens(w, rows ? rows[j] : r0 + j, T, x, xs, xsum, out + j, os, buf);
}

#endif
