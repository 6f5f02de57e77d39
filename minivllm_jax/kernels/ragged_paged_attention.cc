// Ragged paged attention on the CPU: the contract of minivllm_jax/attention.py (its module
// docstring), as an XLA FFI custom call. The pure-JAX reference there is what this must equal.
//
// Work items are (sequence, kv head, tile of query tokens), spread over OpenMP threads. One item
// keeps the queries of its tile and the whole group (tile x G rows) together, so every K/V page
// is read once per item, in place (no gather copy), for all of them: an online softmax over the
// cached pages, then over the step's own new keys (causal). K pages are [hd, page_size] (keys along the fast axis, so a
// page's scores for one query are page_size-wide multiply-adds); V pages are [page_size, hd].

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kMasked = -1e30f;  // a score that no key may see (finite: exp underflows to 0)
constexpr int kMaxBlock = 64;      // keys scored at once: a page (page_size <= 64)
constexpr int kNewBlock = 16;      // new keys scored at once (transposed into a buffer)
constexpr int kQueryTile = 32;     // query tokens of one work item

// exp(x) for x <= 0, vectorizable (std::exp is a scalar call): 2^(x log2 e) split into an
// integer power, set in the exponent bits, and a degree-6 polynomial on [-0.5, 0.5];
// relative error below 2e-7. Inputs below -87 give 0.
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);
  const float y = x * 1.44269504088896341f;
  const float n = std::nearbyint(y);
  const float f = (y - n) * 0.693147180559945309f;  // e^f, |f| <= ln2 / 2
  float p = 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
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

// The same for a compile-time head_dim and block width (the shapes that serve: hd 64 or 128,
// page_size 16), four rows at a time: each K row loaded once feeds four independent
// accumulator chains (one chain would wait on FMA latency), and each row's value sum stays
// in registers across the block's keys. `q` must have RB - 1 readable rows past `rows`.
template <int HD, int W, typename Visible>
inline void AttendBlockFixed(const float* q, int64_t rows, const KeyBlock& kb, Visible visible, float* m,
                             float* l, float* acc) {
  constexpr int RB = 4;
  for (int64_t r0 = 0; r0 < rows; r0 += RB) {
    int n_vis[RB];
    bool any = false;
    for (int rb = 0; rb < RB; ++rb) {
      n_vis[rb] = r0 + rb < rows ? std::min(visible(r0 + rb), kb.n) : 0;
      any |= n_vis[rb] > 0;
    }
    if (!any) continue;
    alignas(64) float sc[RB][W] = {};
    for (int d = 0; d < HD; ++d) {
      const float* krow = kb.k + d * kb.k_stride;
      for (int rb = 0; rb < RB; ++rb) {
        const float qv = q[(r0 + rb) * HD + d];
        for (int j = 0; j < W; ++j) sc[rb][j] += qv * krow[j];
      }
    }
    for (int rb = 0; rb < RB; ++rb) {
      if (n_vis[rb] <= 0) continue;
      const int64_t r = r0 + rb;
      float block_max = kMasked;
      for (int j = 0; j < W; ++j) {
        sc[rb][j] = j < n_vis[rb] ? sc[rb][j] : kMasked;
        block_max = std::max(block_max, sc[rb][j]);
      }
      const float m_new = std::max(m[r], block_max);
      const float rescale = ExpNonPositive(m[r] - m_new);
      float sum = 0.0f;
      for (int j = 0; j < W; ++j) {
        sc[rb][j] = j < n_vis[rb] ? ExpNonPositive(sc[rb][j] - m_new) : 0.0f;
        sum += sc[rb][j];
      }
      l[r] = l[r] * rescale + sum;
      m[r] = m_new;
      alignas(64) float a[HD];
      for (int d = 0; d < HD; ++d) a[d] = acc[r * HD + d] * rescale;
      for (int j = 0; j < n_vis[rb]; ++j) {  // never past the block's keys (V rows may end there)
        const float pj = sc[rb][j];
        const float* vrow = kb.v + j * kb.v_stride;
        for (int d = 0; d < HD; ++d) a[d] += pj * vrow[d];
      }
      for (int d = 0; d < HD; ++d) acc[r * HD + d] = a[d];
    }
  }
}

