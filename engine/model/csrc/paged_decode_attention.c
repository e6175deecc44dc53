/*
 * Paged attention for one-token (decode) queries on the CPU, with the KV cache
 * in fp32 or bf16. Queries, outputs and all arithmetic are fp32.
 *
 * Each request is one task (or, when there are fewer requests than threads,
 * each of its kv heads is): per kv head, its query heads (the GQA group)
 * stream once over the request's KV blocks, read in place through the block
 * table, with the online softmax of FlashAttention (Dao et al. 2022,
 * arXiv:2205.14135) so scores never leave a block-sized buffer. Compared with
 * gathering the blocks into a contiguous copy and calling SDPA, every cached
 * byte is read once instead of read, written and read again. Decode attention
 * is bound by the bytes of KV it reads and by the latency of reading them:
 * a bf16 cache (half the bytes) is widened to fp32 in registers rather than
 * kept in fp32, and since blocks lie at random places, every row read also
 * prefetches the same row of the request's next block (measured on the
 * 2-core test machine, 64 requests of 80-320 tokens: 1.38 -> 1.00 ms per layer).
 *
 * Layouts (contiguous but where a stride is given):
 *   query        [num_reqs, num_heads, head_dim] fp32
 *   new_keys/new_values  [num_reqs, num_kv_heads, head_dim] in the cache's dtype, rows new_*_stride
 *                elements apart: written at slots [num_reqs] int64 before attending; NULL: none
 *   key/value    [num_blocks, block_size, num_kv_heads, head_dim] fp32 or bf16
 *   block_table  [num_reqs, block_table_stride] int32
 *   seq_lens     [num_reqs] int32 (the request's keys, this token's included, >= 1)
 *   window       sliding-window attention: each query sees its request's last `window` keys; 0: all of them
 *   out          [num_reqs, num_heads, head_dim] fp32
 * Both entry points return 0, or -1 when the shapes exceed the fixed buffers (and
 * then have written nothing).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK_SIZE 128
#define MAX_HEADS 128
#define MAX_QUERY 8192 /* num_heads * head_dim */

/* A row of head_dim values, readable as fp32 after being written as raw bits. */
typedef union {
    float f32[MAX_HEAD_DIM];
    uint32_t bits[MAX_HEAD_DIM];
} row_t;

/* Widen n cache values starting at element `offset` into row->f32; bf16 is the upper half of an fp32. */
static inline __attribute__((always_inline)) void widen(row_t *row, const void *cache, int64_t offset, int64_t n,
                                                        int bf16) {
    if (bf16) {
        const uint16_t *src = (const uint16_t *)cache + offset;
#pragma omp simd
        for (int64_t d = 0; d < n; d++) row->bits[d] = (uint32_t)src[d] << 16;
    } else {
        const float *src = (const float *)cache + offset;
#pragma omp simd
        for (int64_t d = 0; d < n; d++) row->f32[d] = src[d];
    }
}

/* Ask for the cache lines of n values starting at element `offset`. */
static inline __attribute__((always_inline)) void prefetch_row(const void *cache, int64_t offset, int64_t n,
                                                              int bf16) {
    const int64_t size = bf16 ? 2 : 4;
    const char *start = (const char *)cache + offset * size;
    for (int64_t byte = 0; byte < n * size; byte += 64) __builtin_prefetch(start + byte);
}

/* Whether the fixed buffers below hold these shapes. */
static int decode_shapes_ok(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size) {
    const int64_t group = num_kv_heads > 0 ? num_heads / num_kv_heads : 0;
    return group >= 1 && group <= MAX_GROUP && head_dim <= MAX_HEAD_DIM && block_size <= MAX_BLOCK_SIZE &&
           num_heads <= MAX_HEADS && num_heads * head_dim <= MAX_QUERY && group * num_kv_heads == num_heads;
}

/*
 * One task: a request's query heads of kv heads [h_begin, h_end) over its cached keys and values: the last
 * `window` of its seq_len ones (0: all), the keys a sliding-window layer sees (Beltagy et al. 2020,
 * arXiv:2004.05150; Mistral 7B's, Jiang et al. 2023, arXiv:2310.06825).
 * query and out: the request's [num_heads, head_dim] fp32 rows (only the task's heads are read and written);
 * blocks: its block table row. `bf16` and usually `head_dim` are compile-time constants at each call.
 */
