/* One decoding step's attention for the transformers engine's own loop (decode.py, `_step_attention`), fused.
 *
 * Per row r (sample r % n of prompt p = r / n) and key/value head h, for each of the head's `group` queries:
 * scores over the prompt's keys (held once for its n samples, with the prompt's padding bias) and over the row's
 * own first `span` generated keys, scaled; one softmax over both in float32; the weighted sum of the values, in
 * float32, rounded once to the output's dtype. Eager PyTorch runs this as ~10 small batched products and
 * element-wise passes per layer and step, each a dispatch over tiny matrices; here it is one pass that reads each
 * key and value row once for the head's whole group.
 *
 * Layouts (all contiguous): q, out [rows, kv, group, d]; prefix_keys, prefix_values [prompts, kv, width, d];
 * prefix_bias [prompts, width] (float32: 0 visible, -inf padding); keys, values [rows, kv, cap, d].
 * dtype 0: float32 tensors; 1: bfloat16 (stored as uint16_t; widened on load, rounded to nearest even on store).
 * d must be a multiple of 8 (the vectors' width). The (row, head) pairs are split over up to `threads` POSIX threads
 * (fewer when the call is small).
 *
 * Written with GCC/Clang vector extensions (8 floats): the compiler maps them to AVX2 or AVX-512 registers, or
 * to pairs of SSE registers, for the CPU it compiles on (-march=native).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX__
#include <immintrin.h>
#endif

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint16_t v16h __attribute__((vector_size(32)));

#define INLINE static inline __attribute__((always_inline))
#define MAX_LANES 32 /* head sizes up to 256 */

typedef struct {
    const void *q, *prefix_keys, *prefix_values, *keys, *values;
    const float *prefix_bias;
    void *out;
    long n, kv, group, d, width, cap, span;
    float scale;
    int dtype;
    long begin, end; /* the (row, head) pairs of this job: [begin, end) */
    int failed;
} Job;

