/* Float32 CPU kernels (AVX2 and FMA) for the engine's few-row steps; serving/kernels.py builds and calls them.
 *
 * gemm_panels: y[m, n] = x[m, k] @ W[k, n] (+ bias). W is stored as panels of NR columns, [ceil(n / NR)][k][NR], so each thread streams whole panels once and
 * reuses one from its L2 cache for every further group of MR rows. Each output is a single running sum over k in
 * order, whatever m is: a row's result does not depend on the other rows of the batch, so a verify step
 * computes bit for bit what decode steps would. gemm_panels_bf16 reads W as bfloat16 (half the bytes a drafter,
 * or the target with EngineConfig.weights = bfloat16, streams) and computes in float32 all the same; gemm_panels_i8
 * reads a drafter's W as int8 with a float32 scale per column (a quarter of the bytes); gemm_pairs_bf16
 * rounds x to bfloat16 too and multiplies on AVX512-BF16's dot products (EngineConfig.dtype = bfloat16). layer_pre and
 * layer_post run a whole decoder layer around its attention on these kernels. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

/* The calls that take many arguments take one struct, declared here and, field for field, as a ctypes Structure in
 * serving/kernel_abi.py (kernel_layouts below lets tests/serving/test_kernels.py check that the two agree). A field
 * added here goes there too, and into kernel_layouts. */

/* A decoder layer's weights (heads/layer.py), as serving/kernels.py's KernelLayer reads them once. */
typedef struct {
    const float *input_norm, *post_norm, *q_norm, *k_norm;  /* q_norm, k_norm: NULL where the model has none */
    const void *qkv, *o, *gate_up, *down;  /* panels in `format` */
    const float *qkv_bias;  /* NULL where the model has none */
    long format;  /* the panels' format and product path: F32_PANELS, BF16_PANELS, I8_PANELS or a pair path */
    long streams;  /* 1: read from memory at every step (the target's layers), 0: kept in cache (a head's) */
    long hidden, heads, kv_heads, dim, intermediate;
    long input_size;  /* the attention's input width: hidden, or a draft head's wider input (EAGLE-3's 2 hidden) */
    float eps;
} layer_weights;

/* One sequence of a paged_attention batch. */
typedef struct {
    long first_row;   /* its first row in q and out */
    long query_rows;  /* its causal query rows: query row i sees keys 0 .. context - query_rows + i */
    long context;     /* its keys in table order after this step */
    long tree_rows;   /* its draft-tree rows after the query rows: each sees the context, then its path */
    long first_path;  /* its first tree row's index in paths */
} sequence;

/* The attention metadata of a step's short sequences (serving/attention.py's ShortQueries builds it once per step,
 * every layer reads it). */
typedef struct {
    const long *new_slots;  /* [num_new] the pool slot each of the step's new keys and values goes to */
    long num_new;           /* 0: paged_attention writes none (they were written before) */
    const sequence *seqs;   /* [num_seqs] */
    long num_seqs;
    const long *slots;      /* [num_seqs][slot_stride] each context's key slots in position order, then padding */
    long slot_stride;
    const long *paths;      /* [tree rows][path_stride] = (path length, the path's slots in position order, padding) */
    long path_stride;
} attention_batch;

/* paged_attention's arguments: one layer's attention of a batch. */
typedef struct {
    const float *q;  /* [tokens, heads, dim], q_stride floats from token to token */
    long q_stride;
    float *out;  /* [tokens, heads, dim] */
    float *k_pool, *v_pool;  /* [slots, kv_heads, dim] */
    const float *k_new, *v_new;  /* the batch's new keys and values, k_stride / v_stride floats from token to token */
    long k_stride, v_stride;
    long heads, kv_heads, dim;  /* dim: a multiple of 8 */
    float scale;
    long window;  /* keys a row sees back from itself, itself included (a sliding-window layer); 0: every key */
    const float *sinks;  /* [heads] logits beside each head's scores that take softmax mass and add no value; or NULL */
    const attention_batch *batch;
} attention_args;

/* layer_pre's and layer_post's arguments: one layer on `rows` rows. */
typedef struct {
    const layer_weights *weights;
    long rows;
    const float *h;        /* [rows, hidden] the layer's input */
    float *normed, *qkv;   /* layer_pre's outputs: [rows, hidden], [rows, (heads + 2 kv_heads) dim] */
    const float *cos, *sin;  /* [rows, dim] each row's rope */
    const float *attn;     /* [rows, heads dim] the attention's output, layer_post's input */
    float *out;            /* [rows, hidden] the layer's output; may be h */
    float *gate_up, *act;  /* layer_post's scratch: [rows, 2 intermediate], [rows, intermediate] */
    const float *x;        /* [rows, input_size] the attention's input where the caller builds it (EAGLE-3's two
                            * normed streams side by side); NULL: input_norm(h), or h where input_norm is NULL */
} layer_step;

/* Every layer's K/V of a step whose sequences all attend through paged_attention. */
typedef struct {
    float *k_pool, *v_pool;  /* layer 0's pools; layer l's begin l * layer_floats floats on */
    long layer_floats;
    const attention_batch *batch;
} paged_kv;

/* model_forward's buffers for intermediate results, shared by every layer (serving/kernels.py's Scratch). */
typedef struct {
    float *h, *normed, *qkv, *attn, *gate_up, *act, *cos, *sin, *selected;
} forward_scratch;

/* model_forward's arguments: the model (fixed once it is loaded), then the step. */
typedef struct {
    const layer_weights *layers;
    long num_layers;
    const float *embed;  /* [vocab, hidden] */
    long vocab;
    const float *cos_table, *sin_table;  /* [max_positions, dim] */
    long max_positions;
    const float *norm;  /* the final norm's weight */
    float eps;
    const void *lm_head;  /* panels in `lm_format` */
    long lm_format;  /* their format, as layer_weights.format */
    float scale;  /* of the attention's scores */
    const long *ids, *positions;  /* [rows] */
    long rows;
    const long *aux_layers;  /* [num_aux], sorted: the layers whose input states are copied into aux */
    long num_aux;
    const long *logits_rows;  /* [num_logits] the rows that need logits; NULL: rows 0 .. num_logits - 1 */
    long num_logits;
    float *aux;  /* [num_aux][rows][hidden] */
    float *hidden_out;  /* [rows, hidden] after the final norm, or NULL */
    float *logits;  /* [num_logits, vocab] */
    long *best;  /* [num_logits] each logits row's argmax */
    paged_kv kv;
    forward_scratch scratch;
} forward_args;

/* eagle3_forward's arguments: an EAGLE-3 head (heads/eagle3.py) and a draft step's rows. */
typedef struct {
    const layer_weights *layer;  /* its one layer, input_size 2 hidden, no input norm */
    const float *embed;  /* [vocab, hidden] the embedding it reads (its own or the target's) */
    long vocab;
    const float *input_norm, *hidden_norm, *norm;  /* the norms of the embedding, of g, and the final one */
    long norm_before_residual, norm_output;  /* Eagle3Config's flags */
    const float *cos_table, *sin_table;  /* [max_positions, dim] */
    long max_positions;
    float scale;  /* of the attention's scores */
    long window;  /* the head's draft_window; 0: every key */
    paged_kv kv;  /* its pool (one layer) and the step's batch */
    const long *ids, *positions;  /* [rows] */
    long rows;
    const float *g;  /* [rows, hidden] the fused target features, or the previous draft's output */
    float *x;  /* scratch [rows, 2 hidden]: the attention's input */
    forward_scratch scratch;  /* h, normed, qkv, attn, gate_up, act, cos, sin ([rows, ...]); selected unused */
    float *out;  /* [rows, hidden] */
} eagle3_args;

/* The weights' formats (layer_weights.format): panels of float32, bfloat16 or int8 under float32 activations, and
 * bfloat16 pair panels under bfloat16 activations on each product path (gemm_pairs). An int8 panel's columns each
 * have a float32 scale, stored after the last panel: an output is its column's scale times the in-order sum of
 * the int8 weights times x. */
enum { F32_PANELS = 0, BF16_PANELS = 1, BF16_DOT = 2, BF16_WIDENED = 3, BF16_AMX = 4, I8_PANELS = 5 };
#define NR 16
/* MR rows x 2 accumulators per tile, each panel streamed once for every MR rows: 6 with AVX2's 16 vector registers;
 * 12 where AVX-512 gives 32 (still 8-lane vectors, so every output's sum runs as it does with 6: the same results),
 * so that a verify step of a tree of up to 11 nodes streams each panel once. */
#ifdef __AVX512VL__
#define MR 12
#else
#define MR 6
#endif
#define NV (NR / 8)
/* Steps of a few rows (a decode step, a chain's verify step, what prompt lookup drafts) stream a group of panels at a
 * time over each thread's share (row_group), as a decode step does; more rows run as tiles, which stream one panel
 * at a time over a static split. few_group[streams][panel_kind][rows]: the panels in a row group, 0 where tiles are
 * faster. Weights read from memory at every step (the target's) bound a few rows' products by memory's rate, not by
 * their multiply-adds, so several streams with work stealing beat a tile's one stream even where AVX2's 16 registers
 * spill some of the sums (3 rows x 4 panels x 2, 5 x 2 x 2). Weights that stay in cache between uses (a draft head's
 * layers) make the same products arithmetic-bound, where spilled sums cost and the tiles' register-held sums win;
 * bfloat16 panels, widened before each multiply-add, get there from 3-4 rows either way (docs/benchmarks/engine.md,
 * verify steps by rows). AVX-512's 32 registers hold 3 rows x 4 panels; its table is the one measured on a Zen 4. */
#define FEW_ROWS 5
#ifdef __AVX512VL__
static const int few_group[2][3][FEW_ROWS + 1] = {
    {{0, 4, 4, 4, 0, 0}, {0, 4, 4, 4, 0, 0}, {0, 4, 4, 4, 0, 0}},
    {{0, 4, 4, 4, 0, 0}, {0, 4, 4, 4, 0, 0}, {0, 4, 4, 4, 0, 0}}};
#else
static const int few_group[2][3][FEW_ROWS + 1] = {
    {{0, 4, 4, 2, 0, 0}, {0, 4, 4, 2, 0, 0}, {0, 4, 4, 2, 0, 0}},   /* in cache */
    {{0, 4, 4, 4, 2, 2}, {0, 4, 4, 2, 0, 0}, {0, 4, 4, 2, 0, 0}}};  /* streamed */
#endif
/* few_group's middle index of a panel format: float32, bfloat16, int8 */
static inline int panel_kind(int format) { return format == I8_PANELS ? 2 : format; }
/* bytes of one weight in a panel of this format */
static inline long weight_bytes(int format) { return format == F32_PANELS ? 4 : format == BF16_PANELS ? 2 : 1; }
/* Tiles of more than one row ask for the weights this far ahead. Out-of-order execution alone keeps fewer loads in
 * flight at 5 rows (10 FMAs per 64 bytes) than at 1, and memory then streams ~30% slower; at 1 row it keeps
 * enough. 64 rows of a float32 panel ahead; past a panel's end the next panel, which the same thread reads next.
 * Into L2 (PREFETCH_LOCALITY 2, prefetcht1), not L1 alone: a 12-row tile's rows of x fill L1 and evicted the
 * weights before their use, so 12-row products took compute time plus memory time (1.4x longer). */
#define PREFETCH_BYTES 4096
#define PREFETCH_LOCALITY 2

/* 8 weights from column 8 * j of row p of a panel: float32, bfloat16 widened to float32 (the same bits, shifted),
 * or int8 converted to float32 (exact).
 * A bfloat16 panel row holds its 16 columns as 8 pairs (c, c + 8), a 32-bit word each (to_panels): one load gives
 * columns 0-7 shifted up and 8-15 masked, where widening each half took a load and a shuffle of its own. */
