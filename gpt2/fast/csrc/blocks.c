/* All n_layer blocks of GPT-2 for a few new tokens per row in one call: what
 * gpt2/model.py's Block.forward computes, as five kernel calls per block with
 * no Python in between (between two kernels that have just streamed weights
 * through the CPU's caches, every small PyTorch op would run cold):
 *
 *     qkv = ln_1(x) W_attn^T + b_attn                     few_rows_linear
 *     y   = attention(q, cache + (k, v))                  few_queries_attention
 *     x2  = x + y W_proj^T + b_proj                       few_rows_linear
 *     h   = gelu(ln_2(x2) W_fc^T + b_fc)                  few_rows_linear
 *     x   = x2 + h W_mlp_proj^T + b_mlp_proj              few_rows_linear
 *
 * Legend: B = rows, T = new tokens per row, N = B * T, C = n_embd, nh = heads,
 * hs = C / nh, S = the cache's capacity.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

void few_rows_linear(const float *x, const void *packed, const float *scale, const float *bias, float *y,
                     int64_t n, int64_t in, int64_t out,
                     const float *norm_weight, const float *norm_bias, float norm_eps,
                     int gelu, const float *residual);

void few_queries_attention(const float *q, const float *k_new, const float *v_new, float *k, float *v, float *y,
                           int64_t B, int64_t nh, int64_t T, const int64_t *starts, const uint8_t *mask,
                           int64_t W, int64_t hs, int64_t q_b, int64_t q_h, int64_t q_t, int64_t kv_b, int64_t kv_h,
                           float scale);

/* One block's parameters as data pointers: the layer norms' weight and bias
 * (C,), and each linear layer's packed weight (float32, or int8 with its
 * rows' scales; see linear.c), scales (NULL for float32) and bias.
 * Mirrored by BlockPointers in gpt2/fast/accelerator.py. */
typedef struct {
    const float *ln_1_weight, *ln_1_bias;
    const void *c_attn;                                          /* C -> 3C */
    const float *c_attn_scale, *c_attn_bias;
    const void *attn_proj;                                       /* C -> C */
    const float *attn_proj_scale, *attn_proj_bias;
    const float *ln_2_weight, *ln_2_bias;
    const void *c_fc;                                            /* C -> 4C */
    const float *c_fc_scale, *c_fc_bias;
    const void *mlp_proj;                                        /* 4C -> C */
    const float *mlp_proj_scale, *mlp_proj_bias;
} BlockPointers;

/* x: (N, C) row-major, the blocks' input, overwritten with their output.
 * scratch: 9 N C floats. k_cache, v_cache: (L, B, nh, S, hs) with strides
 * (layer_stride, kv_b, kv_h, hs, 1). starts: (B,), row b's cached positions
 * [0, starts[b]); its T new tokens are written at [starts[b], starts[b] + T).
 * mask: (T, W) bytes or NULL (causal, W = T), see few_queries_attention. */
void few_rows_blocks(const BlockPointers *blocks, int64_t n_layer, float *x, float *scratch,
                     int64_t B, int64_t T, int64_t C, int64_t nh, float eps,
                     float *k_cache, float *v_cache, int64_t layer_stride, int64_t kv_b, int64_t kv_h,
                     const int64_t *starts, const uint8_t *mask, int64_t mask_width) {
    const int64_t N = B * T, hs = C / nh;
    float *qkv = scratch;          /* (N, 3C) */
    float *y = qkv + N * 3 * C;    /* (N, C) */
    float *x2 = y + N * C;         /* (N, C) */
    float *h = x2 + N * C;         /* (N, 4C) */
    const float attn_scale = 1.0f / sqrtf((float)hs);
    for (int64_t l = 0; l < n_layer; l++) {
        const BlockPointers *b = &blocks[l];
        few_rows_linear(x, b->c_attn, b->c_attn_scale, b->c_attn_bias, qkv, N, C, 3 * C,
                        b->ln_1_weight, b->ln_1_bias, eps, 0, NULL);
        /* q, k, v of token (b, t), head h at qkv + (b T + t) 3C + {0, C, 2C} + h hs */
        few_queries_attention(qkv, qkv + C, qkv + 2 * C, k_cache + l * layer_stride, v_cache + l * layer_stride, y,
                              B, nh, T, starts, mask, mask_width, hs, T * 3 * C, hs, 3 * C, kv_b, kv_h, attn_scale);
        few_rows_linear(y, b->attn_proj, b->attn_proj_scale, b->attn_proj_bias, x2, N, C, C,
                        NULL, NULL, 0.0f, 0, x);
        few_rows_linear(x2, b->c_fc, b->c_fc_scale, b->c_fc_bias, h, N, C, 4 * C,
                        b->ln_2_weight, b->ln_2_bias, eps, 1, NULL);
        few_rows_linear(h, b->mlp_proj, b->mlp_proj_scale, b->mlp_proj_bias, x, N, 4 * C, C,
                        NULL, NULL, 0.0f, 0, x2);
    }
}
