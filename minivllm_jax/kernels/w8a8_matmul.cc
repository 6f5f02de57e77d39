// W8A8 matmul on the CPU (vLLM's INT8 W8A8): y[T, out] = (xq @ wq) * sx[t] * sw[o], with int8
// weights per output channel (minivllm_jax/quantization.py: their layout and the pure-JAX
// reference this equals exactly) and int8 activations quantized here, per row:
// sx = max|x| * (1 / 127) (1 for a zero row), xq = round-half-even(x * (1 / sx)). Products
// are summed exactly in int32, so the only float steps are the quantization and the two
// scalings, done as the reference does them: the same floats, bit for bit.
//
// The weights come packed for AVX-512 VNNI and in panels of 64 columns (the serving layout,
// `quantization.to_panels`): int8 [ceil(out/64), ceil(in/4), 64, 4] (zeros pad the inputs to a
// multiple of 4 and the last panel's columns), so a panel is contiguous and 64 bytes of it are
// 16 columns x 4 consecutive inputs, one operand of vpdpbusd. That instruction multiplies
// unsigned by signed bytes, so the weights are read unsigned as w + 128 (an xor) and each row
// gives back 128 * sum(xq) at the end.
//
// Work: tiles of up to kRowBlock rows x one panel over XLA's CPU threads (parallel.h), panels
// outer, so neighbouring tiles share a panel while it is in cache; a tile in micro-tiles of
// 6 rows x 4 vectors, 24 int32 accumulators in registers. A build for a CPU
// without AVX-512 VNNI gets a plain loop with the same sums and the same float steps.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define MINIVLLM_W8A8_VNNI 1
#include <immintrin.h>
#endif

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMR = 6;             // rows of a micro-tile
constexpr int kNR = 4;             // 16-column vectors of a micro-tile (64 columns)
constexpr int64_t kPanel = 4 * 16 * kNR;  // bytes of one panel row: 64 columns x 4 inputs
constexpr int64_t kRowBlock = 96;          // rows of a work tile (16 micro-tiles)
// The first micro-tile of a tile fetches its panel this many rows ahead (the others find it in
// cache): at 1-16 rows, 10-30% more GOP/s here than the hardware prefetcher alone.
constexpr int64_t kPrefetchRows = 32;

// Row t of x as int8 (padded with zeros to kp), its scale and the sum of its int8 values.
#if MINIVLLM_W8A8_VNNI
void QuantizeRow(const float* x, int64_t n_in, int64_t kp, int8_t* q, float* scale, int32_t* sum) {
  __m512 amax = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n_in; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
  float m = _mm512_reduce_max_ps(amax);
  for (; i < n_in; ++i) m = std::max(m, std::fabs(x[i]));
  const float s = m > 0.0f ? m * (1.0f / 127.0f) : 1.0f, inv = 1.0f / s;
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  __m512i total = _mm512_setzero_si512();
  for (i = 0; i + 16 <= n_in; i += 16) {
    // x * (1 / s), rounded half to even (the default MXCSR)
    __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), vinv));
    v = _mm512_min_epi32(_mm512_max_epi32(v, lo), hi);
    total = _mm512_add_epi32(total, v);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(v));
  }
  int32_t acc = _mm512_reduce_add_epi32(total);
  for (; i < n_in; ++i) {
    const int32_t v = std::min(127, std::max(-127, static_cast<int32_t>(std::nearbyint(x[i] * inv))));
    q[i] = static_cast<int8_t>(v);
    acc += v;
  }
  for (; i < kp; ++i) q[i] = 0;
  *scale = s;
  *sum = acc;
}

