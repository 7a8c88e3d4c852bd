/* KIND_I8X8: Q8_0 rows interleaved eight at a time (blocks_x8.h's idea for int8 codes; the fused
 * step's output layer is Q8_0 in SmolLM2's GGUF). Row group R, block g (32 columns) is
 * X8_I8_BLOCK_BYTES = 272 bytes at data + (R * ng + g) * 272:
 *   bytes [32 v, 32 v + 32), v < 8: lane j (4 bytes) holds row 8R+j's codes of columns 32 g + 4 v + b, b < 4;
 *   bytes [256, 272): the eight rows' f16 scales.
 * row_bytes is 34 per block of 32 columns (272 / 8: 34 ng). Per row and token (every lane and dot_row_x8_i8):
 *   acc = 0; for g: acc = fma(d[g] * xd[g], (float)(codes_g . xq_g), acc); then the flagged residual
 *   blocks in order with xdr / xr; out = acc.
 * A block's exact int32 dot is |w| . sign(x, w) per four columns (vpmaddubsw: pairs <= 2 * 128 * 127
 * fit int16), widened with vpmaddwd and summed in int32: no convert or FMA per row and block.
 * Included by blocks_x8.h only. */
#ifndef TANDEM_BLOCKS_X8_I8_H
#define TANDEM_BLOCKS_X8_I8_H

enum { KIND_I8X8 = 12 };
#define X8_I8_BLOCK_BYTES 272

static inline const uint8_t *x8_i8_block(const tdm_weight *w, int64_t group, int64_t g) {
    return w->data + (group * (w->cols / 32) + g) * X8_I8_BLOCK_BYTES;
}

/* row r . x in the lane arithmetic above */
static float dot_row_x8_i8(const tdm_weight *w, int64_t r, const qvec *x) {
    int64_t ng = w->cols / 32, j = r % X8_ROWS;
    float acc = 0.0f;
    for (int64_t e = -1; e < x->n_flagged; e++) { /* e = -1: the main blocks; then each flagged block */
        int64_t g0 = e < 0 ? 0 : x->flagged[e], g1 = e < 0 ? ng : g0 + 1;
        const int8_t *q = e < 0 ? x->q : x->r;
        for (int64_t g = g0; g < g1; g++) {
            const uint8_t *o = x8_i8_block(w, r / X8_ROWS, g);
            int32_t s = 0;
            for (int v = 0; v < 8; v++)
                for (int b = 0; b < 4; b++) s += (int8_t)o[32 * v + 4 * j + b] * q[32 * g + 4 * v + b];
            acc = fmaf(f16_value(((const uint16_t *)(o + 256))[j]) * (e < 0 ? x->d[g] : x->dr[g]), (float)s, acc);
        }
    }
    return acc;
}

#ifdef TDM_SIMD
/* s + the exact int32 sums of |w| (u8, <= 128) x sign(x, w) (s8) per lane: VNNI's vpdpbusd, or vpmaddubsw's
 * int16 pairs (<= 2 x 128 x 127) widened by vpmaddwd; the same integers */
static inline __m256i x8_i8_more(__m256i s, __m256i aw, __m256i sx) {
#ifdef TDM_VNNI
    return tdm_dpbusd(s, aw, sx);
#else
    return _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), _mm256_set1_epi16(1)));
#endif
}

/* the exact int32 dot products of one block (codes at o) with a token's 32 codes q, eight rows */
static inline __m256i x8_i8_block_dot(const uint8_t *o, const int8_t *q) {
    __m256i s = _mm256_setzero_si256();
    for (int v = 0; v < 8; v++) {
        __m256i w = _mm256_loadu_si256((const __m256i *)(o + 32 * v));
        s = x8_i8_more(s, _mm256_sign_epi8(w, w), _mm256_sign_epi8(x8_bcast(q + 4 * v), w));
    }
    return s;
}

/* acc + the token's flagged residual blocks in order (w8: the row group's first block; dk [ng]: its scales) */
static inline __m256 x8_i8_residuals(const uint8_t *w8, const __m256 *dk, const qvec *xe, __m256 acc) {
    for (int64_t f = 0; f < xe->n_flagged; f++) {
        int64_t g = xe->flagged[f];
        acc = _mm256_fmadd_ps(_mm256_mul_ps(dk[g], _mm256_broadcast_ss(xe->dr + g)),
                              _mm256_cvtepi32_ps(x8_i8_block_dot(w8 + g * X8_I8_BLOCK_BYTES, xe->r + 32 * g)), acc);
    }
    return acc;
}

