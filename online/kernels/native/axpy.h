/* Row axpys of the decode step (the transposed down projection, PowerInfer's CPU form): y += h W[r]
 * over the packed weight formats, one row or four at a time (y loaded and stored once per four).
 * Included by rows.h only, at its end (split from rows.h: fp16 / float / int8 rows here, the f16-scale
 * int rows' helpers in blocks.h). */
#ifndef TANDEM_AXPY_H
#define TANDEM_AXPY_H

/* y [d] += h * W[r] for the transposed down projection */
static void axpy_row(const tdm_weight *w, int64_t r, float h, float *restrict y) {
    int64_t n = w->cols;
    const uint8_t *row = w->data + r * w->row_bytes;
    if (w->kind == KIND_F32) {
        const float *restrict v = (const float *)row;
        for (int64_t k = 0; k < n; k++) y[k] += h * v[k];
    } else if (w->kind == KIND_F16) {
#ifdef TDM_SIMD
        const uint16_t *v = (const uint16_t *)row;
        __m256 hv = _mm256_set1_ps(h);
        for (int64_t k = 0; k < n; k += 8) {
            __m256 wv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(v + k)));
            _mm256_storeu_ps(y + k, _mm256_fmadd_ps(hv, wv, _mm256_loadu_ps(y + k)));
        }
#else
        const uint16_t *v = (const uint16_t *)row;
        for (int64_t k = 0; k < n; k++) y[k] += h * f16_value(v[k]);
#endif
    } else if (w->kind == KIND_I8H) { /* Q8_0 rows, f16 scale per 32 (blocks.h) */
        axpy_row_i8h(w, r, h, y);
    } else if (w->kind == KIND_I4H || w->kind == KIND_I4) { /* Q4_0 / Q4_1 rows, groups of 32 (blocks.h) */
        axpy_row_i4(w, r, h, y);
    } else if (w->kind == KIND_I8) {
        const int8_t *restrict q = (const int8_t *)row;
        float a = h * w->scale[r * w->scale_stride];
        for (int64_t k = 0; k < n; k++) y[k] += a * (float)q[k];
    } else { /* KIND_I8B */
        const int8_t *restrict q = (const int8_t *)row;
        const float *s = w->scale + r * w->scale_stride;
        for (int64_t b = 0; b < n / QB; b++) {
            float a = h * s[b];
            for (int k = 0; k < QB; k++) y[b * QB + k] += a * (float)q[b * QB + k];
        }
    }
}

/* y [d] += sum_j h[j] * W[idx[j]]: float rows four at a time (y is loaded and stored once per four) */
static void axpy_rows(const tdm_weight *w, const int32_t *idx, const float *h, int64_t n, float *restrict y) {
    int64_t j = 0, cols = w->cols;
    if (w->kind == KIND_F32) {
        for (; j + 4 <= n; j += 4) {
            const float *restrict r0 = (const float *)(w->data + idx[j] * w->row_bytes);
            const float *restrict r1 = (const float *)(w->data + idx[j + 1] * w->row_bytes);
            const float *restrict r2 = (const float *)(w->data + idx[j + 2] * w->row_bytes);
            const float *restrict r3 = (const float *)(w->data + idx[j + 3] * w->row_bytes);
            float h0 = h[j], h1 = h[j + 1], h2 = h[j + 2], h3 = h[j + 3];
            for (int64_t k = 0; k < cols; k++) y[k] += (h0 * r0[k] + h1 * r1[k]) + (h2 * r2[k] + h3 * r3[k]);
        }
    }
#ifdef TDM_SIMD
    else if (w->kind == KIND_F16 && cols % 8 == 0) {
        const uint8_t *base = w->data;
        int64_t rb = w->row_bytes;
        for (; j + 4 <= n; j += 4) {
            const uint16_t *r0 = (const uint16_t *)(base + idx[j] * rb), *r1 = (const uint16_t *)(base + idx[j + 1] * rb);
            const uint16_t *r2 = (const uint16_t *)(base + idx[j + 2] * rb), *r3 = (const uint16_t *)(base + idx[j + 3] * rb);
            /* the rows two groups on, fetched meanwhile (the row order is sparse: no hardware stream) */
            int64_t jn = j + 12 <= n ? j + 8 : j;
            const char *n0 = (const char *)(base + idx[jn] * rb), *n1 = (const char *)(base + idx[jn + 1] * rb);
            const char *n2 = (const char *)(base + idx[jn + 2] * rb), *n3 = (const char *)(base + idx[jn + 3] * rb);
            __m256 h0 = _mm256_set1_ps(h[j]), h1 = _mm256_set1_ps(h[j + 1]);
            __m256 h2 = _mm256_set1_ps(h[j + 2]), h3 = _mm256_set1_ps(h[j + 3]);
            for (int64_t k = 0; k < cols; k += 8) {
                if ((k & 31) == 0) { /* one 64-byte line of each next row per 32 values */
                    _mm_prefetch(n0 + 2 * k, _MM_HINT_T0);
                    _mm_prefetch(n1 + 2 * k, _MM_HINT_T0);
                    _mm_prefetch(n2 + 2 * k, _MM_HINT_T0);
                    _mm_prefetch(n3 + 2 * k, _MM_HINT_T0);
                }
                __m256 a = _mm256_fmadd_ps(h0, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(r0 + k))),
                                           _mm256_loadu_ps(y + k));
                __m256 b = _mm256_mul_ps(h1, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(r1 + k))));
                a = _mm256_fmadd_ps(h2, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(r2 + k))), a);
                b = _mm256_fmadd_ps(h3, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(r3 + k))), b);
                _mm256_storeu_ps(y + k, _mm256_add_ps(a, b));
            }
        }
    }
    else if (w->kind == KIND_I8H)
        for (; j + 4 <= n; j += 4) axpy4_i8h(w, idx + j, h + j, j + 8 <= n ? idx + j + 4 : NULL, y);
    else if (w->kind == KIND_I4H || w->kind == KIND_I4)
        for (; j + 4 <= n; j += 4) axpy4_i4(w, idx + j, h + j, j + 8 <= n ? idx + j + 4 : NULL, y);
#endif
    for (; j < n; j++) axpy_row(w, idx[j], h[j], y);
}


#endif
