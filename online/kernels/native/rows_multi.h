/* Multi-token row kernels of the batched decode step (batch.h): every weight row block is read once
 * and applied to T tokens' quantized activations. Each token's float arithmetic is exactly the one
 * of the single-token kernels in rows.h (same products, same FMA chains in the same order, same
 * reductions), so every output is bit-identical to dot_rows on that token alone; only the work that
 * does not touch a token's accumulators is shared (int4 nibble unpacking, int8 |w|, fp16 -> fp32).
 * Tokens go two at a time (8 accumulators in the 16 ymm registers); int4 rows are unpacked once per
 * four-row block into an L1 buffer that every token pair reads.
 * Included by decode.c only, after rows.h. */
#ifndef TANDEM_ROWS_MULTI_H
#define TANDEM_ROWS_MULTI_H
#include "rows.h"
#include "blocks_multi.h" /* the f16-scale (Q4_0 / Q4_1 / Q8_0 in place) twins */
#define TDM_MULTI_MAX_T 64 /* tokens per pass of the f16-scale kernels (their scale buffers are on the stack) */

#ifdef TDM_SIMD
/* sc[k * ng + g] = d[k * ss + g] * xd[g]: the block scales of four rows times a token's activation
 * scales (the same float products the single-token kernels form one at a time) */
static inline void scales4(const float *d, int64_t ss, const float *xd, int64_t ng, float *sc) {
    for (int k = 0; k < 4; k++)
        for (int64_t g = 0; g < ng; g++) sc[k * ng + g] = d[k * ss + g] * xd[g];
}

/* dot4_i4g32 for tokens x[0..T): out[i * os + k] = row r+k . x[i]. The four rows' nibbles are
 * unpacked once into codes (L1) and read back by every token pair. */
static void dot4_i4g32_multi(const tdm_weight *w, int64_t r, const qvec *x, int64_t T, float *out, int64_t os) {
    int64_t rb = w->row_bytes, ss = w->scale_stride, ng = w->cols / 32, i = 0;
    const uint8_t *p = w->data + r * rb;
    const float *d = w->scale + r * ss;
    const char *ahead = (const char *)(p + 8 * rb);
    float sa[4 * ng], sb[4 * ng];
    __m256i codes[4 * ng]; /* [g][k] */
    for (int64_t g = 0; g < ng && T > 1; g++) {
        _mm_prefetch(ahead + 64 * g, _MM_HINT_T0);
        for (int k = 0; k < 4; k++) codes[4 * g + k] = nibbles32(p + k * rb + 16 * g);
    }
    for (; i + 2 <= T; i += 2) {
        const qvec *xa = x + i, *xb = x + i + 1;
        scales4(d, ss, xa->d, ng, sa);
        scales4(d, ss, xb->d, ng, sb);
        __m256 a[4], b[4];
        for (int k = 0; k < 4; k++) a[k] = b[k] = _mm256_setzero_ps();
        for (int64_t g = 0; g < ng; g++) {
            __m256i va = _mm256_loadu_si256((const __m256i *)(xa->q + 32 * g));
            __m256i vb = _mm256_loadu_si256((const __m256i *)(xb->q + 32 * g));
            for (int k = 0; k < 4; k++) {
                __m256i c = codes[4 * g + k];
                a[k] = _mm256_fmadd_ps(_mm256_broadcast_ss(sa + k * ng + g), dot32_u8s8(c, va), a[k]);
                b[k] = _mm256_fmadd_ps(_mm256_broadcast_ss(sb + k * ng + g), dot32_u8s8(c, vb), b[k]);
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
    float sa[4 * nb], sb[4 * nb];
    for (; i + 2 <= T; i += 2) {
        const qvec *xa = x + i, *xb = x + i + 1;
        if (blocked) {
            scales4(s, ss, xa->d, nb, sa);
            scales4(s, ss, xb->d, nb, sb);
        } else { /* 1.0f * x->d[b] is x->d[b] */
            for (int k = 0; k < 4; k++) memcpy(sa + k * nb, xa->d, 4 * nb), memcpy(sb + k * nb, xb->d, 4 * nb);
        }
        __m256 a[4], b[4];
        for (int k = 0; k < 4; k++) a[k] = b[k] = _mm256_setzero_ps();
        for (int64_t bl = 0; bl < nb; bl++) {
            if (i == 0) {
                _mm_prefetch(ahead + 128 * bl, _MM_HINT_T0);
                _mm_prefetch(ahead + 128 * bl + 64, _MM_HINT_T0);
            }
            __m256i va = _mm256_loadu_si256((const __m256i *)(xa->q + 32 * bl));
            __m256i vb = _mm256_loadu_si256((const __m256i *)(xb->q + 32 * bl));
            for (int k = 0; k < 4; k++) {
                __m256i wv = _mm256_loadu_si256((const __m256i *)(q + k * rb + 32 * bl));
                __m256i aw = _mm256_sign_epi8(wv, wv);
                a[k] = _mm256_fmadd_ps(_mm256_broadcast_ss(sa + k * nb + bl), dot32_u8s8(aw, _mm256_sign_epi8(va, wv)), a[k]);
                b[k] = _mm256_fmadd_ps(_mm256_broadcast_ss(sb + k * nb + bl), dot32_u8s8(aw, _mm256_sign_epi8(vb, wv)), b[k]);
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

/* y_i [cols] += sum_j h[i * hs + j] * W[idx[j]] for tokens i < T that share one row list (a dense or
 * equally sparse FFN): axpy_rows per token, with each fp16 block of four rows converted once for
 * all T (the same float operations per token, in the same order) */
static void axpy_rows_multi(const tdm_weight *w, const int32_t *idx, const float *h, int64_t hs, int64_t n, int64_t T,
                            float *y, int64_t ys) {
    int64_t j = 0;
#ifdef TDM_SIMD
    int64_t cols = w->cols;
    if (w->kind == KIND_F16 && cols % 8 == 0 && T > 1) {
        const uint8_t *base = w->data;
        int64_t rb = w->row_bytes;
        for (; j + 4 <= n; j += 4) {
            const uint16_t *r0 = (const uint16_t *)(base + idx[j] * rb), *r1 = (const uint16_t *)(base + idx[j + 1] * rb);
            const uint16_t *r2 = (const uint16_t *)(base + idx[j + 2] * rb), *r3 = (const uint16_t *)(base + idx[j + 3] * rb);
            int64_t jn = j + 12 <= n ? j + 8 : j;
            const char *n0 = (const char *)(base + idx[jn] * rb), *n1 = (const char *)(base + idx[jn + 1] * rb);
            const char *n2 = (const char *)(base + idx[jn + 2] * rb), *n3 = (const char *)(base + idx[jn + 3] * rb);
            for (int64_t k = 0; k < cols; k += 8) {
                if ((k & 31) == 0) {
                    _mm_prefetch(n0 + 2 * k, _MM_HINT_T0);
                    _mm_prefetch(n1 + 2 * k, _MM_HINT_T0);
                    _mm_prefetch(n2 + 2 * k, _MM_HINT_T0);
                    _mm_prefetch(n3 + 2 * k, _MM_HINT_T0);
                }
                __m256 w0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(r0 + k)));
                __m256 w1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(r1 + k)));
                __m256 w2 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(r2 + k)));
                __m256 w3 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(r3 + k)));
                for (int64_t i = 0; i < T; i++) {
                    const float *hi = h + i * hs + j;
                    float *yi = y + i * ys + k;
                    __m256 a = _mm256_fmadd_ps(_mm256_broadcast_ss(hi), w0, _mm256_loadu_ps(yi));
                    __m256 b = _mm256_mul_ps(_mm256_broadcast_ss(hi + 1), w1);
                    a = _mm256_fmadd_ps(_mm256_broadcast_ss(hi + 2), w2, a);
                    b = _mm256_fmadd_ps(_mm256_broadcast_ss(hi + 3), w3, b);
                    _mm256_storeu_ps(yi, _mm256_add_ps(a, b));
                }
            }
        }
    }
