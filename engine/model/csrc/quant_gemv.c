/*
 * y = x W^T (+ bias) for a few rows of x and a weight W quantized in blocks of
 * 32 input features (GGUF Q4_1/Q4_0 as "q4", Q8_0 as "q8"), as llama.cpp does
 * its decode-time products (ggml-cpu/arch/x86/quants.c, ggml_vec_dot_q4_1_q8_1):
 * every 32-block of an x row is quantized to int8 with its own scale
 * (x ~ dx * xq, dx = max|x| / 127), so a block's dot product is an integer dot
 * product of bytes, scaled once per block:
 *
 *   q4:  y = sum_b  dw[b] dx[b] sum_i q[i] xq[i]  +  mw[b] dx[b] sum_i xq[i]     (q in 0..15)
 *   q8:  y = sum_b  dw[b] dx[b] sum_i q[i] xq[i]                                 (q in -128..127)
 *
 * Layout: the rows of W go in tiles of 16 (N padded with zero rows), as
 * llama.cpp's repacked "x8" formats interleave 8 rows (ggml-cpu/repack.cpp).
 * For tile t and block b, the weights form chunks of 64 bytes: 4 for q4, 8 for
 * q8; in chunk r, bytes 4 j .. 4 j + 3 are row 16 t + j's weights 4 r .. 4 r + 3
 * of the block (q4: chunk r < 4 holds weights 4 r + k in the low nibbles and
 * 16 + 4 r + k in the high ones; q8: bytes are q + 128). So 32-bit lane j of a
 * chunk is row j's, the 4 matching activation bytes are broadcast to all lanes,
 * and 8 vpdpbusd (u8 x s8 -> s32) leave the 16 rows' block dot products in the
 * 16 lanes of one accumulator: no horizontal sums, and any K works. vpdpbusd
 * wants unsigned weights, hence q8 stored as q + 128, whose excess 128 sum(xq)
 * starts the accumulator negated. AVX2 (no VNNI) splits a chunk into two
 * halves of 8 rows and uses vpmaddubsw (u8 x s8 -> s16 pairs, saturating): q4
 * products fit (2 * 15 * 127), so it sums 8 of them in int16; q8 uses
 * llama.cpp's sign trick (|q| x sign(xq, q)).
 *
 *   data    [N_pad / 16, K / 32, 4 or 8, 16, 4] bytes;  scales, mins (q4)  [N_pad / 16, K / 32, 16] float16
 *   x       [M, K] float32 or bfloat16;  y [M, N] in x's dtype (both contiguous)
 *
 * Up to 8 rows of x (a tile) share each unpacked block of weights; OpenMP
 * splits the row tiles. The instruction set is chosen at run time among those
 * the build has (1 scalar, 2 AVX2, 3 AVX-512 VNNI), so a build for an AVX2-only
 * CPU works; quant_set_isa forces one (tests).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define QK 32
#define ROWS 16 /* rows of W interleaved in a tile */
#define TILE 8  /* rows of x sharing one pass over a tile of W */

enum { KIND_Q4 = 0, KIND_Q8 = 1 };
enum { ISA_SCALAR = 1, ISA_AVX2 = 2, ISA_AVX512 = 3 };

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define HAVE_AVX512 1
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HAVE_AVX2 1
#endif

#define INLINE static inline __attribute__((always_inline))

static int forced_isa = 0;

static int best_isa(void) {
#ifdef HAVE_AVX512
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))
        return ISA_AVX512;
#endif
#ifdef HAVE_AVX2
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return ISA_AVX2;
#endif
    return ISA_SCALAR;
}

/* Use `isa` from now on (0: the best this CPU and build have). Returns the one in effect, -1 if unavailable. */
int quant_set_isa(int isa) {
    if (isa < 0 || isa > best_isa()) return -1;
    forced_isa = isa;
    return isa ? isa : best_isa();
}

static int current_isa(void) { return forced_isa ? forced_isa : best_isa(); }

INLINE float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) { /* subnormal: renormalize */
        exp = 113;
        while (!(man & 0x400)) man <<= 1, exp--;
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

INLINE float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Round to nearest even, as torch's float -> bfloat16 (NaN stays NaN). */
INLINE uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1)) >> 16);
}

