/* AMX (Intel's tile unit, Sapphire Rapids on): the multi-token products of Q8_0 rows interleaved eight at
 * a time (KIND_I8X8, blocks_x8_i8.h), one tile product per block of 32 columns x 8 rows x up to 16 tokens,
 * where the vector kernel spends 8 x (vpsignb + vpdpbusd) per token; and of Q4 rows (KIND_I4X8), two row
 * groups a product (below, dot_groups_amx_q4).
 *
 * Per block g: A = the tokens' 32 activation codes (s8, one tile row per token, read in place: the qvecs sit
 * at one stride), B = the block's codes as stored (lane j's four bytes: row j's codes of four columns, which
 * is the VNNI order the tile product reads), C = the exact int32 dots of every token and row. The sums are
 * stored, then scaled in x8_i8_tokens' order: acc = fma(d[g] * xd[g], (float)s, acc) over g, then the
 * flagged residual blocks (the vector code). Integer sums are exact on every unit, so each token's result is
 * the vector kernel's bit for bit (tests/test_vnni.py builds without AMX and compares).
 *
 * Measured on a 2-core Sapphire Rapids VM (bench/RESULTS.md, eighteenth session), one thread, 8,192 x 576:
 * 64 / 82 / 103 GMAC/s at 8 / 16 / 64 tokens against the VNNI kernel's 48 / 56 / 63; a tile product took
 * ~15 ns whatever its token count, so fewer than AMX_MIN_TOKENS tokens stay on the vector kernel. Q4 rows,
 * two groups a product with the sums scaled 16 lanes at a time (nineteenth session, same VM, 1,536 x 576,
 * interleaved builds, same bits): 1.0-1.27x the VNNI kernel at 8 tokens, 1.3x at 16, 1.5x at 32, 1.6x at 64
 * (one group a product, scaled 8 lanes at a time, had been 0.83x at 8 tokens).
 *
 * Linux hands out the tile state on request (arch_prctl ARCH_REQ_XCOMP_PERM), once per process, asked at the
 * first product that would use it (so processes that never multiply 8 tokens or more of Q8_0 or Q4 rows never
 * ask: with the permission, the kernel refuses alternate signal stacks too small for the tile state). Where it
 * refuses, or TANDEM_AMX=0 is set when that first product runs (it is read once), the vector kernel runs.
 * T = 17-23 tokens repeat up to 15 tokens' tile products in the overlapping last chunk (not their scaling).
 * Included by blocks_x8.h only. */
#ifndef TANDEM_BLOCKS_AMX_H
#define TANDEM_BLOCKS_AMX_H
#if defined(TDM_SIMD) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define TDM_AMX 1
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_TOKENS 16    /* rows of the A and C tiles */
#define AMX_BATCH 32     /* blocks whose sums are stored before they are scaled */
#define AMX_MIN_TOKENS 8 /* fewer: the vector kernel (measured break-even between 4 and 8 tokens) */

typedef struct __attribute__((aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

static int amx_state; /* 0: not asked yet, 1: granted, -1: refused (a capability, settled once per process) */

/* 1 where this process may use the tiles (asked once; TANDEM_AMX=0: never) */
static int amx_ready(void) {
    int s = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (s == 0) {
        const char *env = getenv("TANDEM_AMX");
        int granted = !(env && env[0] == '0') &&
                      syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
        s = granted ? 1 : -1;
        __atomic_store_n(&amx_state, s, __ATOMIC_RELEASE);
    }
    return s > 0;
}

/* tiles 0, 1: A [tokens, 32 bytes]; 2, 3: B [8, bw bytes]; 4, 5: C [tokens, bw / 4 int32] (bw: 32 for Q8_0's
 * eight rows a product, 64 for Q4's sixteen) */
static void amx_configure(int tokens, int bw) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 6; t++)
        c.colsb[t] = (uint16_t)(t < 2 ? 32 : bw), c.rows[t] = (uint8_t)((t == 2 || t == 3) ? 8 : tokens);
    __asm__ volatile("" : : "r"(&c) : "memory"); /* the fields are written before ldtilecfg reads them */
    _tile_loadconfig(&c);
}

/* the byte stride between the tokens' codes, or 0 where they do not sit at one stride */
static int64_t amx_stride(const qvec *x, int64_t T) {
    int64_t stride = x[1].q - x[0].q;
    for (int64_t e = 2; e < T; e++)
        if (x[e].q - x[0].q != e * stride) return 0;
    return stride;
}

