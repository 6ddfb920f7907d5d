/* The tile-order page layout of bench/DECODE_NOTES.md v39, prototyped before the library moves to
   it (v40-v43): does a decode over pages stored as the mma fragments read them reach the plain
   read's bandwidth on the same bytes?

   Head_dim 128, four query heads per kv head, pages of 128 tokens of one of three kinds:
   - INT2 (kivi2): keys INT2 per channel over the page (a scale and a minimum per channel and
     page), values INT2 per token in groups of 32 channels; 10,752 bytes (2.625 bits an element):
       [8 key tiles of 512 B][8 value tiles of 512 B][8 value-metadata tiles of 256 B][512 B keys']
   - INT4: keys and values INT4 per token in groups of 32, both in the values' order (the keys'
     8 x 8 blocks transposed in registers by movmatrix); 20,480 bytes (5 bits an element):
       [8 key tiles of 1 KiB][8 value tiles of 1 KiB][8 key- and 8 value-metadata tiles of 256 B]
   - Kitty: keys BOOSTED (a quarter of the channels keep two high bits in tiles of their own,
     one word a lane), values INT2 in one group a token; 10,272 bytes (v42).
   The mixes: kivi2 (every page INT2), int4 (every page INT4), 75/25 (every fourth page INT4),
   kitty (every page Kitty).
   A tile holds lane L's bytes at L times 16 (INT2) or 32 (INT4): the A operands of m16n8k16
   that the lane loads (K with tokens as rows, V^T with channels as rows), its words the
   registers a_r of all eight 16-wide matrices j (k-steps of the key product, channel tiles of
   the value product), matrix j's code in each fp16 half at bits 2 j (INT2) or 4 (j % 4) in word
   r + 4 (j / 4) (INT4). A register is one LOP3 away (after one shift, by 10 or 8, for the high
   positions): the code times 2^(p - 24) as an fp16 subnormal, no offset to remove. The power of
   two goes to the other operand (keys: B, the query times the channel scale for INT2 pages, the
   query for INT4 pages, whose per-token scales multiply each group's accumulator after the mma)
   or to the fp32 accumulator (values: one accumulator per channel tile, scaled once at the end,
   and by a power of two where the page kind changes the positions); value scales multiply P per
   group, the minima and the row sum are one more mma (rows: four groups' minima and a row of
   ones); the minimum terms of per-token keys one more (the minima against the query's group
   sums).

   Each warp streams its own run of pages through a ring of cp.async stages (one tile each),
   one unit of (sequence, kv head, pages); a second kernel merges the units of a head. The same
   process times a plain read of the same bytes and checks the output against a double-precision
   softmax over the rows dequantized from the same bytes through the layout's index functions.

   nvcc -std=c++17 -O3 -Xcompiler -fopenmp -gencode=arch=compute_90a,code=sm_90a bench/tile_decode.cu \
        -o build/tile_decode
   build/tile_decode [MIX ...] [BATCH,CTX ...]   (default: every mix; 2,5000 and the issue's
                                                  shapes) */
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CHECK(x)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));             \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

#ifndef KMIN_BLOCKS
#define KMIN_BLOCKS 4 /* blocks an SM the registers are fitted to */
#endif
#ifndef KSTAGES
#define KSTAGES 4
#endif

constexpr int kDim = 128, kPage = 128, kTile = 16, kTilesPerPage = kPage / kTile, kGroup = 32;
constexpr int kGroups = kDim / kGroup, kHeadsPerKv = 4, kKvHeads = 8;
enum PageKind { kInt2 = 0, kInt4 = 1, kKitty = 2 };
/* INT2 pages */
constexpr int kCodeBytes = 512, kValueMetaBytes = 256, kKeyMetaBytes = 512;
constexpr int kValueOffset = kTilesPerPage * kCodeBytes;                           /* 4096 */
constexpr int kValueMetaOffset = 2 * kTilesPerPage * kCodeBytes;                   /* 8192 */
constexpr int kKeyMetaOffset = kValueMetaOffset + kTilesPerPage * kValueMetaBytes; /* 10240 */
constexpr int kPageBytes = kKeyMetaOffset + kKeyMetaBytes;                         /* 10752 */
/* INT4 pages */
constexpr int kCode4Bytes = 1024, kMeta4Bytes = 256;
constexpr int kValue4Offset = kTilesPerPage * kCode4Bytes;                       /* 8192 */
constexpr int kKeyMeta4Offset = 2 * kTilesPerPage * kCode4Bytes;                 /* 16384 */
constexpr int kValueMeta4Offset = kKeyMeta4Offset + kTilesPerPage * kMeta4Bytes; /* 18432 */
constexpr int kPage4Bytes = kValueMeta4Offset + kTilesPerPage * kMeta4Bytes;     /* 20480 */
/* Kitty pages: keys BOOSTED (every channel's low two bits, the quarter of channels with the
   largest |x| over the page keeping two high bits), values INT2 in one group a token */
constexpr int kBoost = kDim / 4, kHighBytes = 16 * kBoost * 2 / 8, kKittyValueMetaBytes = 64;
constexpr int kKittyHighOffset = kTilesPerPage * kCodeBytes;                          /* 4096 */
constexpr int kKittyValueOffset = kKittyHighOffset + kTilesPerPage * kHighBytes;      /* 5120 */
constexpr int kKittyValueMetaOffset = kKittyValueOffset + kTilesPerPage * kCodeBytes; /* 9216 */
constexpr int kKittyKeyMetaOffset =
    kKittyValueMetaOffset + kTilesPerPage * kKittyValueMetaBytes;      /* 9728 */
constexpr int kKittySlotsOffset = kKittyKeyMetaOffset + kKeyMetaBytes; /* 10240: slot -> channel */
constexpr int kKittyPageBytes = kKittySlotsOffset + kBoost;            /* 10272 */
/* a page table entry: the page's offset in units of 32 bytes, times 4, plus its kind */
constexpr int kPageUnit = 32;
static_assert(kPageBytes % kPageUnit == 0 && kPage4Bytes % kPageUnit == 0 &&
                  kKittyPageBytes % kPageUnit == 0,
              "pages of whole units");

/* ---- the layout: where a code and a metadata half live (host and device share these) ---- */

/* Bit of element (row R, column C) of 16x16 fragment matrix j inside a tile: INT2 (512 bytes,
   16 a lane) and INT4 (1 KiB, 32 a lane). */
__host__ __device__ constexpr int fragment_lane(int R, int C) {
    return 4 * (R & 7) + ((C & 7) >> 1);
}
__host__ __device__ constexpr int fragment_register(int R, int C) {
    return (R >> 3) + 2 * (C >> 3);
}
__host__ __device__ constexpr int fragment_bit(int R, int C, int j) {
    return (fragment_lane(R, C) * 4 + fragment_register(R, C)) * 32 + (C & 1) * 16 + 2 * j;
}
__host__ __device__ constexpr int fragment_bit4(int R, int C, int j) {
    return (fragment_lane(R, C) * 8 + fragment_register(R, C) + 4 * (j >> 2)) * 32 + (C & 1) * 16 +
           4 * (j & 3);
}
/* Keys: rows are the tile's tokens, columns a k-step's channels (INT2 pages: per-channel keys);
   per-token codes, keys and values alike, keep the values' order (rows are channels: v43). */
__host__ __device__ constexpr int key_bit(int kind, int token, int channel) {
    return kind == kInt2 ? fragment_bit(token, channel & 15, channel >> 4)
                         : fragment_bit4(channel & 15, token, channel >> 4);
}
__host__ __device__ constexpr int value_bit(int kind, int token, int channel) {
    return kind == kInt2 ? fragment_bit(channel & 15, token, channel >> 4)
                         : fragment_bit4(channel & 15, token, channel >> 4);
}
/* Which of the four fragment elements (2t, 2t+1, 2t+8, 2t+9) a token or channel in 0..15 is. */
__host__ __device__ constexpr int quad_lane(int i) { return (i & 7) >> 1; }
__host__ __device__ constexpr int quad_slot(int i) { return (i & 1) + 2 * (i >> 3); }
/* Value metadata of a tile (both kinds), in halves: scales [t][group][slot], then minima
   [group][t][slot]. */
