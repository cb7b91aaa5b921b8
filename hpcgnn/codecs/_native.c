/* Quantisation kernels for CPU ranks: one pass over the rows, the same numbers as the torch
 * path in quant.py (built with -ffp-contract=off so no multiply-add is fused differently).
 *
 * Row layout (row_bytes = 6 + ceil(width * bits / 8)):
 *   lo   float32  the row minimum, exact
 *   step bfloat16 (max - lo) / (2^bits - 1) rounded up to bfloat16, at least 2^-126 (0 for a
 *        constant row)
 *   codes, 8 / bits per byte, code j at bit (j % (8 / bits)) * bits of byte j / (8 / bits)
 * q = min(levels, floor((x - lo) * (1 / step) + u)), u = (u16 + 0.5) / 2^16, with u16 the
 * 16-bit half (c % 2) of h(r, c / 2) = hash32(hash32(key ^ hash32(r)) ^ col(c / 2)).
 */
#include <stdint.h>
#include <string.h>

/* The loops whose results do not depend on the instruction set (integer hashing, and float
 * sums kept in their sequential order with -ffp-contract=off: no FMA) are compiled for AVX-512,
 * AVX2 and the baseline, and the loader picks the best the CPU has (GNU ifunc). */
#if defined(__x86_64__) && defined(__GLIBC__) && (defined(__clang__) || __GNUC__ >= 6)
#define MULTIARCH __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MULTIARCH
#endif

static inline uint32_t hash32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    x ^= x >> 16;
    return x;
}

static inline uint32_t col_seed(uint32_t g) { return hash32(g * 0x9E3779B1u + 0x7F4A7C15u); }

/* the smallest step of a row that is not constant: FLT_MIN (2^-126, a bfloat16), so that
 * 1 / step is finite; a subnormal step's reciprocal overflows */
#define MIN_STEP 0x1p-126f

static inline float bf16_up(float v) {           /* round a positive float up to bfloat16 */
    uint32_t b;
    memcpy(&b, &v, 4);
    if (b & 0xFFFFu) b = (b & 0xFFFF0000u) + 0x10000u;
    else b &= 0xFFFF0000u;
    memcpy(&v, &b, 4);
    return v;
}

int64_t hpcgnn_quant_row_bytes(int64_t width, int bits) { return 6 + (width * bits + 7) / 8; }

/* one row: codes[c] in [0, levels] from x, lo, inv and the row's noise (u16 per value) */
static void row_codes(const float *xr, int64_t width, float lo, float inv, float levels,
                      uint32_t row, const uint32_t *cols, uint32_t *noise, uint8_t *codes) {
    const int64_t groups = (width + 1) / 2;
    for (int64_t g = 0; g < groups; g++) noise[g] = hash32(row ^ cols[g]);
    const uint16_t *n16 = (const uint16_t *)noise;     /* little endian: half c % 2 of group c / 2 */
    for (int64_t c = 0; c < width; c++) {
        float u = ((float)n16[c] + 0.5f) * (1.0f / 65536.0f);
        float t = (xr[c] - lo) * inv;
        float v = t + u;
        v = v < levels ? v : levels;
        codes[c] = (uint8_t)(int)v;
    }
}

