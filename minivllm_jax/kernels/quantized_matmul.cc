// Weight-only quantized matmul on the CPU for few rows (decode steps): y[T, out] = x[T, in] @ W,
// with W int8 per output channel or int4 in groups along `in` (minivllm_jax/quantization.py
// has the layouts and the pure-JAX dequantize this must equal). The weights are read once, in
// place, and dequantized in registers; a decode step is bound by reading them.
//
// The weights come in the serving layout (`to_panels` there): panels of 64 output columns, each
// `[rows, 64]` contiguous. Work: panels over XLA's CPU threads (parallel.h). A panel is read in order, each input
// row's 64 weights one cache line (int8) or half of one (int4), and keeps the T rows' 64
// accumulators; int4 sums x * q per group, then adds scale * sum + min * sum(x) of the group.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef uint8_t u8x16 __attribute__((vector_size(16), aligned(1)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

constexpr int kCols = 64;    // output columns of one panel, the work block (4 vectors)
constexpr int kMaxRows = 4;  // rows of x per pass over the weights (their accumulators stay in registers)

inline v16 Load16(const float* p) { return *reinterpret_cast<const v16u*>(p); }
inline void Store16(float* p, v16 x) { *reinterpret_cast<v16u*>(p) = x; }

// Bytes to floats through int32. GCC 12 vectorizes the zero-extension of masked or shifted
// bytes (vpmovzxbd) but may turn a plain byte load's conversion into 16 scalar ones, so int8
// uses the AVX-512 sign extension where there is one; elsewhere a byte b read unsigned is the
// signed value (b ^ 128) - 128.
inline v16 U8ToFloat(u8x16 b) { return __builtin_convertvector(__builtin_convertvector(b, i32x16), v16); }
inline v16 S8ToFloat(const uint8_t* p) {
#if defined(__AVX512F__)
  return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  const u8x16 b = *reinterpret_cast<const u8x16*>(p);
  return __builtin_convertvector((__builtin_convertvector(b, i32x16) ^ 128) - 128, v16);
#endif
}

// The 64 weights of input row `i` in the panel of columns [o0, o0 + 64) as floats.
struct Int8Row {
  const int8_t* q;
  int64_t n_in;
  inline void Get(int64_t i, int64_t o0, v16 w[4]) const {
    const int8_t* p = q + (o0 / kCols * n_in + i) * kCols;
    for (int c = 0; c < 4; ++c) w[c] = S8ToFloat(reinterpret_cast<const uint8_t*>(p) + 16 * c);
  }
};

// Rows 2i and 2i + 1 of int4 weights (one byte holds both) as floats 0..15.
struct Int4Rows {
  const uint8_t* q;
  int64_t n_in;
  inline void Get(int64_t i2, int64_t o0, v16 lo[4], v16 hi[4]) const {
    const uint8_t* p = q + (o0 / kCols * (n_in / 2) + i2) * kCols;
    for (int c = 0; c < 4; ++c) {
      const u8x16 b = *reinterpret_cast<const u8x16*>(p + 16 * c);
      lo[c] = U8ToFloat(b & 15);
      hi[c] = U8ToFloat(b >> 4);
    }
  }
};

// Panels over the threads; in each, rows of x in passes of up to kMaxRows, each pass a
// compile-time row count so its accumulators are registers.
template <typename Pass>
void ForBlocksAndPasses(ffi::ThreadPool& pool, int64_t T, int64_t out, Pass pass) {
  minivllm::ParallelFor(pool, out / kCols, [&] {
    return [&](int64_t panel) {
      const int64_t o0 = panel * kCols;
      for (int64_t t0 = 0; t0 < T; t0 += kMaxRows) {
        switch (std::min<int64_t>(kMaxRows, T - t0)) {
          case 1: pass(std::integral_constant<int, 1>{}, t0, o0); break;
          case 2: pass(std::integral_constant<int, 2>{}, t0, o0); break;
          case 3: pass(std::integral_constant<int, 3>{}, t0, o0); break;
          default: pass(std::integral_constant<int, 4>{}, t0, o0); break;
        }
      }
    };
  });
}

