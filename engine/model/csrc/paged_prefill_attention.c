/*
 * Causal paged attention for prefill chunks on the CPU, with the KV cache in
 * fp32 or bf16, read in place through the block table.
 *
 * FlashAttention-2 (Dao 2023, arXiv:2307.08691) on a CPU: each task takes one
 * chunk, one kv head and a tile of the chunk's query tokens together with all
 * the query heads sharing that kv head (GQA: each key and value is loaded once
 * for the whole group), and streams over the request's keys tile by tile,
 * keeping a running max and sum per query row (the online softmax of Milakov &
 * Gimelshein 2018, arXiv:1805.02867), so the scores never leave a tile-sized
 * buffer and no gathered copy of the context is made. Causality: query i of a
 * chunk of n tokens after `context` cached ones sits at position context + i
 * and sees keys 0..context + i; a query tile stops at its last row's position,
 * and only the tiles crossing the diagonal are masked. A sliding window of W
 * keys (Beltagy et al. 2020, arXiv:2004.05150) hides keys before
 * context + i - W + 1 as well: a tile starts at its first row's first key, and
 * the tiles crossing that edge are masked too. Tasks run longest first
 * (the last query tiles see the most keys) over OpenMP threads.
 *
 * Two inner loops. The portable one (GCC vector extensions: 16 floats with
 * AVX-512, 8 with AVX2) puts the query rows of a tile (token-major: row =
 * token * group + head in group) in the lanes of the vectors: the queries are
 * packed once, transposed ([head_dim][rows]); each key and value tile is copied
 * (bf16: widened, a bf16 value being the upper half of an fp32) into a
 * contiguous buffer, prefetching the next tile's rows, since blocks lie at
 * random places; each of its elements is broadcast against vectors of rows, and
 * the softmax runs down the columns of the score tile, whole vectors of rows at
 * a time. On a 2-core Sapphire Rapids VM it reaches about 100 GFLOP per
 * CPU-second in fp32 and bf16 (oneDNN's fp32 GEMM: 113). The bf16 one runs the
 * two matrix products on AMX tiles (see below), about 250.
 *
 * Layouts (contiguous unless said; query, caches and out all fp32 or all bf16):
 *   query        [num_tokens, num_heads, head_dim], token stride query_stride (a view of the QKV output)
 *   key/value    [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_table  [num_chunks, block_table_stride] int32
 *   row_starts   [num_chunks] int32, the chunk's first row in query and out, ascending
 *   query_lens   [num_chunks] int32, its tokens (>= 1)
 *   seq_lens     [num_chunks] int32, context + query_len (the keys its last token sees)
 *   out          [num_tokens, num_heads, head_dim]; rows outside the chunks are zeros
 *   window       each query sees the last `window` keys up to its own position; 0: all of them
 * Both entry points return 0, or -1 when the shapes exceed the fixed limits
 * (head_dim a multiple of 8 up to 256, at most MAX_ROWS query heads per kv head).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define VEC 16          /* floats per vector */
#define KEYS_PER_STEP 8 /* scores: 2 row vectors x 8 keys = 16 accumulators of 32 registers */
#define DIMS_PER_STEP 8 /* values: 2 row vectors x 8 channels */
#else
#define VEC 8
#define KEYS_PER_STEP 4 /* 16 registers: 8 accumulators */
#define DIMS_PER_STEP 4
#endif
#define ROW_STEP (2 * VEC) /* rows per register block */
/* Query rows (tokens x group) per task: each task reads its keys and values once, so more rows read
   fewer bytes per multiply-add (fp32, measured on a loaded machine: about 80 -> 105 GFLOP per CPU-second
   from 96 to 192 rows; 384 no better). */
#define ROWS_TARGET 192
#define MAX_ROWS (ROWS_TARGET + 32)
#define MAX_HEAD_DIM 256
#define KEY_TILE 64 /* keys per tile (32 and 128 measured no better) */