#define PACK(BITS)                                                                         \
    static void pack##BITS(const uint8_t *codes, int64_t width, uint8_t *out) {            \
        enum { PER = 8 / BITS };                                                           \
        const int64_t full = width / PER;                                                  \
        for (int64_t j = 0; j < full; j++) {                                               \
            uint8_t byte = 0;                                                              \
            for (int i = 0; i < PER; i++) byte |= (uint8_t)(codes[j * PER + i] << (i * BITS)); \
            out[j] = byte;                                                                 \
        }                                                                                  \
        if (full * PER < width) {                                                          \
            uint8_t byte = 0;                                                              \
            for (int64_t c = full * PER; c < width; c++)                                   \
                byte |= (uint8_t)(codes[c] << ((c - full * PER) * BITS));                  \
            out[full] = byte;                                                              \
        }                                                                                  \
    }                                                                                      \
    static void unpack##BITS(const uint8_t *packed, int64_t width, float lo, float step,  \
                             float *o) {                                                   \
        enum { PER = 8 / BITS, MASK = (1 << BITS) - 1 };                                   \
        const int64_t full = width / PER;                                                  \
        for (int64_t j = 0; j < full; j++) {                                               \
            const uint8_t b = packed[j];                                                   \
            for (int i = 0; i < PER; i++) {                                                \
                float p = (float)((b >> (i * BITS)) & MASK) * step;                        \
                o[j * PER + i] = p + lo;                                                   \
            }                                                                              \
        }                                                                                  \
        for (int64_t c = full * PER; c < width; c++) {                                     \
            float p = (float)((packed[full] >> ((c - full * PER) * BITS)) & MASK) * step;  \
            o[c] = p + lo;                                                                 \
        }                                                                                  \
    }
PACK(1)
PACK(2)
PACK(4)
PACK(8)

/* Faster forms of pack1/pack2 and unpack1/2/4 with the same bytes and floats. Packing: eight
 * 0/1 codes (one byte each) read as one little-endian uint64 and multiplied by
 * 0x0102040810204080 put code i at bit 56 + i, so the top byte is the packed byte (no carries
 * reach it: checked over all 256 inputs); four 2-bit codes likewise with 0x01041040 in 32 bits
 * (all 256 inputs). tests/test_codecs.py compares the bytes with the numpy reference.
 * Unpacking: a table gives the codes of every byte value as floats, so a row decodes as
 * code * step + lo over contiguous floats (the same two roundings as above). */
static float unpack_table1[256][8], unpack_table2[256][4], unpack_table4[256][2];

__attribute__((constructor)) static void init_unpack_tables(void) {
    for (int b = 0; b < 256; b++) {
        for (int i = 0; i < 8; i++) unpack_table1[b][i] = (float)((b >> i) & 1);
        for (int i = 0; i < 4; i++) unpack_table2[b][i] = (float)((b >> (2 * i)) & 3);
        for (int i = 0; i < 2; i++) unpack_table4[b][i] = (float)((b >> (4 * i)) & 15);
    }
}

#define PACK_FAST(BITS, WORD, MAGIC)                                                        \
    static void pack##BITS##_fast(const uint8_t *codes, int64_t width, uint8_t *out) {       \
        enum { PER = 8 / BITS };                                                             \
        const int64_t full = width / PER;                                                    \
        for (int64_t j = 0; j < full; j++) {                                                 \
            WORD v;                                                                          \
            memcpy(&v, codes + PER * j, PER);                                                \
            out[j] = (uint8_t)((WORD)(v * MAGIC) >> (8 * PER - 8));                          \
        }                                                                                    \
        if (full * PER < width) pack##BITS(codes + full * PER, width - full * PER, out + full); \
    }
PACK_FAST(1, uint64_t, 0x0102040810204080ull)
PACK_FAST(2, uint32_t, 0x01041040u)

#define UNPACK_FAST(BITS)                                                                  \
    static void unpack##BITS##_fast(const uint8_t *packed, int64_t width, float lo,       \
                                    float step, float *restrict o) {                       \
        enum { PER = 8 / BITS };                                                           \
        const int64_t full = width / PER;                                                  \
        for (int64_t j = 0; j < full; j++) {                                               \
            const float *restrict t = unpack_table##BITS[packed[j]];                       \
            for (int i = 0; i < PER; i++) {                                                \
                float p = t[i] * step;                                                     \
                o[j * PER + i] = p + lo;                                                   \
            }                                                                              \
        }                                                                                  \
        if (full * PER < width)                                                            \
            unpack##BITS(packed + full, width - full * PER, lo, step, o + full * PER);     \
    }
UNPACK_FAST(1)
UNPACK_FAST(2)
UNPACK_FAST(4)

