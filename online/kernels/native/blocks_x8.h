/* KIND_I4X8: Q4_0 / Q4_1 rows interleaved eight at a time (llama.cpp's "repacked" Q4_0x8 idea), so
 * that one vector lane is one row and a block's integer dot product needs no horizontal sum.
 *
 * Layout (tdm_repack_x8 builds it from a KIND_I4H weight): row group R (rows 8R..8R+7, the last
 * one zero-padded), block g (32 columns) is B bytes at data + (R * ng + g) * B, B = 160 (Q4_1) or
 * 144 (Q4_0: no minimums; they are -8 d, formed exactly in the kernel):
 *   bytes [32 v, 32 v + 32), v < 4: lane j (4 bytes) holds row 8R+j's codes of columns 32 g + 8 v + b
 *     (low nibble) and 32 g + 8 v + 4 + b (high nibble), b < 4;
 *   bytes [128, 144): the eight rows' f16 scales d; Q4_1: [144, 160) their f16 minimums.
 * row_bytes is ng * B / 8 (the same bytes per row as the GGUF blocks), which tells B apart.
 *
 * Arithmetic, per row and token (every lane, and the scalar dot_row_x8, does exactly this):
 *   acc = 0; for g: acc = fma(d[g] * xd[g], (float)(codes_g . xq_g), acc)      (exact int32 block dot)
 *   then the flagged residual blocks in order: acc = fma(d[g] * xdr[g], (float)(codes_g . xr_g), acc)
 *   m = 0; for g: m = fma(min[g], xs[g], m);  out = acc + m
 * The block dot is summed in int16 (16 products of |code| <= 15 and |x| <= 127 per lane: < 2^15) and
 * widened once per block, so a block costs 8 vpmaddubsw per eight rows instead of 8 x (vpmaddubsw,
 * vpmaddwd, convert, FMA); with VNNI, 8 vpdpbusd summing straight into int32 (the same integers). The
 * multi-token kernel unpacks a row group's nibbles once for all T tokens
 * and runs four tokens at a time; every token's result is bit-identical to the single-token kernel's
 * and to dot_row_x8's (tests: test_interleaved_rows.py). Included by rows.h only. */
#ifndef TANDEM_BLOCKS_X8_H
#define TANDEM_BLOCKS_X8_H

enum { KIND_I4X8 = 11 };
#define X8_ROWS 8
#define X8_BLOCK_BYTES 160

/* Keeps a vector in a register (see blocks_multi.h's TDM_IN_REGISTER) */
#ifdef __AVX512VL__ /* ("v": any of the 32 vector registers; "x": the first 16) */
#define TDM_X8_IN_REGISTER(v) __asm__("" : "+v"(v))
#else
#define TDM_X8_IN_REGISTER(v) __asm__("" : "+x"(v))
#endif

/* bytes per block of eight rows: 160 with minimums (Q4_1), 144 without (Q4_0) */
static inline int64_t x8_block_bytes(const tdm_weight *w) { return w->row_bytes * X8_ROWS / (w->cols / 32); }

static inline const uint8_t *x8_block(const tdm_weight *w, int64_t group, int64_t g) {
    return w->data + (group * (w->cols / 32) + g) * x8_block_bytes(w);
}

/* lane j's minimum of block o: Q4_1's f16 minimum, or Q4_0's -8 d (exact) */
static inline float x8_minimum(const uint8_t *o, int64_t block_bytes, int64_t j) {
    return block_bytes == X8_BLOCK_BYTES ? f16_value(((const uint16_t *)(o + 144))[j])
                                         : -8.0f * f16_value(((const uint16_t *)(o + 128))[j]);
}

/* row r . x in the lane arithmetic above (edge rows of a range, gathered rows, the portable build) */
static float dot_row_x8(const tdm_weight *w, int64_t r, const qvec *x) {
    int64_t ng = w->cols / 32, j = r % X8_ROWS;
    float acc = 0.0f, m = 0.0f;
    for (int64_t e = -1; e < x->n_flagged; e++) { /* e = -1: the main blocks; then each flagged block */
        int64_t g0 = e < 0 ? 0 : x->flagged[e], g1 = e < 0 ? ng : g0 + 1;
        const int8_t *q = e < 0 ? x->q : x->r;
        for (int64_t g = g0; g < g1; g++) {
            const uint8_t *o = x8_block(w, r / X8_ROWS, g);
            int32_t s = 0;
            for (int v = 0; v < 4; v++)
                for (int b = 0; b < 4; b++) {
                    uint8_t c = o[32 * v + 4 * j + b];
                    s += (c & 15) * q[32 * g + 8 * v + b] + (c >> 4) * q[32 * g + 8 * v + 4 + b];
                }
            float xd = e < 0 ? x->d[g] : x->dr[g];
            acc = fmaf(f16_value(((const uint16_t *)(o + 128))[j]) * xd, (float)s, acc);
        }
    }
    for (int64_t g = 0; g < ng; g++) m = fmaf(x8_minimum(x8_block(w, r / X8_ROWS, g), x8_block_bytes(w), j), x->s[g], m);
    return acc + m;
}

