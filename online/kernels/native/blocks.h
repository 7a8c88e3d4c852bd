/* GGUF-block weight formats read in place (online/kernels/quantize.py, superblocks.py): int4 groups of
 * 32 with float16 scale and minimum (Q4_1) or float16 scale only (Q4_0: w = d (q - 8)), int8 blocks
 * of 32 with a float16 scale (Q8_0), and Q4_K super-blocks (256 weights: f16 d, dmin and twelve bytes
 * of 6-bit sub-block scales and minimums, codes in the int4 group-32 nibble order). A kernel expands
 * the scales of the rows it is about to read into float32 (exact: f16 -> f32, and Q4_K's d * sc and
 * dmin * m fit float32's mantissa) and runs the float-scale kernel of rows.h on a "shadow" descriptor:
 * the same products, so the same results as the float32-scale formats, from 0.5625-1.0625 B/weight.
 * Included by rows.h only (after the descriptors). */
#ifndef TANDEM_BLOCKS_H
#define TANDEM_BLOCKS_H

enum { KIND_I4H = 5, KIND_I8H = 6, KIND_Q4K = 7 };
#define QK_K 256 /* weights per k-quant super-block */
#define Q4K_SB_BYTES 16 /* per super-block: f16 d, f16 dmin, 12 bytes of 6-bit scales and minimums */

static inline int packed_scales(int64_t kind) { return kind == KIND_I4H || kind == KIND_I8H || kind == KIND_Q4K; }

static inline float f16_value(uint16_t v) {
#ifdef TDM_SIMD
    return _cvtsh_ss(v);
#else
    uint32_t sign = (uint32_t)(v >> 15) << 31, exp = (v >> 10) & 31, man = v & 1023, bits;
    if (exp == 0) { /* zero or subnormal */
        float f = ldexpf((float)man, -24);
        return sign ? -f : f;
    }
    if (exp == 31) bits = sign | 0x7F800000u | (man << 13);
    else bits = sign | ((exp + 112) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline void f16_row(const uint16_t *h, int64_t n, float *out) {
    int64_t i = 0;
#ifdef TDM_SIMD
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < n; i++) out[i] = f16_value(h[i]);
}

/* Q4_K: the eight sub-block scales d * sc and minimums -(dmin * m) of one super-block. The twelve
 * scale bytes hold sc, m for sub-blocks 0-3 in the low 6 bits of bytes 0-3 / 4-7, and for 4-7 the low /
 * high nibbles of bytes 8-11 plus the top 2 bits of bytes 0-3 / 4-7 (ggml's get_scale_min_k4), here
 * rearranged with 32-bit masks so bytes 0-7 are sc[0..7] and bytes 8-15 m[0..7]. */
static inline void q4k_superblock(const uint8_t *sb, float *d, float *m) {
    uint16_t hd, hm;
    uint32_t u[4];
    memcpy(&hd, sb, 2);
    memcpy(&hm, sb + 2, 2);
    memcpy(u, sb + 4, 12);
    const uint32_t low6 = 0x3f3f3f3fu, low4 = 0x0f0f0f0fu, low2 = 0x03030303u;
    u[3] = ((u[2] >> 4) & low4) | (((u[1] >> 6) & low2) << 4); /* m[4..7] */
    uint32_t m03 = u[1] & low6;                                  /* m[0..3] */
    u[1] = (u[2] & low4) | (((u[0] >> 6) & low2) << 4);         /* sc[4..7] */
    u[2] = m03;
    u[0] &= low6;                                                /* sc[0..3] */
    const uint8_t *b = (const uint8_t *)u;
    float D = f16_value(hd), M = f16_value(hm);
#ifdef TDM_SIMD
    __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)b)));
    __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 8))));
    _mm256_storeu_ps(d, _mm256_mul_ps(_mm256_set1_ps(D), sc));
    _mm256_storeu_ps(m, _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(M), mn), _mm256_set1_ps(-0.0f))); /* -(M mn) */
#else
    for (int j = 0; j < 8; j++) {
        d[j] = D * (float)b[j];
        m[j] = -(M * (float)b[8 + j]);
    }
#endif
}

