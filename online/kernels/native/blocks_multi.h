/* Multi-token twins of the f16-scale four-row kernels (blocks_dot.h: KIND_I4H = Q4_0 / Q4_1,
 * KIND_I8H = Q8_0) for dot_rows_multi (rows_multi.h). Per four-row block everything that does not
 * touch a token's accumulators is done once for all T tokens: the nibbles unpacked (int4) or |w|
 * formed (int8) into an L1 buffer, the f16 scales and minimums widened to float32 (exact). Per token
 * only its own float work is left: the scale products d * xd (8 at a time, the same IEEE products as
 * scales4_f16 / f16_value(d) * xd), then for each token pair 8 FMA chains (4 rows x 2 tokens) in
 * exactly dot4_i4h_core's / dot4_i8h's order: main blocks g = 0..ng-1, then the flagged residual
 * blocks, then (int4) the minimum terms, the same hsum4x8 reductions and the same scalar tail. So
 * every output is bit-identical to dot_rows on that token alone (tests: test_gguf_blocks.py,
 * test_multi_token_step.py). Included by rows_multi.h only. */
#ifndef TANDEM_BLOCKS_MULTI_H
#define TANDEM_BLOCKS_MULTI_H
#ifdef TDM_SIMD

/* Keeps a loaded vector in a register: without it GCC folds the load into every instruction that
 * reads it (x once per row, codes once per token), and the loop runs on the two 256-bit load ports
 * (24 loads per 8 products) instead of the four FP pipes. */
#define TDM_IN_REGISTER(v) __asm__("" : "+x"(v))

/* Tokens whose scale products are formed together, before any is read: a broadcast load right after
 * the 32-byte store that wrote it waits for the store to retire (no forwarding into part of it), so
 * the products of a whole chunk are stored first and read back from L1. */
#define TDM_SCALE_CHUNK 8

/* sc[k * ng8 + g] = dk[k * ng8 + g] * xd[g] for the four rows k, g < ng8: xd is a token's activation
 * scales padded with zeros to ng8 (pad_scales), dk the rows' widened scales (zeros past ng) */
static inline void scale_products4(const float *dk, int64_t ng8, const float *xd, float *sc) {
    for (int64_t g = 0; g < ng8; g += 8) {
        __m256 xv = _mm256_loadu_ps(xd + g);
        for (int k = 0; k < 4; k++)
            _mm256_storeu_ps(sc + k * ng8 + g, _mm256_mul_ps(_mm256_loadu_ps(dk + k * ng8 + g), xv));
    }
}

/* xdp[i * ng8 + g]: token i's activation scales x[i].d[g], zeros from ng to ng8 (once per row range:
 * the kernels then form scale products 8 at a time without a masked load per block) */
static void pad_scales(const qvec *x, int64_t T, int64_t ng, int64_t ng8, float *xdp) {
    int64_t n8 = ng / 8;
    __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(ng - 8 * n8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int64_t i = 0; i < T; i++) { /* whole-vector stores only (the scale products read them back as vectors) */
        for (int64_t j = 0; j < n8; j++) _mm256_storeu_ps(xdp + i * ng8 + 8 * j, _mm256_loadu_ps(x[i].d + 8 * j));
        if (ng8 > 8 * n8) _mm256_storeu_ps(xdp + i * ng8 + 8 * n8, _mm256_maskload_ps(x[i].d + 8 * n8, tail));
    }
}

/* the n < 8 f16 values at h widened, zeros past n: built in a register (the vector loads that read
 * them back then forward from one 32-byte store, not from n scalar ones) */
static inline __m256 f16_tail8(const uint16_t *h, int64_t n) {
    __m128i v = _mm_setzero_si128();
    switch (n) { /* falls through: lanes n-1 .. 0 */
    case 7: v = _mm_insert_epi16(v, h[6], 6); /* fall through */
    case 6: v = _mm_insert_epi16(v, h[5], 5); /* fall through */
    case 5: v = _mm_insert_epi16(v, h[4], 4); /* fall through */
    case 4: v = _mm_insert_epi16(v, h[3], 3); /* fall through */
    case 3: v = _mm_insert_epi16(v, h[2], 2); /* fall through */
    case 2: v = _mm_insert_epi16(v, h[1], 1); /* fall through */
    case 1: v = _mm_insert_epi16(v, h[0], 0); /* fall through */
    default: break;
    }
    return _mm256_cvtph_ps(v);
}