#ifdef TDM_SIMD
static inline __m256i x8_bcast(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* A block's products of codes c (u8) and activations a (s8), summed per lane: x8_first, x8_more for the
 * next four columns, x8_widen for the exact int32 sums. VNNI sums into int32 lanes; AVX2 into int16 lanes
 * (pairs from vpmaddubsw, no overflow: < 2^15), widened once. Both are exact: the same bits. */
#ifdef TDM_VNNI
static inline __m256i x8_first(__m256i c, __m256i a) { return tdm_dpbusd(_mm256_setzero_si256(), c, a); }
static inline __m256i x8_more(__m256i s, __m256i c, __m256i a) { return tdm_dpbusd(s, c, a); }
static inline __m256i x8_widen(__m256i s) { return s; }
#else
static inline __m256i x8_first(__m256i c, __m256i a) { return _mm256_maddubs_epi16(c, a); }
static inline __m256i x8_more(__m256i s, __m256i c, __m256i a) {
    return _mm256_add_epi16(s, _mm256_maddubs_epi16(c, a));
}
static inline __m256i x8_widen(__m256i s) { return _mm256_madd_epi16(s, _mm256_set1_epi16(1)); }
#endif

/* the exact int32 dot products of one unpacked block (c[8]) with a token's 32 codes q, eight rows */
static inline __m256i x8_block_dot(const __m256i *c, const int8_t *q) {
    __m256i s = x8_first(c[0], x8_bcast(q));
    for (int v = 1; v < 8; v++) s = x8_more(s, c[v], x8_bcast(q + 4 * v));
    return x8_widen(s);
}

/* the eight rows' minimums of block o (Q4_0: -8 d, exact) */
static inline __m256 x8_minimum8(const uint8_t *o, int64_t block_bytes) {
    if (block_bytes == X8_BLOCK_BYTES) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + 144)));
    return _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + 128))), _mm256_set1_ps(-8.0f));
}

static inline void x8_unpack(const uint8_t *o, __m256i *c) {
    const __m256i lo = _mm256_set1_epi8(15);
    for (int v = 0; v < 4; v++) {
        __m256i p = _mm256_loadu_si256((const __m256i *)(o + 32 * v));
        c[2 * v] = _mm256_and_si256(p, lo);
        c[2 * v + 1] = _mm256_and_si256(_mm256_srli_epi16(p, 4), lo);
    }
}

/* out[0..8) = rows 8 group .. 8 group + 7 . x (one token; nibbles unpacked in registers) */
static void dot8_x8(const tdm_weight *w, int64_t group, const qvec *x, float *out) {
    int64_t ng = w->cols / 32, bb = x8_block_bytes(w);
    const uint8_t *o = x8_block(w, group, 0);
    __m256 acc = _mm256_setzero_ps(), m = _mm256_setzero_ps();
    __m256i c[8];
    for (int64_t g = 0; g < ng; g++, o += bb) {
        /* 16 blocks on (~8 before 2026-11-29; from memory, one thread: 1.06-1.13x the speed; the step: 0.95-0.98x
         * the time) */
        _mm_prefetch((const char *)o + 16 * bb, _MM_HINT_T0);
        _mm_prefetch((const char *)o + 16 * bb + 64, _MM_HINT_T0);
        _mm_prefetch((const char *)o + 16 * bb + 128, _MM_HINT_T0);
        x8_unpack(o, c);
        __m256 dk = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + 128)));
        acc = _mm256_fmadd_ps(_mm256_mul_ps(dk, _mm256_broadcast_ss(x->d + g)),
                              _mm256_cvtepi32_ps(x8_block_dot(c, x->q + 32 * g)), acc);
        m = _mm256_fmadd_ps(x8_minimum8(o, bb), _mm256_broadcast_ss(x->s + g), m);
    }
    for (int64_t f = 0; f < x->n_flagged; f++) {
        int64_t g = x->flagged[f];
        const uint8_t *b = x8_block(w, group, g);
        x8_unpack(b, c);
        __m256 dk = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 128)));
        acc = _mm256_fmadd_ps(_mm256_mul_ps(dk, _mm256_broadcast_ss(x->dr + g)),
                              _mm256_cvtepi32_ps(x8_block_dot(c, x->r + 32 * g)), acc);
    }
    _mm256_storeu_ps(out, _mm256_add_ps(acc, m));
}