/* x's M rows quantized per 32-block: q [M, K], d [M, nb] scales, s [M, nb] = d sum(q) (q4's min term: the
 * rounded x's sum, not the exact one, so the rounding errors meet the whole weight d q + m, centred near 0,
 * rather than d q alone: half the error on random data), c [M, nb] = -128 sum(q) (q8 stored unsigned). */
typedef struct {
    int8_t *q;
    float *d, *s;
    int32_t *c;
} acts_t;

/* Room for M rows of K quantized activations in `a`: returns the one buffer to free, or NULL. */
static void *acts_alloc(acts_t *a, int64_t M, int64_t K) {
    const int64_t nb = K / QK;
    void *buffer = malloc((size_t)(M * K + M * nb * 12));
    if (!buffer) return NULL;
    a->d = (float *)buffer;
    a->s = a->d + M * nb;
    a->c = (int32_t *)(a->s + M * nb);
    a->q = (int8_t *)(a->c + M * nb);
    return buffer;
}

/* Blocks [b0, b1) of x row m (x points at the row's first element) into a (row m of its [M, K] arrays). */
static void quantize_blocks(const void *x, int x_bf16, int64_t m, int64_t K, int64_t b0, int64_t b1, acts_t *a) {
    const int64_t nb = K / QK;
    for (int64_t b = b0; b < b1; b++) {
        float v[QK], amax = 0.0f;
        if (x_bf16) {
            for (int i = 0; i < QK; i++) v[i] = bf16_to_float(((const uint16_t *)x)[b * QK + i]);
        } else {
            memcpy(v, (const float *)x + b * QK, sizeof v);
        }
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(v[i]));
        const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        int8_t *q = a->q + m * K + b * QK;
        int32_t qsum = 0;
        for (int i = 0; i < QK; i++) {
            q[i] = (int8_t)nearbyintf(v[i] * id);
            qsum += q[i];
        }
        a->d[m * nb + b] = d;
        a->s[m * nb + b] = d * (float)qsum;
        a->c[m * nb + b] = -128 * qsum;
    }
}

static void quantize_acts(const void *x, int x_bf16, int64_t M, int64_t K, acts_t *a) {
    const int64_t row_bytes = K * (x_bf16 ? 2 : 4);
    for (int64_t m = 0; m < M; m++) quantize_blocks((const char *)x + m * row_bytes, x_bf16, m, K, 0, K / QK, a);
}

typedef struct {
    const uint8_t *data;
    const uint16_t *scales, *mins;
    int64_t K, nb, block_bytes; /* block_bytes: one tile's bytes per block, 256 (q4) or 512 (q8) */
} weight_t;

/* Tile t of W against x rows m0 .. m0 + mt: out[m][j] = row 16 t + j's dot product with x row m0 + m. */
INLINE void tile_scalar(int kind, const weight_t *w, int64_t t, const acts_t *a, int64_t m0, int mt,
                        float out[TILE][ROWS]) {
    for (int m = 0; m < mt; m++)
        for (int j = 0; j < ROWS; j++) out[m][j] = 0.0f;
    for (int64_t b = 0; b < w->nb; b++) {
        const uint8_t *p = w->data + (t * w->nb + b) * w->block_bytes;
        const uint16_t *dw = w->scales + (t * w->nb + b) * ROWS, *mw = w->mins + (t * w->nb + b) * ROWS;
        for (int j = 0; j < ROWS; j++) {
            int8_t wq[QK];
            for (int i = 0; i < QK; i++) {
                const int r = i / 4, k = i % 4;
                wq[i] = kind == KIND_Q4 ? (int8_t)((p[(r & 3) * 64 + 4 * j + k] >> (r < 4 ? 0 : 4)) & 15)
                                        : (int8_t)(p[r * 64 + 4 * j + k] - 128);
            }
            const float d = half_to_float(dw[j]), mn = kind == KIND_Q4 ? half_to_float(mw[j]) : 0.0f;
            for (int m = 0; m < mt; m++) {
                const int8_t *xq = a->q + (m0 + m) * w->K + b * QK;
                int32_t dot = 0;
                for (int i = 0; i < QK; i++) dot += wq[i] * xq[i];
                const int64_t blk = (m0 + m) * w->nb + b;
                out[m][j] += d * a->d[blk] * (float)dot + mn * a->s[blk];
            }
        }
    }
}