static inline __attribute__((always_inline)) void attend_heads(const float *query, const void *key_cache,
                                                               const void *value_cache, const int32_t *blocks,
                                                               int64_t seq_len, int64_t window, float *out,
                                                               int64_t num_heads, int64_t num_kv_heads,
                                                               int64_t head_dim, int64_t block_size, float scale,
                                                               int64_t h_begin, int64_t h_end, int bf16) {
    const int64_t group = num_heads / num_kv_heads, token_stride = num_kv_heads * head_dim;
    /* Query heads [first, last) of the task, then per query head: the scaled query, the output
       accumulator and the online-softmax state (indexed by query head over the whole request). */
    const int64_t first = h_begin * group, last = h_end * group;
    float q[MAX_QUERY], acc[MAX_QUERY], running_max[MAX_HEADS], denom[MAX_HEADS];
    float scores[MAX_GROUP][MAX_BLOCK_SIZE];
    float block_max[MAX_GROUP];
    row_t row;
    for (int64_t i = first * head_dim; i < last * head_dim; i++) q[i] = query[i] * scale;
    memset(acc + first * head_dim, 0, sizeof(float) * (last - first) * head_dim);
    for (int64_t i = first; i < last; i++) {
        running_max[i] = -1e30f; /* not -INFINITY: -ffast-math assumes finite values */
        denom[i] = 0.0f;
    }
    /* The first key seen, and the first block holding it; t0 of that block's rows come before it. */
    const int64_t first_key = window > 0 && seq_len > window ? seq_len - window : 0;
    for (int64_t start = first_key / block_size * block_size; start < seq_len; start += block_size) {
        const int64_t n = seq_len - start < block_size ? seq_len - start : block_size;
        const int64_t t0 = first_key > start ? first_key - start : 0;
        const int64_t block = blocks[start / block_size];
        /* The next block is elsewhere in memory, where no hardware prefetcher looks: each row read
           below asks for the same row of the next block, a block's work ahead of its use. */
        const int64_t next_block = start + block_size < seq_len ? blocks[start / block_size + 1] : -1;
        /* The task's kv heads of the block in turn: all of them are one contiguous run of memory. */
        for (int64_t h = h_begin; h < h_end; h++) {
            const int64_t base = block * block_size * token_stride + h * head_dim;
            const int64_t next_base = next_block * block_size * token_stride + h * head_dim;
            float *qh = q + h * group * head_dim, *acch = acc + h * group * head_dim;
            float *maxh = running_max + h * group, *denomh = denom + h * group;
            for (int64_t g = 0; g < group; g++) block_max[g] = maxh[g];
            /* Each key row is widened once and serves every query head of the group. */
            for (int64_t t = t0; t < n; t++) {
                if (next_block >= 0) prefetch_row(key_cache, next_base + t * token_stride, head_dim, bf16);
                widen(&row, key_cache, base + t * token_stride, head_dim, bf16);
                for (int64_t g = 0; g < group; g++) {
                    const float *qg = qh + g * head_dim;
                    float s = 0.0f;
#pragma omp simd reduction(+ : s)
                    for (int64_t d = 0; d < head_dim; d++) s += qg[d] * row.f32[d];
                    scores[g][t] = s;
                    block_max[g] = s > block_max[g] ? s : block_max[g];
                }
            }
            for (int64_t g = 0; g < group; g++) {
                const float correction = expf(maxh[g] - block_max[g]);
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int64_t t = t0; t < n; t++) {
                    scores[g][t] = expf(scores[g][t] - block_max[g]);
                    sum += scores[g][t];
                }
                denomh[g] = denomh[g] * correction + sum;
                maxh[g] = block_max[g];
                float *accg = acch + g * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) accg[d] *= correction;
            }
            for (int64_t t = t0; t < n; t++) {
                if (next_block >= 0) prefetch_row(value_cache, next_base + t * token_stride, head_dim, bf16);
                widen(&row, value_cache, base + t * token_stride, head_dim, bf16);
                for (int64_t g = 0; g < group; g++) {
                    const float p = scores[g][t];
                    float *accg = acch + g * head_dim;
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++) accg[d] += p * row.f32[d];
                }
            }
        }
    }
    for (int64_t i = first; i < last; i++) {
        const float inv = 1.0f / denom[i];
        for (int64_t d = 0; d < head_dim; d++) out[i * head_dim + d] = acc[i * head_dim + d] * inv;
    }
}

/* One task's attention, compiled once per (head_dim, dtype) and never inlined: a head_dim known at compile
 * time lets the compiler unroll the per-row loops into whole vectors, and the fused decode (fused_decode.c)
 * calls the very same code, so that both paths agree bit for bit. */
typedef void (*attend_fn)(const float *query, const void *key_cache, const void *value_cache, const int32_t *blocks,
                          int64_t seq_len, int64_t window, float *out, int64_t num_heads, int64_t num_kv_heads,
                          int64_t head_dim, int64_t block_size, float scale, int64_t h_begin, int64_t h_end);
#define ATTEND_HEADS(NAME, HEAD_DIM, BF16)                                                                        \
    __attribute__((noinline)) static void NAME(const float *query, const void *key_cache, const void *value_cache, \
                                               const int32_t *blocks, int64_t seq_len, int64_t window,            \
                                               float *out, int64_t num_heads, int64_t num_kv_heads,               \
                                               int64_t head_dim, int64_t block_size, float scale,                 \
                                               int64_t h_begin, int64_t h_end) {                                  \
        (void)head_dim;                                                                                           \
        attend_heads(query, key_cache, value_cache, blocks, seq_len, window, out, num_heads, num_kv_heads,        \
                     HEAD_DIM, block_size, scale, h_begin, h_end, BF16);                                          \
    }
