/* Row kernels of the decode step: activation quantization, row dot products and row axpys over
 * the packed weight formats (online/kernels/quantize.py). Included by decode.c only. */
#ifndef TANDEM_ROWS_H
#define TANDEM_ROWS_H
#include <math.h>
#include <stdint.h>
#include <string.h>
/* The vector paths need AVX2, FMA and F16C together (every AVX2 CPU Tandem targets has all three);
 * anything less compiles the portable scalar code. */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TDM_SIMD 1
#include <immintrin.h>
/* VNNI's vpdpbusd (AVX512-VNNI with VL, or AVX-VNNI): four u8 x s8 products summed straight into each int32
 * lane. The int8 block dots use it where the CPU has it: their sums are exact integers either way, so both
 * builds give the same bits (tests/test_vnni.py builds the other one and compares). */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TDM_VNNI 1
#define tdm_dpbusd(acc, u8, s8) _mm256_dpbusd_epi32(acc, u8, s8)
#elif defined(__AVXVNNI__)
#define TDM_VNNI 1
#define tdm_dpbusd(acc, u8, s8) _mm256_dpbusd_avx_epi32(acc, u8, s8)
#endif
#if defined(__AVX512F__) && !defined(TDM_NO_WIDE_ATTENTION)
#define TDM_WIDE_ATTENTION 1 /* attention_wide.h: the same bits in 512-bit vectors */
#endif
#endif

enum { KIND_F32 = 0, KIND_I8 = 1, KIND_I8B = 2, KIND_I4 = 3, KIND_F16 = 4 };
#define QB 32 /* activation quantization block */


typedef struct {
    int64_t kind, group, rows, cols;
    const uint8_t *data;   /* [rows, row_bytes] */
    int64_t row_bytes;
    const float *scale;    /* [rows, scale_stride] (per row: stride 1) */
    const float *minimum;  /* int4 only, same layout as scale */
    int64_t scale_stride;
} tdm_weight;

/* An activation vector quantized for the dot products: x ~ d[b] q + dr[b] r per block of 32
 * (r: the rounding residual, quantized again where dr[b] != 0), s[b]: exact float block sums. */
typedef struct {
    const float *f; /* the float values */
    int8_t *q, *r;
    float *d, *dr, *s;
    int32_t *flagged; /* the blocks with a residual (dr != 0), n_flagged of them */
    int64_t n_flagged;
} qvec;

#include "blocks.h"

#include "act_quant.h"

#ifdef TDM_SIMD
/* e^x for 8 floats: Cephes' expf polynomial after a ln2 range reduction (~1 ulp; x clamped to
 * +-88.38, where expf over/underflows) */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-88.3762626647949f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* sum of the 32 products u8 a * s8 b, as 8 int32 lanes converted to float */
static inline __m256 dot32_u8s8(__m256i a, __m256i b) {
#ifdef TDM_VNNI /* (every caller's u8 codes are <= 128: vpmaddubsw's int16 pairs never saturate, so both are exact) */
    return _mm256_cvtepi32_ps(tdm_dpbusd(_mm256_setzero_si256(), a, b));
#else
    __m256i p16 = _mm256_maddubs_epi16(a, b);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
#endif
}

static inline __m256 dot32_s8s8(__m256i w, __m256i y) {
    return dot32_u8s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(y, w));
}
#endif


/* ---------------------------------------------------------------------------------------------
 * Row dot products: W[r] . x, with x given as float (fp32 weights) and as Q8 blocks (the rest) */

static float dot_f32(const float *restrict w, const float *restrict x, int64_t n) {
    float a = 0.0f;
    for (int64_t k = 0; k < n; k++) a += w[k] * x[k];
    return a;
}

