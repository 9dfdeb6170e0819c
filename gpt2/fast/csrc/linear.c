/* y = residual + gelu(layer_norm(x) W^T + b) for N rows of x, each part
 * optional: GPT-2's matrix products with the work around them, on x86-64
 * with AVX2 + FMA.
 *
 * Legend: N = rows of x, IN = in features, OUT = out features.
 *
 * A decode step (N = 1) and a verification pass (N = gamma + 1) read every
 * weight once, so both should cost what reading W costs. This loop streams W
 * once for all N rows and reuses each loaded weight from a register. W is
 * packed in groups of four rows (gpt2/fast/accelerator.py `pack_rows`): rows
 * o .. o + 3 interleaved in blocks of 8 floats, so that a group of outputs is
 * one sequential stream:
 *
 *     packed[g][k] = W[4g][8k : 8k + 8], ..., W[4g + 3][8k : 8k + 8]   (32 floats)
 *
 * OUT is padded to a multiple of 4 with zero rows; IN must be a multiple of 8.
 * W may be int8 in the same layout with one scale per row, W[o][i] = scale[o]
 * q[o][i] (gpt2/fast/quantize.py): a quarter of the bytes, widened in
 * registers.
 *
 * One row (a decode step) takes a group's four outputs at once: four chains
 * of multiply-adds, so that each need not wait for its previous one (one
 * output alone is latency-bound). For float32 W, two rows, and MANY_ROWS or
 * more, take the four outputs against tiles of up to 3 rows; in between, the
 * group's two pairs of outputs take turns against tiles of up to 7 rows
 * (`group_all_rows` says why); int8 W takes the pairs in turn from two rows
 * on, against tiles of up to INT8_TILE_ROWS. Where the library is built for AVX-512
 * (build.py), WIDE_FROM_ROWS rows or more take 512-bit registers, each
 * holding two outputs' blocks (`wide_tile`): half the multiply-adds; from
 * PAIRS_FROM_ROWS rows, two groups at a time; int8 W takes them at every N
 * (`int8_tile_wide`). Many rows of a long x (a
 * prefill, a big batch) go in blocks of rows that keep x in L2.
 *
 * Batch invariance: every output y[r][o] is summed in one fixed order, the
 * same whatever N is and whichever rows share its tile: 8 lane sums over k
 * in order (int8: two sets of lane sums, even and odd blocks, added at the
 * end), then `sum8`, then the scale and the bias. A position's logits are
 * therefore bit-identical in a decode step, a verification pass or a batch,
 * and in the AVX2 and AVX-512 builds.
 *
 * Work split: groups of outputs in chunks handed out dynamically (OpenMP), so that
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
 * bound by that latency), so its tiles take 3 rows (and so do the AVX-512
 * build's int8 tiles, `int8_tile_wide`: 12 of its 32 registers). */
#define FLOAT_TILE_ROWS 7
#define INT8_TILE_ROWS 3
#define SIDE_BY_SIDE_ROWS 3 /* rows of a tile that takes a group's four outputs at once */
#define MANY_ROWS 24 /* from here on, 4 outputs x SIDE_BY_SIDE_ROWS rows per tile */
#define GROUP 4 /* rows of W packed together */
#define K_STRETCH 8 /* blocks of k per turn of a group's two pairs (even: int8's two sets) */
/* With N > 1, or int8 W, W is prefetched this far ahead into L2: the loop
 * does enough arithmetic per byte that the core alone keeps too few loads in
 * flight. At N = 1 in float32 the hardware prefetcher does better alone. */
#define PREFETCH_BYTES 8192
/* ... and, in the AVX-512 build, this far ahead into L1 as well: its loops
 * take W faster than L1's own prefetcher brings it from L2. */
#ifdef __AVX512F__
#define L1_PREFETCH_BYTES 4096
#else
#define L1_PREFETCH_BYTES 0
#endif
/* Chunks of groups per thread, handed out dynamically. */
#define CHUNKS_PER_THREAD 2
/* x beyond this many bytes goes in blocks of rows, each of at least MIN_BLOCK_ROWS rows (`few_rows_linear`). */
#define ROW_BLOCK_BYTES (512 * 1024)
#define MIN_BLOCK_ROWS 20

