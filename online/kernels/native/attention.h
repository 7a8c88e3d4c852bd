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
/* the reduction's constants and the polynomial's coefficients, highest degree first (exp8_via_double in
 * attention_wide.h runs the same operations on eight lanes) */
#define EXP_LOG2E 1.4426950408889634
#define EXP_LN2_HI 6.93147180369123816490e-01
#define EXP_LN2_LO 1.90821492927058770002e-10
static const double exp_poly[11] = {1.0 / 3628800.0, 1.0 / 362880.0, 1.0 / 40320.0, 1.0 / 5040.0, 1.0 / 720.0,
                                    1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0};

/* e^x for four floats, computed in double and rounded once: x - n ln2 (Cody-Waite split, exact for the
 * |n| <= 150 here), a degree-10 Taylor polynomial on |r| <= ln2 / 2 (relative error < 1e-12, far below
 * float's half ulp), times 2^n. So the result is the correctly rounded e^x, as glibc's expf (0.502 ulp)
 * gives too except near rounding midpoints: 0.06% of inputs in [-100, 0] differ from expf by one ulp.
 * x is clamped to [-104, 89]: below, e^x rounds to 0 in float; above, to inf. */
static inline __m128 exp4_via_double(__m128 xf) {
    __m256d x = _mm256_min_pd(_mm256_max_pd(_mm256_cvtps_pd(xf), _mm256_set1_pd(-104.0)), _mm256_set1_pd(89.0));
    __m256d n = _mm256_round_pd(_mm256_mul_pd(x, _mm256_set1_pd(EXP_LOG2E)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256d r = _mm256_sub_pd(x, _mm256_mul_pd(n, _mm256_set1_pd(EXP_LN2_HI)));
    r = _mm256_sub_pd(r, _mm256_mul_pd(n, _mm256_set1_pd(EXP_LN2_LO)));
    __m256d p = _mm256_set1_pd(exp_poly[0]);
    for (int i = 1; i < 11; i++) p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(exp_poly[i]));
    __m256i e = _mm256_cvtepi32_epi64(_mm256_cvtpd_epi32(n)); /* 2^n as a double's exponent field */
    e = _mm256_slli_epi64(_mm256_add_epi64(e, _mm256_set1_epi64x(1023)), 52);
    return _mm256_cvtpd_ps(_mm256_mul_pd(p, _mm256_castsi256_pd(e)));
}
#endif

#include "attention_wide.h" /* the kernels below on 512-bit vectors where the build has them, same bits */

/* scores[start..pos] = e^(scores - their max), the max at *max_out (when not NULL). The exponentials go four at
 * a time through exp4_via_double (eight through attention_wide.h's exp8_via_double), the tail padded (so a
 * value never depends on its lane): a libm expf call per key cost about as much as the key's q.k and value
 * row together. The max is taken eight at a time: exact whatever the order, and a NaN score is passed over as
 * the scalar compare does (the key-by-key compare was a dependent chain). */
static void softmax_exps(float *scores, int64_t start, int64_t pos, float *max_out) {
    float mx = -INFINITY;
    int64_t s = start;
#ifdef TDM_SIMD
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    for (; s + 8 <= pos + 1; s += 8) m8 = _mm256_max_ps(_mm256_loadu_ps(scores + s), m8); /* NaN: keeps m8 */
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    mx = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
#endif
    for (; s <= pos; s++) mx = scores[s] > mx ? scores[s] : mx;
    if (max_out) *max_out = mx;
#ifdef TDM_SIMD
    __m128 vm = _mm_set1_ps(mx);
    s = start;
#ifdef TDM_WIDE_ATTENTION
    __m256 vm8 = _mm256_set1_ps(mx);
    for (; s + 8 <= pos + 1; s += 8)
        _mm256_storeu_ps(scores + s, exp8_via_double(_mm256_sub_ps(_mm256_loadu_ps(scores + s), vm8)));
#endif
    for (; s + 4 <= pos + 1; s += 4)
        _mm_storeu_ps(scores + s, exp4_via_double(_mm_sub_ps(_mm_loadu_ps(scores + s), vm)));
    if (s <= pos) {
        float tail[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int64_t j = s; j <= pos; j++) tail[j - s] = scores[j];
        _mm_storeu_ps(tail, exp4_via_double(_mm_sub_ps(_mm_loadu_ps(tail), vm)));
        for (int64_t j = s; j <= pos; j++) scores[j] = tail[j - s];
    }
#else
    for (s = start; s <= pos; s++) scores[s] = expf(scores[s] - mx);
#endif
}

/* softmax_exps, returning the sum of the exponentials in key order */
static float softmax_exp(float *scores, int64_t start, int64_t pos, float *max_out) {
    float sum = 0.0f;
    softmax_exps(scores, start, pos, max_out);
    for (int64_t j = start; j <= pos; j++) sum += scores[j];
    return sum;
}

/* Query heads attended together: the heads of one KV group that one thread takes, up to TDM_MAX_GROUP */
#define TDM_MAX_GROUP 16

/* KV rows are float32, or float16 where the model says so (tdm_model.kv_half: half the bytes a token's
 * attention reads; F16C widens them on load, stores round to nearest even as numpy's float16 does) */
static inline uint16_t f16_bits(float f) {
#ifdef TDM_SIMD
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) return (uint16_t)(sign | 0x7E00u);  /* NaN */
    if (ax >= 0x47800000u) return (uint16_t)(sign | 0x7C00u); /* >= 65536 (and inf): inf */
    if (ax < 0x38800000u)                                      /* below 2^-14: a subnormal half (or 0) */
        return (uint16_t)(sign | (uint32_t)nearbyintf(fabsf(f) * 16777216.0f));
    uint32_t r = ax - 0x38000000u; /* exponent rebiased 127 -> 15; the carry of rounding may reach inf */
    return (uint16_t)(sign | ((r + 0xFFFu + ((r >> 13) & 1u)) >> 13));
#endif
}