static float dot_i4(const tdm_weight *w, int64_t r, const qvec *x) {
    const uint8_t *p = w->data + r * w->row_bytes;
    const float *d = w->scale + r * w->scale_stride, *m = w->minimum + r * w->scale_stride;
    const float *xd = x->d, *xr = x->dr;
    int64_t ng = w->cols / w->group, per = w->group / QB; /* activation blocks per weight group */
    float summ = 0.0f;
    if (per == 1)
        for (int64_t g = 0; g < ng; g++) summ += m[g] * x->s[g];
    else
        for (int64_t g = 0; g < ng; g++) summ += m[g] * (x->s[2 * g] + x->s[2 * g + 1]);
#ifdef TDM_SIMD
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), accr = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F);
    if (per == 1) { /* two groups per iteration: two independent FMA chains */
        int64_t g = 0;
        for (; g + 1 < ng; g += 2) {
            __m128i r0 = _mm_loadu_si128((const __m128i *)(p + 16 * g));
            __m128i r1 = _mm_loadu_si128((const __m128i *)(p + 16 * g + 16));
            __m256i c0 = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(r0, 4), r0), low);
            __m256i c1 = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(r1, 4), r1), low);
            __m256 s0 = dot32_u8s8(c0, _mm256_loadu_si256((const __m256i *)(x->q + 32 * g)));
            __m256 s1 = dot32_u8s8(c1, _mm256_loadu_si256((const __m256i *)(x->q + 32 * g + 32)));
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d[g] * xd[g]), s0, acc0);
            acc1 = _mm256_fmadd_ps(_mm256_set1_ps(d[g + 1] * xd[g + 1]), s1, acc1);
            if (xr[g] != 0.0f)
                accr = _mm256_fmadd_ps(_mm256_set1_ps(d[g] * xr[g]),
                                       dot32_u8s8(c0, _mm256_loadu_si256((const __m256i *)(x->r + 32 * g))), accr);
            if (xr[g + 1] != 0.0f)
                accr = _mm256_fmadd_ps(_mm256_set1_ps(d[g + 1] * xr[g + 1]),
                                       dot32_u8s8(c1, _mm256_loadu_si256((const __m256i *)(x->r + 32 * g + 32))), accr);
        }
        for (; g < ng; g++) {
            __m128i r0 = _mm_loadu_si128((const __m128i *)(p + 16 * g));
            __m256i c0 = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(r0, 4), r0), low);
            __m256 s0 = dot32_u8s8(c0, _mm256_loadu_si256((const __m256i *)(x->q + 32 * g)));
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d[g] * xd[g]), s0, acc0);
            if (xr[g] != 0.0f)
                accr = _mm256_fmadd_ps(_mm256_set1_ps(d[g] * xr[g]),
                                       dot32_u8s8(c0, _mm256_loadu_si256((const __m256i *)(x->r + 32 * g))), accr);
        }
    } else { /* groups of 64: 32 bytes, low nibbles = elements 0..31, high = 32..63 */
        for (int64_t g = 0; g < ng; g++) {
            __m256i raw = _mm256_loadu_si256((const __m256i *)(p + 32 * g));
            __m256i c0 = _mm256_and_si256(raw, low), c1 = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
            int64_t b = 2 * g;
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d[g] * xd[b]),
                                   dot32_u8s8(c0, _mm256_loadu_si256((const __m256i *)(x->q + 32 * b))), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_set1_ps(d[g] * xd[b + 1]),
                                   dot32_u8s8(c1, _mm256_loadu_si256((const __m256i *)(x->q + 32 * b + 32))), acc1);
            if (xr[b] != 0.0f)
                accr = _mm256_fmadd_ps(_mm256_set1_ps(d[g] * xr[b]),
                                       dot32_u8s8(c0, _mm256_loadu_si256((const __m256i *)(x->r + 32 * b))), accr);
            if (xr[b + 1] != 0.0f)
                accr = _mm256_fmadd_ps(_mm256_set1_ps(d[g] * xr[b + 1]),
                                       dot32_u8s8(c1, _mm256_loadu_si256((const __m256i *)(x->r + 32 * b + 32))), accr);
        }
    }
    acc0 = _mm256_add_ps(acc0, accr);
    return hsum8(_mm256_add_ps(acc0, acc1)) + summ;
#else
    int64_t G = w->group, half = G / 2;
    float acc = 0.0f;
    for (int64_t g = 0; g < ng; g++) {
        const uint8_t *pg = p + g * half;
        for (int64_t k = 0; k < per; k++) {
            int64_t b = g * per + k;
            int32_t isum = 0, rsum = 0;
            for (int64_t j = 0; j < QB; j++) {
                int64_t e = k * QB + j; /* element inside the group */
                int v = e < half ? (pg[e] & 15) : (pg[e - half] >> 4);
                isum += v * x->q[b * QB + j];
                rsum += v * x->r[b * QB + j];
            }
            acc += d[g] * (xd[b] * (float)isum + (xr[b] != 0.0f ? xr[b] * (float)rsum : 0.0f));
        }
    }
    return acc + summ;
