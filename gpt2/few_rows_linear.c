/* y = x W^T + b for a few rows of x (1 to ~16), the products of a decode step
 * (1 row) and of a verification pass (gamma + 1 rows), on x86-64 with AVX2+FMA.
 *
 * Legend: N = rows of x, IN = in features, OUT = out features.
 *
 * Why it exists (measurements in gpt2/linear.py): with a few rows, a linear
 * layer should cost what reading W from memory costs, whatever N is, because
 * every weight read is reused N times from registers. BLAS kernels are tuned
 * for large N and pay 2-3x at N = 5; this loop streams W once for all N rows.
 *
 * Layout of W ("pair-packed", made in gpt2/linear.py `pack_pairs`): output
 * features are taken in pairs (o, o + 1), and for each pair the two rows are
 * interleaved in blocks of 8 floats (one AVX register):
 *
 *     packed[p][k] = W[2p][8k : 8k + 8], W[2p + 1][8k : 8k + 8]   (16 floats)
 *
 * so each thread reads one sequential stream of memory. OUT is padded to an
 * even number with a zero row; IN must be a multiple of 8.
 *
 * W may also come as int8 in the same layout, with one float scale per output
 * row (weight-only quantisation, gpt2/quantize.py): W[o][i] = scale[o] q[o][i].
 * Each block of 8 is widened to float32 in registers and the row's sum is
 * multiplied by scale[o] at the end, so the product is the float32 one up to
 * rounding, from a quarter of the bytes.
 *
 * One tile: a pair of output features times up to MAX_TILE_ROWS = 7 rows of
 * x: 14 accumulators + 2 registers of W fill AVX2's 16 registers (x is read
 * straight from L1/L2 by the multiply-add). Per 16 weights read: 2 loads of
 * W, up to 7 loads of x, up to 14 fused multiply-adds. (Tiles of 5 and 6
 * rows measured the same at N <= 5 and slower at N = 6, 7.) Each thread takes
 * one contiguous range of output pairs (OpenMP: the runtime PyTorch already
 * loaded).
 *
 * Optionally, the work around the product is done in the same call, for the
 * block loop of few_rows_blocks.c (gpt2/block_loop.py says what it buys): a
 * layer norm of x before it (once, into a scratch copy), and GPT-2's GELU and
 * a residual added after it, each thread on its own outputs while they are
 * still in cache:
 *
 *     y = residual + gelu(layer_norm(x) W^T + b)
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "vector_math.h"

#define MAX_TILE_ROWS 7
/* Prefetch W this many bytes ahead (6 KiB) into L2 (_MM_HINT_T2). With N > 1
 * the loop does enough arithmetic per byte that the out-of-order core alone
 * keeps too few cache lines in flight, and memory time and arithmetic time add
 * up instead of overlapping. Measured on the whole gpt2-large forward, Zen 4
 * EPYC (2 cores, AVX-512 capable, kernel built for AVX2), interleaved runs:
 * r_5 = t_v(5) / step was 2.05-2.31 with a 1 KiB prefetch into L1 (_MM_HINT_T0),
 * 1.32-1.45 with 4 KiB into L2, 1.11-1.26 with 6 KiB, and the same within noise
 * at 8 and 12 KiB or into L1+L2 (_MM_HINT_T1). At N = 1 the hardware prefetcher
 * alone is as fast or faster (step 3-10% slower with it; int8 weights: the
 * same), so it is skipped. */
#define PREFETCH_BYTES 6144

/* Block k of a pair of W's rows, as floats: w0 = W[o][8k : 8k + 8] and
 * w1 = W[o + 1][8k : 8k + 8], unscaled where W is int8. */
static inline __attribute__((always_inline)) void load_pair_block(
    const void *w_pair, int64_t k, const int int8, __m256 *w0, __m256 *w1) {
    if (int8) {
        const int8_t *w = (const int8_t *)w_pair + 16 * k;
        *w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)w)));
        *w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + 8))));
    } else {
        const float *w = (const float *)w_pair + 16 * k;
        *w0 = _mm256_loadu_ps(w);
        *w1 = _mm256_loadu_ps(w + 8);
    }
}