/* Row j of block k of a group of W's rows, as floats (unscaled where W is int8). */
static inline __attribute__((always_inline)) __m256 load_block(const void *w_group, int64_t k, int j, const int int8) {
    if (int8) {
        const int8_t *w = (const int8_t *)w_group + 8 * (GROUP * k + j);
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)w)));
    }
    return _mm256_loadu_ps((const float *)w_group + 8 * (GROUP * k + j));
}

/* Prefetches into L2 the group's blocks PREFETCH_BYTES ahead of block k, all
 * the cache lines of the `sets` blocks the loop takes per step. */
static inline __attribute__((always_inline)) void prefetch_ahead(const void *w_group, int64_t k, const int sets,
                                                               const int int8) {
    const int64_t bytes_per_block = GROUP * 8 * (int8 ? 1 : 4);
    for (int64_t line = 0; line < sets * bytes_per_block; line += 64)
        _mm_prefetch((const char *)w_group + k * bytes_per_block + line + PREFETCH_BYTES, _MM_HINT_T2);
}

/* Prefetches into L1 the float32 group's block L1_PREFETCH_BYTES ahead of block k (two cache lines). */
static inline __attribute__((always_inline)) void prefetch_near(const void *w_group, int64_t k) {
    if (L1_PREFETCH_BYTES == 0) return;
    const char *line = (const char *)w_group + k * GROUP * 8 * 4 + L1_PREFETCH_BYTES;
    _mm_prefetch(line, _MM_HINT_T0);
    _mm_prefetch(line + 64, _MM_HINT_T0);
}

/* y[o + j] = scale[o + j] sum8(lane sums) + bias[o + j]: the last steps of
 * every output, in this one order. The padding rows of OUT are not written. */
static inline __attribute__((always_inline)) void store_output(
    float *y, __m256 lanes, const float *scale, const float *bias, int64_t out, int64_t o) {
    if (o < out) y[o] = (scale ? scale[o] : 1.0f) * sum8(lanes) + (bias ? bias[o] : 0.0f);
}

/* y[r][o .. o + 3] for n_rows (1 to SIDE_BY_SIDE_ROWS) rows of x: the group's four outputs
 * side by side, each block of W loaded once for all of them. */
static inline __attribute__((always_inline)) void group_few_rows(
    const float *x, const void *w_group, const float *scale, const float *bias, float *y,
    int64_t in, int64_t out, int64_t o, const int n_rows, const int int8) {
    const int sets = int8 ? 2 : 1; /* int8: even blocks into set 0, odd ones into set 1 */
    const int64_t blocks = in / 8;
    __m256 acc[2][GROUP][SIDE_BY_SIDE_ROWS]; /* [set][output j][row r] */
    for (int set = 0; set < sets; set++)
        for (int j = 0; j < GROUP; j++)
            for (int r = 0; r < n_rows; r++) acc[set][j][r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < blocks; k += sets) {
        if (n_rows > 1 || int8) prefetch_ahead(w_group, k, sets, int8);
        for (int set = 0; set < sets && k + set < blocks; set++)
            for (int j = 0; j < GROUP; j++) {
                const __m256 w = load_block(w_group, k + set, j, int8);
                for (int r = 0; r < n_rows; r++)
                    acc[set][j][r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + r * in + 8 * (k + set)), acc[set][j][r]);
            }
    }
    for (int j = 0; j < GROUP; j++)
        for (int r = 0; r < n_rows; r++)
            store_output(y + r * out, sets == 2 ? _mm256_add_ps(acc[0][j][r], acc[1][j][r]) : acc[0][j][r],
                         scale, bias, out, o + j);
}

/* Blocks [k_begin, k_end) of outputs o + h and o + h + 1 (h = 0 or 2) for the
 * n_rows rows of x, added to the lane sums acc0, acc1 ([set * n_rows + r]).
 * n_rows, h and int8 are constants at every call site: the sums live in
 * registers while the blocks run. */