typedef float vf __attribute__((vector_size(VEC * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(VEC * sizeof(int32_t))));

static inline vf vload(const float *p) { return *(const vf *)p; }
static inline void vstore(float *p, vf v) { *(vf *)p = v; }
static inline vf vselect(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }
static inline vf vmax(vf a, vf b) { return vselect(a > b, a, b); }

/* exp(x) for x <= 0 (the only arguments an online softmax makes), 0 below -87: Cephes' expf
   polynomial after reducing x = n ln2 + r, |r| <= ln2 / 2; relative error about 2e-7. */
static inline vf vexp(vf x) {
    const vi live = x > -87.0f;
    x = vselect(live, x, (vf){} - 87.0f);
    const vi n = __builtin_convertvector(x * 1.44269504f - 0.5f, vi); /* round to nearest: x <= 0 */
    const vf nf = __builtin_convertvector(n, vf);
    const vf r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    vf p = (vf){} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return (vf)((vi)(p * (vf)((n + 127) << 23)) & live);
}

/* scores[i][r] = sum_d qt[d][r] * keys[i][d] for keys i < num_keys (a multiple of KEYS_PER_STEP: scores
   past the tile's keys are left unread) and rows r < rows (a multiple of ROW_STEP). */
static inline __attribute__((always_inline)) void tile_scores(float *scores, const float *qt, const float *keys,
                                                              int64_t num_keys, int64_t rows, int64_t head_dim) {
    for (int64_t r = 0; r < rows; r += ROW_STEP)
        for (int64_t i = 0; i < num_keys; i += KEYS_PER_STEP) {
            vf acc[KEYS_PER_STEP][2] = {};
            for (int64_t d = 0; d < head_dim; d++) {
                const vf q0 = vload(qt + d * rows + r), q1 = vload(qt + d * rows + r + VEC);
                for (int k = 0; k < KEYS_PER_STEP; k++) {
                    const float key = keys[(i + k) * head_dim + d];
                    acc[k][0] += q0 * key;
                    acc[k][1] += q1 * key;
                }
            }
            for (int k = 0; k < KEYS_PER_STEP; k++) {
                vstore(scores + (i + k) * rows + r, acc[k][0]);
                vstore(scores + (i + k) * rows + r + VEC, acc[k][1]);
            }
        }
}

/* acc_t[d][r] = acc_t[d][r] * alpha[r] + sum_i probs[i][r] * values[i][d]. */
static inline __attribute__((always_inline)) void tile_values(float *acc_t, const float *alpha, const float *probs,
                                                              const float *values, int64_t num_keys, int64_t rows,
                                                              int64_t head_dim) {
    for (int64_t r = 0; r < rows; r += ROW_STEP) {
        const vf a0 = vload(alpha + r), a1 = vload(alpha + r + VEC);
        for (int64_t d0 = 0; d0 < head_dim; d0 += DIMS_PER_STEP) {
            vf acc[DIMS_PER_STEP][2];
            for (int k = 0; k < DIMS_PER_STEP; k++) {
                acc[k][0] = vload(acc_t + (d0 + k) * rows + r) * a0;
                acc[k][1] = vload(acc_t + (d0 + k) * rows + r + VEC) * a1;
            }
            for (int64_t i = 0; i < num_keys; i++) {
                const vf p0 = vload(probs + i * rows + r), p1 = vload(probs + i * rows + r + VEC);
                const float *v = values + i * head_dim + d0;
                for (int k = 0; k < DIMS_PER_STEP; k++) {
                    acc[k][0] += p0 * v[k];
                    acc[k][1] += p1 * v[k];
                }
            }
            for (int k = 0; k < DIMS_PER_STEP; k++) {
                vstore(acc_t + (d0 + k) * rows + r, acc[k][0]);
                vstore(acc_t + (d0 + k) * rows + r + VEC, acc[k][1]);
            }
        }
    }
}

/* Per-thread buffers, 64-byte aligned. */
typedef struct {
    float *qt;        /* [head_dim][rows] the tile's scaled queries, transposed */
    float *acc_t;     /* [head_dim][rows] unnormalised outputs, transposed */
    float *scores;    /* [KEY_TILE][rows] scores, then probabilities */
    float *widened;   /* [2][KEY_TILE][head_dim] a key and a value tile as fp32 (AMX: packed bf16 pairs) */
    float *row_max;   /* [rows] */
    float *row_sum;   /* [rows] */
    float *alpha;     /* [rows] rescaling of the accumulators by the new max */
    int32_t *pos;     /* [rows] each row's position (the last key it sees) */
} buffers_t;

/* This thread's buffers, allocated on its first call and kept: a fresh half-megabyte allocation per call
   would come from mmap, and each of its pages would fault again on every layer. 0 when out of memory. */
static int thread_buffers(buffers_t *b) {
    static _Thread_local char *memory = NULL;
    if (memory == NULL) {
        const size_t floats = MAX_ROWS * (2 * MAX_HEAD_DIM + KEY_TILE + 4) + 2 * KEY_TILE * MAX_HEAD_DIM;
        memory = aligned_alloc(64, sizeof(float) * floats);
        if (memory == NULL) return 0;
    }
    b->qt = (float *)memory;
    b->acc_t = b->qt + MAX_ROWS * MAX_HEAD_DIM;
    b->scores = b->acc_t + MAX_ROWS * MAX_HEAD_DIM;
    b->row_max = b->scores + MAX_ROWS * KEY_TILE;
    b->row_sum = b->row_max + MAX_ROWS;
    b->alpha = b->row_sum + MAX_ROWS;
    b->pos = (int32_t *)(b->alpha + MAX_ROWS);
    b->widened = (float *)(b->pos + MAX_ROWS);
    return 1;
}

/* A masked score: below a row's starting max (-1e30), so that a row whose first tile hides all its keys
   (a sliding window's edge) takes exp(MASKED - max) = 0 for them rather than exp(0) = 1. */
#define MASKED (-2e30f)

/* Online softmax over one tile of scores: update each row's max and sum, turn scores into
   probabilities in place, and leave in alpha how much the accumulators shrink. Masks keys past
   a row's position, and those `window` or more before it (window > 0), when `masked`. */
static inline void tile_softmax(buffers_t *b, int64_t key_start, int64_t num_keys, int64_t rows, int masked,
                                int64_t window) {
    for (int64_t r = 0; r < rows; r += VEC) {
        if (masked) {
            const vi pos = *(const vi *)(b->pos + r);
            const vi first = window > 0 ? pos - (int32_t)(window - 1) : (vi){};
            for (int64_t i = 0; i < num_keys; i++) {
                const vi key = (vi){} + (int32_t)(key_start + i);
                const vi visible = (key <= pos) & (key >= first);
                vstore(b->scores + i * rows + r, vselect(visible, vload(b->scores + i * rows + r),
                                                         (vf){} + MASKED));
            }
        }
        const vf old_max = vload(b->row_max + r);
        vf new_max = old_max;
        for (int64_t i = 0; i < num_keys; i++) new_max = vmax(new_max, vload(b->scores + i * rows + r));
        vf sum = (vf){};
        for (int64_t i = 0; i < num_keys; i++) {
            const vf p = vexp(vload(b->scores + i * rows + r) - new_max);
            vstore(b->scores + i * rows + r, p);
            sum += p;
        }
        const vf alpha = vexp(old_max - new_max);
        vstore(b->alpha + r, alpha);
        vstore(b->row_sum + r, vload(b->row_sum + r) * alpha + sum);
        vstore(b->row_max + r, new_max);
    }
}

/* Widen n bf16 values (the upper halves of fp32s) to fp32. */
static inline void widen(float *dst, const uint16_t *src, int64_t n) {
    uint32_t *bits = (uint32_t *)dst;
#pragma omp simd
    for (int64_t d = 0; d < n; d++) bits[d] = (uint32_t)src[d] << 16;
}

/* Ask for the cache lines of n values starting at element `offset`. */
static inline void prefetch_row(const void *cache, int64_t offset, int64_t n, int bf16) {
    const int64_t size = bf16 ? 2 : 4;
    const char *start = (const char *)cache + offset * size;
    for (int64_t byte = 0; byte < n * size; byte += 64) __builtin_prefetch(start + byte);
}

/* fp32 -> bf16, rounding to nearest even (inputs are finite). */
static inline uint16_t to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof(bits));
    return (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

/* Element i of an fp32 or bf16 array, as fp32. */
static inline float load_float(const void *array, int64_t i, int bf16) {
    if (!bf16) return ((const float *)array)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)array)[i] << 16;
    float x;
    memcpy(&x, &bits, sizeof(x));
    return x;
}

