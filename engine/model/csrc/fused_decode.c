/*
 * The decoder layers of a Llama-family model for one decode step, in one call
 * and one OpenMP parallel region (engine/model/fused_decode.py).
 *
 * With a few tokens per step, the torch path's cost is not its arithmetic: a
 * layer is about forty Python-level calls, and each kernel among them is an
 * OpenMP region of its own, a fork of the thread team and a join at its end.
 * Here the team is forked once per step and its threads meet at barriers
 * between the phases of each layer (GOMP spins at a barrier before sleeping,
 * so a meeting costs well under a microsecond when both threads are running),
 * which is how llama.cpp runs its graph. Per layer:
 *
 *   1. residual += x; x = RMSNorm(residual) (quantize x)   rows split over threads
 *   2. qkv = x Wqkv^T (+ b)                                  output tiles split
 *   3. rotary on q, k; k, v into the cache; attention       (request, kv head) tasks split
 *      (quantize the heads' output)
 *   4. x = attn Wo^T (+ b)                                   output tiles split
 *   5. residual += x; x = RMSNorm(residual) (quantize x)   rows split
 *   6. gate_up = x Wgu^T (+ b)                               output tiles split
 *   7. act = silu(gate) * up (quantize act)                  (row, 256 features) spans split
 *   8. x = act Wdown^T (+ b)                                 output tiles split
 *
 * (the quantize steps only for quantized weights)
 *
 * and after the last layer x = RMSNorm(residual + x), written to `hidden`.
 *
 * Every phase calls the very code of the per-op kernels (this file includes
 * them: cpu_ops.c, paged_decode_attention.c, quant_gemv.c; their one-row and
 * one-task functions, which open no parallel region of their own) and rounds
 * to the activations' dtype where the torch path does (each op's output), so
 * on quantized weights the result is the unfused path's bit for bit in float32
 * and bfloat16. quant_kernels.force_isa does not reach this library: it always
 * runs the best instruction set its build has.
 *
 * Weights are either all quantized (quant_gemv.c's packed q4/q8, activations
 * quantized per 32-block before each product) or all dense (KIND_DENSE: a
 * plain [out, in] matrix in the activations' dtype, multiplied in
 * dense_linear_rows below; the unfused path's oneDNN GEMM sums in another
 * order, so dense results equal it to rounding, not bit for bit).
 * Activations, dense weights, the norms' weights, biases, the rotary table
 * and the KV cache are all float32 or all bfloat16 (`bf16`). Layouts:
 *   hidden       [B, hidden_size]: in, the token embeddings; out, the final hidden states
 *   positions    [B] int64;  slots [B] int64 cache slot of each token
 *   block_table  [B, block_table_stride] int32;  seq_lens [B] int32 (keys to attend, this token included)
 *   cos_sin      [max_positions, head_dim]: cos of each rotary frequency, then sin (RotaryEmbedding.cos_sin)
 *   key_cache, value_cache  [num_blocks, block_size, num_kv_heads, head_dim]
 */
#include "cpu_ops.c"
#include "paged_decode_attention.c"
#include "quant_gemv.c"

typedef struct {
    const qweight_t *qkv, *o, *gate_up, *down;
    const void *qkv_bias, *o_bias, *gate_up_bias, *down_bias; /* [out_features], or NULL */
    const void *input_norm, *post_norm;                        /* [hidden_size] */
    void *key_cache, *value_cache;
    int64_t window; /* sliding-window attention over the last `window` keys; 0: all of them */
} fused_layer_t;

typedef struct {
    int64_t num_layers, hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim, block_size, bf16;
    int64_t quantized; /* the projections are q4/q8, else KIND_DENSE */
    float eps, scale;
    const fused_layer_t *layers;
    const void *final_norm; /* [hidden_size] */
    const void *cos_sin;
    int64_t max_positions; /* rows of cos_sin */
} fused_model_t;

