/* Multi-token row kernels of the batched decode step (batch.h): every weight row block is read once
 * and applied to T tokens' quantized activations. Each token's float arithmetic is exactly the one
 * of the single-token kernels in rows.h (same products, same FMA chains in the same order, same
 * reductions), so every output is bit-identical to dot_rows on that token alone; only the work that
 * does not touch a token's accumulators is shared (int4 nibble unpacking, int8 |w|, fp16 -> fp32).
 * Tokens go two at a time: 8 accumulators + 4 unpacked rows fit the 16 ymm registers.
 * Included by decode.c only, after rows.h. */
#ifndef TANDEM_ROWS_MULTI_H
#define TANDEM_ROWS_MULTI_H
#include "rows.h"

#ifdef TDM_SIMD
/* the tail of dot4_i4g32 for one token: flagged residual blocks, minimum terms, the four sums */
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

/* dot4_i4g32 for tokens x[0..T): out[i * os + k] = row r+k . x[i] */
static void dot4_i4g32_multi(const tdm_weight *w, int64_t r, const qvec *x, int64_t T, float *out, int64_t os) {
    int64_t rb = w->row_bytes, ss = w->scale_stride, ng = w->cols / 32, i = 0;
    const uint8_t *p = w->data + r * rb;
    const float *d = w->scale + r * ss;
    const char *ahead = (const char *)(p + 8 * rb);
    for (; i + 2 <= T; i += 2) {
        const qvec *xa = x + i, *xb = x + i + 1;
        __m256 a[4], b[4];
        for (int k = 0; k < 4; k++) a[k] = b[k] = _mm256_setzero_ps();
        for (int64_t g = 0; g < ng; g++) {
            if (i == 0) _mm_prefetch(ahead + 64 * g, _MM_HINT_T0);
            __m256i va = _mm256_loadu_si256((const __m256i *)(xa->q + 32 * g));
            __m256i vb = _mm256_loadu_si256((const __m256i *)(xb->q + 32 * g));
            float da = xa->d[g], db = xb->d[g];
            for (int k = 0; k < 4; k++) {
                __m256i c = nibbles32(p + k * rb + 16 * g);
                float dk = d[k * ss + g];
                a[k] = _mm256_fmadd_ps(_mm256_set1_ps(dk * da), dot32_u8s8(c, va), a[k]);
                b[k] = _mm256_fmadd_ps(_mm256_set1_ps(dk * db), dot32_u8s8(c, vb), b[k]);
            }
        }
        finish4_i4g32(w, r, xa, a, out + i * os);
        finish4_i4g32(w, r, xb, b, out + (i + 1) * os);
    }
    if (i < T) {
        float o[4];
        dot4_i4g32(w, r, x + i, o);
        for (int k = 0; k < 4; k++) out[i * os + k] = o[k];
    }
}

/* dot4_i8 for tokens x[0..T) (two at a time: the |w| of a block is shared) */
static void dot4_i8_multi(const tdm_weight *w, int64_t r, const qvec *x, int64_t T, float *out, int64_t os) {
    int64_t rb = w->row_bytes, ss = w->scale_stride, nb = w->cols / 32, i = 0;
    int blocked = w->kind == KIND_I8B;
    const int8_t *q = (const int8_t *)(w->data + r * rb);
    const float *s = w->scale + r * ss;
    const char *ahead = (const char *)(q + 8 * rb);
    for (; i + 2 <= T; i += 2) {
        const qvec *xa = x + i, *xb = x + i + 1;
        __m256 a[4], b[4];
        for (int k = 0; k < 4; k++) a[k] = b[k] = _mm256_setzero_ps();
        for (int64_t bl = 0; bl < nb; bl++) {
            if (i == 0) {
                _mm_prefetch(ahead + 128 * bl, _MM_HINT_T0);
                _mm_prefetch(ahead + 128 * bl + 64, _MM_HINT_T0);
            }
            __m256i va = _mm256_loadu_si256((const __m256i *)(xa->q + 32 * bl));
            __m256i vb = _mm256_loadu_si256((const __m256i *)(xb->q + 32 * bl));
            float da = xa->d[bl], db = xb->d[bl];
            for (int k = 0; k < 4; k++) {
                __m256i wv = _mm256_loadu_si256((const __m256i *)(q + k * rb + 32 * bl));
                __m256i aw = _mm256_sign_epi8(wv, wv);
                float sk = blocked ? s[k * ss + bl] : 1.0f;
                a[k] = _mm256_fmadd_ps(_mm256_set1_ps(sk * da), dot32_u8s8(aw, _mm256_sign_epi8(va, wv)), a[k]);
                b[k] = _mm256_fmadd_ps(_mm256_set1_ps(sk * db), dot32_u8s8(aw, _mm256_sign_epi8(vb, wv)), b[k]);
            }
        }
        for (int e = 0; e < 2; e++) {
            const qvec *xe = x + i + e;
            __m256 *acc = e ? b : a;
            for (int64_t f = 0; f < xe->n_flagged; f++) {
                int64_t bl = xe->flagged[f];
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xe->r + 32 * bl));
                for (int k = 0; k < 4; k++) {
                    float sk = blocked ? s[k * ss + bl] : 1.0f;
                    acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(sk * xe->dr[bl]),
                                             dot32_s8s8(_mm256_loadu_si256((const __m256i *)(q + k * rb + 32 * bl)), xv),
                                             acc[k]);
                }
            }
            float *o = out + (i + e) * os;
            _mm_storeu_ps(o, hsum4x8(acc[0], acc[1], acc[2], acc[3]));
            if (!blocked)
                for (int k = 0; k < 4; k++) o[k] *= s[k * ss];
        }
    }
    if (i < T) {
        float o[4];
        dot4_i8(w, r, x + i, o);
        for (int k = 0; k < 4; k++) out[i * os + k] = o[k];
    }
}
#endif

/* out[i * os + j] = W[r0 + j] . x[i] for j < n, i < T: dot_rows (same four-row blocks and tails)
 * for every token, each row block read once */
static void dot_rows_multi(const tdm_weight *w, int64_t r0, int64_t n, const qvec *x, int64_t T, float *out,
                           int64_t os) {
    int64_t j = 0;
#ifdef TDM_SIMD
    if (w->kind == KIND_I4 && w->group == 32)
        for (; j + 4 <= n; j += 4) dot4_i4g32_multi(w, r0 + j, x, T, out + j, os);
    else if (w->kind == KIND_I8B || w->kind == KIND_I8)
        for (; j + 4 <= n; j += 4) dot4_i8_multi(w, r0 + j, x, T, out + j, os);
#endif
    for (; j < n; j++)
        for (int64_t i = 0; i < T; i++) out[i * os + j] = dot_row(w, r0 + j, x + i);
}

#endif
