// Float32 matmul on the CPU for few rows: y[T, out] = x[T, in] @ W[in, out], W in the model's
// own row-major layout (no copy of the weights). Here a decode or verify step is bound by reading
// W, and XLA's CPU dot reads it at full speed only for one row: measured on the 49152 x 576 head,
// 2.9 ms for 1 row, 5.7 ms for 2 to 4, so a speculative verify step of 4 rows cost 1.6x a decode
// step. This reads W once for up to 4 rows (their accumulators stay in registers) and once more,
// from cache, for each further 4.
//
// Work: panels of 64 output columns over XLA's CPU threads, in runs of neighbours (parallel.h).
// A panel is a 256-byte slice of every row of W, `out` floats apart: too far apart for the
// hardware prefetcher, so the rows ahead are prefetched by hand.

#include <algorithm>
#include <cstdint>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));

constexpr int kCols = 64;       // output columns of one panel (4 vectors)
constexpr int kAheadRows = 16;  // rows of W prefetched ahead of use

inline v16 Load16(const float* p) { return *reinterpret_cast<const v16u*>(p); }
inline void Store16(float* p, v16 x) { *reinterpret_cast<v16u*>(p) = x; }

// Rows [t0, t0 + NT) of y, columns [o0, o0 + 64).
template <int NT>
void Pass(const float* x, const float* w, float* y, int64_t n_in, int64_t out, int64_t t0, int64_t o0) {
  v16 acc[NT][4] = {};
  const float* wp = w + o0;
  for (int64_t i = 0; i < n_in; ++i, wp += out) {
    if (i + kAheadRows < n_in) {
      for (int c = 0; c < 4; ++c) __builtin_prefetch(wp + kAheadRows * out + 16 * c);
    }
    v16 wv[4];
    for (int c = 0; c < 4; ++c) wv[c] = Load16(wp + 16 * c);
    for (int t = 0; t < NT; ++t) {
      const float xv = x[(t0 + t) * n_in + i];
      for (int c = 0; c < 4; ++c) acc[t][c] += xv * wv[c];
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int c = 0; c < 4; ++c) Store16(y + (t0 + t) * out + o0 + 16 * c, acc[t][c]);
}

ffi::Error MatmulF32Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                         ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0] || wd[1] % kCols != 0) {
    return ffi::Error::InvalidArgument("matmul_f32: want x [T, in], w [in, out] with out a multiple of 64");
  }
  const int64_t T = xd[0], n_in = wd[0], out = wd[1];
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  minivllm::ParallelFor(pool, out / kCols, [&] {
    return [&](int64_t panel) {
      minivllm::ForRowPasses(T, [&](auto nt, int64_t t0) { Pass<decltype(nt)::value>(xp, wp, yp, n_in, out, t0, panel * kCols); });
    };
  }, /*in_runs=*/true);
  return ffi::Error::Success();
}

// y[T, out] = x[T, in] @ w[out, in]^T: the output head of a model whose head is its embedding
// (`[vocab, hidden]`, read in place; XLA's dot of 2-4 rows read it at half the speed of one row).
// Work: blocks of 4 output rows, contiguous in memory, over the threads; each block's rows are
// dotted with up to 4 rows of x at once, 16 lanes of `in` at a time, then summed across lanes.
template <int NT>
void PassTransposed(const float* x, const float* w, float* y, int64_t n_in, int64_t out, int64_t t0, int64_t o0) {
  v16 acc[NT][4] = {};
  for (int64_t i = 0; i < n_in; i += 16) {
    v16 wv[4];
    for (int r = 0; r < 4; ++r) wv[r] = Load16(w + (o0 + r) * n_in + i);
    for (int t = 0; t < NT; ++t) {
      const v16 xv = Load16(x + (t0 + t) * n_in + i);
      for (int r = 0; r < 4; ++r) acc[t][r] += xv * wv[r];
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < 4; ++r) {
      float sum = 0.0f;
      for (int l = 0; l < 16; ++l) sum += acc[t][r][l];
      y[(t0 + t) * out + o0 + r] = sum;
    }
}

ffi::Error MatmulF32TransposedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                                   ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1] || wd[1] % 16 != 0 || wd[0] % 4 != 0) {
    return ffi::Error::InvalidArgument("matmul_f32_t: want x [T, in], w [out, in], in a multiple of 16, out of 4");
  }
  const int64_t T = xd[0], n_in = wd[1], out = wd[0];
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  minivllm::ParallelFor(pool, out / 4, [&] {
    return [&](int64_t block) {
      minivllm::ForRowPasses(T, [&](auto nt, int64_t t0) { PassTransposed<decltype(nt)::value>(xp, wp, yp, n_in, out, t0, block * 4); });
    };
  }, /*in_runs=*/true);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MinivllmMatmulF32Transposed, MatmulF32TransposedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [out, in]
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MinivllmMatmulF32, MatmulF32Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w
                                  .Ret<ffi::Buffer<ffi::F32>>());
