// ggml's wire-dtype converters, in plain C++ (the fake links nothing of ggml).
//
// The six converters dgr-worker resolves from an engine library (worker/server/engine_lib.cpp) for the lossy
// wire dtypes, under ggml's own names, equal bit for bit to what a real engine library exports (ggml.c's
// ggml_*_row and ggml-quants.c's q8_0 reference of the pinned llama.cpp): here in plain C++, since the fake
// links nothing of ggml. tests/worker/test_fake_engine_cpp.py compares them with the real library's.
//
//   f16:  ggml_compute_fp32_to_fp16 / _fp16_to_fp32 (ggml-impl.h, after Maratyszcza's FP16): round to nearest
//         even in IEEE arithmetic, subnormals kept, overflow an infinity; a NaN becomes sign|0x7E00 (its payload
//         dropped), and widening quiets a signalling NaN (the multiply does).
//   bf16: ggml_compute_fp32_to_bf16: round to nearest even on the bits, a NaN kept with its payload and quieted.
//   q8_0: quantize_row_q8_0_ref: per block of 32, amax by `amax > |x| ? amax : |x|` in order (a NaN resets it,
//         as ggml's MAX), d = amax / 127, id = d ? 1 / d : 0, the scale stored as f16, q = (int8) roundf(x * id).
//         ggml leaves that last cast undefined out of int8's range (NaN or infinity: a NaN block, or a block
//         whose d is subnormal so that 1 / d overflows); a real library built for x86 truncates to int32 as
//         cvttss2si does (out of range: INT32_MIN) and keeps the low byte, and so does this one, everywhere.
#include "dgr_fake_internal.h"

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

inline uint32_t f32_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}

inline float f32_from(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline float fp16_to_fp32(uint16_t h) {
    const uint32_t w = uint32_t(h) << 16;
    const uint32_t sign = w & UINT32_C(0x80000000);
    const uint32_t two_w = w + w;
    const uint32_t exp_offset = UINT32_C(0xE0) << 23;
    const float exp_scale = 0x1.0p-112f;
    const float normalized = f32_from((two_w >> 4) + exp_offset) * exp_scale;
    const uint32_t magic_mask = UINT32_C(126) << 23;
    const float magic_bias = 0.5f;
    const float denormalized = f32_from((two_w >> 17) | magic_mask) - magic_bias;
    const uint32_t denormalized_cutoff = UINT32_C(1) << 27;
    return f32_from(sign | (two_w < denormalized_cutoff ? f32_bits(denormalized) : f32_bits(normalized)));
}

inline uint16_t fp32_to_fp16(float f) {
    const float scale_to_inf = 0x1.0p+112f;
    const float scale_to_zero = 0x1.0p-110f;
    float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
    const uint32_t w = f32_bits(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & UINT32_C(0x80000000);
    uint32_t bias = shl1_w & UINT32_C(0xFF000000);
    if (bias < UINT32_C(0x71000000)) bias = UINT32_C(0x71000000);
    base = f32_from((bias >> 1) + UINT32_C(0x07800000)) + base;
    const uint32_t bits = f32_bits(base);
    const uint32_t exp_bits = (bits >> 13) & UINT32_C(0x00007C00);
    const uint32_t mantissa_bits = bits & UINT32_C(0x00000FFF);
    const uint32_t nonsign = exp_bits + mantissa_bits;
    return uint16_t((sign >> 16) | (shl1_w > UINT32_C(0xFF000000) ? UINT16_C(0x7E00) : nonsign));
}

inline uint16_t fp32_to_bf16(float f) {
    const uint32_t u = f32_bits(f);
    if ((u & UINT32_C(0x7fffffff)) > UINT32_C(0x7f800000)) return uint16_t((u >> 16) | 64);   // NaN: quiet
    return uint16_t((u + (UINT32_C(0x7fff) + ((u >> 16) & 1))) >> 16);
}

// (int8_t) of a float as x86's cvttss2si then a byte store: truncate toward zero to int32, INT32_MIN for a
// NaN or anything out of int32's range, keep the low byte.
inline int8_t x86_int8(float r) {
    const int32_t i = (r >= -2147483648.0f && r < 2147483648.0f) ? int32_t(r) : INT32_MIN;
    return int8_t(uint8_t(uint32_t(i) & 0xFFu));
}

constexpr int QK8_0 = 32;
struct BlockQ8_0 {
    uint16_t d;
    int8_t qs[QK8_0];
};
static_assert(sizeof(BlockQ8_0) == 34, "q8_0 block: an f16 scale, then 32 int8");

}  // namespace

extern "C" {

DGR_API void ggml_fp16_to_fp32_row(const uint16_t * x, float * y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = fp16_to_fp32(x[i]);
}

DGR_API void ggml_fp32_to_fp16_row(const float * x, uint16_t * y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = fp32_to_fp16(x[i]);
}

DGR_API void ggml_bf16_to_fp32_row(const uint16_t * x, float * y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = f32_from(uint32_t(x[i]) << 16);
}

DGR_API void ggml_fp32_to_bf16_row_ref(const float * x, uint16_t * y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = fp32_to_bf16(x[i]);
}

DGR_API void quantize_row_q8_0_ref(const float * x, void * vy, int64_t k) {
    BlockQ8_0 * y = static_cast<BlockQ8_0 *>(vy);
    const int64_t nb = k / QK8_0;
    for (int64_t i = 0; i < nb; ++i) {
        float amax = 0.0f;
        for (int j = 0; j < QK8_0; ++j) {
            const float a = std::fabs(x[i * QK8_0 + j]);
            amax = amax > a ? amax : a;
        }
        const float d = amax / ((1 << 7) - 1);
        const float id = d != 0.0f ? 1.0f / d : 0.0f;     // NaN is not 0: ggml's `d ? ... : 0`
        y[i].d = fp32_to_fp16(d);
        for (int j = 0; j < QK8_0; ++j) y[i].qs[j] = x86_int8(std::round(x[i * QK8_0 + j] * id));
    }
}

DGR_API void dequantize_row_q8_0(const void * vx, float * y, int64_t k) {
    const BlockQ8_0 * x = static_cast<const BlockQ8_0 *>(vx);
    const int64_t nb = k / QK8_0;
    for (int64_t i = 0; i < nb; ++i) {
        const float d = fp16_to_fp32(x[i].d);
        for (int j = 0; j < QK8_0; ++j) y[i * QK8_0 + j] = float(x[i].qs[j]) * d;
    }
}

}  // extern "C"