/* bytes of one head's K or V row (float16 where ``half``) */
static inline int64_t kv_row_bytes(int64_t hd, int half) { return hd * (half ? 2 : 4); }

/* row ``row`` of a KV cache block X (float16 where ``half``) */
static inline void *kv_at(void *X, int64_t row, int64_t hd, int half) {
    return (char *)X + row * kv_row_bytes(hd, half);
}

/* the K (or V) row of position s: rows[s] in a paged pool (batch.h), s in a contiguous cache (rows NULL) */
static inline const char *kv_row(const void *X, const int32_t *rows, int64_t s, int64_t hd, int half) {
    return kv_at((void *)X, rows ? (int64_t)rows[s] : s, hd, half);
}

static inline float kv_value(const char *row, int64_t c, int half) {
    return half ? f16_value(((const uint16_t *)row)[c]) : ((const float *)row)[c];
}

/* one head's k or v row v [hd] into the cache at dst */
static inline void kv_store(void *dst, const float *v, int64_t hd, int half) {
    if (!half) {
        memcpy(dst, v, 4 * hd);
        return;
    }
    uint16_t *o = (uint16_t *)dst;
    int64_t c = 0;
#ifdef TDM_SIMD
    for (; c + 8 <= hd; c += 8)
        _mm_storeu_si128((__m128i *)(o + c), _mm256_cvtps_ph(_mm256_loadu_ps(v + c), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; c < hd; c++) o[c] = f16_bits(v[c]);
}

#ifdef TDM_SIMD
static inline __m256 kv_load8(const char *row, int64_t c, int half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + c)))
                : _mm256_loadu_ps((const float *)row + c);
}

/* the rows of positions [s, e) of X on their way to L2 */
static inline void fetch_rows(const void *X, const int32_t *rows, int64_t s, int64_t e, int64_t hd, int half) {
    int64_t row_bytes = kv_row_bytes(hd, half);
    for (; s < e; s++)
        for (int64_t c = 0; c < row_bytes; c += 64) _mm_prefetch(kv_row(X, rows, s, hd, half) + c, _MM_HINT_T1);
}
#endif

/* scores[j * span + s] = scale * q_j . K[s] for the n_q heads q_j = q + j * hd, s in [start, end): eight keys at
 * a time for every head while they are in L1. Meanwhile the V rows of each block go toward L2 (the value
 * pass then finds them there), and paged K rows a block ahead (their 4 KiB blocks are scattered, so the
 * hardware's stream prefetchers restart at each one; a contiguous cache streams by itself). */
static inline __attribute__((always_inline)) void key_scores_of(
    const float *q, int64_t n_q, const void *K, const void *V, const int32_t *rows, int64_t start, int64_t end,
    int64_t hd, float scale, float *scores, int64_t span, const int half) {
    int64_t s = start;
#ifdef TDM_SIMD
    if (hd % 8 == 0) {
        __m256 vs = _mm256_set1_ps(scale);
        if (rows) fetch_rows(K, rows, s, s + 8 < end ? s + 8 : end, hd, half); /* all lines of the first block at once */
        for (; s + 8 <= end; s += 8) {
            const char *k[8];
            for (int j = 0; j < 8; j++) k[j] = kv_row(K, rows, s + j, hd, half);
            if (rows) fetch_rows(K, rows, s + 8, s + 16 < end ? s + 16 : end, hd, half);
            fetch_rows(V, rows, s, s + 8, hd, half);
#ifdef TDM_WIDE_ATTENTION
            key_block_heads(q, n_q, k, hd, vs, scores + s, span, half);
#else
            for (int64_t h = 0; h < n_q; h++) {
                __m256 acc[8];
                for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
                for (int64_t c = 0; c < hd; c += 8) {
                    __m256 qc = _mm256_loadu_ps(q + h * hd + c);
                    for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(qc, kv_load8(k[j], c, half), acc[j]);
                }
                _mm256_storeu_ps(scores + h * span + s, _mm256_mul_ps(hsum8x8(acc), vs));
            }
#endif
        }
    }
#else
    (void)V;
#endif
    for (; s < end; s++)
        for (int64_t h = 0; h < n_q; h++) {
            const char *k = kv_row(K, rows, s, hd, half);
            float acc = 0.0f;
            if (!half) acc = dot_f32(q + h * hd, (const float *)k, hd);
            else
                for (int64_t c = 0; c < hd; c++) acc += q[h * hd + c] * kv_value(k, c, half);
            scores[h * span + s] = acc * scale;
        }
}

static void key_scores(const float *q, int64_t n_q, const void *K, const void *V, const int32_t *rows,
                       int64_t start, int64_t end, int64_t hd, float scale, float *scores, int64_t span, int half) {
    if (half) key_scores_of(q, n_q, K, V, rows, start, end, hd, scale, scores, span, 1);
    else key_scores_of(q, n_q, K, V, rows, start, end, hd, scale, scores, span, 0);
}

#include "attention_values.h" /* values_of */

#include "attend_parts.h" /* one token's heads over parts of its context, split between threads */

#endif
