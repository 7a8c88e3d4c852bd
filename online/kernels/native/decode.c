/* One decode step (T = 1) of a Llama-family decoder, whole model in one call; with Qwen3's q/k head
 * norms and Gemma 3's sandwich norms, scaled embeddings, softcapped logits and per-layer windows and
 * rope tables (tdm_layer / tdm_model fields at their ends; NULL / 0 = the Llama layout).
 *
 * The Python side (online/execution/fused_decode.py) fills a tdm_model with pointers into the
 * tensors the modular runtime already holds (packed weights, norms, rope tables, the KV cache), so
 * the two paths share every byte and prefill (modular, batched) hands its cache to this decode.
 *
 * Matrix-vector products read the packed weights as they are (quantize.py's formats: fp32, per-row
 * int8, Q8_0 blocks, Q4_1-style int4 groups of 32/64) against the activation quantized to int8 in
 * blocks of 32 (scale per block, exact float block sums for the int4 minimum term), llama.cpp's
 * Q8 trick: an int8 x uint4 dot product is two AVX2 instructions per 32 weights. The FFN down
 * projection is transposed (rows = neurons) and only the rows whose |h| passes the layer's
 * threshold are added (the plan's sparse CPU path).
 *
 * Threads: one OpenMP parallel region per call; every matrix is split by rows over the threads,
 * with a barrier where a phase needs the whole previous result (four per layer). Small vectors
 * (the residual stream, norms, activation quantization) are recomputed by every thread instead of
 * shared: cheaper than a barrier. Row kernels in rows.h, attention (float32 or float16 KV) in attention.h.
 *
 * The multi-token step (tdm_decode_batch: T tokens of one or several sequences over a paged KV
 * layout, each weight row read once for all T) is batch.h with its row kernels in rows_multi.h;
 * it is bit-identical to this single-token step per token. The library is built with
 * -ffp-contract=off so that no scalar a*b+c rounds differently at one call site than at another.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

/* thread t of nt's share [lo, hi) of n units (heads, tokens x heads, ...) */
static void chunk(int64_t n, int t, int nt, int64_t *lo, int64_t *hi) {
    *lo = n * t / nt;
    *hi = n * (t + 1) / nt;
}

/* chunk for a matrix's rows (the probe's passes; the step takes ROW_UNIT units: units.h), on whole groups of
 * eight (the interleaved kernels' row groups, blocks_x8.h): no range starts or ends inside a group that the
 * scalar row (dot_row_x8, ~10x slower per row) would compute. Each row's value does not depend on the split. */
static void row_chunk(int64_t n, int t, int nt, int64_t *lo, int64_t *hi) {
    int64_t groups = (n + 7) / 8;
    *lo = groups * t / nt * 8;
    *hi = t == nt - 1 ? n : groups * (t + 1) / nt * 8;
    if (*lo > n) *lo = n;
    if (*hi > n) *hi = n;
}

/* The slices of `slice` rows that thread t of nt takes of n rows: b0 from *lo while b0 < *hi, in steps of *step.
 * contiguous: one run of slices per thread, so each thread streams its rows (every row is read: the work is
 * even); otherwise every nt-th slice, which spreads uneven work (rows a cut keeps) over the threads. */
static void slice_range(int64_t n, int64_t slice, int contiguous, int t, int nt, int64_t *lo, int64_t *hi,
                        int64_t *step) {
    if (contiguous) {
        int64_t slices = (n + slice - 1) / slice;
        *lo = slices * t / nt * slice;
        *hi = slices * (t + 1) / nt * slice;
        if (*hi > n) *hi = n;
        *step = slice;
    } else {
        *lo = t * slice;
        *hi = n;
        *step = nt * slice;
    }
}

#include "units.h" /* phases cut into units, shared out with stealing (next_unit) */
#include "attention.h"
#include "rows.h"
#include "dequant.h"
#include "predict.h"