__host__ __device__ constexpr int value_scale_half(int token, int group) {
    return (quad_lane(token) * 4 + group) * 4 + quad_slot(token);
}
__host__ __device__ constexpr int value_min_half(int token, int group) {
    return 64 + (group * 4 + quad_lane(token)) * 4 + quad_slot(token);
}
/* Key metadata of an INT2 page, in halves: scales [t][k-step][slot], then minima the same. */
__host__ __device__ constexpr int key_scale_half(int channel) {
    return (quad_lane(channel & 15) * 8 + (channel >> 4)) * 4 + quad_slot(channel & 15);
}
__host__ __device__ constexpr int key_min_half(int channel) {
    return 128 + key_scale_half(channel);
}
/* Bit of a Kitty tile's high code of (token, slot): one 32-bit word a lane, register a_r of
   k-step j (slots 16 j ..) at bits 2 (r + 4 j) of each half, read after a shift to bit 0. */
__host__ __device__ constexpr int high_bit(int token, int slot) {
    return fragment_lane(token, slot & 15) * 32 + (slot & 1) * 16 +
           2 * (fragment_register(token, slot & 15) + 4 * (slot >> 4));
}
/* Value metadata of a Kitty tile (one group a token), in halves: scales [t][slot], minima the same. */
__host__ __device__ constexpr int kitty_scale_half(int token) {
    return quad_lane(token) * 4 + quad_slot(token);
}
__host__ __device__ constexpr int kitty_min_half(int token) { return 16 + kitty_scale_half(token); }
/* Key metadata of an INT4 tile, in halves: scales [token][group], then minima the same. */
__host__ __device__ constexpr int key4_scale_half(int token, int group) {
    return token * 4 + group;
}
__host__ __device__ constexpr int key4_min_half(int token, int group) {
    return 64 + token * 4 + group;
}

/* ---- host: quantize a page, dequantize it back, the reference ---- */

static uint64_t next_random(uint64_t &state) {
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return state;
}
static float gaussian(uint64_t &state) { /* Irwin-Hall of four uniforms, scaled to unit variance */
    float s = 0;
    for (int i = 0; i < 4; i++) s += (float)(next_random(state) >> 40) / (float)(1 << 24);
    return (s - 2.0f) * 1.7320508f;
}
static uint16_t half_bits(float x) {
    __half h = __float2half_rn(x);
    uint16_t b;
    memcpy(&b, &h, 2);
    return b;
}
static float half_value(uint16_t b) {
    __half h;
    memcpy(&h, &b, 2);
    return __half2float(h);
}
static void put_code(uint8_t *tile, int bit, int code) {
    tile[bit >> 3] |= (uint8_t)(code << (bit & 7));
}
static int get_code(const uint8_t *tile, int bit, int levels) {
    return (tile[bit >> 3] >> (bit & 7)) & levels;
}

/* Scale and minimum of `levels` steps over x[0..n) (stride), as fp16. */
static void min_max_params(const float *x, int n, int stride, int levels, uint16_t *scale,
                           uint16_t *min) {
    float lo = x[0], hi = x[0];
    for (int i = 1; i < n; i++) lo = std::min(lo, x[i * stride]), hi = std::max(hi, x[i * stride]);
    *scale = half_bits((hi - lo) / (float)levels);
    *min = half_bits(lo);
}
static int code_of(float x, uint16_t scale, uint16_t min, int levels) {
    const float s = half_value(scale), m = half_value(min);
    if (s == 0.0f) return 0;
    return std::min(levels, std::max(0, (int)lrintf((x - m) / s)));
}
__host__ __device__ constexpr int levels_of(int kind) { return kind == kInt4 ? 15 : 3; }
__host__ __device__ constexpr int page_bytes_of(int kind) {
    return kind == kInt2 ? kPageBytes : kind == kInt4 ? kPage4Bytes : kKittyPageBytes;
}
__host__ __device__ constexpr int code_bytes_of(int kind) {
    return kind == kInt4 ? kCode4Bytes : kCodeBytes;
}
__host__ __device__ constexpr int value_meta_offset_of(int kind) {
    return kind == kInt2 ? kValueMetaOffset : kValueMeta4Offset;
}

/* A Kitty page: the kBoost channels of largest sum |x| keep 4 bits (their scale and minimum for
   15 levels), in slots of increasing channel; values INT2, one group a token. */
static void quantize_kitty_page(const float *keys, const float *values, uint8_t *page) {
    memset(page, 0, kKittyPageBytes);
    float score[kDim];
    bool boosted[kDim] = {};
    for (int c = 0; c < kDim; c++) {
        score[c] = 0.0f;
        for (int t = 0; t < kPage; t++) score[c] += fabsf(keys[t * kDim + c]);
    }
    for (int k = 0; k < kBoost; k++) {
        int best = -1;
        for (int c = 0; c < kDim; c++)
            if (!boosted[c] && (best < 0 || score[c] > score[best])) best = c;
        boosted[best] = true;
    }
    uint16_t *key_meta = (uint16_t *)(page + kKittyKeyMetaOffset);
    for (int c = 0, slot = 0; c < kDim; c++) {
        const int levels = boosted[c] ? 15 : 3;
        uint16_t s, m;
        min_max_params(keys + c, kPage, kDim, levels, &s, &m);
        key_meta[key_scale_half(c)] = s, key_meta[key_min_half(c)] = m;
        for (int t = 0; t < kPage; t++) {
            const int q = code_of(keys[t * kDim + c], s, m, levels);
            put_code(page + (t / kTile) * kCodeBytes, key_bit(kInt2, t % kTile, c), q & 3);
            if (boosted[c])
                put_code(page + kKittyHighOffset + (t / kTile) * kHighBytes,
                         high_bit(t % kTile, slot), q >> 2);
        }
        if (boosted[c]) page[kKittySlotsOffset + slot++] = (uint8_t)c;
    }
    for (int t = 0; t < kPage; t++) {
        uint16_t *meta =
            (uint16_t *)(page + kKittyValueMetaOffset + (t / kTile) * kKittyValueMetaBytes);
        uint16_t s, m;
        min_max_params(values + t * kDim, kDim, 1, 3, &s, &m);
        meta[kitty_scale_half(t % kTile)] = s, meta[kitty_min_half(t % kTile)] = m;
        for (int c = 0; c < kDim; c++)
            put_code(page + kKittyValueOffset + (t / kTile) * kCodeBytes,
                     value_bit(kInt2, t % kTile, c), code_of(values[t * kDim + c], s, m, 3));
    }
}

static void dequantize_kitty_page(const uint8_t *page, float *keys, float *values) {
    const uint16_t *key_meta = (const uint16_t *)(page + kKittyKeyMetaOffset);
    int slot_of[kDim];
    for (int c = 0; c < kDim; c++) slot_of[c] = -1;
    for (int k = 0; k < kBoost; k++) slot_of[page[kKittySlotsOffset + k]] = k;
    for (int t = 0; t < kPage; t++) {
        const uint16_t *meta =
            (const uint16_t *)(page + kKittyValueMetaOffset + (t / kTile) * kKittyValueMetaBytes);
        for (int c = 0; c < kDim; c++) {
            int code = get_code(page + (t / kTile) * kCodeBytes, key_bit(kInt2, t % kTile, c), 3);
            if (slot_of[c] >= 0)
                code |= get_code(page + kKittyHighOffset + (t / kTile) * kHighBytes,
                                 high_bit(t % kTile, slot_of[c]), 3)
                        << 2;
            keys[t * kDim + c] = code * half_value(key_meta[key_scale_half(c)]) +
                                 half_value(key_meta[key_min_half(c)]);
            values[t * kDim + c] = get_code(page + kKittyValueOffset + (t / kTile) * kCodeBytes,
                                            value_bit(kInt2, t % kTile, c), 3) *
                                       half_value(meta[kitty_scale_half(t % kTile)]) +
                                   half_value(meta[kitty_min_half(t % kTile)]);
        }
    }
}

