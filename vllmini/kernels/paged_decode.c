/* Decode attention over the paged KV cache, for the CPU (float32).

   One query token per row attends to the first seq_lens[b] positions of its sequence, read
   straight from the cache through its block table: no gathered copy of K/V is made (the torch
   path makes one, and on a CPU that copy is most of decode attention's cost). Rows (or, with
   fewer rows than threads, key ranges of rows) are spread over num_threads OpenMP threads
   (torch's intra-op count). A row walks its blocks, each one contiguous keys (or values) of
   all KV heads, with an online softmax per query head (running max m, running sum l,
   unnormalised output acc); before it works on a block it asks for the next one (the blocks
   are scattered in memory, so the hardware prefetcher cannot guess them).
   Built with -ffast-math so that expf vectorises; nothing here relies on infinities or NaN.

   Layouts (all contiguous): q, out [batch, num_kv_heads, group, head_dim];
   k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim];
   block_tables int32 [batch, table_stride]; seq_lens int32 [batch], each >= 1.
   Limits (checked by the caller): num_kv_heads * group <= MAX_HEADS, head_dim <= MAX_HEAD_DIM,
   block_size <= MAX_BLOCK_SIZE. Built and loaded by vllmini/models/cpu_attention.py. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_HEADS 128
#define MAX_HEAD_DIM 256
#define MAX_BLOCK_SIZE 256

int64_t paged_decode_limits(int64_t which) {
    return which == 0 ? MAX_HEADS : which == 1 ? MAX_HEAD_DIM : MAX_BLOCK_SIZE;
}

static void prefetch(const float *p, int64_t floats) {
    for (int64_t x = 0; x < floats; x += 16) __builtin_prefetch(p + x); /* 16 floats: one cache line */
}

/* Positions [start, end) of one row (start a multiple of block_size) for all its query heads:
   m, l, acc hold that range's running max, sum and unnormalised output when it returns. */
static void attend(const float *qb, const float *k_cache, const float *v_cache, const int32_t *table,
                   int64_t start, int64_t end, int64_t num_kv_heads, int64_t group, int64_t head_dim,
                   int64_t block_size, float scale, float *m, float *l, float *acc) {
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t block_stride = block_size * token_stride;
    const int64_t heads = num_kv_heads * group;
    float s[MAX_BLOCK_SIZE];
    for (int64_t i = 0; i < heads; i++) m[i] = 0.f, l[i] = 0.f;
    for (int64_t x = 0; x < heads * head_dim; x++) acc[x] = 0.f;
    for (int64_t pos = start; pos < end; pos += block_size) {
        const int64_t n = end - pos < block_size ? end - pos : block_size;
        const float *kb = k_cache + table[pos / block_size] * block_stride;
        const float *vb = v_cache + table[pos / block_size] * block_stride;
        if (pos + block_size < end) {
            const int64_t next = table[pos / block_size + 1] * block_stride;
            const int64_t rest = end - pos - block_size;
            prefetch(k_cache + next, (rest < block_size ? rest : block_size) * token_stride);
            prefetch(v_cache + next, (rest < block_size ? rest : block_size) * token_stride);
        }
        for (int64_t i = 0; i < heads; i++) { /* query head i reads KV head i / group */
            const float *qi = qb + i * head_dim;
            const float *kh = kb + (i / group) * head_dim, *vh = vb + (i / group) * head_dim;
            float block_max = pos > start ? m[i] : -FLT_MAX;
            for (int64_t t = 0; t < n; t++) {
                const float *kt = kh + t * token_stride;
                float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < head_dim; d++) dot += qi[d] * kt[d];
                s[t] = dot * scale;
                block_max = s[t] > block_max ? s[t] : block_max;
            }
            const float correction = pos > start ? expf(m[i] - block_max) : 0.f;
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
}

/* Work items are (row, split): with num_splits > 1 each row's blocks are cut into that many
   ranges (so that fewer rows than threads still keep every thread busy), each range's m, l and
   acc go to a scratch buffer, and a second pass merges them per row. */
void paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                      const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                      float *out, int64_t batch, int64_t num_kv_heads, int64_t group,
                      int64_t head_dim, int64_t block_size, float scale, int num_threads,
                      int64_t num_splits) {
    const int64_t heads = num_kv_heads * group, part_size = heads * (head_dim + 2);
    float *parts = num_splits > 1 ? malloc(sizeof(float) * batch * num_splits * part_size) : NULL;
    if (num_splits > 1 && !parts) num_splits = 1; /* no scratch: one range per row */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < batch * num_splits; item++) {
        const int64_t b = item / num_splits, split = item % num_splits, len = seq_lens[b];
        const int64_t per_split = (len + block_size - 1) / block_size * block_size / num_splits;
        const int64_t range = (per_split + block_size - 1) / block_size * block_size; /* whole blocks */
        const int64_t start = split * range, end = len < start + range ? len : start + range;
        float m[MAX_HEADS], l[MAX_HEADS], acc[MAX_HEADS * MAX_HEAD_DIM];
        attend(q + b * heads * head_dim, k_cache, v_cache, block_tables + b * table_stride, start,
               end, num_kv_heads, group, head_dim, block_size, scale, m, l, acc);
        if (!parts) {
            float *o = out + b * heads * head_dim;
            for (int64_t i = 0; i < heads; i++)
                for (int64_t d = 0; d < head_dim; d++) o[i * head_dim + d] = acc[i * head_dim + d] / l[i];
            continue;
        }
        float *part = parts + item * part_size; /* [m | l | acc] per head; l = 0 for an empty range */
        for (int64_t i = 0; i < heads; i++) part[i] = m[i], part[heads + i] = l[i];
        for (int64_t x = 0; x < heads * head_dim; x++) part[2 * heads + x] = acc[x];
    }
    if (!parts) return;
#pragma omp parallel for num_threads(num_threads)
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t i = 0; i < heads; i++) {
            const float *first = parts + b * num_splits * part_size;
            float top = -FLT_MAX, total = 0.f;
            for (int64_t sp = 0; sp < num_splits; sp++) {
                const float *part = first + sp * part_size;
                if (part[heads + i] > 0.f && part[i] > top) top = part[i];
            }
            float *o = out + (b * heads + i) * head_dim;
            for (int64_t d = 0; d < head_dim; d++) o[d] = 0.f;
            for (int64_t sp = 0; sp < num_splits; sp++) {
                const float *part = first + sp * part_size;
                if (part[heads + i] == 0.f) continue;
                const float w = expf(part[i] - top);
                total += w * part[heads + i];
                for (int64_t d = 0; d < head_dim; d++) o[d] += w * part[2 * heads + i * head_dim + d];
            }
            for (int64_t d = 0; d < head_dim; d++) o[d] /= total;
        }
    }
    free(parts);
}