/* NT (1, 2 or 4) tokens of dot8_x8_multi against the unpacked group (cb [ng][8], dk [ng]): out = acc
 * (the minimums' sums are added by x8_minimums) */
static inline __attribute__((always_inline)) void x8_tokens(const __m256i *cb, const __m256 *dk, int64_t ng,
                                                             const qvec *x, int nt, float *out, int64_t os) {
    __m256 acc[4];
    for (int e = 0; e < nt; e++) acc[e] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m256i s[4];
        for (int v = 0; v < 8; v++) {
            __m256i c = _mm256_load_si256(cb + 8 * g + v);
            TDM_X8_IN_REGISTER(c);
            for (int e = 0; e < nt; e++) {
                __m256i a = x8_bcast(x[e].q + 32 * g + 4 * v);
                s[e] = v ? x8_more(s[e], c, a) : x8_first(c, a);
                TDM_X8_IN_REGISTER(s[e]); /* summed as it comes: no tree of 8 x nt live products */
            }
        }
        for (int e = 0; e < nt; e++)
            acc[e] = _mm256_fmadd_ps(_mm256_mul_ps(dk[g], _mm256_broadcast_ss(x[e].d + g)),
                                     _mm256_cvtepi32_ps(x8_widen(s[e])), acc[e]);
    }
    for (int e = 0; e < nt; e++) {
        const qvec *xe = x + e;
        for (int64_t f = 0; f < xe->n_flagged; f++) {
            int64_t g = xe->flagged[f];
            acc[e] = _mm256_fmadd_ps(_mm256_mul_ps(dk[g], _mm256_broadcast_ss(xe->dr + g)),
                                     _mm256_cvtepi32_ps(x8_block_dot(cb + 8 * g, xe->r + 32 * g)), acc[e]);
        }
        _mm256_storeu_ps(out + e * os, acc[e]);
    }
}

/* out[e * os + j] += m of token e (the in-order FMA chain over the blocks' minimums, mk [ng]) for NT
 * (<= 8) tokens: one chain per token, interleaved, so the FMA latency is paid once for all of them */
static inline __attribute__((always_inline)) void x8_minimums(const __m256 *mk, int64_t ng, const qvec *x, int nt,
                                                               float *out, int64_t os) {
    __m256 m[8];
    for (int e = 0; e < nt; e++) m[e] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m256 k = mk[g];
        for (int e = 0; e < nt; e++) m[e] = _mm256_fmadd_ps(k, _mm256_broadcast_ss(x[e].s + g), m[e]);
    }
    for (int e = 0; e < nt; e++) _mm256_storeu_ps(out + e * os, _mm256_add_ps(_mm256_loadu_ps(out + e * os), m[e]));
}

/* out[i * os + j] = row 8 group + j . x[i] for T tokens: the group's nibbles and scales unpacked once */
static void dot8_x8_multi(const tdm_weight *w, int64_t group, const qvec *x, int64_t T, float *out, int64_t os) {
    int64_t ng = w->cols / 32, bb = x8_block_bytes(w), i = 0;
    __m256i cb[8 * ng] __attribute__((aligned(32)));
    __m256 dk[ng], mk[ng];
    const uint8_t *o = x8_block(w, group, 0);
    for (int64_t g = 0; g < ng; g++, o += bb) {
        _mm_prefetch((const char *)o + ng * bb, _MM_HINT_T0); /* the next group, as far ahead */
        _mm_prefetch((const char *)o + ng * bb + 64, _MM_HINT_T0);
        _mm_prefetch((const char *)o + ng * bb + 128, _MM_HINT_T0);
        x8_unpack(o, cb + 8 * g);
        dk[g] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + 128)));
        mk[g] = x8_minimum8(o, bb);
    }
    for (; i + 4 <= T; i += 4) x8_tokens(cb, dk, ng, x + i, 4, out + i * os, os);
    if (i + 2 <= T) x8_tokens(cb, dk, ng, x + i, 2, out + i * os, os), i += 2;
    if (i < T) x8_tokens(cb, dk, ng, x + i, 1, out + i * os, os);
    for (i = 0; i + 8 <= T; i += 8) x8_minimums(mk, ng, x + i, 8, out + i * os, os);
    if (i + 4 <= T) x8_minimums(mk, ng, x + i, 4, out + i * os, os), i += 4;
    if (i + 2 <= T) x8_minimums(mk, ng, x + i, 2, out + i * os, os), i += 2;
    if (i < T) x8_minimums(mk, ng, x + i, 1, out + i * os, os);
}
#endif

