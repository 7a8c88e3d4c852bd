/* Attention pieces of the decode step for one query token: rotary embedding (rotate-half) and
 * softmax attention over the cached keys/values of one head. Included by decode.c only. */
#ifndef TANDEM_ATTENTION_H
#define TANDEM_ATTENTION_H
#include "rows.h"

static void rope_head(float *v, const float *c, const float *s, int64_t hd) {
    int64_t half = hd / 2;
    for (int64_t i = 0; i < half; i++) {
        float a = v[i], b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i + half] + a * s[i + half];
    }
}

#ifdef TDM_SIMD
/* the 8 horizontal sums of a[0..7], in order */
static inline __m256 hsum8x8(const __m256 *a) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

#ifdef TDM_SIMD
/* e^x for four floats, computed in double and rounded once: x - n ln2 (Cody-Waite split, exact for the
 * |n| <= 150 here), a degree-10 Taylor polynomial on |r| <= ln2 / 2 (relative error < 1e-12, far below
 * float's half ulp), times 2^n. So the result is the correctly rounded e^x, as glibc's expf (0.502 ulp)
 * gives too except near rounding midpoints: 0.06% of inputs in [-100, 0] differ from expf by one ulp.
 * x is clamped to [-104, 89]: below, e^x rounds to 0 in float; above, to inf. */
static inline __m128 exp4_via_double(__m128 xf) {
    __m256d x = _mm256_min_pd(_mm256_max_pd(_mm256_cvtps_pd(xf), _mm256_set1_pd(-104.0)), _mm256_set1_pd(89.0));
    __m256d n = _mm256_round_pd(_mm256_mul_pd(x, _mm256_set1_pd(1.4426950408889634)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256d r = _mm256_sub_pd(x, _mm256_mul_pd(n, _mm256_set1_pd(6.93147180369123816490e-01)));
    r = _mm256_sub_pd(r, _mm256_mul_pd(n, _mm256_set1_pd(1.90821492927058770002e-10)));
    __m256d p = _mm256_set1_pd(1.0 / 3628800.0);
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 362880.0));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 40320.0));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 5040.0));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 720.0));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 120.0));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 24.0));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0 / 6.0));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(0.5));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0));
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0));
    __m256i e = _mm256_cvtepi32_epi64(_mm256_cvtpd_epi32(n)); /* 2^n as a double's exponent field */
    e = _mm256_slli_epi64(_mm256_add_epi64(e, _mm256_set1_epi64x(1023)), 52);
    return _mm256_cvtpd_ps(_mm256_mul_pd(p, _mm256_castsi256_pd(e)));
}
#endif

/* scores[start..pos] = e^(scores - their max), returning their sum (in order, as before). The
 * exponentials go four at a time through exp4_via_double, the tail padded (so a value never depends
 * on its lane): a libm expf call per key cost about as much as the key's q.k and value row together. */
static float softmax_exp(float *scores, int64_t start, int64_t pos) {
    float mx = -INFINITY, sum = 0.0f;
    for (int64_t s = start; s <= pos; s++) mx = scores[s] > mx ? scores[s] : mx;
#ifdef TDM_SIMD
    __m128 vm = _mm_set1_ps(mx);
    int64_t s = start;
    for (; s + 4 <= pos + 1; s += 4) _mm_storeu_ps(scores + s, exp4_via_double(_mm_sub_ps(_mm_loadu_ps(scores + s), vm)));
    if (s <= pos) {
        float tail[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int64_t j = s; j <= pos; j++) tail[j - s] = scores[j];
        _mm_storeu_ps(tail, exp4_via_double(_mm_sub_ps(_mm_loadu_ps(tail), vm)));
        for (int64_t j = s; j <= pos; j++) scores[j] = tail[j - s];
    }
    for (int64_t j = start; j <= pos; j++) sum += scores[j];
#else
    for (int64_t s = start; s <= pos; s++) {
        scores[s] = expf(scores[s] - mx);
        sum += scores[s];
    }
#endif
    return sum;
}

/* scores[s] = scale * q . K[s] for s in [start, end); fetch_v (non-NULL: the first head of a KV group) sends the V
 * rows of each block of keys toward L2 meanwhile, so the value pass that follows does not wait on memory
 * (the K rows stream in order; the V rows would only start streaming when that pass begins) */
static void key_scores(const float *q, const float *K, const float *fetch_v, int64_t start, int64_t end, int64_t hd,
                       float scale, float *scores) {
    int64_t s = start;
#ifdef TDM_SIMD
    if (hd % 8 == 0) {
        __m256 vs = _mm256_set1_ps(scale);
        for (; s + 8 <= end; s += 8) {
            __m256 acc[8];
            if (fetch_v)
                for (int64_t c = 0; c < 8 * hd; c += 16) _mm_prefetch((const char *)(fetch_v + s * hd + c), _MM_HINT_T1);
            for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
            for (int64_t c = 0; c < hd; c += 8) {
                __m256 qc = _mm256_loadu_ps(q + c);
                for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(K + (s + j) * hd + c), acc[j]);
            }
            _mm256_storeu_ps(scores + s, _mm256_mul_ps(hsum8x8(acc), vs));
        }
    }
#endif
    for (; s < end; s++) scores[s] = dot_f32(q, K + s * hd, hd) * scale;
}

/* out [hd] = softmax(scale * q . K[start..pos]) @ V[start..pos] for one query head (K, V: [*, hd]) */
static void attend_head(const float *K, const float *V, int64_t start, int64_t pos, int64_t hd, float scale,
                        const float *q, float *out, float *scores, int fetch) {
    key_scores(q, K, fetch ? V : NULL, start, pos + 1, hd, scale, scores);
    float sum = softmax_exp(scores, start, pos);
    for (int64_t k = 0; k < hd; k++) out[k] = 0.0f;
    for (int64_t s = start; s <= pos; s++) { /* out stays in L1; four keys per pass over it */
        const float *restrict vs = V + s * hd;
        float p = scores[s];
        if (s + 3 <= pos) {
            const float *restrict v1 = vs + hd, *restrict v2 = vs + 2 * hd, *restrict v3 = vs + 3 * hd;
            float p1 = scores[s + 1], p2 = scores[s + 2], p3 = scores[s + 3];
            for (int64_t k = 0; k < hd; k++) out[k] += (p * vs[k] + p1 * v1[k]) + (p2 * v2[k] + p3 * v3[k]);
            s += 3;
        } else {
            for (int64_t k = 0; k < hd; k++) out[k] += p * vs[k];
        }
    }
    float inv = 1.0f / sum;
    for (int64_t k = 0; k < hd; k++) out[k] *= inv;
}

#endif