enum { ACT_SILU = 0, ACT_RELU = 1, ACT_FATRELU = 2, ACT_DRELU = 3, ACT_GELU = 4, ACT_GELU_TANH = 5 };
typedef struct {
    const float *attn_norm, *ffn_norm;          /* [d] */
    const float *qkv_bias, *o_bias, *down_bias; /* NULL when absent */
    void *k_cache, *v_cache;                    /* [n_kv, capacity, head_dim]: float32, float16 with kv_half */
    tdm_weight qkv, o, gate, up, down_t;        /* down_t: [n_ff, d], rows = neurons */
    double threshold;                           /* |h| > threshold is computed; < 0: all */
    const tdm_predictor *pred;                  /* NULL: no predictor (predict.h) */
    /* Qwen3 / Gemma 3 (NULL / 0: absent, the Llama layout) */
    const float *q_norm, *k_norm;               /* [head_dim]: RMSNorm of every q / k head before rope */
    const float *attn_out_norm, *ffn_out_norm;  /* [d]: RMSNorm of the attention / FFN output (sandwich) */
    const float *rope_cos, *rope_sin;           /* this layer's own rope table (Gemma's local layers) */
    int64_t window;                             /* > 0: this layer's sliding window (else the model's) */
    /* OPT (NULL: absent): LayerNorm biases of the attention / FFN input norms, the up projection's bias */
    const float *attn_norm_bias, *ffn_norm_bias, *up_bias; /* [d], [d], [n_ff] */
    int64_t n_ff;                               /* this layer's FFN width (0: the model's n_ff) */
    const struct tdm_moe *moe;                  /* non-NULL: a MoE layer (moe.h); gate/up/down_t unused */
    tdm_weight down;                            /* [d, n_ff] dense down (data NULL: the sparse down_t rows) */
    /* q/k/v of different block kinds (Q4_K_M's Q6_K v): qkv holds q only, k / v their own rows;
     * k.data NULL: qkv stacks all three */
    tdm_weight k, v;
} tdm_layer;

typedef struct {
    int64_t n_layers, d, n_heads, n_kv, head_dim, n_ff, vocab, capacity, window, act, gated, threads;
    double norm_eps, act_alpha, attn_scale;
    double residual_ratio;              /* see quantize_q8; < 0: plain int8 activations */
    const float *embed;                 /* [vocab, d] */
    const float *final_norm;            /* [d] */
    const float *rope_cos, *rope_sin;   /* [positions, head_dim], NULL: no rope */
    int64_t rope_positions;
    tdm_weight head;
    tdm_layer *layers;
    uint8_t *work;                      /* tdm_work_bytes(model) bytes, 64-byte aligned */
    double embed_scale;                 /* embeddings times this (Gemma: sqrt(d)); 0: 1 */
    double logit_softcap;               /* logits = cap * tanh(logits / cap); 0: none */
    /* OPT (0 / NULL: RMSNorm, rope): the norm kind (arch.h), the final norm's bias, learned positions */
    int64_t norm_kind;                  /* NORM_RMS / NORM_LAYER */
    const float *final_norm_bias;       /* [d] */
    const float *pos_embed;             /* [rope_positions, d]: position p's row (OPT's offset applied) */
    int64_t kv_half;                    /* 1: the layers' k_cache / v_cache hold float16 (attention.h), 0: float32 */
} tdm_model;

/* ---------------------------------------------------------------------------------------------
 * Scratch layout */

typedef struct {
    float *delta, *qkv, *attn, *partial; /* shared: o-proj output [d], [q+2kv], [q], [threads, d] */
    int64_t *counts;                     /* [threads] */
    float *hfull;                        /* [n_ff] the dense down's input (zero between layers) */
    float *parts;                        /* [n_heads, segments, hd + 2] attention parts (attend_parts.h) */
    int64_t *units;                      /* [n_layers * UNIT_PHASES + 1, threads, UNIT_STRIDE] phase counters */
} shared_bufs;

/* Every thread keeps its own copy of the residual stream, updated from the shared pieces in the
 * same order by all threads (so the copies stay bit-identical): no barrier to publish it. */