#define ACT_SPAN 8   /* blocks of 32 features per task of phase 7 */
#define KIND_DENSE 2 /* a qweight_t whose data is a plain [out, in] matrix in the activations' dtype */
#define DENSE_ROWS 4 /* rows of x sharing each pass over a dense weight row */

/* Output features [n0, n1) of y [M, N] = x [M, K] W^T (+ bias) for a dense W [N, K], x, W, y and bias in the
 * activations' dtype, sums in fp32 (bf16 pairs by vdpbf16ps where the CPU has it, as oneDNN does). */
static inline __attribute__((always_inline)) void dense_linear_rows(const qweight_t *w, const void *x, int64_t M,
                                                                    int64_t n0, int64_t n1, const void *bias,
                                                                    void *y, int bf16) {
    const int64_t K = w->in_features, N = w->out_features;
    for (int64_t n = n0; n < n1; n++) {
        const char *wn = (const char *)w->data + ESIZE(bf16) * n * K;
        const float b = bias ? LOAD(bias, n, bf16) : 0.0f;
        for (int64_t m0 = 0; m0 < M; m0 += DENSE_ROWS) {
            const int64_t mt = M - m0 < DENSE_ROWS ? M - m0 : DENSE_ROWS;
            float sums[DENSE_ROWS];
#if defined(__AVX512F__)
            __m512 acc[DENSE_ROWS];
            for (int64_t j = 0; j < mt; j++) acc[j] = _mm512_setzero_ps();
            if (bf16) {
                for (int64_t k = 0; k < K; k += 32) {
                    const __m512i wv = _mm512_loadu_si512(wn + 2 * k);
                    for (int64_t j = 0; j < mt; j++) {
                        const __m512i xv = _mm512_loadu_si512((const uint16_t *)x + (m0 + j) * K + k);
#if defined(__AVX512BF16__)
                        acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)xv, (__m512bh)wv);
#else /* widen each bf16 half to fp32: the upper 16 bits of a float */
                        const __m512i mask = _mm512_set1_epi32((int)0xffff0000);
                        acc[j] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(xv, 16)),
                                                 _mm512_castsi512_ps(_mm512_slli_epi32(wv, 16)), acc[j]);
                        acc[j] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(xv, mask)),
                                                 _mm512_castsi512_ps(_mm512_and_si512(wv, mask)), acc[j]);
#endif
                    }
                }
            } else {
                for (int64_t k = 0; k < K; k += 16) {
                    const __m512 wv = _mm512_loadu_ps((const float *)wn + k);
                    for (int64_t j = 0; j < mt; j++)
                        acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps((const float *)x + (m0 + j) * K + k), wv, acc[j]);
                }
            }
            for (int64_t j = 0; j < mt; j++) sums[j] = _mm512_reduce_add_ps(acc[j]);
#else
            for (int64_t j = 0; j < mt; j++) {
                const char *xj = (const char *)x + ESIZE(bf16) * (m0 + j) * K;
                float sum = 0.0f;
                for (int64_t k = 0; k < K; k++) sum += LOAD(xj, k, bf16) * LOAD(wn, k, bf16);
                sums[j] = sum;
            }
#endif
            for (int64_t j = 0; j < mt; j++) STORE(y, (m0 + j) * N + n, sums[j] + b, bf16);
        }
    }
}

/* y [M, out_features] = x W^T (+ bias); the calling team splits the output features in tiles of 16. A
 * quantized W reads x quantized in `a`, a dense one x itself. */
static inline __attribute__((always_inline)) void team_linear(int isa, const qweight_t *w, const acts_t *a,
                                                              const void *x, int64_t M, const void *bias, void *y,
                                                              int bf16) {
    const int64_t N = w->out_features, num_tiles = (N + ROWS - 1) / ROWS;
    if (w->kind == KIND_DENSE) {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < num_tiles; t++)
            dense_linear_rows(w, x, M, t * ROWS, (t + 1) * ROWS < N ? (t + 1) * ROWS : N, bias, y, bf16);
    } else {
        const weight_t tiles = tiles_of(w);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < num_tiles; t++)
            gemm_tile(isa, (int)w->kind, &tiles, a, M, N, t, bias, bf16, y, bf16);
    }
}