/* keys and values: [kPage][kDim] rows of one page (rows past a sequence's end are never read). */
static void quantize_page(int kind, const float *keys, const float *values, uint8_t *page) {
    if (kind == kKitty) return quantize_kitty_page(keys, values, page);
    const int levels = levels_of(kind), code_bytes = code_bytes_of(kind);
    memset(page, 0, page_bytes_of(kind));
    if (kind == kInt2) {
        uint16_t *key_meta = (uint16_t *)(page + kKeyMetaOffset);
        for (int c = 0; c < kDim; c++) {
            uint16_t s, m;
            min_max_params(keys + c, kPage, kDim, levels, &s, &m);
            key_meta[key_scale_half(c)] = s, key_meta[key_min_half(c)] = m;
            for (int t = 0; t < kPage; t++)
                put_code(page + (t / kTile) * code_bytes, key_bit(kind, t % kTile, c),
                         code_of(keys[t * kDim + c], s, m, levels));
        }
    } else {
        for (int t = 0; t < kPage; t++) {
            uint16_t *meta = (uint16_t *)(page + kKeyMeta4Offset + (t / kTile) * kMeta4Bytes);
            for (int g = 0; g < kGroups; g++) {
                const float *x = keys + t * kDim + g * kGroup;
                uint16_t s, m;
                min_max_params(x, kGroup, 1, levels, &s, &m);
                meta[key4_scale_half(t % kTile, g)] = s, meta[key4_min_half(t % kTile, g)] = m;
                for (int c = 0; c < kGroup; c++)
                    put_code(page + (t / kTile) * code_bytes,
                             key_bit(kind, t % kTile, g * kGroup + c), code_of(x[c], s, m, levels));
            }
        }
    }
    const int value_offset = kTilesPerPage * code_bytes, meta_offset = value_meta_offset_of(kind);
    for (int t = 0; t < kPage; t++) {
        uint16_t *meta = (uint16_t *)(page + meta_offset + (t / kTile) * kValueMetaBytes);
        for (int g = 0; g < kGroups; g++) {
            const float *x = values + t * kDim + g * kGroup;
            uint16_t s, m;
            min_max_params(x, kGroup, 1, levels, &s, &m);
            meta[value_scale_half(t % kTile, g)] = s, meta[value_min_half(t % kTile, g)] = m;
            for (int c = 0; c < kGroup; c++)
                put_code(page + value_offset + (t / kTile) * code_bytes,
                         value_bit(kind, t % kTile, g * kGroup + c), code_of(x[c], s, m, levels));
        }
    }
}

static void dequantize_page(int kind, const uint8_t *page, float *keys, float *values) {
    if (kind == kKitty) return dequantize_kitty_page(page, keys, values);
    const int levels = levels_of(kind), code_bytes = code_bytes_of(kind);
    const int value_offset = kTilesPerPage * code_bytes, meta_offset = value_meta_offset_of(kind);
    for (int t = 0; t < kPage; t++) {
        const uint8_t *kt = page + (t / kTile) * code_bytes,
                      *vt = page + value_offset + (t / kTile) * code_bytes;
        const uint16_t *vmeta =
            (const uint16_t *)(page + meta_offset + (t / kTile) * kValueMetaBytes);
        const uint16_t *kmeta =
            kind == kInt2 ? (const uint16_t *)(page + kKeyMetaOffset)
                          : (const uint16_t *)(page + kKeyMeta4Offset + (t / kTile) * kMeta4Bytes);
        for (int c = 0; c < kDim; c++) {
            const int g = c / kGroup, code = get_code(kt, key_bit(kind, t % kTile, c), levels);
            keys[t * kDim + c] = kind == kInt2
                                     ? code * half_value(kmeta[key_scale_half(c)]) +
                                           half_value(kmeta[key_min_half(c)])
                                     : code * half_value(kmeta[key4_scale_half(t % kTile, g)]) +
                                           half_value(kmeta[key4_min_half(t % kTile, g)]);
            values[t * kDim + c] = get_code(vt, value_bit(kind, t % kTile, c), levels) *
                                       half_value(vmeta[value_scale_half(t % kTile, g)]) +
                                   half_value(vmeta[value_min_half(t % kTile, g)]);
        }
    }
}

/* ---- device ---- */

__device__ __forceinline__ void copy16(uint32_t dst, const void *src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void wait_groups() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
}
__device__ __forceinline__ void mma(float *d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                    uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
    uint32_t y;
    asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
    return y;
}
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *(uint32_t *)&h;
}
/* 2^e for -126 <= e <= 127, from its exponent field */
__device__ __forceinline__ float power_of_two(int e) {
    return __uint_as_float((uint32_t)(e + 127) << 23);
}
__device__ __forceinline__ uint32_t max_abs_half2(uint32_t a, uint32_t b) {
    __half2 r = __hmax2(__habs2(*(__half2 *)&a), __habs2(*(__half2 *)&b));
    return *(uint32_t *)&r;
}
__device__ __forceinline__ uint32_t mul_half2(uint32_t a, uint32_t b) {
    __half2 r = __hmul2(*(__half2 *)&a, *(__half2 *)&b);
    return *(uint32_t *)&r;
}
/* Code positions of matrix j inside its fp16 half once read (INT2: 2j, after a shift by 10 for
   j >= 5; INT4: 4 (j % 2), after a shift by 8 for j % 4 >= 2): the register holds code 2^(p - 24). */
__host__ __device__ constexpr int code_position(int kind, int j) {
    return kind == kInt2 ? (j < 5 ? 2 * j : 2 * (j - 5)) : 4 * (j & 1);
}

/* A lane's code words of one tile. */
template <int kKind> struct LaneCodes {
    static constexpr int kWords = kKind == kInt2 ? 4 : 8, kShift = kKind == kInt2 ? 10 : 8;
    uint32_t w[kWords];
    __device__ __forceinline__ void load(const uint8_t *lane_bytes) {
#pragma unroll
        for (int i = 0; i < kWords; i += 4) {
            const uint4 v = *(const uint4 *)(lane_bytes + 4 * i);
            w[i] = v.x, w[i + 1] = v.y, w[i + 2] = v.z, w[i + 3] = v.w;
        }
    }
    /* register a_r of matrix J (the high positions after the shift) */
    template <int J> __device__ __forceinline__ uint32_t reg(int r) const {
        if (kKind == kInt2)
            return (J < 5 ? w[r] : w[r] >> kShift) & (0x00030003u << code_position(kInt2, J));
        const uint32_t word = w[r + 4 * (J >> 2)];
        return ((J & 2) ? word >> kShift : word) & (0x000F000Fu << code_position(kInt4, J));
    }
};

constexpr int kStages = KSTAGES;
constexpr float kLazyLog2 = 8.0f;
/* A ring slot: INT2 [keys 512][values 512][value metadata 256][the page's key metadata 512];
   INT4 [keys 1024][values 1024][value metadata 256][key metadata 256]. */
constexpr int kSlotBytes = 2 * kCode4Bytes + 2 * kMeta4Bytes; /* 2560 */
constexpr int kQueryBytes = 8 * 32 * 8; /* eight k-steps' B fragments a lane */
constexpr int kWarpBytes = kStages * kSlotBytes + kQueryBytes;
constexpr int kWarps = 4;
constexpr float kLog2eOverSqrtD = 1.4426950408889634f / 11.313708498984761f;
__host__ __device__ constexpr int value_slot_offset(int kind) { return code_bytes_of(kind); }
/* a Kitty slot is an INT2 slot followed by the tile's high codes and the page's slot list */
constexpr int kKittyHighSlotOffset = 2 * kCodeBytes + kValueMetaBytes + kKeyMetaBytes; /* 1792 */
constexpr int kKittySlotsSlotOffset = kKittyHighSlotOffset + kHighBytes;               /* 1920 */
__host__ __device__ constexpr int value_meta_slot_offset(int kind) {
    return 2 * code_bytes_of(kind);
}
__host__ __device__ constexpr int key_meta_slot_offset(int kind) {
    return 2 * code_bytes_of(kind) + kValueMetaBytes;
}

struct Units {
    int pages_per_seq, n_tokens, chunk_pages, units_per_head, n_units;
};

/* The key product's B operands for one page, the logits' scale and (INT2 pages) the bias of each
   logit column. INT2: the query times the channel scale (fp16), times 2^(K - p_j) so that each
   k-step's code position p_j is undone and the largest fits fp16; the bias (the query times the
   channel minima) is one mma a k-step whose A is the minima in every row, so every row of the
   product is the bias row and lane (g, t) holds columns 2t, 2t+1 as the logits do. INT4: the
   query times 2^(K_q - p_j), K_q the unit's. */
struct PageKeys {
    uint32_t b[8][2], high[2][2]; /* high: Kitty's boosted slots, two k-steps of 16 */
    float scale, bias0, bias1;
};

__device__ __forceinline__ uint32_t
half2_bits_of_power(int e) { /* 2^e in both halves, -14 <= e <= 15 */
    return (uint32_t)(e + 15) << 10 | (uint32_t)(e + 15) << 26;
}
/* K with 2^(K - p) B < 2^15 for the largest |B| < 2^e, at most 15 (2^(K - p) an fp16 normal) */
__device__ __forceinline__ int fp16_headroom(uint32_t top_half2) {
    float largest = fmaxf(__half2float(__ushort_as_half((unsigned short)(top_half2 & 0xffff))),
                          __half2float(__ushort_as_half((unsigned short)(top_half2 >> 16))));
#pragma unroll
    for (int o = 16; o; o >>= 1) largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, o));
    const int e = (int)((__float_as_uint(largest) >> 23) & 0xff) - 126;
    return largest > 0.0f ? min(15 - e, 15) : 15;
}