/* The next weight unit's bytes for block blk: [ahead + blk * ahead_bytes, + ahead_bytes) fetched into L2 while the
 * tiles multiply (nothing where ahead is NULL). Spread over the tile products, the next unit's reads keep memory busy
 * through them; issued as one burst during the unpacking, or into L1, they queued behind the core's few line-fill
 * buffers and the tile products waited. 8 tokens x 131,072 x 576 from memory, one thread, builds interleaved: Q4_1
 * 60.7 -> 85.8 GMAC/s (into L1 during the tiles: 75.4), Q8_0 65.2 -> 87.8; SmolLM2's 8-sequence batch step and
 * step_many(8): 0.90-0.93x the time. */
static inline __attribute__((always_inline)) void amx_fetch_ahead(const uint8_t *ahead, int64_t ahead_bytes,
                                                                  int64_t blk) {
    if (ahead)
        for (int64_t k = 0; k < ahead_bytes + 63; k += 64)
            _mm_prefetch((const char *)ahead + blk * ahead_bytes + k, _MM_HINT_T1);
}

/* The tile sums of blocks [g0, g1): sums [g - g0][token][n] (n < width int32) = block g's exact dots, two tile sets
 * so that one block's loads overlap the other's product. A = the tokens' codes of block blk (q, stride apart), B =
 * bsrc (an expression in blk, a row every bstride bytes), dp the tile product. Tile numbers are immediates, so these
 * are macros; they use the caller's q, stride, g0, g1, sums, ahead and ahead_bytes (amx_fetch_ahead). */
#define AMX_BLOCK(a, b, c, bsrc, bstride, dp)                                                                   \
    do {                                                                                                        \
        amx_fetch_ahead(ahead, ahead_bytes, blk);                                                               \
        _tile_loadd(a, q + 32 * blk, stride);                                                                   \
        _tile_loadd(b, bsrc, bstride);                                                                          \
        _tile_zero(c);                                                                                          \
        dp(c, a, b);                                                                                            \
    } while (0)
#define AMX_SUMS(bsrc, bstride, dp, width)                                                                      \
    do {                                                                                                        \
        int64_t g = g0;                                                                                         \
        for (; g + 2 <= g1; g += 2) {                                                                           \
            { int64_t blk = g; AMX_BLOCK(0, 2, 4, bsrc, bstride, dp); }                                         \
            { int64_t blk = g + 1; AMX_BLOCK(1, 3, 5, bsrc, bstride, dp); }                                     \
            _tile_stored(4, sums + (g - g0) * AMX_TOKENS * (width), 4 * (width));                               \
            _tile_stored(5, sums + (g + 1 - g0) * AMX_TOKENS * (width), 4 * (width));                           \
        }                                                                                                       \
        if (g < g1) {                                                                                           \
            int64_t blk = g;                                                                                    \
            AMX_BLOCK(0, 2, 4, bsrc, bstride, dp);                                                              \
            _tile_stored(4, sums + (g - g0) * AMX_TOKENS * (width), 4 * (width));                               \
        }                                                                                                       \
    } while (0)

/* Q8_0: blocks at w8, 272 bytes apart (B: the block's codes as stored); sums [g - g0][e][8]; ahead: the next
 * group's blocks (or NULL) */
static void amx_sums(const uint8_t *w8, const int8_t *q, int64_t stride, int64_t g0, int64_t g1, int32_t *sums,
                     const uint8_t *ahead) {
    const int64_t ahead_bytes = X8_I8_BLOCK_BYTES;
    AMX_SUMS(w8 + blk * X8_I8_BLOCK_BYTES, 32, _tile_dpbssd, 8);
}

/* NT (1, 2 or 4) tokens from e0: accs[e] += the blocks [g0, g1), scaled as x8_i8_tokens does */
static inline __attribute__((always_inline)) void amx_scale(const int32_t *sums, const __m256 *dk, const qvec *x,
                                                            int nt, int64_t e0, int64_t g0, int64_t g1, __m256 *accs) {
    __m256 acc[4];
    for (int e = 0; e < nt; e++) acc[e] = accs[e0 + e];
    for (int64_t g = g0; g < g1; g++)
        for (int e = 0; e < nt; e++) {
            __m256i s = _mm256_load_si256((const __m256i *)(sums + ((g - g0) * AMX_TOKENS + e0 + e) * 8));
            acc[e] = _mm256_fmadd_ps(_mm256_mul_ps(dk[g], _mm256_broadcast_ss(x[e0 + e].d + g)), _mm256_cvtepi32_ps(s),
                                     acc[e]);
        }
    for (int e = 0; e < nt; e++) accs[e0 + e] = acc[e];
}

