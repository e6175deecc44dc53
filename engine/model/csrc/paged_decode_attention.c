/*
 * Paged attention for one-token (decode) queries on the CPU, fp32.
 *
 * Each (request, kv head) pair is one task: its query heads (the GQA group)
 * stream once over the request's KV blocks, read in place through the block
 * table, with the online softmax of FlashAttention (Dao et al. 2022,
 * arXiv:2205.14135) so scores never leave a block-sized buffer. Compared with
 * gathering the blocks into a contiguous copy and calling SDPA, every cached
 * byte is read once instead of read, written and read again.
 *
 * Layouts (contiguous, fp32 unless noted):
 *   query        [num_reqs, num_heads, head_dim]
 *   key/value    [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_table  [num_reqs, block_table_stride] int32
 *   seq_lens     [num_reqs] int32 (keys to attend, >= 1)
 *   out          [num_reqs, num_heads, head_dim]
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK_SIZE 128

int paged_decode_attention(const float *query, const float *key_cache, const float *value_cache,
                           const int32_t *block_table, int64_t block_table_stride, const int32_t *seq_lens,
                           float *out, int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size, float scale) {
    const int64_t group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK_SIZE ||
        group * num_kv_heads != num_heads)
        return -1;
    const int64_t token_stride = num_kv_heads * head_dim;

#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t r = 0; r < num_reqs; r++) {
        for (int64_t h = 0; h < num_kv_heads; h++) {
            float q[MAX_GROUP][MAX_HEAD_DIM];
            float acc[MAX_GROUP][MAX_HEAD_DIM];
            float scores[MAX_GROUP][MAX_BLOCK_SIZE];
            float running_max[MAX_GROUP], denom[MAX_GROUP];
            for (int64_t g = 0; g < group; g++) {
                const float *src = query + (r * num_heads + h * group + g) * head_dim;
                for (int64_t d = 0; d < head_dim; d++) q[g][d] = src[d] * scale;
                memset(acc[g], 0, sizeof(float) * head_dim);
                running_max[g] = -1e30f; /* not -INFINITY: -ffast-math assumes finite values */
                denom[g] = 0.0f;
            }
            const int64_t seq_len = seq_lens[r];
            const int32_t *blocks = block_table + r * block_table_stride;
            for (int64_t start = 0; start < seq_len; start += block_size) {
                const int64_t n = seq_len - start < block_size ? seq_len - start : block_size;
                const int64_t base = ((int64_t)blocks[start / block_size] * block_size) * token_stride + h * head_dim;
                const float *k = key_cache + base;
                const float *v = value_cache + base;
                for (int64_t g = 0; g < group; g++) {
                    float block_max = running_max[g];
                    for (int64_t t = 0; t < n; t++) {
                        const float *kt = k + t * token_stride;
                        float s = 0.0f;
#pragma omp simd reduction(+ : s)
                        for (int64_t d = 0; d < head_dim; d++) s += q[g][d] * kt[d];
                        scores[g][t] = s;
                        block_max = s > block_max ? s : block_max;
                    }
                    const float correction = expf(running_max[g] - block_max);
                    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                    for (int64_t t = 0; t < n; t++) {
                        scores[g][t] = expf(scores[g][t] - block_max);
                        sum += scores[g][t];
                    }
                    denom[g] = denom[g] * correction + sum;
                    running_max[g] = block_max;
                    for (int64_t d = 0; d < head_dim; d++) acc[g][d] *= correction;
                    for (int64_t t = 0; t < n; t++) {
                        const float p = scores[g][t];
                        const float *vt = v + t * token_stride;
#pragma omp simd
                        for (int64_t d = 0; d < head_dim; d++) acc[g][d] += p * vt[d];
                    }
                }
            }
            for (int64_t g = 0; g < group; g++) {
                float *dst = out + (r * num_heads + h * group + g) * head_dim;
                const float inv = 1.0f / denom[g];
                for (int64_t d = 0; d < head_dim; d++) dst[d] = acc[g][d] * inv;
            }
        }
    }
    return 0;
}