/* Kitty pages (kHigh) add the boosted slots' B: the query times the scale of the slot's channel,
   times 4 (the high bits' weight), code position 0. */
template <bool kHigh>
__device__ __forceinline__ void page_keys_int2(const uint8_t *meta, const uint2 *qfrag, int lane,
                                               PageKeys &pk, const uint8_t *slots = nullptr) {
    const int t = lane & 3, g = lane >> 2;
    uint32_t sc[16], mn[16]; /* words 2s, 2s + 1: channels 16s + 2t + (0, 1) and + (8, 9) */
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const uint4 a = *(const uint4 *)(meta + 64 * t + 16 * i),
                    m = *(const uint4 *)(meta + 256 + 64 * t + 16 * i);
        sc[4 * i] = a.x, sc[4 * i + 1] = a.y, sc[4 * i + 2] = a.z, sc[4 * i + 3] = a.w;
        mn[4 * i] = m.x, mn[4 * i + 1] = m.y, mn[4 * i + 2] = m.z, mn[4 * i + 3] = m.w;
    }
    float bias[4] = {};
    uint32_t top = 0;
#pragma unroll
    for (int s = 0; s < 8; s++) {
        const uint2 qf = qfrag[s * 32 + lane];
        mma(bias, mn[2 * s], mn[2 * s], mn[2 * s + 1], mn[2 * s + 1], qf.x, qf.y);
        pk.b[s][0] = mul_half2(qf.x, sc[2 * s]), pk.b[s][1] = mul_half2(qf.y, sc[2 * s + 1]);
        top = max_abs_half2(top, max_abs_half2(pk.b[s][0], pk.b[s][1]));
    }
    if (kHigh) {
        const unsigned short *q_halves = (const unsigned short *)qfrag;
        const unsigned short *scales = (const unsigned short *)meta;
#pragma unroll
        for (int j = 0; j < 2; j++) {
            unsigned short e[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int c = slots[16 * j + 2 * t + (i & 1) + 8 * (i >> 1)], cc = c & 15;
                const __half qh = __ushort_as_half(
                    q_halves[((c >> 4) * 32 + 4 * g + quad_lane(cc)) * 4 + quad_slot(cc)]);
                const __half sh = __ushort_as_half(scales[key_scale_half(c)]);
                e[i] = __half_as_ushort(__hmul(__hmul(qh, sh), __float2half(4.0f)));
            }
            pk.high[j][0] = e[0] | (uint32_t)e[1] << 16,
            pk.high[j][1] = e[2] | (uint32_t)e[3] << 16;
            top = max_abs_half2(top, max_abs_half2(pk.high[j][0], pk.high[j][1]));
        }
    }
    const int k = fp16_headroom(top);
#pragma unroll
    for (int s = 0; s < 8; s++) {
        const uint32_t undo = half2_bits_of_power(k - code_position(kInt2, s));
        pk.b[s][0] = mul_half2(pk.b[s][0], undo), pk.b[s][1] = mul_half2(pk.b[s][1], undo);
    }
    if (kHigh) {
        const uint32_t undo = half2_bits_of_power(k);
#pragma unroll
        for (int j = 0; j < 2; j++)
            pk.high[j][0] = mul_half2(pk.high[j][0], undo),
            pk.high[j][1] = mul_half2(pk.high[j][1], undo);
    }
    pk.bias0 = bias[0] * kLog2eOverSqrtD, pk.bias1 = bias[1] * kLog2eOverSqrtD;
    pk.scale = kLog2eOverSqrtD * power_of_two(24 - k);
}

__device__ __forceinline__ void page_keys_int4(const uint2 *qfrag, int lane, int query_k,
                                               PageKeys &pk) {
#pragma unroll
    for (int s = 0; s < 8; s++) {
        const uint2 qf = qfrag[s * 32 + lane];
        const uint32_t undo = half2_bits_of_power(query_k - code_position(kInt4, s));
        pk.b[s][0] = mul_half2(qf.x, undo), pk.b[s][1] = mul_half2(qf.y, undo);
    }
    pk.scale = kLog2eOverSqrtD * power_of_two(24 - query_k);
}

/* A warp's running softmax: o[m] channels 16 m + g (+8) x heads 2t, 2t+1 (in units of the code
   positions of page kind `kind`); mins rows 0..3 the groups' minimum terms, row 4 the
   probabilities' sums. */
struct Running {
    float o[8][4], mins[4], run0, run1;
    int kind;
};

/* The value accumulators into another kind's code positions (exact: powers of two). */
__device__ __forceinline__ void change_positions(Running &r, int kind) {
#pragma unroll
    for (int m = 0; m < 8; m++) {
        const float f =
            power_of_two(kind == kInt4 ? code_position(kInt4, m) - code_position(kInt2, m)
                                       : code_position(kInt2, m) - code_position(kInt4, m));
        r.o[m][0] *= f, r.o[m][1] *= f, r.o[m][2] *= f, r.o[m][3] *= f;
    }
    r.kind = kind;
}

/* INT2 keys: the logits of the tile's 16 tokens, x[0..3] as the C fragment (rows g, g + 8). */
template <bool kHigh>
__device__ __forceinline__ void logits_int2(float *x, const PageKeys &pk, const uint8_t *slot,
                                            int lane) {
    LaneCodes<kInt2> k;
    k.load(slot + lane * 16);
    float s[4] = {}, s2[4] = {}; /* two chains of four mma, not one of eight */
#define KVMIX_KEY_STEP(J, ACC)                                                                     \
    mma(ACC, k.reg<J>(0), k.reg<J>(1), k.reg<J>(2), k.reg<J>(3), pk.b[J][0], pk.b[J][1])
    KVMIX_KEY_STEP(0, s), KVMIX_KEY_STEP(1, s2), KVMIX_KEY_STEP(2, s), KVMIX_KEY_STEP(3, s2);
    KVMIX_KEY_STEP(4, s), KVMIX_KEY_STEP(5, s2), KVMIX_KEY_STEP(6, s), KVMIX_KEY_STEP(7, s2);
    if (kHigh) { /* Kitty's high codes: register a_r of k-step j at bits 2 (r + 4 j) */
        const uint32_t hw = *(const uint32_t *)(slot + kKittyHighSlotOffset + lane * 4);
#pragma unroll
        for (int j = 0; j < 2; j++)
            mma(j ? s2 : s, (hw >> (8 * j)) & 0x00030003u, (hw >> (8 * j + 2)) & 0x00030003u,
                (hw >> (8 * j + 4)) & 0x00030003u, (hw >> (8 * j + 6)) & 0x00030003u, pk.high[j][0],
                pk.high[j][1]);
    }
    x[0] = fmaf(s[0] + s2[0], pk.scale, pk.bias0), x[1] = fmaf(s[1] + s2[1], pk.scale, pk.bias1);
    x[2] = fmaf(s[2] + s2[2], pk.scale, pk.bias0), x[3] = fmaf(s[3] + s2[3], pk.scale, pk.bias1);
}

/* INT4 keys: one accumulator per group (its two k-steps), times the tokens' scales after the
   mma; the minimum terms one mma of the tokens' minima (A: tokens x groups) against the query's
   group sums (B: groups x heads, query_sums). */