/* What every task of one call shares. */
typedef struct {
    const void *query;
    int64_t query_stride;
    const void *key_cache, *value_cache;
    const int32_t *block_table;
    int64_t block_table_stride;
    void *out;
    int64_t num_heads, num_kv_heads, group, block_size;
    float scale;
    int64_t window; /* sliding-window attention over this many keys; 0: causal over all */
    int amx;        /* the tasks run on AMX tiles, which each thread configures first */
} problem_t;

/* The first key any row of query tokens [t0, t1) after `context` sees, and whether a tile of keys from
   key_start to key_end (inclusive) hides some key from some row: it crosses the diagonal (past the first
   row's position) or the window's edge (before the last row's first key). */
static inline int64_t first_key(const problem_t *p, int64_t context, int64_t t0) {
    return p->window > 0 && context + t0 - p->window + 1 > 0 ? context + t0 - p->window + 1 : 0;
}
static inline int tile_masked(const problem_t *p, int64_t key_start, int64_t key_end, int64_t context, int64_t t0,
                              int64_t t1) {
    return key_end > context + t0 || (p->window > 0 && key_start < context + t1 - p->window);
}

/* One task: query tokens [t0, t1) of a chunk, kv head h, every query head of its group. `head_dim` and
   `bf16` are compile-time constants in each specialisation below. */
