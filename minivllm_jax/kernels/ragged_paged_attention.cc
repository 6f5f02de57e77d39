// Ragged paged attention on the CPU: the contract of minivllm_jax/attention.py (its module
// docstring), as an XLA FFI custom call. The pure-JAX reference there is what this must equal.
//
// Work items are (sequence, kv head, tile of query tokens), spread over XLA's CPU threads (parallel.h). One item
// keeps the queries of its tile and the whole group (tile x G rows) together, so every K/V page
// is read once per item, in place (no gather copy), for all of them: an online softmax over the
// cached pages, then over the step's own new keys (causal). K pages are [hd, page_size] (keys along the fast axis, so a
// page's scores for one query are page_size-wide multiply-adds); V pages are [page_size, hd].
// int8 pages (one float scale per token and kv head) are dequantized one (page, head) block at a
// time into a small buffer that stays in L1, so the scoring code is the same and memory traffic
// is the int8 bytes.
//
// The kernel checks its own inputs before it follows any index (`CheckBatch`): every extent
// against the others, in int64 (a sum of two int32 fields may overflow int32). A batch that
// does not fit is an ffi error the caller sees, never a read or write out of bounds.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kMasked = -1e30f;  // a score that no key may see (finite: exp underflows to 0)
constexpr int kMaxBlock = 64;      // keys scored at once: a page (page_size <= 64)
constexpr int kNewBlock = 16;      // new keys scored at once (transposed into a buffer)
constexpr int kQueryTile = 32;     // query tokens of one work item
constexpr int kPrefetchAhead = 1;  // pages: while one page is scored, this one ahead is fetched

// e^f for |f| <= ln2 / 2 (a float or a vector of them): the degree-6 Taylor polynomial.
template <typename T>
inline T ExpReduced(T f) {
  T p = f * (1.0f / 720.0f) + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  return p * f + 1.0f;
}

// exp(x) for x <= 0, vectorizable (std::exp is a scalar call): 2^(x log2 e) split into an
// integer power, set in the exponent bits, and a degree-6 polynomial on [-0.5, 0.5];
// relative error below 2e-7. Inputs below -87 give 0.
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);
  const float y = x * 1.44269504088896341f;
  const float n = std::nearbyint(y);
  const float f = (y - n) * 0.693147180559945309f;  // e^f, |f| <= ln2 / 2
  const float p = ExpReduced(f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// One block of keys: K as [hd][k_stride] (keys along the fast axis), V as [n][v_stride].
struct KeyBlock {
  const float* k;
  int64_t k_stride;
  const float* v;
  int64_t v_stride;
  int n;
};

// Score `rows` query rows (each `hd` floats in `q`, row r may see the block's first
// `visible(r)` keys) against one key block and fold them into their online softmax state:
// running max `m`, sum `l`, weighted value sum `acc` (hd floats per row).
template <typename Visible>
inline void AttendBlock(const float* q, int64_t rows, int64_t hd, const KeyBlock& kb, Visible visible,
                        float* m, float* l, float* acc) {
  alignas(64) float sc[kMaxBlock];
  for (int64_t r = 0; r < rows; ++r) {
    const int n_visible = visible(r);
    if (n_visible <= 0) continue;
    const float* qr = q + r * hd;
    for (int j = 0; j < kb.n; ++j) sc[j] = 0.0f;
    for (int64_t d = 0; d < hd; ++d) {
      const float qv = qr[d];
      const float* krow = kb.k + d * kb.k_stride;
      for (int j = 0; j < kb.n; ++j) sc[j] += qv * krow[j];
    }
    float block_max = kMasked;
    for (int j = 0; j < kb.n; ++j) {
      sc[j] = j < n_visible ? sc[j] : kMasked;
      block_max = std::max(block_max, sc[j]);
    }
    const float m_new = std::max(m[r], block_max);
    const float rescale = ExpNonPositive(m[r] - m_new);
    float sum = 0.0f;
    for (int j = 0; j < kb.n; ++j) {
      sc[j] = j < n_visible ? ExpNonPositive(sc[j] - m_new) : 0.0f;  // masked keys weigh exactly 0
      sum += sc[j];
    }
    l[r] = l[r] * rescale + sum;
    float* a = acc + r * hd;
    for (int64_t d = 0; d < hd; ++d) a[d] *= rescale;
    for (int j = 0; j < n_visible; ++j) {
      const float p = sc[j];
      const float* vrow = kb.v + j * kb.v_stride;
      for (int64_t d = 0; d < hd; ++d) a[d] += p * vrow[d];
    }
    m[r] = m_new;
  }
}

// The fixed-shape path (the shapes that serve: head_dim 64 or 128, blocks of 16 keys), in GCC
// vector extensions (one v16 is a zmm register, or two ymm: no intrinsics, any target).
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));  // unaligned loads
typedef int32_t i16v __attribute__((vector_size(64)));