ffi::Error MatmulInt8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> qweight, ffi::Buffer<ffi::F32> scales,
                          ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = qweight.dimensions();
  const int64_t out = static_cast<int64_t>(scales.element_count());
  if (xd.size() != 2 || wd.size() != 3 || xd[1] != wd[1] || wd[2] != kCols || wd[0] * kCols != out) {
    return ffi::Error::InvalidArgument("matmul_int8: want x [T, in], panels [out / 64, in, 64], scales [out]");
  }
  const int64_t T = xd[0], n_in = wd[1];
  const float* xp = x.typed_data();
  const float* sp = scales.typed_data();
  float* yp = y->typed_data();
  const Int8Row rows{qweight.typed_data(), n_in};
  ForBlocksAndPasses(pool, T, out, [&](auto rows_c, int64_t t0, int64_t o0) {
    constexpr int NT = decltype(rows_c)::value;
    v16 acc[NT][4] = {};
    for (int64_t i = 0; i < n_in; ++i) {
      v16 w[4];
      rows.Get(i, o0, w);
      for (int t = 0; t < NT; ++t) {
        const float xv = xp[(t0 + t) * n_in + i];
        for (int c = 0; c < 4; ++c) acc[t][c] += xv * w[c];
      }
    }
    for (int t = 0; t < NT; ++t)
      for (int c = 0; c < 4; ++c) Store16(yp + (t0 + t) * out + o0 + 16 * c, acc[t][c] * Load16(sp + o0 + 16 * c));
  });
  return ffi::Error::Success();
}

ffi::Error MatmulInt4Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> qweight, ffi::Buffer<ffi::F32> scales,
                          ffi::Buffer<ffi::F32> mins, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = qweight.dimensions(), sd = scales.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || sd.size() != 2 || xd[1] != 2 * wd[1] || wd[2] != kCols ||
      wd[0] * kCols != sd[1] || mins.element_count() != scales.element_count()) {
    return ffi::Error::InvalidArgument(
        "matmul_int4: want x [T, in], panels [out / 64, in / 2, 64], scales/mins [in / g, out]");
  }
  const int64_t T = xd[0], n_in = xd[1], out = sd[1], groups = sd[0];
  if (n_in % groups != 0 || (n_in / groups) % 2 != 0) {
    return ffi::Error::InvalidArgument("matmul_int4: groups must be even-sized");
  }
  const int64_t g_size = n_in / groups;
  const float* xp = x.typed_data();
  const float* sp = scales.typed_data();
  const float* mp = mins.typed_data();
  float* yp = y->typed_data();
  const Int4Rows rows{qweight.typed_data(), n_in};
  // Each row's sum of x over each group: the minimums' share of the dot product.
  std::vector<float> xsum(T * groups, 0.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < n_in; ++i) xsum[t * groups + i / g_size] += xp[t * n_in + i];
  ForBlocksAndPasses(pool, T, out, [&](auto rows_c, int64_t t0, int64_t o0) {
    constexpr int NT = decltype(rows_c)::value;
    v16 acc[NT][4] = {};
    for (int64_t g = 0; g < groups; ++g) {
      v16 part[NT][4] = {};
      for (int64_t i = g * g_size; i < (g + 1) * g_size; i += 2) {
        v16 lo[4], hi[4];
        rows.Get(i / 2, o0, lo, hi);
        for (int t = 0; t < NT; ++t) {
          const float x0 = xp[(t0 + t) * n_in + i], x1 = xp[(t0 + t) * n_in + i + 1];
          for (int c = 0; c < 4; ++c) part[t][c] += x0 * lo[c] + x1 * hi[c];
        }
      }
      for (int c = 0; c < 4; ++c) {
        const v16 s = Load16(sp + g * out + o0 + 16 * c), m = Load16(mp + g * out + o0 + 16 * c);
        for (int t = 0; t < NT; ++t) acc[t][c] += part[t][c] * s + xsum[(t0 + t) * groups + g] * m;
      }
    }
    for (int t = 0; t < NT; ++t)
      for (int c = 0; c < 4; ++c) Store16(yp + (t0 + t) * out + o0 + 16 * c, acc[t][c]);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MinivllmMatmulInt8F32, MatmulInt8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::S8>>()   // qweight_panels
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MinivllmMatmulInt4F32, MatmulInt4Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::U8>>()   // qweight4_panels
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales
                                  .Arg<ffi::Buffer<ffi::F32>>()  // mins
                                  .Ret<ffi::Buffer<ffi::F32>>());