static inline __attribute__((always_inline)) void pair_blocks(
    const float *x, const void *w_group, int64_t in, int64_t k_begin, int64_t k_end,
    const int h, const int n_rows, const int int8, __m256 *acc0, __m256 *acc1) {
    const int sets = int8 ? 2 : 1;
    __m256 a0[2 * FLOAT_TILE_ROWS], a1[2 * FLOAT_TILE_ROWS];
    for (int a = 0; a < n_rows * sets; a++) a0[a] = acc0[a], a1[a] = acc1[a];
    for (int64_t k = k_begin; k < k_end; k += sets) {
        if (n_rows > 1 && h == 0) { /* the first pair's turn, for both */
            prefetch_ahead(w_group, k, sets, int8);
            if (!int8) prefetch_near(w_group, k);
        }
        for (int set = 0; set < sets && k + set < k_end; set++) {
            const __m256 w0 = load_block(w_group, k + set, h, int8), w1 = load_block(w_group, k + set, h + 1, int8);
            for (int r = 0; r < n_rows; r++) {
                __m256 xr = _mm256_loadu_ps(x + r * in + 8 * (k + set)); /* x[r][8k : 8k + 8] */
                a0[set * n_rows + r] = _mm256_fmadd_ps(w0, xr, a0[set * n_rows + r]);
                a1[set * n_rows + r] = _mm256_fmadd_ps(w1, xr, a1[set * n_rows + r]);
            }
        }
    }
    for (int a = 0; a < n_rows * sets; a++) acc0[a] = a0[a], acc1[a] = a1[a];
}

/* y[r][o .. o + 3] for the n_rows rows of x: the group's two pairs take turns
 * over stretches of K_STRETCH blocks, so that the second pair finds the
 * stretch in L1. Each output's lane sums still run over k in order. */
static inline __attribute__((always_inline)) void group_tile(
    const float *x, const void *w_group, const float *scale, const float *bias, float *y,
    int64_t in, int64_t out, int64_t o, const int n_rows, const int int8) {
    const int sets = int8 ? 2 : 1;
    const int64_t blocks = in / 8;
    __m256 acc[GROUP][2 * FLOAT_TILE_ROWS]; /* [output j][set * n_rows + r] */
    for (int j = 0; j < GROUP; j++)
        for (int a = 0; a < n_rows * sets; a++) acc[j][a] = _mm256_setzero_ps();
    for (int64_t k = 0; k < blocks; k += K_STRETCH) {
        const int64_t k_end = k + K_STRETCH < blocks ? k + K_STRETCH : blocks;
        pair_blocks(x, w_group, in, k, k_end, 0, n_rows, int8, acc[0], acc[1]);
        pair_blocks(x, w_group, in, k, k_end, 2, n_rows, int8, acc[2], acc[3]);
    }
    for (int j = 0; j < GROUP; j++)
        for (int r = 0; r < n_rows; r++)
            store_output(y + r * out, sets == 2 ? _mm256_add_ps(acc[j][r], acc[j][n_rows + r]) : acc[j][r],
                         scale, bias, out, o + j);
}

#ifdef __AVX512F__
#define WIDE_FROM_ROWS 6 /* float32 passes of this many rows or more take `group_all_rows_wide` */
#define PAIRS_FROM_ROWS 32 /* ... and from this many, two groups at a time (`wide_tile`) */
#define WIDE_ACCUMULATORS 24 /* + up to 4 registers of W + 1 of x, of 32 */
#define WIDE_TILE_ROWS (WIDE_ACCUMULATORS / 2) /* a tile of one group: 2 registers per row */

/* x[8k : 8k + 8] in both halves of a 512-bit register. */
static inline __attribute__((always_inline)) __m512 load_twice(const float *x) {
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd((const double *)x)));
}

/* Lanes 0-7 and 8-15 of a 512-bit register, as two 256-bit ones. */
static inline __attribute__((always_inline)) __m256 low_half(__m512 v) { return _mm512_castps512_ps256(v); }
static inline __attribute__((always_inline)) __m256 high_half(__m512 v) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