ATTEND_HEADS(attend_heads_64_f32, 64, 0)
ATTEND_HEADS(attend_heads_128_f32, 128, 0)
ATTEND_HEADS(attend_heads_any_f32, head_dim, 0)
ATTEND_HEADS(attend_heads_64_bf16, 64, 1)
ATTEND_HEADS(attend_heads_128_bf16, 128, 1)
ATTEND_HEADS(attend_heads_any_bf16, head_dim, 1)

static attend_fn attend_heads_for(int64_t head_dim, int bf16) {
    switch (head_dim) {
    case 64: return bf16 ? attend_heads_64_bf16 : attend_heads_64_f32;
    case 128: return bf16 ? attend_heads_128_bf16 : attend_heads_128_f32;
    default: return bf16 ? attend_heads_any_bf16 : attend_heads_any_f32;
    }
}

static int attend(const float *query, const void *new_keys, const void *new_values, int64_t new_keys_stride,
                  int64_t new_values_stride, const int64_t *slots, void *key_cache, void *value_cache,
                  const int32_t *block_table, int64_t block_table_stride, const int32_t *seq_lens, float *out,
                  int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                  float scale, int64_t window, int bf16) {
    if (!decode_shapes_ok(num_heads, num_kv_heads, head_dim, block_size)) return -1;
    const attend_fn task_fn = attend_heads_for(head_dim, bf16);
    const int64_t token_stride = num_kv_heads * head_dim;
    /* A task reading whole blocks (all kv heads) reads contiguous memory; with fewer requests than
       threads, splitting each request by kv head keeps every thread busy instead. (Splitting further,
       over runs of blocks as Flash-Decoding does, measured no faster on the 2-core test machine, one
       request of 300 or 2,000 tokens and 3 kv heads: one thread alone nearly fills the memory bandwidth.) */
    const int64_t kv_heads_per_task = num_reqs >= omp_get_max_threads() ? num_kv_heads : 1;
    const int64_t tasks_per_req = num_kv_heads / kv_heads_per_task;
    /* The step's own keys and values into their slots first (a few hundred bytes per request: no
       threads), which spares the caller two indexed copies per layer. */
    if (new_keys != NULL) {
        const int64_t size = bf16 ? 2 : 4, row_bytes = token_stride * size;
        for (int64_t r = 0; r < num_reqs; r++) {
            memcpy((char *)key_cache + slots[r] * row_bytes, (const char *)new_keys + r * new_keys_stride * size,
                   row_bytes);
            memcpy((char *)value_cache + slots[r] * row_bytes,
                   (const char *)new_values + r * new_values_stride * size, row_bytes);
        }
    }

#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_reqs * tasks_per_req; task++) {
        const int64_t r = task / tasks_per_req;
        const int64_t h_begin = task % tasks_per_req * kv_heads_per_task;
        task_fn(query + r * num_heads * head_dim, key_cache, value_cache, block_table + r * block_table_stride,
                seq_lens[r], window, out + r * num_heads * head_dim, num_heads, num_kv_heads, head_dim, block_size, scale,
                h_begin, h_begin + kv_heads_per_task);
    }
    return 0;
}

int paged_decode_attention_f32(const float *query, const float *new_keys, const float *new_values,
                               int64_t new_keys_stride, int64_t new_values_stride, const int64_t *slots,
                               float *key_cache, float *value_cache, const int32_t *block_table,
                               int64_t block_table_stride, const int32_t *seq_lens, float *out, int64_t num_reqs,
                               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                               float scale, int64_t window) {
    return attend(query, new_keys, new_values, new_keys_stride, new_values_stride, slots, key_cache, value_cache,
                  block_table, block_table_stride, seq_lens, out, num_reqs, num_heads, num_kv_heads, head_dim,
                  block_size, scale, window, 0);
}

int paged_decode_attention_bf16(const float *query, const uint16_t *new_keys, const uint16_t *new_values,
                                int64_t new_keys_stride, int64_t new_values_stride, const int64_t *slots,
                                uint16_t *key_cache, uint16_t *value_cache, const int32_t *block_table,
                                int64_t block_table_stride, const int32_t *seq_lens, float *out, int64_t num_reqs,
                                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                float scale, int64_t window) {
    return attend(query, new_keys, new_values, new_keys_stride, new_values_stride, slots, key_cache, value_cache,
                  block_table, block_table_stride, seq_lens, out, num_reqs, num_heads, num_kv_heads, head_dim,
                  block_size, scale, window, 1);
}