typedef struct {
    float *res, *xn, *h, *scores; /* [d], [max_in], [n_ff], [group_heads, capacity] */
    int32_t *idx;                 /* [n_ff] active neuron ids */
    qvec x;
} thread_bufs;

static int64_t align64(int64_t n) { return (n + 63) & ~(int64_t)63; }

static int64_t max_in(const tdm_model *m) {
    int64_t a = m->d > m->n_heads * m->head_dim ? m->d : m->n_heads * m->head_dim;
    return a > m->n_ff ? a : m->n_ff;
}

static int64_t unit_bytes(const tdm_model *m) { return 8 * (m->n_layers * UNIT_PHASES + 1) * m->threads * UNIT_STRIDE; }

static int64_t shared_bytes(const tdm_model *m) {
    int64_t q = m->n_heads * m->head_dim, kv = m->n_kv * m->head_dim;
    return align64(4 * m->d) + align64(4 * (q + 2 * kv)) + align64(4 * q) + align64(4 * m->threads * m->d)
           + align64(8 * m->threads) + align64(4 * m->n_ff)
           + align64(4 * m->n_heads * max_segments(m->capacity) * PART_FLOATS(m->head_dim)) + align64(unit_bytes(m));
}

/* query heads one attend_group call may take: a whole KV group, at most TDM_MAX_GROUP of them */
static int64_t group_heads(const tdm_model *m) {
    int64_t rep = m->n_heads / m->n_kv;
    return rep <= TDM_MAX_GROUP ? rep : TDM_MAX_GROUP;
}

static int64_t thread_bytes(const tdm_model *m) {
    int64_t n = max_in(m);
    return align64(4 * m->d) + align64(4 * n) + 4 * align64(4 * (n / QB + 1)) + 2 * align64(4 * m->n_ff)
           + align64(4 * m->capacity * group_heads(m)) + 2 * align64(n);
}

static int64_t moe_bytes(const tdm_model *m); /* moe.h: MoE scratch after the step's own */

int64_t tdm_work_bytes(const tdm_model *m) { return shared_bytes(m) + m->threads * thread_bytes(m) + moe_bytes(m); }

static shared_bufs get_shared(const tdm_model *m) {
    int64_t q = m->n_heads * m->head_dim, kv = m->n_kv * m->head_dim;
    uint8_t *p = m->work;
    shared_bufs s;
    s.delta = (float *)p; p += align64(4 * m->d);
    s.qkv = (float *)p; p += align64(4 * (q + 2 * kv));
    s.attn = (float *)p; p += align64(4 * q);
    s.partial = (float *)p; p += align64(4 * m->threads * m->d);
    s.counts = (int64_t *)p; p += align64(8 * m->threads);
    s.hfull = (float *)p; p += align64(4 * m->n_ff);
    s.parts = (float *)p; p += align64(4 * m->n_heads * max_segments(m->capacity) * PART_FLOATS(m->head_dim));
    s.units = (int64_t *)p;
    return s;
}

static thread_bufs get_thread(const tdm_model *m, int t) {
    int64_t n = max_in(m);
    uint8_t *p = m->work + shared_bytes(m) + t * thread_bytes(m);
    thread_bufs b;
    b.res = (float *)p; p += align64(4 * m->d);
    b.xn = (float *)p; p += align64(4 * n);
    b.x.d = (float *)p; p += align64(4 * (n / QB + 1));
    b.x.dr = (float *)p; p += align64(4 * (n / QB + 1));
    b.x.s = (float *)p; p += align64(4 * (n / QB + 1));
    b.x.flagged = (int32_t *)p; p += align64(4 * (n / QB + 1));
    b.h = (float *)p; p += align64(4 * m->n_ff);
    b.idx = (int32_t *)p; p += align64(4 * m->n_ff);
    b.scores = (float *)p; p += align64(4 * m->capacity * group_heads(m));
    b.x.q = (int8_t *)p; p += align64(n);
    b.x.r = (int8_t *)p;
    b.x.f = b.xn;
    return b;
}