/* Prefetches into L2 two cache lines of the next groups' W (`next`, NULL:
 * none) at block k of this tile's `blocks`: its share of them, bytes
 * [begin, end), spread evenly over the tile's loop. */
static inline __attribute__((always_inline)) void prefetch_share(const char *next, int64_t begin, int64_t end,
                                                                int64_t k, int64_t blocks) {
    if (!next) return;
    const char *line = next + ((begin + (end - begin) * k / blocks) & ~(int64_t)63);
    _mm_prefetch(line, _MM_HINT_T1);
    _mm_prefetch(line + 64, _MM_HINT_T1);
}

/* y[r][o .. o + 4 n_groups - 1] for n_rows rows of x (float32 W; n_groups = 1
 * or 2 consecutive groups), with 512-bit registers: block k of outputs
 * o + 2p and o + 2p + 1 are 16 consecutive floats of the packed group, so
 * one register holds both, multiplied by x[r][8k : 8k + 8] in both halves.
 * Lanes 0-7 are output o + 2p's 8 lane sums over k in order, lanes 8-15
 * output o + 2p + 1's: the sums of the 256-bit loops, bit for bit, at half
 * the multiply-adds. Two groups load 4 registers of W per block for 6 rows
 * instead of 2 for 12: fewer loads of x per multiply-add, and a tile's x
 * (6 rows of IN floats: 30 KB at IN = 1280) stays in cache. `fetch`: prefetch the groups' own W
 * (`prefetch_ahead`, `prefetch_near`). */
static inline __attribute__((always_inline)) void wide_tile(
    const float *x, const float *w, const float *bias, float *y, int64_t in, int64_t out, int64_t o,
    const int n_groups, const int n_rows, const char *next, int64_t next_begin, int64_t next_end, const int fetch) {
    const int64_t blocks = in / 8;
    __m512 acc[4][WIDE_TILE_ROWS]; /* [pair p of outputs][row r] */
    for (int p = 0; p < 2 * n_groups; p++)
        for (int r = 0; r < n_rows; r++) acc[p][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < blocks; k++) {
        __m512 wk[4]; /* outputs o + 2p, o + 2p + 1 */
        for (int g = 0; g < n_groups; g++) {
            const float *w_group = w + g * GROUP * in;
            if (fetch) {
                prefetch_ahead(w_group, k, 1, 0);
                prefetch_near(w_group, k);
            }
            wk[2 * g] = _mm512_loadu_ps(w_group + GROUP * 8 * k);
            wk[2 * g + 1] = _mm512_loadu_ps(w_group + GROUP * 8 * k + 16);
        }
        prefetch_share(next, next_begin, next_end, k, blocks);
        for (int r = 0; r < n_rows; r++) {
            const __m512 xr = load_twice(x + r * in + 8 * k);
            for (int p = 0; p < 2 * n_groups; p++) acc[p][r] = _mm512_fmadd_ps(wk[p], xr, acc[p][r]);
        }
    }
    for (int p = 0; p < 2 * n_groups; p++)
        for (int r = 0; r < n_rows; r++) {
            store_output(y + r * out, low_half(acc[p][r]), NULL, bias, out, o + 2 * p);
            store_output(y + r * out, high_half(acc[p][r]), NULL, bias, out, o + 2 * p + 1);
        }
}

/* y[r][o .. o + 3] for n_rows (1 to INT8_TILE_ROWS) rows of x, int8 W, with
 * 512-bit registers: block k of outputs o + 2p and o + 2p + 1 are 16
 * consecutive int8 of the packed group, widened into one register and
 * multiplied by x[r][8k : 8k + 8] in both halves. Even and odd blocks go
 * into two sets of sums, as in `group_few_rows` and `group_tile`: the same
 * sums, bit for bit, at half the widenings and multiply-adds. */