/* y[r, o] and y[r, o + 1] for rows r < n_rows of x (n_rows and int8 are
 * constants at every call site, so the accumulators live in registers and
 * each combination compiles to its own loop).
 *
 * With one row the blocks alternate between two sets of accumulators, so
 * that a multiply-add does not wait for the previous one to finish (4 cycles
 * of latency): that bounds the int8 loop, which reads a quarter of the bytes
 * and widens every weight. Measured on the gpt2-large weights, N = 1: 31-33
 * ms with two sets against 36-38 with one (float32: memory-bound, the same). */
static inline __attribute__((always_inline)) void pair_tile(
    const float *x, const void *w_pair, const float *scale, const float *bias, float *y,
    int64_t in, int64_t out, int64_t o, const int n_rows, const int int8) {
    const int sets = n_rows == 1 ? 2 : 1;
    const int64_t blocks = in / 8, bytes_per_block = int8 ? 16 : 64;
    __m256 acc0[MAX_TILE_ROWS], acc1[MAX_TILE_ROWS]; /* output o and o + 1; [set] when n_rows = 1, else [r] */
    for (int a = 0; a < n_rows * sets; a++) {
        acc0[a] = _mm256_setzero_ps();
        acc1[a] = _mm256_setzero_ps();
    }
    for (int64_t k = 0; k < blocks; k += sets) {
        if (n_rows > 1) _mm_prefetch((const char *)w_pair + k * bytes_per_block + PREFETCH_BYTES, _MM_HINT_T2);
        for (int set = 0; set < sets && k + set < blocks; set++) {
            __m256 w0, w1;
            load_pair_block(w_pair, k + set, int8, &w0, &w1);
            for (int r = 0; r < n_rows; r++) {
                __m256 xr = _mm256_loadu_ps(x + r * in + 8 * (k + set)); /* x[r][8k : 8k + 8] */
                acc0[r + set] = _mm256_fmadd_ps(w0, xr, acc0[r + set]);
                acc1[r + set] = _mm256_fmadd_ps(w1, xr, acc1[r + set]);
            }
        }
    }
    if (sets == 2) {
        acc0[0] = _mm256_add_ps(acc0[0], acc0[1]);
        acc1[0] = _mm256_add_ps(acc1[0], acc1[1]);
    }
    const float s0 = scale ? scale[o] : 1.0f, s1 = scale && o + 1 < out ? scale[o + 1] : 1.0f;
    for (int r = 0; r < n_rows; r++) {
        y[r * out + o] = s0 * sum8(acc0[r]) + (bias ? bias[o] : 0.0f);
        if (o + 1 < out) /* the padding row of an odd OUT is not written */
            y[r * out + o + 1] = s1 * sum8(acc1[r]) + (bias ? bias[o + 1] : 0.0f);
    }
}

/* One pair of outputs for all N rows, in tiles of up to MAX_TILE_ROWS rows
 * (W's pair stays in L1 across the tiles). */
static inline __attribute__((always_inline)) void pair_all_rows(
    const float *x, const void *w_pair, const float *scale, const float *bias, float *y,
    int64_t n, int64_t in, int64_t out, int64_t o, const int int8) {
    for (int64_t r0 = 0; r0 < n; r0 += MAX_TILE_ROWS) {
        const float *xt = x + r0 * in;
        float *yt = y + r0 * out;
        switch (n - r0 < MAX_TILE_ROWS ? n - r0 : MAX_TILE_ROWS) {
            case 1: pair_tile(xt, w_pair, scale, bias, yt, in, out, o, 1, int8); break;
            case 2: pair_tile(xt, w_pair, scale, bias, yt, in, out, o, 2, int8); break;
            case 3: pair_tile(xt, w_pair, scale, bias, yt, in, out, o, 3, int8); break;
            case 4: pair_tile(xt, w_pair, scale, bias, yt, in, out, o, 4, int8); break;
            case 5: pair_tile(xt, w_pair, scale, bias, yt, in, out, o, 5, int8); break;
            case 6: pair_tile(xt, w_pair, scale, bias, yt, in, out, o, 6, int8); break;
            default: pair_tile(xt, w_pair, scale, bias, yt, in, out, o, 7, int8); break;
        }
    }
}

