/* Whole-row dequantization of the packed weight formats (online/kernels/quantize.py) to float32,
 * for the batched prefill path (torch matmuls on dequantized weights): the first request needs no
 * JIT. Float, fp16 and int8 rows reuse rows.h's axpy_row (y = 0 + 1 * W[r]: exact); int4 groups
 * decode here (same nibble order as quantize.py: byte j of group g holds element g*G + j low,
 * g*G + G/2 + j high; w = d q + m). Included by decode.c only, after rows.h. */
#ifndef TANDEM_DEQUANT_H
#define TANDEM_DEQUANT_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

static void dequant_i4_row(const tdm_weight *w, int64_t r, float *restrict out) {
    const uint8_t *p = w->data + r * w->row_bytes;
    const float *d = w->scale + r * w->scale_stride, *m = w->minimum + r * w->scale_stride;
    int64_t G = w->group, half = G / 2, ng = w->cols / G;
    for (int64_t g = 0; g < ng; g++) {
        const uint8_t *pg = p + g * half;
        float *o = out + g * G, dg = d[g], mg = m[g];
        for (int64_t j = 0; j < half; j++) {
            o[j] = dg * (float)(pg[j] & 15) + mg;
            o[half + j] = dg * (float)(pg[j] >> 4) + mg;
        }
    }
}

/* out [n, cols] = W[r0 .. r0 + n) as float32 (one thread: prefill interleaves this with torch's pool) */
void tdm_dequantize_rows(const tdm_weight *w, int64_t r0, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) {
        float *o = out + i * w->cols;
        if (is_kquant(w->kind)) { /* kquants.h */
            kq_dequant_row(w, r0 + i, o);
        } else if (packed_scales(w->kind)) { /* blocks.h: the row's scales expanded, then the float-scale format */
            int64_t ng = w->cols / 32;
            float d[ng], m[ng];
            tdm_weight sh;
            shadow_rows(w, r0 + i, 1, d, m, &sh);
            tdm_dequantize_rows(&sh, 0, 1, o);
        } else if (w->kind == KIND_I4) {
            dequant_i4_row(w, r0 + i, o);
        } else {
            memset(o, 0, (size_t)w->cols * sizeof(float));
            axpy_row(w, r0 + i, 1.0f, o);
        }
    }
}

/* Self-check and benchmark entry: y [cols] += sum_j h[j] * W[idx[j]] (the sparse down projection's axpy_rows) */
void tdm_axpy_rows(const tdm_weight *w, const int32_t *idx, const float *h, int64_t n, float *y) {
    axpy_rows(w, idx, h, n, y);
}
#endif