inline v16 Load16(const float* p) { return *reinterpret_cast<const v16u*>(p); }
inline void Store16(float* p, v16 x) { *reinterpret_cast<v16u*>(p) = x; }

// ExpNonPositive, 16 lanes at once.
inline v16 Exp16(v16 x) {
  const v16 lo = v16{} - 87.0f;
  x = x < lo ? lo : x;
  const v16 y = x * 1.44269504088896341f;
  const v16 n = (y + 12582912.0f) - 12582912.0f;  // round to nearest (|y| < 2^22)
  const v16 f = (y - n) * 0.693147180559945309f;
  const v16 p = ExpReduced(f);
  const i16v bits = (__builtin_convertvector(n, i16v) + 127) << 23;
  return p * (v16)bits;  // a vector cast keeps the bits
}

// `RB` rows at a time against one block of up to 16 keys: scores as RB accumulator chains
// (each K row loaded once feeds all RB; RB = 8 keeps both FMA pipes busy), then the value sums
// `PR` rows at a time with the rows' accumulators in registers across the block's keys.
// Prefetches the block after next (`next_k`/`next_v`, one cache line per head_dim step) so the
// memory streams while this block computes: a decode step is bound by reading the pages.
// `q` must have RB - 1 readable rows past `rows`.
template <int HD, int RB, typename Visible>
inline void AttendBlockFixed(const float* q, int64_t rows, const KeyBlock& kb, Visible visible, float* m,
                             float* l, float* acc, const float* next_k, const float* next_v) {
  constexpr int W = 16, NV = HD / 16, PR = HD == 64 ? 4 : 2;
  static_assert(RB % PR == 0, "row block must split into value-sum blocks");
  const i16v lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int64_t r0 = 0; r0 < rows; r0 += RB) {
    int n_vis[RB];
    int any = 0;
    for (int rb = 0; rb < RB; ++rb) {
      n_vis[rb] = r0 + rb < rows ? std::min(visible(r0 + rb), kb.n) : 0;
      any = std::max(any, n_vis[rb]);
    }
    if (any <= 0) continue;
    v16 sc[RB];
    for (int rb = 0; rb < RB; ++rb) sc[rb] = v16{};
    const float* qb = q + r0 * HD;
    for (int d = 0; d < HD; ++d) {
      if (next_k != nullptr && r0 == 0) {
        __builtin_prefetch(next_k + d * 16);
        __builtin_prefetch(next_v + d * 16);
      }
      const v16 k = Load16(kb.k + d * kb.k_stride);
      for (int rb = 0; rb < RB; ++rb) sc[rb] += qb[rb * HD + d] * k;
    }
    alignas(64) float p[RB][W];
    float rescale[RB];
    for (int rb = 0; rb < RB; ++rb) {
      const int64_t r = r0 + rb;
      if (n_vis[rb] <= 0) {
        Store16(p[rb], v16{});
        rescale[rb] = 1.0f;
        continue;
      }
      const v16 s = lane < n_vis[rb] ? sc[rb] : v16{} + kMasked;
      float block_max = kMasked;
      for (int j = 0; j < W; ++j) block_max = std::max(block_max, s[j]);
      const float m_new = std::max(m[r], block_max);
      rescale[rb] = ExpNonPositive(m[r] - m_new);
      const v16 e = lane < n_vis[rb] ? Exp16(s - m_new) : v16{};  // masked keys weigh exactly 0
      float sum = 0.0f;
      for (int j = 0; j < W; ++j) sum += e[j];
      Store16(p[rb], e);
      l[r] = l[r] * rescale[rb] + sum;
      m[r] = m_new;
    }
    for (int pr0 = 0; pr0 < RB && r0 + pr0 < rows; pr0 += PR) {
      int n_keys = 0;
      for (int pr = 0; pr < PR; ++pr) n_keys = std::max(n_keys, n_vis[pr0 + pr]);
      if (n_keys <= 0) continue;
      const int64_t n_rows = std::min<int64_t>(PR, rows - r0 - pr0);
      v16 a[PR][NV];
      for (int pr = 0; pr < PR; ++pr)
        for (int c = 0; c < NV; ++c)
          a[pr][c] = pr < n_rows ? Load16(acc + (r0 + pr0 + pr) * HD + c * 16) * rescale[pr0 + pr] : v16{};
      for (int j = 0; j < n_keys; ++j) {  // never past the block's keys (V rows may end there)
        const float* vrow = kb.v + j * kb.v_stride;
        v16 v[NV];
        for (int c = 0; c < NV; ++c) v[c] = Load16(vrow + c * 16);
        for (int pr = 0; pr < PR; ++pr) {
          const float pj = p[pr0 + pr][j];
          for (int c = 0; c < NV; ++c) a[pr][c] += pj * v[c];
        }
      }
      for (int pr = 0; pr < n_rows; ++pr)
        for (int c = 0; c < NV; ++c) Store16(acc + (r0 + pr0 + pr) * HD + c * 16, a[pr][c]);
    }
  }
}