/* Self-check entry (tests/test_interleaved_rows.py): [lo, hi) of thread t of nt over n rows */
void tdm_row_chunk(int64_t n, int64_t t, int64_t nt, int64_t *out) { row_chunk(n, (int)t, (int)nt, out, out + 1); }

/* ---------------------------------------------------------------------------------------------
 * Vector helpers */

static void rms_norm(float *restrict out, const float *restrict x, const float *restrict w, int64_t n, float eps) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

#include "arch.h" /* Qwen3 / Gemma 3 / OPT layer pieces (q/k norms, sandwich norms, windows, softcap, LayerNorm) */

static float act_fn(int64_t act, float alpha, float g, float u) {
    switch (act) {
    case ACT_SILU: return g / (1.0f + expf(-g)) * u;
    case ACT_RELU: return (g > 0.0f ? g : 0.0f) * u;
    case ACT_FATRELU: return g > alpha ? g * u : 0.0f;
    case ACT_DRELU: return (g > 0.0f ? g : 0.0f) * (u > 0.0f ? u : 0.0f);
    case ACT_GELU: return 0.5f * g * (1.0f + erff(g * 0.7071067811865476f)) * u;
    default: { /* 0.5 (1 + tanh(a)) = 1 / (1 + e^(-2a)): the form activate's eight-wide loop computes */
        float inner = 0.7978845608028654f * (g + 0.044715f * g * g * g);
        return g * u / (1.0f + expf(-2.0f * inner));
    }
    }
}

/* h[i] = act(g[i]) * u[i] (plain FFNs: act(u[i])); gated SiLU and GELU-tanh eight at a time where
 * AVX2 is there (exp8: ~1 ulp from expf, so lanes and the scalar tail agree to rounding) */
static void activate(int64_t act, float alpha, int64_t gated, const float *g, const float *u, float *h, int64_t n) {
    int64_t i = 0;
#ifdef TDM_SIMD
    if (act == ACT_SILU && gated) {
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 e = exp8(_mm256_sub_ps(zero, gv));
            _mm256_storeu_ps(h + i, _mm256_div_ps(_mm256_mul_ps(gv, _mm256_loadu_ps(u + i)), _mm256_add_ps(one, e)));
        }
    }
    if (act == ACT_GELU_TANH && gated) {
        const __m256 one = _mm256_set1_ps(1.0f), c = _mm256_set1_ps(0.7978845608028654f);
        const __m256 k = _mm256_set1_ps(0.044715f), m2 = _mm256_set1_ps(-2.0f);
        for (; i + 8 <= n; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 cube = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(k, gv), gv), gv); /* as act_fn */
            __m256 inner = _mm256_mul_ps(c, _mm256_add_ps(gv, cube));
            __m256 e = exp8(_mm256_mul_ps(m2, inner));
            _mm256_storeu_ps(h + i, _mm256_div_ps(_mm256_mul_ps(gv, _mm256_loadu_ps(u + i)), _mm256_add_ps(one, e)));
        }
    }
#endif
    for (; i < n; i++) h[i] = gated ? act_fn(act, alpha, g[i], u[i]) : act_fn(act, alpha, u[i], 1.0f);
}

/* ---------------------------------------------------------------------------------------------
 * The step */

static void norm_and_quantize(const tdm_model *m, const float *x, const float *w, const float *b, thread_bufs *tb) {
    model_norm(m, tb->xn, x, w, b);
    tb->x.f = tb->xn;
    quantize_q8(tb->xn, m->d, &tb->x, (float)m->residual_ratio);
}

/* Head unit u's weight (q heads, then k heads, then v heads) and its first row there: the stacked qkv,
 * or q / k / v apart where their block kinds differ (k.data set). */
static const tdm_weight *qkv_unit(const tdm_model *m, const tdm_layer *L, int64_t u, int64_t *r0) {
    int64_t part = !L->k.data || u < m->n_heads ? 0 : u < m->n_heads + m->n_kv ? 1 : 2;
    *r0 = (u - (part ? m->n_heads + (part - 1) * m->n_kv : 0)) * m->head_dim;
    return part == 0 ? &L->qkv : part == 1 ? &L->k : &L->v;
}