#endif
    for (int64_t i = 0; i < T; i++) /* the rest (and every other format): row by row, per token */
        if (j == 0) axpy_rows(w, idx, h + i * hs, n, y + i * ys);
        else for (int64_t jj = j; jj < n; jj++) axpy_row(w, idx[jj], h[i * hs + jj], y + i * ys);
}

/* out[i * os + j] = W[r0 + j] . x[i] for j < n, i < T: dot_rows (same four-row blocks and tails)
 * for every token, each row block read once */
static void dot_rows_multi(const tdm_weight *w, int64_t r0, int64_t n, const qvec *x, int64_t T, float *out,
                           int64_t os) {
    int64_t j = 0;
    if (T == 1) { /* one token: the single-token kernels themselves */
        dot_rows(w, r0, n, x, out);
        return;
    }
    if (is_kquant(w->kind)) { /* kquants.h */
        kq_dot_rows_multi(w, r0, n, x, T, out, os);
        return;
    }
    if (is_x8(w->kind)) { /* blocks_x8.h: each row group unpacked once for all T */
        dot_rows_x8_multi(w, r0, n, x, T, out, os);
        return;
    }
#ifdef TDM_SIMD
    if ((w->kind == KIND_I4H || w->kind == KIND_I8H) && T > TDM_MULTI_MAX_T) { /* token chunks (stack bound) */
        for (int64_t i = 0; i < T; i += TDM_MULTI_MAX_T)
            dot_rows_multi(w, r0, n, x + i, T - i < TDM_MULTI_MAX_T ? T - i : TDM_MULTI_MAX_T, out + i * os, os);
        return;
    }
    if (w->kind == KIND_I4H || w->kind == KIND_I8H) { /* blocks_multi.h: f16 scales widened once per four rows */
        int64_t ng = w->cols / 32, ng8 = (ng + 7) & ~(int64_t)7;
        float xdp[T * ng8]; /* the tokens' activation scales, zero-padded to whole vectors */
        pad_scales(x, T, ng, ng8, xdp);
        if (w->kind == KIND_I4H)
            for (; j + 4 <= n; j += 4) dot4_i4h_multi(w, r0 + j, x, xdp, T, out + j, os);
        else
            for (; j + 4 <= n; j += 4) dot4_i8h_multi(w, r0 + j, x, xdp, T, out + j, os);
    } else if (packed_scales(w->kind)) { /* blocks.h: as dot_rows, four rows' scales expanded once for all T */
        int64_t ng = w->cols / 32;
        float d[4 * ng], m[4 * ng];
        tdm_weight sh;
        for (; j + 4 <= n; j += 4) {
            shadow_rows(w, r0 + j, 4, d, m, &sh);
            if (sh.kind == KIND_I4) dot4_i4g32_multi(&sh, 0, x, T, out + j, os);
            else dot4_i8_multi(&sh, 0, x, T, out + j, os);
        }
    } else if (w->kind == KIND_I4 && w->group == 32)
        for (; j + 4 <= n; j += 4) dot4_i4g32_multi(w, r0 + j, x, T, out + j, os);
    else if (w->kind == KIND_I8B || w->kind == KIND_I8)
        for (; j + 4 <= n; j += 4) dot4_i8_multi(w, r0 + j, x, T, out + j, os);
#endif
    for (; j < n; j++)
        for (int64_t i = 0; i < T; i++) out[i * os + j] = dot_row(w, r0 + j, x + i);
}

#endif