__device__ __forceinline__ void logits_int4(float *x, const PageKeys &pk, const uint8_t *slot,
                                            int lane, uint32_t query_sums) {
    const int g = lane >> 2, t = lane & 3;
    LaneCodes<kInt4> k;
    k.load(slot + lane * 32);
    const uint8_t *meta = slot + key_meta_slot_offset(kInt4);
    const uint2 s_lo = *(const uint2 *)(meta + 8 * g), s_hi = *(const uint2 *)(meta + 8 * (g + 8));
    const uint32_t m_lo = *(const uint32_t *)(meta + 128 + 8 * g + 4 * (t & 1)),
                   m_hi = *(const uint32_t *)(meta + 128 + 8 * (g + 8) + 4 * (t & 1));
    const __half *scale_lo = (const __half *)&s_lo, *scale_hi = (const __half *)&s_hi;
    float raw[4] = {};
    /* keys kept in the values' order: each 8 x 8 block transposed in registers (a1 <-> a2) */
#define KVMIX_KEY_STEP_T(J, ACC)                                                                   \
    mma(ACC, transpose8x8(k.reg<J>(0)), transpose8x8(k.reg<J>(2)), transpose8x8(k.reg<J>(1)),      \
        transpose8x8(k.reg<J>(3)), pk.b[J][0], pk.b[J][1])
    /* a group's two k-steps, then its tokens' scales (rows g, g + 8): one accumulator at a time */
#define KVMIX_KEY_GROUP(G)                                                                         \
    do {                                                                                           \
        float acc[4] = {};                                                                         \
        KVMIX_KEY_STEP_T(2 * G, acc), KVMIX_KEY_STEP_T(2 * G + 1, acc);                            \
        const float lo = __half2float(scale_lo[G]), hi = __half2float(scale_hi[G]);                \
        raw[0] = fmaf(lo, acc[0], raw[0]), raw[1] = fmaf(lo, acc[1], raw[1]);                      \
        raw[2] = fmaf(hi, acc[2], raw[2]), raw[3] = fmaf(hi, acc[3], raw[3]);                      \
    } while (0)
    KVMIX_KEY_GROUP(0);
    KVMIX_KEY_GROUP(1);
    KVMIX_KEY_GROUP(2);
    KVMIX_KEY_GROUP(3);
#undef KVMIX_KEY_GROUP
#undef KVMIX_KEY_STEP_T
#undef KVMIX_KEY_STEP
    float bias[4] = {};
    mma(bias, t < 2 ? m_lo : 0u, t < 2 ? m_hi : 0u, 0u, 0u, query_sums, 0u);
#pragma unroll
    for (int i = 0; i < 4; i++) x[i] = fmaf(raw[i], pk.scale, bias[i] * kLog2eOverSqrtD);
}

/* One tile from its ring slot; rows at or past valid_rows (the sequence's end) count for nothing. */
template <int kKind, bool kTail>
__device__ __forceinline__ void attend_tile(Running &r, const PageKeys &pk, const uint8_t *slot,
                                            int lane, int valid_rows, uint32_t query_sums) {
    const int g = lane >> 2, t = lane & 3;
    float x[4];
    if (kKind == kInt4)
        logits_int4(x, pk, slot, lane, query_sums);
    else
        logits_int2<kKind == kKitty>(x, pk, slot, lane);
    if (kTail) {
        if (g >= valid_rows) x[0] = x[1] = -INFINITY;
        if (g + 8 >= valid_rows) x[2] = x[3] = -INFINITY;
    }
    /* lazy: the columns' maxima are reduced, and the running sums rescaled, only when a logit
       passes its column's running maximum by 2^8 (so p <= 256 in fp16 until then) */
    const bool over =
        fmaxf(x[0], x[2]) > r.run0 + kLazyLog2 || fmaxf(x[1], x[3]) > r.run1 + kLazyLog2;
    if (__any_sync(0xffffffffu, over)) {
        float top0 = fmaxf(x[0], x[2]), top1 = fmaxf(x[1], x[3]);
#pragma unroll
        for (int o2 = 4; o2 < 32; o2 <<= 1) {
            top0 = fmaxf(top0, __shfl_xor_sync(0xffffffffu, top0, o2));
            top1 = fmaxf(top1, __shfl_xor_sync(0xffffffffu, top1, o2));
        }
        const float new0 = fmaxf(r.run0, top0), new1 = fmaxf(r.run1, top1);
        const float a0 = exp2_approx(r.run0 - new0), a1 = exp2_approx(r.run1 - new1);
#pragma unroll
        for (int m = 0; m < 8; m++)
            r.o[m][0] *= a0, r.o[m][1] *= a1, r.o[m][2] *= a0, r.o[m][3] *= a1;
        r.mins[0] *= a0, r.mins[1] *= a1, r.mins[2] *= a0, r.mins[3] *= a1;
        r.run0 = new0, r.run1 = new1;
    }
    /* columns 4..7 (lanes t >= 2) are no heads: their logits are 0 and their p, at most 1, land in
       output columns nobody reads */
    const uint32_t p_lo = pack_half2(exp2_approx(x[0] - r.run0), exp2_approx(x[1] - r.run1));
    const uint32_t p_hi = pack_half2(exp2_approx(x[2] - r.run0), exp2_approx(x[3] - r.run1));
    const uint32_t pb0 = transpose8x8(p_lo), pb1 = transpose8x8(p_hi); /* B: tokens x head g */

    const uint8_t *vmeta = slot + value_meta_slot_offset(kKind);
    const uint32_t ones = g == 4 ? 0x3C003C00u : 0u;
    LaneCodes<kKind == kInt4 ? kInt4 : kInt2> v;
    v.load(slot + value_slot_offset(kKind) + lane * (kKind == kInt4 ? 32 : 16));
#define KVMIX_VALUE_STEP(J, B0, B1)                                                                \
    mma(r.o[J], v.template reg<J>(0), v.template reg<J>(1), v.template reg<J>(2),                  \
        v.template reg<J>(3), B0, B1)
    if (kKind == kKitty) { /* one group a token: one B for every channel tile, minima in row 0 */
        const uint2 sc = *(const uint2 *)(vmeta + 8 * t), mn = *(const uint2 *)(vmeta + 32 + 8 * t);
        mma(r.mins, g == 0 ? mn.x : ones, 0u, g == 0 ? mn.y : ones, 0u, pb0, pb1);
        const uint32_t b0 = mul_half2(pb0, sc.x), b1 = mul_half2(pb1, sc.y);
        KVMIX_VALUE_STEP(0, b0, b1), KVMIX_VALUE_STEP(1, b0, b1), KVMIX_VALUE_STEP(2, b0, b1);
        KVMIX_VALUE_STEP(3, b0, b1), KVMIX_VALUE_STEP(4, b0, b1), KVMIX_VALUE_STEP(5, b0, b1);
        KVMIX_VALUE_STEP(6, b0, b1), KVMIX_VALUE_STEP(7, b0, b1);
        return;
    }
    const uint4 sc_a = *(const uint4 *)(vmeta + 32 * t),
                sc_b = *(const uint4 *)(vmeta + 32 * t + 16);
    const uint2 mn = *(const uint2 *)(vmeta + 128 + 32 * (g & 3) + 8 * t);
    mma(r.mins, g < 4 ? mn.x : ones, 0u, g < 4 ? mn.y : ones, 0u, pb0, pb1);
    uint32_t b0 = mul_half2(pb0, sc_a.x), b1 = mul_half2(pb1, sc_a.y);
    KVMIX_VALUE_STEP(0, b0, b1), KVMIX_VALUE_STEP(1, b0, b1);
    b0 = mul_half2(pb0, sc_a.z), b1 = mul_half2(pb1, sc_a.w);
    KVMIX_VALUE_STEP(2, b0, b1), KVMIX_VALUE_STEP(3, b0, b1);
    b0 = mul_half2(pb0, sc_b.x), b1 = mul_half2(pb1, sc_b.y);
    KVMIX_VALUE_STEP(4, b0, b1), KVMIX_VALUE_STEP(5, b0, b1);
    b0 = mul_half2(pb0, sc_b.z), b1 = mul_half2(pb1, sc_b.w);
    KVMIX_VALUE_STEP(6, b0, b1), KVMIX_VALUE_STEP(7, b0, b1);
#undef KVMIX_VALUE_STEP
}

/* Tile `tile` of a page of kind kKind into a ring slot; an INT2 page's key metadata travels with
   its first tile, an INT4 tile's with the tile. */