static inline __attribute__((always_inline)) void attend_tile(buffers_t *b, const problem_t *p,
                                                              const int32_t *blocks, int64_t row_start,
                                                              int64_t context, int64_t t0, int64_t t1, int64_t h,
                                                              int64_t head_dim, int bf16) {
    const int64_t group = p->group, num_heads = p->num_heads, block_size = p->block_size;
    const int64_t used = (t1 - t0) * group;
    const int64_t rows = (used + ROW_STEP - 1) / ROW_STEP * ROW_STEP;
    const int64_t token_stride = p->num_kv_heads * head_dim;
    /* Pack the queries transposed and scaled; padding rows are zero and see every key. */
    for (int64_t r = 0; r < rows; r++) {
        const int64_t t = r < used ? r / group : t1 - t0 - 1;
        b->pos[r] = (int32_t)(context + t0 + t);
        b->row_max[r] = -1e30f; /* not -INFINITY: -ffast-math assumes finite values */
        b->row_sum[r] = 0.0f;
    }
    for (int64_t r = 0; r < used; r++) {
        const int64_t q = (row_start + t0 + r / group) * p->query_stride + (h * group + r % group) * head_dim;
        for (int64_t d = 0; d < head_dim; d++) b->qt[d * rows + r] = load_float(p->query, q + d, bf16) * p->scale;
    }
    for (int64_t d = 0; d < head_dim; d++) {
        memset(b->qt + d * rows + used, 0, sizeof(float) * (rows - used));
        memset(b->acc_t + d * rows, 0, sizeof(float) * rows);
    }
    const int64_t num_keys = context + t1; /* the last row sees keys up to context + t1 - 1 */
    float *keys = b->widened, *values = b->widened + KEY_TILE * head_dim;
    for (int64_t key_start = first_key(p, context, t0); key_start < num_keys; key_start += KEY_TILE) {
        const int64_t n = num_keys - key_start < KEY_TILE ? num_keys - key_start : KEY_TILE;
        for (int64_t i = 0; i < n; i++) {
            const int64_t key = key_start + i;
            const int64_t offset = (blocks[key / block_size] * block_size + key % block_size) * token_stride +
                                   h * head_dim;
            float *k = keys + i * head_dim, *v = values + i * head_dim;
            if (bf16) {
                widen(k, (const uint16_t *)p->key_cache + offset, head_dim);
                widen(v, (const uint16_t *)p->value_cache + offset, head_dim);
            } else {
                memcpy(k, (const float *)p->key_cache + offset, sizeof(float) * head_dim);
                memcpy(v, (const float *)p->value_cache + offset, sizeof(float) * head_dim);
            }
            /* The next tile's row, a tile's work ahead of its use: blocks lie at random places, where
               no hardware prefetcher looks. */
            const int64_t next = key + KEY_TILE;
            if (next < num_keys) {
                const int64_t next_offset =
                    (blocks[next / block_size] * block_size + next % block_size) * token_stride + h * head_dim;
                prefetch_row(p->key_cache, next_offset, head_dim, bf16);
                prefetch_row(p->value_cache, next_offset, head_dim, bf16);
            }
        }
        const int64_t padded = (n + KEYS_PER_STEP - 1) / KEYS_PER_STEP * KEYS_PER_STEP;
        tile_scores(b->scores, b->qt, keys, padded, rows, head_dim);
        tile_softmax(b, key_start, n, rows, tile_masked(p, key_start, key_start + n - 1, context, t0, t1),
                     p->window);
        tile_values(b->acc_t, b->alpha, b->scores, values, n, rows, head_dim);
    }
    for (int64_t r = 0; r < used; r++) {
        const int64_t o = ((row_start + t0 + r / group) * num_heads + h * group + r % group) * head_dim;
        const float inv = 1.0f / b->row_sum[r];
        for (int64_t d = 0; d < head_dim; d++) {
            const float x = b->acc_t[d * rows + r] * inv;
            if (bf16)
                ((uint16_t *)p->out)[o + d] = to_bf16(x);
            else
                ((float *)p->out)[o + d] = x;
        }
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/*
 * The bf16 path on AMX (Intel's tile matrix unit, Sapphire Rapids and later): one TDPBF16PS multiplies
 * a 16x32 bf16 tile by a 32x16 one into 16x16 fp32, 16 times the multiply-adds of an AVX-512 FMA. The
 * matrix products cost little next to the softmax, so the rows leave the vector lanes: a task's queries
 * are bf16 rows [rows][head_dim], scores and outputs fp32 rows, and each key tile is repacked once into
 * the pair-interleaved layout the B operand wants (keys transposed: [head_dim / 2][KEY_TILE] pairs of
 * channels; values: [KEY_TILE / 2][head_dim] pairs of keys). Probabilities go to the value product in
 * bf16, as in FlashAttention's bf16 kernels; running max, sum and output stay fp32.
 */
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define HAVE_AMX 1
_Static_assert(KEY_TILE == 64, "the AMX path's four score tiles cover 64 keys");
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Whether this process may use the tile registers: Linux hands their state out only on request. */
static int amx_permitted(void) {
    static int permitted = -1;
    if (permitted < 0) permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return permitted;
}

/* All eight tiles as 16 rows of 64 bytes (palette 1): tmm0-3 accumulate, tmm4 holds A, tmm5-6 B. */
static void configure_tiles(void) {
    struct __attribute__((packed)) {
        uint8_t palette_id, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } config = {.palette_id = 1};
    for (int t = 0; t < 8; t++) {
        config.colsb[t] = 64;
        config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
}

/* 2^x for x <= 0, 0 below -126: a degree-5 Taylor polynomial of 2^f on f in [-1/2, 1/2] (relative error
   below 3e-6), scaled by 2^n. */
static inline __m512 exp2_amx(__m512 x) {
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_GT_OQ);
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.3333558e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(live, p, n);
}

/* Online softmax of 16 rows of KEY_TILE scores (fp32 rows of `scores`), masked past each row's
   position (and `window` or more before it) when `masked`; probabilities out as bf16 rows of `probs`, each row's rescale in alpha.
   Returns whether the max of any of the 16 rows moved: only then do the outputs, which AMX reads and
   writes, need rescaling by vector code (AMX loads of memory that vector code just wrote stall; after
   the first few tiles a row's max seldom moves: 250 against 183 GFLOP per CPU-second when rescaling
   every tile, on 2048 queries after 5952 tokens of context). */
static inline int softmax_amx(buffers_t *b, const float *scores, uint16_t *probs, int64_t row0,
                              int64_t key_start, int masked, int64_t window, float log2e_scale) {
    int moved = 0;
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int64_t i = 0; i < 16; i++) {
        const int64_t r = row0 + i;
        __m512 s[KEY_TILE / 16];
        for (int k = 0; k < KEY_TILE / 16; k++) {
            s[k] = _mm512_load_ps(scores + i * KEY_TILE + k * 16);
            if (masked) {
                const __m512i key = _mm512_add_epi32(lanes, _mm512_set1_epi32((int32_t)(key_start + k * 16)));
                __mmask16 visible = _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(b->pos[r]));
                if (window > 0)
                    visible &= _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32(b->pos[r] - (int32_t)(window - 1)));
                s[k] = _mm512_mask_mov_ps(_mm512_set1_ps(MASKED), visible, s[k]);
            }
        }
        __m512 top = s[0];
        for (int k = 1; k < KEY_TILE / 16; k++) top = _mm512_max_ps(top, s[k]);
        const float old_max = b->row_max[r];
        const float tile_max = _mm512_reduce_max_ps(top);
        const float new_max = tile_max > old_max ? tile_max : old_max;
        const __m512 offset = _mm512_set1_ps(-new_max * log2e_scale), factor = _mm512_set1_ps(log2e_scale);
        __m512 sum = _mm512_setzero_ps();
        for (int k = 0; k < KEY_TILE / 16; k += 2) {
            const __m512 p0 = exp2_amx(_mm512_fmadd_ps(s[k], factor, offset));
            const __m512 p1 = exp2_amx(_mm512_fmadd_ps(s[k + 1], factor, offset));
            sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
            _mm512_store_si512(probs + i * KEY_TILE + k * 16, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
        }
        const float alpha = new_max == old_max ? 1.0f : exp2f((old_max - new_max) * log2e_scale);
        moved |= new_max != old_max;
        b->alpha[r] = alpha;
        b->row_sum[r] = b->row_sum[r] * alpha + _mm512_reduce_add_ps(sum);
        b->row_max[r] = new_max;
    }
    return moved;
}