static inline __attribute__((always_inline)) void int8_tile_wide(
    const float *x, const int8_t *w, const float *scale, const float *bias, float *y,
    int64_t in, int64_t out, int64_t o, const int n_rows) {
    const int64_t blocks = in / 8;
    __m512 acc[2][2][INT8_TILE_ROWS]; /* [set][pair p][row r] */
    for (int set = 0; set < 2; set++)
        for (int p = 0; p < 2; p++)
            for (int r = 0; r < n_rows; r++) acc[set][p][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < blocks; k += 2) {
        prefetch_ahead(w, k, 2, 1);
        for (int set = 0; set < 2 && k + set < blocks; set++)
            for (int p = 0; p < 2; p++) {
                const __m128i q = _mm_loadu_si128((const __m128i *)(w + 8 * (GROUP * (k + set) + 2 * p)));
                const __m512 wp = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
                for (int r = 0; r < n_rows; r++)
                    acc[set][p][r] = _mm512_fmadd_ps(wp, load_twice(x + r * in + 8 * (k + set)), acc[set][p][r]);
            }
    }
    for (int p = 0; p < 2; p++)
        for (int r = 0; r < n_rows; r++) {
            const __m512 sum = _mm512_add_ps(acc[0][p][r], acc[1][p][r]);
            store_output(y + r * out, low_half(sum), scale, bias, out, o + 2 * p);
            store_output(y + r * out, high_half(sum), scale, bias, out, o + 2 * p + 1);
        }
}

/* A group's four outputs for all N rows, int8 W, INT8_TILE_ROWS rows at a time. */
static inline __attribute__((always_inline)) void int8_all_rows_wide(
    const float *x, const int8_t *w_group, const float *scale, const float *bias, float *y,
    int64_t n, int64_t in, int64_t out, int64_t o) {
    for (int64_t r0 = 0; r0 < n; r0 += INT8_TILE_ROWS) {
        const float *xt = x + r0 * in;
        float *yt = y + r0 * out;
        switch (n - r0 < INT8_TILE_ROWS ? n - r0 : INT8_TILE_ROWS) {
            case 1: int8_tile_wide(xt, w_group, scale, bias, yt, in, out, o, 1); break;
            case 2: int8_tile_wide(xt, w_group, scale, bias, yt, in, out, o, 2); break;
            default: int8_tile_wide(xt, w_group, scale, bias, yt, in, out, o, INT8_TILE_ROWS); break;
        }
    }
}

/* n_groups (1 or 2) float32 groups' outputs for all N rows, in tiles of up
 * to WIDE_ACCUMULATORS / (2 n_groups) rows, near-equal in size. Only the
 * first tile reads the groups' W from memory; the others find it in cache,
 * and memory would idle while they run. So each tile also prefetches its
 * share of the next groups (`w_next`, NULL: none), by rows: W is read all
 * along the tiles. */
static inline __attribute__((always_inline)) void group_all_rows_wide(
    const float *x, const float *w, const float *bias, float *y, int64_t n, int64_t in, int64_t out, int64_t o,
    const int n_groups, const char *w_next) {
    const int tile_rows = WIDE_ACCUMULATORS / (2 * n_groups);
    const int64_t bytes = n_groups * GROUP * in * 4, tiles = (n + tile_rows - 1) / tile_rows;
    const char *next = tiles > 1 ? w_next : NULL; /* one tile: `prefetch_ahead` runs into the next group */
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t r0 = n * t / tiles, r1 = n * (t + 1) / tiles; /* rows [r0, r1) */
        const int64_t share0 = bytes * r0 / n, share1 = bytes * r1 / n; /* of the next groups */
        const float *xt = x + r0 * in;
        float *yt = y + r0 * out;
        /* A pair's later tiles find its W in cache: prefetching it again would only take load slots. */
        const int fetch = t == 0 || n_groups == 1;
#define TILE(rows) wide_tile(xt, w, bias, yt, in, out, o, n_groups, rows, next, share0, share1, fetch)
        switch (r1 - r0) { /* the row count a constant in each copy; two groups take at most 6 */
            case 1: TILE(1); break;
            case 2: TILE(2); break;
            case 3: TILE(3); break;
            case 4: TILE(4); break;
            case 5: TILE(5); break;
            case 6: TILE(6); break;
            case 7: if (n_groups == 1) TILE(7); break;
            case 8: if (n_groups == 1) TILE(8); break;
            case 9: if (n_groups == 1) TILE(9); break;
            case 10: if (n_groups == 1) TILE(10); break;
            case 11: if (n_groups == 1) TILE(11); break;
            default: if (n_groups == 1) TILE(WIDE_TILE_ROWS); break;
        }
#undef TILE
    }
}
#endif