#if NV != 2
#error "bfloat16 panels hold column pairs (c, c + 8): NR must be 16"
#endif
static inline __attribute__((always_inline)) __m256 load_w(const void *w, int format, long p, int j) {
    if (format == I8_PANELS)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const signed char *)w + p * NR + 8 * j))));
    if (format == BF16_PANELS) {
        __m256i pairs = _mm256_loadu_si256((const __m256i *)((const unsigned short *)w + p * NR));
        return _mm256_castsi256_ps(j == 0 ? _mm256_slli_epi32(pairs, 16)
                                          : _mm256_and_si256(pairs, _mm256_set1_epi32((int)0xFFFF0000u)));
    }
    return _mm256_loadu_ps((const float *)w + p * NR + 8 * j);
}

static inline __attribute__((always_inline)) void tile(int mr, const float *x, long ldx, const void *w, int format,
                                                       long k, const float *scale, const float *bias, const float *add,
                                                       float *y, long ldy, int cols) {
    __m256 acc[MR][NV];
    _Pragma("GCC unroll 12") for (int i = 0; i < mr; i++)
        _Pragma("GCC unroll 3") for (int j = 0; j < NV; j++) acc[i][j] = _mm256_setzero_ps();
    const char *ahead = (const char *)w + PREFETCH_BYTES;
    long row_bytes = NR * weight_bytes(format);
    for (long p = 0; p < k; p++) {
        __m256 wv[NV];
        if (mr > 1) __builtin_prefetch(ahead + p * row_bytes, 0, PREFETCH_LOCALITY);
        _Pragma("GCC unroll 3") for (int j = 0; j < NV; j++) wv[j] = load_w(w, format, p, j);
        _Pragma("GCC unroll 12") for (int i = 0; i < mr; i++) {
            __m256 xi = _mm256_broadcast_ss(x + i * ldx + p);
            _Pragma("GCC unroll 3") for (int j = 0; j < NV; j++) acc[i][j] = _mm256_fmadd_ps(xi, wv[j], acc[i][j]);
        }
    }
    _Pragma("GCC unroll 12") for (int i = 0; i < mr; i++) {
        float out[NR];
        _Pragma("GCC unroll 3") for (int j = 0; j < NV; j++) _mm256_storeu_ps(out + 8 * j, acc[i][j]);
        for (int j = 0; j < cols; j++) {
            float v = format == I8_PANELS ? out[j] * scale[j] : out[j];
            v = bias ? v + bias[j] : v;
            y[i * ldy + j] = add ? add[i * ldy + j] + v : v;
        }
    }
}

/* Each row count's tile is a function of its own: inlined together into one parallel loop, the tiles' accumulators
 * got no registers and every multiply-add went through the stack (a 12-row tile ran at 40% of the FMA peak, 85%
 * on its own). */
#define TILE(R)                                                                                                      \
    static __attribute__((noinline)) void tile_##R(const float *x, long ldx, const void *w, int format, long k,    \
                                                   const float *scale, const float *bias, const float *add,        \
                                                   float *y, long ldy, int cols) {                                 \
        if (format == BF16_PANELS) tile(R, x, ldx, w, BF16_PANELS, k, scale, bias, add, y, ldy, cols);             \
        else if (format == I8_PANELS) tile(R, x, ldx, w, I8_PANELS, k, scale, bias, add, y, ldy, cols);            \
        else tile(R, x, ldx, w, F32_PANELS, k, scale, bias, add, y, ldy, cols);                                    \
    }
TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)
#if MR > 6
TILE(7) TILE(8) TILE(9) TILE(10) TILE(11) TILE(12)
#endif
typedef void (*tile_fn)(const float *, long, const void *, int, long, const float *, const float *, const float *,
                        float *, long, int);
static const tile_fn tiles[MR + 1] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6,
#if MR > 6
                                      tile_7, tile_8, tile_9, tile_10, tile_11, tile_12
#endif
};

/* One panel's columns of y for every row, MR rows at a time. */
static void panel(const float *x, long m, long ldx, const void *w, int format, long k, long n, const float *scale,
                  const float *bias, const float *add, float *y, long ldy, long q) {
    const void *wq = (const char *)w + q * k * NR * weight_bytes(format);
    const float *bq = bias ? bias + q * NR : 0, *sq = scale ? scale + q * NR : 0;
    int cols = n - q * NR < NR ? (int)(n - q * NR) : NR;
    const float *aq = add ? add + q * NR : 0;
    float *yq = y + q * NR;
    for (long i = 0; i < m; i += MR) {
        long rows = m - i < MR ? m - i : MR;
        tiles[rows](x + i * ldx, ldx, wq, format, k, sq, bq, aq ? aq + i * ldy : 0, yq + i * ldy, ldy, cols);
    }
}

/* mr rows over panels q .. q + g - 1, g <= ROW_GROUP: 2g running sums a row where a tile has two. A tile's sums
 * are chains of dependent multiply-adds, one every few cycles each; two of them streamed bfloat16 weights at ~60%
 * of memory's rate, eight keep up (float32 gains 6-14%). Each output is still the one in-order sum `tile` computes. */
#define ROW_GROUP 4
/* row_group asks for each of its panels' weights this far ahead, one line at a time: out-of-order execution alone
 * keeps ~2 KB of bfloat16 loads in flight (a 64-byte line is 2 loop iterations of ~20 instructions per panel), and
 * one-row bfloat16 products over the target's matrices streamed 5-7% slower without it (float32: 0-2%). */
#define GROUP_PREFETCH_BYTES 1024
static inline __attribute__((always_inline)) void row_group(int mr, const float *x, long ldx, const void *w,
                                                            int format, int g, long k, long n, const float *scale,
                                                            const float *bias, const float *add, float *y, long ldy,
                                                            long q) {
    long panel_bytes = k * NR * weight_bytes(format);
    const char *wq = (const char *)w + q * panel_bytes;
    __m256 acc[FEW_ROWS][ROW_GROUP * NV];
    _Pragma("GCC unroll 5") for (int r = 0; r < mr; r++)
        _Pragma("GCC unroll 8") for (int j = 0; j < g * NV; j++) acc[r][j] = _mm256_setzero_ps();
    long row_bytes = NR * weight_bytes(format), rows_per_line = 64 / row_bytes;
    for (long p = 0; p < k; p++) {
        if (p % rows_per_line == 0)
            _Pragma("GCC unroll 4") for (int i = 0; i < g; i++)
                __builtin_prefetch(wq + i * panel_bytes + p * row_bytes + GROUP_PREFETCH_BYTES, 0, PREFETCH_LOCALITY);
        __m256 xr[FEW_ROWS];
        _Pragma("GCC unroll 5") for (int r = 0; r < mr; r++) xr[r] = _mm256_broadcast_ss(x + r * ldx + p);
        _Pragma("GCC unroll 4") for (int i = 0; i < g; i++)
            _Pragma("GCC unroll 2") for (int j = 0; j < NV; j++) {
                __m256 wv = load_w(wq + i * panel_bytes, format, p, j);
                _Pragma("GCC unroll 5") for (int r = 0; r < mr; r++)
                    acc[r][i * NV + j] = _mm256_fmadd_ps(xr[r], wv, acc[r][i * NV + j]);
            }
    }
    int cols = n - q * NR < g * NR ? (int)(n - q * NR) : g * NR;
    _Pragma("GCC unroll 5") for (int r = 0; r < mr; r++) {
        float out[ROW_GROUP * NR];
        _Pragma("GCC unroll 8") for (int j = 0; j < g * NV; j++) _mm256_storeu_ps(out + 8 * j, acc[r][j]);
        for (int j = 0; j < cols; j++) {
            long c = q * NR + j;
            float v = format == I8_PANELS ? out[j] * scale[c] : out[j];
            v = bias ? v + bias[c] : v;
            y[r * ldy + c] = add ? add[r * ldy + c] + v : v;
        }
    }
}

/* Each (rows, group size) its own compiled loop, as the tiles are. */
#define ROWS_GROUP(R, G)                                                                                             \
    static __attribute__((noinline)) void rows_group_##R##_##G(const float *x, long ldx, const void *w, int format, \
                                                             long k, long n, const float *scale, const float *bias, \
                                                             const float *add, float *y, long ldy, long q) {       \
        if (format == BF16_PANELS) row_group(R, x, ldx, w, BF16_PANELS, G, k, n, scale, bias, add, y, ldy, q);    \
        else if (format == I8_PANELS) row_group(R, x, ldx, w, I8_PANELS, G, k, n, scale, bias, add, y, ldy, q);   \
        else row_group(R, x, ldx, w, F32_PANELS, G, k, n, scale, bias, add, y, ldy, q);                           \
    }
typedef void (*group_fn)(const float *, long, const void *, int, long, long, const float *, const float *,
                         const float *, float *, long, long);
ROWS_GROUP(1, 1) ROWS_GROUP(1, 2) ROWS_GROUP(1, 3) ROWS_GROUP(1, 4)
ROWS_GROUP(2, 1) ROWS_GROUP(2, 2) ROWS_GROUP(2, 3) ROWS_GROUP(2, 4)
ROWS_GROUP(3, 1) ROWS_GROUP(3, 2) ROWS_GROUP(3, 3) ROWS_GROUP(3, 4)
ROWS_GROUP(4, 1) ROWS_GROUP(4, 2) ROWS_GROUP(5, 1) ROWS_GROUP(5, 2)
/* groups[rows][panels], for every few_group entry and the smaller group at the end of a share */
static const group_fn groups[FEW_ROWS + 1][ROW_GROUP + 1] = {
    {0},
    {0, rows_group_1_1, rows_group_1_2, rows_group_1_3, rows_group_1_4},
    {0, rows_group_2_1, rows_group_2_2, rows_group_2_3, rows_group_2_4},
    {0, rows_group_3_1, rows_group_3_2, rows_group_3_3, rows_group_3_4},
    {0, rows_group_4_1, rows_group_4_2},
    {0, rows_group_5_1, rows_group_5_2},
};

/* One thread's share of a product's panels [start, end), in groups of `most`: `groups` holds the next group from
 * the front (low 32 bits) and the end of those not taken (high 32 bits). The owner takes from the front, the others,
 * done with their own, from the back; each group's outputs are computed whole by whoever takes it, so the split
 * changes no result. A cache line each: the threads' words do not share one. */
typedef struct {
    long start, end, most;
    unsigned long groups;
} __attribute__((aligned(64))) share;

/* Groups taken from the share: from the front (its owner) a quarter of those left, at least one; from the back
 * (another thread) one. The first panel taken, and in *stop the end of the panels taken; -1 when none is left.
 * The owner's claims shrink as its share does, so a product takes a few compare-and-swaps a thread (each a full
 * fence) rather than one per group, and the last groups are still single ones for the others to take. */
static long take(share *s, int front, long *stop) {
    unsigned long now = __atomic_load_n(&s->groups, __ATOMIC_ACQUIRE), next;
    long group, count;
    do {
        unsigned long first = now & 0xFFFFFFFFu, last = now >> 32;
        if (first >= last) return -1;
        count = front && (last - first) / 4 > 1 ? (long)((last - first) / 4) : 1;
        group = (long)(front ? first : last - 1);
        next = front ? now + (unsigned long)count : now - (1ul << 32);
    } while (!__atomic_compare_exchange_n(&s->groups, &now, next, 1, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE));
    long q = s->start + group * s->most, e = q + count * s->most;
    *stop = e < s->end ? e : s->end;
    return q;
}

/* The first panel of thread t's next groups, and in *end the end of the panels taken: from the front of its own
 * share, then from the backs of the others' (those of threads a smaller team lacks too), *v the share it is on
 * (0: its own; start at 0). -1 when every share is taken. */
static long next_group(share *shares, long threads, long t, long *v, long *end) {
    for (; *v < threads; (*v)++) {
        long q = take(shares + (t + *v) % threads, *v == 0, end);
        if (q >= 0) return q;
    }
    return -1;
}

/* A product's `panels` in equal shares for `threads` threads, groups of `most` panels. */
static void split(share *shares, long threads, long panels, long most) {
    for (long t = 0; t < threads; t++) {
        long start = panels * t / threads, end = panels * (t + 1) / threads;
        shares[t] = (share){start, end, most, (unsigned long)((end - start + most - 1) / most) << 32};
    }
}

/* m rows in row groups of `most` panels: each thread its share of the panels (split), a group at a time, then what
 * is left of the others' (next_group). */
