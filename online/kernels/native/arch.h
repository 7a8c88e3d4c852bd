/* Per-layer pieces of Qwen3, Gemma 3 and OPT shared by the single- and multi-token steps (so both round
 * alike): q/k head norms, sandwich output norms, per-layer windows and rope tables, scaled embeddings,
 * softcapped logits; OPT's LayerNorm (mean and variance, weight and bias) and learned positions.
 * Included by decode.c after its structs and rms_norm. */
#ifndef TANDEM_ARCH_H
#define TANDEM_ARCH_H

/* the same arithmetic as rms_norm, x overwritten (a q / k head, the sandwich norms) */
static void rms_norm_in_place(float *x, const float *w, int64_t n, float eps) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) x[i] = x[i] * r * w[i];
}

enum { NORM_RMS = 0, NORM_LAYER = 1 };

/* out = (x - mean) / sqrt(var + eps) * w + b (biased variance, as torch's layer_norm; b NULL: none) */
static void layer_norm(float *restrict out, const float *restrict x, const float *restrict w, const float *b,
                       int64_t n, float eps) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += x[i];
    float mean = sum / (float)n, ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += (x[i] - mean) * (x[i] - mean);
    float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = (x[i] - mean) * r * w[i] + (b ? b[i] : 0.0f);
}

/* the model's norm of a residual stream: RMSNorm, or LayerNorm with its bias */
static void model_norm(const tdm_model *m, float *out, const float *x, const float *w, const float *b) {
    if (m->norm_kind == NORM_LAYER)
        layer_norm(out, x, w, b, m->d, (float)m->norm_eps);
    else
        rms_norm(out, x, w, m->d, (float)m->norm_eps);
}

/* learned positions (OPT): res += pos_embed[pos] (the table starts at OPT's offset) */
static void add_position(const tdm_model *m, int64_t pos, float *res) {
    if (!m->pos_embed) return;
    const float *p = m->pos_embed + pos * m->d;
    for (int64_t k = 0; k < m->d; k++) res[k] += p[k];
}

static int64_t layer_window(const tdm_model *m, const tdm_layer *L) { return L->window > 0 ? L->window : m->window; }

static int64_t window_start(const tdm_model *m, const tdm_layer *L, int64_t pos) {
    int64_t w = layer_window(m, L);
    return (w > 0 && pos + 1 > w) ? pos + 1 - w : 0;
}

/* head u of the q|k|v projection after bias: q/k norm (Qwen3, Gemma 3), then rope with the layer's table */
static void qk_head(const tdm_model *m, const tdm_layer *L, int64_t u, int64_t pos, float *v) {
    int64_t hd = m->head_dim;
    if (u >= m->n_heads + m->n_kv) return;
    const float *w = u < m->n_heads ? L->q_norm : L->k_norm;
    if (w) rms_norm_in_place(v, w, hd, (float)m->norm_eps);
    const float *c = L->rope_cos ? L->rope_cos : m->rope_cos, *s = L->rope_cos ? L->rope_sin : m->rope_sin;
    if (c) rope_head(v, c + pos * hd, s + pos * hd, hd);
}

/* res += delta, or res += norm(delta) with a sandwich norm (tmp [d] scratch; may be delta itself) */
static void add_output(const tdm_model *m, const float *norm, float *res, const float *delta, float *tmp) {
    if (norm) {
        if (tmp != delta) memcpy(tmp, delta, 4 * m->d);
        rms_norm_in_place(tmp, norm, m->d, (float)m->norm_eps);
        delta = tmp;
    }
    for (int64_t k = 0; k < m->d; k++) res[k] += delta[k];
}

static void embed_row(const tdm_model *m, int64_t token, float *res) {
    const float *e = m->embed + token * m->d;
    if (m->embed_scale == 0.0 || m->embed_scale == 1.0) {
        memcpy(res, e, 4 * m->d);
        return;
    }
    float s = (float)m->embed_scale;
    for (int64_t k = 0; k < m->d; k++) res[k] = e[k] * s;
}

static void softcap(const tdm_model *m, float *logits, int64_t n) {
    if (m->logit_softcap <= 0.0) return;
    float cap = (float)m->logit_softcap;
    for (int64_t i = 0; i < n; i++) logits[i] = tanhf(logits[i] / cap) * cap;
}

#endif
