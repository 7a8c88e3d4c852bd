/* Four-row dot kernels that read GGUF's f16 block scales in place (Q4_0 / Q4_1 as KIND_I4H, Q8_0 as
 * KIND_I8H; blocks.h): the scales of eight blocks are widened with F16C and multiplied by the
 * activation scales in one vector per row, and the minimum terms of Q4_1 (or -8 d of Q4_0) are widened
 * in the registers of the final sums. Each accumulator sees exactly the float operations of the
 * float32-scale kernels (dot4_i4g32 / dot4_i8 in rows.h: the same products d * xd, the same FMA chain
 * order, the same reductions), so results are bit-identical to them; what goes is the shadow
 * expansion (blocks.h: four rows' scales written to memory and read back), which cost up to ~20% on
 * narrow (576-wide) rows. Included by rows.h only, after the float-scale four-row kernels. */
#ifndef TANDEM_BLOCKS_DOT_H
#define TANDEM_BLOCKS_DOT_H
#ifdef TDM_SIMD

/* sc[k * 8 + j] = f16(d[k][b0 + j]) * xd[b0 + j] for the four rows k, blocks j < n (n <= 8) */
static inline void scales4_f16(const uint16_t *const d[4], const float *xd, int64_t b0, int64_t n, float *sc) {
    if (n == 8) {
        __m256 xv = _mm256_loadu_ps(xd + b0);
        for (int k = 0; k < 4; k++)
            _mm256_storeu_ps(sc + 8 * k, _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d[k] + b0))), xv));
        return;
    }
    for (int k = 0; k < 4; k++)
        for (int64_t j = 0; j < n; j++) sc[8 * k + j] = f16_value(d[k][b0 + j]) * xd[b0 + j];
}

/* eight f16 minimums of Q4_1 (or, with m NULL, Q4_0's -8 d: exact) as float32 */
static inline __m256 minimum8_f16(const uint16_t *d, const uint16_t *m) {
    if (m) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)m));
    return _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)d)), _mm256_set1_ps(-8.0f));
}

static inline float minimum_f16(const uint16_t *d, const uint16_t *m) { return m ? f16_value(*m) : -8.0f * f16_value(*d); }

/* out[k] = row k . x for four KIND_I4H rows: codes p[k], f16 scales d[k] and minimums m[k] (m NULL: Q4_0).
 * Prefetches ahead + 64 g (four contiguous rows on), or the rows at next_p / next_d (gathered), or nothing. */
static inline __attribute__((always_inline)) void dot4_i4h_core(const uint8_t *const p[4], const uint16_t *const d[4],
                                                                const uint16_t *const m[4], const qvec *x, int64_t ng,
                                                                const char *ahead, const uint8_t *const *next_p,
                                                                const uint16_t *const *next_d, float *out) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    float sc[32];
    for (int64_t g0 = 0; g0 < ng; g0 += 8) {
        int64_t n = ng - g0 < 8 ? ng - g0 : 8;
        scales4_f16(d, x->d, g0, n, sc);
        for (int64_t j = 0; j < n; j++) {
            int64_t g = g0 + j;
            if (ahead) _mm_prefetch(ahead + 64 * g, _MM_HINT_T0);
            if (next_p && (g & 3) == 0)
                for (int k = 0; k < 4; k++) _mm_prefetch((const char *)(next_p[k] + 16 * g), _MM_HINT_T0);
            if (next_d && (g & 31) == 0)
                for (int k = 0; k < 4; k++) _mm_prefetch((const char *)(next_d[k] + g), _MM_HINT_T0);
            __m256i xv = _mm256_loadu_si256((const __m256i *)(x->q + 32 * g));
            for (int k = 0; k < 4; k++)
                acc[k] = _mm256_fmadd_ps(_mm256_broadcast_ss(sc + 8 * k + j), dot32_u8s8(nibbles32(p[k] + 16 * g), xv),
                                         acc[k]);
        }
    }
    for (int64_t f = 0; f < x->n_flagged; f++) { /* finish4_i4g32's tail on f16 scales */
        int64_t g = x->flagged[f];
        __m256i xv = _mm256_loadu_si256((const __m256i *)(x->r + 32 * g));
        for (int k = 0; k < 4; k++)
            acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(f16_value(d[k][g]) * x->dr[g]), dot32_u8s8(nibbles32(p[k] + 16 * g), xv),
                                     acc[k]);
    }
    __m256 s[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t g = 0;
    for (; g + 8 <= ng; g += 8) {
        __m256 xs = _mm256_loadu_ps(x->s + g);
        for (int k = 0; k < 4; k++) s[k] = _mm256_fmadd_ps(minimum8_f16(d[k] + g, m[k] ? m[k] + g : NULL), xs, s[k]);
    }
    _mm_storeu_ps(out, _mm_add_ps(hsum4x8(acc[0], acc[1], acc[2], acc[3]), hsum4x8(s[0], s[1], s[2], s[3])));
    for (; g < ng; g++)
        for (int k = 0; k < 4; k++) out[k] += minimum_f16(d[k] + g, m[k] ? m[k] + g : NULL) * x->s[g];
}

/* rows r..r+3 (dot4_i4g32's arithmetic on f16 scales) */
static void dot4_i4h(const tdm_weight *w, int64_t r, const qvec *x, float *out) {
    int64_t rb = w->row_bytes, ss = w->scale_stride;
    const uint8_t *p[4];
    const uint16_t *d[4], *m[4];
    for (int k = 0; k < 4; k++) {
        p[k] = w->data + (r + k) * rb;
        d[k] = (const uint16_t *)w->scale + (r + k) * ss;
        m[k] = w->minimum ? (const uint16_t *)w->minimum + (r + k) * ss : NULL;
    }
    dot4_i4h_core(p, d, m, x, w->cols / 32, (const char *)(p[0] + 8 * rb), NULL, NULL, out);
}