/* out[e * os + j] = row j . token e for tokens [first, rows) of the configured tile rows: the blocks through
 * the tiles, then each token's flagged residual blocks by the vector code; ahead: the next group's blocks, fetched
 * during the tile products (or NULL) */
static void amx_tokens(const uint8_t *w8, const __m256 *dk, int64_t ng, const qvec *x, int64_t stride, int64_t rows,
                       int64_t first, float *out, int64_t os, const uint8_t *ahead) {
    __m256 accs[AMX_TOKENS];
    int32_t sums[AMX_BATCH * AMX_TOKENS * 8] __attribute__((aligned(64)));
    for (int64_t e = 0; e < rows; e++) accs[e] = _mm256_setzero_ps();
    for (int64_t g0 = 0; g0 < ng; g0 += AMX_BATCH) {
        int64_t g1 = g0 + AMX_BATCH < ng ? g0 + AMX_BATCH : ng, e = first;
        amx_sums(w8, x[0].q, stride, g0, g1, sums, ahead);
        for (; e + 4 <= rows; e += 4) amx_scale(sums, dk, x, 4, e, g0, g1, accs);
        if (e + 2 <= rows) amx_scale(sums, dk, x, 2, e, g0, g1, accs), e += 2;
        if (e < rows) amx_scale(sums, dk, x, 1, e, g0, g1, accs);
    }
    for (int64_t e = first; e < rows; e++) _mm256_storeu_ps(out + e * os, x8_i8_residuals(w8, dk, x + e, accs[e]));
}

/* dot8_x8_i8_multi on the tiles, configured for `rows` tokens: T tokens in chunks of rows (T > rows: the
 * last chunk ends at T and overlaps the one before; its first rows are computed again, not written); ahead: the
 * next group's blocks from its first (or NULL), all fetched during the first chunk's tile products */
static void dot8_x8_i8_multi_amx(const tdm_weight *w, int64_t group, const qvec *x, int64_t T, int64_t stride,
                                 int64_t rows, float *out, int64_t os, const uint8_t *ahead) {
    int64_t ng = w->cols / 32;
    __m256 dk[ng];
    const uint8_t *o = x8_i8_block(w, group, 0);
    for (int64_t g = 0; g < ng; g++, o += X8_I8_BLOCK_BYTES)
        dk[g] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + 256)));
    for (int64_t c0 = 0; c0 < T; c0 += rows) {
        int64_t start = c0 + rows <= T ? c0 : T - rows;
        amx_tokens(x8_i8_block(w, group, 0), dk, ng, x + start, stride, rows, c0 - start, out + start * os, os,
                   c0 == 0 ? ahead : NULL);
    }
}

#if defined(__AVX512F__) && !defined(TDM_NO_AMX_Q4) /* (-DTDM_NO_AMX_Q4: the vector kernel, for A/B runs) */
/* Q4 rows (KIND_I4X8) two row groups at a time: the pair's nibbles are unpacked once for all tokens into
 * B tiles of 8 K-quads x 64 bytes (group R's eight lanes, then R + 1's: x8_unpack's order), so one product
 * covers 16 rows x 32 columns x up to 16 tokens (A: the tokens' codes, signed; B: the codes, unsigned) and C
 * holds a token's 16 exact int32 dots in one zmm. The sums are scaled lane by lane in x8_tokens' order
 * (acc = fma(d * xd, (float)s, acc) over the blocks, then the flagged residual blocks) beside x8_minimums'
 * chain (m = fma(min, xs, m) over the blocks), and out = acc + m, so every token's result is the vector
 * kernel's bit for bit. An odd last group runs on the vector kernel. */
#define AMX_Q4_MIN_TOKENS 8
#define AMX_Q4_BATCH 16 /* blocks whose sums are stored before they are scaled */

static inline __m256 amx_half(__m512 v, int high) {
    return high ? _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)) : _mm512_castps512_ps256(v);
}

/* NT (1, 2 or 4) tokens from e0: accs[e] += the blocks [g0, g1) of the stored sums, scaled as x8_tokens does,
 * and ms[e] += their minimums' terms (x8_minimums' chain: m = fma(min, xs, m) over the blocks) */
