/* Attention of T new queries per row over a KV cache (a decode step, a
 * verification pass, a token tree, a batch of rows, a prefill chunk), on
 * x86-64 with AVX2 + FMA.
 *
 * Legend: B = rows, nh = heads, T = new tokens per row, hs = head size,
 * P = starts[b], the positions row b has cached before this pass.
 *
 * Row b's new tokens go into its cache at [P, P + T). Query t of row b sees
 * the cached keys [0, P) and the new tokens u that mask[t][u] allows (causal,
 * u <= t, without a mask; its ancestors in a token tree). A mask W > T wide
 * covers a window of the W - T last cached keys and then the new tokens:
 * query t sees the keys before the window, and the window keys the mask
 * allows (a tree drafted one depth per pass). Each cached key is read once
 * for all T queries; the values once per query.
 *
 * Batch invariance: a query's result depends only on the keys it sees, never
 * on T, B or where its keys sit in the cache. Every score is the same 8-lane
 * dot product reduced as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7));
 * the softmax and the weighted sum of values run over the seen keys in one
 * order, by position: the keys before the window, then the seen window keys. So a
 * position gives the same bits in a decode step, inside a verification pass,
 * at the end of a tree path and in a prefill chunk.
 *
 * Per (b, h), in three passes over this row's keys:
 *   1. scores s[t][i] = scale * q_t . k_i over the cached keys and the new
 *      ones each query sees, then compacted to the seen keys;
 *   2. softmax: p[t][i] = exp(s[t][i] - max_t), and 1 / sum;
 *   3. y_t = (sum_i p[t][i] v_i) / sum, written into y's (B, T, nh, hs) layout.
 * (b, h) pairs are handed to threads dynamically (OpenMP).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

/* The lanes of v added as a balanced tree: the order `sum8x8` uses for each key. */
static inline float sum8_tree(__m256 v) {
    float l[8];
    _mm256_storeu_ps(l, v);
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

/* Lane i = sum8_tree(a[i]), for 8 vectors at once. */
static inline __m256 sum8x8(const __m256 a[8]) {
    __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    /* s0123 = [a0 a1 a2 a3 (low halves) | a0 a1 a2 a3 (high halves)], same for s4567 */
    __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20);
    __m256 hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
    return _mm256_add_ps(lo, hi);
}

/* The 8 lane sums of q . k: lane l = sum over c = l (mod 8). */
static inline __m256 dot_lanes(const float *q, const float *k, int64_t hs) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t c = 0; c < hs; c += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), _mm256_loadu_ps(k + c), acc);
    return acc;
}

/* q: (B, nh, T, hs) with strides q_b, q_h, q_t (elements; hs contiguous);
 * k_new, v_new: the T new keys and values of each row, laid out like q, which
 * are first copied into the cache at [starts[b], starts[b] + T); or NULL where
 * they are there already. k, v: the cache, (B, nh, S, hs) with strides kv_b,
 * kv_h, hs. starts: (B,). mask: (T, W) bytes, W >= T, mask[t * W + u] nonzero
 * where query t sees window key u, key starts[b] + T - W + u (it must see
 * itself, u = W - T + t); NULL: causal (W = T).
 * y: (B, T, nh, hs) contiguous. hs must be a multiple of 8. */