// Dispatch: the fixed-shape path where it exists, else the general one.
template <typename Visible>
inline void Attend(const float* q, int64_t rows, int64_t hd, const KeyBlock& kb, int width, Visible visible,
                   float* m, float* l, float* acc) {
  if (hd == 64 && width == 16) return AttendBlockFixed<64, 16>(q, rows, kb, visible, m, l, acc);
  if (hd == 128 && width == 16) return AttendBlockFixed<128, 16>(q, rows, kb, visible, m, l, acc);
  AttendBlock(q, rows, hd, kb, visible, m, l, acc);
}

ffi::Error RaggedPagedAttentionImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_new,
                                    ffi::Buffer<ffi::F32> v_new, ffi::Buffer<ffi::F32> cache_k,
                                    ffi::Buffer<ffi::F32> cache_v, ffi::Buffer<ffi::S32> layer_buf,
                                    ffi::Buffer<ffi::S32> query_start, ffi::Buffer<ffi::S32> query_len,
                                    ffi::Buffer<ffi::S32> context_len, ffi::Buffer<ffi::S32> page_start,
                                    ffi::Buffer<ffi::S32> page_ids, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();       // [T, H, hd]
  const auto kd = k_new.dimensions();   // [T, KVH, hd]
  const auto cd = cache_k.dimensions(); // [L, P, KVH, hd, ps]
  if (qd.size() != 3 || kd.size() != 3 || cd.size() != 5) {
    return ffi::Error::InvalidArgument("ragged_paged_attention: q/k_new must be rank 3, the cache rank 5");
  }
  const int64_t T = qd[0], H = qd[1], hd = qd[2], KVH = kd[1];
  const int64_t L = cd[0], P = cd[1], ps = cd[4];
  const int64_t S = query_len.element_count(), N = page_ids.element_count();
  if (H % KVH != 0 || cd[2] != KVH || cd[3] != hd) {
    return ffi::Error::InvalidArgument("ragged_paged_attention: head counts or head_dim disagree");
  }
  if (ps > kMaxBlock) return ffi::Error::InvalidArgument("ragged_paged_attention: page_size above 64");
  const int64_t G = H / KVH;
  const int32_t layer = layer_buf.typed_data()[0];
  if (layer < 0 || layer >= L) return ffi::Error::InvalidArgument("ragged_paged_attention: layer out of range");
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));

  const float* qp = q.typed_data();
  const float* knp = k_new.typed_data();
  const float* vnp = v_new.typed_data();
  // This layer's pages: [P, KVH, hd, ps] of K and [P, KVH, ps, hd] of V.
  const int64_t block = KVH * hd * ps;
  const float* kc = cache_k.typed_data() + layer * P * block;
  const float* vc = cache_v.typed_data() + layer * P * block;
  const int32_t* qs = query_start.typed_data();
  const int32_t* ql = query_len.typed_data();
  const int32_t* cl = context_len.typed_data();
  const int32_t* pst = page_start.typed_data();
  const int32_t* pid = page_ids.typed_data();
  float* op = out->typed_data();
  std::memset(op, 0, sizeof(float) * T * H * hd);  // padding tokens give zeros

  // Work items: (sequence, kv head, tile of up to kQueryTile query tokens). Tiles let a long
  // prompt chunk use every thread; each item reads its sequence's pages itself.
  struct Item {
    int64_t s, h, i_lo, i_hi;
  };
  std::vector<Item> items;
  for (int64_t s = 0; s < S; ++s) {
    if (ql[s] <= 0 || qs[s] < 0 || qs[s] + ql[s] > T) continue;
    for (int64_t i = 0; i < ql[s]; i += kQueryTile)
      for (int64_t h = 0; h < KVH; ++h) items.push_back({s, h, i, std::min<int64_t>(ql[s], i + kQueryTile)});
  }