#endif
}

/* Q8_0 blocks (scale per 32) or per-row int8 (one scale) */
static float dot_i8(const tdm_weight *w, int64_t r, const qvec *x) {
    const int8_t *q = (const int8_t *)(w->data + r * w->row_bytes);
    const float *s = w->scale + r * w->scale_stride;
    int64_t nb = w->cols / QB;
    int blocked = w->kind == KIND_I8B;
#ifdef TDM_SIMD
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), accr = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        __m256i w0 = _mm256_loadu_si256((const __m256i *)(q + 32 * b));
        __m256i w1 = _mm256_loadu_si256((const __m256i *)(q + 32 * b + 32));
        float s0 = blocked ? s[b] : 1.0f, s1 = blocked ? s[b + 1] : 1.0f;
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(s0 * x->d[b]),
                               dot32_s8s8(w0, _mm256_loadu_si256((const __m256i *)(x->q + 32 * b))), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_set1_ps(s1 * x->d[b + 1]),
                               dot32_s8s8(w1, _mm256_loadu_si256((const __m256i *)(x->q + 32 * b + 32))), acc1);
        if (x->dr[b] != 0.0f)
            accr = _mm256_fmadd_ps(_mm256_set1_ps(s0 * x->dr[b]),
                                   dot32_s8s8(w0, _mm256_loadu_si256((const __m256i *)(x->r + 32 * b))), accr);
        if (x->dr[b + 1] != 0.0f)
            accr = _mm256_fmadd_ps(_mm256_set1_ps(s1 * x->dr[b + 1]),
                                   dot32_s8s8(w1, _mm256_loadu_si256((const __m256i *)(x->r + 32 * b + 32))), accr);
    }
    for (; b < nb; b++) {
        __m256i w0 = _mm256_loadu_si256((const __m256i *)(q + 32 * b));
        float s0 = blocked ? s[b] : 1.0f;
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(s0 * x->d[b]),
                               dot32_s8s8(w0, _mm256_loadu_si256((const __m256i *)(x->q + 32 * b))), acc0);
        if (x->dr[b] != 0.0f)
            accr = _mm256_fmadd_ps(_mm256_set1_ps(s0 * x->dr[b]),
                                   dot32_s8s8(w0, _mm256_loadu_si256((const __m256i *)(x->r + 32 * b))), accr);
    }
    float total = hsum8(_mm256_add_ps(_mm256_add_ps(acc0, accr), acc1));
#else
    float total = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        int32_t isum = 0, rsum = 0;
        for (int k = 0; k < QB; k++) {
            isum += (int32_t)q[b * QB + k] * x->q[b * QB + k];
            rsum += (int32_t)q[b * QB + k] * x->r[b * QB + k];
        }
        total += (blocked ? s[b] : 1.0f) * (x->d[b] * (float)isum + (x->dr[b] != 0.0f ? x->dr[b] * (float)rsum : 0.0f));
    }
#endif
    return blocked ? total : total * s[0];
}

#ifdef TDM_SIMD
/* the four horizontal sums of a, b, c, e as one vector */
static inline __m128 hsum4x8(__m256 a, __m256 b, __m256 c, __m256 e) {
    __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, e));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

static inline __m256i nibbles32(const uint8_t *p) { /* 16 bytes -> the 32 codes of a Q4_1 group, in order */
    __m128i raw = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
}

/* acc[k] += (d_k[g] * scale) * codes(row k, group g) . xv, for the four rows at p (row stride rb) */
static inline __attribute__((always_inline)) void acc4_i4g32(__m256 acc[4], const uint8_t *p, int64_t rb,
                                                             const float *d, int64_t ss, int64_t g, __m256i xv,
                                                             float scale) {
    for (int k = 0; k < 4; k++)
        acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(d[k * ss + g] * scale), dot32_u8s8(nibbles32(p + k * rb + 16 * g), xv),
                                 acc[k]);
}