// Dispatch: the fixed-shape path where it exists (4-row blocks for a decode's few rows, 8 for
// a prompt chunk's many), else the general one.
template <typename Visible>
inline void Attend(const float* q, int64_t rows, int64_t hd, const KeyBlock& kb, int width, Visible visible,
                   float* m, float* l, float* acc, const float* next_k = nullptr, const float* next_v = nullptr) {
  if (width == 16 && hd == 64) {
    if (rows <= 4) return AttendBlockFixed<64, 4>(q, rows, kb, visible, m, l, acc, next_k, next_v);
    return AttendBlockFixed<64, 8>(q, rows, kb, visible, m, l, acc, next_k, next_v);
  }
  if (width == 16 && hd == 128) {
    if (rows <= 4) return AttendBlockFixed<128, 4>(q, rows, kb, visible, m, l, acc, next_k, next_v);
    return AttendBlockFixed<128, 8>(q, rows, kb, visible, m, l, acc, next_k, next_v);
  }
  AttendBlock(q, rows, hd, kb, visible, m, l, acc);
}

// Where a (page, kv head) block of this layer comes from. Float pages are read in place, and
// the next block is prefetched inside `Attend`.
struct FloatPages {
  const float* k;  // [L, P, KVH, hd, ps]
  const float* v;  // [L, P, KVH, ps, hd]
  int64_t KVH, hd, ps;
  FloatPages Layer(int64_t layer, int64_t P) const {
    const int64_t b = layer * P * KVH * hd * ps;
    return FloatPages{k + b, v + b, KVH, hd, ps};
  }
  KeyBlock Block(int64_t page, int64_t h, float*, float*) const {
    const int64_t b = (page * KVH + h) * hd * ps;
    return KeyBlock{k + b, ps, v + b, hd, static_cast<int>(ps)};
  }
  void Prefetch(int64_t page, int64_t h, const float** next_k, const float** next_v) const {
    *next_k = page >= 0 ? k + (page * KVH + h) * hd * ps : nullptr;
    *next_v = page >= 0 ? v + (page * KVH + h) * hd * ps : nullptr;
  }
};

// dst[r][c] = src[r][c] * col_scale[c] (col_scale given) or * row_scale[r].
inline void DequantizeBlock(const int8_t* src, int64_t rows, int64_t cols, const float* col_scale,
                            const float* row_scale, float* dst) {
#if defined(__AVX512F__)
  if (cols % 16 == 0) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; c += 16) {
        const __m512 x = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + r * cols + c))));
        const __m512 s = col_scale != nullptr ? _mm512_loadu_ps(col_scale + c) : _mm512_set1_ps(row_scale[r]);
        _mm512_storeu_ps(dst + r * cols + c, _mm512_mul_ps(x, s));
      }
    return;
  }
