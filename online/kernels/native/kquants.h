/* GGUF Q5_0, Q6_K and Q5_K blocks read in place by the row-dot kernels (online/kernels/gguf_blocks.py):
 * the descriptor's data are the tensor's own blocks (row_bytes = blocks per row x block bytes; scale
 * and minimum unused). Per block of 32 weights the kernel decodes the codes to int8 in registers
 * (llama.cpp's AVX2 bit tricks) and multiplies them with the int8 activation block (the qvec scheme):
 *   Q5_0 (22 B / 32):   f16 d, 32 high bits, 16 nibble bytes; w = d (q - 16)       (codes -16..15)
 *   Q6_K (210 B / 256): 128 B low nibbles, 64 B 2-bit highs, 16 int8 scales, f16 d;
 *                       w = (d sc[i / 16]) (q - 32)                                   (codes -32..31)
 *   Q5_K (176 B / 256): f16 d, dmin, 12 B 6-bit scales / minimums (as Q4_K), 32 B high bits, 128 B
 *                       nibbles; w = (d sc[i / 32]) q - dmin m[i / 32]                (codes 0..31)
 * A block's weight scale is a float per 16 weights (Q6_K's sub-blocks; the two halves equal
 * otherwise), multiplied by the activation scale into lanes 0-3 / 4-7 of the int32 dot (elements
 * 0-15 / 16-31). Q5_K's minimum term uses the exact float block sums (as Q4_K).
 * Every token's float operations are the same in the single-token and the multi-token kernels
 * (per block: main product, then the residual product where the block is flagged; one reduction),
 * so their outputs are bit-identical. Included by rows.h only (after blocks.h). */
#ifndef TANDEM_KQUANTS_H
#define TANDEM_KQUANTS_H

enum { KIND_Q50 = 8, KIND_Q6K = 9, KIND_Q5K = 10 };
#define Q50_BYTES 22
#define Q6K_BYTES 210
#define Q5K_BYTES 176
#define KQ_CHUNK 64 /* blocks of 32 whose codes the multi-token kernel decodes at once (8 KB for 4 rows) */

static inline int is_kquant(int64_t kind) { return kind == KIND_Q50 || kind == KIND_Q6K || kind == KIND_Q5K; }

/* s2 [2 nb]: the weight scale of each half-block (16 weights); mn [nb]: Q5_K's minimums (else 0) */
static void kq_row_scales(const tdm_weight *w, int64_t r, float *s2, float *mn) {
    const uint8_t *p = w->data + r * w->row_bytes;
    int64_t nb = w->cols / 32;
    if (w->kind == KIND_Q50) {
        for (int64_t b = 0; b < nb; b++) {
            uint16_t h;
            memcpy(&h, p + Q50_BYTES * b, 2);
            s2[2 * b] = s2[2 * b + 1] = f16_value(h);
            mn[b] = 0.0f;
        }
    } else if (w->kind == KIND_Q6K) {
        for (int64_t s = 0; s < nb / 8; s++) {
            const uint8_t *blk = p + Q6K_BYTES * s;
            uint16_t h;
            memcpy(&h, blk + 208, 2);
            float D = f16_value(h);
            for (int j = 0; j < 16; j++) s2[16 * s + j] = D * (float)(int8_t)blk[192 + j];
            for (int j = 0; j < 8; j++) mn[8 * s + j] = 0.0f;
        }
    } else { /* KIND_Q5K: the Q4_K scale bytes (blocks.h) */
        for (int64_t s = 0; s < nb / 8; s++) {
            float d[8];
            q4k_superblock(p + Q5K_BYTES * s, d, mn + 8 * s);
            for (int j = 0; j < 8; j++) s2[16 * s + 2 * j] = s2[16 * s + 2 * j + 1] = d[j];
        }
    }
}