#else
void QuantizeRow(const float* x, int64_t n_in, int64_t kp, int8_t* q, float* scale, int32_t* sum) {
  float m = 0.0f;
  for (int64_t i = 0; i < n_in; ++i) m = std::max(m, std::fabs(x[i]));
  const float s = m > 0.0f ? m * (1.0f / 127.0f) : 1.0f, inv = 1.0f / s;
  int32_t acc = 0;
  for (int64_t i = 0; i < n_in; ++i) {
    const int32_t v = std::min(127, std::max(-127, static_cast<int32_t>(std::nearbyint(x[i] * inv))));
    q[i] = static_cast<int8_t>(v);
    acc += v;
  }
  for (int64_t i = n_in; i < kp; ++i) q[i] = 0;
  *scale = s;
  *sum = acc;
}
#endif

#if MINIVLLM_W8A8_VNNI
// acc += u8 x s8 products of 4 bytes per lane (vpdpbusd). As an asm statement, since GCC 12's
// intrinsic keeps copying the accumulator between registers (and spilled 24 of them to the stack).
inline void Dpbusd(__m512i& acc, __m512i u8, __m512i s8) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
}

typedef int32_t Int32Alias __attribute__((may_alias, aligned(1)));

// MR rows x NR vectors of y: rows xq[0..MR) (kp bytes apart), columns [o0, o0 + 16 NR) from
// their panel.
template <int MR, int NR, bool Prefetch>
inline void MicroTile(const int8_t* xq, int64_t kp, const int8_t* panel, int64_t out, int64_t o0, const float* sx,
                      const int32_t* xsum, const float* sw, float* y) {
  __m512i acc[MR][NR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NR; ++c) acc[r][c] = _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int8_t* wp = panel;
  const int64_t in4 = kp / 4;
  for (int64_t k4 = 0; k4 < in4; ++k4, wp += kPanel) {
    if constexpr (Prefetch) {
#pragma GCC unroll 4
      for (int c = 0; c < NR; ++c) __builtin_prefetch(wp + kPrefetchRows * kPanel + 64 * c);
    }
    __m512i b[NR];
#pragma GCC unroll 4
    for (int c = 0; c < NR; ++c) b[c] = _mm512_xor_si512(_mm512_loadu_si512(wp + 64 * c), flip);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512i a = _mm512_set1_epi32(*reinterpret_cast<const Int32Alias*>(xq + r * kp + 4 * k4));
#pragma GCC unroll 4
      for (int c = 0; c < NR; ++c) Dpbusd(acc[r][c], b[c], a);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    const __m512i comp = _mm512_set1_epi32(128 * xsum[r]);
    const __m512 s = _mm512_set1_ps(sx[r]);
#pragma GCC unroll 4
    for (int c = 0; c < NR; ++c) {
      // (float(acc) * sx) * sw: the reference's order
      const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][c], comp)), s);
      _mm512_storeu_ps(y + r * out + o0 + 16 * c, _mm512_mul_ps(v, _mm512_loadu_ps(sw + o0 + 16 * c)));
    }
  }
}

// Rows [t0, t1) of y in the 16 NR columns from o0.
template <int NR>
void RowsOfTile(int64_t t0, int64_t t1, const int8_t* xq, int64_t kp, const int8_t* panel, int64_t out,
                int64_t o0, const float* sx, const int32_t* xsum, const float* sw, float* y) {
  const auto tile = [&](auto mr, auto prefetch, int64_t t) {
    MicroTile<decltype(mr)::value, NR, decltype(prefetch)::value>(xq + t * kp, kp, panel, out, o0, sx + t,
                                                                  xsum + t, sw, y + t * out);
  };
  const auto rest = [&](auto prefetch, int64_t t) {
    switch (t1 - t) {
      case 1: tile(std::integral_constant<int, 1>{}, prefetch, t); break;
      case 2: tile(std::integral_constant<int, 2>{}, prefetch, t); break;
      case 3: tile(std::integral_constant<int, 3>{}, prefetch, t); break;
      case 4: tile(std::integral_constant<int, 4>{}, prefetch, t); break;
      case 5: tile(std::integral_constant<int, 5>{}, prefetch, t); break;
      default: tile(std::integral_constant<int, kMR>{}, prefetch, t); break;
    }
  };
  rest(std::true_type{}, t0);  // the first micro-tile fetches the column block's weights
  for (int64_t t = t0 + kMR; t < t1; t += kMR) rest(std::false_type{}, t);
}