/* Multi-versioned (MULTIARCH): the hashing, the stochastic rounding (a subtract, a multiply and
 * an add, no FMA) and the packing give the same bytes on every instruction set; the row's
 * minimum and maximum are the same values whatever the vector width (a row whose minimum is a
 * zero of both signs may carry either sign in its header: it decodes to the same numbers). On
 * an AVX-512 machine this encode took 12-37 % less time than the baseline build at 64-256
 * channels and 5-16 % more at 16 (bench/results/codecs-2core-2026-11-28.md); the decode stays
 * on the baseline build, where the 4-bit table unpacking was faster. */
MULTIARCH void hpcgnn_quant_encode(const float *x, int64_t rows, int64_t width, int bits,
                                   uint32_t key, const uint32_t *cols, uint8_t *out) {
    const int64_t rb = hpcgnn_quant_row_bytes(width, bits);
    const float levels = (float)((1 << bits) - 1);
    uint8_t codes[width + 8];
    uint32_t noise[(width + 1) / 2 + 1];
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * width;
        uint8_t *o = out + r * rb;
        float lo = xr[0], hi = xr[0];
        for (int64_t c = 1; c < width; c++) {
            lo = xr[c] < lo ? xr[c] : lo;
            hi = xr[c] > hi ? xr[c] : hi;
        }
        float step = hi > lo ? bf16_up((hi - lo) / levels) : 0.0f;
        if (hi > lo && step < MIN_STEP) step = MIN_STEP;   /* 1 / step stays finite */
        float inv = step > 0.0f ? 1.0f / step : 0.0f;
        uint32_t sbits;
        memcpy(&sbits, &step, 4);
        uint16_t s16 = (uint16_t)(sbits >> 16);
        memcpy(o, &lo, 4);
        memcpy(o + 4, &s16, 2);
        row_codes(xr, width, lo, inv, levels, hash32(hash32((uint32_t)r) ^ key), cols, noise, codes);
        switch (bits) {
            case 1: pack1_fast(codes, width, o + 6); break;
            case 2: pack2_fast(codes, width, o + 6); break;
            case 4: pack4(codes, width, o + 6); break;
            default: pack8(codes, width, o + 6); break;
        }
    }
}

void hpcgnn_quant_decode(const uint8_t *buf, int64_t rows, int64_t width, int bits, float *out) {
    const int64_t rb = hpcgnn_quant_row_bytes(width, bits);
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = buf + r * rb;
        float lo, step;
        uint16_t s16;
        memcpy(&lo, row, 4);
        memcpy(&s16, row + 4, 2);
        uint32_t sbits = (uint32_t)s16 << 16;
        memcpy(&step, &sbits, 4);
        float *o = out + r * width;
        switch (bits) {
            case 1: unpack1_fast(row + 6, width, lo, step, o); break;
            case 2: unpack2_fast(row + 6, width, lo, step, o); break;
            case 4: unpack4_fast(row + 6, width, lo, step, o); break;
            default: unpack8(row + 6, width, lo, step, o); break;
        }
    }
}

/* Counter-based dropout's keep bits (hpcgnn/nn/dropout.py keep_mask): element (r, c) is kept
 * where hash32(rows[r] ^ cols[c]) >= threshold, with rows[r] and cols[c] the 32-bit row and
 * channel hashes the torch path computes; out is (n, width) bytes of 0/1 (a torch bool tensor). */
MULTIARCH void hpcgnn_dropout_keep(const int64_t *rows, const int64_t *cols, int64_t n, int64_t width,
                         uint64_t threshold, uint8_t *out) {
    for (int64_t r = 0; r < n; r++) {
        const uint32_t h = (uint32_t)rows[r];
        uint8_t *o = out + r * width;
        for (int64_t c = 0; c < width; c++)
            o[c] = (uint64_t)hash32(h ^ (uint32_t)cols[c]) >= threshold;
    }
}

/* The same bits applied as the torch path applies them, y = x * (keep * scale) (so an inf or NaN
 * dropped is NaN there too), branch-free (the bits are coin flips). No mask is written: the
 * backward applies this same function to the gradient (hashing again costs less than writing
 * and reading a byte per element). The channel hashes are taken to 32 bits a block at a time so
 * that the loop is one vector type (it vectorises to 16 lanes on AVX-512). */