template <int kKind>
__device__ __forceinline__ void copy_tile(uint32_t slot, const uint8_t *page, int tile, int lane) {
    if (kKind == kKitty) { /* the slot list and the page's key metadata with its first tile */
        copy16(slot + lane * 16, page + tile * kCodeBytes + lane * 16);
        copy16(slot + kCodeBytes + lane * 16,
               page + kKittyValueOffset + tile * kCodeBytes + lane * 16);
        if (lane < 4)
            copy16(slot + 2 * kCodeBytes + lane * 16,
                   page + kKittyValueMetaOffset + tile * kKittyValueMetaBytes + lane * 16);
        else if (lane >= 8 && lane < 16)
            copy16(slot + kKittyHighSlotOffset + (lane - 8) * 16,
                   page + kKittyHighOffset + tile * kHighBytes + (lane - 8) * 16);
        if (tile == 0) {
            copy16(slot + 2 * kCodeBytes + kValueMetaBytes + lane * 16,
                   page + kKittyKeyMetaOffset + lane * 16);
            if (lane >= 16 && lane < 18)
                copy16(slot + kKittySlotsSlotOffset + (lane - 16) * 16,
                       page + kKittySlotsOffset + (lane - 16) * 16);
        }
    } else if (kKind == kInt2) {
        copy16(slot + lane * 16, page + tile * kCodeBytes + lane * 16);
        copy16(slot + kCodeBytes + lane * 16, page + kValueOffset + tile * kCodeBytes + lane * 16);
        if (lane < 16)
            copy16(slot + 2 * kCodeBytes + lane * 16,
                   page + kValueMetaOffset + tile * kValueMetaBytes + lane * 16);
        if (tile == 0)
            copy16(slot + 2 * kCodeBytes + kValueMetaBytes + lane * 16,
                   page + kKeyMetaOffset + lane * 16);
    } else {
        const uint8_t *keys = page + tile * kCode4Bytes + lane * 32;
        const uint8_t *values = page + kValue4Offset + tile * kCode4Bytes + lane * 32;
        copy16(slot + lane * 32, keys), copy16(slot + lane * 32 + 16, keys + 16);
        copy16(slot + kCode4Bytes + lane * 32, values);
        copy16(slot + kCode4Bytes + lane * 32 + 16, values + 16);
        if (lane < 16) /* lanes 0..15 the value metadata, 16..31 the key metadata */
            copy16(slot + 2 * kCode4Bytes + lane * 16,
                   page + kValueMeta4Offset + tile * kMeta4Bytes + lane * 16);
        else
            copy16(slot + 2 * kCode4Bytes + kMeta4Bytes + (lane - 16) * 16,
                   page + kKeyMeta4Offset + tile * kMeta4Bytes + (lane - 16) * 16);
    }
}
/* kKinds: the page kinds a kernel reads, bit 1 << kind (a mix of one kind needs no branch) */
/* The one kind of a kernel that reads one (-1 for the INT2 + INT4 kernel). */
__host__ __device__ constexpr int single_kind(int kinds) {
    return kinds == 1 << kInt2    ? kInt2
           : kinds == 1 << kInt4  ? kInt4
           : kinds == 1 << kKitty ? kKitty
                                  : -1;
}
template <int kKinds>
__device__ __forceinline__ void copy_tile_of(int kind, uint32_t slot, const uint8_t *page, int tile,
                                             int lane) {
    constexpr int only = single_kind(kKinds);
    if (only >= 0)
        copy_tile < only<0 ? 0 : only>(slot, page, tile, lane);
    else if (kind == kInt2)
        copy_tile<kInt2>(slot, page, tile, lane);
    else
        copy_tile<kInt4>(slot, page, tile, lane);
}

/* What a unit's warp carries from page to page. */
struct Unit {
    const uint8_t *ring;
    uint32_t ring_addr;
    const uint2 *qfrag;
    int lane, query_k;
    uint32_t query_sums;
};

/* The eight tiles of one page in two halves of kStages (one code path a half, for the
   instruction cache), the copies kStages - 1 tiles ahead (into the next page, of next_kind,
   where there is one); the unit's last page (kLast) stops at its tokens and masks its last tile. */
static_assert(kStages * 2 == kTilesPerPage, "a half page is one turn of the ring");
template <int kKind, bool kLast, int kKinds>
__device__ __forceinline__ void attend_page(Running &r, PageKeys &pk, const Unit &w,
                                            const uint8_t *page, const uint8_t *next_page,
                                            int next_kind, int page_tokens) {
#pragma unroll 1
    for (int half = 0; half < 2; half++) {
#pragma unroll
        for (int i = 0; i < kStages; i++) {
            const int j = half * kStages + i;
            const uint32_t dst = w.ring_addr + ((i + kStages - 1) % kStages) * kSlotBytes;
            if (half == 0)
                copy_tile<kKind>(dst, page, i + kStages - 1, w.lane);
            else if (i == 0)
                copy_tile<kKind>(dst, page, kTilesPerPage - 1, w.lane);
            else if (!kLast)
                copy_tile_of<kKinds>(next_kind, dst, next_page, i - 1, w.lane);
            commit(); /* an empty group past the end keeps the wait's count */
            wait_groups<kStages - 1>();
            __syncwarp();
            const uint8_t *slot = w.ring + i * kSlotBytes;
            if (i == 0 && half == 0) {
                if (kKind == kInt4)
                    page_keys_int4(w.qfrag, w.lane, w.query_k, pk);
                else
                    page_keys_int2<kKind == kKitty>(slot + key_meta_slot_offset(kInt2), w.qfrag,
                                                    w.lane, pk, slot + kKittySlotsSlotOffset);
            }
            if (!kLast) {
                attend_tile<kKind, false>(r, pk, slot, w.lane, kTile, w.query_sums);
            } else if (j * kTile < page_tokens) {
                if ((j + 1) * kTile <= page_tokens)
                    attend_tile<kKind, false>(r, pk, slot, w.lane, kTile, w.query_sums);
                else
                    attend_tile<kKind, true>(r, pk, slot, w.lane, page_tokens - j * kTile,
                                             w.query_sums);
            }
            __syncwarp(); /* every lane is done with this slot before it is refilled */
        }
    }
}

/* A page of either kind: the value accumulators follow its code positions first. */
template <bool kLast, int kKinds>
__device__ __forceinline__ void
attend_page_either(int kind, Running &r, PageKeys &pk, const Unit &w, const uint8_t *page,
                   const uint8_t *next_page, int next_kind, int page_tokens) {
    if (kind != r.kind) change_positions(r, kind);
    if (kind == kInt2)
        attend_page<kInt2, kLast, kKinds>(r, pk, w, page, next_page, next_kind, page_tokens);
    else
        attend_page<kInt4, kLast, kKinds>(r, pk, w, page, next_page, next_kind, page_tokens);
}

template <int kKinds, bool kLast>
__device__ __forceinline__ void attend_page_of(int kind, Running &r, PageKeys &pk, const Unit &w,
                                               const uint8_t *page, const uint8_t *next_page,
                                               int next_kind, int page_tokens) {
    constexpr int only = single_kind(kKinds);
    if (only >= 0)
        attend_page <
            only<0 ? 0 : only, kLast, kKinds>(r, pk, w, page, next_page, next_kind, page_tokens);
    else
        attend_page_either<kLast, kKinds>(kind, r, pk, w, page, next_page, next_kind, page_tokens);
}