// Rows [t0, t1) x columns [o0, o0 + 64) (or to `out`) of y, from their panel.
void Tile(int64_t t0, int64_t t1, const int8_t* xq, int64_t kp, const int8_t* panel, int64_t out, int64_t o0,
          const float* sx, const int32_t* xsum, const float* sw, float* y) {
  const auto args = std::make_tuple(t0, t1, xq, kp, panel, out, o0, sx, xsum, sw, y);
  switch (std::min<int64_t>(kNR, (out - o0) / 16)) {
    case 1: std::apply(RowsOfTile<1>, args); break;
    case 2: std::apply(RowsOfTile<2>, args); break;
    case 3: std::apply(RowsOfTile<3>, args); break;
    default: std::apply(RowsOfTile<kNR>, args); break;
  }
}
#else
void Tile(int64_t t0, int64_t t1, const int8_t* xq, int64_t kp, const int8_t* panel, int64_t out, int64_t o0,
          const float* sx, const int32_t* xsum, const float* sw, float* y) {
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t o = o0; o < std::min(out, o0 + 16 * kNR); ++o) {
      int32_t acc = 0;
      for (int64_t k = 0; k < kp; ++k) acc += xq[t * kp + k] * panel[(k / 4) * kPanel + 4 * (o - o0) + k % 4];
      y[t * out + o] = (static_cast<float>(acc) * sx[t]) * sw[o];
    }
  }
}
#endif

ffi::Error MatmulW8A8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> qweight, ffi::Buffer<ffi::F32> scales,
                          ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = qweight.dimensions();
  const int64_t out = scales.element_count();
  if (xd.size() != 2 || wd.size() != 3 || wd[0] != (out + 63) / 64 || wd[2] != kPanel || xd[1] > 4 * wd[1] ||
      xd[1] <= 4 * (wd[1] - 1)) {
    return ffi::Error::InvalidArgument(
        "matmul_w8a8: want x [T, in], qweight_a8_panels [ceil(out/64), ceil(in/4), 256], scales [out]");
  }
  const int64_t T = xd[0], n_in = xd[1], in4 = wd[1], kp = 4 * in4;
  if (out % 16 != 0) return ffi::Error::InvalidArgument("matmul_w8a8: out must be a multiple of 16");
  const float* xp = x.typed_data();
  const int8_t* wp = qweight.typed_data();
  const float* sw = scales.typed_data();
  float* yp = y->typed_data();
  std::vector<int8_t> xq(T * kp);
  std::vector<float> sx(T);
  std::vector<int32_t> xsum(T);
  const int64_t row_blocks = (T + kRowBlock - 1) / kRowBlock, col_blocks = wd[0];
  minivllm::ParallelFor(pool, T, [&] {
    return [&](int64_t t) { QuantizeRow(xp + t * n_in, n_in, kp, xq.data() + t * kp, &sx[t], &xsum[t]); };
  });
  minivllm::ParallelFor(pool, col_blocks * row_blocks, [&] {
    return [&](int64_t tile) {  // panels outer: neighbouring tiles share a panel
      const int64_t cb = tile / row_blocks, t0 = tile % row_blocks * kRowBlock;
      Tile(t0, std::min(T, t0 + kRowBlock), xq.data(), kp, wp + cb * in4 * kPanel, out, 16 * kNR * cb, sx.data(),
           xsum.data(), sw, yp);
    };
  }, /*in_runs=*/true);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MinivllmMatmulW8A8F32, MatmulW8A8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::S8>>()   // qweight_a8_panels
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales
                                  .Ret<ffi::Buffer<ffi::F32>>());