static void few_rows(const float *x, long m, long ldx, const void *w, int format, long most, long k, long n,
                     const float *scale, const float *bias, const float *add, float *y, long ldy) {
    long threads = omp_get_max_threads();
    share shares[threads];
    split(shares, threads, (n + NR - 1) / NR, most);
    #pragma omp parallel
    {
        long t = omp_get_thread_num(), v = 0, end;
        for (long q0; (q0 = next_group(shares, threads, t, &v, &end)) >= 0;)
            for (long q = q0; q < end; q += most)
                groups[m][end - q < most ? end - q : most](x, ldx, w, format, k, n, scale, bias, add, y, ldy, q);
    }
}

/* bfloat16 compute: x rounded to bfloat16 at the product's input, bfloat16 weights, float32 sums. The weights are
 * pair panels (to_pair_panels): [ceil(n / NR)][ceil(k / 2)][NR][2], for each pair of k (2p, 2p + 1) and each of the
 * panel's 16 columns the two weights side by side, zero past k and n. One 64-byte row of a panel is then what one
 * vdpbf16ps takes: 16 float32 lanes, each adding the two products of its column's pair. Where the CPU has no
 * AVX512-BF16 the same panels and rounded activations run widened to float32 on FMAs (the even k's product, then
 * the odd one's). Either way each output is one running sum over the pairs in order, whatever the number of rows: a
 * row's bits do not depend on its batch within a path (the paths differ from each other in the last bits).
 * On a CPU with AMX the panels are also the tiles' layout: 16 rows of a panel (16 pairs of k) are one weight tile,
 * so each panel holds its pairs padded with zeros to a multiple of 16 (on every path: one format). */
#define PAIR_ROW 32  /* bfloat16 values in a pair panel's row: NR columns x 2 */
#define TILE_PAIRS 16  /* pairs of k in one AMX weight tile: its 16 rows of 64 bytes */
/* a pair panel's rows for k inputs: ceil(k / 2) pairs, padded to whole tiles */
#define PANEL_PAIRS(k) (((k) + 2 * TILE_PAIRS - 1) / (2 * TILE_PAIRS) * TILE_PAIRS)
/* rows of a dot tile: 12 rows x 2 panels keep 24 sums in AVX-512's 32 registers */
#define DOT_ROWS 12
/* the panels a tile of mr rows streams together: as many as keep mr x g <= 24 sums (fewer rows, more panels: more
 * independent sums in flight where one row alone would wait on each dot product's latency) */
#define DOT_GROUP(mr) ((mr) <= 6 ? 4 : (mr) <= 8 ? 3 : 2)
/* widened tiles hold 2 float32 vectors per row and panel in AVX2's 16 (or AVX-512's 32) registers */
#define WIDE_GROUP(mr) ((mr) * 4 <= MR ? 4 : (mr) * 3 <= MR ? 3 : (mr) * 2 <= MR ? 2 : 1)
/* how far ahead in each panel's stream a tile asks for weights: far enough that memory's latency hides behind a
 * 12-row tile's dot products; a one-row tile (a decode step), which does little between loads, streams faster
 * asking nearer (docs/benchmarks/engine.md has the distances tried) */
#define PAIR_PREFETCH_BYTES 2048
#define ONE_ROW_PAIR_PREFETCH_BYTES 1024

/* float32 -> bfloat16, rounding to nearest even, NaN to the quiet NaN: as torch's Tensor.bfloat16(). */
static inline unsigned short round_bf16(float v) {
    unsigned int bits;
    memcpy(&bits, &v, 4);
    if (isnan(v)) return 0x7FC0;
    return (unsigned short)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* Eight floats' round_bf16, each in the high half of its 32-bit lane (the low half zero): the same bits. */
static inline __m256i round_bf16_8(__m256 v) {
    __m256i bits = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i up = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    __m256i rounded = _mm256_slli_epi32(_mm256_srli_epi32(up, 16), 16);
    __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC00000), _mm256_castps_si256(nan));
}

/* The rows of x rounded to bfloat16 into buf (ldb apart; rows m .. buf_rows - 1 and columns k .. ldb - 1 zero):
 * as bfloat16 for the dot products (dot), else widened back to float32. Vectorised: a step of 17 rows rounds ~3
 * million activations, which one scalar loop, before the threads start, made a visible part of the step. */
static void round_rows(const float *x, long m, long ldx, long k, void *buf, long buf_rows, long ldb, int dot) {
    long elem = dot ? 2 : 4;
    for (long r = 0; r < m; r++) {
        const float *xr = x + r * ldx;
        unsigned short *b16 = (unsigned short *)buf + r * ldb;
        float *b32 = (float *)buf + r * ldb;
        long c = 0;
        for (; c + 16 <= k; c += 16) {
            __m256i lo = round_bf16_8(_mm256_loadu_ps(xr + c)), hi = round_bf16_8(_mm256_loadu_ps(xr + c + 8));
            if (dot) {
                __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(lo, 16), _mm256_srli_epi32(hi, 16));
                _mm256_storeu_si256((__m256i *)(b16 + c), _mm256_permute4x64_epi64(packed, 0xD8));
            } else {
                _mm256_storeu_si256((__m256i *)(b32 + c), lo);
                _mm256_storeu_si256((__m256i *)(b32 + c + 8), hi);
            }
        }
        for (; c < k; c++) {
            unsigned short b = round_bf16(xr[c]);
            if (dot) b16[c] = b;
            else {
                unsigned int bits = (unsigned int)b << 16;
                memcpy(b32 + c, &bits, 4);
            }
        }
        memset((char *)buf + (r * ldb + k) * elem, 0, (ldb - k) * elem);
    }
    memset((char *)buf + m * ldb * elem, 0, (buf_rows - m) * ldb * elem);
}

/* The tile's sums (16 columns per panel) into y, with the bias and the added rows as `tile` does. */
static inline __attribute__((always_inline)) void store_pairs(const float *out, long ldo, int mr, int g, long n,
                                                              long q, const float *bias, const float *add, float *y,
                                                              long ldy) {
    int cols = n - q * NR < g * NR ? (int)(n - q * NR) : g * NR;
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < cols; j++) {
            long c = q * NR + j;
            float v = bias ? out[r * ldo + j] + bias[c] : out[r * ldo + j];
            y[r * ldy + c] = add ? add[r * ldy + c] + v : v;
        }
}

/* mr rows (bfloat16, ldx apart, even length 2 kp) over panels q .. q + g - 1 on vdpbf16ps. */
__attribute__((target("avx512f,avx512bf16"))) static inline __attribute__((always_inline)) void
dot_tile(int mr, int g, const unsigned short *x, long ldx, const unsigned short *w, long kp, long n, const float *bias,
         const float *add, float *y, long ldy, long q) {
    long panel_elems = kp * PAIR_ROW;
    const unsigned short *wq = w + q * panel_elems;
    __m512 acc[DOT_ROWS][4];
    _Pragma("GCC unroll 12") for (int r = 0; r < mr; r++)
        _Pragma("GCC unroll 4") for (int i = 0; i < g; i++) acc[r][i] = _mm512_setzero_ps();
    for (long p = 0; p < kp; p++) {
        __m512i wv[4];
        _Pragma("GCC unroll 4") for (int i = 0; i < g; i++) {
            const unsigned short *row = wq + i * panel_elems + p * PAIR_ROW;
            __builtin_prefetch((const char *)row + (mr > 1 ? PAIR_PREFETCH_BYTES : ONE_ROW_PAIR_PREFETCH_BYTES), 0,
                               PREFETCH_LOCALITY);
            wv[i] = _mm512_loadu_si512(row);
        }
        _Pragma("GCC unroll 12") for (int r = 0; r < mr; r++) {
            int pair;
            memcpy(&pair, x + r * ldx + 2 * p, 4);
            __m512bh xr = (__m512bh)_mm512_set1_epi32(pair);
            _Pragma("GCC unroll 4") for (int i = 0; i < g; i++)
                acc[r][i] = _mm512_dpbf16_ps(acc[r][i], xr, (__m512bh)wv[i]);
        }
    }
    float out[DOT_ROWS * 4 * NR];
    _Pragma("GCC unroll 12") for (int r = 0; r < mr; r++)
        _Pragma("GCC unroll 4") for (int i = 0; i < g; i++) _mm512_storeu_ps(out + r * 4 * NR + i * NR, acc[r][i]);
    store_pairs(out, 4 * NR, mr, g, n, q, bias, add, y, ldy);
}

/* The same on FMAs: x holds the rounded activations widened to float32 (ldx apart, even length 2 kp); each pair
 * panel row's 32-bit words widen as load_w widens a bfloat16 panel's (low half: the even k, high half: the odd). */
static inline __attribute__((always_inline)) void wide_tile(int mr, int g, const float *x, long ldx,
                                                            const unsigned short *w, long kp, long n, const float *bias,
                                                            const float *add, float *y, long ldy, long q) {
    long panel_elems = kp * PAIR_ROW;
    const unsigned short *wq = w + q * panel_elems;
    __m256 acc[MR][4][2];
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    _Pragma("GCC unroll 12") for (int r = 0; r < mr; r++)
        _Pragma("GCC unroll 4") for (int i = 0; i < g; i++) acc[r][i][0] = acc[r][i][1] = _mm256_setzero_ps();
    for (long p = 0; p < kp; p++) {
        __m256 even[4][2], odd[4][2];
        _Pragma("GCC unroll 4") for (int i = 0; i < g; i++) {
            const unsigned short *row = wq + i * panel_elems + p * PAIR_ROW;
            __builtin_prefetch((const char *)row + PAIR_PREFETCH_BYTES, 0, PREFETCH_LOCALITY);
            _Pragma("GCC unroll 2") for (int j = 0; j < 2; j++) {
                __m256i pairs = _mm256_loadu_si256((const __m256i *)(row + 16 * j));
                even[i][j] = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
                odd[i][j] = _mm256_castsi256_ps(_mm256_and_si256(pairs, high));
            }
        }
        _Pragma("GCC unroll 12") for (int r = 0; r < mr; r++) {
            __m256 xe = _mm256_broadcast_ss(x + r * ldx + 2 * p), xo = _mm256_broadcast_ss(x + r * ldx + 2 * p + 1);
            _Pragma("GCC unroll 4") for (int i = 0; i < g; i++)
                _Pragma("GCC unroll 2") for (int j = 0; j < 2; j++)
                    acc[r][i][j] = _mm256_fmadd_ps(xo, odd[i][j], _mm256_fmadd_ps(xe, even[i][j], acc[r][i][j]));
        }
    }
    float out[MR * 4 * NR];
    _Pragma("GCC unroll 12") for (int r = 0; r < mr; r++)
        _Pragma("GCC unroll 4") for (int i = 0; i < g; i++)
            _Pragma("GCC unroll 2") for (int j = 0; j < 2; j++)
                _mm256_storeu_ps(out + r * 4 * NR + i * NR + 8 * j, acc[r][i][j]);
    store_pairs(out, 4 * NR, mr, g, n, q, bias, add, y, ldy);
}

/* AMX: tiles of up to 16 rows x 64 bytes, 16 pairs of k at a time; 16 pair-panel rows are a weight tile. Two
 * layouts of the eight tiles, chosen once per product by its rows:
 * - up to 16 rows: x is tile 4, the weights tiles 5, 6, 7; tdpbf16ps adds into tiles 0-2 the float32 sums of 3
 *   panels' 48 columns (a fourth panel reusing tile 5 waited on the first's product to free it: 3-6% slower steps);
 * - more: two blocks of rows at once, x tiles 4 and 5 (16 rows and the rest, or 16 and 16 with x padded with zero
 *   rows to a multiple of 32), over 2 panels (weights 6, 7) into tiles 0, 1 and 2, 3: each weight tile, loaded
 *   once, serves both blocks, where one block at a time loaded it once per 16 rows.
 * Each sum runs over the pairs in order, tile after tile, whatever the rows or the layout: a row's bits do not
 * depend on its batch. Linux hands a process the tiles' state only on request (serving/cpu_features.py asks before
 * this path is chosen). */
#define AMX_ROWS 16
typedef struct {
    unsigned char palette, start_row, reserved[14];
    unsigned short colsb[16];
    unsigned char rows[16];
} tile_config;