/* Tiles 0-3, a 16 x 64 fp32 block, += a . b over `depth` (a multiple of 32): `a` is 16 rows of bf16,
   `a_stride` elements apart; `b` is bf16 pairs packed as 32-bit words (AMX's VNNI layout), depth / 2
   rows of `b_stride` words. Tiles 4-6 are scratch. */
static inline __attribute__((always_inline)) void amx_accumulate_16x64(const uint16_t *a, int64_t a_stride,
                                                                       const uint32_t *b, int64_t b_stride,
                                                                       int64_t depth) {
    for (int64_t k0 = 0; k0 < depth; k0 += 32) {
        const uint32_t *bt = b + k0 / 2 * b_stride;
        _tile_loadd(4, a + k0, a_stride * 2);
        _tile_loadd(5, bt, b_stride * 4);
        _tile_loadd(6, bt + 16, b_stride * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(5, bt + 32, b_stride * 4);
        _tile_loadd(6, bt + 48, b_stride * 4);
        _tile_dpbf16ps(2, 4, 5);
        _tile_dpbf16ps(3, 4, 6);
    }
}

/* Tiles 0-3 from a 16 x 64 fp32 block whose rows are `stride` floats apart. */
static inline __attribute__((always_inline)) void amx_load_16x64(const float *c, int64_t stride) {
    _tile_loadd(0, c, stride * 4);
    _tile_loadd(1, c + 16, stride * 4);
    _tile_loadd(2, c + 32, stride * 4);
    _tile_loadd(3, c + 48, stride * 4);
}

/* Tiles 0-3 out to a 16 x 64 fp32 block whose rows are `stride` floats apart. */
static inline __attribute__((always_inline)) void amx_store_16x64(float *c, int64_t stride) {
    _tile_stored(0, c, stride * 4);
    _tile_stored(1, c + 16, stride * 4);
    _tile_stored(2, c + 32, stride * 4);
    _tile_stored(3, c + 48, stride * 4);
}

/* One task on AMX (see attend_tile; bf16 caches, head_dim a multiple of 64). */
static inline __attribute__((always_inline)) void attend_tile_amx(buffers_t *b, const problem_t *p,
                                                                  const int32_t *blocks, int64_t row_start,
                                                                  int64_t context, int64_t t0, int64_t t1,
                                                                  int64_t h, int64_t head_dim) {
    const int64_t group = p->group, num_heads = p->num_heads, block_size = p->block_size;
    const int64_t used = (t1 - t0) * group;
    const int64_t rows = (used + 15) / 16 * 16;
    const int64_t token_stride = p->num_kv_heads * head_dim;
    const int64_t pairs = head_dim / 2;
    /* Buffers: queries [rows][head_dim] bf16 in qt, outputs [rows][head_dim] fp32 in acc_t, one row
       block's scores [16][KEY_TILE] fp32 and probabilities [16][KEY_TILE] bf16 in scores, the packed key
       and value tiles (32-bit pairs) in widened. */
    uint16_t *queries = (uint16_t *)b->qt, *probs = (uint16_t *)(b->scores + 16 * KEY_TILE);
    float *outputs = b->acc_t, *scores = b->scores;
    uint32_t *keys = (uint32_t *)b->widened, *values = keys + KEY_TILE * MAX_HEAD_DIM / 2;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t t = r < used ? r / group : t1 - t0 - 1;
        b->pos[r] = (int32_t)(context + t0 + t);
        b->row_max[r] = -1e30f;
        b->row_sum[r] = 0.0f;
        const uint16_t *q =
            (const uint16_t *)p->query + (row_start + t0 + t) * p->query_stride + (h * group + r % group) * head_dim;
        for (int64_t d = 0; d < head_dim; d++) queries[r * head_dim + d] = r < used ? q[d] : 0;
    }
    memset(outputs, 0, sizeof(float) * rows * head_dim);
    const float log2e_scale = p->scale * 1.44269504f;
    const int64_t num_keys = context + t1;
    for (int64_t key_start = first_key(p, context, t0); key_start < num_keys; key_start += KEY_TILE) {
        const int64_t n = num_keys - key_start < KEY_TILE ? num_keys - key_start : KEY_TILE;
        for (int64_t i = 0; i < KEY_TILE; i += 2) {
            const uint16_t *k[2], *v[2];
            for (int64_t j = 0; j < 2; j++) {
                const int64_t key = key_start + i + j;
                /* Keys past the sequence have no block (the table row may end there): no offset for them. */
                const int64_t offset = i + j < n ? (blocks[key / block_size] * block_size + key % block_size) *
                                                           token_stride + h * head_dim
                                                 : 0;
                k[j] = i + j < n ? (const uint16_t *)p->key_cache + offset : NULL;
                v[j] = i + j < n ? (const uint16_t *)p->value_cache + offset : NULL;
                const int64_t next = key + KEY_TILE;
                if (i + j < n && next < num_keys) {
                    const int64_t next_offset =
                        (blocks[next / block_size] * block_size + next % block_size) * token_stride + h * head_dim;
                    prefetch_row(p->key_cache, next_offset, head_dim, 1);
                    prefetch_row(p->value_cache, next_offset, head_dim, 1);
                }
            }
            /* Keys past the sequence are zeros: masked scores, and 0 x 0 adds nothing to the outputs. */
            for (int64_t j = 0; j < 2; j++)
                for (int64_t d = 0; d < pairs; d++) {
                    uint32_t pair = 0;
                    if (k[j] != NULL) memcpy(&pair, k[j] + 2 * d, sizeof(pair));
                    keys[d * KEY_TILE + i + j] = pair;
                }
            uint32_t *row = values + i / 2 * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++)
                row[d] = (v[0] != NULL ? v[0][d] : 0u) | (uint32_t)(v[1] != NULL ? v[1][d] : 0u) << 16;
        }
        const int masked = tile_masked(p, key_start, key_start + KEY_TILE - 1, context, t0, t1);
        for (int64_t row0 = 0; row0 < rows; row0 += 16) {
            /* Scores of 16 rows x 64 keys: four accumulator tiles, head_dim / 32 steps. */
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            amx_accumulate_16x64(queries + row0 * head_dim, head_dim, keys, KEY_TILE, head_dim);
            amx_store_16x64(scores, KEY_TILE);
            /* Outputs of the 16 rows: rescaled when a max moved, then plus probabilities x values,
               64 channels (four accumulator tiles) at a time. */
            if (softmax_amx(b, scores, probs, row0, key_start, masked, p->window, log2e_scale))
                for (int64_t i = 0; i < 16; i++) {
                    const __m512 alpha = _mm512_set1_ps(b->alpha[row0 + i]);
                    float *o = outputs + (row0 + i) * head_dim;
                    for (int64_t d = 0; d < head_dim; d += 16)
                        _mm512_store_ps(o + d, _mm512_mul_ps(_mm512_load_ps(o + d), alpha));
                }
            for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
                float *o = outputs + row0 * head_dim + d0;
                amx_load_16x64(o, head_dim);
                amx_accumulate_16x64(probs, KEY_TILE, values + d0, head_dim, KEY_TILE);
                amx_store_16x64(o, head_dim);
            }
        }
    }
    for (int64_t r = 0; r < used; r++) {
        uint16_t *o = (uint16_t *)p->out + ((row_start + t0 + r / group) * num_heads + h * group + r % group) * head_dim;
        const float inv = 1.0f / b->row_sum[r];
        for (int64_t d = 0; d < head_dim; d++) o[d] = to_bf16(outputs[r * head_dim + d] * inv);
    }
}
#endif