/* Phase 3 for request r and kv head h: its query heads and key rotated in place in the qkv row, its key and
 * value into the cache, attention over the request's context, the heads' output into attn (then quantized). */
static inline __attribute__((always_inline)) void attention_task(const fused_model_t *m, const fused_layer_t *layer,
                                                                 char *qkv, char *attn, acts_t *a, int64_t r,
                                                                 int64_t h, const int64_t *positions,
                                                                 const int64_t *slots, const int32_t *block_table,
                                                                 int64_t block_table_stride, const int32_t *seq_lens,
                                                                 attend_fn attend_task, int bf16) {
    const int64_t es = ESIZE(bf16), group = m->num_heads / m->num_kv_heads, head_dim = m->head_dim;
    const int64_t nq = m->num_heads * head_dim, nkv = m->num_kv_heads * head_dim;
    char *row = qkv + es * r * (nq + 2 * nkv);
    char *query = row + es * h * group * head_dim, *key = row + es * (nq + h * head_dim), *value = key + es * nkv;
    const char *cos = (const char *)m->cos_sin + es * positions[r] * head_dim, *sin = cos + es * head_dim / 2;
    rotary_row(query, cos, sin, group, head_dim, bf16);
    rotary_row(key, cos, sin, 1, head_dim, bf16);
    const int64_t slot = slots[r] * nkv + h * head_dim;
    memcpy((char *)layer->key_cache + es * slot, key, es * head_dim);
    memcpy((char *)layer->value_cache + es * slot, value, es * head_dim);
    float q[MAX_QUERY], out[MAX_QUERY];
    const int64_t first = h * group * head_dim, last = first + group * head_dim;
    for (int64_t i = first; i < last; i++) q[i] = LOAD(row, i, bf16);
    attend_task(q, layer->key_cache, layer->value_cache, block_table + r * block_table_stride, seq_lens[r],
                layer->window, out, m->num_heads, m->num_kv_heads, head_dim, m->block_size, m->scale, h, h + 1);
    char *dst = attn + es * r * nq;
    for (int64_t i = first; i < last; i++) STORE(dst, i, out[i], bf16);
    if (m->quantized) quantize_blocks(dst, bf16, r, nq, first / QK, last / QK, a);
}

