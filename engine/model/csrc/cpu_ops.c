/*
 * Fused elementwise ops of a decoder layer on the CPU: residual add + RMSNorm,
 * rotary embedding in place, and SiLU-and-multiply, for fp32 and bf16 tensors.
 *
 * In torch each of these is a chain of 3-8 ops (RMSNorm: add, pow, mean, add,
 * rsqrt, mul, mul). With one token per step every op costs its dispatch (2-3 us
 * each, about 23 us for a 576-wide RMSNorm on the 2-core test machine) rather
 * than its arithmetic, so one call here replaces each chain. The arithmetic is
 * fp32, with each result rounded once to the tensor's dtype (torch rounds bf16
 * after every op of the chain, so bf16 results may differ from it by an ulp;
 * fp32 results differ only in summation order).
 *
 * Rows are tokens and may be strided (a view into a fused projection's output);
 * elements within a row are contiguous. Rows are split over OpenMP threads only
 * when there are many (a prefill chunk): for a few rows the barrier costs more
 * than the work.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#define PARALLEL_ROWS 64

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)h << 16};
    return v.f;
}

/* Round to nearest even, as torch does; NaN stays NaN. */
static inline uint16_t f32_to_bf16(float f) {
    union { float f; uint32_t u; } v = {.f = f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);
    v.u += 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)(v.u >> 16);
}

#define LOAD(p, i, bf16) ((bf16) ? bf16_to_f32(((const uint16_t *)(p))[i]) : ((const float *)(p))[i])
#define STORE(p, i, x, bf16)                                        \
    do {                                                            \
        if (bf16) ((uint16_t *)(p))[i] = f32_to_bf16(x);           \
        else ((float *)(p))[i] = (x);                               \
    } while (0)

/* The one-row functions (rms_norm_row, rotary_row, silu_mul_span) are not inlined into their callers: the
 * fused decode (fused_decode.c) includes this file and calls them inside its own parallel region (not the
 * entry points, whose pragmas would open a nested region per call), and with the same compiled code in both
 * places (no caller-specific vectorisation of their sums and expf) the fused and unfused paths agree bit for
 * bit. */
#define NOINLINE __attribute__((noinline))

/* A row's element type size in bytes. */
#define ESIZE(bf16) ((bf16) ? 2 : 4)

/*
 * out = weight * rms_norm(x); or, with a residual, in place: residual += x, then x = weight * rms_norm(residual)
 * (vLLM's fused_add_rms_norm), so that neither result needs a new tensor.
 * x, out, residual: [rows, width] with the given row strides (elements); weight: [width]; residual may be NULL.
 * As transformers' LlamaRMSNorm: the sum is rounded to the dtype, the statistics are fp32, the normalised
 * value is rounded to the dtype before the weight multiplies it.
 */
NOINLINE static void rms_norm_row(void *x, void *residual, const void *weight, void *out, int64_t width, float eps,
                                  int bf16) {
    const char *src = (const char *)x;
    double sum_sq = 0.0;
    if (residual) {
        char *res = (char *)residual;
        for (int64_t i = 0; i < width; i++) {
            STORE(res, i, LOAD(src, i, bf16) + LOAD(res, i, bf16), bf16);
            const float v = LOAD(res, i, bf16); /* the rounded sum, as torch normalises it */
            sum_sq += (double)v * v;
        }
        src = res;
    } else {
#pragma omp simd reduction(+ : sum_sq)
        for (int64_t i = 0; i < width; i++) {
            const float v = LOAD(src, i, bf16);
            sum_sq += (double)v * v;
        }
    }
    const float inv_rms = 1.0f / sqrtf((float)(sum_sq / (double)width) + eps);
    for (int64_t i = 0; i < width; i++) {
        float normed = LOAD(src, i, bf16) * inv_rms;
        if (bf16) normed = bf16_to_f32(f32_to_bf16(normed));
        STORE(out, i, LOAD(weight, i, bf16) * normed, bf16);
    }
}