/* the 32 codes of block b of the row at p, as plain ints (portable code and the dequantizer) */
static void kq_codes_scalar(int64_t kind, const uint8_t *p, int64_t b, int8_t *c) {
    if (kind == KIND_Q50) {
        const uint8_t *blk = p + Q50_BYTES * b;
        uint32_t qh;
        memcpy(&qh, blk + 2, 4);
        for (int j = 0; j < 16; j++) {
            c[j] = (int8_t)(((blk[6 + j] & 15) | (((qh >> j) & 1) << 4)) - 16);
            c[16 + j] = (int8_t)(((blk[6 + j] >> 4) | (((qh >> (16 + j)) & 1) << 4)) - 16);
        }
    } else if (kind == KIND_Q6K) {
        const uint8_t *blk = p + Q6K_BYTES * (b / 8);
        int j = (int)(b % 8), half = j / 4, quad = j % 4;
        const uint8_t *ql = blk + 64 * half + 32 * (quad & 1), *qh = blk + 128 + 32 * half;
        for (int l = 0; l < 32; l++)
            c[l] = (int8_t)((((quad >= 2 ? ql[l] >> 4 : ql[l]) & 15) | (((qh[l] >> (2 * quad)) & 3) << 4)) - 32);
    } else {
        const uint8_t *blk = p + Q5K_BYTES * (b / 8);
        int j = (int)(b % 8);
        const uint8_t *qs = blk + 48 + 32 * (j / 2), *qh = blk + 16;
        for (int l = 0; l < 32; l++)
            c[l] = (int8_t)((((j & 1) ? qs[l] >> 4 : qs[l]) & 15) | (((qh[l] >> j) & 1) << 4));
    }
}

#ifdef TDM_SIMD
static inline __m256i kq_bits32(const uint8_t *x) { /* byte j = 0xFF where bit j of x is set (llama.cpp) */
    uint32_t v;
    memcpy(&v, x, 4);
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)v), shuf);
    bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

static inline __attribute__((always_inline)) __m256i kq_codes(int64_t kind, const uint8_t *p, int64_t b) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    if (kind == KIND_Q50) {
        const uint8_t *blk = p + Q50_BYTES * b;
        __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 6));
        __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low);
        __m256i hi = _mm256_andnot_si256(kq_bits32(blk + 2), _mm256_set1_epi8((char)0xF0));
        return _mm256_or_si256(q, hi); /* q | 16 h, minus 16, as int8 */
    }
    if (kind == KIND_Q6K) {
        const uint8_t *blk = p + Q6K_BYTES * (b >> 3);
        int j = (int)(b & 7), half = j >> 2, quad = j & 3;
        __m256i l = _mm256_loadu_si256((const __m256i *)(blk + 64 * half + 32 * (quad & 1)));
        if (quad >= 2) l = _mm256_srli_epi16(l, 4);
        __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * half));
        h = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * quad)), _mm256_set1_epi8(3));
        __m256i q = _mm256_or_si256(_mm256_and_si256(l, low), _mm256_slli_epi16(h, 4));
        return _mm256_sub_epi8(q, _mm256_set1_epi8(32));
    }
    const uint8_t *blk = p + Q5K_BYTES * (b >> 3);
    int j = (int)(b & 7);
    __m256i l = _mm256_loadu_si256((const __m256i *)(blk + 48 + 32 * (j >> 1)));
    if (j & 1) l = _mm256_srli_epi16(l, 4);
    __m256i h = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(blk + 16)), _mm_cvtsi32_si128(j)),
                                 _mm256_set1_epi8(1));
    return _mm256_or_si256(_mm256_and_si256(l, low), _mm256_slli_epi16(h, 4));
}

/* acc += (s * xd) c . xq, then (s * dr) c . xr where the block has a residual: one token, one row */
static inline __attribute__((always_inline)) __m256 kq_block(__m256 acc, __m256i c, const float *s2, const qvec *x,
                                                             int64_t b) {
    __m256 sv = _mm256_set_m128(_mm_set1_ps(s2[2 * b + 1]), _mm_set1_ps(s2[2 * b]));
    acc = _mm256_fmadd_ps(_mm256_mul_ps(sv, _mm256_set1_ps(x->d[b])),
                          dot32_s8s8(c, _mm256_loadu_si256((const __m256i *)(x->q + 32 * b))), acc);
    if (x->dr[b] != 0.0f)
        acc = _mm256_fmadd_ps(_mm256_mul_ps(sv, _mm256_set1_ps(x->dr[b])),
                              dot32_s8s8(c, _mm256_loadu_si256((const __m256i *)(x->r + 32 * b))), acc);
    return acc;
}