#ifdef HAVE_AVX2
INLINE __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

INLINE void tile_avx2(int kind, const weight_t *w, int64_t t, const acts_t *a, int64_t m0, int mt,
                      float out[TILE][ROWS]) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; h++) { /* rows 8 h .. 8 h + 7 of the tile */
        __m256 acc[TILE], acc_min[TILE];
        _Pragma("GCC unroll 8") for (int m = 0; m < TILE; m++) acc[m] = acc_min[m] = _mm256_setzero_ps();
        for (int64_t b = 0; b < w->nb; b++) {
            const uint8_t *p = w->data + (t * w->nb + b) * w->block_bytes + 32 * h;
            __m256i wa[8], ws[8]; /* q4: unsigned weights; q8: |q| and q */
            if (kind == KIND_Q4) {
                _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 64 * r));
                    wa[r] = _mm256_and_si256(v, low4);
                    wa[r + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                }
            } else {
                _Pragma("GCC unroll 8") for (int r = 0; r < 8; r++) {
                    ws[r] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(p + 64 * r)), flip);
                    wa[r] = _mm256_abs_epi8(ws[r]);
                }
            }
            const int64_t sb = (t * w->nb + b) * ROWS + 8 * h;
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w->scales + sb)));
            const __m256 mw =
                kind == KIND_Q4 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w->mins + sb))) : _mm256_setzero_ps();
            _Pragma("GCC unroll 8") for (int m = 0; m < mt; m++) {
                const int8_t *xq = a->q + (m0 + m) * w->K + b * QK;
                __m256i dot;
                if (kind == KIND_Q4) {
                    __m256i sum16 = _mm256_setzero_si256();
                    _Pragma("GCC unroll 8") for (int r = 0; r < 8; r++) sum16 =
                        _mm256_add_epi16(sum16, _mm256_maddubs_epi16(wa[r], bcast4(xq + 4 * r)));
                    dot = _mm256_madd_epi16(sum16, ones);
                } else {
                    dot = _mm256_setzero_si256();
                    _Pragma("GCC unroll 8") for (int r = 0; r < 8; r++) {
                        const __m256i x8 = _mm256_sign_epi8(bcast4(xq + 4 * r), ws[r]);
                        dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(wa[r], x8), ones));
                    }
                }
                const int64_t blk = (m0 + m) * w->nb + b;
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, _mm256_set1_ps(a->d[blk])), acc[m]);
                if (kind == KIND_Q4) acc_min[m] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a->s[blk]), acc_min[m]);
            }
        }
        _Pragma("GCC unroll 8") for (int m = 0; m < mt; m++)
            _mm256_storeu_ps(out[m] + 8 * h, _mm256_add_ps(acc[m], acc_min[m]));
    }
}
#endif

#ifdef HAVE_AVX512
INLINE __m512i bcast4_512(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

INLINE void tile_avx512(int kind, const weight_t *w, int64_t t, const acts_t *a, int64_t m0, int mt,
                        float out[TILE][ROWS]) {
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    /* Two float accumulators a row (the dot and the min terms): two short dependency chains, not one long. */
    __m512 acc[TILE], acc_min[TILE];
    _Pragma("GCC unroll 8") for (int m = 0; m < TILE; m++) acc[m] = acc_min[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < w->nb; b++) {
        const uint8_t *p = w->data + (t * w->nb + b) * w->block_bytes;
        __m512i wr[8];
        if (kind == KIND_Q4) {
            _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++) {
                const __m512i v = _mm512_loadu_si512(p + 64 * r);
                wr[r] = _mm512_and_si512(v, low4);
                wr[r + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            }
        } else {
            _Pragma("GCC unroll 8") for (int r = 0; r < 8; r++) wr[r] = _mm512_loadu_si512(p + 64 * r);
        }
        const int64_t sb = (t * w->nb + b) * ROWS;
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->scales + sb)));
        const __m512 mw = kind == KIND_Q4 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->mins + sb)))
                                          : _mm512_setzero_ps();
        _Pragma("GCC unroll 8") for (int m = 0; m < mt; m++) {
            const int8_t *xq = a->q + (m0 + m) * w->K + b * QK;
            const int64_t blk = (m0 + m) * w->nb + b;
            /* Two integer chains of 4 vpdpbusd, not one of 8. */
            __m512i dot0 = kind == KIND_Q8 ? _mm512_set1_epi32(a->c[blk]) : _mm512_setzero_si512();
            __m512i dot1 = _mm512_setzero_si512();
            _Pragma("GCC unroll 4") for (int r = 0; r < 8; r += 2) {
                dot0 = _mm512_dpbusd_epi32(dot0, wr[r], bcast4_512(xq + 4 * r));
                dot1 = _mm512_dpbusd_epi32(dot1, wr[r + 1], bcast4_512(xq + 4 * r + 4));
            }
            const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(a->d[blk]));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(dot0, dot1)), scale, acc[m]);
            if (kind == KIND_Q4) acc_min[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a->s[blk]), acc_min[m]);
        }
    }
    _Pragma("GCC unroll 8") for (int m = 0; m < mt; m++) _mm512_storeu_ps(out[m], _mm512_add_ps(acc[m], acc_min[m]));
}
#endif

