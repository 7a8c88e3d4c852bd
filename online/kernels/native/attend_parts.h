/* Attention over one token's context in parts (flash-decoding's split-K) and the token's (KV group, part,
 * head) units split between the step's threads: attend_token, run by attention_block (decode.c) and timed by
 * the probe (probe.h); attend_group, run per (token, head run) by batch.h. The kernels it calls (key_scores,
 * softmax_exps, values_of) are attention.h's. Included by attention.h only. */
#ifndef TANDEM_ATTEND_PARTS_H
#define TANDEM_ATTEND_PARTS_H

/* A head's context of more than TDM_SEGMENT_POSITIONS positions is attended in equal parts (at most
 * TDM_MAX_SEGMENTS), each with its own maximum, and the parts merged by their maxima (flash-decoding's
 * split-K): one token's parts go to different threads, so the head count no longer caps the threads a
 * long context's attention can use (SmolLM2's 9 heads: at most 9 before) nor splits it unevenly (9 on 2).
 * The split depends on the context length alone, so every path (one token, several, a batch of
 * sequences, any thread count) computes the same values; up to TDM_SEGMENT_POSITIONS positions it is
 * the one-part arithmetic exactly. A part's record is hd + 2 floats: the unnormalised output, then the
 * maximum and the sum of the exponentials. */
#define TDM_SEGMENT_POSITIONS 512
#define TDM_MAX_SEGMENTS 64
#define PART_FLOATS(hd) ((hd) + 2)

static inline int64_t attend_segments(int64_t start, int64_t pos) {
    int64_t n = (pos - start + TDM_SEGMENT_POSITIONS) / TDM_SEGMENT_POSITIONS; /* ceil((pos - start + 1) / SEG) */
    return n < 1 ? 1 : n < TDM_MAX_SEGMENTS ? n : TDM_MAX_SEGMENTS;
}

/* the most parts a context of `positions` positions takes (scratch sizes) */
static inline int64_t max_segments(int64_t positions) { return attend_segments(0, positions - 1); }

/* positions [*s0, *s1] of part k of n over [start, pos]: whole blocks of eight keys but in the last part
 * (key_scores takes a part's last len % 8 keys one at a time) */
static inline void segment_bounds(int64_t start, int64_t pos, int64_t n, int64_t k, int64_t *s0, int64_t *s1) {
    int64_t len = pos - start + 1;
    *s0 = start + ((len * k / n) & ~(int64_t)7);
    *s1 = k + 1 == n ? pos : start + ((len * (k + 1) / n) & ~(int64_t)7) - 1;
}

/* out + j * hd = sum_s e^(scale q_j . K[s] - max_j) V[s] over s in [s0, s1] (unnormalised) for the n_q query
 * heads q_j = q + j * hd of one KV group; sums[j] = the sum of those exponentials, maxes[j] (when not NULL)
 * max_j. Both the one-part attention and each part run through here. */
static void attend_span(const void *K, const void *V, const int32_t *rows, int64_t s0, int64_t s1, int64_t hd,
                        float scale, const float *q, int64_t n_q, float *out, float *sums, float *maxes,
                        float *scores, int64_t span, int half) {
    key_scores(q, n_q, K, V, rows, s0, s1 + 1, hd, scale, scores, span, half);
    for (int64_t h = 0; h < n_q; h++) softmax_exps(scores + h * span, s0, s1, maxes ? maxes + h : NULL);
    if (half) values_of(V, rows, s0, s1, hd, n_q, out, scores, span, sums, 1);
    else values_of(V, rows, s0, s1, hd, n_q, out, scores, span, sums, 0);
}

/* attend_span's results for positions [s0, s1] as head j's part record at part + j * part_stride */
static void attend_part(const void *K, const void *V, const int32_t *rows, int64_t s0, int64_t s1, int64_t hd,
                        float scale, const float *q, int64_t n_q, float *part, int64_t part_stride, float *scores,
                        int64_t span, int half) {
    float o[n_q * hd], sums[TDM_MAX_GROUP], maxes[TDM_MAX_GROUP]; /* o: [n_q, hd] as values_of writes them */
    attend_span(K, V, rows, s0, s1, hd, scale, q, n_q, o, sums, maxes, scores, span, half);
    for (int64_t h = 0; h < n_q; h++) {
        float *rec = part + h * part_stride;
        memcpy(rec, o + h * hd, 4 * hd);
        rec[hd] = maxes[h], rec[hd + 1] = sums[h];
    }
}

/* out [hd] = one head's attention from its n part records (rec + k * PART_FLOATS(hd)): each part weighted
 * by e^(its max - the largest), in part order (libm's expf: n calls per head, not worth exp4_via_double's
 * lanes; every path merges through here, so the paths agree whichever exp it is) */
static void merge_parts(const float *rec, int64_t n, int64_t hd, float *out) {
    int64_t R = PART_FLOATS(hd), c = 0;
    float mx = -INFINITY, sum = 0.0f, w[TDM_MAX_SEGMENTS];
    for (int64_t k = 0; k < n; k++) mx = rec[k * R + hd] > mx ? rec[k * R + hd] : mx;
    for (int64_t k = 0; k < n; k++) {
        w[k] = expf(rec[k * R + hd] - mx);
        sum += rec[k * R + hd + 1] * w[k];
    }
    float inv = 1.0f / sum;
#ifdef TDM_SIMD
    for (; c + 8 <= hd; c += 8) { /* eight columns at a time, each summed over the parts in order */
        __m256 acc = _mm256_setzero_ps();
        for (int64_t k = 0; k < n; k++)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(rec + k * R + c), _mm256_set1_ps(w[k]), acc);
        _mm256_storeu_ps(out + c, _mm256_mul_ps(acc, _mm256_set1_ps(inv)));
    }