/* four gathered rows rows[0..3] (predict.h's dot4_i4g32_idx on f16 scales); fetches the rows at next[] (NULL: none) */
static void dot4_i4h_idx(const tdm_weight *w, const int32_t *rows, const int32_t *next, const qvec *x, float *out) {
    int64_t rb = w->row_bytes, ss = w->scale_stride;
    const uint8_t *p[4], *np[4];
    const uint16_t *d[4], *m[4], *nd[4];
    for (int k = 0; k < 4; k++) {
        p[k] = w->data + rows[k] * rb;
        d[k] = (const uint16_t *)w->scale + rows[k] * ss;
        m[k] = w->minimum ? (const uint16_t *)w->minimum + rows[k] * ss : NULL;
        if (next) np[k] = w->data + next[k] * rb, nd[k] = (const uint16_t *)w->scale + next[k] * ss;
    }
    if (next) dot4_i4h_core(p, d, m, x, w->cols / 32, NULL, np, nd, out);
    else dot4_i4h_core(p, d, m, x, w->cols / 32, NULL, NULL, NULL, out);
}

/* out[k] = row k . x for four KIND_I8H rows: codes q[k], f16 scales s[k] (dot4_i8's blocked arithmetic on
 * f16 scales). Prefetches ahead + 128 b (four contiguous rows on), or the rows at next_q / next_s
 * (gathered), or nothing. */
static inline __attribute__((always_inline)) void dot4_i8h_core(const int8_t *const q[4], const uint16_t *const s[4],
                                                                const qvec *x, int64_t nb, const char *ahead,
                                                                const int8_t *const *next_q,
                                                                const uint16_t *const *next_s, float *out) {
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    float sc[32];
    for (int64_t b0 = 0; b0 < nb; b0 += 8) {
        int64_t n = nb - b0 < 8 ? nb - b0 : 8;
        scales4_f16(s, x->d, b0, n, sc);
        for (int64_t j = 0; j < n; j++) {
            int64_t b = b0 + j;
            if (ahead) {
                _mm_prefetch(ahead + 128 * b, _MM_HINT_T0);
                _mm_prefetch(ahead + 128 * b + 64, _MM_HINT_T0);
            }
            if (next_q && (b & 1) == 0)
                for (int k = 0; k < 4; k++) _mm_prefetch((const char *)(next_q[k] + 32 * b), _MM_HINT_T0);
            if (next_s && (b & 31) == 0)
                for (int k = 0; k < 4; k++) _mm_prefetch((const char *)(next_s[k] + b), _MM_HINT_T0);
            __m256i xv = _mm256_loadu_si256((const __m256i *)(x->q + 32 * b));
            for (int k = 0; k < 4; k++)
                a[k] = _mm256_fmadd_ps(_mm256_broadcast_ss(sc + 8 * k + j),
                                       dot32_s8s8(_mm256_loadu_si256((const __m256i *)(q[k] + 32 * b)), xv), a[k]);
        }
    }
    for (int64_t f = 0; f < x->n_flagged; f++) {
        int64_t b = x->flagged[f];
        __m256i xv = _mm256_loadu_si256((const __m256i *)(x->r + 32 * b));
        for (int k = 0; k < 4; k++)
            a[k] = _mm256_fmadd_ps(_mm256_set1_ps(f16_value(s[k][b]) * x->dr[b]),
                                   dot32_s8s8(_mm256_loadu_si256((const __m256i *)(q[k] + 32 * b)), xv), a[k]);
    }
    _mm_storeu_ps(out, hsum4x8(a[0], a[1], a[2], a[3]));
}

/* out[0..3] = rows r..r+3 . x for KIND_I8H */
static void dot4_i8h(const tdm_weight *w, int64_t r, const qvec *x, float *out) {
    int64_t rb = w->row_bytes, ss = w->scale_stride;
    const int8_t *q0 = (const int8_t *)(w->data + r * rb);
    const uint16_t *s0 = (const uint16_t *)w->scale + r * ss;
    const int8_t *q[4] = {q0, q0 + rb, q0 + 2 * rb, q0 + 3 * rb};
    const uint16_t *s[4] = {s0, s0 + ss, s0 + 2 * ss, s0 + 3 * ss};
    dot4_i8h_core(q, s, x, w->cols / 32, (const char *)(q0 + 8 * rb), NULL, NULL, out);
}

/* four gathered KIND_I8H rows rows[0..3]; fetches the rows at next[] meanwhile (NULL: none) */
static void dot4_i8h_idx(const tdm_weight *w, const int32_t *rows, const int32_t *next, const qvec *x, float *out) {
    int64_t rb = w->row_bytes, ss = w->scale_stride;
    const int8_t *q[4], *nq[4];
    const uint16_t *s[4], *ns[4];
    for (int k = 0; k < 4; k++) {
        q[k] = (const int8_t *)(w->data + rows[k] * rb);
        s[k] = (const uint16_t *)w->scale + rows[k] * ss;
        if (next) nq[k] = (const int8_t *)(w->data + next[k] * rb), ns[k] = (const uint16_t *)w->scale + next[k] * ss;
    }
    if (next) dot4_i8h_core(q, s, x, w->cols / 32, NULL, nq, ns, out);
    else dot4_i8h_core(q, s, x, w->cols / 32, NULL, NULL, NULL, out);
}

#endif
#endif