/* the tail of dot4_i4g32 (and of its multi-token twin, rows_multi.h) for one token: flagged residual blocks, minimum terms, the four sums */
static inline void finish4_i4g32(const tdm_weight *w, int64_t r, const qvec *x, __m256 acc[4], float *out) {
    int64_t rb = w->row_bytes, ss = w->scale_stride, ng = w->cols / 32;
    const uint8_t *p = w->data + r * rb;
    const float *d = w->scale + r * ss, *m = w->minimum + r * ss;
    for (int64_t f = 0; f < x->n_flagged; f++) {
        int64_t g = x->flagged[f];
        acc4_i4g32(acc, p, rb, d, ss, g, _mm256_loadu_si256((const __m256i *)(x->r + 32 * g)), x->dr[g]);
    }
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    int64_t g = 0;
    for (; g + 8 <= ng; g += 8) {
        __m256 xs = _mm256_loadu_ps(x->s + g);
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(m + g), xs, s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(m + ss + g), xs, s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(m + 2 * ss + g), xs, s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(m + 3 * ss + g), xs, s3);
    }
    __m128 sums = _mm_add_ps(hsum4x8(acc[0], acc[1], acc[2], acc[3]), hsum4x8(s0, s1, s2, s3));
    _mm_storeu_ps(out, sums);
    for (; g < ng; g++)
        for (int k = 0; k < 4; k++) out[k] += m[k * ss + g] * x->s[g];
}

/* out[0..3] = rows r..r+3 . x for int4 groups of 32: the activation blocks and their scales are
 * loaded once for four rows, four independent FMA chains, one reduction for the four sums. */
static void dot4_i4g32(const tdm_weight *w, int64_t r, const qvec *x, float *out) {
    int64_t rb = w->row_bytes, ss = w->scale_stride, ng = w->cols / 32;
    const uint8_t *p = w->data + r * rb;
    const float *d = w->scale + r * ss;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    const char *ahead = (const char *)(p + 8 * rb); /* four rows further on: one line per group */
    for (int64_t g = 0; g < ng; g++) {
        _mm_prefetch(ahead + 64 * g, _MM_HINT_T0);
        acc4_i4g32(acc, p, rb, d, ss, g, _mm256_loadu_si256((const __m256i *)(x->q + 32 * g)), x->d[g]);
    }
    finish4_i4g32(w, r, x, acc, out);
}

/* the same for Q8_0 blocks (blocked = 1) or per-row int8 (blocked = 0, one scale per row) */
static void dot4_i8(const tdm_weight *w, int64_t r, const qvec *x, float *out) {
    int64_t rb = w->row_bytes, ss = w->scale_stride, nb = w->cols / 32;
    int blocked = w->kind == KIND_I8B;
    const int8_t *q = (const int8_t *)(w->data + r * rb);
    const float *s = w->scale + r * ss;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
#define TDM_I8_BLOCK(codes, scale_of)                                                                     \
    do {                                                                                                  \
        __m256i xv = _mm256_loadu_si256((const __m256i *)((codes) + 32 * b));                             \
        a0 = _mm256_fmadd_ps(_mm256_set1_ps(scale_of(0)), dot32_s8s8(_mm256_loadu_si256((const __m256i *)(q + 32 * b)), xv), a0); \
        a1 = _mm256_fmadd_ps(_mm256_set1_ps(scale_of(1)), dot32_s8s8(_mm256_loadu_si256((const __m256i *)(q + rb + 32 * b)), xv), a1); \
        a2 = _mm256_fmadd_ps(_mm256_set1_ps(scale_of(2)), dot32_s8s8(_mm256_loadu_si256((const __m256i *)(q + 2 * rb + 32 * b)), xv), a2); \
        a3 = _mm256_fmadd_ps(_mm256_set1_ps(scale_of(3)), dot32_s8s8(_mm256_loadu_si256((const __m256i *)(q + 3 * rb + 32 * b)), xv), a3); \
    } while (0)
#define TDM_SCALE_Q(k) ((blocked ? s[(k) * ss + b] : 1.0f) * x->d[b])
#define TDM_SCALE_R(k) ((blocked ? s[(k) * ss + b] : 1.0f) * x->dr[b])
    const char *ahead = (const char *)(q + 8 * rb); /* four rows further on: two lines per block */
    for (int64_t b = 0; b < nb; b++) {
        _mm_prefetch(ahead + 128 * b, _MM_HINT_T0);
        _mm_prefetch(ahead + 128 * b + 64, _MM_HINT_T0);
        TDM_I8_BLOCK(x->q, TDM_SCALE_Q);
    }
    for (int64_t f = 0; f < x->n_flagged; f++) {
        int64_t b = x->flagged[f];
        TDM_I8_BLOCK(x->r, TDM_SCALE_R);
    }
#undef TDM_SCALE_R
#undef TDM_SCALE_Q
#undef TDM_I8_BLOCK
    _mm_storeu_ps(out, hsum4x8(a0, a1, a2, a3));
    if (!blocked)
        for (int k = 0; k < 4; k++) out[k] *= s[k * ss];
}
#endif