/* d, m [n][cols / 32]: the float32 per-32 scales and minimums of rows r .. r+n-1 (m unused for int8) */
static void expand_scales(const tdm_weight *w, int64_t r, int64_t n, float *d, float *m) {
    int64_t ng = w->cols / 32, ss = w->scale_stride;
    for (int64_t k = 0; k < n; k++) {
        float *dk = d + k * ng, *mk = m + k * ng;
        if (w->kind == KIND_Q4K) {
            const uint8_t *sb = (const uint8_t *)w->scale + (r + k) * ss;
            for (int64_t s = 0; s < ng / 8; s++) q4k_superblock(sb + Q4K_SB_BYTES * s, dk + 8 * s, mk + 8 * s);
            continue;
        }
        f16_row((const uint16_t *)w->scale + (r + k) * ss, ng, dk);
        if (w->kind != KIND_I4H) continue;
        if (w->minimum) f16_row((const uint16_t *)w->minimum + (r + k) * ss, ng, mk);
        else for (int64_t g = 0; g < ng; g++) mk[g] = -8.0f * dk[g]; /* Q4_0: exact */
    }
}

/* sh = rows r .. r+n-1 of w as the float-scale format (KIND_I4 / KIND_I8B) over the scales in d, m
 * ([n][cols / 32] each, filled here); the codes are w's own bytes */
static inline void shadow_rows(const tdm_weight *w, int64_t r, int64_t n, float *d, float *m, tdm_weight *sh) {
    expand_scales(w, r, n, d, m);
    *sh = *w;
    sh->kind = w->kind == KIND_I8H ? KIND_I8B : KIND_I4;
    sh->group = 32;
    sh->rows = n;
    sh->data = w->data + r * w->row_bytes;
    sh->scale = d;
    sh->minimum = w->kind == KIND_I8H ? NULL : m;
    sh->scale_stride = w->cols / 32;
}
/* y [cols] += h * W[r] for a Q8_0 row with f16 scales (the sparse down projection's rows) */
static void axpy_row_i8h(const tdm_weight *w, int64_t r, float h, float *restrict y) {
    int64_t n = w->cols;
    const int8_t *restrict q = (const int8_t *)(w->data + r * w->row_bytes);
    const uint16_t *s = (const uint16_t *)w->scale + r * w->scale_stride;
    for (int64_t b = 0; b < n / 32; b++) {
        float a = h * f16_value(s[b]);
#ifdef TDM_SIMD
        __m256 av = _mm256_set1_ps(a);
        for (int c = 0; c < 32; c += 8) {
            float *yk = y + b * 32 + c;
            __m256 wv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + b * 32 + c))));
            _mm256_storeu_ps(yk, _mm256_fmadd_ps(av, wv, _mm256_loadu_ps(yk)));
        }
#else
        for (int k = 0; k < 32; k++) y[b * 32 + k] += a * (float)q[b * 32 + k];
#endif
    }
}

#ifdef TDM_SIMD
/* y [d] += sum_k h[k] * W[idx[k]] for four Q8_0 rows with f16 scales (y loaded and stored once per
 * four rows, the float32 operations of axpy_rows' fp16 kernel); fetches the rows at next[] meanwhile */
static void axpy4_i8h(const tdm_weight *w, const int32_t *idx, const float *h, const int32_t *next, float *restrict y) {
    int64_t rb = w->row_bytes, ss = w->scale_stride, nb = w->cols / 32;
    const int8_t *q[4];
    const uint16_t *s[4];
    for (int k = 0; k < 4; k++) {
        q[k] = (const int8_t *)(w->data + idx[k] * rb);
        s[k] = (const uint16_t *)w->scale + idx[k] * ss;
    }
    for (int64_t b = 0; b < nb; b++) {
        if (next && (b & 1) == 0)
            for (int k = 0; k < 4; k++) _mm_prefetch((const char *)(w->data + next[k] * rb) + 32 * b, _MM_HINT_T0);
        __m256 a0 = _mm256_set1_ps(h[0] * f16_value(s[0][b])), a1 = _mm256_set1_ps(h[1] * f16_value(s[1][b]));
        __m256 a2 = _mm256_set1_ps(h[2] * f16_value(s[2][b])), a3 = _mm256_set1_ps(h[3] * f16_value(s[3][b]));
        for (int c = 0; c < 32; c += 8) {
            int64_t k = b * 32 + c;
#define TDM_Q8_LANE(r) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q[r] + k))))
            __m256 a = _mm256_fmadd_ps(a0, TDM_Q8_LANE(0), _mm256_loadu_ps(y + k));
            __m256 e = _mm256_mul_ps(a1, TDM_Q8_LANE(1));
            a = _mm256_fmadd_ps(a2, TDM_Q8_LANE(2), a);
            e = _mm256_fmadd_ps(a3, TDM_Q8_LANE(3), e);
#undef TDM_Q8_LANE
            _mm256_storeu_ps(y + k, _mm256_add_ps(a, e));
        }
    }
}
#endif


/* The int4 row axpys (the sparse down projection as Q4_0 / Q4_1 rows, groups of 32 along d):
 * y += (h d[g]) q + h m[g] per group. d, m: the row's float32 scales and minimums (expanded). */