typedef void (*tile_fn)(buffers_t *, const problem_t *, const int32_t *, int64_t, int64_t, int64_t, int64_t,
                        int64_t, int64_t);

/* The specialisations: a head_dim known at compile time lets the compiler unroll the per-channel loops.
   (Called through a pointer from the parallel loop: OpenMP outlines the loop's body into a function of
   its own, where constants of the caller would be variables again.) */
#define TILE_FN(NAME, HEAD_DIM, BF16)                                                                           \
    static void NAME(buffers_t *b, const problem_t *p, const int32_t *blocks, int64_t row_start,               \
                     int64_t context, int64_t t0, int64_t t1, int64_t h, int64_t head_dim) {                    \
        (void)head_dim; /* a constant instead, except in the _any versions */                                   \
        attend_tile(b, p, blocks, row_start, context, t0, t1, h, HEAD_DIM, BF16);                                \
    }
TILE_FN(tile_f32_64, 64, 0)
TILE_FN(tile_f32_128, 128, 0)
TILE_FN(tile_f32_any, head_dim, 0)
TILE_FN(tile_bf16_64, 64, 1)
TILE_FN(tile_bf16_128, 128, 1)
TILE_FN(tile_bf16_any, head_dim, 1)
#ifdef HAVE_AMX
static void tile_amx_64(buffers_t *b, const problem_t *p, const int32_t *blocks, int64_t row_start, int64_t context,
                        int64_t t0, int64_t t1, int64_t h, int64_t head_dim) {
    (void)head_dim;
    attend_tile_amx(b, p, blocks, row_start, context, t0, t1, h, 64);
}
static void tile_amx_any(buffers_t *b, const problem_t *p, const int32_t *blocks, int64_t row_start,
                         int64_t context, int64_t t0, int64_t t1, int64_t h, int64_t head_dim) {
    attend_tile_amx(b, p, blocks, row_start, context, t0, t1, h, head_dim);
}
#endif