void few_queries_attention(const float *q, const float *k_new, const float *v_new, float *k, float *v, float *y,
                           int64_t B, int64_t nh, int64_t T, const int64_t *starts, const uint8_t *mask,
                           int64_t W, int64_t hs, int64_t q_b, int64_t q_h, int64_t q_t, int64_t kv_b, int64_t kv_h,
                           float scale) {
#pragma omp parallel
    {
        float *scores = NULL;        /* this thread's rows of scores, then probabilities */
        int64_t *window_keys = malloc((size_t)W * sizeof(int64_t)); /* the seen window keys of one query */
        int64_t capacity = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t bh = 0; bh < B * nh; bh++) {
            const int64_t b = bh / nh, h = bh % nh, P = starts[b], P0 = P + T - W; /* the window: [P0, P + T) */
            const float *qh = q + b * q_b + h * q_h; /* query t at qh + t * q_t */
            float *kh = k + b * kv_b + h * kv_h;     /* key j at kh + j * hs */
            float *vh = v + b * kv_b + h * kv_h;
            if ((P + T) * T > capacity) {
                capacity = (P + T) * T;
                free(scores);
                scores = malloc((size_t)capacity * sizeof(float));
            }

            /* 0. the new keys and values into the cache */
            for (int64_t t = 0; k_new && t < T; t++) {
                memcpy(kh + (P + t) * hs, k_new + b * q_b + h * q_h + t * q_t, (size_t)hs * sizeof(float));
                memcpy(vh + (P + t) * hs, v_new + b * q_b + h * q_h + t * q_t, (size_t)hs * sizeof(float));
            }

            /* 1. scores of the cached keys, 8 keys at a time (one block stays in L1 while every query is scored) */
            int64_t j = 0;
            for (; j + 8 <= P; j += 8) {
                for (int64_t t = 0; t < T; t++) {
                    __m256 acc[8];
                    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
                    for (int64_t c = 0; c < hs; c += 8) {
                        __m256 qc = _mm256_loadu_ps(qh + t * q_t + c);
                        for (int i = 0; i < 8; i++)
                            acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(kh + (j + i) * hs + c), qc, acc[i]);
                    }
                    _mm256_storeu_ps(scores + t * (P + T) + j, _mm256_mul_ps(sum8x8(acc), _mm256_set1_ps(scale)));
                }
            }
            for (; j < P; j++) /* the last P % 8 */
                for (int64_t t = 0; t < T; t++)
                    scores[t * (P + T) + j] = scale * sum8_tree(dot_lanes(qh + t * q_t, kh + j * hs, hs));

            for (int64_t t = 0; t < T; t++) {
                float *row = scores + t * (P + T); /* the seen keys' scores, compacted: [0, seen) */
                /* the keys before the window, then the window keys this query sees, in index order
                 * (a cached one's score is already in row[P0 + u], and seen <= P0 + u: moved down in place) */
                int64_t seen = P0, n_window = 0;
                for (int64_t u = 0; u < W; u++) {
                    if (mask ? mask[t * W + u] != 0 : u <= t) {
                        const int64_t key = P0 + u;
                        window_keys[n_window++] = key;
                        row[seen++] = key < P ? row[key]
                                              : scale * sum8_tree(dot_lanes(qh + t * q_t, kh + key * hs, hs));
                    }
                }

                /* 2. softmax over the seen keys */
                float max = row[0];
                for (int64_t i = 1; i < seen; i++) max = row[i] > max ? row[i] : max;
                __m256 vmax = _mm256_set1_ps(max), vsum = _mm256_setzero_ps();
                int64_t i = 0;
                for (; i + 8 <= seen; i += 8) {
                    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + i), vmax));
                    _mm256_storeu_ps(row + i, e);
                    vsum = _mm256_add_ps(vsum, e);
                }
                float sum = sum8(vsum);
                if (i < seen) { /* the last seen % 8, through a padded register */
                    float tail[8];
                    for (int l = 0; l < 8; l++) tail[l] = i + l < seen ? row[i + l] - max : -100.0f;
                    _mm256_storeu_ps(tail, exp8(_mm256_loadu_ps(tail)));
                    for (int64_t l = 0; i + l < seen; l++) {
                        row[i + l] = tail[l];
                        sum += tail[l];
                    }
                }
                const __m256 inv_sum = _mm256_set1_ps(1.0f / sum);

                /* 3. y_t = sum_i p_i v_i / sum, 64 lanes of hs at a time in registers */
                float *yt = y + ((b * T + t) * nh + h) * hs;
                for (int64_t c0 = 0; c0 < hs; c0 += 64) {
                    const int64_t width = hs - c0 < 64 ? hs - c0 : 64;
                    __m256 acc[8];
                    for (int l = 0; l < 8; l++) acc[l] = _mm256_setzero_ps();
                    for (int64_t i2 = 0; i2 < seen; i2++) {
                        const int64_t key = i2 < P0 ? i2 : window_keys[i2 - P0];
                        __m256 pj = _mm256_set1_ps(row[i2]);
                        const float *vj = vh + key * hs + c0;
                        for (int l = 0; l < width / 8; l++)
                            acc[l] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * l), acc[l]);
                    }
                    for (int l = 0; l < width / 8; l++) _mm256_storeu_ps(yt + c0 + 8 * l, _mm256_mul_ps(acc[l], inv_sum));
                }
            }
        }
        free(scores);
        free(window_keys);
    }
}