#endif
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      dst[r * cols + c] = static_cast<float>(src[r * cols + c]) * (col_scale != nullptr ? col_scale[c] : row_scale[r]);
}

// int8 pages: a block is dequantized into the caller's buffers (K [hd, ps] scaled per key
// column, V [ps, hd] per key row), the next one prefetched here (its int8 bytes and scales).
struct Int8Pages {
  const int8_t* k;
  const int8_t* v;
  const float* k_scale;  // [L, P, KVH, ps]
  const float* v_scale;
  int64_t KVH, hd, ps;
  Int8Pages Layer(int64_t layer, int64_t P) const {
    const int64_t b = layer * P * KVH * hd * ps, sb = layer * P * KVH * ps;
    return Int8Pages{k + b, v + b, k_scale + sb, v_scale + sb, KVH, hd, ps};
  }
  KeyBlock Block(int64_t page, int64_t h, float* k_buf, float* v_buf) const {
    const int64_t b = (page * KVH + h) * hd * ps, sb = (page * KVH + h) * ps;
    DequantizeBlock(k + b, hd, ps, k_scale + sb, nullptr, k_buf);
    DequantizeBlock(v + b, ps, hd, nullptr, v_scale + sb, v_buf);
    return KeyBlock{k_buf, ps, v_buf, hd, static_cast<int>(ps)};
  }
  void Prefetch(int64_t page, int64_t h, const float** next_k, const float** next_v) const {
    *next_k = *next_v = nullptr;
    if (page < 0) return;
    const int64_t b = (page * KVH + h) * hd * ps, sb = (page * KVH + h) * ps;
    for (int64_t off = 0; off < hd * ps; off += 64) {
      __builtin_prefetch(k + b + off);
      __builtin_prefetch(v + b + off);
    }
    __builtin_prefetch(k_scale + sb);
    __builtin_prefetch(v_scale + sb);
  }
};

ffi::Error Invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("ragged_paged_attention: " + what);
}

// Every sequence that feeds tokens (query_len > 0; padding sequences feed none and are never
// read) must keep its queries within the T new tokens, and list ceil(context_len / page_size)
// pages within page_ids, each within the cache's P pages. All sums in int64.
ffi::Error CheckBatch(int64_t T, int64_t P, int64_t N, int64_t ps, int64_t S, const int32_t* qs, const int32_t* ql,
                      const int32_t* cl, const int32_t* pst, const int32_t* pid) {
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q0 = qs[s], n = ql[s], ctx = cl[s], p0 = pst[s];
    const std::string seq = "sequence " + std::to_string(s) + ": ";
    if (n < 0) return Invalid(seq + "query_len " + std::to_string(n) + " is negative");
    if (n == 0) continue;
    if (q0 < 0 || q0 + n > T) {
      return Invalid(seq + "query_start " + std::to_string(q0) + " + query_len " + std::to_string(n) +
                     " is outside the " + std::to_string(T) + " tokens");
    }
    if (ctx < 0) return Invalid(seq + "context_len " + std::to_string(ctx) + " is negative");
    const int64_t n_pages = (ctx + ps - 1) / ps;
    if (p0 < 0 || p0 + n_pages > N) {
      return Invalid(seq + "page_start " + std::to_string(p0) + " + " + std::to_string(n_pages) +
                     " pages of context is outside the " + std::to_string(N) + " listed page ids");
    }
    for (int64_t c = 0; c < n_pages; ++c) {
      const int64_t page = pid[p0 + c];
      if (page < 0 || page >= P) {
        return Invalid(seq + "page id " + std::to_string(page) + " is outside the cache's " + std::to_string(P) +
                       " pages");
      }
    }
  }
  return ffi::Error::Success();
}