/* dk[k * ng8 + g] = the f16 scales of row k widened (exact), zeros from ng to ng8 */
static inline void widen_scales4(const uint16_t *d16, int64_t ss, int64_t ng, int64_t ng8, float *dk) {
    int64_t n8 = ng / 8;
    for (int k = 0; k < 4; k++) {
        const uint16_t *h = d16 + k * ss;
        for (int64_t j = 0; j < n8; j++)
            _mm256_storeu_ps(dk + k * ng8 + 8 * j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 8 * j))));
        if (ng8 > 8 * n8) _mm256_storeu_ps(dk + k * ng8 + 8 * n8, f16_tail8(h + 8 * n8, ng - 8 * n8));
    }
}

/* the main blocks of one token (NT = 1) or a token pair (NT = 2): acc_e[k] += sc_e[k][g] * (codes . x_e) */
static inline __attribute__((always_inline)) void i4_main_blocks(const __m256i *codes, int64_t ng, int64_t ng8,
                                                                 const float *sa, const float *sb, const int8_t *qa,
                                                                 const int8_t *qb, int nt, __m256 a[4], __m256 b[4]) {
    for (int64_t g = 0; g < ng; g++) {
        __m256i va = _mm256_loadu_si256((const __m256i *)(qa + 32 * g));
        if (nt == 2) {
            __m256i vb = _mm256_loadu_si256((const __m256i *)(qb + 32 * g));
            TDM_IN_REGISTER(va);
            TDM_IN_REGISTER(vb);
            for (int k = 0; k < 4; k++) {
                __m256i c = _mm256_load_si256(codes + 4 * g + k);
                TDM_IN_REGISTER(c);
                a[k] = _mm256_fmadd_ps(_mm256_broadcast_ss(sa + k * ng8 + g), dot32_u8s8(c, va), a[k]);
                b[k] = _mm256_fmadd_ps(_mm256_broadcast_ss(sb + k * ng8 + g), dot32_u8s8(c, vb), b[k]);
            }
        } else {
            for (int k = 0; k < 4; k++)
                a[k] = _mm256_fmadd_ps(_mm256_broadcast_ss(sa + k * ng8 + g),
                                       dot32_u8s8(_mm256_load_si256(codes + 4 * g + k), va), a[k]);
        }
    }
}

/* dot4_i4h_core's tail for one token: flagged residual blocks, minimum terms, the four sums to out */
static inline void i4_finish(const __m256i *codes, const float *dk, const __m256 *mv, const __m128 *mt, int64_t ng,
                             int64_t ng8, const qvec *x, __m256 acc[4], float *out) {
    for (int64_t f = 0; f < x->n_flagged; f++) {
        int64_t g = x->flagged[f];
        __m256i xv = _mm256_loadu_si256((const __m256i *)(x->r + 32 * g));
        for (int k = 0; k < 4; k++)
            acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(dk[k * ng8 + g] * x->dr[g]), dot32_u8s8(codes[4 * g + k], xv),
                                     acc[k]);
    }
    __m256 s[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t g = 0, n8 = ng / 8;
    for (int64_t j = 0; j < n8; j++, g += 8) {
        __m256 xs = _mm256_loadu_ps(x->s + g);
        for (int k = 0; k < 4; k++) s[k] = _mm256_fmadd_ps(mv[j * 4 + k], xs, s[k]);
    }
    __m128 sums = _mm_add_ps(hsum4x8(acc[0], acc[1], acc[2], acc[3]), hsum4x8(s[0], s[1], s[2], s[3]));
    for (int64_t j = 0; g < ng; g++, j++) /* out[k] += m[k][g] * s[g], the four rows in one vector */
        sums = _mm_add_ps(sums, _mm_mul_ps(mt[j], _mm_set1_ps(x->s[g])));
    _mm_storeu_ps(out, sums);
}

