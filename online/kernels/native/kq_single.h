/* Single-token four-row kernels for Q5_0 and Q6_K blocks read in place (Gemma 3's q/k/v/gate/up and
 * down projections): the arithmetic of kq_dot4_kind (kquants.h), bit for bit, with less work per block.
 *  - The codes stay unsigned (Q5_0: 0..31, Q6_K: 0..63) and the offset is taken off in int16:
 *    maddubs(u, x) - maddubs(off, x) is the exact pair sum of (u - off) x (|pairs| < 2^15), so the int32
 *    lanes equal the signed-code products the sign trick forms; maddubs(off, x) is shared by four rows.
 *  - Scales are read where they are (Q5_0's f16 d per block; Q6_K's int8 sub-scales times the f16 super
 *    scale, one float product each, as kq_row_scales forms them), with no per-row scale pass.
 *  - Q6_K walks a super-block at a time: each 32-byte load of low and high bits feeds two or four blocks.
 *  - The residual check is made once per block for the four rows; each row's FMA chain still runs main
 *    product then residual product per block, in block order (the multi-token kernel's order).
 * Included by kquants.h (TDM_SIMD only). */
#ifndef TANDEM_KQ_SINGLE_H
#define TANDEM_KQ_SINGLE_H

#ifndef KQ_AHEAD_ROWS
#define KQ_AHEAD_ROWS 8 /* prefetch distance: the rows two four-row blocks ahead (contiguous rows) */
#endif

/* pair sums of (u - off) . x as int32 lanes (4 bytes each), as cvt'd floats */
static inline __m256 kq_dot_off(__m256i u, __m256i xv, __m256i off_x) {
    __m256i p16 = _mm256_sub_epi16(_mm256_maddubs_epi16(u, xv), off_x);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}

/* Q5_0 block at blk: codes q | 16 h in 0..31 (the signed code plus 16) */
static inline __m256i q50_ucodes(const uint8_t *blk) {
    __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 6));
    __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
    return _mm256_or_si256(q, _mm256_and_si256(kq_bits32(blk + 2), _mm256_set1_epi8(0x10)));
}

static void kq_dot4_q50(const tdm_weight *w, const int64_t r[4], const qvec *x, float *out) {
    int64_t nb = w->cols / 32;
    const uint8_t *p[4];
    for (int k = 0; k < 4; k++) p[k] = w->data + r[k] * w->row_bytes;
    const __m256i sixteen = _mm256_set1_epi8(16);
    const char *ahead = (const char *)(w->data + (r[0] + KQ_AHEAD_ROWS) * w->row_bytes); /* rows streamed next */
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < nb; b++) {
        _mm_prefetch(ahead + 4 * Q50_BYTES * b, _MM_HINT_T0); /* the four rows' bytes of this block, ahead */
        _mm_prefetch(ahead + 4 * Q50_BYTES * b + 64, _MM_HINT_T0);
        __m256i xv = _mm256_loadu_si256((const __m256i *)(x->q + 32 * b));
        __m256i off = _mm256_maddubs_epi16(sixteen, xv);
        __m256i u[4];
        float d[4], xd = x->d[b];
        for (int k = 0; k < 4; k++) {
            const uint8_t *blk = p[k] + Q50_BYTES * b;
            uint16_t h;
            memcpy(&h, blk, 2);
            d[k] = _cvtsh_ss(h);
            u[k] = q50_ucodes(blk);
            acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(d[k] * xd), kq_dot_off(u[k], xv, off), acc[k]);
        }
        float dr = x->dr[b];
        if (dr != 0.0f) {
            __m256i rv = _mm256_loadu_si256((const __m256i *)(x->r + 32 * b));
            __m256i roff = _mm256_maddubs_epi16(sixteen, rv);
            for (int k = 0; k < 4; k++)
                acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(d[k] * dr), kq_dot_off(u[k], rv, roff), acc[k]);
        }
    }
    _mm_storeu_ps(out, hsum4x8(acc[0], acc[1], acc[2], acc[3]));
}

/* the Q6_K codes (0..63) of block j (0..7) of a super-block, from its low-bit vector l (the half's
 * 32-byte chunk quad & 1, unshifted) and high-bit vector h (the half's 32 bytes) */