static int attend(const problem_t *p, tile_fn tile_fn, const int32_t *row_starts, const int32_t *query_lens,
                  const int32_t *seq_lens, int64_t num_tokens, int64_t num_chunks, int64_t head_dim, int bf16) {
    const int64_t group = p->group, num_kv_heads = p->num_kv_heads;
    if (group * num_kv_heads != p->num_heads || group > MAX_ROWS || head_dim > MAX_HEAD_DIM || head_dim % 8 != 0)
        return -1;
    /* Zeros in the rows between and after the chunks (decodes, padding). */
    const int64_t row_bytes = p->num_heads * head_dim * (bf16 ? 2 : 4);
    for (int64_t c = 0, row = 0; c <= num_chunks; c++) {
        const int64_t end = c < num_chunks ? row_starts[c] : num_tokens;
        if (end > row) memset((char *)p->out + row * row_bytes, 0, (end - row) * row_bytes);
        if (c < num_chunks) row = row_starts[c] + query_lens[c];
    }
    const int64_t tile_tokens = ROWS_TARGET / group > 0 ? ROWS_TARGET / group : 1;
    /* Tasks: (chunk, query tile, kv head), the tiles of each chunk last first: later tiles see more
       keys, and starting the longest tasks first evens out the threads' loads at the end. */
    int64_t num_tasks = 0;
    for (int64_t c = 0; c < num_chunks; c++) num_tasks += (query_lens[c] + tile_tokens - 1) / tile_tokens;
    num_tasks *= num_kv_heads;
    int status = 0;
#pragma omp parallel
    {
        buffers_t b;
        const int ready = thread_buffers(&b);
        if (!ready) {
#pragma omp atomic write
            status = -1;
        }
#ifdef HAVE_AMX
        if (p->amx) configure_tiles();
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_tasks; task++) {
            if (!ready) continue;
            int64_t index = task / num_kv_heads, c = 0;
            const int64_t h = task % num_kv_heads;
            int64_t tiles = (query_lens[0] + tile_tokens - 1) / tile_tokens;
            while (index >= tiles) {
                index -= tiles;
                c++;
                tiles = (query_lens[c] + tile_tokens - 1) / tile_tokens;
            }
            const int64_t t0 = (tiles - 1 - index) * tile_tokens;
            const int64_t t1 = t0 + tile_tokens < query_lens[c] ? t0 + tile_tokens : query_lens[c];
            tile_fn(&b, p, p->block_table + c * p->block_table_stride, row_starts[c], seq_lens[c] - query_lens[c],
                    t0, t1, h, head_dim);
        }
#ifdef HAVE_AMX
        /* Hand the tiles back: torch's oneDNN kernels configure their own. */
        if (p->amx) _tile_release();
#endif
    }
    return status;
}