#include "kq_single.h"

/* out[k] = the four sums plus Q5_K's minimum terms (mn [4][nb], in block order) */
static inline void kq_finish4(const __m256 acc[4], const float *mn, int64_t nb, int minimum, const qvec *x, float *out) {
    _mm_storeu_ps(out, hsum4x8(acc[0], acc[1], acc[2], acc[3]));
    if (!minimum) return;
    for (int k = 0; k < 4; k++) {
        float s = 0.0f;
        for (int64_t b = 0; b < nb; b++) s += mn[k * nb + b] * x->s[b];
        out[k] += s;
    }
}

/* the four rows r[0..3] (repeats allowed: the tail) of w: their row pointers and scales */
static inline void kq_rows4(const tdm_weight *w, const int64_t r[4], const uint8_t *p[4], float *s2, float *mn) {
    int64_t nb = w->cols / 32;
    for (int k = 0; k < 4; k++) {
        p[k] = w->data + r[k] * w->row_bytes;
        kq_row_scales(w, r[k], s2 + 2 * nb * k, mn + nb * k);
    }
}

static inline __attribute__((always_inline)) void kq_dot4_kind(const tdm_weight *w, const int64_t r[4], const qvec *x,
                                                               float *out, int64_t kind) {
    int64_t nb = w->cols / 32;
    const uint8_t *p[4];
    float s2[8 * nb], mn[4 * nb];
    kq_rows4(w, r, p, s2, mn);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < nb; b++)
        for (int k = 0; k < 4; k++) acc[k] = kq_block(acc[k], kq_codes(kind, p[k], b), s2 + 2 * nb * k, x, b);
    kq_finish4(acc, mn, nb, kind == KIND_Q5K, x, out);
}

/* out[0..3] = rows r[0..3] . x */
static void kq_dot4(const tdm_weight *w, const int64_t r[4], const qvec *x, float *out) {
    if (w->kind == KIND_Q50) kq_dot4_q50(w, r, x, out); /* kq_single.h: the same sums, less work */
    else if (w->kind == KIND_Q6K) kq_dot4_q6k(w, r, x, out);
    else kq_dot4_kind(w, r, x, out, KIND_Q5K);
}

/* the same for tokens x[0..T): out[i * os + k]. The codes of KQ_CHUNK blocks of the four rows are
 * decoded once (L1) and read by every token; each token's accumulators carry over the chunks. */
static inline __attribute__((always_inline)) void kq_dot4_multi_kind(const tdm_weight *w, const int64_t r[4],
                                                                     const qvec *x, int64_t T, float *out, int64_t os,
                                                                     int64_t kind) {
    int64_t nb = w->cols / 32;
    const uint8_t *p[4];
    float s2[8 * nb], mn[4 * nb];
    kq_rows4(w, r, p, s2, mn);
    __m256 acc[T][4];
    __m256i codes[KQ_CHUNK][4];
    for (int64_t i = 0; i < T; i++)
        for (int k = 0; k < 4; k++) acc[i][k] = _mm256_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += KQ_CHUNK) {
        int64_t n = nb - b0 < KQ_CHUNK ? nb - b0 : KQ_CHUNK;
        for (int64_t b = 0; b < n; b++)
            for (int k = 0; k < 4; k++) codes[b][k] = kq_codes(kind, p[k], b0 + b);
        for (int64_t i = 0; i < T; i++) {
            __m256 a0 = acc[i][0], a1 = acc[i][1], a2 = acc[i][2], a3 = acc[i][3];
            for (int64_t b = 0; b < n; b++) {
                a0 = kq_block(a0, codes[b][0], s2, x + i, b0 + b);
                a1 = kq_block(a1, codes[b][1], s2 + 2 * nb, x + i, b0 + b);
                a2 = kq_block(a2, codes[b][2], s2 + 4 * nb, x + i, b0 + b);
                a3 = kq_block(a3, codes[b][3], s2 + 6 * nb, x + i, b0 + b);
            }
            acc[i][0] = a0, acc[i][1] = a1, acc[i][2] = a2, acc[i][3] = a3;
        }
    }
    for (int64_t i = 0; i < T; i++) {
        float o[4];
        kq_finish4(acc[i], mn, nb, kind == KIND_Q5K, x + i, o);
        for (int k = 0; k < 4; k++) out[i * os + k] = o[k];
    }
}