/* dot4_i4h for tokens x[0..T): out[i * os + k] = row r+k . x[i] */
static void dot4_i4h_multi(const tdm_weight *w, int64_t r, const qvec *x, const float *xdp, int64_t T, float *out,
                           int64_t os) {
    int64_t rb = w->row_bytes, ss = w->scale_stride, ng = w->cols / 32, ng8 = (ng + 7) & ~(int64_t)7, n8 = ng / 8;
    const uint8_t *p = w->data + r * rb;
    const uint16_t *d16 = (const uint16_t *)w->scale + r * ss;
    const uint16_t *m16 = w->minimum ? (const uint16_t *)w->minimum + r * ss : NULL;
    __m256i codes[4 * ng];                         /* [g][k] */
    __m256 mv[4 * (n8 > 0 ? n8 : 1)];                    /* [g / 8][k]: minimum8_f16 */
    __m128 mt[8];                                        /* [g - 8 n8][k]: the tail's minimums */
    float dk[4 * ng8], sc[TDM_SCALE_CHUNK * 4 * ng8];   /* dk [k][g]: the f16 scales widened; sc [token][k][g] */
    const char *ahead = (const char *)(p + 8 * rb);
    for (int64_t g = 0; g < ng; g++) {
        _mm_prefetch(ahead + 64 * g, _MM_HINT_T0);
        for (int k = 0; k < 4; k++) codes[4 * g + k] = nibbles32(p + k * rb + 16 * g);
    }
    widen_scales4(d16, ss, ng, ng8, dk);
    const uint16_t *dr[4], *mr[4];
    for (int k = 0; k < 4; k++) {
        dr[k] = d16 + k * ss, mr[k] = m16 ? m16 + k * ss : NULL;
        for (int64_t j = 0; j < n8; j++) mv[j * 4 + k] = minimum8_f16(dr[k] + 8 * j, mr[k] ? mr[k] + 8 * j : NULL);
    }
    for (int64_t g = 8 * n8; g < ng; g++) /* in registers: no vector load of four scalar stores */
        mt[g - 8 * n8] = _mm_setr_ps(minimum_f16(dr[0] + g, mr[0] ? mr[0] + g : NULL),
                                     minimum_f16(dr[1] + g, mr[1] ? mr[1] + g : NULL),
                                     minimum_f16(dr[2] + g, mr[2] ? mr[2] + g : NULL),
                                     minimum_f16(dr[3] + g, mr[3] ? mr[3] + g : NULL));
    for (int64_t i0 = 0; i0 < T; i0 += TDM_SCALE_CHUNK) {
        int64_t nc = T - i0 < TDM_SCALE_CHUNK ? T - i0 : TDM_SCALE_CHUNK, i = 0;
        for (int64_t e = 0; e < nc; e++) scale_products4(dk, ng8, xdp + (i0 + e) * ng8, sc + e * 4 * ng8);
        for (; i + 2 <= nc; i += 2) {
            const qvec *xa = x + i0 + i, *xb = xa + 1;
            __m256 a[4], b[4];
            for (int k = 0; k < 4; k++) a[k] = b[k] = _mm256_setzero_ps();
            i4_main_blocks(codes, ng, ng8, sc + i * 4 * ng8, sc + (i + 1) * 4 * ng8, xa->q, xb->q, 2, a, b);
            i4_finish(codes, dk, mv, mt, ng, ng8, xa, a, out + (i0 + i) * os);
            i4_finish(codes, dk, mv, mt, ng, ng8, xb, b, out + (i0 + i + 1) * os);
        }
        if (i < nc) {
            const qvec *xa = x + i0 + i;
            __m256 a[4], b[4];
            for (int k = 0; k < 4; k++) a[k] = b[k] = _mm256_setzero_ps();
            i4_main_blocks(codes, ng, ng8, sc + i * 4 * ng8, NULL, xa->q, NULL, 1, a, b);
            i4_finish(codes, dk, mv, mt, ng, ng8, xa, a, out + (i0 + i) * os);
        }
    }
}

/* the main blocks of int8 rows for one token or a pair: acc_e[k] += sc_e[k][b] * (|w| . sign(x_e, w)) */
static inline __attribute__((always_inline)) void i8_main_blocks(const int8_t *q, int64_t rb, const __m256i *aw,
                                                                 int64_t nb, int64_t nb8, const float *sa,
                                                                 const float *sb, const int8_t *qa, const int8_t *qb,
                                                                 int nt, __m256 a[4], __m256 b[4]) {
    for (int64_t bl = 0; bl < nb; bl++) {
        __m256i va = _mm256_loadu_si256((const __m256i *)(qa + 32 * bl));
        __m256i vb = nt == 2 ? _mm256_loadu_si256((const __m256i *)(qb + 32 * bl)) : va; /* NT 1: qb unused */
        TDM_IN_REGISTER(va);
        TDM_IN_REGISTER(vb);
        for (int k = 0; k < 4; k++) {
            __m256i wv = _mm256_loadu_si256((const __m256i *)(q + k * rb + 32 * bl));
            __m256i u = _mm256_load_si256(aw + 4 * bl + k);
            a[k] = _mm256_fmadd_ps(_mm256_broadcast_ss(sa + k * nb8 + bl), dot32_u8s8(u, _mm256_sign_epi8(va, wv)), a[k]);
            if (nt == 2)
                b[k] = _mm256_fmadd_ps(_mm256_broadcast_ss(sb + k * nb8 + bl), dot32_u8s8(u, _mm256_sign_epi8(vb, wv)),
                                       b[k]);
        }
    }
}