static inline __attribute__((always_inline)) void amx_q4_scale(const int32_t *sums, const __m512 *dk, const __m512 *mk,
                                                               const qvec *x, int nt, int64_t e0, int64_t g0,
                                                               int64_t g1, __m512 *accs, __m512 *ms) {
    __m512 acc[4], m[4];
    for (int e = 0; e < nt; e++) acc[e] = accs[e0 + e], m[e] = ms[e0 + e];
    for (int64_t g = g0; g < g1; g++)
        for (int e = 0; e < nt; e++) {
            __m512i s = _mm512_load_si512((const void *)(sums + ((g - g0) * AMX_TOKENS + e0 + e) * 16));
            acc[e] = _mm512_fmadd_ps(_mm512_mul_ps(dk[g], _mm512_set1_ps(x[e0 + e].d[g])), _mm512_cvtepi32_ps(s),
                                     acc[e]);
            m[e] = _mm512_fmadd_ps(mk[g], _mm512_set1_ps(x[e0 + e].s[g]), m[e]);
        }
    for (int e = 0; e < nt; e++) accs[e0 + e] = acc[e], ms[e0 + e] = m[e];
}

/* tokens [first, rows) of the configured tile rows (x: the chunk's first token): out[e * os + j] = the pair's
 * row j (j >= 8: group R + 1) . token e; ahead: the next pair's bytes (or NULL), ahead_bytes of them per block */
static void amx_q4_tokens(const __m512i *cb, const __m512 *dk, const __m512 *mk, int64_t ng, const qvec *x,
                          int64_t stride, int64_t rows, int64_t first, float *out, int64_t os, const uint8_t *ahead,
                          int64_t ahead_bytes) {
    __m512 accs[AMX_TOKENS], ms[AMX_TOKENS];
    int32_t sums[AMX_Q4_BATCH * AMX_TOKENS * 16] __attribute__((aligned(64)));
    const int8_t *q = x[0].q;
    for (int64_t e = 0; e < rows; e++) accs[e] = ms[e] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < ng; g0 += AMX_Q4_BATCH) {
        int64_t g1 = g0 + AMX_Q4_BATCH < ng ? g0 + AMX_Q4_BATCH : ng, e = first;
        AMX_SUMS(cb + 8 * blk, 64, _tile_dpbsud, 16); /* B: the pair's unpacked codes; sums [g - g0][e][16] */
        for (; e + 4 <= rows; e += 4) amx_q4_scale(sums, dk, mk, x, 4, e, g0, g1, accs, ms);
        if (e + 2 <= rows) amx_q4_scale(sums, dk, mk, x, 2, e, g0, g1, accs, ms), e += 2;
        if (e < rows) amx_q4_scale(sums, dk, mk, x, 1, e, g0, g1, accs, ms);
    }
    for (int64_t e = first; e < rows; e++)
        for (int h = 0; h < 2; h++) { /* each group's half: its flagged residual blocks by the vector code */
            const qvec *xe = x + e;
            __m256 acc = amx_half(accs[e], h);
            for (int64_t f = 0; f < xe->n_flagged; f++) {
                int64_t g = xe->flagged[f];
                __m256i c[8];
                for (int v = 0; v < 8; v++)
                    c[v] = h ? _mm512_extracti64x4_epi64(cb[8 * g + v], 1) : _mm512_castsi512_si256(cb[8 * g + v]);
                acc = _mm256_fmadd_ps(_mm256_mul_ps(amx_half(dk[g], h), _mm256_broadcast_ss(xe->dr + g)),
                                      _mm256_cvtepi32_ps(x8_block_dot(c, xe->r + 32 * g)), acc);
            }
            _mm256_storeu_ps(out + e * os + 8 * h, _mm256_add_ps(acc, amx_half(ms[e], h)));
        }
}

/* rows 8 group .. 8 group + 15 (two groups) . x for T tokens (out[t * os + j]) on the tiles configured for
 * `rows` tokens: T in chunks of rows (the last chunk ends at T and overlaps the one before; its first rows are
 * computed again, not written); ahead: the next pair's blocks from its first (or NULL), all fetched during the
 * first chunk's tile products */