static void kq_dot4_multi(const tdm_weight *w, const int64_t r[4], const qvec *x, int64_t T, float *out, int64_t os) {
    if (w->kind == KIND_Q50) kq_dot4_multi_kind(w, r, x, T, out, os, KIND_Q50);
    else if (w->kind == KIND_Q6K) kq_dot4_multi_kind(w, r, x, T, out, os, KIND_Q6K);
    else kq_dot4_multi_kind(w, r, x, T, out, os, KIND_Q5K);
}
#endif

/* out[i] = W[r0 + i] . x for i < n (four rows at a time; a tail repeats its last row) */
static void kq_dot_rows(const tdm_weight *w, int64_t r0, int64_t n, const qvec *x, float *out) {
#ifdef TDM_SIMD
    for (int64_t i = 0; i < n; i += 4) {
        int64_t r[4];
        float o[4];
        for (int k = 0; k < 4; k++) r[k] = r0 + (i + k < n ? i + k : n - 1);
        kq_dot4(w, r, x, o);
        for (int k = 0; k < 4 && i + k < n; k++) out[i + k] = o[k];
    }
#else
    int64_t nb = w->cols / 32;
    float s2[2 * nb], mn[nb];
    int8_t c[32];
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *p = w->data + (r0 + i) * w->row_bytes;
        kq_row_scales(w, r0 + i, s2, mn);
        float acc = 0.0f, summ = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            kq_codes_scalar(w->kind, p, b, c);
            for (int h = 0; h < 2; h++) {
                int32_t isum = 0, rsum = 0;
                for (int j = 16 * h; j < 16 * h + 16; j++) {
                    isum += c[j] * x->q[32 * b + j];
                    rsum += c[j] * x->r[32 * b + j];
                }
                acc += s2[2 * b + h] * (x->d[b] * (float)isum + (x->dr[b] != 0.0f ? x->dr[b] * (float)rsum : 0.0f));
            }
            summ += mn[b] * x->s[b];
        }
        out[i] = acc + summ;
    }
#endif
}

/* out[i * os + j] = W[r0 + j] . x[i] (j < n, i < T): bit-identical to kq_dot_rows per token */
static void kq_dot_rows_multi(const tdm_weight *w, int64_t r0, int64_t n, const qvec *x, int64_t T, float *out,
                              int64_t os) {
#ifdef TDM_SIMD
    for (int64_t j = 0; j < n; j += 4) {
        int64_t r[4], m = n - j < 4 ? n - j : 4;
        for (int k = 0; k < 4; k++) r[k] = r0 + (j + k < n ? j + k : n - 1);
        if (m == 4) {
            kq_dot4_multi(w, r, x, T, out + j, os);
            continue;
        }
        for (int64_t i = 0; i < T; i++) { /* the tail: through the four-row kernel, m outputs kept */
            float o[4];
            kq_dot4(w, r, x + i, o);
            for (int k = 0; k < m; k++) out[i * os + j + k] = o[k];
        }
    }
#else
    for (int64_t i = 0; i < T; i++) {
        float o[n];
        kq_dot_rows(w, r0, n, x + i, o);
        for (int64_t j = 0; j < n; j++) out[i * os + j] = o[j];
    }
#endif
}

/* out [cols] = W[r] as float32: gguf's decode (s * code, minus Q5_K's dmin m) */
static void kq_dequant_row(const tdm_weight *w, int64_t r, float *out) {
    int64_t nb = w->cols / 32;
    const uint8_t *p = w->data + r * w->row_bytes;
    float s2[2 * nb], mn[nb];
    int8_t c[32];
    kq_row_scales(w, r, s2, mn);
    for (int64_t b = 0; b < nb; b++) {
        kq_codes_scalar(w->kind, p, b, c);
        for (int j = 0; j < 32; j++) out[32 * b + j] = s2[2 * b + j / 16] * (float)c[j] + mn[b];
    }
}
#endif