/* A group's four outputs for all N rows, in tiles of rows (the group's
 * weights stay in cache across the tiles). Which tile depends on N: the
 * four outputs side by side for one row or two (few sums in flight
 * otherwise), and from MANY_ROWS rows, where arithmetic bounds the loop (3
 * rows x 4 outputs load fewer values per multiply-add than 7 x 2); the two
 * pairs in turn, FLOAT_TILE_ROWS rows at a time, in between, where memory does.
 * In the AVX-512 build, float32 W from WIDE_FROM_ROWS rows on: the 512-bit
 * tiles, which prefetch w_next, the next group of the chunk (NULL: none).
 * (The AVX-512 build takes int8 W in `int8_all_rows_wide`.) */
static inline __attribute__((always_inline)) void group_all_rows(
    const float *x, const void *w_group, const float *scale, const float *bias, float *y,
    int64_t n, int64_t in, int64_t out, int64_t o, const int int8, const char *w_next) {
#ifdef __AVX512F__
    if (!int8 && n >= WIDE_FROM_ROWS) {
        group_all_rows_wide(x, (const float *)w_group, bias, y, n, in, out, o, 1, w_next);
        return;
    }
#endif
    if (n == 1) {
        group_few_rows(x, w_group, scale, bias, y, in, out, o, 1, int8);
        return;
    }
    const int side_by_side = !int8 && (n == 2 || n >= MANY_ROWS);
    const int64_t tile = side_by_side ? SIDE_BY_SIDE_ROWS : int8 ? INT8_TILE_ROWS : FLOAT_TILE_ROWS;
    for (int64_t r0 = 0; r0 < n; r0 += tile) {
        const float *xt = x + r0 * in;
        float *yt = y + r0 * out;
        const int64_t rows = n - r0 < tile ? n - r0 : tile;
        if (side_by_side) {
            if (rows == 1) group_few_rows(xt, w_group, scale, bias, yt, in, out, o, 1, 0);
            else if (rows == 2) group_few_rows(xt, w_group, scale, bias, yt, in, out, o, 2, 0);
            else group_few_rows(xt, w_group, scale, bias, yt, in, out, o, SIDE_BY_SIDE_ROWS, 0);
            continue;
        }
        switch (rows) {
            case 1: group_tile(xt, w_group, scale, bias, yt, in, out, o, 1, int8); break;
            case 2: group_tile(xt, w_group, scale, bias, yt, in, out, o, 2, int8); break;
            case 3: group_tile(xt, w_group, scale, bias, yt, in, out, o, 3, int8); break;
            case 4: if (!int8) group_tile(xt, w_group, scale, bias, yt, in, out, o, 4, 0); break;
            case 5: if (!int8) group_tile(xt, w_group, scale, bias, yt, in, out, o, 5, 0); break;
            case 6: if (!int8) group_tile(xt, w_group, scale, bias, yt, in, out, o, 6, 0); break;
            default: if (!int8) group_tile(xt, w_group, scale, bias, yt, in, out, o, FLOAT_TILE_ROWS, 0); break;
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

/* Outputs [4 g_begin, 4 g_end) of every row of y (N, OUT), a chunk's: GELU, then the residual. */
static void finish_chunk(float *y, const float *residual, int gelu, int64_t n, int64_t out, int64_t g_begin,
                         int64_t g_end) {
    if (!gelu && !residual) return;
    const int64_t c_begin = GROUP * g_begin, c_end = GROUP * g_end < out ? GROUP * g_end : out;
    for (int64_t r = 0; r < n; r++)
        finish(y + r * out + c_begin, residual ? residual + r * out + c_begin : NULL, gelu, c_end - c_begin);
}

/* x: (N, IN) row-major; packed: (ceil(OUT / 4), IN / 8, 4, 8), float32, or
 * int8 with scale: (OUT,) the rows' scales (NULL for float32); bias: (OUT,)
 * or NULL; y: (N, OUT) row-major, every element written.
 * norm_weight, norm_bias: (IN,) and eps of a layer norm applied to x first, or
 * NULL; gelu: nonzero to apply GELU to x W^T + b; residual: (N, OUT) row-major
 * added last, or NULL. */
void few_rows_linear(const float *x, const void *packed, const float *scale, const float *bias, float *y,
                     int64_t n, int64_t in, int64_t out,
                     const float *norm_weight, const float *norm_bias, float norm_eps,
                     int gelu, const float *residual) {
    /* Many rows of a long x: in blocks of rows whose x stays in L2 while every group passes over it
     * (each block reads W again; its rows' outputs are the same, row by row). */
    const int64_t row_blocks_by_size = (n * in * 4 + ROW_BLOCK_BYTES - 1) / ROW_BLOCK_BYTES;
    const int64_t row_blocks = row_blocks_by_size < n / MIN_BLOCK_ROWS ? row_blocks_by_size : n / MIN_BLOCK_ROWS;
    if (row_blocks > 1) {
        for (int64_t b = 0; b < row_blocks; b++) {
            const int64_t r0 = n * b / row_blocks, r1 = n * (b + 1) / row_blocks;
            few_rows_linear(x + r0 * in, packed, scale, bias, y + r0 * out, r1 - r0, in, out,
                            norm_weight, norm_bias, norm_eps, gelu, residual ? residual + r0 * out : NULL);
        }
        return;
    }
    float *normed = NULL;
    if (norm_weight) { /* once, before the threads start: N x IN is small */
        normed = malloc((size_t)(n * in) * sizeof(float));
        layer_norm_rows(x, norm_weight, norm_bias, norm_eps, normed, n, in);
        x = normed;
    }
    const int64_t groups = (out + GROUP - 1) / GROUP;
    const int64_t group_bytes = GROUP * in * (scale ? 1 : 4);
    int64_t chunk = groups / (CHUNKS_PER_THREAD * omp_get_max_threads());
    chunk = chunk < 2 ? 2 : chunk;
    const int64_t chunks = (groups + chunk - 1) / chunk;
#ifdef __AVX512F__
    if (scale) { /* int8 W in a loop of its own: in the float32 loop, it made the compiler lay that out slower */
#pragma omp parallel for schedule(dynamic, 1)
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t g_begin = c * chunk, g_end = g_begin + chunk < groups ? g_begin + chunk : groups;
            for (int64_t g = g_begin; g < g_end; g++)
                int8_all_rows_wide(x, (const int8_t *)packed + g * group_bytes, scale, bias, y, n, in, out, GROUP * g);
            finish_chunk(y, residual, gelu, n, out, g_begin, g_end);
        }
        free(normed);
        return;
    }
#endif
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t g_begin = c * chunk, g_end = g_begin + chunk < groups ? g_begin + chunk : groups;
        for (int64_t g = g_begin; g < g_end; g++) {
            const void *w_group = (const char *)packed + g * group_bytes;
            if (scale) /* the AVX2 build's int8 (the AVX-512 build took it in the loop above) */
                group_all_rows(x, w_group, scale, bias, y, n, in, out, GROUP * g, 1, NULL);
#ifdef __AVX512F__
            else if (n >= PAIRS_FROM_ROWS && g + 1 < g_end) { /* this group and the next, with the two after */
                group_all_rows_wide(x, (const float *)w_group, bias, y, n, in, out, GROUP * g, 2,
                                    g + 3 < g_end ? (const char *)w_group + 2 * group_bytes : NULL);
                g++;
            }
#endif
            else /* with the next group of this chunk, for the 512-bit tiles to prefetch */
                group_all_rows(x, w_group, NULL, bias, y, n, in, out, GROUP * g, 0,
                               g + 1 < g_end ? (const char *)w_group + group_bytes : NULL);
        }
        finish_chunk(y, residual, gelu, n, out, g_begin, g_end);
    }
    free(normed);
}