#define DROPOUT_BLOCK 256
MULTIARCH void hpcgnn_dropout_apply(const float *x, const int64_t *rows, const int64_t *cols,
                                    int64_t n, int64_t width, uint64_t threshold, float scale,
                                    float *y) {
    uint32_t c32[DROPOUT_BLOCK];
    const uint32_t thr = (uint32_t)threshold;        /* p < 1, so threshold < 2^32 */
    for (int64_t c0 = 0; c0 < width; c0 += DROPOUT_BLOCK) {
        const int64_t w = width - c0 < DROPOUT_BLOCK ? width - c0 : DROPOUT_BLOCK;
        for (int64_t c = 0; c < w; c++) c32[c] = (uint32_t)cols[c0 + c];
        for (int64_t r = 0; r < n; r++) {
            const uint32_t h = (uint32_t)rows[r];
            const float *restrict xr = x + r * width + c0;
            float *restrict yr = y + r * width + c0;
            float ks[DROPOUT_BLOCK];                   /* keep * scale: selected into an array,
                                                          then multiplied, so that the loop is
                                                          vectorised without a branch */
            for (int64_t c = 0; c < w; c++) ks[c] = hash32(h ^ c32[c]) >= thr ? scale : 0.0f;
            for (int64_t c = 0; c < w; c++) yr[c] = xr[c] * ks[c];
        }
    }
}

/* Sparse times dense, one output row o (w) = row r of A x with A in CSR (int64 indptr and
 * indices, float values) and x (m, w) row-major: the row sums its non-zeros in CSR order,
 * ((v0 x0 + v1 x1) + v2 x2) + ..., whatever the unrolling, so the result is the same on every
 * instruction set and for any split of the rows between threads. Four non-zeros per pass over
 * the output row: a row of 64-256 channels stays in registers / L1 while the four source rows
 * stream in. */
static inline __attribute__((always_inline)) void spmm_row(
        const int64_t *indptr, const int64_t *indices, const float *values, int64_t r,
        const float *restrict x, int64_t w, float *restrict o) {
    int64_t e = indptr[r];
    const int64_t end = indptr[r + 1];
    if (e == end) {
        memset(o, 0, (size_t)w * sizeof(float));
        return;
    }
    {
        const float v = values[e];
        const float *restrict xr = x + indices[e] * w;
        for (int64_t c = 0; c < w; c++) o[c] = v * xr[c];
        e++;
    }
    for (; e + 3 < end; e += 4) {
        const float v0 = values[e], v1 = values[e + 1], v2 = values[e + 2], v3 = values[e + 3];
        const float *restrict x0 = x + indices[e] * w, *restrict x1 = x + indices[e + 1] * w;
        const float *restrict x2 = x + indices[e + 2] * w, *restrict x3 = x + indices[e + 3] * w;
        for (int64_t c = 0; c < w; c++)
            o[c] = (((o[c] + v0 * x0[c]) + v1 * x1[c]) + v2 * x2[c]) + v3 * x3[c];
    }
    for (; e < end; e++) {
        const float v = values[e];
        const float *restrict xr = x + indices[e] * w;
        for (int64_t c = 0; c < w; c++) o[c] += v * xr[c];
    }
}

/* Rows r0 <= r < r1 of out (n, w) = A x (spmm_row). */
MULTIARCH void hpcgnn_spmm(const int64_t *indptr, const int64_t *indices, const float *values,
                           int64_t r0, int64_t r1, const float *restrict x, int64_t w,
                           float *restrict out) {
    for (int64_t r = r0; r < r1; r++) spmm_row(indptr, indices, values, r, x, w, out + r * w);
}

/* Rows r0 <= r < r1 of out (n, w) = A xa + B xb, two CSR operators with the same rows (a
 * layer's owned and halo columns): each row is A's sum plus B's sum, each summed as spmm_row
 * sums it, then added once, so the result is (A xa) + (B xb) of two hpcgnn_spmm calls bit for
 * bit, without the second output and the pass that adds them. t: scratch of w floats. */