/* The tile kernel for one (isa, kind, tile height): all literals at the call, so the tile stays in registers. */
INLINE void tile_dot(int isa, int kind, const weight_t *w, int64_t t, const acts_t *a, int64_t m0, int mt,
                     float out[TILE][ROWS]) {
    (void)isa;
#ifdef HAVE_AVX512
    if (isa == ISA_AVX512) return tile_avx512(kind, w, t, a, m0, mt, out);
#endif
#ifdef HAVE_AVX2
    if (isa == ISA_AVX2) return tile_avx2(kind, w, t, a, m0, mt, out);
#endif
    tile_scalar(kind, w, t, a, m0, mt, out);
}

/* The switch sits in gemm_tile, inlined into each OpenMP loop: a loop body is outlined before inlining, so
 * constants passed into it would not reach the tile kernels. The best instruction set the build has gets a copy per tile
 * height (TILE_CASES: the tile stays in registers); the others, kept for other CPUs and tests, one copy
 * for any height (TILE_ANY): 8 copies of each would triple the compile time (to 5 s). */
#define TILE_CASE(I_, K_, MT_) \
    case (I_) * 64 + (K_) * 16 + (MT_): tile_dot((I_), (K_), w, t, a, m0, (MT_), out); break;
#define TILE_CASES(I_, K_) \
    TILE_CASE(I_, K_, 1) TILE_CASE(I_, K_, 2) TILE_CASE(I_, K_, 3) TILE_CASE(I_, K_, 4) \
    TILE_CASE(I_, K_, 5) TILE_CASE(I_, K_, 6) TILE_CASE(I_, K_, 7) TILE_CASE(I_, K_, 8)
#define TILE_ANY(I_, K_) \
    case (I_) * 64 + (K_) * 16 + 1 ... (I_) * 64 + (K_) * 16 + TILE: tile_dot((I_), (K_), w, t, a, m0, mt, out); break;
#if defined(HAVE_AVX512)
#define SIMD_CASES TILE_CASES(ISA_AVX512, KIND_Q4) TILE_CASES(ISA_AVX512, KIND_Q8) \
    TILE_ANY(ISA_AVX2, KIND_Q4) TILE_ANY(ISA_AVX2, KIND_Q8)
#elif defined(HAVE_AVX2)
#define SIMD_CASES TILE_CASES(ISA_AVX2, KIND_Q4) TILE_CASES(ISA_AVX2, KIND_Q8)
#else
#define SIMD_CASES
#endif