#endif
    for (; c < hd; c++) {
        float acc = 0.0f;
        for (int64_t k = 0; k < n; k++) acc = fmaf(rec[k * R + c], w[k], acc);
        out[c] = acc * inv;
    }
}

/* out + j * hd = softmax(scale * q_j . K[start..pos]) @ V[start..pos] for the n_q <= TDM_MAX_GROUP query heads
 * q_j = q + j * hd of one KV group (K, V: that group's rows, float16 where ``half``; rows: see kv_row;
 * scores: [n_q, span] scratch; parts: n_q * attend_segments * PART_FLOATS(hd) floats of scratch, used
 * past TDM_SEGMENT_POSITIONS positions). Each head's arithmetic is the same whatever n_q (the decode
 * step's and batch.h's tokens are bit-identical); the heads share each K and V row while it is in L1. */
static void attend_group(const void *K, const void *V, const int32_t *rows, int64_t start, int64_t pos,
                         int64_t hd, float scale, const float *q, int64_t n_q, float *out, float *scores,
                         int64_t span, int half, float *parts) {
    int64_t n = attend_segments(start, pos), R = PART_FLOATS(hd);
    if (n > 1) {
        for (int64_t k = 0, s0, s1; k < n; k++) {
            segment_bounds(start, pos, n, k, &s0, &s1);
            attend_part(K, V, rows, s0, s1, hd, scale, q, n_q, parts + k * R, n * R, scores, span, half);
        }
        for (int64_t h = 0; h < n_q; h++) merge_parts(parts + h * n * R, n, hd, out + h * hd);
        return;
    }
    float sums[TDM_MAX_GROUP];
    attend_span(K, V, rows, start, pos, hd, scale, q, n_q, out, sums, NULL, scores, span, half);
    for (int64_t h = 0; h < n_q; h++) {
        float inv = 1.0f / sums[h];
        for (int64_t k = 0; k < hd; k++) out[h * hd + k] *= inv;
    }
}

/* One token's units [lo, hi) of n_heads * n_seg (n_seg = attend_segments(start, pos); arguments as attend_token's):
 * unit ((g * n_seg + k) * rep + j) is head g * rep + j over part k; each run of one group's heads over one part
 * (at most per) goes through attend_group (one part: out directly) or attend_part (records at parts +
 * (h * n_seg + k) * PART_FLOATS(hd), merged by merge_heads once every thread is done). */
static void attend_units(void *K, void *V, int64_t kv_rows, int64_t lo, int64_t hi, int64_t rep, int64_t per,
                         int64_t start, int64_t pos, int64_t hd, float scale, const float *q, float *out, float *parts,
                         float *scores, int64_t span, int half) {
    int64_t n = attend_segments(start, pos), R = PART_FLOATS(hd);
    for (int64_t e = lo, n_q; e < hi; e += n_q) {
        int64_t j = e % rep, k = (e / rep) % n, g = e / (rep * n), h = g * rep + j, s0, s1;
        int64_t end = e - j + rep < hi ? e - j + rep : hi;
        n_q = end - e < per ? end - e : per;
        const void *Kg = kv_at(K, g * kv_rows, hd, half), *Vg = kv_at(V, g * kv_rows, hd, half);
        if (n == 1) {
            attend_group(Kg, Vg, NULL, start, pos, hd, scale, q + h * hd, n_q, out + h * hd, scores, span, half, NULL);
            continue;
        }
        segment_bounds(start, pos, n, k, &s0, &s1);
        attend_part(Kg, Vg, NULL, s0, s1, hd, scale, q + h * hd, n_q, parts + (h * n + k) * R, n * R, scores, span,
                    half);
    }
}

/* The attention output of attend_units' token: `out` itself for a one-part context, else every head's
 * parts merged into `merged` [n_heads, hd] (each thread merges them all into its own copy: no barrier) */
static const float *merge_heads(const float *out, const float *parts, int64_t n_heads, int64_t start, int64_t pos,
                                int64_t hd, float *merged) {
    int64_t n = attend_segments(start, pos);
    if (n == 1) return out;
    for (int64_t h = 0; h < n_heads; h++) merge_parts(parts + h * n * PART_FLOATS(hd), n, hd, merged + h * hd);
    return merged;
}

/* One token's attention on thread t of nt in the step's OpenMP region (attention_block; probe.h times it):
 * this thread's share of the units (chunk: decode.c), a barrier, the merged output. K, V: [n_kv, kv_rows, hd];
 * q, out: [n_heads, hd]; parts (shared): n_heads * attend_segments * PART_FLOATS(hd) floats; scores, merged:
 * this thread's [per, span], [n_heads, hd]. */
static const float *attend_token(void *K, void *V, int64_t kv_rows, int64_t n_heads, int64_t rep, int64_t per,
                                 int64_t start, int64_t pos, int64_t hd, float scale, const float *q, float *out,
                                 float *parts, float *scores, int64_t span, int half, float *merged, int t, int nt) {
    int64_t lo, hi;
    chunk(n_heads * attend_segments(start, pos), t, nt, &lo, &hi);
    attend_units(K, V, kv_rows, lo, hi, rep, per, start, pos, hd, scale, q, out, parts, scores, span, half);
#pragma omp barrier
    return merge_heads(out, parts, n_heads, start, pos, hd, merged);
}

#endif
