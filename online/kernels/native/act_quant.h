/* Activation quantization of the decode step's matrix inputs (included by rows.h, after qvec): int8 codes
 * per block of 32 with the exact block sums, a second int8 residual on outlier blocks; the vector path
 * quantizes eight blocks at a time, bit-identical to the scalar loop. */
#ifndef TANDEM_ACT_QUANT_H
#define TANDEM_ACT_QUANT_H

#ifdef TDM_SIMD
/* 8x8 floats transposed in registers: r[k] lane j = the k-th float of row j */
static inline void transpose8x8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int j = 0; j < 8; j += 2) {
        t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
        t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
    }
    for (int j = 0; j < 8; j += 4) {
        u[j] = _mm256_shuffle_ps(t[j], t[j + 2], 0x44);
        u[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], 0xEE);
        u[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0x44);
        u[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0xEE);
    }
    for (int j = 0; j < 4; j++) {
        r[j] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x20);
        r[j + 4] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x31);
    }
}

/* eight products x * inv rounded to int32 as (int8_t)lrintf does: a block whose amax is so small that 127 / amax
 * overflows (below ~3.7e-37: denormals, or an inf / NaN in the block) gives inf or NaN products, which
 * vcvtps2dq turns into INT32_MIN and the saturating packs into -128, where lrintf's 64-bit result keeps a zero
 * low byte: those lanes are set to 0. Real codes are within +-127, never INT32_MIN. */
static inline __m256i codes8(__m256 v) {
    __m256i c = _mm256_cvtps_epi32(v);
    return _mm256_andnot_si256(_mm256_cmpeq_epi32(c, _mm256_set1_epi32(INT32_MIN)), c);
}

/* quantize_q8's first pass for blocks [b0, b0 + 8): each block's max |x|, its codes, d and the exact block
 * sum, bit-identical to the scalar loop (lane j sums block j's 32 floats in order from 0.0f; the codes are
 * the same products x * (127 / amax) rounded to nearest even, as lrintf in the default mode) */
static inline void quantize_blocks8(const float *restrict x, int64_t b0, qvec *out) {
    const float *xb = x + b0 * QB;
    __m256 sum = _mm256_setzero_ps(), amax = _mm256_setzero_ps(), sign = _mm256_set1_ps(-0.0f);
    for (int c = 0; c < QB; c += 8) {
        __m256 r[8];
        for (int j = 0; j < 8; j++) r[j] = _mm256_loadu_ps(xb + j * QB + c);
        transpose8x8(r);
        for (int k = 0; k < 8; k++) {
            sum = _mm256_add_ps(sum, r[k]);
            amax = _mm256_max_ps(_mm256_andnot_ps(sign, r[k]), amax); /* NaN |x|: amax kept, as a > amax ? a : amax */
        }
    }
    __m256 pos = _mm256_cmp_ps(amax, _mm256_setzero_ps(), _CMP_GT_OQ);
    __m256 inv = _mm256_and_ps(pos, _mm256_div_ps(_mm256_set1_ps(127.0f), amax));
    _mm256_storeu_ps(out->d + b0, _mm256_div_ps(amax, _mm256_set1_ps(127.0f)));
    _mm256_storeu_ps(out->s + b0, sum);
    float iv[8];
    _mm256_storeu_ps(iv, inv);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int j = 0; j < 8; j++) {
        __m256 f = _mm256_set1_ps(iv[j]);
        const float *xj = xb + j * QB;
        __m256i a = codes8(_mm256_mul_ps(_mm256_loadu_ps(xj), f));
        __m256i b = codes8(_mm256_mul_ps(_mm256_loadu_ps(xj + 8), f));
        __m256i c = codes8(_mm256_mul_ps(_mm256_loadu_ps(xj + 16), f));
        __m256i e = codes8(_mm256_mul_ps(_mm256_loadu_ps(xj + 24), f));
        __m256i q = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, e));
        _mm256_storeu_si256((__m256i *)(out->q + (b0 + j) * QB), _mm256_permutevar8x32_epi32(q, order));
    }
}
#endif

/* x [n] (n % 32 == 0) -> int8 codes per block of 32 (scale d = max|x| / 127) and exact block sums.
 * Blocks whose scale exceeds residual_ratio x the mean scale (outlier channels: SmolLM2's residual
 * stream has a few) also get their rounding residual quantized (scale d / 254): ~15 bits there.
 * residual_ratio 0: every block; < 0: none. */
static void quantize_q8(const float *restrict x, int64_t n, qvec *out, float residual_ratio) {
    int64_t nb = n / QB, b = 0;
    float mean_d = 0.0f;
#ifdef TDM_SIMD
    for (; b + 8 <= nb; b += 8) quantize_blocks8(x, b, out);
    for (int64_t j = 0; j < b; j++) mean_d += out->d[j];
#endif
    for (; b < nb; b++) {
        const float *xb = x + b * QB;
        float amax = 0.0f, sum = 0.0f;
        for (int k = 0; k < QB; k++) {
            float a = fabsf(xb[k]);
            amax = a > amax ? a : amax;
            sum += xb[k];
        }
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int k = 0; k < QB; k++) out->q[b * QB + k] = (int8_t)lrintf(xb[k] * inv);
        out->d[b] = amax / 127.0f;
        out->s[b] = sum;
        mean_d += out->d[b];
    }
    mean_d /= (float)(nb > 0 ? nb : 1);
    out->n_flagged = 0;
    for (int64_t b = 0; b < nb; b++) {
        float d = out->d[b];
        if (residual_ratio < 0.0f || d <= residual_ratio * mean_d || d == 0.0f) {
            out->dr[b] = 0.0f;
            continue;
        }
        out->flagged[out->n_flagged++] = (int32_t)b;
        float dr = d / 254.0f, inv = 254.0f / d;
        for (int k = 0; k < QB; k++) {
            float rest = x[b * QB + k] - d * (float)out->q[b * QB + k];
            out->r[b * QB + k] = (int8_t)lrintf(rest * inv);
        }
        out->dr[b] = dr;
    }
}

/* Self-check entry (tests/test_fused_decode.py): quantize_q8 of x [n] into q [n], r [n], d / dr / s [n / 32];
 * returns the number of flagged blocks */
int64_t tdm_quantize_q8(const float *x, int64_t n, double residual_ratio, int8_t *q, int8_t *r, float *d, float *dr,
                        float *s) {
    int32_t flagged[n / QB + 1];
    qvec v = {x, q, r, d, dr, s, flagged, 0};
    quantize_q8(x, n, &v, (float)residual_ratio);
    return v.n_flagged;
}

#endif