#include "blocks_x8_i8.h" /* the Q8_0 twin (KIND_I8X8) */
#include "blocks_amx.h"   /* its multi-token products on AMX tiles, where the CPU has them */

static inline int is_x8(int64_t kind) { return kind == KIND_I4X8 || kind == KIND_I8X8; }

static inline float dot_row_any_x8(const tdm_weight *w, int64_t r, const qvec *x) {
    return w->kind == KIND_I8X8 ? dot_row_x8_i8(w, r, x) : dot_row_x8(w, r, x);
}

/* out[i] = W[r0 + i] . x, i < n: whole row groups eight at a time, the rows either side one by one */
static void dot_rows_x8(const tdm_weight *w, int64_t r0, int64_t n, const qvec *x, float *out) {
    int64_t i = 0;
    for (; i < n && (r0 + i) % X8_ROWS; i++) out[i] = dot_row_any_x8(w, r0 + i, x);
#ifdef TDM_SIMD
    for (; i + X8_ROWS <= n; i += X8_ROWS)
        if (w->kind == KIND_I8X8) dot8_x8_i8(w, (r0 + i) / X8_ROWS, x, out + i);
        else dot8_x8(w, (r0 + i) / X8_ROWS, x, out + i);
#endif
    for (; i < n; i++) out[i] = dot_row_any_x8(w, r0 + i, x);
}

/* dot_rows_x8 for T tokens (out[t * os + i]); each token's values are dot_rows_x8's */
static void dot_rows_x8_multi(const tdm_weight *w, int64_t r0, int64_t n, const qvec *x, int64_t T, float *out,
                              int64_t os) {
    int64_t i = 0;
    for (; i < n && (r0 + i) % X8_ROWS; i++)
        for (int64_t t = 0; t < T; t++) out[t * os + i] = dot_row_any_x8(w, r0 + i, x + t);
#ifdef TDM_AMX
    int64_t whole = (n - i) / X8_ROWS; /* blocks_amx.h: Q8_0 groups for 8 tokens and more */
    if (dot_groups_amx(w, (r0 + i) / X8_ROWS, (r0 + i) / X8_ROWS + whole, x, T, out + i, os)) i += whole * X8_ROWS;
#endif
#ifdef TDM_SIMD
    for (; i + X8_ROWS <= n; i += X8_ROWS)
        if (w->kind == KIND_I8X8) dot8_x8_i8_multi(w, (r0 + i) / X8_ROWS, x, T, out + i, os);
        else dot8_x8_multi(w, (r0 + i) / X8_ROWS, x, T, out + i, os);
#endif
    for (; i < n; i++)
        for (int64_t t = 0; t < T; t++) out[t * os + i] = dot_row_any_x8(w, r0 + i, x + t);
}

/* out (uint8 [ceil(rows / 8) * ng * B]) = the KIND_I4H weight w interleaved as above (KIND_I8H: the
 * KIND_I8X8 layout, blocks_x8_i8.h) */
void tdm_repack_x8(const tdm_weight *w, uint8_t *out) {
    if (w->kind == KIND_I8H) {
        repack_i8x8(w, out);
        return;
    }
    int64_t ng = w->cols / 32, groups = (w->rows + X8_ROWS - 1) / X8_ROWS;
    int64_t bb = w->minimum ? X8_BLOCK_BYTES : X8_BLOCK_BYTES - 16;
    const uint16_t *d16 = (const uint16_t *)w->scale, *m16 = (const uint16_t *)w->minimum;
    memset(out, 0, (size_t)(groups * ng * bb));
    for (int64_t r = 0; r < w->rows; r++) {
        int64_t j = r % X8_ROWS;
        for (int64_t g = 0; g < ng; g++) {
            uint8_t *o = out + ((r / X8_ROWS) * ng + g) * bb;
            const uint8_t *p = w->data + r * w->row_bytes + 16 * g; /* GGUF: low nibbles 0..15, high 16..31 */
            uint8_t c[32];
            for (int k = 0; k < 16; k++) c[k] = p[k] & 15, c[k + 16] = p[k] >> 4;
            for (int v = 0; v < 4; v++)
                for (int b = 0; b < 4; b++) o[32 * v + 4 * j + b] = (uint8_t)(c[8 * v + b] | c[8 * v + 4 + b] << 4);
            ((uint16_t *)(o + 128))[j] = d16[r * w->scale_stride + g];
            if (m16) ((uint16_t *)(o + 144))[j] = m16[r * w->scale_stride + g];
        }
    }
}

#endif