/* out[0..8) = rows 8 group .. 8 group + 7 . x (one token) */
static void dot8_x8_i8(const tdm_weight *w, int64_t group, const qvec *x, float *out) {
    int64_t ng = w->cols / 32;
    const uint8_t *o = x8_i8_block(w, group, 0);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; g++, o += X8_I8_BLOCK_BYTES) {
        for (int k = 0; k < 5; k++) _mm_prefetch((const char *)o + 2176 + 64 * k, _MM_HINT_T0); /* 8 blocks on */
        __m256 dk = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + 256)));
        acc = _mm256_fmadd_ps(_mm256_mul_ps(dk, _mm256_broadcast_ss(x->d + g)),
                              _mm256_cvtepi32_ps(x8_i8_block_dot(o, x->q + 32 * g)), acc);
    }
    for (int64_t f = 0; f < x->n_flagged; f++) {
        int64_t g = x->flagged[f];
        const uint8_t *b = x8_i8_block(w, group, g);
        __m256 dk = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 256)));
        acc = _mm256_fmadd_ps(_mm256_mul_ps(dk, _mm256_broadcast_ss(x->dr + g)),
                              _mm256_cvtepi32_ps(x8_i8_block_dot(b, x->r + 32 * g)), acc);
    }
    _mm256_storeu_ps(out, acc);
}

/* NT (1, 2 or 4) tokens against one group: aw [ng][8] its |w| (L1), dk [ng] its scales */
static inline __attribute__((always_inline)) void x8_i8_tokens(const tdm_weight *w, int64_t group, const __m256i *aw,
                                                                const __m256 *dk, int64_t ng, const qvec *x, int nt,
                                                                float *out, int64_t os) {
    __m256 acc[4];
    for (int e = 0; e < nt; e++) acc[e] = _mm256_setzero_ps();
    const uint8_t *o = x8_i8_block(w, group, 0);
    for (int64_t g = 0; g < ng; g++, o += X8_I8_BLOCK_BYTES) {
        __m256i s[4];
        for (int e = 0; e < nt; e++) s[e] = _mm256_setzero_si256();
        for (int v = 0; v < 8; v++) {
            __m256i wv = _mm256_loadu_si256((const __m256i *)(o + 32 * v)), a = _mm256_load_si256(aw + 8 * g + v);
            TDM_X8_IN_REGISTER(wv);
            TDM_X8_IN_REGISTER(a);
            for (int e = 0; e < nt; e++) {
                s[e] = x8_i8_more(s[e], a, _mm256_sign_epi8(x8_bcast(x[e].q + 32 * g + 4 * v), wv));
                TDM_X8_IN_REGISTER(s[e]);
            }
        }
        for (int e = 0; e < nt; e++)
            acc[e] = _mm256_fmadd_ps(_mm256_mul_ps(dk[g], _mm256_broadcast_ss(x[e].d + g)), _mm256_cvtepi32_ps(s[e]), acc[e]);
    }
    for (int e = 0; e < nt; e++)
        _mm256_storeu_ps(out + e * os, x8_i8_residuals(x8_i8_block(w, group, 0), dk, x + e, acc[e]));
}

/* out[i * os + j] = row 8 group + j . x[i] for T tokens: |w| and the scales formed once per group */
static void dot8_x8_i8_multi(const tdm_weight *w, int64_t group, const qvec *x, int64_t T, float *out, int64_t os) {
    int64_t ng = w->cols / 32, i = 0;
    __m256i aw[8 * ng] __attribute__((aligned(32)));
    __m256 dk[ng];
    const uint8_t *o = x8_i8_block(w, group, 0);
    for (int64_t g = 0; g < ng; g++, o += X8_I8_BLOCK_BYTES) {
        for (int k = 0; k < 5; k++) _mm_prefetch((const char *)o + ng * X8_I8_BLOCK_BYTES + 64 * k, _MM_HINT_T0);
        for (int v = 0; v < 8; v++) {
            __m256i wv = _mm256_loadu_si256((const __m256i *)(o + 32 * v));
            aw[8 * g + v] = _mm256_sign_epi8(wv, wv);
        }
        dk[g] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + 256)));
    }
    for (; i + 4 <= T; i += 4) x8_i8_tokens(w, group, aw, dk, ng, x + i, 4, out + i * os, os);
    if (i + 2 <= T) x8_i8_tokens(w, group, aw, dk, ng, x + i, 2, out + i * os, os), i += 2;
    if (i < T) x8_i8_tokens(w, group, aw, dk, ng, x + i, 1, out + i * os, os);
}
#endif

/* out (uint8 [ceil(rows / 8) * ng * 272]) = the KIND_I8H weight w interleaved as above */
static void repack_i8x8(const tdm_weight *w, uint8_t *out) {
    int64_t ng = w->cols / 32, groups = (w->rows + X8_ROWS - 1) / X8_ROWS;
    memset(out, 0, (size_t)(groups * ng * X8_I8_BLOCK_BYTES));
    for (int64_t r = 0; r < w->rows; r++)
        for (int64_t g = 0; g < ng; g++) {
            uint8_t *o = out + ((r / X8_ROWS) * ng + g) * X8_I8_BLOCK_BYTES;
            const uint8_t *p = w->data + r * w->row_bytes + 32 * g;
            for (int v = 0; v < 8; v++) memcpy(o + 32 * v + 4 * (r % X8_ROWS), p + 4 * v, 4);
            ((uint16_t *)(o + 256))[r % X8_ROWS] = ((const uint16_t *)w->scale)[r * w->scale_stride + g];
        }
}

#endif