#ifdef TDM_SIMD
static inline void q4_lanes(const uint8_t *p, __m256 out[4]) { /* 16 bytes -> the 32 codes as 4 x 8 floats, in order */
    __m128i raw = _mm_loadu_si128((const __m128i *)p), low = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(raw, low), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    out[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    out[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}
#endif

static void axpy_row_q4(const uint8_t *p, const float *d, const float *m, int64_t ng, float h, float *restrict y) {
    for (int64_t g = 0; g < ng; g++) {
        float a = h * d[g], c = h * m[g];
#ifdef TDM_SIMD
        __m256 q[4], av = _mm256_set1_ps(a), cv = _mm256_set1_ps(c);
        q4_lanes(p + 16 * g, q);
        for (int l = 0; l < 4; l++) {
            float *yk = y + 32 * g + 8 * l;
            _mm256_storeu_ps(yk, _mm256_add_ps(_mm256_loadu_ps(yk), _mm256_fmadd_ps(av, q[l], cv)));
        }
#else
        for (int k = 0; k < 16; k++) {
            y[32 * g + k] += a * (float)(p[16 * g + k] & 15) + c;
            y[32 * g + 16 + k] += a * (float)(p[16 * g + k] >> 4) + c;
        }
#endif
    }
}

/* y += h * W[r] for int4 rows of groups of 32 (KIND_I4 with group 32, KIND_I4H) */
static void axpy_row_i4(const tdm_weight *w, int64_t r, float h, float *restrict y) {
    int64_t ng = w->cols / 32;
    const uint8_t *p = w->data + r * w->row_bytes;
    if (w->kind == KIND_I4) {
        axpy_row_q4(p, w->scale + r * w->scale_stride, w->minimum + r * w->scale_stride, ng, h, y);
        return;
    }
    float d[ng], m[ng];
    expand_scales(w, r, 1, d, m);
    axpy_row_q4(p, d, m, ng, h, y);
}

#ifdef TDM_SIMD
/* the same for four rows idx[0..3] (y loaded and stored once per four); fetches the rows at next[] */
static void axpy4_i4(const tdm_weight *w, const int32_t *idx, const float *h, const int32_t *next, float *restrict y) {
    int64_t ng = w->cols / 32, rb = w->row_bytes, ss = w->scale_stride;
    float dx[4 * ng], mx[4 * ng];
    const float *d[4], *m[4];
    const uint8_t *p[4];
    for (int k = 0; k < 4; k++) {
        p[k] = w->data + idx[k] * rb;
        if (w->kind == KIND_I4) {
            d[k] = w->scale + idx[k] * ss;
            m[k] = w->minimum + idx[k] * ss;
        } else {
            expand_scales(w, idx[k], 1, dx + k * ng, mx + k * ng);
            d[k] = dx + k * ng;
            m[k] = mx + k * ng;
        }
    }
    for (int64_t g = 0; g < ng; g++) {
        if (next && (g & 3) == 0)
            for (int k = 0; k < 4; k++) _mm_prefetch((const char *)(w->data + next[k] * rb) + 16 * g, _MM_HINT_T0);
        __m256 q0[4], q1[4], q2[4], q3[4];
        q4_lanes(p[0] + 16 * g, q0), q4_lanes(p[1] + 16 * g, q1), q4_lanes(p[2] + 16 * g, q2), q4_lanes(p[3] + 16 * g, q3);
        __m256 a0 = _mm256_set1_ps(h[0] * d[0][g]), c0 = _mm256_set1_ps(h[0] * m[0][g]);
        __m256 a1 = _mm256_set1_ps(h[1] * d[1][g]), c1 = _mm256_set1_ps(h[1] * m[1][g]);
        __m256 a2 = _mm256_set1_ps(h[2] * d[2][g]), c2 = _mm256_set1_ps(h[2] * m[2][g]);
        __m256 a3 = _mm256_set1_ps(h[3] * d[3][g]), c3 = _mm256_set1_ps(h[3] * m[3][g]);
        for (int l = 0; l < 4; l++) {
            float *yk = y + 32 * g + 8 * l;
            __m256 s01 = _mm256_add_ps(_mm256_fmadd_ps(a0, q0[l], c0), _mm256_fmadd_ps(a1, q1[l], c1));
            __m256 s23 = _mm256_add_ps(_mm256_fmadd_ps(a2, q2[l], c2), _mm256_fmadd_ps(a3, q3[l], c3));
            _mm256_storeu_ps(yk, _mm256_add_ps(_mm256_loadu_ps(yk), _mm256_add_ps(s01, s23)));
        }
    }
}
#endif
#endif