#ifdef DRAFTHEADS_EMULATE_AMX
/* For tests on CPUs without AMX (tests/serving/test_amx_tiles.py builds the library with this defined): each tile
 * instruction done in C over this thread's eight tiles as Intel's manual defines it (denormals aside), so that the
 * loops below, their tile shapes and strides, run and are checked anywhere. */
#define AMX_TARGET
static __thread tile_config emu_config;
static __thread unsigned char emu_tiles[8][16][64] __attribute__((aligned(64)));
static void emu_load(int t, const void *base, long stride) {
    for (int r = 0; r < emu_config.rows[t]; r++)
        memcpy(emu_tiles[t][r], (const char *)base + r * stride, emu_config.colsb[t]);
}
static void emu_store(int t, void *base, long stride) {
    for (int r = 0; r < emu_config.rows[t]; r++)
        memcpy((char *)base + r * stride, emu_tiles[t][r], emu_config.colsb[t]);
}
static float emu_widen(unsigned short b) {
    unsigned int bits = (unsigned int)b << 16;
    float v;
    memcpy(&v, &bits, 4);
    return v;
}
static void emu_dp(int c, int a, int b) {
    for (int m = 0; m < emu_config.rows[c]; m++) {
        float sums[16];
        const unsigned short *x = (const unsigned short *)emu_tiles[a][m];
        memcpy(sums, emu_tiles[c][m], 64);
        for (int k = 0; k < emu_config.colsb[a] / 4; k++) {
            const unsigned short *w = (const unsigned short *)emu_tiles[b][k];
            for (int j = 0; j < emu_config.colsb[c] / 4; j++) {
                sums[j] += emu_widen(x[2 * k]) * emu_widen(w[2 * j]);
                sums[j] += emu_widen(x[2 * k + 1]) * emu_widen(w[2 * j + 1]);
            }
        }
        memcpy(emu_tiles[c][m], sums, 64);
    }
}
#define TILE_CONFIG(config) (emu_config = *(config), memset(emu_tiles, 0, sizeof emu_tiles))
#define TILE_RELEASE() ((void)0)
#define TILE_ZERO(t) memset(emu_tiles[t], 0, 1024)
#define TILE_LOAD(t, base, stride) emu_load(t, base, stride)
#define TILE_STORE(t, base, stride) emu_store(t, base, stride)
#define TILE_DP(c, a, b) emu_dp(c, a, b)
#else
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))
/* not _tile_loadconfig: GCC 12's declares an 8-byte operand, so the stores that fill the rest of the configuration
 * are dropped as dead and ldtilecfg faults on what the stack held */
#define TILE_CONFIG(config) __asm__ volatile("ldtilecfg %0" ::"m"(*(const tile_config *)(config)))
#define TILE_RELEASE() _tile_release()
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_LOAD(t, base, stride) _tile_loadd(t, base, stride)
#define TILE_STORE(t, base, stride) _tile_stored(t, base, stride)
#define TILE_DP(c, a, b) _tile_dpbf16ps(c, a, b)
#endif

/* This thread's tiles: rows_b == 0, one block of rows_a rows (sums and x rows_a x 64 bytes); else blocks of rows_a
 * and rows_b rows (tiles 0, 1 and x 4: rows_a; 2, 3 and x 5: rows_b). Weight tiles 16 x 64 bytes. */
AMX_TARGET static void amx_configure(int rows_a, int rows_b) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.colsb[t] = 64;
        if (rows_b == 0) config.rows[t] = t < 5 ? rows_a : TILE_PAIRS;
        else config.rows[t] = t == 0 || t == 1 || t == 4 ? rows_a : t == 2 || t == 3 || t == 5 ? rows_b : TILE_PAIRS;
    }
    TILE_CONFIG(&config);
}

/* One block: the configured rows of x (bfloat16, ldx apart, 2 kp long) over panels q .. q + g - 1, g <= 3. */
AMX_TARGET static void amx_block(int mr, int g, const unsigned short *x, long ldx, const unsigned short *w, long kp,
                                 long n, const float *bias, const float *add, float *y, long ldy, long q) {
    long panel_elems = kp * PAIR_ROW, row_bytes = PAIR_ROW * 2;
    const unsigned short *w0 = w + q * panel_elems, *w1 = w0 + panel_elems, *w2 = w1 + panel_elems;
    TILE_ZERO(0);
    TILE_ZERO(1);
    TILE_ZERO(2);
    for (long p = 0; p < kp; p += TILE_PAIRS) {
        long at = p * PAIR_ROW;
        TILE_LOAD(4, x + 2 * p, ldx * 2);
        TILE_LOAD(5, w0 + at, row_bytes);
        TILE_DP(0, 4, 5);
        if (g > 1) {
            TILE_LOAD(6, w1 + at, row_bytes);
            TILE_DP(1, 4, 6);
        }
        if (g > 2) {
            TILE_LOAD(7, w2 + at, row_bytes);
            TILE_DP(2, 4, 7);
        }
    }
    float out[AMX_ROWS * 3 * NR];
    long ldo = 3 * NR;
    TILE_STORE(0, out, ldo * 4);
    if (g > 1) TILE_STORE(1, out + NR, ldo * 4);
    if (g > 2) TILE_STORE(2, out + 2 * NR, ldo * 4);
    store_pairs(out, ldo, mr, g, n, q, bias, add, y, ldy);
}

/* Two blocks: rows x and x + 16 rows (their first ma and mb stored) over panels q .. q + g - 1, g <= 2. */
AMX_TARGET static void amx_blocks(int ma, int mb, int g, const unsigned short *x, long ldx, const unsigned short *w,
                                  long kp, long n, const float *bias, const float *add, float *y, long ldy, long q) {
    long panel_elems = kp * PAIR_ROW, row_bytes = PAIR_ROW * 2;
    const unsigned short *w0 = w + q * panel_elems, *w1 = w0 + panel_elems, *xb = x + AMX_ROWS * ldx;
    TILE_ZERO(0);
    TILE_ZERO(1);
    TILE_ZERO(2);
    TILE_ZERO(3);
    for (long p = 0; p < kp; p += TILE_PAIRS) {
        long at = p * PAIR_ROW;
        TILE_LOAD(4, x + 2 * p, ldx * 2);
        TILE_LOAD(5, xb + 2 * p, ldx * 2);
        TILE_LOAD(6, w0 + at, row_bytes);
        TILE_DP(0, 4, 6);
        TILE_DP(2, 5, 6);
        if (g > 1) {
            TILE_LOAD(7, w1 + at, row_bytes);
            TILE_DP(1, 4, 7);
            TILE_DP(3, 5, 7);
        }
    }
    float out[2][AMX_ROWS * 2 * NR];
    long ldo = 2 * NR;
    TILE_STORE(0, out[0], ldo * 4);
    TILE_STORE(2, out[1], ldo * 4);
    if (g > 1) {
        TILE_STORE(1, out[0] + NR, ldo * 4);
        TILE_STORE(3, out[1] + NR, ldo * 4);
    }
    store_pairs(out[0], ldo, ma, g, n, q, bias, add, y, ldy);
    if (mb > 0)
        store_pairs(out[1], ldo, mb, g, n, q, bias, add ? add + AMX_ROWS * ldy : 0, y + AMX_ROWS * ldy, ldy);
}

/* Panels q .. q + g - 1 for every row, in the layout amx_configure set for m rows (amx_rows). */
AMX_TARGET static void amx_group(const unsigned short *x, long m, long ldx, const unsigned short *w, long kp, long n,
                                 const float *bias, const float *add, float *y, long ldy, long q, int g) {
    if (m <= AMX_ROWS) {
        amx_block((int)m, g, x, ldx, w, kp, n, bias, add, y, ldy, q);
        return;
    }
    for (long i = 0; i < m; i += 2 * AMX_ROWS) {
        long ma = m - i < AMX_ROWS ? m - i : AMX_ROWS, mb = m - i - ma < AMX_ROWS ? m - i - ma : AMX_ROWS;
        amx_blocks((int)ma, (int)mb, g, x + i * ldx, ldx, w, kp, n, bias, add ? add + i * ldy : 0, y + i * ldy, ldy,
                   q);
    }
}

/* The tile rows of m rows' layout (amx_configure's), the rows x must hold (the rest zeros) and the panels of a group. */
static void amx_rows(long m, int *rows_a, int *rows_b, long *buf_rows, long *group) {
    *rows_a = m < AMX_ROWS ? (int)m : AMX_ROWS;
    *rows_b = m <= AMX_ROWS ? 0 : m <= 2 * AMX_ROWS ? (int)(m - AMX_ROWS) : AMX_ROWS;
    *buf_rows = m <= 2 * AMX_ROWS ? m : (m + 2 * AMX_ROWS - 1) / (2 * AMX_ROWS) * (2 * AMX_ROWS);
    *group = m <= AMX_ROWS ? 3 : 2;
}

AMX_TARGET static void amx_release(void) { TILE_RELEASE(); }

/* Each (rows, panels) tile its own compiled loop, as the float32 tiles are. */
typedef void (*pair_fn)(const void *, long, const unsigned short *, long, long, const float *, const float *, float *,
                        long, long);
#define DOT(R, G)                                                                                                    \
    __attribute__((target("avx512f,avx512bf16"), noinline)) static void dot_##R##_##G(                             \
        const void *x, long ldx, const unsigned short *w, long kp, long n, const float *bias, const float *add,     \
        float *y, long ldy, long q) {                                                                              \
        dot_tile(R, G, (const unsigned short *)x, ldx, w, kp, n, bias, add, y, ldy, q);                             \
    }
#define WIDE(R, G)                                                                                                   \
    static __attribute__((noinline)) void wide_##R##_##G(const void *x, long ldx, const unsigned short *w, long kp, \
                                                         long n, const float *bias, const float *add, float *y,    \
                                                         long ldy, long q) {                                       \
        wide_tile(R, G, (const float *)x, ldx, w, kp, n, bias, add, y, ldy, q);                                    \
    }
#define FOUR(F, R) F(R, 1) F(R, 2) F(R, 3) F(R, 4)
#define TABLE_ROW(F, R) {0, F##_##R##_1, F##_##R##_2, F##_##R##_3, F##_##R##_4}
FOUR(DOT, 1) FOUR(DOT, 2) FOUR(DOT, 3) FOUR(DOT, 4) FOUR(DOT, 5) FOUR(DOT, 6)
FOUR(DOT, 7) FOUR(DOT, 8) FOUR(DOT, 9) FOUR(DOT, 10) FOUR(DOT, 11) FOUR(DOT, 12)
static const pair_fn dots[DOT_ROWS + 1][5] = {
    {0}, TABLE_ROW(dot, 1), TABLE_ROW(dot, 2), TABLE_ROW(dot, 3), TABLE_ROW(dot, 4), TABLE_ROW(dot, 5),
    TABLE_ROW(dot, 6), TABLE_ROW(dot, 7), TABLE_ROW(dot, 8), TABLE_ROW(dot, 9), TABLE_ROW(dot, 10),
    TABLE_ROW(dot, 11), TABLE_ROW(dot, 12)};
FOUR(WIDE, 1) FOUR(WIDE, 2) FOUR(WIDE, 3) FOUR(WIDE, 4) FOUR(WIDE, 5) FOUR(WIDE, 6)
#if MR > 6
FOUR(WIDE, 7) FOUR(WIDE, 8) FOUR(WIDE, 9) FOUR(WIDE, 10) FOUR(WIDE, 11) FOUR(WIDE, 12)
#endif
static const pair_fn wides[MR + 1][5] = {
    {0}, TABLE_ROW(wide, 1), TABLE_ROW(wide, 2), TABLE_ROW(wide, 3), TABLE_ROW(wide, 4), TABLE_ROW(wide, 5),
    TABLE_ROW(wide, 6),
#if MR > 6
    TABLE_ROW(wide, 7), TABLE_ROW(wide, 8), TABLE_ROW(wide, 9), TABLE_ROW(wide, 10), TABLE_ROW(wide, 11),
    TABLE_ROW(wide, 12)
#endif
};