/* Tile t (output features 16 t .. 16 t + 15) of y [M, N] = x W^T + bias, for every row of x. */
static inline __attribute__((always_inline)) void gemm_tile(int isa, int kind, const weight_t *w, const acts_t *a,
                                                            int64_t M, int64_t N, int64_t t, const void *bias,
                                                            int bias_bf16, void *y, int y_bf16) {
    const int64_t n0 = t * ROWS, rows = N - n0 < ROWS ? N - n0 : ROWS;
    float b[ROWS] = {0};
    for (int64_t j = 0; bias && j < rows; j++)
        b[j] = bias_bf16 ? bf16_to_float(((const uint16_t *)bias)[n0 + j]) : ((const float *)bias)[n0 + j];
    for (int64_t m0 = 0; m0 < M; m0 += TILE) {
        const int mt = M - m0 < TILE ? (int)(M - m0) : TILE;
        float out[TILE][ROWS];
        switch (isa * 64 + kind * 16 + mt) {
            SIMD_CASES
            TILE_ANY(ISA_SCALAR, KIND_Q4)
            TILE_ANY(ISA_SCALAR, KIND_Q8)
            default: __builtin_unreachable();
        }
        for (int m = 0; m < mt; m++) {
            if (y_bf16) {
                uint16_t *row = (uint16_t *)y + (m0 + m) * N + n0;
                for (int64_t j = 0; j < rows; j++) row[j] = float_to_bf16(out[m][j] + b[j]);
            } else {
                float *row = (float *)y + (m0 + m) * N + n0;
                for (int64_t j = 0; j < rows; j++) row[j] = out[m][j] + b[j];
            }
        }
    }
}

static void gemm_tiles(int isa, int kind, const weight_t *w, const acts_t *a, int64_t M, int64_t N, const void *bias,
                       int bias_bf16, void *y, int y_bf16) {
    const int64_t tiles = (N + ROWS - 1) / ROWS;
#pragma omp parallel for schedule(static) if (tiles > 1)
    for (int64_t t = 0; t < tiles; t++) gemm_tile(isa, kind, w, a, M, N, t, bias, bias_bf16, y, y_bf16);
}

/* A packed weight, as quant_kernels.QuantizedWeight holds it (the Python side builds one per weight, once). */
typedef struct {
    int64_t kind, out_features, in_features;
    const uint8_t *data;
    const uint16_t *scales, *mins; /* mins: q4 only */
} qweight_t;

/* The tiles view of a packed weight. */
static weight_t tiles_of(const qweight_t *w) {
    const weight_t tiles = {w->data, w->scales, w->mins, w->in_features, w->in_features / QK,
                            w->kind == KIND_Q4 ? 256 : 512};
    return tiles;
}

/* Bits of quant_linear's flags. */
enum { X_BF16 = 1, BIAS_BF16 = 2 };

/*
 * y [M, N] = x [M, K] W^T + bias (bias may be NULL), x and y contiguous, both float32 or both bfloat16
 * (flags & X_BF16); bias float32 or bfloat16 (flags & BIAS_BF16). Returns the instruction set used, or -1
 * on bad arguments.
 */
int quant_linear_bias(const qweight_t *w, const void *x, void *y, int64_t M, int64_t flags, const void *bias) {
    const int64_t K = w->in_features, N = w->out_features, kind = w->kind;
    if ((kind != KIND_Q4 && kind != KIND_Q8) || M < 0 || N < 0 || K <= 0 || K % QK) return -1;
    const int isa = current_isa();
    if (M == 0 || N == 0) return isa;
    acts_t a;
    void *buffer = acts_alloc(&a, M, K);
    if (!buffer) return -1;
    quantize_acts(x, flags & X_BF16, M, K, &a);
    const weight_t tiles = tiles_of(w);
    gemm_tiles(isa, (int)kind, &tiles, &a, M, N, bias, (flags & BIAS_BF16) != 0, y, (flags & X_BF16) != 0);
    free(buffer);
    return isa;
}

/* quant_linear_bias without a bias: one argument fewer, as each costs Python's ctypes about half a microsecond. */
int quant_linear(const qweight_t *w, const void *x, void *y, int64_t M, int64_t flags) {
    return quant_linear_bias(w, x, y, M, flags, NULL);
}

/* Row j of tile t, block b: its 32 weights in order (quantized values; q8 still + 128). */
INLINE void row_block_bytes(int kind, const uint8_t *p, int64_t j, uint8_t bytes[QK]) {
    if (kind == KIND_Q4) {
        uint8_t packed[QK / 2];
        for (int r = 0; r < 4; r++) memcpy(packed + 4 * r, p + 64 * r + 4 * j, 4);
        for (int i = 0; i < QK / 2; i++) bytes[i] = packed[i] & 15, bytes[i + QK / 2] = packed[i] >> 4;
    } else {
        for (int r = 0; r < 8; r++) memcpy(bytes + 4 * r, p + 64 * r + 4 * j, 4);
    }
}