MULTIARCH void hpcgnn_spmm_sum2(const int64_t *pa, const int64_t *ia, const float *va,
                                const float *restrict xa, const int64_t *pb, const int64_t *ib,
                                const float *vb, const float *restrict xb, int64_t r0, int64_t r1,
                                int64_t w, float *restrict out, float *restrict t) {
    for (int64_t r = r0; r < r1; r++) {
        float *restrict o = out + r * w;
        spmm_row(pa, ia, va, r, xa, w, o);
        spmm_row(pb, ib, vb, r, xb, w, t);
        for (int64_t c = 0; c < w; c++) o[c] = o[c] + t[c];
    }
}

/* Counter-based dropout fused with a product by a narrow weight (hpcgnn/nn/dropout.py
 * dropout_matmul): y (n, m) = (x (n, k) * keep * scale) w (k, m), the keep bits those of
 * hpcgnn_dropout_apply, so the dropped rows are never written. Each y[r, j] is summed over c in
 * order, ((0 + a_0 w_0j) + a_1 w_1j) + ..., with a_c = x[r, c] * (keep ? scale : 0) (no FMA:
 * -ffp-contract=off), whatever the instruction set. Four rows at a time, their sums held in
 * registers M = 8, 16 or 32 wide (w padded with zero columns to M), so that four independent
 * sums hide the latency of the adds. m <= DM_MAXW. */
#define DM_ROWS 4
#define DM_MAXW 32

/* a = x * keep * scale for rows r0 .. r0 + nr - 1 (zeros past them), channels c0 .. c0 + kw - 1;
 * and keep * scale itself in s where s is not NULL */
static inline void dm_mask_rows(const float *x, const int64_t *rows, const uint32_t *c32,
                                int64_t r0, int64_t nr, int64_t k, int64_t c0, int64_t kw,
                                uint32_t thr, float scale, float a[DM_ROWS][DROPOUT_BLOCK],
                                float s[DM_ROWS][DROPOUT_BLOCK]) {
    for (int64_t i = 0; i < DM_ROWS; i++) {
        if (i >= nr) {                                   /* past the last row: zeros */
            for (int64_t c = 0; c < kw; c++) a[i][c] = 0.0f;
            continue;
        }
        const uint32_t h = (uint32_t)rows[r0 + i];
        const float *restrict xr = x + (r0 + i) * k + c0;
        if (s) {
            for (int64_t c = 0; c < kw; c++) {
                s[i][c] = hash32(h ^ c32[c]) >= thr ? scale : 0.0f;
                a[i][c] = xr[c] * s[i][c];
            }
        } else {
            float ks[DROPOUT_BLOCK];                       /* as above: vectorised, no branch */
            for (int64_t c = 0; c < kw; c++) ks[c] = hash32(h ^ c32[c]) >= thr ? scale : 0.0f;
            for (int64_t c = 0; c < kw; c++) a[i][c] = xr[c] * ks[c];
        }
    }
}

typedef float vf8 __attribute__((vector_size(32)));   /* 8 floats: one AVX register */