/* y = add + round_bf16(x) @ W (+ bias) over pair panels, on `path` (BF16_DOT or BF16_WIDENED). The rows are rounded
 * once into a buffer (bfloat16 for the dot products, widened back to float32 for the FMAs), then each thread takes an
 * equal share of the panels, a group of them at a time, and every block of rows over that group. */
static void gemm_pairs(const float *x, long m, long ldx, const unsigned short *w, int path, long k, long n,
                       const float *bias, const float *add, float *y, long ldy) {
    long kp = PANEL_PAIRS(k), ldb = 2 * kp, panels = (n + NR - 1) / NR;
    int dot = path == BF16_DOT || path == BF16_AMX;
    int rows_a = 0, rows_b = 0;
    long buf_rows = m, amx_group_panels = 0;
    if (path == BF16_AMX) amx_rows(m, &rows_a, &rows_b, &buf_rows, &amx_group_panels);
    void *buf = malloc((size_t)buf_rows * ldb * (dot ? 2 : 4));
    round_rows(x, m, ldx, k, buf, buf_rows, ldb, dot);
    long block = path == BF16_AMX ? AMX_ROWS : dot ? DOT_ROWS : MR, elem = dot ? 2 : 4;
    /* a group's panels stay in L2 for every further block of rows; a block of fewer rows takes as many */
    long full = m < block ? m : block;
    long most = path == BF16_AMX ? amx_group_panels : dot ? DOT_GROUP(full) : WIDE_GROUP(full);
    long threads = omp_get_max_threads();
    share shares[threads];
    split(shares, threads, panels, most);
    #pragma omp parallel
    {
        long t = omp_get_thread_num(), v = 0, end;
        if (path == BF16_AMX) amx_configure(rows_a, rows_b);
        /* a thread the memory served slower this time does not hold the rest at the barrier: next_group */
        for (long q0; (q0 = next_group(shares, threads, t, &v, &end)) >= 0;)
            for (long q = q0; q < end; q += most) {
                long g = end - q < most ? end - q : most;
                if (path == BF16_AMX) amx_group(buf, m, ldb, w, kp, n, bias, add, y, ldy, q, (int)g);
                else for (long i = 0; i < m; i += block) {
                    long rows = m - i < block ? m - i : block;
                    const void *xi = (const char *)buf + i * ldb * elem;
                    (dot ? dots : wides)[rows][g](xi, ldb, w, kp, n, bias, add ? add + i * ldy : 0, y + i * ldy,
                                                  ldy, q);
                }
            }
        if (path == BF16_AMX) amx_release();
    }
    free(buf);
}

/* y = add + x @ W (+ bias); add may be y itself (in place) or NULL, and has y's row stride. streams: whether W comes
 * from memory rather than cache (few_group). */
static void gemm(const float *x, long m, long ldx, const void *w, int format, int streams, long k, long n,
                 const float *bias, const float *add, float *y, long ldy) {
    if (m == 0) return;
    if (format == BF16_DOT || format == BF16_WIDENED || format == BF16_AMX) {
        gemm_pairs(x, m, ldx, (const unsigned short *)w, format, k, n, bias, add, y, ldy);
        return;
    }
    long panels = (n + NR - 1) / NR;
    const float *scale = format == I8_PANELS ? (const float *)((const char *)w + panels * k * NR) : 0;
    int most = m <= FEW_ROWS ? few_group[streams][panel_kind(format)][m] : 0;
    if (most) {
        few_rows(x, m, ldx, w, format, most, k, n, scale, bias, add, y, ldy);
        return;
    }
    #pragma omp parallel for schedule(static)
    for (long q = 0; q < panels; q++) panel(x, m, ldx, w, format, k, n, scale, bias, add, y, ldy, q);
}

/* serving/kernels.py's PackedLinear: the products the target runs outside its layer calls (its LM head, the layers of
 * families whose layers are torch modules) stream their weights from memory; a head's are mostly bfloat16 panels,
 * whose choice does not depend on it */
void gemm_panels(const float *x, long m, long ldx, const float *w, long k, long n, const float *bias,
                 float *y, long ldy) {
    gemm(x, m, ldx, w, F32_PANELS, 1, k, n, bias, 0, y, ldy);
}

void gemm_panels_bf16(const float *x, long m, long ldx, const unsigned short *w, long k, long n, const float *bias,
                      float *y, long ldy) {
    gemm(x, m, ldx, w, BF16_PANELS, 1, k, n, bias, 0, y, ldy);
}

/* w: int8 panels, then each column's scale (I8_PANELS) */
void gemm_panels_i8(const float *x, long m, long ldx, const void *w, long k, long n, const float *bias, float *y,
                    long ldy) {
    gemm(x, m, ldx, w, I8_PANELS, 1, k, n, bias, 0, y, ldy);
}

/* bfloat16 compute over pair panels; path: BF16_AMX (only where the CPU has AMX and Linux granted its tiles), BF16_DOT
 * (only where it has AVX512-BF16) or BF16_WIDENED. */
void gemm_pairs_bf16(const float *x, long m, long ldx, const unsigned short *w, long k, long n, const float *bias,
                     float *y, long ldy, long path) {
    gemm(x, m, ldx, w, (int)path, 1, k, n, bias, 0, y, ldy);
}

/* y = x / sqrt(mean(x^2) + eps) * w over rows of n, as float32 reference implementations do. */
void rms_norm(const float *x, long rows, long ldx, const float *w, float eps, float *y, long ldy, long n) {
    #pragma omp parallel for schedule(static) if (rows >= 64)
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        float *yr = y + r * ldy;
        __m256 sq = _mm256_setzero_ps();
        long i = 0;
        for (; i + 8 <= n; i += 8) {
            __m256 v = _mm256_loadu_ps(xr + i);
            sq = _mm256_fmadd_ps(v, v, sq);
        }
        float lanes[8], sum = 0.0f;
        _mm256_storeu_ps(lanes, sq);
        for (int j = 0; j < 8; j++) sum += lanes[j];
        for (; i < n; i++) sum += xr[i] * xr[i];
        float scale = 1.0f / sqrtf(sum / n + eps);
        for (i = 0; i < n; i++) yr[i] = w[i] * (xr[i] * scale);
    }
}

/* e^x for 8 lanes: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (relative error
 * below 2e-7), 2^n through the exponent bits. Lanes below -87 give 0, as softmax wants for masked keys. */
static inline __m256 exp8(__m256 x) {
    __m256 zero_below = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)), zero_below);
}

/* The 8 sums of 8 vectors, one per lane. */
static inline __m256 sum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
    __m256 s01 = _mm256_hadd_ps(a0, a1), s23 = _mm256_hadd_ps(a2, a3), s45 = _mm256_hadd_ps(a4, a5), s67 = _mm256_hadd_ps(a6, a7);
    __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* The key slot of position c (0 .. context + path length - 1) of a row: the context's slots, then its path's
 * (path: (length, slots...), null for a query row; positions past the end repeat the last, which nothing weighs;
 * slot 0 where a tree pass has no context, which nothing reads either). */
static inline long key_slot(const long *sl, long context, const long *path, long c) {
    if (c < context) return sl[c];
    if (path == 0) return context > 0 ? sl[context - 1] : 0;
    long k = c - context;
    return path[1 + (k < path[0] ? k : path[0] - 1)];
}

/* Keys per attention task. A sequence of more keys splits them into chunks of this many, each a task over every
 * head (contiguous rows of the pool: per head, the keys' rows are read through strides, which ran 1.3x slower), whose
 * partial softmaxes are then merged in chunk order; a sequence of up to this many keys is one chunk, a task per
 * key-value head, its result used as it is. Fixed, not derived from the threads or the batch, so that a row's sums
 * depend on its keys alone, whichever task computes them. */
#define KEY_CHUNK 128

/* One row's scores against 8 keys (kr), for its heads r0 .. r0 + g - 1 (qs rows, dim apart), into scores (width
 * apart) at column at: per key 8 lanes summing q * k over the dims 8 at a time, then sum8. */
static inline void scores8(const float *qs, long dim, long r0, long g, const float *const *kr, float *scores,
                           long width, long at) {
    for (long r = r0; r < r0 + g; r++) {
        __m256 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
        for (long v = 0; v < dim / 8; v++) {
            __m256 qv = _mm256_loadu_ps(qs + r * dim + 8 * v);
            for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[j] + 8 * v), a[j]);
        }
        _mm256_storeu_ps(scores + r * width + at, sum8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]));
    }
}

/* One row's weighted sums of values (part + 2 of each head's part, part_floats apart) for its heads sharing the
 * keys: per head and lane one running sum over the visible keys in order, weights s (width apart per head). */
static inline void weigh_values(const float *v_pool, const long *sl, long context, const long *path, long c0,
                                long visible, long h, long kv_heads, long dim, const float *s, long width, long g,
                                float *part, long part_floats) {
    long vecs = dim / 8;
    for (long x = 0; x < g; x++) {
        const float *sx = s + x * width;
        float *px = part + x * part_floats;
        for (long v0 = 0; v0 < vecs; v0 += 8) {  /* 8 vectors of the sums at a time, in registers */
            __m256 acc[8];
            long nv = vecs - v0 < 8 ? vecs - v0 : 8;
            for (int v = 0; v < 8; v++) acc[v] = _mm256_setzero_ps();
            for (long c = 0; c < visible; c++) {
                const float *vr = v_pool + (key_slot(sl, context, path, c0 + c) * kv_heads + h) * dim + 8 * v0;
                __m256 p = _mm256_set1_ps(sx[c]);
                if (nv == 8)
                    for (int v = 0; v < 8; v++) acc[v] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 8 * v), acc[v]);
                else
                    for (int v = 0; v < nv; v++) acc[v] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 8 * v), acc[v]);
            }
            for (int v = 0; v < nv; v++) _mm256_storeu_ps(px + 2 + 8 * (v0 + v), acc[v]);
        }
    }
}

#ifdef __AVX512F__
/* With AVX-512 the same sums, two 8-lane sums to a 512-bit register, so that one FMA does the work of two and each
 * key (or value) read serves every head of the row: the additions, their lanes and their order are scores8's and
 * weigh_values', so the bits are the AVX2 build's. A verify step's rows make attention FMA-bound. */
static inline __m512 join8(__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
}
static inline __m512 twice8(const float *at) {
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(at))));
}
#define LO8(z) _mm512_castps512_ps256(z)
#define HI8(z) _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1))

/* scores8 for G heads at once: keys 2p and 2p + 1 side by side in pair p */
static inline __attribute__((always_inline)) void scores8_x(int G, const float *qs, long dim, long r0,
                                                             const float *const *kr, float *scores, long width,
                                                             long at) {
    __m512 acc[4][4];
    _Pragma("GCC unroll 4") for (int x = 0; x < G; x++)
        _Pragma("GCC unroll 4") for (int p = 0; p < 4; p++) acc[x][p] = _mm512_setzero_ps();
    for (long v = 0; v < dim / 8; v++) {
        __m512 keys[4];
        _Pragma("GCC unroll 4") for (int p = 0; p < 4; p++)
            keys[p] = join8(_mm256_loadu_ps(kr[2 * p] + 8 * v), _mm256_loadu_ps(kr[2 * p + 1] + 8 * v));
        _Pragma("GCC unroll 4") for (int x = 0; x < G; x++) {
            __m512 qv = twice8(qs + (r0 + x) * dim + 8 * v);
            _Pragma("GCC unroll 4") for (int p = 0; p < 4; p++) acc[x][p] = _mm512_fmadd_ps(qv, keys[p], acc[x][p]);
        }
    }
    _Pragma("GCC unroll 4") for (int x = 0; x < G; x++)
        _mm256_storeu_ps(scores + (r0 + x) * width + at,
                         sum8(LO8(acc[x][0]), HI8(acc[x][0]), LO8(acc[x][1]), HI8(acc[x][1]), LO8(acc[x][2]),
                              HI8(acc[x][2]), LO8(acc[x][3]), HI8(acc[x][3])));
}