#ifdef HAVE_AVX512
/* 16 floats to bfloat16, rounded to nearest even (values are finite here). */
INLINE void store_bf16x16(uint16_t *dst, __m512 v) {
#ifdef __AVX512BF16__
    _mm256_storeu_si256((__m256i *)dst, (__m256i)_mm512_cvtneps_pbh(v));
#else
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    _mm256_storeu_si256((__m256i *)dst, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
#endif
}

/* One row's block of 32 weights, dequantized into out[0 .. 32): dword loads put its bytes in order. */
INLINE void dequantize_block_avx512(int kind, const uint8_t *p, int64_t j, float d, float mn, void *out,
                                    int out_bf16) {
    const int32_t *c = (const int32_t *)(p + 4 * j); /* chunk r's dword for row j: c[16 r] */
    __m512 v[2];
    if (kind == KIND_Q4) {
        const __m128i packed = _mm_setr_epi32(c[0], c[16], c[32], c[48]);
        const __m128i low4 = _mm_set1_epi8(0x0f);
        v[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(packed, low4)));
        v[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(packed, 4), low4)));
    } else {
        const __m128i flip = _mm_set1_epi8((char)0x80);
        const __m128i lo = _mm_xor_si128(_mm_setr_epi32(c[0], c[16], c[32], c[48]), flip);
        const __m128i hi = _mm_xor_si128(_mm_setr_epi32(c[64], c[80], c[96], c[112]), flip);
        v[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo));
        v[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi));
    }
    for (int h = 0; h < 2; h++) {
        const __m512 w = _mm512_fmadd_ps(v[h], _mm512_set1_ps(d), _mm512_set1_ps(mn));
        if (out_bf16)
            store_bf16x16((uint16_t *)out + 16 * h, w);
        else
            _mm512_storeu_ps((float *)out + 16 * h, w);
    }
}
#endif

/*
 * out [R, K] = rows ids[0 .. R) of W [N, K] dequantized (ids NULL: rows 0 .. R). out_bf16: 1 bfloat16, 0 float32.
 * Returns 0, or -1 on bad arguments or an id outside [0, N).
 */
int quant_dequantize(int kind, const uint8_t *data, const uint16_t *scales, const uint16_t *mins, const int64_t *ids,
                     int64_t R, int64_t N, int64_t K, void *out, int out_bf16) {
    if ((kind != KIND_Q4 && kind != KIND_Q8) || R < 0 || K <= 0 || K % QK) return -1;
    for (int64_t i = 0; ids && i < R; i++)
        if (ids[i] < 0 || ids[i] >= N) return -1;
    const int64_t nb = K / QK, block_bytes = kind == KIND_Q4 ? 256 : 512;
    const int isa = current_isa();
#pragma omp parallel for schedule(static) if (R > 1)
    for (int64_t i = 0; i < R; i++) {
        const int64_t n = ids ? ids[i] : i, t = n / ROWS, j = n % ROWS;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *p = data + (t * nb + b) * block_bytes;
            const float d = half_to_float(scales[(t * nb + b) * ROWS + j]);
            const float mn = kind == KIND_Q4 ? half_to_float(mins[(t * nb + b) * ROWS + j]) : 0.0f;
            const int64_t at = i * K + b * QK;
            void *dst = out_bf16 ? (void *)((uint16_t *)out + at) : (void *)((float *)out + at);
#ifdef HAVE_AVX512
            if (isa == ISA_AVX512) {
                dequantize_block_avx512(kind, p, j, d, mn, dst, out_bf16);
                continue;
            }
#endif
            (void)isa;
            uint8_t bytes[QK];
            float v[QK];
            row_block_bytes(kind, p, j, bytes);
            for (int k = 0; k < QK; k++) v[k] = d * (float)(kind == KIND_Q4 ? bytes[k] : (int)bytes[k] - 128) + mn;
            if (out_bf16) {
                for (int k = 0; k < QK; k++) ((uint16_t *)dst)[k] = float_to_bf16(v[k]);
            } else {
                memcpy(dst, v, sizeof v);
            }
        }
    }
    return 0;
}