#define DM_FORWARD(M)                                                                            \
static void dm_forward_##M(const float *x, const int64_t *rows, const int64_t *cols, int64_t n,  \
                           int64_t k, uint32_t thr, float scale, const float *w, int64_t m,     \
                           float *y) {                                                           \
    enum { V = M / 8 };                                                                          \
    uint32_t c32[DROPOUT_BLOCK];                                                                 \
    float a[DM_ROWS][DROPOUT_BLOCK];                                                             \
    static __thread vf8 wp[DROPOUT_BLOCK * V];                                                   \
    float tmp[DM_ROWS][M] __attribute__((aligned(32)));                                          \
    for (int64_t c0 = 0; c0 < k; c0 += DROPOUT_BLOCK) {                                          \
        const int64_t kw = k - c0 < DROPOUT_BLOCK ? k - c0 : DROPOUT_BLOCK;                      \
        for (int64_t c = 0; c < kw; c++) {                                                       \
            c32[c] = (uint32_t)cols[c0 + c];                                                     \
            for (int64_t j = 0; j < M; j++)                                                      \
                wp[c * V + j / 8][j % 8] = j < m ? w[(c0 + c) * m + j] : 0.0f;                   \
        }                                                                                        \
        for (int64_t r0 = 0; r0 < n; r0 += DM_ROWS) {                                            \
            const int64_t nr = n - r0 < DM_ROWS ? n - r0 : DM_ROWS;                              \
            dm_mask_rows(x, rows, c32, r0, nr, k, c0, kw, thr, scale, a, 0);                     \
            for (int64_t i = 0; i < DM_ROWS; i++)                                                \
                for (int64_t j = 0; j < M; j++)                                                  \
                    tmp[i][j] = (c0 && i < nr && j < m) ? y[(r0 + i) * m + j] : 0.0f;            \
            vf8 acc[DM_ROWS][V];                                                                 \
            for (int64_t i = 0; i < DM_ROWS; i++)                                                \
                for (int64_t v = 0; v < V; v++) memcpy(&acc[i][v], &tmp[i][v * 8], 32);         \
            for (int64_t c = 0; c < kw; c++) {                                                   \
                const vf8 *wc = wp + c * V;                                                      \
                const vf8 a0 = (vf8){0} + a[0][c], a1 = (vf8){0} + a[1][c];                     \
                const vf8 a2 = (vf8){0} + a[2][c], a3 = (vf8){0} + a[3][c];                     \
                for (int64_t v = 0; v < V; v++) {                                                \
                    acc[0][v] = acc[0][v] + a0 * wc[v];                                          \
                    acc[1][v] = acc[1][v] + a1 * wc[v];                                          \
                    acc[2][v] = acc[2][v] + a2 * wc[v];                                          \
                    acc[3][v] = acc[3][v] + a3 * wc[v];                                          \
                }                                                                                \
            }                                                                                    \
            for (int64_t i = 0; i < DM_ROWS; i++)                                                \
                for (int64_t v = 0; v < V; v++) memcpy(&tmp[i][v * 8], &acc[i][v], 32);         \
            for (int64_t i = 0; i < nr; i++)                                                     \
                for (int64_t j = 0; j < m; j++) y[(r0 + i) * m + j] = tmp[i][j];                 \
        }                                                                                        \
    }                                                                                            \
}
MULTIARCH DM_FORWARD(8)
MULTIARCH DM_FORWARD(16)
MULTIARCH DM_FORWARD(32)

void hpcgnn_dropout_matmul(const float *x, const int64_t *rows, const int64_t *cols, int64_t n,
                           int64_t k, uint64_t threshold, float scale, const float *w, int64_t m,
                           float *y) {
    const uint32_t thr = (uint32_t)threshold;           /* p < 1, so threshold < 2^32 */
    if (m <= 8) dm_forward_8(x, rows, cols, n, k, thr, scale, w, m, y);
    else if (m <= 16) dm_forward_16(x, rows, cols, n, k, thr, scale, w, m, y);
    else dm_forward_32(x, rows, cols, n, k, thr, scale, w, m, y);
}

/* The adjoint of hpcgnn_dropout_matmul given gy (n, m): dx (n, k) = (gy w^T) * keep * scale,
 * each element summed over j in order, with wt = w^T (m, k); and dwt (m, k) += (a^T gy)^T, a
 * the dropped x, each element summed over r in order (the caller zeroes dwt), four rows per
 * load and store. The bits are hashed again. dx NULL: no input gradient. */
