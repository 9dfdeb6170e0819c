/* y = residual + gelu(layer_norm(x) W^T + b) for N rows of x, each part
 * optional: GPT-2's matrix products with the work around them, on x86-64
 * with AVX2 + FMA.
 *
 * Legend: N = rows of x, IN = in features, OUT = out features.
 *
 * A decode step (N = 1) and a verification pass (N = gamma + 1) read every
 * weight once, so both should cost what reading W costs. This loop streams W
 * once for all N rows and reuses each loaded weight from a register. W is
 * "pair-packed" (gpt2/fast/accelerator.py `pack_pairs`): rows o and o + 1
 * interleaved in blocks of 8 floats, so that a pair of outputs is one
 * sequential stream:
 *
 *     packed[p][k] = W[2p][8k : 8k + 8], W[2p + 1][8k : 8k + 8]   (16 floats)
 *
 * OUT is padded to even with a zero row; IN must be a multiple of 8. W may be
 * int8 in the same layout with one scale per row, W[o][i] = scale[o] q[o][i]
 * (gpt2/fast/quantize.py): a quarter of the bytes, widened in registers.
 *
 * Batch invariance: every output y[r][o] is summed in one fixed order, the
 * same whatever N is and whichever rows share its tile: 8 lane sums over k
 * in order (int8: two sets of lane sums, even and odd blocks, added at the
 * end), then `sum8`, then the scale and the bias. A position's logits are
 * therefore bit-identical in a decode step, a verification pass or a batch.
 *
 * Work split: output pairs in chunks handed out dynamically (OpenMP), so that
 * a thread slowed by another process on its core takes fewer chunks instead
 * of holding up every layer. GELU and the residual are applied chunk by chunk
 * while the outputs are still in cache.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "vector_math.h"

/* A tile: one pair of outputs times up to 7 rows of x, 14 accumulators + 2
 * registers of W in AVX2's 16 registers. int8 keeps two sets of accumulators
 * (a multiply-add then never waits for the previous one; the int8 loop is
 * bound by that latency), so its tiles take 3 rows. */
#define FLOAT_TILE_ROWS 7
#define INT8_TILE_ROWS 3
/* With N > 1, W is prefetched this far ahead into L2: the loop does enough
 * arithmetic per byte that the core alone keeps too few loads in flight.
 * At N = 1 the hardware prefetcher does better alone. */
#define PREFETCH_BYTES 6144
/* Chunks of output pairs per thread, handed out dynamically. */
#define CHUNKS_PER_THREAD 8

/* Block k of a pair of W's rows, as floats (unscaled where W is int8). */
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

/* y[r][o] and y[r][o + 1] for the n_rows rows of x (n_rows and int8 are
 * constants at every call site: the accumulators live in registers). */
static inline __attribute__((always_inline)) void pair_tile(
    const float *x, const void *w_pair, const float *scale, const float *bias, float *y,
    int64_t in, int64_t out, int64_t o, const int n_rows, const int int8) {
    const int sets = int8 ? 2 : 1; /* int8: even blocks into set 0, odd ones into set 1 */
    const int64_t blocks = in / 8, bytes_per_block = int8 ? 16 : 64;
    __m256 acc0[FLOAT_TILE_ROWS], acc1[FLOAT_TILE_ROWS]; /* outputs o and o + 1, [set * n_rows + r] */
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
                acc0[set * n_rows + r] = _mm256_fmadd_ps(w0, xr, acc0[set * n_rows + r]);
                acc1[set * n_rows + r] = _mm256_fmadd_ps(w1, xr, acc1[set * n_rows + r]);
            }
        }
    }
    const float s0 = scale ? scale[o] : 1.0f, s1 = scale && o + 1 < out ? scale[o + 1] : 1.0f;
    for (int r = 0; r < n_rows; r++) {
        if (sets == 2) {
            acc0[r] = _mm256_add_ps(acc0[r], acc0[n_rows + r]);
            acc1[r] = _mm256_add_ps(acc1[r], acc1[n_rows + r]);
        }
        y[r * out + o] = s0 * sum8(acc0[r]) + (bias ? bias[o] : 0.0f);
        if (o + 1 < out) /* the padding row of an odd OUT is not written */
            y[r * out + o + 1] = s1 * sum8(acc1[r]) + (bias ? bias[o + 1] : 0.0f);
    }
}

/* One pair of outputs for all N rows, in tiles (W's pair stays in L1 across them). */
static inline __attribute__((always_inline)) void pair_all_rows(
    const float *x, const void *w_pair, const float *scale, const float *bias, float *y,
    int64_t n, int64_t in, int64_t out, int64_t o, const int int8) {
    const int64_t tile = int8 ? INT8_TILE_ROWS : FLOAT_TILE_ROWS;
    for (int64_t r0 = 0; r0 < n; r0 += tile) {
        const float *xt = x + r0 * in;
        float *yt = y + r0 * out;
        switch (n - r0 < tile ? n - r0 : tile) {
            case 1: pair_tile(xt, w_pair, scale, bias, yt, in, out, o, 1, int8); break;
            case 2: pair_tile(xt, w_pair, scale, bias, yt, in, out, o, 2, int8); break;
            case 3: pair_tile(xt, w_pair, scale, bias, yt, in, out, o, 3, int8); break;
            case 4: if (!int8) pair_tile(xt, w_pair, scale, bias, yt, in, out, o, 4, 0); break;
            case 5: if (!int8) pair_tile(xt, w_pair, scale, bias, yt, in, out, o, 5, 0); break;
            case 6: if (!int8) pair_tile(xt, w_pair, scale, bias, yt, in, out, o, 6, 0); break;
            default: if (!int8) pair_tile(xt, w_pair, scale, bias, yt, in, out, o, 7, 0); break;
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
    int64_t chunk = pairs / (CHUNKS_PER_THREAD * omp_get_max_threads());
    chunk = chunk < 4 ? 4 : chunk;
    const int64_t chunks = (pairs + chunk - 1) / chunk;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t p_begin = c * chunk, p_end = p_begin + chunk < pairs ? p_begin + chunk : pairs;
        for (int64_t p = p_begin; p < p_end; p++) {
            const void *w_pair = (const char *)packed + p * pair_bytes;
            if (scale)
                pair_all_rows(x, w_pair, scale, bias, y, n, in, out, 2 * p, 1);
            else
                pair_all_rows(x, w_pair, NULL, bias, y, n, in, out, 2 * p, 0);
        }
        if (gelu || residual) { /* this chunk's outputs [2 p_begin, 2 p_end) of every row */
            const int64_t c_begin = 2 * p_begin, c_end = 2 * p_end < out ? 2 * p_end : out;
            for (int64_t r = 0; r < n; r++)
                finish(y + r * out + c_begin, residual ? residual + r * out + c_begin : NULL, gelu, c_end - c_begin);
        }
    }
    free(normed);
}