#include "kquants.h" /* Q5_0 / Q6_K / Q5_K blocks in place */
#include "blocks_dot.h"
#include "blocks_x8.h" /* Q4_0 / Q4_1 rows interleaved eight at a time */

static float dot_row(const tdm_weight *w, int64_t r, const qvec *x) {
    float o;
    if (is_x8(w->kind)) return dot_row_any_x8(w, r, x); /* blocks_x8.h */
    if (is_kquant(w->kind)) return kq_dot_rows(w, r, 1, x, &o), o; /* kquants.h */
    if (packed_scales(w->kind)) { /* blocks.h: this row's scales expanded, then the float-scale kernel */
        int64_t ng = w->cols / 32;
        float d[ng], m[ng];
        tdm_weight sh;
        shadow_rows(w, r, 1, d, m, &sh);
        return dot_row(&sh, 0, x);
    }
    switch (w->kind) {
    case KIND_F32: return dot_f32((const float *)(w->data + r * w->row_bytes), x->f, w->cols);
    case KIND_I4: return dot_i4(w, r, x);
    default: return dot_i8(w, r, x);
    }
}

/* out[i] = W[r0 + i] . x for i < n: four rows at a time where a four-row kernel exists */
static void dot_rows(const tdm_weight *w, int64_t r0, int64_t n, const qvec *x, float *out) {
    int64_t i = 0;
    if (is_kquant(w->kind)) { kq_dot_rows(w, r0, n, x, out); return; } /* kquants.h */
    if (is_x8(w->kind)) { dot_rows_x8(w, r0, n, x, out); return; } /* blocks_x8.h */
#ifdef TDM_SIMD
    if (w->kind == KIND_I4H) /* blocks_dot.h: f16 scales widened in registers */
        for (; i + 4 <= n; i += 4) dot4_i4h(w, r0 + i, x, out + i);
    else if (w->kind == KIND_I8H)
        for (; i + 4 <= n; i += 4) dot4_i8h(w, r0 + i, x, out + i);
    else if (packed_scales(w->kind)) { /* blocks.h (Q4_K): four rows' scales expanded, then the float-scale kernel */
        int64_t ng = w->cols / 32;
        float d[4 * ng], m[4 * ng];
        tdm_weight sh;
        for (; i + 4 <= n; i += 4) {
            shadow_rows(w, r0 + i, 4, d, m, &sh);
            if (sh.kind == KIND_I4) dot4_i4g32(&sh, 0, x, out + i);
            else dot4_i8(&sh, 0, x, out + i);
        }
    } else if (w->kind == KIND_I4 && w->group == 32)
        for (; i + 4 <= n; i += 4) dot4_i4g32(w, r0 + i, x, out + i);
    else if (w->kind == KIND_I8B || w->kind == KIND_I8)
        for (; i + 4 <= n; i += 4) dot4_i8(w, r0 + i, x, out + i);
#endif
    for (; i < n; i++) out[i] = dot_row(w, r0 + i, x);
}
#include "axpy.h"

/* The instruction sets this build's kernels use, as bits: 1 AVX2 / FMA / F16C, 2 VNNI's int8 dots (vpdpbusd),
 * 4 AMX tiles for Q8_0's and Q4's multi-token products (blocks_amx.h; Linux is asked for them at first use) */
int64_t tdm_simd_features(void) {
    int64_t bits = 0;
#ifdef TDM_SIMD
    bits |= 1;
#endif
#ifdef TDM_VNNI
    bits |= 2;
#endif
#ifdef TDM_AMX
    bits |= 4;
#endif
#ifdef TDM_WIDE_ATTENTION
    bits |= 8;
#endif
    return bits;
}

#endif
