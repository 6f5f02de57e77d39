// Weight-only quantized matmul on the CPU for few rows (decode steps): y[T, out] = x[T, in] @ W,
// with W int8 per output channel or int4 in groups along `in` (minivllm_jax/quantization.py
// has the layouts and the pure-JAX dequantize this must equal). The weights are read once, in
// place, and dequantized in registers; a decode step is bound by reading them.
//
// The weights come in the serving layout (`to_panels` there): panels of 64 output columns, each
// `[rows, 64]` contiguous. Work: panels over XLA's CPU threads (parallel.h). A panel is read in order, each input
// row's 64 weights one cache line (int8) or half of one (int4), and keeps the T rows' 64
// accumulators; int4 sums x * q per group, then adds scale * sum + min * sum(x) of the group.
//
// int4 on AVX-512 BF16 + VBMI: converting nibbles to floats one by one made the int4 kernel
// compute-bound at int8's speed (measured ~45 G weights/s either way, int4 with 3/4 of the
// bytes). There a byte row of a panel (64 columns x input rows 2i, 2i + 1) becomes 32-bit lanes
// of two bf16, 16 + q of each row, in two instructions per 16 columns: vpmultishiftqb moves each
// nibble to bit 3 of its own byte, vpternlogd keeps those 4 bits and sets the rest of the bf16
// pattern of 16 + q (0x4180 | q << 3, exact), and vdpbf16ps multiplies the pair by (x[2i], x[2i + 1])
// into f32. x is split in two bf16s, hi + lo (|x - hi - lo| <= 2^-17 |x|), one vdpbf16ps each, and
// 16 * sum(hi + lo) of the group is taken back off with the scale. For vpmultishiftqb to reach
// them, each 8-byte word of a panel row holds columns 16k + 2j + e at byte 8j + 2k + e (k: which
// 16 columns, j: 0..7, e: 0, 1), the `INT4_PANEL_ORDER` of quantization.py; 1.4x the weights per
// second of the float conversion on one core here.

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
// Weight rows fetched ahead of use. A panel is short (18-110 KB) and the hardware prefetcher
// ramps up per stream, so without this a batch-1 matmul waited on memory: measured in the model,
// int4 gate/up 57 -> 43 us, down 31 -> 24 us.
constexpr int kAheadRows = 16;

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

// Byte of a panel row that holds column `col` (0..63) of int4 weights (`INT4_PANEL_ORDER`).
constexpr int Int4Byte(int col) { return 8 * (col % 16 / 2) + 2 * (col / 16) + col % 2; }

// Rows 2i and 2i + 1 of int4 weights (one byte holds both) as floats 0..15 (the portable path).
struct Int4Rows {
  const uint8_t* q;
  int64_t n_in;
  inline void Get(int64_t i2, int64_t o0, v16 lo[4], v16 hi[4]) const {
    const uint8_t* p = q + (o0 / kCols * (n_in / 2) + i2) * kCols;
    for (int c = 0; c < 4; ++c) {
      u8x16 b;
      for (int l = 0; l < 16; ++l) b[l] = p[Int4Byte(16 * c + l)];
      lo[c] = U8ToFloat(b & 15);
      hi[c] = U8ToFloat(b >> 4);
    }
  }
};