/* q/k/v rows are dealt out in whole heads, so each thread ropes its own heads and writes its k/v
 * heads into the cache without waiting for the others. */
static void attention_block(const tdm_model *m, const tdm_layer *L, int64_t pos, shared_bufs *sb,
                            thread_bufs *tb, int64_t *units, int t, int nt) {
    int64_t hd = m->head_dim, qn = m->n_heads * hd, half = m->kv_half != 0;
    norm_and_quantize(m, tb->res, L->attn_norm, L->attn_norm_bias, tb);
    unit_queue heads = phase_units(units, 0, m->n_heads + 2 * m->n_kv, t, nt);
    for (int64_t u; (u = next_unit(&heads)) >= 0;) { /* q heads, then k heads, then v heads */
        float *v = sb->qkv + u * hd;
        int64_t r0;
        const tdm_weight *w = qkv_unit(m, L, u, &r0); /* sets r0 (argument order is unspecified) */
        dot_rows(w, r0, hd, &tb->x, v);
        if (L->qkv_bias)
            for (int64_t k = 0; k < hd; k++) v[k] += L->qkv_bias[u * hd + k];
        qk_head(m, L, u, pos, v);
        if (u >= m->n_heads + m->n_kv)
            kv_store(kv_at(L->v_cache, (u - m->n_heads - m->n_kv) * m->capacity + pos, hd, half), v, hd, half);
        else if (u >= m->n_heads)
            kv_store(kv_at(L->k_cache, (u - m->n_heads) * m->capacity + pos, hd, half), v, hd, half);
    }
#pragma omp barrier
    tb->x.f = (float *)attend_token(L->k_cache, L->v_cache, m->capacity, m->n_heads, m->n_heads / m->n_kv,
                                    group_heads(m), window_start(m, L, pos), pos, hd, (float)m->attn_scale, sb->qkv,
                                    sb->attn, sb->parts, tb->scores, m->capacity, half, tb->xn, t, nt);
    quantize_q8(tb->x.f, qn, &tb->x, (float)m->residual_ratio);
    unit_queue rows = row_units(units, 2, m->d, ROW_UNIT, t, nt);
    for (int64_t lo, hi; next_rows(&rows, &lo, &hi);) {
        dot_rows(&L->o, lo, hi - lo, &tb->x, sb->delta + lo);
        if (L->o_bias)
            for (int64_t r = lo; r < hi; r++) sb->delta[r] += L->o_bias[r];
    }
#pragma omp barrier
    add_output(m, L->attn_out_norm, tb->res, sb->delta, tb->xn);
}

#include "ffn.h" /* one layer's FFN: rows, down rows or dense down, MoE dispatch */
#include "probe.h" /* benchmark entries: the row kernels timed as the step reads (online/kind_probe.py) */

int64_t tdm_decode_range(const tdm_model *m, int64_t first, int64_t last, int64_t pos, float *res, float *logits);

/* logits [vocab] for token at position pos (pos < capacity, pos < rope_positions). Returns the number
 * of FFN neurons computed (summed over layers). */
int64_t tdm_decode(const tdm_model *m, int64_t token, int64_t pos, float *logits) {
    float res[m->d]; /* the token's residual stream: its embedding, then every layer (tdm_decode_range) */
    embed_row(m, token, res);
    add_position(m, pos, res);
    return tdm_decode_range(m, 0, m->n_layers, pos, res, logits);
}

/* The token's input row at pos into res [d] (embedding, its scale, a learned position): the GPU step's
 * host embedding, where the embeddings are not on the tier. */
void tdm_embed(const tdm_model *m, int64_t token, int64_t pos, float *res) {
    embed_row(m, token, res);
    add_position(m, pos, res);
}