INLINE v8f splat(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

/* Lane by lane: where `mask` (all ones or all zeros per lane, as comparisons give) a, else b. */
INLINE v8f pick(v8i mask, v8f a, v8f b) { return (v8f)(((v8i)a & mask) | ((v8i)b & ~mask)); }

/* Eight consecutive values of a float32 (dtype 0) or bfloat16 (dtype 1) tensor, as float32. */
INLINE v8f load8(const void *base, int dtype, long index) {
    v8f out;
    if (dtype == 0) {
        memcpy(&out, (const float *)base + index, sizeof out);
    } else {
        v8h half;
        memcpy(&half, (const uint16_t *)base + index, sizeof half);
        v8u wide = __builtin_convertvector(half, v8u) << 16;
        memcpy(&out, &wide, sizeof out);
    }
    return out;
}

INLINE float hsum(v8f x) {
    return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

INLINE uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* exp(x) for x <= 88.3 (the caller clamps larger x), eight at a time: x = n ln2 + r with |r| <= ln2 / 2, exp(r)
 * by its degree-7 Taylor polynomial (measured relative error < 7.2e-8 over [-87, 0]: 1.2 float32 roundings),
 * times 2^n built in the exponent bits (n <= 127); below -87.3 (and for -inf) exactly 0. Rounding to the nearest integer adds and
 * subtracts 1.5 * 2^23 (exact in float32 for |x| < 2^22, under the default rounding mode). */
INLINE v8f exp8(v8f x) {
    const v8i under = x < splat(-87.3f);
    const v8f clamped = pick(under, splat(-87.3f), x);
    const v8f n = (clamped * splat(1.44269504088896341f) + splat(12582912.0f)) - splat(12582912.0f);
    const v8f r = (clamped - n * splat(0.693145751953125f)) - n * splat(1.428606765330187e-06f);
    v8f p = splat(1.0f / 5040.0f);
    p = p * r + splat(1.0f / 720.0f);
    p = p * r + splat(1.0f / 120.0f);
    p = p * r + splat(1.0f / 24.0f);
    p = p * r + splat(1.0f / 6.0f);
    p = p * r + splat(0.5f);
    p = p * r + splat(1.0f);
    p = p * r + splat(1.0f);
    v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
    v8f scale;
    memcpy(&scale, &bits, sizeof scale);
    return pick(under, splat(0.0f), p * scale);
}

/* Eight float32 values rounded to bfloat16 (to nearest even; NaN stays NaN), as the high halves of 32-bit words. */
INLINE v8u bf16_bits8(v8f x) {
    v8u bits;
    memcpy(&bits, &x, sizeof bits);
    const v8u rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    const v8i nan = x != x;
    return (v8u)pick(nan, (v8f)(bits | 0x00400000u), (v8f)rounded);
}

INLINE void store8(void *base, int dtype, long index, v8f value) {
    if (dtype == 0) {
        memcpy((float *)base + index, &value, sizeof value);
    } else {
        const v8h half = __builtin_convertvector(bf16_bits8(value) >> 16, v8h);
        memcpy((uint16_t *)base + index, &half, sizeof half);
    }
}

/* The eight sums of x[0..7] (one vector per key) in one vector: three rounds of pairwise shuffles and adds. */
INLINE v8f hsum8(const v8f *x) {
    v8f pairs[4], quads[2];
    for (int i = 0; i < 4; ++i)
        pairs[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
                   __builtin_shufflevector(x[2 * i], x[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int i = 0; i < 2; ++i)
        quads[i] = __builtin_shufflevector(pairs[2 * i], pairs[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
                   __builtin_shufflevector(pairs[2 * i], pairs[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(quads[0], quads[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(quads[0], quads[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* scores[j] = (query . key j) * scale (+ bias[j]) for the `count` keys from row `first` of `keys`; the query is
 * `lanes` vectors (a local copy: in registers when `lanes` is a constant). */
INLINE void scores_of(const void *keys, long first, long count, const v8f *query, const long lanes, const long d,
                      int dtype, float scale, const float *bias, float *scores) {
    v8f q[MAX_LANES];
    for (long c = 0; c < lanes; ++c) q[c] = query[c];
    long j = 0;
    for (; j + 8 <= count; j += 8) {
        v8f sums[8];
        const long start = (first + j) * d;
        for (int k = 0; k < 8; ++k) sums[k] = q[0] * load8(keys, dtype, start + k * d);
        for (long c = 1; c < lanes; ++c)  /* the eight keys' sums are independent chains */
            for (int k = 0; k < 8; ++k) sums[k] += q[c] * load8(keys, dtype, start + k * d + c * 8);
        v8f block = hsum8(sums) * splat(scale);
        if (bias) block += load8(bias, 0, j);
        memcpy(scores + j, &block, sizeof block);
    }
    for (; j < count; ++j) {
        const long start = (first + j) * d;
        v8f sum = q[0] * load8(keys, dtype, start);
        for (long c = 1; c < lanes; ++c) sum += q[c] * load8(keys, dtype, start + c * 8);
        scores[j] = hsum(sum) * scale + (bias ? bias[j] : 0.0f);
    }
}

/* The softmax of scores[0..total) in place, in float32; the slots up to `total` rounded up to 8 are scratch. */
INLINE void softmax(float *s, long total) {
    const long blocks = (total + 7) / 8;
    for (long j = total; j < blocks * 8; ++j) s[j] = -INFINITY; /* the last block's tail: exp gives 0 */
    v8f top = splat(-INFINITY), block;
    for (long b = 0; b < blocks; ++b) {
        memcpy(&block, s + b * 8, sizeof block);
        top = pick(block > top, block, top);
    }
    const v8f peak = splat(fmaxf(fmaxf(fmaxf(top[0], top[1]), fmaxf(top[2], top[3])),
                                 fmaxf(fmaxf(top[4], top[5]), fmaxf(top[6], top[7]))));
    v8f sum = splat(0.0f);
    for (long b = 0; b < blocks; ++b) {
        memcpy(&block, s + b * 8, sizeof block);
        block = exp8(block - peak);
        sum += block;
        memcpy(s + b * 8, &block, sizeof block);
    }
    const v8f inv = splat(1.0f / hsum(sum));
    for (long b = 0; b < blocks; ++b) {
        memcpy(&block, s + b * 8, sizeof block);
        block *= inv;
        memcpy(s + b * 8, &block, sizeof block);
    }
}

/* acc += sum over j of weights[j] * value row (first + j), the sums in registers when `lanes` is a constant; weights
 * of exactly 0 (the prompt's padding) are skipped. */
INLINE void weigh(const void *values, long first, long count, const float *weights, const long lanes, const long d,
                  int dtype, v8f *acc) {
    v8f a[MAX_LANES];
    for (long c = 0; c < lanes; ++c) a[c] = acc[c];
    for (long j = 0; j < count; ++j) {
        const float w = weights[j];
        if (w == 0.0f) continue;
        const long start = (first + j) * d;
        for (long c = 0; c < lanes; ++c) a[c] += splat(w) * load8(values, dtype, start + c * 8);
    }
    for (long c = 0; c < lanes; ++c) acc[c] = a[c];
}

/* One (row, key/value head) pair. `d` (a multiple of 8) is a constant where the caller dispatches on common head
 * sizes: the loops over a row's vectors then unroll, with the query and the sums in registers. `scores` holds
 * stride floats, stride >= width + span rounded up to 8; `vectors` holds 2 x d / 8. */
INLINE void attend(const Job *job, long pair, const long d, float *scores, v8f *vectors) {
    const long group = job->group, width = job->width, span = job->span, lanes = d / 8;
    const long r = pair / job->kv, h = pair % job->kv, p = r / job->n;
    const int dtype = job->dtype;
    const float *bias = job->prefix_bias + p * width;
    const long prompt_rows = (p * job->kv + h) * width, own_rows = (r * job->kv + h) * job->cap;
    v8f *query = vectors, *acc = vectors + lanes;
    for (long g = 0; g < group; ++g) {
        const long first = (pair * group + g) * d;
        for (long c = 0; c < lanes; ++c) query[c] = load8(job->q, dtype, first + c * 8);
        /* The prompt's keys, then the row's own, in blocks of eight keys (one vector of eight scores). */
        scores_of(job->prefix_keys, prompt_rows, width, query, lanes, d, dtype, job->scale, bias, scores);
        scores_of(job->keys, own_rows, span, query, lanes, d, dtype, job->scale, NULL, scores + width);
        softmax(scores, width + span);
        for (long c = 0; c < lanes; ++c) acc[c] = splat(0.0f);
        weigh(job->prefix_values, prompt_rows, width, scores, lanes, d, dtype, acc);
        weigh(job->values, own_rows, span, scores + width, lanes, d, dtype, acc);
        for (long c = 0; c < lanes; ++c) store8(job->out, dtype, first + c * 8, acc[c]);
    }
}

static void *run(void *arg) {
    Job *job = (Job *)arg;
    const long d = job->d, stride = (job->width + job->span + 7) / 8 * 8;
    v8f *vectors = aligned_alloc(32, sizeof(v8f) * (size_t)(2 * d / 8));
    float *scores = aligned_alloc(32, sizeof(float) * (size_t)stride);
    if (!vectors || !scores) {
        job->failed = 1;
    } else {
        for (long pair = job->begin; pair < job->end; ++pair) {
            if (d == 64)
                attend(job, pair, 64, scores, vectors);
            else if (d == 128)
                attend(job, pair, 128, scores, vectors);
            else if (d == 32)
                attend(job, pair, 32, scores, vectors);
            else
                attend(job, pair, d, scores, vectors);
        }
    }
    free(vectors), free(scores);
    return NULL;
}

/* Runs work(job) for `count` jobs laid out `size` bytes apart: the first on the calling thread, the others on POSIX
 * threads of their own (a job whose thread could not be started runs on the calling thread after the first). */
static void run_jobs(void *jobs, size_t size, int count, void *(*work)(void *)) {
    pthread_t ids[count];
    int started[count];
    for (int t = 1; t < count; ++t) started[t] = pthread_create(&ids[t], NULL, work, (char *)jobs + t * size) == 0;
    work(jobs);
    for (int t = 1; t < count; ++t) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else
            work((char *)jobs + t * size);
    }
}

/* Returns 0 on success, 1 when scratch memory could not be had, 2 for a head size that is not a multiple of 8 up
 * to 256. */
int decode_attention(const void *q, const void *prefix_keys, const void *prefix_values, const float *prefix_bias,
                     const void *keys, const void *values, void *out, long rows, long n, long kv, long group, long d,
                     long width, long cap, long span, float scale, int dtype, int threads) {
    if (d % 8 || d > 8 * MAX_LANES) return 2;
    const long pairs = rows * kv;
    /* A thread is started per call: each gets at least ~2^18 multiply-adds (tens of microseconds), so that its
     * start (~15 us) stays small against its share. */
    const long most = pairs * group * (width + span) * d / (1L << 18);
    if (threads > most) threads = (int)most;
    if (threads < 1) threads = 1;
    Job jobs[threads];
    for (int t = 0; t < threads; ++t)
        jobs[t] = (Job){q, prefix_keys, prefix_values, keys, values, prefix_bias, out, n, kv, group, d, width, cap,
                        span, scale, dtype, pairs * t / threads, pairs * (t + 1) / threads, 0};
    run_jobs(jobs, sizeof jobs[0], threads, run);
    int failed = 0;
    for (int t = 0; t < threads; ++t) failed |= jobs[t].failed;
    return failed;
}

/* ---- The element-wise steps around the decoding loop's projections (decode.py, `_forward`) ---- */

/* exp(x) for any x: +inf above 88.3 (as float32's own exp overflows just above 88.72). */
INLINE v8f exp_any(v8f x) {
    const v8i over = x > splat(88.3f);
    return pick(over, splat(INFINITY), exp8(pick(over, splat(0.0f), x)));
}

INLINE float load1(const void *base, int dtype, long index) {
    if (dtype == 0) return ((const float *)base)[index];
    uint32_t bits = (uint32_t)((const uint16_t *)base)[index] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

INLINE void store1(void *base, int dtype, long index, float value) {
    if (dtype == 0)
        ((float *)base)[index] = value;
    else
        ((uint16_t *)base)[index] = f32_to_bf16(value);
}

/* x rounded to the tensor's dtype and widened back (bfloat16 rounds to nearest even; float32 is itself). */
INLINE float round1(float x, int dtype) {
    if (dtype == 0) return x;
    uint32_t bits = (uint32_t)f32_to_bf16(x) << 16;
    memcpy(&x, &bits, sizeof x);
    return x;
}

INLINE v8f round8(v8f x, int dtype) {
    if (dtype == 0) return x;
    const v8u bits = bf16_bits8(x);
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* Llama-family RMS norm, row by row, as transformers computes it: h = float32(x), h * rsqrt(mean(h^2) + eps)
 * rounded to x's dtype, times the weight (same dtype), rounded. x, out [rows, width]; weight [width]. */
void rms_norm(const void *x, const void *weight, void *out, long rows, long width, float eps, int dtype) {
    const long body = width / 8 * 8;
    for (long r = 0; r < rows; ++r) {
        const long first = r * width;
        v8f squares = splat(0.0f);
        for (long i = 0; i < body; i += 8) {
            const v8f h = load8(x, dtype, first + i);
            squares += h * h;
        }
        float sum = hsum(squares);
        for (long i = body; i < width; ++i) sum += load1(x, dtype, first + i) * load1(x, dtype, first + i);
        const float inv = 1.0f / sqrtf(sum / (float)width + eps);
        for (long i = 0; i < body; i += 8)
            store8(out, dtype, first + i,
                   load8(weight, dtype, i) * round8(load8(x, dtype, first + i) * splat(inv), dtype));
        for (long i = body; i < width; ++i)
            store1(out, dtype, first + i, load1(weight, dtype, i) * round1(load1(x, dtype, first + i) * inv, dtype));
    }
}

/* SiLU-gated product of a fused gate/up projection's output, as transformers computes it: gate = in[r, :inter],
 * up = in[r, inter:]; out[r, i] = round(silu(gate)) * up, rounded (silu(g) = g / (1 + exp(-g)) in float32).
 * in [rows, 2 * inter]; out [rows, inter]. */
void silu_mul(const void *in, void *out, long rows, long inter, int dtype) {
    const long body = inter / 8 * 8;
    for (long r = 0; r < rows; ++r) {
        const long gate = r * 2 * inter, up = gate + inter, dst = r * inter;
        for (long i = 0; i < body; i += 8) {
            const v8f g = load8(in, dtype, gate + i);
            const v8f s = round8(g / (splat(1.0f) + exp_any(-g)), dtype);
            store8(out, dtype, dst + i, s * load8(in, dtype, up + i));
        }
        for (long i = body; i < inter; ++i) {
            const float g = load1(in, dtype, gate + i);
            store1(out, dtype, dst + i, round1(g / (1.0f + expf(-g)), dtype) * load1(in, dtype, up + i));
        }
    }
}

/* ---- A whole decoding step's attention from the fused query/key/value projection (decode.py, `_forward`) ---- */

/* What stays the same for a layer over a sampling call (set once by native.py's DecodeStep): the caches, the
 * scratch rows of the rotated queries, the output rows, the shapes. Layouts as in decode_attention, with query and
 * out [rows, kv * group * d]. */
typedef struct {
    void *query, *out, *keys, *values;
    const void *prefix_keys, *prefix_values;
    const float *prefix_bias;
    long rows, n, kv, group, d, width, cap;
    float scale;
    int dtype, threads;
} StepPlan;

/* transformers' rotary embedding, x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1), of `heads`
 * vectors of d values from src + a into dst + b (element offsets); cos, sin: d values from index c. In bfloat16
 * each product and the sum are rounded, as the eager ops round them. d is a multiple of 16. */
INLINE void rotate(const void *src, long a, void *dst, long b, const void *cos, const void *sin, long c, long heads,
                   long d, int dtype) {
    const long half = d / 2;
    for (long j = 0; j < heads; ++j, a += d, b += d) {
        for (long i = 0; i < half; i += 8) {
            const v8f x1 = load8(src, dtype, a + i), x2 = load8(src, dtype, a + half + i);
            const v8f lo = round8(x1 * load8(cos, dtype, c + i), dtype) - round8(x2 * load8(sin, dtype, c + i), dtype);
            const v8f hi =
                round8(x2 * load8(cos, dtype, c + half + i), dtype) + round8(x1 * load8(sin, dtype, c + half + i), dtype);
            store8(dst, dtype, b + i, lo);
            store8(dst, dtype, b + half + i, hi);
        }
    }
}

/* Decoding step `step` of one layer: `qkv` [rows, (kv * group + 2 * kv) * d] is the fused projection's output
 * (queries, then keys, then values, by head); cos, sin [rows, d] the rotary embedding at each row's position. The
 * queries are rotated into plan->query, the keys rotated and the values copied into generated slot `step` of the
 * caches, and the attention over the prompt's keys and slots 0..step goes to plan->out. Returns as
 * decode_attention, or 2 for a head size that is not a multiple of 16. */
int decode_step(const StepPlan *plan, const void *qkv, const void *cos, const void *sin, long step) {
    const long d = plan->d, kv = plan->kv, heads = kv * plan->group, stride = (heads + 2 * kv) * d;
    const int dtype = plan->dtype;
    const size_t size = dtype == 0 ? sizeof(float) : sizeof(uint16_t);
    if (d % 16 || d > 8 * MAX_LANES) return 2;
    for (long r = 0; r < plan->rows; ++r) {
        const long row = r * stride;
        rotate(qkv, row, plan->query, r * heads * d, cos, sin, r * d, heads, d, dtype);
        for (long h = 0; h < kv; ++h) {
            const long slot = ((r * kv + h) * plan->cap + step) * d;
            rotate(qkv, row + (heads + h) * d, plan->keys, slot, cos, sin, r * d, 1, d, dtype);
            memcpy((char *)plan->values + slot * size, (const char *)qkv + (row + (heads + kv + h) * d) * size,
                   (size_t)d * size);
        }
    }
    return decode_attention(plan->query, plan->prefix_keys, plan->prefix_values, plan->prefix_bias, plan->keys,
                            plan->values, plan->out, plan->rows, plan->n, kv, plan->group, d, plan->width, plan->cap,
                            step + 1, plan->scale, dtype, plan->threads);
}

/* ---- Log-probabilities and entropies of the training forward's tokens (algorithms/functional.py) ---- */

/* z = x / temperature, as the eager ops divide (exactly x at temperature 1). */
INLINE v8f tempered8(const void *x, int dtype, long index, float temperature) {
    const v8f v = load8(x, dtype, index);
    return temperature == 1.0f ? v : v / splat(temperature);
}

INLINE float tempered1(const void *x, int dtype, long index, float temperature) {
    const float v = load1(x, dtype, index);
    return temperature == 1.0f ? v : v / temperature;
}

/* The rows [begin, end) of token_logprobs (forward) or token_logprobs_backward, below. */
typedef struct {
    const void *logits;
    const int64_t *labels;
    const float *lse_in, *mean_in, *g_lp, *g_ent; /* the backward's inputs */
    float *logp, *lse, *entropy, *mean;           /* the forward's outputs */
    void *grad;
    long vocab;
    float temperature;
    int dtype;
    long begin, end, bad; /* rows [begin, end); labels outside [0, vocab) met */
} TokenJob;

static void token_forward_rows(TokenJob *job) {
    const void *logits = job->logits;
    const long vocab = job->vocab, body = vocab / 8 * 8;
    const float temperature = job->temperature;
    const int dtype = job->dtype;
    float *entropy = job->entropy;
    for (long r = job->begin; r < job->end; ++r) {
        const long base = r * vocab;
        v8f top = splat(-INFINITY);
        for (long i = 0; i < body; i += 8) {
            const v8f z = tempered8(logits, dtype, base + i, temperature);
            top = pick(z > top, z, top);
        }
        float peak = -INFINITY;
        for (int k = 0; k < 8; ++k) peak = fmaxf(peak, top[k]);
        for (long i = body; i < vocab; ++i) peak = fmaxf(peak, tempered1(logits, dtype, base + i, temperature));
        if (!isfinite(peak)) peak = 0.0f;
        /* Sums of 64 entries in float32 lanes, added up in double: a float32 running sum over thousands of
         * entries would drift by ~1e-6 relative. */
        double total = 0.0, moment = 0.0;
        for (long start = 0; start < body; start += 64) {
            v8f sums = splat(0.0f), weighted = splat(0.0f);
            for (long i = start; i < body && i < start + 64; i += 8) {
                const v8f z = tempered8(logits, dtype, base + i, temperature);
                const v8f e = exp8(z - splat(peak));
                sums += e;
                if (entropy) weighted += e * (z - splat(peak));
            }
            total += hsum(sums);
            moment += hsum(weighted);
        }
        for (long i = body; i < vocab; ++i) {
            const float z = tempered1(logits, dtype, base + i, temperature), e = expf(z - peak);
            total += e;
            moment += e * (z - peak);
        }
        const float l = (float)(log(total) + peak);
        job->lse[r] = l;
        const int64_t label = job->labels[r];
        if (label < 0 || label >= vocab) {
            ++job->bad;
            job->logp[r] = NAN;
        } else {
            job->logp[r] = tempered1(logits, dtype, base + label, temperature) - l;
        }
        if (entropy) { /* relative to the peak: no cancellation between two large numbers */
            job->mean[r] = (float)(peak + moment / total);
            entropy[r] = (float)(log(total) - moment / total);
        }
    }
}

static void token_backward_rows(TokenJob *job) {
    const void *logits = job->logits;
    void *grad = job->grad;
    const float *g_ent = job->g_ent;
    const long vocab = job->vocab, body = vocab / 8 * 8;
    const float temperature = job->temperature;
    const int dtype = job->dtype;
    for (long r = job->begin; r < job->end; ++r) {
        const long base = r * vocab;
        const int64_t label = job->labels[r];
        if (label < 0 || label >= vocab) { /* nothing written through it; the caller raises */
            ++job->bad;
            continue;
        }
        const float l = job->lse_in[r], glp = job->g_lp[r];
        const float gent = g_ent ? g_ent[r] : 0.0f, m = g_ent ? job->mean_in[r] : 0.0f;
        for (long i = 0; i < body; i += 8) {
            const v8f z = tempered8(logits, dtype, base + i, temperature);
            const v8f p = exp8(z - splat(l));
            v8f w = g_ent ? p * -((z - splat(m)) * splat(gent) + splat(glp)) : p * splat(-glp);
            if (temperature != 1.0f) w = w / splat(temperature);
            store8(grad, dtype, base + i, w);
        }
        for (long i = body; i < vocab; ++i) {
            const float z = tempered1(logits, dtype, base + i, temperature), p = expf(z - l);
            float w = g_ent ? p * -((z - m) * gent + glp) : p * -glp;
            if (temperature != 1.0f) w = w / temperature;
            store1(grad, dtype, base + i, w);
        }
        /* the label's entry: the one-hot term added before the division */
        const float z = tempered1(logits, dtype, base + label, temperature), p = expf(z - l);
        float w = (g_ent ? p * -((z - m) * gent + glp) : p * -glp) + glp;
        if (temperature != 1.0f) w = w / temperature;
        store1(grad, dtype, base + label, w);
    }
}

static void *token_forward_job(void *arg) {
    token_forward_rows((TokenJob *)arg);
    return NULL;
}

static void *token_backward_job(void *arg) {
    token_backward_rows((TokenJob *)arg);
    return NULL;
}

/* Runs `job`'s rows split over up to `threads` POSIX threads (each at least 64 rows); returns the labels outside
 * [0, vocab) met. */
static long token_rows(TokenJob job, long rows, int threads, void *(*work)(void *)) {
    if (threads > rows / 64) threads = (int)(rows / 64);
    if (threads < 1) threads = 1;
    TokenJob jobs[threads];
    for (int t = 0; t < threads; ++t) {
        jobs[t] = job;
        jobs[t].begin = rows * t / threads, jobs[t].end = rows * (t + 1) / threads, jobs[t].bad = 0;
    }
    run_jobs(jobs, sizeof jobs[0], threads, work);
    long bad = 0;
    for (int t = 0; t < threads; ++t) bad += jobs[t].bad;
    return bad;
}

/* Per row r of logits [rows, vocab] (float32 or bfloat16): with z = logits / temperature, lse[r] = logsumexp(z),
 * logp[r] = z[labels[r]] - lse[r] and, where entropy is not NULL, mean[r] = E_p[z] and entropy[r] = lse[r] - mean[r]
 * (p = softmax(z); both taken relative to max z, which keeps the entropy's absolute error at float32 rounding of
 * log-sum, not of max z), all in float32. A row of -inf gives lse -inf (as the eager ops). Returns the number of
 * labels outside [0, vocab) (nothing is read through them). Rows split over up to `threads` threads. */
long token_logprobs(const void *logits, const int64_t *labels, long rows, long vocab, float temperature, int dtype,
                    float *logp, float *lse, float *entropy, float *mean, int threads) {
    const TokenJob job = {.logits = logits, .labels = labels, .logp = logp, .lse = lse, .entropy = entropy,
                          .mean = mean, .vocab = vocab, .temperature = temperature, .dtype = dtype};
    return token_rows(job, rows, threads, token_forward_job);
}

/* The gradient of sum(g_lp * logp + g_ent * entropy) with respect to the logits, into grad [rows, vocab] (the
 * logits' dtype, rounded once): (onehot(label) * g_lp - p * (g_lp + g_ent * (z - mean))) / temperature, with
 * p = exp(z - lse). g_ent and mean may be NULL (no entropy term). Returns the number of labels outside [0, vocab)
 * (their rows are not written). Rows split over up to `threads` threads. */
long token_logprobs_backward(const void *logits, const int64_t *labels, const float *lse, const float *mean,
                             const float *g_lp, const float *g_ent, long rows, long vocab, float temperature,
                             int dtype, void *grad, int threads) {
    const TokenJob job = {.logits = logits, .labels = labels, .lse_in = lse, .mean_in = mean, .g_lp = g_lp,
                          .g_ent = g_ent, .grad = grad, .vocab = vocab, .temperature = temperature, .dtype = dtype};
    return token_rows(job, rows, threads, token_backward_job);
}

/* ---- float32 -> bfloat16 casts of many tensors (a weight hand-off into a bfloat16 engine's store) ---- */

/* Sixteen float32 values rounded to bfloat16 (to nearest even; NaN stays NaN), as one 32-byte vector. */
INLINE v16h bf16_16(const float *src) {
    v8f lo, hi;
    memcpy(&lo, src, sizeof lo);
    memcpy(&hi, src + 8, sizeof hi);
    const v8h a = __builtin_convertvector(bf16_bits8(lo) >> 16, v8h);
    const v8h b = __builtin_convertvector(bf16_bits8(hi) >> 16, v8h);
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

/* dst[i] = bfloat16(src[i]) for i < size (the streaming stores of cast_bf16, without its fence). */
static void cast_bf16_run(const float *from, uint16_t *to, long size) {
    long i = 0;
    for (; i < size && ((uintptr_t)(to + i) & 31u); ++i) to[i] = f32_to_bf16(from[i]);
    for (; i + 16 <= size; i += 16) {
        const v16h out = bf16_16(from + i);
#ifdef __AVX__
        _mm256_stream_si256((__m256i *)(to + i), (__m256i)out);
#else
        memcpy(to + i, &out, sizeof out);
#endif
    }
    for (; i < size; ++i) to[i] = f32_to_bf16(from[i]);
}

/* dst[k][i] = bfloat16(src[k][i]) for i < n[k], k < count. The stores bypass the caches where the CPU has AVX
 * (streaming stores of 32 aligned bytes): the destination is read later by another process, and a cached store would
 * first read each line it writes (a third more memory traffic for this cast). */
void cast_bf16(const float *const *src, uint16_t *const *dst, const long *n, long count) {
    for (long k = 0; k < count; ++k) cast_bf16_run(src[k], dst[k], n[k]);
#ifdef __AVX__
    _mm_sfence(); /* the streaming stores are visible before whatever the caller does next (a barrier) */
#endif
}
