/* Decode attention over the paged KV cache, for the CPU (float32).

   One query token per row attends to the first seq_lens[b] positions of its sequence, read
   straight from the cache through its block table: no gathered copy of K/V is made (the torch
   path makes one, and on a CPU that copy is most of decode attention's cost). Rows are spread
   over num_threads OpenMP threads (torch's intra-op count). A row walks its blocks, each one
   contiguous keys (or values) of all KV heads, with an online softmax per query head (running
   max m, running sum l, unnormalised output acc); before it works on a block it asks for the
   next one (the blocks are scattered in memory, so the hardware prefetcher cannot guess them).
   Built with -ffast-math so that expf vectorises; nothing here relies on infinities or NaN.

   Layouts (all contiguous): q, out [batch, num_kv_heads, group, head_dim];
   k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim];
   block_tables int32 [batch, table_stride]; seq_lens int32 [batch], each >= 1.
   Limits (checked by the caller): num_kv_heads * group <= MAX_HEADS, head_dim <= MAX_HEAD_DIM,
   block_size <= MAX_BLOCK_SIZE. Built and loaded by vllmini/models/cpu_attention.py. */
#include <float.h>
#include <math.h>
#include <stdint.h>

#define MAX_HEADS 128
#define MAX_HEAD_DIM 256
#define MAX_BLOCK_SIZE 256

int64_t paged_decode_limits(int64_t which) {
    return which == 0 ? MAX_HEADS : which == 1 ? MAX_HEAD_DIM : MAX_BLOCK_SIZE;
}

static void prefetch(const float *p, int64_t floats) {
    for (int64_t x = 0; x < floats; x += 16) __builtin_prefetch(p + x); /* 16 floats: one cache line */
}

void paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                      const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                      float *out, int64_t batch, int64_t num_kv_heads, int64_t group,
                      int64_t head_dim, int64_t block_size, float scale, int num_threads) {
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t block_stride = block_size * token_stride;
    const int64_t heads = num_kv_heads * group;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t b = 0; b < batch; b++) {
        const int64_t len = seq_lens[b];
        const int32_t *table = block_tables + b * table_stride;
        const float *qb = q + b * heads * head_dim;
        float m[MAX_HEADS], l[MAX_HEADS], s[MAX_BLOCK_SIZE];
        float acc[MAX_HEADS * MAX_HEAD_DIM];
        for (int64_t i = 0; i < heads; i++) m[i] = 0.f, l[i] = 0.f;
        for (int64_t x = 0; x < heads * head_dim; x++) acc[x] = 0.f;
        for (int64_t start = 0; start < len; start += block_size) {
            const int64_t n = len - start < block_size ? len - start : block_size;
            const float *kb = k_cache + table[start / block_size] * block_stride;
            const float *vb = v_cache + table[start / block_size] * block_stride;
            if (start + block_size < len) {
                const int64_t next = table[start / block_size + 1] * block_stride;
                const int64_t rest = len - start - block_size;
                prefetch(k_cache + next, (rest < block_size ? rest : block_size) * token_stride);
                prefetch(v_cache + next, (rest < block_size ? rest : block_size) * token_stride);
            }
            for (int64_t i = 0; i < heads; i++) { /* query head i reads KV head i / group */
                const float *qi = qb + i * head_dim;
                const float *kh = kb + (i / group) * head_dim, *vh = vb + (i / group) * head_dim;
                float block_max = start ? m[i] : -FLT_MAX;
                for (int64_t t = 0; t < n; t++) {
                    const float *kt = kh + t * token_stride;
                    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < head_dim; d++) dot += qi[d] * kt[d];
                    s[t] = dot * scale;
                    block_max = s[t] > block_max ? s[t] : block_max;
                }
                const float correction = start ? expf(m[i] - block_max) : 0.f;
                float sum = 0.f;
#pragma omp simd reduction(+ : sum)
                for (int64_t t = 0; t < n; t++) {
                    s[t] = expf(s[t] - block_max);
                    sum += s[t];
                }
                l[i] = l[i] * correction + sum;
                m[i] = block_max;
                float *a = acc + i * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) a[d] *= correction;
                for (int64_t t = 0; t < n; t++) {
                    const float *vt = vh + t * token_stride;
                    const float p = s[t];
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++) a[d] += p * vt[d];
                }
            }
        }
        float *o = out + b * heads * head_dim;
        for (int64_t i = 0; i < heads; i++)
            for (int64_t d = 0; d < head_dim; d++) o[i * head_dim + d] = acc[i * head_dim + d] / l[i];
    }
}