template <int kKinds>
__global__ void __launch_bounds__(kWarps * 32, KMIN_BLOCKS)
    tile_decode(const uint8_t *__restrict__ pool, const int *__restrict__ page_table,
                const float *__restrict__ q, Units u, float *__restrict__ partial_o,
                float2 *__restrict__ partial_ml) {
    extern __shared__ __align__(16) uint8_t smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int unit = blockIdx.x * kWarps + warp;
    if (unit >= u.n_units) return; /* warps are independent: no block barrier follows */
    Unit w;
    w.ring = smem + warp * kWarpBytes;
    w.ring_addr = (uint32_t)__cvta_generic_to_shared(w.ring);
    w.lane = lane;
    uint2 *qfrag = (uint2 *)(w.ring + kStages * kSlotBytes);
    w.qfrag = qfrag;
    const int head = unit / u.units_per_head,
              first_page = (unit % u.units_per_head) * u.chunk_pages;
    const int n_pages = min(first_page + u.chunk_pages, u.pages_per_seq) - first_page;
    const int end_token = min((first_page + n_pages) * kPage, u.n_tokens);
    /* the unit's page table entries (at most 32), one a lane */
    const int my_entry =
        lane < n_pages ? page_table[(size_t)head * u.pages_per_seq + first_page + lane] : 0;
    auto entry_at = [&](int i) { return __shfl_sync(0xffffffffu, my_entry, i); };
    auto page_of = [&](int entry) { return pool + (size_t)(entry >> 2) * kPageUnit; };

    int entry = entry_at(0);
    const uint8_t *page = page_of(entry);
#pragma unroll
    for (int k = 0; k < kStages - 1; k++) {
        copy_tile_of<kKinds>(entry & 3, w.ring_addr + k * kSlotBytes, page, k, lane);
        commit();
    }
    /* (while the first tiles travel) the query as the key product's B fragments (fp16; zero for
       columns 4..7), one set a lane; its headroom K_q; its group sums as B of the INT4 keys'
       minimum terms (groups 2t, 2t+1 of head g in lanes t < 2, g < 4) */
    {
        const float *qh = q + ((size_t)head * kHeadsPerKv + (g & 3)) * kDim;
        uint32_t top = 0;
#pragma unroll
        for (int s = 0; s < 8; s++) {
            const float2 lo = *(const float2 *)(qh + 16 * s + 2 * t),
                         hi = *(const float2 *)(qh + 16 * s + 2 * t + 8);
            const uint2 f = g < kHeadsPerKv
                                ? make_uint2(pack_half2(lo.x, lo.y), pack_half2(hi.x, hi.y))
                                : make_uint2(0u, 0u);
            qfrag[s * 32 + lane] = f;
            top = max_abs_half2(top, max_abs_half2(f.x, f.y));
        }
        w.query_k = fp16_headroom(top);
        float sum0 = 0.0f, sum1 = 0.0f;
        if (g < kHeadsPerKv && t < 2)
            for (int c = 0; c < kGroup; c++)
                sum0 += qh[2 * t * kGroup + c], sum1 += qh[(2 * t + 1) * kGroup + c];
        w.query_sums = g < kHeadsPerKv && t < 2 ? pack_half2(sum0, sum1) : 0u;
    }
    __syncwarp();

    Running r = {};
    r.run0 = r.run1 = -INFINITY;
    r.kind = kKinds == 1 << kInt4 ? kInt4 : kInt2;
    PageKeys pk;
    for (int i = 0; i < n_pages - 1; i++) {
        const int next = entry_at(i + 1);
        attend_page_of<kKinds, false>(entry & 3, r, pk, w, page, page_of(next), next & 3, kPage);
        entry = next, page = page_of(next);
    }
    attend_page_of<kKinds, true>(entry & 3, r, pk, w, page, nullptr, 0,
                                 end_token - (first_page + n_pages - 1) * kPage);
    wait_groups<0>();

    const float l0 = __shfl_sync(0xffffffffu, r.mins[0], 16 + t),
                l1 = __shfl_sync(0xffffffffu, r.mins[1], 16 + t);
    float *po = partial_o + (size_t)unit * kHeadsPerKv * kDim;
#pragma unroll
    for (int m = 0; m < 8; m++) {
        const float up = power_of_two(24 - code_position(r.kind, m));
        const int group = kKinds == 1 << kKitty ? 0 : m / 2; /* the minima's row */
        const float add0 = __shfl_sync(0xffffffffu, r.mins[0], 4 * group + t);
        const float add1 = __shfl_sync(0xffffffffu, r.mins[1], 4 * group + t);
        if (t < 2) {
            const int c = 16 * m + g;
            po[(2 * t) * kDim + c] = fmaf(r.o[m][0], up, add0);
            po[(2 * t + 1) * kDim + c] = fmaf(r.o[m][1], up, add1);
            po[(2 * t) * kDim + c + 8] = fmaf(r.o[m][2], up, add0);
            po[(2 * t + 1) * kDim + c + 8] = fmaf(r.o[m][3], up, add1);
        }
    }
    if (g == 0 && t < 2) {
        partial_ml[(size_t)unit * kHeadsPerKv + 2 * t] = make_float2(r.run0, l0);
        partial_ml[(size_t)unit * kHeadsPerKv + 2 * t + 1] = make_float2(r.run1, l1);
    }
}

/* The units' partial softmaxes of each query head, merged: a block per (kv head, query head, 32
   channels), its eight warps each folding every eighth unit, then folded together. */
constexpr int kMergeSlices = 8, kMergeChannels = 32;
__global__ void __launch_bounds__(kMergeSlices *kMergeChannels)
    merge_units(const float *__restrict__ partial_o, const float2 *__restrict__ partial_ml, Units u,
                float *__restrict__ out) {
    __shared__ float3 folded[kMergeSlices][kMergeChannels];
    const int chunks = kDim / kMergeChannels, qh = blockIdx.x / chunks;
    const int head = qh / kHeadsPerKv, within = qh % kHeadsPerKv;
    const int c = (blockIdx.x % chunks) * kMergeChannels + (threadIdx.x % kMergeChannels);
    const int slice = threadIdx.x / kMergeChannels;
    float top = -INFINITY, den = 0.0f, num = 0.0f;
#pragma unroll 4
    for (int i = slice; i < u.units_per_head; i += kMergeSlices) {
        const size_t unit = (size_t)head * u.units_per_head + i;
        const float2 ml = partial_ml[unit * kHeadsPerKv + within];
        const float o = partial_o[(unit * kHeadsPerKv + within) * kDim + c];
        const float next = fmaxf(top, ml.x);
        if (next == -INFINITY) continue;
        const float a = exp2f(top - next), w = exp2f(ml.x - next);
        den = den * a + w * ml.y, num = num * a + w * o, top = next;
    }
    folded[slice][threadIdx.x % kMergeChannels] = make_float3(top, den, num);
    __syncthreads();
    if (slice == 0) {
        float t2 = -INFINITY;
        for (int k = 0; k < kMergeSlices; k++) t2 = fmaxf(t2, folded[k][threadIdx.x].x);
        float d2 = 0.0f, n2 = 0.0f;
        for (int k = 0; k < kMergeSlices; k++) {
            const float3 f = folded[k][threadIdx.x];
            if (f.x == -INFINITY) continue;
            const float w = exp2f(f.x - t2);
            d2 += w * f.y, n2 += w * f.z;
        }
        out[(size_t)qh * kDim + c] = n2 / d2;
    }
}

/* The plain read: every byte of [src, src + n) once, 16 bytes a load, four loads in flight. */
__global__ void plain_read(const uint4 *__restrict__ src, size_t n16, uint32_t *sink) {
    uint32_t acc = 0;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        const uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride],
                    d = src[i + 3 * stride];
        acc ^= a.x ^ a.w ^ b.y ^ b.z ^ c.x ^ c.w ^ d.y ^ d.z;
    }
    for (; i < n16; i += stride) acc ^= src[i].x;
    if (acc == 0x12345678u) *sink = acc; /* keeps the loads */
}

/* ---- the run ---- */

struct Case {
    int batch, n_tokens;
};

/* The kind of page i of a sequence in a mix. */
static int page_kind(const char *mix, int i) {
    if (!strcmp(mix, "int4")) return kInt4;
    if (!strcmp(mix, "75/25")) return i % 4 == 3 ? kInt4 : kInt2;
    if (!strcmp(mix, "kitty")) return kKitty;
    return kInt2;
}

using DecodeKernel = void (*)(const uint8_t *, const int *, const float *, Units, float *,
                              float2 *);
/* The decode built for a mix's page kinds. */
static DecodeKernel kernel_of(const char *mix) {
    if (!strcmp(mix, "int4")) return tile_decode<1 << kInt4>;
    if (!strcmp(mix, "75/25")) return tile_decode<(1 << kInt2) | (1 << kInt4)>;
    if (!strcmp(mix, "kitty")) return tile_decode<1 << kKitty>;
    return tile_decode<1 << kInt2>;
}

