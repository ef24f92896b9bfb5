/* Decode attention over the paged KV cache, for the CPU (float32 math; float32, bfloat16 or fp8 cache).

   One query token per row attends to the first seq_lens[b] positions of its sequence (with
   window > 0, only the last window of them: sliding-window attention), read
   straight from the cache through its block table: no gathered copy of K/V is made (the torch
   path makes one, and on a CPU that copy is most of decode attention's cost). Rows (or, with
   fewer rows than threads, key ranges of rows) are spread over num_threads OpenMP threads
   (torch's intra-op count). A row walks its blocks, each one contiguous keys (or values) of
   all KV heads, with an online softmax per query head (running max m, running sum l,
   unnormalised output acc); while it works on a block it prefetches the next one (the blocks
   are scattered in memory, so the hardware prefetcher cannot guess them).
   With softcap > 0 (Gemma 2's attn_logit_softcapping) each score s becomes softcap * tanh(s / softcap)
   before the softmax; the capped and uncapped loops are separate specialisations of attend (no
   branch in the uncapped one), and tanh is computed from one expf of a non-positive argument
   (no overflow), in a loop of its own so that it vectorises.
   With sinks (gpt-oss: a learned logit per query head that joins the softmax as a column whose value row
   is zero) a row's online softmax starts from m = sink, l = 1, acc = 0 instead of from its first block:
   no extra work per key, and without sinks (NULL) the same loop as before. A row cut into key ranges
   counts its sink in its first range only (the merge would count it once per range otherwise).
   Built with -ffast-math so that expf vectorises; nothing here relies on infinities or NaN (the caller
   passes finite sinks).

   Layouts (all contiguous): q, out [batch, num_kv_heads, group, head_dim], float32;
   k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim], of cache_kind: 0 float32,
   1 bfloat16, 2 fp8 e4m3 (OCP "fn": no infinities), 3 fp8 e5m2; each element is widened to
   float32 as it is read, which is exact;
   block_tables int32 [batch, table_stride]; seq_lens int32 [batch], each >= 1; sinks float32 [num_kv_heads * group]
   or NULL.
   Limits (checked by the caller): num_kv_heads * group <= MAX_HEADS, head_dim <= MAX_HEAD_DIM,
   block_size <= MAX_BLOCK_SIZE. Built and loaded by vllmini/models/cpu_attention.py. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEADS 128
#define MAX_HEAD_DIM 256
#define MAX_BLOCK_SIZE 256

int64_t paged_decode_limits(int64_t which) {
    return which == 0 ? MAX_HEADS : which == 1 ? MAX_HEAD_DIM : MAX_BLOCK_SIZE;
}

static void prefetch(const char *p, int64_t bytes) {
    for (int64_t x = 0; x < bytes; x += 64) __builtin_prefetch(p + x); /* one cache line */
}

enum { KIND_F32, KIND_BF16, KIND_E4M3, KIND_E5M2 };

/* Element i of a cache row as float32. bfloat16 is the top half of a float32, so widening it is
   a 16-bit shift. An fp8 byte's exponent and mantissa bits, moved to the top of a float32's
   (shift 20 for e4m3's 3 mantissa bits, 21 for e5m2's 2), read as a float32 whose exponent bias
   is 127 instead of the format's 7 or 15: its value times 2^(127 - bias) (``rebias``), which
   attend applies once per score and once per softmax weight instead of once per element (1.2x
   faster at 64 rows). Subnormal fp8 values land on float32 subnormals, exactly (e4m3's NaN bytes
   would read as 480: the cache never holds them, to_cache saturates). ``kind`` is a
   constant wherever this is inlined, so each loop is built once per cache type, with no branch
   inside. */
