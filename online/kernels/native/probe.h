/* Benchmark entries of the row kernels (online/kind_probe.py: the cost model's probe, placement/fused_calibration.py),
 * read as the step reads its matrices: included by decode.c after ffn.h (FFN_SLICE). */
#ifndef TDM_PROBE_H
#define TDM_PROBE_H

/* One thread's part of a read pass: access 0: rows rows[0] .. rows[0] + n - 1 dotted (dot_rows, split by
 * row_chunk into contiguous ranges, as the step's own shares are where no thread steals: units.h); 1: the n rows
 * at rows[] dotted (dot_rows_idx); 2: those rows added with weights h (axpy_rows); 3: two matrices of n rows,
 * rows[0] .. + n - 1 (a layer's up) and the n after them (its gate), read whole together as ffn_rows' dense slice
 * loop reads them: FFN_SLICE rows of one, then the same rows of the other, each thread its own run of slices (the
 * up rows' outputs at o, the gate rows' at o + n). Thread t takes [n t / T, n (t + 1) / T) and writes at o. */
static void read_pass_part(const tdm_weight *w, int64_t access, const int32_t *rows, int64_t n, const qvec *v,
                           const float *h, int t, int nt, float *o) {
    int64_t lo = n * t / nt, hi = n * (t + 1) / nt;
    if (access == 0) {
        row_chunk(n, t, nt, &lo, &hi);
        dot_rows(w, rows[0] + lo, hi - lo, v, o);
    } else if (access == 1) dot_rows_idx(w, rows + lo, hi - lo, v, o);
    else if (access == 2) axpy_rows(w, rows + lo, h + lo, hi - lo, o);
    else {
        int64_t s0, s1, step;
        slice_range(n, FFN_SLICE, 1, t, nt, &s0, &s1, &step);
        for (int64_t b0 = s0; b0 < s1; b0 += step) {
            int64_t k = b0 + FFN_SLICE < s1 ? FFN_SLICE : s1 - b0;
            dot_rows(w, rows[0] + b0, k, v, o + b0);
            dot_rows(w, rows[0] + n + b0, k, v, o + n + b0);
        }
    }
}

/* Benchmark entry (online/kind_probe.py ReadPass): one pass of the step's row kernels on `threads` OpenMP
 * threads (read_pass_part; thread t writes at out + t * out_stride; x is quantized once, before), timed
 * inside the region: the seconds from a barrier every thread has reached (all awake) to the barrier after
 * the last row. The step reads its matrices inside one live region; timed from outside, a pass also paid
 * the workers' wake-up (~0.1-0.2 ms here: the probe rated gathered and added rows 10-30% slow until
 * 2026-11-28; Python threads, before that, ~0.1 ms more). */
double tdm_read_pass_timed(const tdm_weight *w, int64_t access, const int32_t *rows, int64_t n, const float *x,
                           const float *h, int64_t threads, float *out, int64_t out_stride) {
    int64_t cols = w->cols, nb = cols / QB + 1;
    int8_t q[cols], rq[cols];
    float d[nb], dr[nb], s[nb];
    int32_t flagged[nb];
    qvec v = {x, q, rq, d, dr, s, flagged, 0};
    double t0 = 0.0, t1 = 0.0;
    if (access != 2) quantize_q8(x, cols, &v, 2.0f);
#pragma omp parallel num_threads((int)threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
#pragma omp barrier
#pragma omp master
        t0 = omp_get_wtime();
        read_pass_part(w, access, rows, n, &v, h, t, nt, out + t * out_stride);
#pragma omp barrier
#pragma omp master
        t1 = omp_get_wtime();
    }
    return t1 - t0;
}

/* Benchmark entry (online/kind_probe.py measure_pass_cost): the rows of w read as n_passes consecutive
 * whole passes of pass_rows rows each (the last one shorter), one after another in ONE OpenMP region
 * with a barrier after each, as the step reads a layer's matrices: each pass splits its rows between the
 * threads in contiguous ranges, as the step's own shares (units.h) do (so every pass starts each thread's
 * stream anew), thread t writes at out + t * out_stride. x is quantized once, before. n_passes 1 and
 * pass_rows = rows: one pass. */
void tdm_read_passes(const tdm_weight *w, int64_t pass_rows, int64_t n_passes, const float *x, int64_t threads,
                     float *out, int64_t out_stride) {
    int64_t cols = w->cols, nb = cols / QB + 1;
    int8_t q[cols], rq[cols];
    float d[nb], dr[nb], s[nb];
    int32_t flagged[nb];
    qvec v = {x, q, rq, d, dr, s, flagged, 0};
    quantize_q8(x, cols, &v, 2.0f);
#pragma omp parallel num_threads((int)threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (int64_t i = 0; i < n_passes; i++) {
            int64_t r0 = i * pass_rows, n = r0 + pass_rows <= w->rows ? pass_rows : w->rows - r0, lo, hi;
            row_chunk(n, t, nt, &lo, &hi);
            dot_rows(w, r0 + lo, hi - lo, &v, out + t * out_stride);
#pragma omp barrier
        }
    }
}

/* Benchmark entry (online/kind_probe.py AttendPass): the attention of one token over `rows` cached positions
 * of n_kv KV heads (K, V: [n_kv, rows, hd], float16 where `half`) for n_kv * rep query heads q [n_kv * rep, hd],
 * through attention_block's own attend_token on `threads` OpenMP threads (out: [n_kv * rep, hd]; scores:
 * [threads, min(rep, TDM_MAX_GROUP), rows] scratch; the parts' records are allocated here). Timed inside the
 * region like tdm_read_pass_timed; -1 when the records cannot be allocated. */
double tdm_attend_pass_timed(const void *K, const void *V, int64_t n_kv, int64_t rows, int64_t hd, int64_t rep,
                             int64_t half, int64_t threads, const float *q, float *out, float *scores) {
    double t0 = 0.0, t1 = 0.0;
    int64_t per = rep <= TDM_MAX_GROUP ? rep : TDM_MAX_GROUP, n_heads = n_kv * rep;
    float *parts = (float *)malloc((size_t)(n_heads * max_segments(rows) * PART_FLOATS(hd)) * sizeof(float));
    float *merged = (float *)malloc((size_t)(threads * n_heads * hd) * sizeof(float));
    if (!parts || !merged) {
        free(parts), free(merged);
        return -1.0;
    }
    memset(parts, 0, (size_t)(n_heads * max_segments(rows) * PART_FLOATS(hd)) * sizeof(float)); /* pages mapped */
    memset(merged, 0, (size_t)(threads * n_heads * hd) * sizeof(float));                        /* before t0 */
#pragma omp parallel num_threads((int)threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
#pragma omp barrier
#pragma omp master
        t0 = omp_get_wtime();
        const float *o = attend_token((void *)K, (void *)V, rows, n_heads, rep, per, 0, rows - 1, hd, 0.125f, q, out,
                                      parts, scores + t * per * rows, rows, (int)half, merged + t * n_heads * hd, t, nt);
#pragma omp barrier
#pragma omp master
        {
            t1 = omp_get_wtime();
            if (o != out) memcpy(out, o, 4 * (size_t)(n_heads * hd));
        }
    }
    free(parts), free(merged);
    return t1 - t0;
}

#endif