/* Self-check for the tests: out[i] = W[r0 + i] . x (i < n) with the code the step uses. */
void tdm_dot_rows(const tdm_weight *w, int64_t r0, int64_t n, const float *x, double residual_ratio, float *out) {
    int64_t cols = w->cols, nb = cols / QB + 1;
    int8_t q[cols], rq[cols];
    float d[nb], dr[nb], s[nb];
    int32_t flagged[nb];
    qvec v = {x, q, rq, d, dr, s, flagged, 0};
    if (cols % QB == 0) quantize_q8(x, cols, &v, (float)residual_ratio);
    dot_rows(w, r0, n, &v, out);
}

/* Self-check for the tests: scores[0..n) = e^(scores - max) as attention's softmax forms them; returns the sum */
double tdm_softmax_exp(float *scores, int64_t n) { return n > 0 ? softmax_exp(scores, 0, n - 1, NULL) : 0.0; }

/* Layer offload (llama.cpp -ngl): layers [first, last) of m->layers on the residual stream res [d]
 * (in/out, the tokens' stream after the layers run elsewhere); with logits != NULL also the final
 * norm and the output layer. Returns the FFN neurons computed. */
static int64_t decode_parts(const tdm_model *m, int64_t first, int64_t last, int64_t pos, float *res, float *logits,
                            int64_t parts);

int64_t tdm_decode_range(const tdm_model *m, int64_t first, int64_t last, int64_t pos, float *res, float *logits) {
    return decode_parts(m, first, last, pos, res, logits, 3);
}

/* Parts of layers [first, last) on res: 1 = attention, 2 = FFN, 3 = both (the GPU step runs the other
   part of a layer on the GPU). No logits. */
int64_t tdm_decode_parts(const tdm_model *m, int64_t first, int64_t last, int64_t pos, float *res, int64_t parts) {
    return decode_parts(m, first, last, pos, res, NULL, parts);
}

static int64_t decode_parts(const tdm_model *m, int64_t first, int64_t last, int64_t pos, float *res, float *logits,
                            int64_t parts) {
    shared_bufs sb = get_shared(m);
    int nt = (int)m->threads;
    for (int j = 0; j < nt; j++) sb.counts[j] = 0;
    memset(sb.hfull, 0, 4 * (size_t)m->n_ff);
    moe_clear(m, m->work + shared_bytes(m) + m->threads * thread_bytes(m));
    int64_t n_run = last > first ? last - first : 0; /* counters of these layers and the output layer only */
    memset(sb.units, 0, 8 * (size_t)((n_run * UNIT_PHASES + 1) * nt * UNIT_STRIDE));
#pragma omp parallel num_threads(nt)
    {
        int t = omp_get_thread_num(), n = omp_get_num_threads();
        thread_bufs tb = get_thread(m, t);
        memcpy(tb.res, res, 4 * m->d);
        for (int64_t l = first; l < last; l++) {
            int64_t *units = layer_units(sb.units, l - first, n);
            if (parts & 1) attention_block(m, &m->layers[l], pos, &sb, &tb, units, t, n);
            if (parts & 2) ffn_block(m, &m->layers[l], &sb, &tb, units, t, n);
        }
#pragma omp barrier
        if (t == 0) memcpy(res, tb.res, 4 * m->d); /* every thread's copy is bit-identical */
        if (logits) {
            norm_and_quantize(m, tb.res, m->final_norm, m->final_norm_bias, &tb);
            unit_queue head = row_units(layer_units(sb.units, n_run, n), 0, m->vocab, HEAD_UNIT, t, n);
            for (int64_t lo, hi; next_rows(&head, &lo, &hi);) {
                dot_rows(&m->head, lo, hi - lo, &tb.x, logits + lo);
                softcap(m, logits + lo, hi - lo);
            }
        }
    }
    int64_t total = 0;
    for (int j = 0; j < nt; j++) total += sb.counts[j];
    return total;
}

#include "moe.h" /* MoE layers: router, top-k, experts through ffn_rows, shared expert */

#include "batch.h" /* the multi-token step (T tokens of one or several sequences, one region) */
#include "module.h" /* the module path's float-activation kernels (online/kernels/cpu_kernels.py) */