static void dot16_x8_multi_amx(const tdm_weight *w, int64_t group, const qvec *x, int64_t T, int64_t stride,
                               int64_t rows, float *out, int64_t os, const uint8_t *ahead) {
    int64_t ng = w->cols / 32, bb = x8_block_bytes(w);
    __m512i cb[8 * ng] __attribute__((aligned(64)));
    __m512 dk[ng], mk[ng];
    const uint8_t *o0 = x8_block(w, group, 0), *o1 = x8_block(w, group + 1, 0);
    const __m512i lo = _mm512_set1_epi8(15);
    for (int64_t g = 0; g < ng; g++, o0 += bb, o1 += bb) {
        for (int v = 0; v < 4; v++) {
            __m512i p = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(o0 + 32 * v))),
                                           _mm256_loadu_si256((const __m256i *)(o1 + 32 * v)), 1);
            cb[8 * g + 2 * v] = _mm512_and_si512(p, lo);
            cb[8 * g + 2 * v + 1] = _mm512_and_si512(_mm512_srli_epi16(p, 4), lo);
        }
        __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o0 + 128)));
        __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o1 + 128)));
        dk[g] = _mm512_castpd_ps(
            _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(d0)), _mm256_castps_pd(d1), 1));
        mk[g] = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(x8_minimum8(o0, bb))),
                                                    _mm256_castps_pd(x8_minimum8(o1, bb)), 1));
    }
    for (int64_t c0 = 0; c0 < T; c0 += rows) {
        int64_t start = c0 + rows <= T ? c0 : T - rows;
        amx_q4_tokens(cb, dk, mk, ng, x + start, stride, rows, c0 - start, out + start * os, os, c0 == 0 ? ahead : NULL,
                      2 * bb); /* a pair's two groups are contiguous: 2 ng bb bytes */
    }
}

/* the whole row groups [g0, g1) of a KIND_I4X8 weight for T tokens, pairs on the tiles (an odd last group on
 * the vector kernel); 0 where the tiles cannot run here */
static int dot_groups_amx_q4(const tdm_weight *w, int64_t g0, int64_t g1, const qvec *x, int64_t T, float *out,
                             int64_t os) {
    int64_t stride, g = g0;
    if (T < AMX_Q4_MIN_TOKENS || g1 - g0 < 2 || !amx_ready() || (stride = amx_stride(x, T)) == 0) return 0;
    int64_t rows = T < AMX_TOKENS ? T : AMX_TOKENS;
    amx_configure((int)rows, 64);
    for (; g + 2 <= g1; g += 2)
        dot16_x8_multi_amx(w, g, x, T, stride, rows, out + (g - g0) * X8_ROWS, os,
                           g + 4 <= g1 ? x8_block(w, g + 2, 0) : NULL);
    _tile_release();
    if (g < g1) dot8_x8_multi(w, g, x, T, out + (g - g0) * X8_ROWS, os);
    return 1;
}
#else
static int dot_groups_amx_q4(const tdm_weight *w, int64_t g0, int64_t g1, const qvec *x, int64_t T, float *out,
                             int64_t os) {
    (void)w, (void)g0, (void)g1, (void)x, (void)T, (void)out, (void)os;
    return 0;
}
#endif

/* the whole row groups [g0, g1) of a KIND_I8X8 weight for T tokens (out: group g0's first row) on the tiles;
 * 0 where they cannot run here (then the vector kernel does) */
static int dot_groups_amx(const tdm_weight *w, int64_t g0, int64_t g1, const qvec *x, int64_t T, float *out,
                          int64_t os) {
    int64_t stride;
    if (w->kind == KIND_I4X8) return dot_groups_amx_q4(w, g0, g1, x, T, out, os);
    if (w->kind != KIND_I8X8 || T < AMX_MIN_TOKENS || g1 <= g0 || !amx_ready() || (stride = amx_stride(x, T)) == 0)
        return 0;
    int64_t rows = T < AMX_TOKENS ? T : AMX_TOKENS;
    amx_configure((int)rows, 32);
    for (int64_t g = g0; g < g1; g++)
        dot8_x8_i8_multi_amx(w, g, x, T, stride, rows, out + (g - g0) * X8_ROWS, os,
                             g + 1 < g1 ? x8_i8_block(w, g + 1, 0) : NULL);
    _tile_release();
    return 1;
}

#undef AMX_SUMS
#undef AMX_BLOCK

/* the tiles in this process: 1 granted (a product has used them), -1 refused or TANDEM_AMX=0, 0 not asked yet */
int64_t tdm_amx_state(void) { return __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE); }
#else
int64_t tdm_amx_state(void) { return 0; } /* a build without the tile kernels */
#endif
#endif