/* xn[r] = (x[r] - mean) / sqrt(var + eps) * weight + bias for each row r: the
 * layer norm over IN features, as torch.nn.LayerNorm (biased variance). */
static void layer_norm_rows(const float *x, const float *weight, const float *bias, float eps,
                            float *xn, int64_t n, int64_t in) {
    for (int64_t r = 0; r < n; r++) {
        const float *xr = x + r * in;
        float *out = xn + r * in;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < in; i += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(xr + i));
        const __m256 mean = _mm256_set1_ps(sum8(acc) / (float)in);
        acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < in; i += 8) {
            __m256 d = _mm256_sub_ps(_mm256_loadu_ps(xr + i), mean);
            acc = _mm256_fmadd_ps(d, d, acc);
        }
        const __m256 rstd = _mm256_set1_ps(1.0f / sqrtf(sum8(acc) / (float)in + eps));
        for (int64_t i = 0; i < in; i += 8) {
            __m256 z = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(xr + i), mean), rstd);
            _mm256_storeu_ps(out + i, _mm256_fmadd_ps(z, _mm256_loadu_ps(weight + i), _mm256_loadu_ps(bias + i)));
        }
    }
}

/* y[c] = gelu(y[c]) if gelu, then += residual[c], for c in [0, count). */
static void finish(float *y, const float *residual, int gelu, int64_t count) {
    int64_t c = 0;
    for (; c + 8 <= count; c += 8) {
        __m256 v = _mm256_loadu_ps(y + c);
        if (gelu) v = gelu8(v);
        if (residual) v = _mm256_add_ps(v, _mm256_loadu_ps(residual + c));
        _mm256_storeu_ps(y + c, v);
    }
    if (c < count) { /* the last count % 8, through a padded register */
        float tail[8] = {0};
        for (int64_t l = 0; c + l < count; l++) tail[l] = y[c + l];
        __m256 v = _mm256_loadu_ps(tail);
        if (gelu) v = gelu8(v);
        _mm256_storeu_ps(tail, v);
        for (int64_t l = 0; c + l < count; l++) y[c + l] = tail[l] + (residual ? residual[c + l] : 0.0f);
    }
}

/* x: (N, IN) row-major; packed: (ceil(OUT / 2), IN / 8, 2, 8), float32, or
 * int8 with scale: (OUT,) the rows' scales (NULL for float32); bias: (OUT,)
 * or NULL; y: (N, OUT) row-major, every element written.
 * norm_weight, norm_bias: (IN,) and eps of a layer norm applied to x first, or
 * NULL; gelu: nonzero to apply GELU to x W^T + b; residual: (N, OUT) row-major
 * added last, or NULL. */
void few_rows_linear(const float *x, const void *packed, const float *scale, const float *bias, float *y,
                     int64_t n, int64_t in, int64_t out,
                     const float *norm_weight, const float *norm_bias, float norm_eps,
                     int gelu, const float *residual) {
    float *normed = NULL;
    if (norm_weight) { /* once, before the threads start: N x IN is small */
        normed = malloc((size_t)(n * in) * sizeof(float));
        layer_norm_rows(x, norm_weight, norm_bias, norm_eps, normed, n, in);
        x = normed;
    }
    const int64_t pairs = (out + 1) / 2;
    const int64_t pair_bytes = 2 * in * (scale ? 1 : 4);
#pragma omp parallel
    {
        const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t p_begin = pairs * id / threads, p_end = pairs * (id + 1) / threads;
        for (int64_t p = p_begin; p < p_end; p++) {
            const void *w_pair = (const char *)packed + p * pair_bytes;
            if (scale)
                pair_all_rows(x, w_pair, scale, bias, y, n, in, out, 2 * p, 1);
            else
                pair_all_rows(x, w_pair, NULL, bias, y, n, in, out, 2 * p, 0);
        }
        if (gelu || residual) { /* this thread's outputs [2 p_begin, 2 p_end) of every row */
            const int64_t c_begin = 2 * p_begin, c_end = 2 * p_end < out ? 2 * p_end : out;
            for (int64_t r = 0; r < n && c_begin < c_end; r++)
                finish(y + r * out + c_begin, residual ? residual + r * out + c_begin : NULL, gelu, c_end - c_begin);
        }
    }
    free(normed);
}