// Panels over the threads; in each, rows of x in passes (parallel.h's ForRowPasses).
template <typename Pass>
void ForBlocksAndPasses(ffi::ThreadPool& pool, int64_t T, int64_t out, Pass pass) {
  minivllm::ParallelFor(pool, out / kCols, [&] {
    return [&](int64_t panel) {
      minivllm::ForRowPasses(T, [&](auto rows_c, int64_t t0) { pass(rows_c, t0, panel * kCols); });
    };
  }, /*in_runs=*/true);
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
      __builtin_prefetch(rows.q + (o0 / kCols * n_in + i + kAheadRows) * kCols);
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

ffi::Error MatmulInt4Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> qweight,
                          ffi::Buffer<ffi::F32> scales_mins, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = qweight.dimensions(), sd = scales_mins.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || sd.size() != 4 || xd[1] != 2 * wd[1] || wd[2] != kCols ||
      sd[0] != wd[0] || sd[2] != 2 || sd[3] != kCols) {
    return ffi::Error::InvalidArgument(
        "matmul_int4: want x [T, in], panels [out / 64, in / 2, 64], scales_mins [out / 64, in / g, 2, 64]");
  }
  const int64_t T = xd[0], n_in = xd[1], out = wd[0] * kCols, groups = sd[1];
  if (n_in % groups != 0 || (n_in / groups) % 2 != 0) {
    return ffi::Error::InvalidArgument("matmul_int4: groups must be even-sized");
  }
  const int64_t g_size = n_in / groups;
  const float* xp = x.typed_data();
  // A panel's group g: 64 scales, then 64 minimums.
  const float* smp = scales_mins.typed_data();
  auto group_params = [&](int64_t o0, int64_t g) { return smp + ((o0 / kCols * groups + g) * 2) * kCols; };
  float* yp = y->typed_data();
  // Each row's sum of x over each group: the minimums' share of the dot product. (Per group,
  // not per element: a division per element cost microseconds a call, single-threaded.)
  std::vector<float> xsum(T * groups, 0.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < groups; ++g) {
      float sum = 0.0f;
      for (int64_t i = g * g_size; i < (g + 1) * g_size; ++i) sum += xp[t * n_in + i];
      xsum[t * groups + g] = sum;
    }
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
  // x as bf16 pairs hi + lo, and 16 * sum(hi + lo) per group (the 16 added to every q).
  std::vector<uint16_t> x_hi(T * n_in), x_lo(T * n_in);
  std::vector<float> split16(T * groups, 0.0f);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < n_in; i += 16) {
      const __mmask16 k = static_cast<__mmask16>((1u << std::min<int64_t>(16, n_in - i)) - 1);
      const __m512 v = _mm512_maskz_loadu_ps(k, xp + t * n_in + i);
      const __m256bh hi = _mm512_cvtneps_pbh(v);
      const __m512 hi_f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)hi), 16));
      const __m256bh lo = _mm512_cvtneps_pbh(_mm512_sub_ps(v, hi_f));
      const __m512 lo_f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)lo), 16));
      _mm256_mask_storeu_epi16(x_hi.data() + t * n_in + i, k, (__m256i)hi);
      _mm256_mask_storeu_epi16(x_lo.data() + t * n_in + i, k, (__m256i)lo);
      if (g_size % 16 == 0) {  // the 16 lie in one group
        split16[t * groups + i / g_size] += _mm512_reduce_add_ps(_mm512_add_ps(hi_f, lo_f));
      } else {
        float both[16];
        _mm512_storeu_ps(both, _mm512_add_ps(hi_f, lo_f));
        for (int64_t j = 0; j < std::min<int64_t>(16, n_in - i); ++j) split16[t * groups + (i + j) / g_size] += both[j];
      }
    }
    for (int64_t g = 0; g < groups; ++g) split16[t * groups + g] *= 16.0f;
  }
  // vpmultishiftqb controls: for the 16 columns of vector c, lane byte 0 <- bits 0-3 of the
  // column's byte (at bit 3), byte 2 <- bits 4-7; bytes 1 and 3 are overwritten by the pattern.
  __m512i ctrl[4];
  for (int c = 0; c < 4; ++c) {
    const uint64_t b = 16 * c;  // bit offset of the pair's first byte (byte 2c) in its word
    ctrl[c] = _mm512_set1_epi64(static_cast<int64_t>(((b + 61) & 63) | (b + 1) << 16 | (b + 5) << 32 | (b + 9) << 48));
  }
  const __m512i keep = _mm512_set1_epi32(0x00780078), pattern = _mm512_set1_epi32(0x41804180);
  const uint16_t* xh = x_hi.data();
  const uint16_t* xl = x_lo.data();
  const uint8_t* qp = qweight.typed_data();
  ForBlocksAndPasses(pool, T, out, [&](auto rows_c, int64_t t0, int64_t o0) {
    constexpr int NT = decltype(rows_c)::value;
    const uint8_t* panel = qp + o0 / kCols * (n_in / 2) * kCols;
    __m512 acc[NT][4];
    for (int t = 0; t < NT; ++t)
      for (int c = 0; c < 4; ++c) acc[t][c] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m512 part[NT][4];
      for (int t = 0; t < NT; ++t)
        for (int c = 0; c < 4; ++c) part[t][c] = _mm512_setzero_ps();
      const float* next_group = group_params(o0, std::min(g + 1, groups - 1));
      for (int k = 0; k < 2 * kCols; k += 16) __builtin_prefetch(next_group + k);
      for (int64_t i = g * g_size; i < (g + 1) * g_size; i += 2) {
        __builtin_prefetch(panel + (i / 2 + kAheadRows) * kCols);
        const __m512i bytes = _mm512_loadu_si512(panel + i / 2 * kCols);
        __m512bh h[NT], l[NT];
        for (int t = 0; t < NT; ++t) {
          uint32_t hp, lp;  // (x[i], x[i + 1]) of row t0 + t
          std::memcpy(&hp, xh + (t0 + t) * n_in + i, 4);
          std::memcpy(&lp, xl + (t0 + t) * n_in + i, 4);
          h[t] = (__m512bh)_mm512_set1_epi32(static_cast<int>(hp));
          l[t] = (__m512bh)_mm512_set1_epi32(static_cast<int>(lp));
        }
        for (int c = 0; c < 4; ++c) {
          const __m512bh w = (__m512bh)_mm512_ternarylogic_epi32(_mm512_multishift_epi64_epi8(ctrl[c], bytes), keep,
                                                                 pattern, 0xEA);  // (a & keep) | pattern
          for (int t = 0; t < NT; ++t) part[t][c] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(part[t][c], w, h[t]), w, l[t]);
        }
      }
      for (int c = 0; c < 4; ++c) {
        const float* gp = group_params(o0, g) + 16 * c;
        const __m512 s = _mm512_loadu_ps(gp), m = _mm512_loadu_ps(gp + kCols);
        for (int t = 0; t < NT; ++t) {
          const int64_t tg = (t0 + t) * groups + g;
          __m512 a = _mm512_fmadd_ps(s, part[t][c], acc[t][c]);
          a = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[tg]), a);
          acc[t][c] = _mm512_fnmadd_ps(s, _mm512_set1_ps(split16[tg]), a);
        }
      }
    }
    for (int t = 0; t < NT; ++t)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(yp + (t0 + t) * out + o0 + 16 * c, acc[t][c]);
  });
#else
  const Int4Rows rows{qweight.typed_data(), n_in};
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
        const float* gp = group_params(o0, g) + 16 * c;
        const v16 s = Load16(gp), m = Load16(gp + kCols);
        for (int t = 0; t < NT; ++t) acc[t][c] += part[t][c] * s + xsum[(t0 + t) * groups + g] * m;
      }
    }
    for (int t = 0; t < NT; ++t)
      for (int c = 0; c < 4; ++c) Store16(yp + (t0 + t) * out + o0 + 16 * c, acc[t][c]);
  });
#endif
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
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales_mins_panels
                                  .Ret<ffi::Buffer<ffi::F32>>());