static inline void scores8_heads(const float *qs, long dim, long r0, long g, const float *const *kr, float *scores,
                                 long width, long at) {
    for (long x = 0; x < g; x += 4) {
        switch (g - x < 4 ? g - x : 4) {
        case 4: scores8_x(4, qs, dim, r0 + x, kr, scores, width, at); break;
        case 3: scores8_x(3, qs, dim, r0 + x, kr, scores, width, at); break;
        case 2: scores8_x(2, qs, dim, r0 + x, kr, scores, width, at); break;
        default: scores8_x(1, qs, dim, r0 + x, kr, scores, width, at);
        }
    }
}

/* weigh_values for G heads and 16 of the dims (d0 ..) at once, each 512-bit sum two 8-lane ones */
static inline __attribute__((always_inline)) void weigh_x(int G, const float *v_pool, const long *sl, long context,
                                                           const long *path, long c0, long visible, long h,
                                                           long kv_heads, long dim, long d0, const float *s,
                                                           long width, float *part, long part_floats) {
    __m512 acc[4][4];
    _Pragma("GCC unroll 4") for (int x = 0; x < G; x++)
        _Pragma("GCC unroll 4") for (int z = 0; z < 4; z++) acc[x][z] = _mm512_setzero_ps();
    for (long c = 0; c < visible; c++) {
        const float *vr = v_pool + (key_slot(sl, context, path, c0 + c) * kv_heads + h) * dim + d0;
        __m512 vals[4];
        _Pragma("GCC unroll 4") for (int z = 0; z < 4; z++) vals[z] = _mm512_loadu_ps(vr + 16 * z);
        _Pragma("GCC unroll 4") for (int x = 0; x < G; x++) {
            __m512 p = _mm512_set1_ps(s[x * width + c]);
            _Pragma("GCC unroll 4") for (int z = 0; z < 4; z++) acc[x][z] = _mm512_fmadd_ps(p, vals[z], acc[x][z]);
        }
    }
    _Pragma("GCC unroll 4") for (int x = 0; x < G; x++)
        _Pragma("GCC unroll 4") for (int z = 0; z < 4; z++)
            _mm512_storeu_ps(part + x * part_floats + 2 + d0 + 16 * z, acc[x][z]);
}

static inline void weigh_values_heads(const float *v_pool, const long *sl, long context, const long *path, long c0,
                                      long visible, long h, long kv_heads, long dim, const float *s, long width,
                                      long g, float *part, long part_floats) {
    if (dim % 64) {
        weigh_values(v_pool, sl, context, path, c0, visible, h, kv_heads, dim, s, width, g, part, part_floats);
        return;
    }
    for (long d0 = 0; d0 < dim; d0 += 64)
        for (long x = 0; x < g; x += 3) {
            const float *sx = s + x * width;
            float *px = part + x * part_floats;
            switch (g - x < 3 ? g - x : 3) {
            case 3: weigh_x(3, v_pool, sl, context, path, c0, visible, h, kv_heads, dim, d0, sx, width, px,
                            part_floats); break;
            case 2: weigh_x(2, v_pool, sl, context, path, c0, visible, h, kv_heads, dim, d0, sx, width, px,
                            part_floats); break;
            default: weigh_x(1, v_pool, sl, context, path, c0, visible, h, kv_heads, dim, d0, sx, width, px,
                             part_floats);
            }
        }
}
#else
#define scores8_heads scores8
#define weigh_values_heads weigh_values
#endif

/* One task of paged_attention: every row of one sequence and the query heads of key-value heads [h0, h1) over its
 * keys [c0, c1), into parts ([rows][heads][dim + 2]): per (row, head) the chunk's largest score, its sum of
 * exponentials and the unnormalised weighted sum of values. Two passes rather than an online softmax: every row's
 * scores first (the shared keys read once, in blocks of 8), then each row's softmax and its weighted sum of values
 * with the sums in registers, the values fetched into L2 during the first pass. No softmax between key blocks holds
 * up the next block's loads: 1.4-1.6x faster than an online softmax over K/V in memory. */
static void attend_chunk(const float *q, long q_stride, const float *k_pool, const float *v_pool, const sequence *seq,
                         const long *sl, const long *tree_paths, long path_stride, long c0, long c1, long h0, long h1,
                         long heads, long kv_heads, long dim, float scale, long window, float *parts) {
    long first = seq->first_row, rows = seq->query_rows, context = seq->context, group = heads / kv_heads;
    long hs = (h1 - h0) * group, n = (rows + seq->tree_rows) * hs, width = (c1 - c0 + 7) / 8 * 8;
    float *buf = malloc(sizeof(float) * n * (dim + width));
    long *seen = malloc(sizeof(long) * n);
    float *qs = buf, *scores = buf + n * dim;  /* row-head r = i * hs + (head - h0 * group): row i */
    for (long r = 0; r < n; r++) {
        const float *src = q + (first + r / hs) * q_stride + (h0 * group + r % hs) * dim;
        for (long d = 0; d < dim; d++) qs[r * dim + d] = src[d] * scale;
        long t = r / hs - rows;  /* t >= 0: tree row t */
        seen[r] = t < 0 ? context - rows + r / hs + 1 : context + tree_paths[t * path_stride];
    }
    long row_bytes = (h1 - h0) * dim * (long)sizeof(float);
    for (long b0 = c0; b0 < c1; b0 += 8) {
        /* the values two blocks on into L2, for the second pass (into L1 they evicted the keys) */
        for (long c = b0 + 16; c < b0 + 24 && c < c1 && c < context; c++) {
            const char *vr = (const char *)(v_pool + (sl[c] * kv_heads + h0) * dim);
            for (long o = 0; o < row_bytes; o += 64) _mm_prefetch(vr + o, _MM_HINT_T1);
        }
        for (long h = h0; h < h1; h++) {
            const float *kr[8];  /* the context's keys of this block, shared by every row */
            for (int j = 0; j < 8; j++) kr[j] = k_pool + (key_slot(sl, context, 0, b0 + j) * kv_heads + h) * dim;
            for (long i = 0; i < rows + seq->tree_rows; i++) {
                long t = i - rows, r0 = i * hs + (h - h0) * group;
                if (seen[r0] <= b0) continue;
                const float **krow = kr, *kp[8];
                if (t >= 0 && b0 + 8 > context) {  /* the block reaches into this row's path */
                    for (int j = 0; j < 8; j++)
                        kp[j] = k_pool + (key_slot(sl, context, tree_paths + t * path_stride, b0 + j) * kv_heads + h) * dim;
                    krow = kp;
                }
                scores8_heads(qs, dim, r0, group, krow, scores, width, b0 - c0);
            }
        }
    }
    for (long r0 = 0; r0 < n; r0 += group) {  /* one row's heads of one key-value head: the same keys */
        long i = r0 / hs, hq0 = h0 * group + r0 % hs, h = hq0 / group, t = i - rows;
        const long *path = t >= 0 ? tree_paths + t * path_stride : 0;
        float *part0 = parts + (i * heads + hq0) * (dim + 2);
        long visible = (seen[r0] < c1 ? seen[r0] : c1) - c0;  /* this chunk's keys up to the row's own */
        long hidden = window && seen[r0] - window > c0 ? seen[r0] - window - c0 : 0;  /* those before its window */
        if (visible <= hidden) {
            for (long x = 0; x < group; x++) {
                float *part = part0 + x * (dim + 2);
                part[0] = -INFINITY;
                for (long d = 1; d < dim + 2; d++) part[d] = 0.0f;
            }
            continue;
        }
        long blocks = (visible + 7) / 8 * 8;
        for (long r = r0; r < r0 + group; r++) {
            float *s = scores + r * width, *part = part0 + (r - r0) * (dim + 2);
            for (long c = visible; c < blocks; c++) s[c] = -INFINITY;
            for (long c = 0; c < hidden; c++) s[c] = -INFINITY;
            __m256 mv = _mm256_set1_ps(-INFINITY), lv = _mm256_setzero_ps();
            for (long c = 0; c < blocks; c += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + c));
            float lanes[8], mx = -INFINITY, l = 0.0f;
            _mm256_storeu_ps(lanes, mv);
            for (int j = 0; j < 8; j++) mx = lanes[j] > mx ? lanes[j] : mx;
            for (long c = 0; c < blocks; c += 8) {
                __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + c), _mm256_set1_ps(mx)));
                _mm256_storeu_ps(s + c, e);
                lv = _mm256_add_ps(lv, e);
            }
            _mm256_storeu_ps(lanes, lv);
            for (int j = 0; j < 8; j++) l += lanes[j];
            part[0] = mx;
            part[1] = l;
        }
        weigh_values_heads(v_pool, sl, context, path, c0, visible, h, kv_heads, dim, scores + r0 * width, width,
                           group, part0, dim + 2);
    }
    free(seen);
    free(buf);
}

/* A sequence's tasks per chunk of keys: one per key-value head where its keys are one chunk, or where it has rows
 * enough that the arithmetic outweighs reading each head's keys through strides (a verify step's: a 17-row tree over
 * 3 chunks was 3 tasks for 2 threads); else one over every head. Which task computes a row's sums changes none. */
#define SPLIT_HEADS_ROWS 4
static long head_tasks(const sequence *seq, long chunks, long kv_heads) {
    return chunks == 1 || seq->query_rows + seq->tree_rows >= SPLIT_HEADS_ROWS ? kv_heads : 1;
}

/* Attention of short queries (decode, verify) and draft-tree rows over keys read in place from the paged pool,
 * after writing the batch's new keys and values (its num_new rows of k_new / v_new into its new_slots) to it.
 * Query row i of a sequence sees keys 0 .. context - query_rows + i. Tree row t, after the query rows, sees the whole
 * context and then its path (its ancestors' slots and its own), so its sums run over the keys a decode step at its
 * position would read, in the same chunks and order: a node's output is the one that step gives.
 * Tasks per sequence (attend_chunk): per chunk of keys, one per key-value head or one over every head (head_tasks);
 * then each row's chunks are merged in order (a lone chunk's result as it is). */
