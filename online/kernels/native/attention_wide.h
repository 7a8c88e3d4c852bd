/* Attention's kernels on 512-bit vectors (AVX-512F), each lane's arithmetic that of attention.h's 8-wide
 * code: the same operations on the same values in the same order, so a build with AVX-512 computes the same bits
 * as one without (tests/test_attention_wide.py compares the two builds) in fewer instructions:
 *  - keys: two keys share a vector (lanes 0-7 key j's eight columns, 8-15 key j + 1's), each pair widened once
 *    per eight columns for up to four heads at a time (the 8-wide code widens every key for every head);
 *  - values (attention_values.h's values_of): sixteen columns a vector;
 *  - exponentials: eight lanes of doubles.
 * With attention_values.h's pass, one thread, SmolLM2's 3 KV heads x 3 query heads over 1,900 float16 positions:
 * 162 -> 105 us (bench/RESULTS.md, twentieth session). Included by attention.h only. */
#ifndef TANDEM_ATTENTION_WIDE_H
#define TANDEM_ATTENTION_WIDE_H
#ifdef TDM_WIDE_ATTENTION /* rows.h: AVX-512F, unless -DTDM_NO_WIDE_ATTENTION */

/* exp4_via_double on eight lanes (the same double operations, lane by lane) */
static inline __m256 exp8_via_double(__m256 xf) {
    __m512d x = _mm512_min_pd(_mm512_max_pd(_mm512_cvtps_pd(xf), _mm512_set1_pd(-104.0)), _mm512_set1_pd(89.0));
    __m512d n = _mm512_roundscale_pd(_mm512_mul_pd(x, _mm512_set1_pd(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512d r = _mm512_sub_pd(x, _mm512_mul_pd(n, _mm512_set1_pd(EXP_LN2_HI)));
    r = _mm512_sub_pd(r, _mm512_mul_pd(n, _mm512_set1_pd(EXP_LN2_LO)));
    __m512d p = _mm512_set1_pd(exp_poly[0]);
    for (int i = 1; i < 11; i++) p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(exp_poly[i]));
    __m512i e = _mm512_cvtepi32_epi64(_mm512_cvtpd_epi32(n)); /* 2^n as a double's exponent field */
    e = _mm512_slli_epi64(_mm512_add_epi64(e, _mm512_set1_epi64(1023)), 52);
    return _mm512_cvtpd_ps(_mm512_mul_pd(p, _mm512_castsi512_pd(e)));
}

/* columns [c, c + 8) of rows a (lanes 0-7) and b (lanes 8-15) */
static inline __m512 kv_load8x2(const char *a, const char *b, int64_t c, int half) {
    if (half)
        return _mm512_cvtph_ps(_mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)((const uint16_t *)a + c))),
            _mm_loadu_si128((const __m128i *)((const uint16_t *)b + c)), 1));
    __m256d lo = _mm256_castps_pd(_mm256_loadu_ps((const float *)a + c));
    __m256d hi = _mm256_castps_pd(_mm256_loadu_ps((const float *)b + c));
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(lo), hi, 1));
}

/* columns [c, c + 16) of one row */
static inline __m512 kv_load16(const char *row, int64_t c, int half) {
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + c)))
                : _mm512_loadu_ps((const float *)row + c);
}

/* scores[h * span + s + j] = scale * q_h . k[j] for the eight keys k[0..7] and the NH heads q + h * hd: per head
 * and key, fma over the columns eight at a time, then hsum8x8 over the eight keys (attention.h's order) */
static inline __attribute__((always_inline)) void key_block_wide(const float *q, int NH, const char *const *k,
                                                                 int64_t hd, __m256 vs, float *scores, int64_t span,
                                                                 int half) {
    __m512 acc[4][4]; /* [head][key pair] */
    for (int h = 0; h < NH; h++)
        for (int j = 0; j < 4; j++) acc[h][j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < hd; c += 8) {
        __m512 kp[4];
        for (int j = 0; j < 4; j++) kp[j] = kv_load8x2(k[2 * j], k[2 * j + 1], c, half);
        for (int h = 0; h < NH; h++) {
            __m512 qc = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(q + h * hd + c))));
            for (int j = 0; j < 4; j++) acc[h][j] = _mm512_fmadd_ps(qc, kp[j], acc[h][j]);
        }
    }
    for (int h = 0; h < NH; h++) {
        __m256 a[8];
        for (int j = 0; j < 4; j++) {
            a[2 * j] = _mm512_castps512_ps256(acc[h][j]);
            a[2 * j + 1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[h][j]), 1));
        }
        _mm256_storeu_ps(scores + h * span, _mm256_mul_ps(hsum8x8(a), vs));
    }
}

/* key_block_wide for n_q heads, four at a time */
static inline __attribute__((always_inline)) void key_block_heads(const float *q, int64_t n_q, const char *const *k,
                                                                  int64_t hd, __m256 vs, float *scores, int64_t span,
                                                                  int half) {
    int64_t h = 0;
    for (; h + 4 <= n_q; h += 4) key_block_wide(q + h * hd, 4, k, hd, vs, scores + h * span, span, half);
    if (n_q - h == 3) key_block_wide(q + h * hd, 3, k, hd, vs, scores + h * span, span, half);
    else if (n_q - h == 2) key_block_wide(q + h * hd, 2, k, hd, vs, scores + h * span, span, half);
    else if (n_q - h == 1) key_block_wide(q + h * hd, 1, k, hd, vs, scores + h * span, span, half);
}

#endif
#endif