MULTIARCH void hpcgnn_dropout_matmul_backward(const float *x, const int64_t *rows,
                                              const int64_t *cols, int64_t n, int64_t k,
                                              uint64_t threshold, float scale, const float *wt,
                                              int64_t m, const float *gy, float *dx, float *dwt) {
    const uint32_t thr = (uint32_t)threshold;
    uint32_t c32[DROPOUT_BLOCK];
    float a[DM_ROWS][DROPOUT_BLOCK], ks[DM_ROWS][DROPOUT_BLOCK], acc[32];
    const float zero[DM_MAXW] = {0};
    for (int64_t c0 = 0; c0 < k; c0 += DROPOUT_BLOCK) {
        const int64_t kw = k - c0 < DROPOUT_BLOCK ? k - c0 : DROPOUT_BLOCK;
        for (int64_t c = 0; c < kw; c++) c32[c] = (uint32_t)cols[c0 + c];
        for (int64_t r0 = 0; r0 < n; r0 += DM_ROWS) {
            const int64_t nr = n - r0 < DM_ROWS ? n - r0 : DM_ROWS;
            dm_mask_rows(x, rows, c32, r0, nr, k, c0, kw, thr, scale, a, ks);
            if (dx) {
                /* dx row by row, 32 channels at a time held in four registers over the m
                 * outputs (the sums stay out of memory), then 8, then one at a time: each
                 * element's sum over j in order, whatever the split */
                for (int64_t i = 0; i < nr; i++) {
                    const int64_t r = r0 + i;
                    const float *restrict g = gy + r * m;
                    float *restrict dxr = dx + r * k + c0;
                    int64_t c = 0;
                    for (; c + 32 <= kw; c += 32) {
                        vf8 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0}, w0, w1, w2, w3;
                        for (int64_t j = 0; j < m; j++) {
                            const vf8 gj = (vf8){0} + g[j];
                            const float *wj = wt + j * k + c0 + c;
                            memcpy(&w0, wj, 32);
                            memcpy(&w1, wj + 8, 32);
                            memcpy(&w2, wj + 16, 32);
                            memcpy(&w3, wj + 24, 32);
                            s0 = s0 + gj * w0;
                            s1 = s1 + gj * w1;
                            s2 = s2 + gj * w2;
                            s3 = s3 + gj * w3;
                        }
                        memcpy(acc, &s0, 32);
                        memcpy(acc + 8, &s1, 32);
                        memcpy(acc + 16, &s2, 32);
                        memcpy(acc + 24, &s3, 32);
                        for (int64_t e = 0; e < 32; e++) dxr[c + e] = acc[e] * ks[i][c + e];
                    }
                    for (; c + 8 <= kw; c += 8) {
                        vf8 s0 = {0}, w0;
                        for (int64_t j = 0; j < m; j++) {
                            memcpy(&w0, wt + j * k + c0 + c, 32);
                            s0 = s0 + ((vf8){0} + g[j]) * w0;
                        }
                        memcpy(acc, &s0, 32);
                        for (int64_t e = 0; e < 8; e++) dxr[c + e] = acc[e] * ks[i][c + e];
                    }
                    for (; c < kw; c++) {
                        float s0 = 0.0f;
                        for (int64_t j = 0; j < m; j++) s0 = s0 + g[j] * wt[j * k + c0 + c];
                        dxr[c] = s0 * ks[i][c];
                    }
                }
            }
            /* rows past n (the last block) add a zero row: d + 0 * 0 = d */
            const float *g0 = gy + r0 * m;
            const float *g1 = nr > 1 ? gy + (r0 + 1) * m : zero;
            const float *g2 = nr > 2 ? gy + (r0 + 2) * m : zero;
            const float *g3 = nr > 3 ? gy + (r0 + 3) * m : zero;
            for (int64_t j = 0; j < m; j++) {
                float *restrict d = dwt + j * k + c0;
                const float q0 = g0[j], q1 = g1[j], q2 = g2[j], q3 = g3[j];
                const float *restrict a0 = a[0], *restrict a1 = a[1], *restrict a2 = a[2],
                            *restrict a3 = a[3];
                for (int64_t c = 0; c < kw; c++)
                    d[c] = (((d[c] + a0[c] * q0) + a1[c] * q1) + a2[c] * q2) + a3[c] * q3;
            }
        }
    }
}