template <typename Pages>
ffi::Error RaggedPagedAttention(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new,
                                ffi::Span<const int64_t> cd, Pages pages,
                                ffi::Buffer<ffi::S32> layer_buf, ffi::Buffer<ffi::S32> query_start,
                                ffi::Buffer<ffi::S32> query_len, ffi::Buffer<ffi::S32> context_len,
                                ffi::Buffer<ffi::S32> page_start, ffi::Buffer<ffi::S32> page_ids,
                                ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();  // [T, H, hd]
  const auto kd = k_new.dimensions();  // [T, KVH, hd]; cd: the cache K's [L, P, KVH, hd, ps]
  if (qd.size() != 3 || kd.size() != 3 || cd.size() != 5) {
    return ffi::Error::InvalidArgument("ragged_paged_attention: q/k_new must be rank 3, the cache rank 5");
  }
  const int64_t T = qd[0], H = qd[1], hd = qd[2], KVH = kd[1];
  const int64_t L = cd[0], P = cd[1], ps = cd[4];
  const int64_t S = query_len.element_count(), N = page_ids.element_count();
  if (KVH <= 0 || H % KVH != 0 || cd[2] != KVH || cd[3] != hd || kd[2] != hd) {
    return Invalid("head counts or head_dim disagree");
  }
  if (kd[0] != T || v_new.dimensions().size() != 3 || v_new.element_count() != k_new.element_count()) {
    return Invalid("k_new and v_new must be [T, KVH, hd] with q's T");
  }
  if (static_cast<int64_t>(out->element_count()) != T * H * hd) return Invalid("the output must be q's shape");
  if (ps < 1 || ps > kMaxBlock) return Invalid("page_size must be 1 to 64");
  if (static_cast<int64_t>(query_start.element_count()) != S || static_cast<int64_t>(context_len.element_count()) != S ||
      static_cast<int64_t>(page_start.element_count()) != S) {
    return Invalid("query_start, query_len, context_len and page_start must have one entry per sequence");
  }
  if (layer_buf.element_count() < 1) return Invalid("layer must hold one index");
  const int64_t G = H / KVH;
  const int64_t layer = layer_buf.typed_data()[0];
  if (layer < 0 || layer >= L) return Invalid("layer out of range");
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));

  const float* qp = q.typed_data();
  const float* knp = k_new.typed_data();
  const float* vnp = v_new.typed_data();
  const Pages layer_pages = pages.Layer(layer, P);
  const int32_t* qs = query_start.typed_data();
  const int32_t* ql = query_len.typed_data();
  const int32_t* cl = context_len.typed_data();
  const int32_t* pst = page_start.typed_data();
  const int32_t* pid = page_ids.typed_data();
  if (ffi::Error bad = CheckBatch(T, P, N, ps, S, qs, ql, cl, pst, pid); bad.failure()) return bad;
  float* op = out->typed_data();
  std::memset(op, 0, sizeof(float) * T * H * hd);  // padding tokens give zeros

  // Work items: (sequence, tile of up to kQueryTile query tokens, kv heads). Tiles let a long
  // prompt chunk use every thread. A decode's item takes all kv heads of its sequence when
  // there are enough sequences to keep the threads busy: a page's heads are contiguous, so it
  // then streams one long block of K and one of V per page instead of KVH short ones.
  struct Item {
    int64_t s, i_lo, i_hi, h_lo, h_hi;
  };
  int64_t n_decodes = 0;
  for (int64_t s = 0; s < S; ++s) n_decodes += ql[s] == 1;
  const bool group_heads = n_decodes >= 8;
  std::vector<Item> items;
  for (int64_t s = 0; s < S; ++s) {
    if (ql[s] <= 0) continue;  // padding (CheckBatch has checked the others)
    for (int64_t i = 0; i < ql[s]; i += kQueryTile) {
      const int64_t i_hi = std::min<int64_t>(ql[s], i + kQueryTile);
      if (group_heads && ql[s] == 1) {
        items.push_back({s, i, i_hi, 0, KVH});
      } else {
        for (int64_t h = 0; h < KVH; ++h) items.push_back({s, i, i_hi, h, h + 1});
      }
    }
  }

  minivllm::ParallelFor(pool, static_cast<int64_t>(items.size()), [&] {
    // Each participant's scratch.
    return [&, qbuf = std::vector<float>(), acc = std::vector<float>(), m = std::vector<float>(),
            l = std::vector<float>(), k_block = std::vector<float>(hd * kNewBlock),
            k_page = std::vector<float>(hd * ps), v_page = std::vector<float>(ps * hd)](int64_t it) mutable {
      const Item& item = items[it];
      const int64_t s = item.s, i_lo = item.i_lo, i_hi = item.i_hi, h_lo = item.h_lo, nh = item.h_hi - h_lo;
      const int64_t ctx = cl[s], q0 = qs[s];
      // Per head, row r = (i - i_lo) * G + g: query token i, group member g.
      const int64_t R = (i_hi - i_lo) * G;
      qbuf.assign((nh * R + 8) * hd, 0.0f);  // 8 zero rows past the end: the fixed path reads 8 at a time
      acc.assign(nh * R * hd, 0.0f);
      m.assign(nh * R, kMasked);
      l.assign(nh * R, 0.0f);
      for (int64_t hh = 0; hh < nh; ++hh)
        for (int64_t i = i_lo; i < i_hi; ++i)
          for (int64_t g = 0; g < G; ++g) {
            const float* src = qp + ((q0 + i) * H + (h_lo + hh) * G + g) * hd;
            float* dst = qbuf.data() + (hh * R + (i - i_lo) * G + g) * hd;
            for (int64_t d = 0; d < hd; ++d) dst[d] = src[d] * scale;
          }
      // Cached context, read in place: every cached token precedes every new one. While a
      // page is scored, the same head's block of the next page is prefetched.
      const int64_t n_pages = (ctx + ps - 1) / ps;  // all listed and in range (CheckBatch)
      auto page_at = [&](int64_t c) -> int64_t {
        if (c >= n_pages || pst[s] + c < 0) return -1;
        const int64_t page = pid[pst[s] + c];
        return page >= 0 && page < P ? page : -1;
      };
      for (int64_t c = 0; c < n_pages; ++c) {
        const int64_t page = page_at(c), next = page_at(c + kPrefetchAhead);
        if (page < 0) continue;
        const int n_keys = static_cast<int>(std::min<int64_t>(ps, ctx - c * ps));
        for (int64_t hh = 0; hh < nh; ++hh) {
          const int64_t h = h_lo + hh;
          const float *next_k, *next_v;
          layer_pages.Prefetch(next, h, &next_k, &next_v);
          const KeyBlock kb = layer_pages.Block(page, h, k_page.data(), v_page.data());
          Attend(qbuf.data() + hh * R * hd, R, hd, kb, static_cast<int>(ps), [&](int64_t) { return n_keys; },
                 m.data() + hh * R, l.data() + hh * R, acc.data() + hh * R * hd, next_k, next_v);
        }
      }
      // The step's new tokens, causally (query i sees new keys 0..i), in blocks of kNewBlock
      // keys with K transposed into a [hd, kNewBlock] buffer (zero past the block's keys).
      for (int64_t hh = 0; hh < nh; ++hh) {
        const int64_t h = h_lo + hh;
        float* mh = m.data() + hh * R;
        float* lh = l.data() + hh * R;
        float* ah = acc.data() + hh * R * hd;
        const float* qh = qbuf.data() + hh * R * hd;
        for (int64_t j0 = 0; j0 < i_hi; j0 += kNewBlock) {
          const int n = static_cast<int>(std::min<int64_t>(kNewBlock, i_hi - j0));
          std::fill(k_block.begin(), k_block.end(), 0.0f);
          for (int j = 0; j < n; ++j) {
            const float* kr = knp + ((q0 + j0 + j) * KVH + h) * hd;
            for (int64_t d = 0; d < hd; ++d) k_block[d * kNewBlock + j] = kr[d];
          }
          const KeyBlock kb{k_block.data(), kNewBlock, vnp + ((q0 + j0) * KVH + h) * hd, KVH * hd, n};
          const int64_t r0 = std::max<int64_t>(0, j0 - i_lo) * G;  // rows of queries before j0 see none of it
          Attend(qh + r0 * hd, R - r0, hd, kb, kNewBlock,
                 [&](int64_t r) { return static_cast<int>(std::min<int64_t>(n, i_lo + (r0 + r) / G - j0 + 1)); },
                 mh + r0, lh + r0, ah + r0 * hd);
        }
        for (int64_t i = i_lo; i < i_hi; ++i)
          for (int64_t g = 0; g < G; ++g) {
            const int64_t r = (i - i_lo) * G + g;
            const float inv = lh[r] > 0.0f ? 1.0f / lh[r] : 0.0f;
            float* dst = op + ((q0 + i) * H + h * G + g) * hd;
            const float* a = ah + r * hd;
            for (int64_t d = 0; d < hd; ++d) dst[d] = a[d] * inv;
          }
      }
    };
  });
  return ffi::Error::Success();
}