/* dot4_i8h's tail for one token: flagged residual blocks, then the four sums */
static inline void i8_finish(const int8_t *q, int64_t rb, const float *dk, int64_t nb8, const qvec *x, __m256 acc[4],
                             float *out) {
    for (int64_t f = 0; f < x->n_flagged; f++) {
        int64_t bl = x->flagged[f];
        __m256i xv = _mm256_loadu_si256((const __m256i *)(x->r + 32 * bl));
        for (int k = 0; k < 4; k++)
            acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(dk[k * nb8 + bl] * x->dr[bl]),
                                     dot32_s8s8(_mm256_loadu_si256((const __m256i *)(q + k * rb + 32 * bl)), xv), acc[k]);
    }
    _mm_storeu_ps(out, hsum4x8(acc[0], acc[1], acc[2], acc[3]));
}

/* dot4_i8h for tokens x[0..T): out[i * os + k] = row r+k . x[i] */
static void dot4_i8h_multi(const tdm_weight *w, int64_t r, const qvec *x, const float *xdp, int64_t T, float *out,
                           int64_t os) {
    int64_t rb = w->row_bytes, ss = w->scale_stride, nb = w->cols / 32, nb8 = (nb + 7) & ~(int64_t)7;
    const int8_t *q = (const int8_t *)(w->data + r * rb);
    const uint16_t *s16 = (const uint16_t *)w->scale + r * ss;
    __m256i aw[4 * nb]; /* [b][k]: |w| */
    float dk[4 * nb8], sc[TDM_SCALE_CHUNK * 4 * nb8]; /* sc [token][k][b] */
    const char *ahead = (const char *)(q + 8 * rb);
    for (int64_t bl = 0; bl < nb; bl++) {
        _mm_prefetch(ahead + 128 * bl, _MM_HINT_T0);
        _mm_prefetch(ahead + 128 * bl + 64, _MM_HINT_T0);
        for (int k = 0; k < 4; k++) {
            __m256i wv = _mm256_loadu_si256((const __m256i *)(q + k * rb + 32 * bl));
            aw[4 * bl + k] = _mm256_sign_epi8(wv, wv);
        }
    }
    widen_scales4(s16, ss, nb, nb8, dk);
    for (int64_t i0 = 0; i0 < T; i0 += TDM_SCALE_CHUNK) {
        int64_t nc = T - i0 < TDM_SCALE_CHUNK ? T - i0 : TDM_SCALE_CHUNK, i = 0;
        for (int64_t e = 0; e < nc; e++) scale_products4(dk, nb8, xdp + (i0 + e) * nb8, sc + e * 4 * nb8);
        for (; i + 2 <= nc; i += 2) {
            const qvec *xa = x + i0 + i, *xb = xa + 1;
            __m256 a[4], b[4];
            for (int k = 0; k < 4; k++) a[k] = b[k] = _mm256_setzero_ps();
            i8_main_blocks(q, rb, aw, nb, nb8, sc + i * 4 * nb8, sc + (i + 1) * 4 * nb8, xa->q, xb->q, 2, a, b);
            i8_finish(q, rb, dk, nb8, xa, a, out + (i0 + i) * os);
            i8_finish(q, rb, dk, nb8, xb, b, out + (i0 + i + 1) * os);
        }
        if (i < nc) {
            const qvec *xa = x + i0 + i;
            __m256 a[4], b[4];
            for (int k = 0; k < 4; k++) a[k] = b[k] = _mm256_setzero_ps();
            i8_main_blocks(q, rb, aw, nb, nb8, sc + i * 4 * nb8, NULL, xa->q, NULL, 1, a, b);
            i8_finish(q, rb, dk, nb8, xa, a, out + (i0 + i) * os);
        }
    }
}

#endif
#endif