/* The sample stage's row selection (hpcgnn/codecs/base.py _sample): in block b of counts[b]
 * rows, the kept[b] rows of smallest (score, row in block), score(i) = hash32((row_key ^
 * 0x5A17E5) ^ hash32(i)), row_key the high 32 bits of the packed block key keys[b] (the low
 * half is the channel key, hpcgnn/codecs/rng.py); out gets their buffer rows (block start + i)
 * in ascending order, and the function returns how many it wrote. work: max(counts) uint64 of
 * scratch. One quickselect per block (the scores are hashes: no adversarial order), then one
 * scan. */
static uint64_t select_kth(uint64_t *a, int64_t n, int64_t k) {     /* k-th smallest, 0-based */
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        const uint64_t pivot = a[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] < pivot) i++;
            while (a[j] > pivot) j--;
            if (i <= j) {
                const uint64_t t = a[i]; a[i] = a[j]; a[j] = t;
                i++; j--;
            }
        }
        if (k <= j) hi = j;
        else if (k >= i) lo = i;
        else return a[k];
    }
    return a[k];
}

int64_t hpcgnn_sample_rows(const int64_t *keys, const int64_t *counts, const int64_t *kept,
                           int64_t blocks, int64_t *out, uint64_t *work) {
    int64_t start = 0, n = 0;
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t count = counts[b], k = kept[b];
        const uint32_t salt = (uint32_t)((uint64_t)keys[b] >> 32) ^ 0x5A17E5u;
        if (k >= count) {
            for (int64_t i = 0; i < count; i++) out[n++] = start + i;
        } else if (k > 0) {
            for (int64_t i = 0; i < count; i++)
                work[i] = ((uint64_t)hash32(salt ^ hash32((uint32_t)i)) << 32) | (uint64_t)i;
            const uint64_t kth = select_kth(work, count, k - 1);
            for (int64_t i = 0; i < count; i++)
                if ((((uint64_t)hash32(salt ^ hash32((uint32_t)i)) << 32) | (uint64_t)i) <= kth)
                    out[n++] = start + i;
        }
        start += count;
    }
    return n;
}

/* o = x * (*scale) as float32 products, or x as it is where scale is NULL */
static inline void copy_row(const float *restrict x, const float *scale, int64_t width,
                            float *restrict o) {
    if (scale) {
        const float s = *scale;
        for (int64_t c = 0; c < width; c++) o[c] = x[c] * s;
    } else {
        memcpy(o, x, (size_t)width * sizeof(float));
    }
}

/* The receiving end of a row sample (base.py WireCodec._place): out (rows, width) is zero but
 * for rows index[j], which get y[j] * scale[j] (scale NULL: y[j] as it is), float32 products as
 * torch's. index strictly ascending within [0, rows), as hpcgnn_sample_rows writes it; returns
 * -1 (out then undefined) where it is not, else 0. */
int hpcgnn_place_rows(const float *y, const int64_t *index, const float *scale, int64_t n,
                      int64_t rows, int64_t width, float *out) {
    int64_t r = 0;
    for (int64_t j = 0; j < n; j++) {
        const int64_t to = index[j];
        if (to < r || to >= rows) return -1;
        if (to > r) memset(out + r * width, 0, (size_t)((to - r) * width) * sizeof(float));
        copy_row(y + j * width, scale ? scale + j : NULL, width, out + to * width);
        r = to + 1;
    }
    if (rows > r) memset(out + r * width, 0, (size_t)((rows - r) * width) * sizeof(float));
    return 0;
}

/* The sending end (base.py WireCodec._gather, the row stage): out (n, width) = x[index[j]]
 * (* scale[j] where scale is given: the adjoint's scaling on the way out) from x (rows, width);
 * returns -1 (out then undefined) where an index is outside [0, rows), else 0. */
int hpcgnn_gather_rows(const float *x, int64_t rows, const int64_t *index, const float *scale,
                       int64_t n, int64_t width, float *out) {
    for (int64_t j = 0; j < n; j++) {
        if (index[j] < 0 || index[j] >= rows) return -1;
        copy_row(x + index[j] * width, scale ? scale + j : NULL, width, out + j * width);
    }
    return 0;
}