static float median_ms(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

static void run_case(const char *mix, Case cs, int n_sms, int blocks_per_sm) {
    const DecodeKernel kernel = kernel_of(mix);
    const int heads = cs.batch * kKvHeads, pages = (cs.n_tokens + kPage - 1) / kPage;
    const size_t pool_pages = (size_t)heads * pages;
    /* pages scattered over the pool, as in an arena: the table's entries in a shuffled order */
    std::vector<size_t> order(pool_pages);
    for (size_t i = 0; i < pool_pages; i++) order[i] = i;
    uint64_t state = 0x9E3779B97F4A7C15ull;
    for (size_t i = pool_pages - 1; i > 0; i--)
        std::swap(order[i], order[next_random(state) % (i + 1)]);
    std::vector<int> table(pool_pages);
    size_t pool_bytes = 0;
    for (size_t i : order) {
        const int kind = page_kind(mix, (int)(i % pages));
        table[i] = (int)(pool_bytes / kPageUnit) * 4 + kind;
        pool_bytes += page_bytes_of(kind);
    }
    /* as many copies as keep the rotation beyond the L2 */
    const int sets = std::max(1, std::min(4, (int)std::ceil(400e6 / (double)pool_bytes)));
    std::vector<uint8_t> pool(pool_bytes);
    std::vector<float> channel_spread(kDim);
    for (int c = 0; c < kDim; c++) channel_spread[c] = 1.0f + 3.0f * (float)(c * 37 % kDim) / kDim;
#pragma omp parallel
    {
        std::vector<float> kf(kPage * kDim), vf(kPage * kDim);
#pragma omp for schedule(static)
        for (long p = 0; p < (long)pool_pages; p++) {
            uint64_t page_state = 0x2545F4914F6CDD1Dull * (uint64_t)(p + 1);
            for (int i = 0; i < kPage * kDim; i++)
                kf[i] = gaussian(page_state) * channel_spread[i % kDim],
                vf[i] = gaussian(page_state);
            quantize_page(table[p] & 3, kf.data(), vf.data(),
                          pool.data() + (size_t)(table[p] >> 2) * kPageUnit);
        }
    }
    std::vector<float> q((size_t)heads * kHeadsPerKv * kDim);
    for (auto &x : q) x = gaussian(state);

    Units u;
    u.pages_per_seq = pages, u.n_tokens = cs.n_tokens;
    const int slots = n_sms * blocks_per_sm * kWarps;
    u.chunk_pages = std::min(32, std::max(1, (int)((pool_pages + slots - 1) / slots)));
    u.units_per_head = (pages + u.chunk_pages - 1) / u.chunk_pages;
    u.n_units = heads * u.units_per_head;

    uint8_t *d_pool;
    int *d_table;
    float *d_q, *d_po, *d_out;
    float2 *d_ml;
    uint32_t *d_sink;
    CHECK(cudaMalloc(&d_pool, pool_bytes * sets));
    for (int s = 0; s < sets; s++)
        CHECK(cudaMemcpy(d_pool + s * pool_bytes, pool.data(), pool_bytes, cudaMemcpyHostToDevice));
    CHECK(cudaMalloc(&d_table, pool_pages * sizeof(int)));
    CHECK(cudaMemcpy(d_table, table.data(), pool_pages * sizeof(int), cudaMemcpyHostToDevice));
    CHECK(cudaMalloc(&d_q, q.size() * 4));
    CHECK(cudaMemcpy(d_q, q.data(), q.size() * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMalloc(&d_po, (size_t)u.n_units * kHeadsPerKv * kDim * 4));
    CHECK(cudaMalloc(&d_ml, (size_t)u.n_units * kHeadsPerKv * sizeof(float2)));
    CHECK(cudaMalloc(&d_out, q.size() * 4));
    CHECK(cudaMalloc(&d_sink, 4));

    const int smem = kWarps * kWarpBytes, grid = (u.n_units + kWarps - 1) / kWarps;
    auto decode_units = [&](int s) {
        kernel<<<grid, kWarps * 32, smem>>>(d_pool + s * pool_bytes, d_table, d_q, u, d_po, d_ml);
    };
    auto decode = [&](int s) {
        decode_units(s);
        merge_units<<<heads * kHeadsPerKv *(kDim / kMergeChannels),
                      kMergeSlices * kMergeChannels>>>(d_po, d_ml, u, d_out);
    };
    auto read = [&](int s) {
        plain_read<<<n_sms * 8, 256>>>((const uint4 *)(d_pool + s * pool_bytes), pool_bytes / 16,
                                       d_sink);
    };
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    auto median_time = [&](auto fn) {
        for (int i = 0; i < 3; i++) fn(i % sets);
        std::vector<float> ms;
        for (int i = 0; i < 30; i++) {
            CHECK(cudaEventRecord(e0));
            fn(i % sets);
            CHECK(cudaEventRecord(e1));
            CHECK(cudaEventSynchronize(e1));
            float x;
            CHECK(cudaEventElapsedTime(&x, e0, e1));
            ms.push_back(x);
        }
        return median_ms(ms);
    };
    const float read_ms = median_time(read), units_ms = median_time(decode_units),
                decode_ms = median_time(decode);
    decode(0);
    CHECK(cudaGetLastError());
    std::vector<float> out(q.size());
    CHECK(cudaMemcpy(out.data(), d_out, out.size() * 4, cudaMemcpyDeviceToHost));

    /* reference: sequence 0's eight kv heads and sequence batch-1's first, from the pool's bytes */
    double err = 0.0, ref_energy = 0.0;
    std::vector<float> kd((size_t)pages * kPage * kDim), vd((size_t)pages * kPage * kDim);
    for (int head : {0, 1, 2, 3, 4, 5, 6, 7, heads - kKvHeads}) {
        for (int p = 0; p < pages; p++) {
            const int e = table[(size_t)head * pages + p];
            dequantize_page(e & 3, pool.data() + (size_t)(e >> 2) * kPageUnit,
                            kd.data() + (size_t)p * kPage * kDim,
                            vd.data() + (size_t)p * kPage * kDim);
        }
        for (int h = 0; h < kHeadsPerKv; h++) {
            const float *qv = q.data() + ((size_t)head * kHeadsPerKv + h) * kDim;
            std::vector<double> logit(cs.n_tokens);
            double top = -1e300;
            for (int t = 0; t < cs.n_tokens; t++) {
                double d = 0;
                for (int c = 0; c < kDim; c++) d += (double)qv[c] * kd[(size_t)t * kDim + c];
                logit[t] = d / std::sqrt((double)kDim);
                top = std::max(top, logit[t]);
            }
            std::vector<double> acc(kDim, 0.0);
            double den = 0;
            for (int t = 0; t < cs.n_tokens; t++) {
                const double w = std::exp(logit[t] - top);
                den += w;
                for (int c = 0; c < kDim; c++) acc[c] += w * vd[(size_t)t * kDim + c];
            }
            for (int c = 0; c < kDim; c++) {
                const double r = acc[c] / den, x = out[((size_t)head * kHeadsPerKv + h) * kDim + c];
                err += (x - r) * (x - r), ref_energy += r * r;
            }
        }
    }
    const double gb = pool_bytes / 1e9;
    printf("%-6s %5d %7d %9.1f %9.4f %7.0f %9.4f %7.0f %6.1f%% %9.4f %6.1f%%  %6d %5d  %.1e\n", mix,
           cs.batch, cs.n_tokens, pool_bytes / 1e6, read_ms, gb / read_ms * 1e3, decode_ms,
           gb / decode_ms * 1e3, 100.0 * read_ms / decode_ms, units_ms, 100.0 * read_ms / units_ms,
           u.chunk_pages, u.n_units, err / ref_energy);
    cudaFree(d_pool), cudaFree(d_table), cudaFree(d_q), cudaFree(d_po), cudaFree(d_ml),
        cudaFree(d_out);
    cudaFree(d_sink);
}

int main(int argc, char **argv) {
    std::vector<Case> cases;
    std::vector<const char *> mixes;
    for (int i = 1; i < argc; i++) {
        Case c;
        if (!strcmp(argv[i], "kivi2") || !strcmp(argv[i], "int4") || !strcmp(argv[i], "75/25") ||
            !strcmp(argv[i], "kitty")) {
            mixes.push_back(argv[i]);
            continue;
        }
        if (sscanf(argv[i], "%d,%d", &c.batch, &c.n_tokens) != 2 || c.batch < 1 || c.n_tokens < 1) {
            fprintf(stderr, "usage: %s [kivi2|int4|75/25|kitty ...] [BATCH,CTX ...]\n", argv[0]);
            return 2;
        }
        cases.push_back(c);
    }
    if (mixes.empty()) mixes = {"kivi2", "int4", "75/25", "kitty"};
    if (cases.empty())
        cases = {{2, 5000},  {1, 4096},   {1, 8192},  {1, 131072},
                 {8, 32768}, {8, 131072}, {32, 32768}};
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s, %d SMs; tile order, head_dim %d, %d q heads a kv head, %d kv heads, pages "
           "of %d, %d stages of one tile\n",
           prop.name, prop.multiProcessorCount, kDim, kHeadsPerKv, kKvHeads, kPage, kStages);
    std::vector<int> blocks(mixes.size());
    for (size_t i = 0; i < mixes.size(); i++) {
        const DecodeKernel kernel = kernel_of(mixes[i]);
        const int smem = kWarps * kWarpBytes;
        CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks[i], kernel, kWarps * 32, smem));
        cudaFuncAttributes attr;
        CHECK(cudaFuncGetAttributes(&attr, kernel));
        printf("decode for %s: %d registers (%d B spilled), %d B shared a block of %d warps, %d "
               "blocks/SM (%d warps)\n",
               mixes[i], attr.numRegs, (int)attr.localSizeBytes, smem, kWarps, blocks[i],
               blocks[i] * kWarps);
    }
    printf("%-6s %5s %7s %9s %9s %7s %9s %7s %7s %9s %7s  %6s %5s  %s\n", "mix", "batch", "ctx",
           "MB", "read ms", "GB/s", "decode ms", "GB/s", "%same", "units ms", "%same", "pages",
           "units", "NMSE");
    printf("(decode: units and merge; units: the decode kernel alone; %%same: of the plain read of "
           "the same bytes)\n");
    for (size_t i = 0; i < mixes.size(); i++)
        for (Case c : cases) run_case(mixes[i], c, prop.multiProcessorCount, blocks[i]);
    return 0;
}
