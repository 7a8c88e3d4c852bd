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

/* scores[s] = scale * q . K[s] for s in [start, end) */
static void key_scores(const float *q, const float *K, int64_t start, int64_t end, int64_t hd, float scale,
                       float *scores) {
    int64_t s = start;
#ifdef TDM_SIMD
    if (hd % 8 == 0) {
        __m256 vs = _mm256_set1_ps(scale);
        for (; s + 8 <= end; s += 8) {
            __m256 acc[8];
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
                        const float *q, float *out, float *scores) {
    key_scores(q, K, start, pos + 1, hd, scale, scores);
    float mx = -INFINITY;
    for (int64_t s = start; s <= pos; s++) mx = scores[s] > mx ? scores[s] : mx;
    float sum = 0.0f;
    for (int64_t s = start; s <= pos; s++) {
        scores[s] = expf(scores[s] - mx);
        sum += scores[s];
    }
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