void paged_attention(const attention_args *a) {
    const attention_batch *batch = a->batch;
    const float *q = a->q;
    float *out = a->out, *k_pool = a->k_pool, *v_pool = a->v_pool;
    long q_stride = a->q_stride, heads = a->heads, kv_heads = a->kv_heads, dim = a->dim;
    float scale = a->scale;
    const sequence *seqs = batch->seqs;
    const long *slots = batch->slots, *paths = batch->paths;
    long num_seqs = batch->num_seqs, slot_stride = batch->slot_stride, path_stride = batch->path_stride;
    long row = kv_heads * dim;
    for (long t = 0; t < batch->num_new; t++) {
        memcpy(k_pool + batch->new_slots[t] * row, a->k_new + t * a->k_stride, row * sizeof(float));
        memcpy(v_pool + batch->new_slots[t] * row, a->v_new + t * a->v_stride, row * sizeof(float));
    }
    /* per sequence: its keys (its longest row's), its first task and its first part (a part: one chunk's result for
     * one row's heads) */
    long *num_keys = malloc(sizeof(long) * (3 * num_seqs + 2)), *first_task = num_keys + num_seqs,
         *first_part = first_task + num_seqs + 1;
    first_task[0] = first_part[0] = 0;
    for (long b = 0; b < num_seqs; b++) {
        const sequence *seq = seqs + b;
        const long *tree_paths = paths + seq->first_path * path_stride;
        num_keys[b] = seq->context;
        for (long t = 0; t < seq->tree_rows; t++)
            if (seq->context + tree_paths[t * path_stride] > num_keys[b])
                num_keys[b] = seq->context + tree_paths[t * path_stride];
        long chunks = (num_keys[b] + KEY_CHUNK - 1) / KEY_CHUNK;
        first_task[b + 1] = first_task[b] + chunks * head_tasks(seq, chunks, kv_heads);
        first_part[b + 1] = first_part[b] + chunks * (seq->query_rows + seq->tree_rows);
    }
    long part_floats = heads * (dim + 2);
    float *parts = malloc(sizeof(float) * first_part[num_seqs] * part_floats);
    #pragma omp parallel for schedule(dynamic)
    for (long task = 0; task < first_task[num_seqs]; task++) {
        long b = 0;
        while (first_task[b + 1] <= task) b++;
        const sequence *seq = seqs + b;
        long chunks = (num_keys[b] + KEY_CHUNK - 1) / KEY_CHUNK, split = head_tasks(seq, chunks, kv_heads);
        long k = task - first_task[b], j = k / split, h0 = split == 1 ? 0 : k % split, h1 = split == 1 ? kv_heads : h0 + 1;
        long c0 = j * KEY_CHUNK;
        long c1 = c0 + KEY_CHUNK < num_keys[b] ? c0 + KEY_CHUNK : num_keys[b];
        attend_chunk(q, q_stride, k_pool, v_pool, seq, slots + b * slot_stride, paths + seq->first_path * path_stride,
                     path_stride, c0, c1, h0, h1, heads, kv_heads, dim, scale, a->window,
                     parts + (first_part[b] + j * (seq->query_rows + seq->tree_rows)) * part_floats);
    }
    #pragma omp parallel for schedule(static) if (num_seqs >= 4)
    for (long b = 0; b < num_seqs; b++) {
        const sequence *seq = seqs + b;
        long n = seq->query_rows + seq->tree_rows, chunks = (num_keys[b] + KEY_CHUNK - 1) / KEY_CHUNK;
        for (long r = 0; r < n * heads; r++) {  /* r = i * heads + hq */
            float *dst = out + ((seq->first_row + r / heads) * heads + r % heads) * dim;
            const float *part = parts + first_part[b] * part_floats + r * (dim + 2);
            if (chunks == 1 && !a->sinks) {
                float inv = 1.0f / part[1];
                for (long d = 0; d < dim; d++) dst[d] = part[2 + d] * inv;
                continue;
            }
            float mx = a->sinks ? a->sinks[r % heads] : -INFINITY, l = 0.0f;
            for (long j = 0; j < chunks; j++) {
                float m = part[j * n * part_floats];
                mx = m > mx ? m : mx;
            }
            if (a->sinks) l = expf(a->sinks[r % heads] - mx);
            for (long d = 0; d < dim; d++) dst[d] = 0.0f;
            for (long j = 0; j < chunks; j++) {
                const float *pj = part + j * n * part_floats;
                if (pj[0] == -INFINITY) continue;
                float w = expf(pj[0] - mx);
                l += pj[1] * w;
                for (long d = 0; d < dim; d++) dst[d] += pj[2 + d] * w;
            }
            float inv = 1.0f / l;
            for (long d = 0; d < dim; d++) dst[d] *= inv;
        }
    }
    free(parts);
    free(num_keys);
}

/* Whether xr[c], at an index after best, takes the lead from xr[best] in torch.argmax's order: larger, or the first
 * NaN (a NaN, once best, keeps it). */
static inline int later_wins(const float *xr, long best, long c) {
    return !isnan(xr[best]) && (isnan(xr[c]) || xr[c] > xr[best]);
}

/* The index of the largest value among xr[lo .. hi), the first one on ties and the first NaN if any, as
 * torch.argmax. Each lane keeps its own first best; the lanes then resolve by value and index. */
static long argmax_range(const float *xr, long lo, long hi) {
    long best = lo, i = lo + 1;
    if (hi - lo >= 8) {
        __m256 bv = _mm256_loadu_ps(xr + lo);
        __m256i bi = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), idx = bi, step = _mm256_set1_epi32(8);
        for (i = lo + 8; i + 8 <= hi; i += 8) {
            __m256 v = _mm256_loadu_ps(xr + i);
            idx = _mm256_add_epi32(idx, step);
            /* v wins if larger, or if it is the lane's first NaN */
            __m256 win = _mm256_or_ps(_mm256_cmp_ps(v, bv, _CMP_GT_OQ),
                                      _mm256_and_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q), _mm256_cmp_ps(bv, bv, _CMP_ORD_Q)));
            bv = _mm256_blendv_ps(bv, v, win);
            bi = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(bi), _mm256_castsi256_ps(idx), win));
        }
        float lv[8];
        int li[8];
        _mm256_storeu_ps(lv, bv);
        _mm256_storeu_si256((__m256i *)li, bi);
        best = lo + li[0];
        for (int j = 1; j < 8; j++) {
            long c = lo + li[j];
            float a = lv[j], b = xr[best];
            int better = isnan(a) ? (!isnan(b) || c < best) : (!isnan(b) && (a > b || (a == b && c < best)));
            if (better) best = c;
        }
    }
    for (; i < hi; i++)  /* the tail past the last 8, or the whole range when it is shorter */
        if (later_wins(xr, best, i)) best = i;
    return best;
}

/* The index of each row's largest value (argmax_range over the whole row): rows of n floats, ldx apart. Each thread
 * takes the columns of the panels few_rows gives it, still in its caches after a product has written them, and the
 * threads' bests are resolved in column order: the index one pass over the row finds. */
void argmax_rows(const float *x, long rows, long ldx, long n, long *out) {
    long panels = (n + NR - 1) / NR, threads = omp_get_max_threads();
    long *found = malloc(sizeof(long) * rows * threads);
    for (long i = 0; i < rows * threads; i++) found[i] = -1;
    #pragma omp parallel
    {
        long count = omp_get_num_threads(), t = omp_get_thread_num();
        long lo = panels * t / count * NR, hi = panels * (t + 1) / count * NR;
        hi = hi < n ? hi : n;
        if (lo < hi)
            for (long r = 0; r < rows; r++) found[r * threads + t] = argmax_range(x + r * ldx, lo, hi);
    }
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        long best = -1;
        for (long t = 0; t < threads; t++) {
            long c = found[r * threads + t];
            if (c >= 0 && (best < 0 || later_wins(xr, best, c))) best = c;
        }
        out[r] = best;
    }
    free(found);
}

/* Index c into best, the indices of the (up to k, *found held) largest of xr in order, where it belongs: after those
 * at least as large, so that of equal values the lower index, seen first, stays first. */
static inline void keep_largest(const float *xr, long c, long *best, long *found, long k) {
    if (*found == k && !(xr[c] > xr[best[k - 1]])) return;
    long at = *found < k ? (*found)++ : k - 1;
    for (; at > 0 && xr[c] > xr[best[at - 1]]; at--) best[at] = best[at - 1];
    best[at] = c;
}

/* A drafter's scores of its most likely drafts: the k largest values of each row of x (rows of n floats, ldx apart),
 * largest first (the lower index first on ties), as log-probabilities under softmax(x / t[r * t_stride]) (t_stride 0:
 * one temperature for every row), into logp [rows][k], and their indices into idx [rows][k]. One pass over a row for
 * its maximum, one for the sum of exponentials and the k largest: serving/drafters/confidence.py's top_log_probs,
 * where torch's log-softmax and top-k were two operators and a tensor of every log-probability, each draft of every
 * head drafter. */
void top_log_probs(const float *x, long rows, long ldx, long n, const float *t, long t_stride, long k, float *logp,
                   long *idx) {
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        float tr = t[r * t_stride];
        float *lp = logp + r * k;
        long *best = idx + r * k, found = 0;
        float top = xr[argmax_range(xr, 0, n)] / tr;  /* the largest of x / t: t > 0 */
        __m256 tv = _mm256_set1_ps(tr), topv = _mm256_set1_ps(top), sv = _mm256_setzero_ps();
        long i = 0;
        for (; i + 8 <= n; i += 8) {
            __m256 v = _mm256_loadu_ps(xr + i);
            sv = _mm256_add_ps(sv, exp8(_mm256_sub_ps(_mm256_div_ps(v, tv), topv)));
            /* most blocks hold nothing above the k-th largest so far */
            if (found < k || _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(xr[best[k - 1]]), _CMP_GT_OQ)))
                for (long c = i; c < i + 8; c++) keep_largest(xr, c, best, &found, k);
        }
        float lanes[8], sum = 0.0f;
        _mm256_storeu_ps(lanes, sv);
        for (int j = 0; j < 8; j++) sum += lanes[j];
        for (; i < n; i++) {
            sum += expf(xr[i] / tr - top);
            keep_largest(xr, i, best, &found, k);
        }
        float log_sum = logf(sum);
        for (long j = 0; j < k; j++) lp[j] = xr[best[j]] / tr - top - log_sum;
    }
}

/* x * cos + roll(x, dim / 2) * sin per head, in place: heads.rope.apply_rope, each product and the sum rounded
 * as torch rounds them (no fused multiply-add). */
__attribute__((optimize("fp-contract=off")))
static void rope(float *x, long rows, long ldx, long heads, long dim, const float *cos, const float *sin) {
    long half = dim / 2;
    float t[dim];
    for (long r = 0; r < rows; r++) {
        const float *c = cos + r * dim, *s = sin + r * dim;
        for (long h = 0; h < heads; h++) {
            float *v = x + r * ldx + h * dim;
            for (long i = 0; i < dim; i++) {
                float a = v[i] * c[i], b = v[i < half ? i + half : i - half] * s[i];
                t[i] = a + b;
            }
            memcpy(v, t, dim * sizeof(float));
        }
    }
}