static inline __attribute__((always_inline)) void forward(const fused_model_t *m, char *hidden, int64_t B,
                                                          const int64_t *positions, const int64_t *slots,
                                                          const int32_t *block_table, int64_t block_table_stride,
                                                          const int32_t *seq_lens, char *work, acts_t *a, int bf16) {
    const int64_t es = ESIZE(bf16), H = m->hidden_size, I = m->intermediate_size, head_dim = m->head_dim;
    const int64_t nq = m->num_heads * head_dim, nqkv = nq + 2 * m->num_kv_heads * head_dim;
    char *residual = work, *x = residual + es * B * H, *qkv = x + es * B * H, *attn = qkv + es * B * nqkv;
    char *gate_up = attn + es * B * nq, *act = gate_up + es * B * 2 * I;
    const int64_t attention_tasks = B * m->num_kv_heads, spans = (I / QK + ACT_SPAN - 1) / ACT_SPAN;
    const int isa = current_isa();
    const attend_fn attend_task = attend_heads_for(head_dim, bf16);
#pragma omp parallel
    for (int64_t l = 0; l < m->num_layers; l++) {
        const fused_layer_t *layer = m->layers + l;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < B; r++) {
            char *xr = x + es * r * H, *res = residual + es * r * H;
            if (l == 0) { /* the residual stream starts as the embeddings, normalised alone */
                memcpy(res, hidden + es * r * H, es * H);
                rms_norm_row(res, NULL, layer->input_norm, xr, H, m->eps, bf16);
            } else {
                rms_norm_row(xr, res, layer->input_norm, xr, H, m->eps, bf16);
            }
            if (m->quantized) quantize_blocks(xr, bf16, r, H, 0, H / QK, a);
        }
        team_linear(isa, layer->qkv, a, x, B, layer->qkv_bias, qkv, bf16);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < attention_tasks; task++) {
            attention_task(m, layer, qkv, attn, a, task / m->num_kv_heads, task % m->num_kv_heads, positions, slots,
                           block_table, block_table_stride, seq_lens, attend_task, bf16);
        }
        team_linear(isa, layer->o, a, attn, B, layer->o_bias, x, bf16);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < B; r++) {
            char *xr = x + es * r * H;
            rms_norm_row(xr, residual + es * r * H, layer->post_norm, xr, H, m->eps, bf16);
            if (m->quantized) quantize_blocks(xr, bf16, r, H, 0, H / QK, a);
        }
        team_linear(isa, layer->gate_up, a, x, B, layer->gate_up_bias, gate_up, bf16);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < B * spans; task++) {
            const int64_t r = task / spans, b0 = task % spans * ACT_SPAN;
            const int64_t b1 = b0 + ACT_SPAN < I / QK ? b0 + ACT_SPAN : I / QK;
            const char *gate = gate_up + es * (r * 2 * I + b0 * QK);
            silu_mul_span(gate, gate + es * I, act + es * (r * I + b0 * QK), (b1 - b0) * QK, bf16);
            if (m->quantized) quantize_blocks(act + es * r * I, bf16, r, I, b0, b1, a);
        }
        team_linear(isa, layer->down, a, act, B, layer->down_bias, x, bf16);
        if (l == m->num_layers - 1) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < B; r++)
                rms_norm_row(x + es * r * H, residual + es * r * H, m->final_norm, hidden + es * r * H, H, m->eps,
                             bf16);
        }
    }
}

/*
 * Runs the decoder layers over B decode tokens: `hidden` holds their embeddings on entry and the final hidden
 * states on return. Returns 0, or -1 (nothing written, not even the cache) when the shapes are outside what
 * the kernels hold, a position is outside the rotary table, or memory runs out.
 */
int fused_decode_forward(const fused_model_t *m, void *hidden, int64_t B, const int64_t *positions,
                         const int64_t *slots, const int32_t *block_table, int64_t block_table_stride,
                         const int32_t *seq_lens) {
    const int64_t H = m->hidden_size, I = m->intermediate_size, head_dim = m->head_dim;
    if (B <= 0 || m->num_layers <= 0 || !decode_shapes_ok(m->num_heads, m->num_kv_heads, head_dim, m->block_size) ||
        head_dim % QK || H % QK || I % QK)
        return -1;
    for (int64_t r = 0; r < B; r++)
        if (positions[r] < 0 || positions[r] >= m->max_positions) return -1;
    const int64_t nq = m->num_heads * head_dim, nqkv = nq + 2 * m->num_kv_heads * head_dim;
    const int64_t widest = H > I ? (H > nq ? H : nq) : (I > nq ? I : nq);
    char *work = malloc((size_t)(ESIZE(m->bf16) * B * (2 * H + nqkv + nq + 3 * I)));
    acts_t a = {0};
    void *acts = m->quantized ? acts_alloc(&a, B, widest) : NULL; /* dense weights read x as it is */
    if (work && (acts || !m->quantized)) {
        if (m->bf16)
            forward(m, hidden, B, positions, slots, block_table, block_table_stride, seq_lens, work, &a, 1);
        else
            forward(m, hidden, B, positions, slots, block_table, block_table_stride, seq_lens, work, &a, 0);
    }
    const int status = work && (acts || !m->quantized) ? 0 : -1;
    free(work);
    free(acts);
    return status;
}