static inline float load(const char *row, int64_t i, int kind) {
    if (kind == KIND_F32) return ((const float *)row)[i];
    uint32_t bits;
    if (kind == KIND_BF16) {
        bits = (uint32_t)((const uint16_t *)row)[i] << 16;
    } else {
        const uint32_t b = ((const uint8_t *)row)[i];
        bits = (b & 0x80u) << 24 | (b & 0x7fu) << (kind == KIND_E4M3 ? 20 : 21);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f; /* fp8: still to be multiplied by rebias(kind), which attend folds into its scales */
}

/* 2^(127 - bias): what an fp8 element read by load() is still to be multiplied by. */
static inline float rebias(int kind) {
    return kind == KIND_E4M3 ? 0x1p120f : kind == KIND_E5M2 ? 0x1p112f : 1.f;
}

/* softcap * tanh(x / softcap) of n scores, in place, and their max (at least floor). tanh(|y|) is
   (1 - e) / (1 + e) with e = exp(-2|y|) in (0, 1]: no overflow, and one expf per score. */
static inline float cap_scores(float *s, int64_t n, float softcap, float floor) {
    const float inv = 1.f / softcap;
    float top = floor;
#pragma omp simd reduction(max : top)
    for (int64_t t = 0; t < n; t++) {
        const float e = expf(-2.f * fabsf(s[t] * inv));
        const float c = copysignf(softcap * (1.f - e) / (1.f + e), s[t]);
        s[t] = c;
        top = c > top ? c : top;
    }
    return top;
}

/* Positions [start, end) of one row for all its query heads: m, l, acc hold that range's
   running max, sum and unnormalised output when it returns (l = 0 for an empty range; with
   sink, a logit per head, the sink's column is in them from the start: m = sink, l = 1).
   capped (a constant where inlined): scores pass through cap_scores. */
static inline __attribute__((always_inline)) void attend(
    const float *qb, const char *k_cache, const char *v_cache, const int32_t *table, int64_t start,
    int64_t end, int64_t num_kv_heads, int64_t group, int64_t head_dim, int64_t block_size,
    float scale, float *m, float *l, float *acc, int kind, int capped, float softcap, const float *sink) {
    const int64_t elem = kind == KIND_F32 ? 4 : kind == KIND_BF16 ? 2 : 1; /* bytes */
    const float k_scale = scale * rebias(kind); /* fp8 keys' rebias, once per score */
    const int64_t token_stride = num_kv_heads * head_dim * elem;
    const int64_t block_stride = block_size * token_stride;
    const int64_t heads = num_kv_heads * group;
    float s[MAX_BLOCK_SIZE];
    for (int64_t i = 0; i < heads; i++) m[i] = sink ? sink[i] : 0.f, l[i] = sink ? 1.f : 0.f;
    for (int64_t x = 0; x < heads * head_dim; x++) acc[x] = 0.f;
    for (int64_t pos = start, after; pos < end; pos = after) {
        const int64_t off = pos % block_size; /* a window may start mid-block */
        const int64_t n = end - pos < block_size - off ? end - pos : block_size - off;
        const char *kb = k_cache + table[pos / block_size] * block_stride + off * token_stride;
        const char *vb = v_cache + table[pos / block_size] * block_stride + off * token_stride;
        after = pos + n; /* the next block's first position */
        /* The next block (none at the range's end) is prefetched a slice per query head, so its
           fetches spread over this block's work: asked for all at once before it, as first
           written, decode attention was 1.15x (float32) to 1.3x (bfloat16) slower. */
        const int64_t rest = end - after; /* positions after this block */
        const int64_t next_bytes = rest <= 0 ? 0 : (rest < block_size ? rest : block_size) * token_stride;
        const int64_t next = next_bytes ? table[after / block_size] * block_stride : 0;
        const int64_t slice = (next_bytes / heads + 63) / 64 * 64; /* whole cache lines */
        const int seen = pos > start || sink; /* a running (m, l, acc) to rescale: earlier blocks or the sink */
        for (int64_t i = 0; i < heads; i++) { /* query head i reads KV head i / group */
            if (i * slice < next_bytes) {
                const int64_t len = next_bytes - i * slice < slice ? next_bytes - i * slice : slice;
                prefetch(k_cache + next + i * slice, len);
                prefetch(v_cache + next + i * slice, len);
            }
            const float *qi = qb + i * head_dim;
            const char *kh = kb + (i / group) * head_dim * elem, *vh = vb + (i / group) * head_dim * elem;
            float block_max = seen ? m[i] : -FLT_MAX;
            for (int64_t t = 0; t < n; t++) {
                const char *kt = kh + t * token_stride;
                float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < head_dim; d++) dot += qi[d] * load(kt, d, kind);
                s[t] = dot * k_scale;
                if (!capped) block_max = s[t] > block_max ? s[t] : block_max;
            }
            if (capped) block_max = cap_scores(s, n, softcap, block_max);
            const float correction = seen ? expf(m[i] - block_max) : 0.f;
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
                const char *vt = vh + t * token_stride;
                const float p = s[t] * rebias(kind); /* fp8 values' rebias, once per weight */
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) a[d] += p * load(vt, d, kind);
            }
        }
    }
}

/* Work items are (row, split): with num_splits > 1 each row's blocks are cut into that many
   ranges (so that fewer rows than threads still keep every thread busy), each range's m, l and
   acc go to a scratch buffer, and a second pass merges them per row (sinks: in range 0's). */
void paged_decode(const float *q, const void *k_cache, const void *v_cache, int cache_kind,
                  const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                  float *out, int64_t batch, int64_t num_kv_heads, int64_t group, int64_t head_dim,
                  int64_t block_size, float scale, int num_threads, int64_t num_splits, int64_t window,
                  float softcap, const float *sinks) {
    const int64_t heads = num_kv_heads * group, part_size = heads * (head_dim + 2);
    float *parts = num_splits > 1 ? malloc(sizeof(float) * batch * num_splits * part_size) : NULL;
    if (num_splits > 1 && !parts) num_splits = 1; /* no scratch: one range per row */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < batch * num_splits; item++) {
        const int64_t b = item / num_splits, split = item % num_splits, len = seq_lens[b];
        const int64_t lo = window > 0 && len > window ? len - window : 0; /* the row's first key */
        /* the blocks holding [lo, len), cut into num_splits runs of whole blocks */
        const int64_t first = lo / block_size, per = ((len + block_size - 1) / block_size - first + num_splits - 1) / num_splits;
        const int64_t run_start = (first + split * per) * block_size, run_end = run_start + per * block_size;
        const int64_t start = run_start > lo ? run_start : lo, end = run_end < len ? run_end : len;
        float m[MAX_HEADS], l[MAX_HEADS], acc[MAX_HEADS * MAX_HEAD_DIM];
        const float *qb = q + b * heads * head_dim;
        const int32_t *table = block_tables + b * table_stride;
#define ATTEND(kind, capped) attend(qb, k_cache, v_cache, table, start, end, num_kv_heads, group, head_dim, \
                                        block_size, scale, m, l, acc, kind, capped, softcap, split ? NULL : sinks)
#define ATTEND_KINDS(capped) switch (cache_kind) { \
        case KIND_BF16: ATTEND(KIND_BF16, capped); break;    \
        case KIND_E4M3: ATTEND(KIND_E4M3, capped); break;    \
        case KIND_E5M2: ATTEND(KIND_E5M2, capped); break;    \
        default: ATTEND(KIND_F32, capped);                   \
        }
        /* calls with constant kinds and cap flags: one specialised copy of attend each */
        if (softcap > 0.f) {
            ATTEND_KINDS(1)
        } else {
            ATTEND_KINDS(0)
        }
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