static void rms_norm(void *x, int64_t x_stride, void *residual, int64_t residual_stride, const void *weight,
                     void *out, int64_t out_stride, int64_t rows, int64_t width, float eps, int bf16) {
#pragma omp parallel for if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++)
        rms_norm_row((char *)x + r * x_stride * ESIZE(bf16),
                     residual ? (char *)residual + r * residual_stride * ESIZE(bf16) : NULL, weight,
                     (char *)out + r * out_stride * ESIZE(bf16), width, eps, bf16);
}

void rms_norm_f32(void *x, int64_t xs, void *res, int64_t rs, const void *w, void *out, int64_t os, int64_t rows,
                  int64_t width, float eps) {
    rms_norm(x, xs, res, rs, w, out, os, rows, width, eps, 0);
}

void rms_norm_bf16(void *x, int64_t xs, void *res, int64_t rs, const void *w, void *out, int64_t os, int64_t rows,
                   int64_t width, float eps) {
    rms_norm(x, xs, res, rs, w, out, os, rows, width, eps, 1);
}

/*
 * Rotary embedding, "rotate half" layout, in place: for each head, with h = head_dim / 2,
 * x[i] <- x[i] cos[i] - x[i+h] sin[i] and x[i+h] <- x[i+h] cos[i] + x[i] sin[i].
 * x: [rows, heads, head_dim], heads contiguous within a row, rows x_stride elements apart.
 * cos, sin: [rows, head_dim / 2], rows cs_stride elements apart.
 */
NOINLINE static void rotary_row(void *x, const void *cos, const void *sin, int64_t heads, int64_t head_dim,
                                int bf16) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        char *head = (char *)x + h * head_dim * ESIZE(bf16);
        for (int64_t i = 0; i < half; i++) {
            const float x1 = LOAD(head, i, bf16), x2 = LOAD(head, i + half, bf16);
            const float c = LOAD(cos, i, bf16), s = LOAD(sin, i, bf16);
            STORE(head, i, x1 * c - x2 * s, bf16);
            STORE(head, i + half, x2 * c + x1 * s, bf16);
        }
    }
}

static void rotary(void *x, int64_t x_stride, const void *cos, const void *sin, int64_t cs_stride, int64_t rows,
                   int64_t heads, int64_t head_dim, int bf16) {
#pragma omp parallel for if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++)
        rotary_row((char *)x + r * x_stride * ESIZE(bf16), (const char *)cos + r * cs_stride * ESIZE(bf16),
                   (const char *)sin + r * cs_stride * ESIZE(bf16), heads, head_dim, bf16);
}

void rotary_f32(void *x, int64_t xs, const void *cos, const void *sin, int64_t cs, int64_t rows, int64_t heads,
                int64_t head_dim) {
    rotary(x, xs, cos, sin, cs, rows, heads, head_dim, 0);
}

void rotary_bf16(void *x, int64_t xs, const void *cos, const void *sin, int64_t cs, int64_t rows, int64_t heads,
                 int64_t head_dim) {
    rotary(x, xs, cos, sin, cs, rows, heads, head_dim, 1);
}

/* out[i] = silu(gate[i]) * up[i] for i < n: the activation of a SwiGLU MLP. */
NOINLINE static void silu_mul_span(const void *gate, const void *up, void *out, int64_t n, int bf16) {
    for (int64_t i = 0; i < n; i++) {
        const float g = LOAD(gate, i, bf16);
        STORE(out, i, g / (1.0f + expf(-g)) * LOAD(up, i, bf16), bf16);
    }
}

/*
 * out = silu(gate) * up, where each row of gate_up is [gate (width) | up (width)].
 * gate_up: [rows, 2 * width] contiguous; out: [rows, width] contiguous.
 */
static void silu_and_mul(const void *gate_up, void *out, int64_t rows, int64_t width, int bf16) {
#pragma omp parallel for if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        const char *gr = (const char *)gate_up + r * 2 * width * ESIZE(bf16);
        silu_mul_span(gr, gr + width * ESIZE(bf16), (char *)out + r * width * ESIZE(bf16), width, bf16);
    }
}

void silu_and_mul_f32(const void *gate_up, void *out, int64_t rows, int64_t width) {
    silu_and_mul(gate_up, out, rows, width, 0);
}

void silu_and_mul_bf16(const void *gate_up, void *out, int64_t rows, int64_t width) {
    silu_and_mul(gate_up, out, rows, width, 1);
}