/* out[r] = silu(gate) * up for rows of [gate | up], n each; silu(g) = g / (1 + e^-g). */
static void silu_mul(const float *gu, long rows, long n, float *out) {
    #pragma omp parallel for schedule(static) if (rows * n >= 65536)
    for (long r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * n, *u = g + n;
        float *o = out + r * n;
        long i = 0;
        for (; i + 8 <= n; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 e = exp8(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), gv), _mm256_set1_ps(88.0f)));
            __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
        }
        for (; i < n; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* A decoder layer of heads/layer.py around its attention, in two calls (the attention runs between them, from
 * serving/attention.py), so that a step makes three calls per layer instead of some twenty torch operators. Every
 * part computes a row from that row alone, as the separate kernels do.
 * Before attention: normed = input_norm(h); qkv = normed @ W_qkv (+ bias) (or x @ W_qkv, or h @ W_qkv: layer_step.x); the query and key heads normed (Qwen3)
 * and rotated in place. */
void layer_pre(const layer_step *s) {
    const layer_weights *L = s->weights;
    long rows = s->rows, n = (L->heads + 2 * L->kv_heads) * L->dim;
    float *qkv = s->qkv;
    const float *x = s->x ? s->x : L->input_norm ? s->normed : s->h;
    if (!s->x && L->input_norm) rms_norm(s->h, rows, L->hidden, L->input_norm, L->eps, s->normed, L->hidden, L->hidden);
    gemm(x, rows, L->input_size, L->qkv, L->format, L->streams, L->input_size, n, L->qkv_bias, 0, qkv, n);
    if (L->q_norm)
        for (long r = 0; r < rows; r++) {
            float *q = qkv + r * n, *k = q + L->heads * L->dim;
            rms_norm(q, L->heads, L->dim, L->q_norm, L->eps, q, L->dim, L->dim);
            rms_norm(k, L->kv_heads, L->dim, L->k_norm, L->eps, k, L->dim, L->dim);
        }
    rope(qkv, rows, n, L->heads + L->kv_heads, L->dim, s->cos, s->sin);
}

/* After attention: out = h + attn @ W_o; normed = post_norm(out); gate_up = normed @ W_gate_up;
 * act = silu(gate) * up; out += act @ W_down. */
void layer_post(const layer_step *s) {
    const layer_weights *L = s->weights;
    long rows = s->rows, q_size = L->heads * L->dim, n = L->intermediate;
    gemm(s->attn, rows, q_size, L->o, L->format, L->streams, q_size, L->hidden, 0, s->h, s->out, L->hidden);
    rms_norm(s->out, rows, L->hidden, L->post_norm, L->eps, s->normed, L->hidden, L->hidden);
    gemm(s->normed, rows, L->hidden, L->gate_up, L->format, L->streams, L->hidden, 2 * n, 0, 0, s->gate_up, 2 * n);
    silu_mul(s->gate_up, rows, n, s->act);
    gemm(s->act, rows, n, L->down, L->format, L->streams, n, L->hidden, 0, s->out, s->out, L->hidden);
}

/* One layer's paged_attention over a forward_scratch: the queries, keys and values layer_pre left in qkv, the output
 * into attn (and the step's keys and values into the pools at the batch's new_slots). */
static void scratch_attention(const layer_weights *L, const forward_scratch *w, float *k_pool, float *v_pool,
                              float scale, long window, const attention_batch *batch) {
    long q_size = L->heads * L->dim, kv_size = L->kv_heads * L->dim, n = q_size + 2 * kv_size;
    attention_args attention = {w->qkv, n, w->attn, k_pool, v_pool, w->qkv + q_size, w->qkv + q_size + kv_size, n, n,
                                L->heads, L->kv_heads, L->dim, scale, window, 0, batch};
    paged_attention(&attention);
}

/* A forward's first rows: 0 when every id is in [0, vocab) and every position in [0, max_positions), else -1. */
static long rows_in_range(const long *ids, const long *positions, long rows, long vocab, long max_positions) {
    for (long r = 0; r < rows; r++)
        if (ids[r] < 0 || ids[r] >= vocab || positions[r] < 0 || positions[r] >= max_positions) return -1;
    return 0;
}

/* Each row's embedding (into h, ldh floats from row to row) and its position's rope rows (into the scratch's cos and
 * sin). */
static void gather_rows(const long *ids, const long *positions, long rows, const float *embed, long hidden, float *h,
                        long ldh, const float *cos_table, const float *sin_table, long dim, const forward_scratch *w) {
    for (long r = 0; r < rows; r++) {
        memcpy(h + r * ldh, embed + ids[r] * hidden, hidden * sizeof(float));
        memcpy(w->cos + r * dim, cos_table + positions[r] * dim, dim * sizeof(float));
        memcpy(w->sin + r * dim, sin_table + positions[r] * dim, dim * sizeof(float));
    }
}

/* Layers [first, stop) of the model, one after another, on a step whose every sequence attends through
 * paged_attention (a decode or verify step): per layer layer_pre, the attention over that layer's pools, which also
 * writes the step's keys and values into the batch's new_slots, and layer_post: the kernels a layer loop in Python
 * calls, in the same order, so the same results. The scratch's h: [rows, hidden], the input, overwritten by the
 * output. */
static void decoder_layers(const forward_args *f, long first, long stop) {
    const forward_scratch *w = &f->scratch;
    layer_step step = {0, f->rows, w->h, w->normed, w->qkv, w->cos, w->sin, w->attn, w->h, w->gate_up, w->act,
                       0};  /* x: input_norm(h) */
    for (long l = first; l < stop; l++) {
        step.weights = f->layers + l;
        layer_pre(&step);
        scratch_attention(step.weights, w, f->kv.k_pool + l * f->kv.layer_floats, f->kv.v_pool + l * f->kv.layer_floats,
                          f->scale, 0, f->kv.batch);
        layer_post(&step);  /* in place: h is read only by layer_post's first sum */
    }
}

/* The target's whole forward on a step whose every sequence attends through paged_attention (a decode or verify
 * step), as serving/model.py's Model.forward computes it operator by operator: each row's embedding and rope rows by
 * its id and position, the layers by decoder_layers, a copy of the states before each of the aux layers, the final
 * norm of every row into hidden_out (when not NULL) and of the logits rows into the scratch's `selected`, the LM
 * head's product into logits and each logits row's argmax into best.
 * The Python between these steps read every cache line of its state anew after the layers' weights had streamed
 * through the caches. Returns 0, or -1 (computing nothing) when an id, a position or a logits row is out of range. */
long model_forward(const forward_args *f) {
    const forward_scratch *w = &f->scratch;
    long hidden = f->layers->hidden, dim = f->layers->dim, rows = f->rows;
    if (rows_in_range(f->ids, f->positions, rows, f->vocab, f->max_positions)) return -1;
    for (long i = 0; f->logits_rows && i < f->num_logits; i++)
        if (f->logits_rows[i] < 0 || f->logits_rows[i] >= rows) return -1;
    gather_rows(f->ids, f->positions, rows, f->embed, hidden, w->h, hidden, f->cos_table, f->sin_table, dim, w);
    long start = 0;
    for (long a = 0; a <= f->num_aux; a++) {
        long stop = a < f->num_aux ? f->aux_layers[a] : f->num_layers;
        decoder_layers(f, start, stop);
        if (a < f->num_aux) memcpy(f->aux + a * rows * hidden, w->h, rows * hidden * sizeof(float));
        start = stop;
    }
    if (f->hidden_out) rms_norm(w->h, rows, hidden, f->norm, f->eps, f->hidden_out, hidden, hidden);
    for (long i = 0; i < f->num_logits; i++)
        rms_norm(w->h + (f->logits_rows ? f->logits_rows[i] : i) * hidden, 1, hidden, f->norm, f->eps,
                 w->selected + i * hidden, hidden, hidden);
    if (f->num_logits) {
        gemm(w->selected, f->num_logits, hidden, f->lm_head, (int)f->lm_format, 1, hidden, f->vocab, 0, 0, f->logits,
             f->vocab);
        argmax_rows(f->logits, f->num_logits, f->vocab, f->vocab, f->best);
    }
    return 0;
}

/* EAGLE-3's draft forward (heads/eagle3.py, Eagle3.forward, whose layer is a KernelLayer) in one call, for draft
 * steps whose every sequence attends through paged_attention: x = concat(input_norm(embed[ids]), hidden_norm(g)), the
 * layer over the residual g (or hidden_norm(g)) with x as the attention's input, then the final norm where
 * norm_output. The kernels the module calls one by one, in the same order: the same bits. A draft forward at a few
 * rows was some fifteen torch calls around the layer's two. Returns 0, or -1 (computing nothing) when an id or a
 * position is out of range. */
long eagle3_forward(const eagle3_args *a) {
    const layer_weights *L = a->layer;
    const forward_scratch *w = &a->scratch;
    long hidden = L->hidden, rows = a->rows, wide = 2 * hidden;
    if (rows_in_range(a->ids, a->positions, rows, a->vocab, a->max_positions)) return -1;
    gather_rows(a->ids, a->positions, rows, a->embed, hidden, a->x, wide, a->cos_table, a->sin_table, L->dim, w);
    rms_norm(a->x, rows, wide, a->input_norm, L->eps, a->x, wide, hidden);
    rms_norm(a->g, rows, hidden, a->hidden_norm, L->eps, a->x + hidden, wide, hidden);
    const float *residual = a->g;
    if (a->norm_before_residual) {  /* layer_post adds to rows of hidden floats */
        for (long r = 0; r < rows; r++) memcpy(w->h + r * hidden, a->x + r * wide + hidden, hidden * sizeof(float));
        residual = w->h;
    }
    layer_step step = {L, rows, residual, w->normed, w->qkv, w->cos, w->sin, w->attn, a->out, w->gate_up, w->act,
                       a->x};
    layer_pre(&step);
    scratch_attention(L, w, a->kv.k_pool, a->kv.v_pool, a->scale, a->window, a->kv.batch);
    layer_post(&step);
    if (a->norm_output) rms_norm(a->out, rows, hidden, a->norm, L->eps, a->out, hidden, hidden);
    return 0;
}

/* Each struct field's offset and size, and each struct's size (field NULL), in declaration order, for the test that
 * checks serving/kernel_abi.py's Structures against them. */
typedef struct {
    const char *type, *field;
    long offset, size;
} field_layout;
#define FIELD(T, F) {#T, #F, offsetof(T, F), sizeof(((T *)0)->F)}
#define SIZE(T) {#T, 0, 0, sizeof(T)}
static const field_layout layouts[] = {
    SIZE(layer_weights), FIELD(layer_weights, input_norm), FIELD(layer_weights, post_norm),
    FIELD(layer_weights, q_norm), FIELD(layer_weights, k_norm), FIELD(layer_weights, qkv), FIELD(layer_weights, o),
    FIELD(layer_weights, gate_up), FIELD(layer_weights, down), FIELD(layer_weights, qkv_bias),
    FIELD(layer_weights, format), FIELD(layer_weights, streams), FIELD(layer_weights, hidden), FIELD(layer_weights, heads),
    FIELD(layer_weights, kv_heads), FIELD(layer_weights, dim), FIELD(layer_weights, intermediate),
    FIELD(layer_weights, input_size), FIELD(layer_weights, eps),
    SIZE(sequence), FIELD(sequence, first_row), FIELD(sequence, query_rows), FIELD(sequence, context),
    FIELD(sequence, tree_rows), FIELD(sequence, first_path),
    SIZE(attention_batch), FIELD(attention_batch, new_slots), FIELD(attention_batch, num_new),
    FIELD(attention_batch, seqs), FIELD(attention_batch, num_seqs), FIELD(attention_batch, slots),
    FIELD(attention_batch, slot_stride), FIELD(attention_batch, paths), FIELD(attention_batch, path_stride),
    SIZE(attention_args), FIELD(attention_args, q), FIELD(attention_args, q_stride), FIELD(attention_args, out),
    FIELD(attention_args, k_pool), FIELD(attention_args, v_pool), FIELD(attention_args, k_new),
    FIELD(attention_args, v_new), FIELD(attention_args, k_stride), FIELD(attention_args, v_stride),
    FIELD(attention_args, heads), FIELD(attention_args, kv_heads), FIELD(attention_args, dim),
    FIELD(attention_args, scale), FIELD(attention_args, window), FIELD(attention_args, sinks),
    FIELD(attention_args, batch),
    SIZE(layer_step), FIELD(layer_step, weights), FIELD(layer_step, rows), FIELD(layer_step, h),
    FIELD(layer_step, normed), FIELD(layer_step, qkv), FIELD(layer_step, cos), FIELD(layer_step, sin),
    FIELD(layer_step, attn), FIELD(layer_step, out), FIELD(layer_step, gate_up), FIELD(layer_step, act), FIELD(layer_step, x),
    SIZE(paged_kv), FIELD(paged_kv, k_pool), FIELD(paged_kv, v_pool), FIELD(paged_kv, layer_floats),
    FIELD(paged_kv, batch),
    SIZE(forward_scratch), FIELD(forward_scratch, h), FIELD(forward_scratch, normed), FIELD(forward_scratch, qkv),
    FIELD(forward_scratch, attn), FIELD(forward_scratch, gate_up), FIELD(forward_scratch, act),
    FIELD(forward_scratch, cos), FIELD(forward_scratch, sin), FIELD(forward_scratch, selected),
    SIZE(forward_args), FIELD(forward_args, layers), FIELD(forward_args, num_layers), FIELD(forward_args, embed),
    FIELD(forward_args, vocab), FIELD(forward_args, cos_table), FIELD(forward_args, sin_table),
    FIELD(forward_args, max_positions), FIELD(forward_args, norm), FIELD(forward_args, eps),
    FIELD(forward_args, lm_head), FIELD(forward_args, lm_format), FIELD(forward_args, scale), FIELD(forward_args, ids),
    FIELD(forward_args, positions), FIELD(forward_args, rows), FIELD(forward_args, aux_layers),
    FIELD(forward_args, num_aux), FIELD(forward_args, logits_rows), FIELD(forward_args, num_logits),
    FIELD(forward_args, aux), FIELD(forward_args, hidden_out), FIELD(forward_args, logits), FIELD(forward_args, best),
    FIELD(forward_args, kv), FIELD(forward_args, scratch),
    SIZE(eagle3_args), FIELD(eagle3_args, layer), FIELD(eagle3_args, embed), FIELD(eagle3_args, vocab),
    FIELD(eagle3_args, input_norm), FIELD(eagle3_args, hidden_norm), FIELD(eagle3_args, norm),
    FIELD(eagle3_args, norm_before_residual), FIELD(eagle3_args, norm_output), FIELD(eagle3_args, cos_table),
    FIELD(eagle3_args, sin_table), FIELD(eagle3_args, max_positions), FIELD(eagle3_args, scale),
    FIELD(eagle3_args, window), FIELD(eagle3_args, kv), FIELD(eagle3_args, ids), FIELD(eagle3_args, positions),
    FIELD(eagle3_args, rows), FIELD(eagle3_args, g), FIELD(eagle3_args, x), FIELD(eagle3_args, scratch),
    FIELD(eagle3_args, out),
};

/* The layouts above and their count. */
long kernel_layouts(const field_layout **out) {
    *out = layouts;
    return sizeof(layouts) / sizeof(layouts[0]);
}