using S32 = ffi::Buffer<ffi::S32>;

ffi::Error RaggedPagedAttentionF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new,
                                   ffi::Buffer<ffi::F32> cache_k, ffi::Buffer<ffi::F32> cache_v, S32 layer,
                                   S32 query_start, S32 query_len, S32 context_len, S32 page_start, S32 page_ids,
                                   ffi::ResultBuffer<ffi::F32> out) {
  const auto cd = cache_k.dimensions();
  if (cd.size() != 5) return ffi::Error::InvalidArgument("ragged_paged_attention: the cache must be rank 5");
  if (cache_v.element_count() != cache_k.element_count()) return Invalid("the V cache must match the K cache");
  const FloatPages pages{cache_k.typed_data(), cache_v.typed_data(), cd[2], cd[3], cd[4]};
  return RaggedPagedAttention(pool, q, k_new, v_new, cd, pages, layer, query_start, query_len, context_len, page_start,
                              page_ids, out);
}

ffi::Error RaggedPagedAttentionInt8KV(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_new,
                                      ffi::Buffer<ffi::F32> v_new, ffi::Buffer<ffi::S8> cache_k,
                                      ffi::Buffer<ffi::S8> cache_v, ffi::Buffer<ffi::F32> k_scale,
                                      ffi::Buffer<ffi::F32> v_scale, S32 layer, S32 query_start, S32 query_len,
                                      S32 context_len, S32 page_start, S32 page_ids, ffi::ResultBuffer<ffi::F32> out) {
  const auto cd = cache_k.dimensions();
  if (cd.size() != 5) return ffi::Error::InvalidArgument("ragged_paged_attention: the cache must be rank 5");
  if (cache_v.element_count() != cache_k.element_count()) return Invalid("the V cache must match the K cache");
  const int64_t n_scales = cd[0] * cd[1] * cd[2] * cd[4];
  if (static_cast<int64_t>(k_scale.element_count()) != n_scales ||
      static_cast<int64_t>(v_scale.element_count()) != n_scales) {
    return ffi::Error::InvalidArgument("ragged_paged_attention: int8 pages need one scale per token and kv head");
  }
  const Int8Pages pages{cache_k.typed_data(), cache_v.typed_data(), k_scale.typed_data(), v_scale.typed_data(),
                        cd[2], cd[3], cd[4]};
  return RaggedPagedAttention(pool, q, k_new, v_new, cd, pages, layer, query_start, query_len, context_len, page_start,
                              page_ids, out);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MinivllmRaggedPagedAttentionF32, RaggedPagedAttentionF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_new
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_new
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cache K
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cache V
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_len
                                  .Arg<ffi::Buffer<ffi::S32>>()  // context_len
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_start
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_ids
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MinivllmRaggedPagedAttentionInt8KV, RaggedPagedAttentionInt8KV,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_new
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_new
                                  .Arg<ffi::Buffer<ffi::S8>>()   // cache K (int8)
                                  .Arg<ffi::Buffer<ffi::S8>>()   // cache V (int8)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // K scales [L, P, KVH, ps]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // V scales
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_len
                                  .Arg<ffi::Buffer<ffi::S32>>()  // context_len
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_start
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_ids
                                  .Ret<ffi::Buffer<ffi::F32>>());