static inline __m256i q6k_ucodes(__m256i l, __m256i h, int quad) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    if (quad >= 2) l = _mm256_srli_epi16(l, 4);
    /* the two high bits of this quad, moved to bits 4-5 */
    __m256i hb = quad == 0 ? _mm256_slli_epi16(h, 4) : quad == 1 ? _mm256_slli_epi16(h, 2)
                 : quad == 2 ? h : _mm256_srli_epi16(h, 2);
    return _mm256_or_si256(_mm256_and_si256(l, low), _mm256_and_si256(hb, _mm256_set1_epi8(0x30)));
}

static void kq_dot4_q6k(const tdm_weight *w, const int64_t r[4], const qvec *x, float *out) {
    int64_t ns = w->cols / 256;
    const uint8_t *p[4];
    for (int k = 0; k < 4; k++) p[k] = w->data + r[k] * w->row_bytes;
    const __m256i thirtytwo = _mm256_set1_epi8(32);
    const __m256i pick = _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0);
    const char *ahead = (const char *)(w->data + (r[0] + KQ_AHEAD_ROWS) * w->row_bytes);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t s = 0; s < ns; s++) {
        float sc[4][16]; /* D * sc[j]: kq_row_scales' products */
        for (int k = 0; k < 4; k++) {
            const uint8_t *blk = p[k] + Q6K_BYTES * s;
            uint16_t h;
            memcpy(&h, blk + 208, 2);
            float D = _cvtsh_ss(h);
            for (int j = 0; j < 16; j++) sc[k][j] = D * (float)(int8_t)blk[192 + j];
        }
        for (int half = 0; half < 2; half++) {
            __m256i l[4][2], hv[4];
            for (int k = 0; k < 4; k++) {
                const uint8_t *blk = p[k] + Q6K_BYTES * s;
                l[k][0] = _mm256_loadu_si256((const __m256i *)(blk + 64 * half));
                l[k][1] = _mm256_loadu_si256((const __m256i *)(blk + 64 * half + 32));
                hv[k] = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * half));
            }
            for (int quad = 0; quad < 4; quad++) {
                int64_t b = 8 * s + 4 * half + quad;
                _mm_prefetch(ahead + (4 * Q6K_BYTES / 8) * b, _MM_HINT_T0); /* 105 B of the four rows per block */
                _mm_prefetch(ahead + (4 * Q6K_BYTES / 8) * b + 64, _MM_HINT_T0);
                int sj = 2 * (4 * half + quad); /* the sub-scale of the block's first 16 weights */
                __m256i xv = _mm256_loadu_si256((const __m256i *)(x->q + 32 * b));
                __m256i off = _mm256_maddubs_epi16(thirtytwo, xv);
                __m256 xd = _mm256_set1_ps(x->d[b]);
                __m256i u[4];
                __m256 sv[4];
                for (int k = 0; k < 4; k++) {
                    u[k] = q6k_ucodes(l[k][quad & 1], hv[k], quad);
                    __m256 pair = _mm256_castpd_ps(_mm256_broadcast_sd((const double *)&sc[k][sj]));
                    sv[k] = _mm256_permutevar8x32_ps(pair, pick); /* lanes 0-3: sc[sj], 4-7: sc[sj + 1] */
                    acc[k] = _mm256_fmadd_ps(_mm256_mul_ps(sv[k], xd), kq_dot_off(u[k], xv, off), acc[k]);
                }
                float dr = x->dr[b];
                if (dr != 0.0f) {
                    __m256i rv = _mm256_loadu_si256((const __m256i *)(x->r + 32 * b));
                    __m256i roff = _mm256_maddubs_epi16(thirtytwo, rv);
                    for (int k = 0; k < 4; k++)
                        acc[k] = _mm256_fmadd_ps(_mm256_mul_ps(sv[k], _mm256_set1_ps(dr)), kq_dot_off(u[k], rv, roff),
                                                 acc[k]);
                }
            }
        }
    }
    _mm_storeu_ps(out, hsum4x8(acc[0], acc[1], acc[2], acc[3]));
}

#endif