#pragma omp parallel
  {
    std::vector<float> qbuf, acc, m, l, k_block(hd * kNewBlock);
#pragma omp for schedule(dynamic, 1)
    for (size_t it = 0; it < items.size(); ++it) {
      const int64_t s = items[it].s, h = items[it].h, i_lo = items[it].i_lo, i_hi = items[it].i_hi;
      const int64_t ctx = cl[s], q0 = qs[s];
      const int64_t R = (i_hi - i_lo) * G;  // row r = (i - i_lo) * G + g: query token i, group member g
      qbuf.assign((R + 4) * hd, 0.0f);  // 4 zero rows past the end: the fixed path reads 4 at a time
      acc.assign(R * hd, 0.0f);
      m.assign(R, kMasked);
      l.assign(R, 0.0f);
      for (int64_t i = i_lo; i < i_hi; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const float* src = qp + ((q0 + i) * H + h * G + g) * hd;
          float* dst = qbuf.data() + ((i - i_lo) * G + g) * hd;
          for (int64_t d = 0; d < hd; ++d) dst[d] = src[d] * scale;
        }
      // Cached context, read in place: every cached token precedes every new one.
      const int64_t n_pages = (ctx + ps - 1) / ps;
      for (int64_t c = 0; c < n_pages; ++c) {
        const int64_t entry = pst[s] + c;
        if (entry < 0 || entry >= N) break;
        const int64_t page = pid[entry];
        if (page < 0 || page >= P) continue;
        const int n_keys = static_cast<int>(std::min<int64_t>(ps, ctx - c * ps));
        const KeyBlock kb{kc + (page * KVH + h) * hd * ps, ps, vc + (page * KVH + h) * ps * hd, hd,
                          static_cast<int>(ps)};
        Attend(qbuf.data(), R, hd, kb, static_cast<int>(ps), [&](int64_t) { return n_keys; }, m.data(), l.data(),
               acc.data());
      }
      // The step's new tokens, causally (query i sees new keys 0..i), in blocks of kNewBlock
      // keys with K transposed into a [hd, kNewBlock] buffer (zero past the block's keys).
      for (int64_t j0 = 0; j0 < i_hi; j0 += kNewBlock) {
        const int n = static_cast<int>(std::min<int64_t>(kNewBlock, i_hi - j0));
        std::fill(k_block.begin(), k_block.end(), 0.0f);
        for (int j = 0; j < n; ++j) {
          const float* kr = knp + ((q0 + j0 + j) * KVH + h) * hd;
          for (int64_t d = 0; d < hd; ++d) k_block[d * kNewBlock + j] = kr[d];
        }
        const KeyBlock kb{k_block.data(), kNewBlock, vnp + ((q0 + j0) * KVH + h) * hd, KVH * hd, n};
        const int64_t r0 = std::max<int64_t>(0, j0 - i_lo) * G;  // rows of queries before j0 see none of it
        Attend(qbuf.data() + r0 * hd, R - r0, hd, kb, kNewBlock,
               [&](int64_t r) {
                 return static_cast<int>(std::min<int64_t>(n, i_lo + (r0 + r) / G - j0 + 1));
               },
               m.data() + r0, l.data() + r0, acc.data() + r0 * hd);
      }
      for (int64_t i = i_lo; i < i_hi; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = (i - i_lo) * G + g;
          const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
          float* dst = op + ((q0 + i) * H + h * G + g) * hd;
          const float* a = acc.data() + r * hd;
          for (int64_t d = 0; d < hd; ++d) dst[d] = a[d] * inv;
        }
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MinivllmRaggedPagedAttentionF32, RaggedPagedAttentionImpl,
                              ffi::Ffi::Bind()
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