/* Whether bf16 caches run on AMX: compiled in (an AMX machine), allowed by the kernel (Linux), and not
   switched off. `enable` 0 or 1 switches it (for tests and benchmarks), -1 only asks. */
int paged_prefill_attention_amx(int enable) {
#ifdef HAVE_AMX
    static int enabled = 1;
    if (enable >= 0) enabled = enable;
    return enabled && amx_permitted();
#else
    (void)enable;
    return 0;
#endif
}

int paged_prefill_attention_f32(const float *query, int64_t query_stride, const float *key_cache,
                                const float *value_cache, const int32_t *block_table, int64_t block_table_stride,
                                const int32_t *row_starts, const int32_t *query_lens, const int32_t *seq_lens,
                                float *out, int64_t num_tokens, int64_t num_chunks, int64_t num_heads,
                                int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                                int64_t window) {
    const problem_t p = {.query = query, .query_stride = query_stride, .key_cache = key_cache,
                         .value_cache = value_cache, .block_table = block_table,
                         .block_table_stride = block_table_stride, .out = out, .num_heads = num_heads,
                         .num_kv_heads = num_kv_heads, .group = num_heads / num_kv_heads,
                         .block_size = block_size, .scale = scale, .window = window, .amx = 0};
    const tile_fn fn = head_dim == 64 ? tile_f32_64 : head_dim == 128 ? tile_f32_128 : tile_f32_any;
    return attend(&p, fn, row_starts, query_lens, seq_lens, num_tokens, num_chunks, head_dim, 0);
}

int paged_prefill_attention_bf16(const uint16_t *query, int64_t query_stride, const uint16_t *key_cache,
                                 const uint16_t *value_cache, const int32_t *block_table, int64_t block_table_stride,
                                 const int32_t *row_starts, const int32_t *query_lens, const int32_t *seq_lens,
                                 uint16_t *out, int64_t num_tokens, int64_t num_chunks, int64_t num_heads,
                                 int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                                 int64_t window) {
    const int amx = paged_prefill_attention_amx(-1) && head_dim % 64 == 0;
    const problem_t p = {.query = query, .query_stride = query_stride, .key_cache = key_cache,
                         .value_cache = value_cache, .block_table = block_table,
                         .block_table_stride = block_table_stride, .out = out, .num_heads = num_heads,
                         .num_kv_heads = num_kv_heads, .group = num_heads / num_kv_heads,
                         .block_size = block_size, .scale = scale, .window = window, .amx = amx};
    tile_fn fn = head_dim == 64 ? tile_bf16_64 : head_dim == 128 ? tile_bf16_128 : tile_bf16_any;
#ifdef HAVE_AMX
    if (amx) fn = head_dim == 64 ? tile_amx_64 : tile_amx_any;
#endif
    return attend(&p, fn, row_starts, query_lens, seq_lens, num_tokens, num_chunks, head_dim, 1);
}
