// Paged attention on CPU that reads K/V in place from the page pool.
//
// kv_layer is pool[:, layer]: [num_pages, 2, page_size, kv_heads, head_dim] with any strides
// except a contiguous head_dim, so pages need not be adjacent. One work item is
// (sequence, range of kv heads, tile of query rows, range of key positions) and keeps an
// online softmax (running max m, running sum l, unnormalised accumulator acc) per row:
//
//   decode item   all kv heads of one sequence: within a token the heads are adjacent, so
//                 each page is read front to back as one stream (memory bound, like dense)
//   prefill item  one kv head x up to kQueryTile new tokens (x group query heads each):
//                 scores come from register-blocked micro-kernels (compute bound)
//   row limit     ctx - q_len + i, the last key position query row i may see (causal)
//
// When there are too few items to keep every thread busy (a small decode batch over long
// contexts), key ranges are split into partitions whose partial (m, l, acc) are merged
// afterwards (flash-decoding). Items are pulled from a shared counter, longest first, so
// mixed context lengths balance across threads. Everything the kernel dereferences (page
// ids, slots, lengths) is validated before any thread starts.
//
// FP8 pages (float8_e4m3fn / float8_e5m2 codes) come with kv_scales [num_pages, 2, kv_heads]
// (fp32, any strides): value = decode(code) * scale of its (page, plane, kv head). Rows are
// decoded into fp32 as they are read, like fp16/bf16 rows, so the pool is never expanded.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

#if defined(__F16C__) && defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kKeyChunk = 64;    // keys scored between two softmax rescales
constexpr int64_t kQueryTile = 32;   // query rows of one sequence per prefill item
constexpr int64_t kMinPartition = 256;  // never split a key range finer than this
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Geometry {
  int64_t num_pages, page_size, kv_heads, head_dim, num_heads, group, max_pages;
  int64_t stride_page, stride_kv, stride_token, stride_head;  // elements, of kv_layer
  const float* scales;  // FP8 pools only, else nullptr
  int64_t scale_stride_page, scale_stride_kv, scale_stride_head;
};

struct WorkItem {
  int64_t seq;
  int64_t head_begin, head_end;  // kv heads, [head_begin, head_end)
  int64_t row_begin, row_end;    // token rows of q/out, [row_begin, row_end)
  int64_t key_begin, key_end;    // key positions, [key_begin, key_end)
  int64_t scratch;               // -1: sole partition, write out directly; else first partial row
  int64_t cost;

  int64_t num_rows(int64_t group) const { return (row_end - row_begin) * (head_end - head_begin) * group; }
};

// Item rows run kv-head-major: r = (kv head within item) * rows_per_head + i * group + g, so
// the rows that read one K/V row are adjacent and can be blocked. Row r -> offset of its
// [head_dim] vector in a [T, H, D] tensor.
inline int64_t row_offset(const WorkItem& it, int64_t r, int64_t group, int64_t num_heads, int64_t head_dim) {
  const int64_t rows_per_head = (it.row_end - it.row_begin) * group;
  const int64_t hh = r / rows_per_head, rem = r % rows_per_head;
  return ((it.row_begin + rem / group) * num_heads + (it.head_begin + hh) * group + rem % group) * head_dim;
}

// Portable SIMD through GCC/Clang vector extensions: 16 floats, unaligned loads allowed.
// Blocked kernels need head_dim % 16 == 0 (every common model); others use scalar loops.
typedef float vf16 __attribute__((vector_size(64), aligned(4)));
constexpr int64_t kLanes = 16;
constexpr int64_t kRowBlock = 4;  // query rows sharing one K/V row load

inline vf16 load(const float* p) { return *reinterpret_cast<const vf16*>(p); }
inline void store(float* p, vf16 v) { *reinterpret_cast<vf16*>(p) = v; }
typedef float vf8 __attribute__((vector_size(32), aligned(4)));
typedef float vf4 __attribute__((vector_size(16), aligned(4)));
// Pairwise tree; a lane-by-lane loop would be 15 dependent adds (no -ffast-math to reorder).
inline float hsum(vf16 v) {
  vf8 lo, hi;
  std::memcpy(&lo, &v, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(lo), sizeof(hi));
  const vf8 s8 = lo + hi;
  vf4 lo4, hi4;
  std::memcpy(&lo4, &s8, sizeof(lo4));
  std::memcpy(&hi4, reinterpret_cast<const char*>(&s8) + sizeof(lo4), sizeof(hi4));
  const vf4 s4 = lo4 + hi4;
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// out[j * out_stride] = <q[j], k> for kRowBlock rows q[j] = q0 + j * q_stride.
inline void dot_block(const float* q0, int64_t q_stride, const float* k, int64_t n, float* out, int64_t out_stride) {
  vf16 a0 = {}, a1 = {}, a2 = {}, a3 = {};
  for (int64_t d = 0; d < n; d += kLanes) {
    const vf16 kv = load(k + d);
    a0 += load(q0 + d) * kv;
    a1 += load(q0 + q_stride + d) * kv;
    a2 += load(q0 + 2 * q_stride + d) * kv;
    a3 += load(q0 + 3 * q_stride + d) * kv;
  }
  out[0] = hsum(a0);
  out[out_stride] = hsum(a1);
  out[2 * out_stride] = hsum(a2);
  out[3 * out_stride] = hsum(a3);
}

inline void axpy(float* __restrict y, float a, const float* __restrict x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

inline void scale_inplace(float* __restrict y, float a, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] *= a;
}

// acc[j] += sum_t p[j * row_stride + t * key_stride] * v[t] for kRowBlock rows of acc
// (stride D), with a 32-wide slice of each accumulator row held in registers over all n keys.
inline void pv_block(float* acc, int64_t D, const float* p, int64_t row_stride, int64_t key_stride,
                     const float* const* v, int64_t v_off, int64_t n) {
  for (int64_t d = 0; d < D; d += 2 * kLanes) {
    const bool two = d + kLanes < D;
    vf16 a00 = load(acc + d), a10 = load(acc + D + d), a20 = load(acc + 2 * D + d), a30 = load(acc + 3 * D + d);
    vf16 a01 = {}, a11 = {}, a21 = {}, a31 = {};
    if (two) {
      a01 = load(acc + d + kLanes);
      a11 = load(acc + D + d + kLanes);
      a21 = load(acc + 2 * D + d + kLanes);
      a31 = load(acc + 3 * D + d + kLanes);
    }
    for (int64_t t = 0; t < n; ++t) {
      const float* vt = v[t] + v_off + d;
      const float* pt = p + t * key_stride;
      const float p0 = pt[0], p1 = pt[row_stride], p2 = pt[2 * row_stride], p3 = pt[3 * row_stride];
      const vf16 v0 = load(vt);
      a00 += p0 * v0;
      a10 += p1 * v0;
      a20 += p2 * v0;
      a30 += p3 * v0;
      if (two) {
        const vf16 v1 = load(vt + kLanes);
        a01 += p0 * v1;
        a11 += p1 * v1;
        a21 += p2 * v1;
        a31 += p3 * v1;
      }
    }
    store(acc + d, a00);
    store(acc + D + d, a10);
    store(acc + 2 * D + d, a20);
    store(acc + 3 * D + d, a30);
    if (two) {
      store(acc + d + kLanes, a01);
      store(acc + D + d + kLanes, a11);
      store(acc + 2 * D + d + kLanes, a21);
      store(acc + 3 * D + d + kLanes, a31);
    }
  }
}

// Scores of many query rows against n keys without horizontal sums: the rows are held
// transposed (qt [D, rows_pad], rows_pad % 16 == 0) and each key element is broadcast.
// Writes s[t * rows_pad + r]. Register block: 4 keys x 16 rows.
inline void scores_rows_vectorised(const float* qt, int64_t rows_pad, int64_t D, const float* const* krow,
                                   int64_t k_off, int64_t n, float* s) {
  for (int64_t r0 = 0; r0 < rows_pad; r0 += kLanes) {
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
      const float *k0 = krow[t] + k_off, *k1 = krow[t + 1] + k_off, *k2 = krow[t + 2] + k_off,
                  *k3 = krow[t + 3] + k_off;
      vf16 a0 = {}, a1 = {}, a2 = {}, a3 = {};
      for (int64_t d = 0; d < D; ++d) {
        const vf16 qd = load(qt + d * rows_pad + r0);
        a0 += k0[d] * qd;
        a1 += k1[d] * qd;
        a2 += k2[d] * qd;
        a3 += k3[d] * qd;
      }
      store(s + t * rows_pad + r0, a0);
      store(s + (t + 1) * rows_pad + r0, a1);
      store(s + (t + 2) * rows_pad + r0, a2);
      store(s + (t + 3) * rows_pad + r0, a3);
    }
    for (; t < n; ++t) {
      const float* k = krow[t] + k_off;
      vf16 a = {};
      for (int64_t d = 0; d < D; ++d) a += k[d] * load(qt + d * rows_pad + r0);
      store(s + t * rows_pad + r0, a);
    }
  }
}

template <typename scalar_t>
void to_float(float* __restrict dst, const scalar_t* __restrict src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename scalar_t>
constexpr bool kIsFp8 = std::is_same_v<scalar_t, c10::Float8_e4m3fn> || std::is_same_v<scalar_t, c10::Float8_e5m2>;

// FP8 code -> fp32. An FP8 code is a narrow fp16: e5m2 is the top byte of an fp16, and e4m3's
// bits shifted into fp16's fields give the same number times 2^-8 (subnormals included,
// since fp16 has room below e4m3's range). With F16C, 8 codes at a time become fp16 lanes,
// then fp32 (vcvtph2ps), and the 2^8 is folded into the page scale. Elsewhere (and for
// tails) a 256-entry table per format, built once from c10's exact conversions. NaN/inf
// codes never occur: writes saturate to the largest finite value.
template <typename fp8_t>
const float* fp8_table() {
  static const auto table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b)
      t[b] = static_cast<float>(fp8_t(static_cast<uint8_t>(b), typename fp8_t::from_bits_t{}));
    return t;
  }();
  return table.data();
}

template <typename fp8_t>
void fp8_to_float(float* __restrict dst, const uint8_t* __restrict src, int64_t n, float scale) {
  constexpr bool kE4M3 = std::is_same_v<fp8_t, c10::Float8_e4m3fn>;
  int64_t i = 0;
#if defined(__F16C__) && defined(__AVX2__)
  const __m256 vscale = _mm256_set1_ps(kE4M3 ? scale * 256.f : scale);
  for (; i + 8 <= n; i += 8) {
    const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i)));
    __m128i h;
    if constexpr (kE4M3)
      h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8),
                       _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7));
    else
      h = _mm_slli_epi16(w, 8);
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtph_ps(h), vscale));
  }
#endif
  const float* __restrict table = fp8_table<fp8_t>();
  for (; i < n; ++i) dst[i] = table[src[i]] * scale;
}

template <typename scalar_t>
void widen(float* __restrict dst, const scalar_t* __restrict src, int64_t n, float scale) {
  if constexpr (std::is_same_v<scalar_t, c10::Float8_e4m3fn>)
    fp8_to_float<c10::Float8_e4m3fn>(dst, reinterpret_cast<const uint8_t*>(src), n, scale);
  else if constexpr (std::is_same_v<scalar_t, c10::Float8_e5m2>)
    fp8_to_float<c10::Float8_e5m2>(dst, reinterpret_cast<const uint8_t*>(src), n, scale);
  else
    to_float(dst, src, n);
}

// q is pre-scaled fp32 [T, H, D]; out is fp32 [T, H, D]; partials hold one row per item row.
//
// Scores live in s with a per-row base and a per-key stride, in one of two layouts:
//   few rows per kv head (decode):  row-major [R][kKeyChunk], each score one dot product;
//   many rows per kv head (prefill): per head key-major [kKeyChunk][rows_pad], computed by
//                                    scores_rows_vectorised from the transposed query rows.
template <typename scalar_t>
void attend(const WorkItem& it, const Geometry& g, const float* q, const scalar_t* kv, const int32_t* block_tables,
            int64_t first_pos, float* out, float* part_acc, float* part_ml) {
  constexpr bool kIsFloat = std::is_same_v<scalar_t, float>;
  const int64_t D = g.head_dim, G = g.group;
  const int64_t num_kv = it.head_end - it.head_begin;
  const int64_t rows_per_head = (it.row_end - it.row_begin) * G;
  const int64_t R = num_kv * rows_per_head;
  const bool blocked = D % kLanes == 0;
  const bool rows_vectorised = blocked && rows_per_head >= kLanes;
  const int64_t rows_pad = (rows_per_head + kLanes - 1) / kLanes * kLanes;

  std::vector<float> acc(R * D, 0.f), m(R, kNegInf), l(R, 0.f);
  std::vector<int64_t> limit(R), s_base(R);
  // qbuf: dense query rows [R, D], or per head the transpose [D, rows_pad] (padding rows 0).
  std::vector<float> qbuf(rows_vectorised ? num_kv * D * rows_pad : R * D, 0.f);
  std::vector<float> s(rows_vectorised ? num_kv * kKeyChunk * rows_pad : R * kKeyChunk);
  const int64_t key_stride = rows_vectorised ? rows_pad : 1;
  const int64_t row_stride = rows_vectorised ? 1 : kKeyChunk;
  for (int64_t r = 0; r < R; ++r) {
    const float* src = q + row_offset(it, r, G, g.num_heads, D);
    const int64_t hh = r / rows_per_head, rr = r % rows_per_head;
    if (rows_vectorised) {
      for (int64_t d = 0; d < D; ++d) qbuf[(hh * D + d) * rows_pad + rr] = src[d];
      s_base[r] = hh * kKeyChunk * rows_pad + rr;
    } else {
      std::memcpy(qbuf.data() + r * D, src, D * sizeof(float));
      s_base[r] = r * kKeyChunk;
    }
    limit[r] = first_pos + it.row_begin + rr / G;
  }
  const int64_t max_limit = *std::max_element(limit.begin(), limit.end());
  const int64_t min_limit = *std::min_element(limit.begin(), limit.end());
  // fp16/bf16/fp8 rows are widened into buffers laid out [chunk, num_kv, D]; fp32 rows are read in place.
  std::vector<float> kbuf(kIsFloat ? 0 : kKeyChunk * num_kv * D), vbuf(kIsFloat ? 0 : kKeyChunk * num_kv * D);
  const int64_t head_stride = kIsFloat ? g.stride_head : D;
  const float* krow[kKeyChunk];
  const float* vrow[kKeyChunk];
  const int32_t* table = block_tables + it.seq * g.max_pages;

  for (int64_t k0 = it.key_begin; k0 < it.key_end && k0 <= max_limit; k0 += kKeyChunk) {
    const int64_t n = std::min({kKeyChunk, it.key_end - k0, max_limit + 1 - k0});
    for (int64_t t = 0; t < n; ++t) {
      const int64_t pos = k0 + t;
      const int64_t page = table[pos / g.page_size];
      const scalar_t* base = kv + page * g.stride_page + (pos % g.page_size) * g.stride_token +
                             it.head_begin * g.stride_head;
      if constexpr (kIsFloat) {
        krow[t] = base;
        vrow[t] = base + g.stride_kv;
      } else {
        for (int64_t h = 0; h < num_kv; ++h) {
          float k_scale = 1.f, v_scale = 1.f;
          if constexpr (kIsFp8<scalar_t>) {
            const float* sc = g.scales + page * g.scale_stride_page + (it.head_begin + h) * g.scale_stride_head;
            k_scale = sc[0];
            v_scale = sc[g.scale_stride_kv];
          }
          widen(kbuf.data() + (t * num_kv + h) * D, base + h * g.stride_head, D, k_scale);
          widen(vbuf.data() + (t * num_kv + h) * D, base + g.stride_kv + h * g.stride_head, D, v_scale);
        }
        krow[t] = kbuf.data() + t * num_kv * D;
        vrow[t] = vbuf.data() + t * num_kv * D;
      }
    }
    if (rows_vectorised) {
      for (int64_t hh = 0; hh < num_kv; ++hh)
        scores_rows_vectorised(qbuf.data() + hh * D * rows_pad, rows_pad, D, krow, hh * head_stride, n,
                               s.data() + hh * kKeyChunk * rows_pad);
    } else {
      // Key outer: a key row is loaded once for every query row that reads it, and within
      // a token the kv heads are walked in address order (one page is one stream).
      for (int64_t t = 0; t < n; ++t)
        for (int64_t hh = 0; hh < num_kv; ++hh) {
          const float* k = krow[t] + hh * head_stride;
          int64_t r = hh * rows_per_head;
          const int64_t r_end = r + rows_per_head;
          if (blocked)
            for (; r + kRowBlock <= r_end; r += kRowBlock)
              dot_block(qbuf.data() + r * D, D, k, D, s.data() + r * kKeyChunk + t, kKeyChunk);
          for (; r < r_end; ++r) s[r * kKeyChunk + t] = dot(qbuf.data() + r * D, k, D);
        }
    }
    const bool causal_cut = k0 + n - 1 > min_limit;  // some row sees only part of this chunk
    // Online softmax: mask, then rescale each row once per chunk.
    for (int64_t r = 0; r < R; ++r) {
      float* sr = s.data() + s_base[r];
      if (causal_cut)
        for (int64_t t = std::max<int64_t>(0, limit[r] + 1 - k0); t < n; ++t) sr[t * key_stride] = kNegInf;
      float mx = kNegInf;
      for (int64_t t = 0; t < n; ++t) mx = std::max(mx, sr[t * key_stride]);
      const float m_new = std::max(m[r], mx);
      if (m_new == kNegInf) {  // nothing visible yet: exp(-inf - -inf) would be NaN
        for (int64_t t = 0; t < n; ++t) sr[t * key_stride] = 0.f;
        continue;
      }
      float sum = 0.f;
      for (int64_t t = 0; t < n; ++t) {
        const float e = std::exp(sr[t * key_stride] - m_new);
        sr[t * key_stride] = e;
        sum += e;
      }
      const float alpha = std::exp(m[r] - m_new);
      if (alpha != 1.f) scale_inplace(acc.data() + r * D, alpha, D);
      l[r] = l[r] * alpha + sum;
      m[r] = m_new;
    }
    for (int64_t hh = 0; hh < num_kv; ++hh) {
      int64_t r = hh * rows_per_head;
      const int64_t r_end = r + rows_per_head;
      if (blocked)
        for (; r + kRowBlock <= r_end; r += kRowBlock)
          pv_block(acc.data() + r * D, D, s.data() + s_base[r], row_stride, key_stride, vrow, hh * head_stride, n);
      for (; r < r_end; ++r)
        for (int64_t t = 0; t < n; ++t)
          axpy(acc.data() + r * D, s[s_base[r] + t * key_stride], vrow[t] + hh * head_stride, D);
    }
  }

  for (int64_t r = 0; r < R; ++r) {
    if (it.scratch < 0) {
      float* o = out + row_offset(it, r, G, g.num_heads, D);
      const float inv = 1.f / l[r];
      for (int64_t d = 0; d < D; ++d) o[d] = acc[r * D + d] * inv;
    } else {
      const int64_t row = it.scratch + r;
      std::memcpy(part_acc + row * D, acc.data() + r * D, D * sizeof(float));
      part_ml[row * 2] = m[r];
      part_ml[row * 2 + 1] = l[r];
    }
  }
}

// Combines the partials of one (sequence, query tile, kv heads) split into `parts` items whose
// rows sit back to back from `it.scratch`.
void merge(const WorkItem& it, int64_t parts, const Geometry& g, const float* part_acc, const float* part_ml,
           float* out) {
  const int64_t D = g.head_dim, G = g.group;
  const int64_t R = it.num_rows(G);
  std::vector<float> acc(D);
  for (int64_t r = 0; r < R; ++r) {
    float m_max = kNegInf;
    for (int64_t p = 0; p < parts; ++p) m_max = std::max(m_max, part_ml[(it.scratch + p * R + r) * 2]);
    std::fill(acc.begin(), acc.end(), 0.f);
    float l_sum = 0.f;
    for (int64_t p = 0; p < parts; ++p) {
      const int64_t row = it.scratch + p * R + r;
      const float m_p = part_ml[row * 2];
      if (m_p == kNegInf) continue;  // this partition saw no key visible to the row
      const float w = std::exp(m_p - m_max);
      l_sum += part_ml[row * 2 + 1] * w;
      axpy(acc.data(), w, part_acc + row * D, D);
    }
    float* o = out + row_offset(it, r, G, g.num_heads, D);
    const float inv = 1.f / l_sum;
    for (int64_t d = 0; d < D; ++d) o[d] = acc[d] * inv;
  }
}

// Runs fn(i) for i in [0, n) on torch's intra-op threads; indices are handed out one at a
// time so uneven items balance. at::parallel_for rethrows exceptions from workers.
template <typename F>
void run_dynamic(int64_t n, const F& fn) {
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(n, at::get_num_threads());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  });
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kv_layer, const at::Tensor& block_tables,
                           const at::Tensor& query_start, const at::Tensor& context_lens, double scale,
                           int64_t partition_size, const c10::optional<at::Tensor>& kv_scales) {
  TORCH_CHECK(q.device().is_cpu() && kv_layer.device().is_cpu(), "paged_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3, "q must be [T, num_heads, head_dim], got ", q.sizes());
  TORCH_CHECK(kv_layer.dim() == 5 && kv_layer.size(1) == 2,
              "kv_layer must be [num_pages, 2, page_size, kv_heads, head_dim], got ", kv_layer.sizes());
  TORCH_CHECK(kv_layer.stride(4) == 1, "kv_layer must have a contiguous head_dim");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt, "block_tables must be int32 [B, P]");
  TORCH_CHECK(query_start.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "query_start and context_lens must be int32");

  Geometry g{};
  g.num_pages = kv_layer.size(0);
  g.page_size = kv_layer.size(2);
  g.kv_heads = kv_layer.size(3);
  g.head_dim = kv_layer.size(4);
  g.num_heads = q.size(1);
  g.max_pages = block_tables.size(1);
  g.stride_page = kv_layer.stride(0);
  g.stride_kv = kv_layer.stride(1);
  g.stride_token = kv_layer.stride(2);
  g.stride_head = kv_layer.stride(3);
  TORCH_CHECK(q.size(2) == g.head_dim, "q head_dim ", q.size(2), " != kv head_dim ", g.head_dim);
  TORCH_CHECK(g.num_heads % g.kv_heads == 0, "num_heads ", g.num_heads, " is not a multiple of kv_heads ", g.kv_heads);
  g.group = g.num_heads / g.kv_heads;
  const bool is_fp8 =
      kv_layer.scalar_type() == at::kFloat8_e4m3fn || kv_layer.scalar_type() == at::kFloat8_e5m2;
  TORCH_CHECK(is_fp8 == kv_scales.has_value(), "kv_scales must be given exactly when kv_layer holds fp8 codes");
  if (is_fp8) {
    const at::Tensor& sc = *kv_scales;
    TORCH_CHECK(sc.device().is_cpu() && sc.scalar_type() == at::kFloat && sc.dim() == 3 &&
                    sc.size(0) == g.num_pages && sc.size(1) == 2 && sc.size(2) == g.kv_heads,
                "kv_scales must be fp32 [num_pages, 2, kv_heads] = [", g.num_pages, ", 2, ", g.kv_heads, "], got ",
                sc.scalar_type(), " ", sc.sizes());
    g.scales = sc.data_ptr<float>();
    g.scale_stride_page = sc.stride(0);
    g.scale_stride_kv = sc.stride(1);
    g.scale_stride_head = sc.stride(2);
  }

  const at::Tensor qf = (q.to(at::kFloat) * scale).contiguous();  // fold the scale into q once
  const at::Tensor bt = block_tables.contiguous();
  const at::Tensor qs_t = query_start.contiguous();
  const at::Tensor ctx_t = context_lens.contiguous();
  const int64_t B = ctx_t.numel();
  TORCH_CHECK(qs_t.numel() == B + 1 && bt.size(0) == B, "query_start must be [B + 1] and block_tables [B, P]");
  const int32_t* qs = qs_t.data_ptr<int32_t>();
  const int32_t* ctx = ctx_t.data_ptr<int32_t>();
  const int32_t* table = bt.data_ptr<int32_t>();
  const int64_t T = q.size(0);
  TORCH_CHECK(qs[0] == 0 && qs[B] == T, "query_start must run from 0 to T=", T);

  // Validate everything the kernel will dereference before any thread starts.
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = qs[b + 1] - qs[b];
    TORCH_CHECK(q_len >= 1 && q_len <= ctx[b], "sequence ", b, ": query_len ", q_len, " not in [1, ", ctx[b], "]");
    const int64_t used_pages = (ctx[b] + g.page_size - 1) / g.page_size;
    TORCH_CHECK(used_pages <= g.max_pages, "sequence ", b, ": context ", ctx[b], " needs ", used_pages,
                " pages, block table has ", g.max_pages);
    for (int64_t p = 0; p < used_pages; ++p) {
      const int32_t page = table[b * g.max_pages + p];
      TORCH_CHECK(page >= 0 && page < g.num_pages, "sequence ", b, ": page id ", page, " outside [0, ", g.num_pages,
                  ")");
    }
  }

  // Work items. A decode row takes all kv heads of its sequence, so it streams each page
  // (all heads of a token are adjacent) front to back; a prefill tile takes one kv head to
  // bound its rows. Items are split along the keys only when there are too few of them.
  const auto heads_per_item = [&](int64_t q_len) { return q_len == 1 ? g.kv_heads : int64_t{1}; };
  const int64_t num_threads = at::get_num_threads();
  int64_t num_base_items = 0, total_keys = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = qs[b + 1] - qs[b];
    const int64_t per_tile = g.kv_heads / heads_per_item(q_len);
    for (int64_t i0 = 0; i0 < q_len; i0 += kQueryTile) {
      num_base_items += per_tile;
      total_keys += per_tile * (ctx[b] - q_len + std::min(q_len, i0 + kQueryTile));
    }
  }
  if (partition_size == 0) {  // auto: split only when items cannot feed every thread 4 times
    const int64_t target = 4 * num_threads;
    if (num_base_items >= target) {
      partition_size = -1;
    } else {
      const int64_t per_item = (total_keys + target - 1) / target;
      partition_size = std::max(kMinPartition, (per_item + kKeyChunk - 1) / kKeyChunk * kKeyChunk);
    }
  }

  std::vector<WorkItem> items;
  std::vector<std::pair<WorkItem, int64_t>> splits;  // whole-range item, number of parts
  std::vector<int64_t> first_pos(B);
  int64_t num_partial_rows = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = qs[b + 1] - qs[b];
    first_pos[b] = ctx[b] - q_len - qs[b];  // position of token row t is first_pos[b] + t
    const int64_t hpi = heads_per_item(q_len);
    for (int64_t i0 = 0; i0 < q_len; i0 += kQueryTile) {
      const int64_t i1 = std::min(q_len, i0 + kQueryTile);
      const int64_t key_end = ctx[b] - q_len + i1;
      const int64_t parts = partition_size > 0 ? (key_end + partition_size - 1) / partition_size : 1;
      for (int64_t h = 0; h < g.kv_heads; h += hpi) {
        WorkItem whole{b, h, h + hpi, qs[b] + i0, qs[b] + i1, 0, key_end, -1, key_end * (i1 - i0) * hpi};
        if (parts == 1) {
          items.push_back(whole);
          continue;
        }
        whole.scratch = num_partial_rows;
        splits.emplace_back(whole, parts);
        for (int64_t p = 0; p < parts; ++p) {
          WorkItem part = whole;
          part.key_begin = p * partition_size;
          part.key_end = std::min(key_end, part.key_begin + partition_size);
          part.scratch = num_partial_rows;
          part.cost = (part.key_end - part.key_begin) * (i1 - i0) * hpi;
          num_partial_rows += part.num_rows(g.group);
          items.push_back(part);
        }
      }
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });

  at::Tensor out = at::empty({T, g.num_heads, g.head_dim}, q.options().dtype(at::kFloat));
  at::Tensor part_acc = at::empty({num_partial_rows * g.head_dim}, out.options());
  at::Tensor part_ml = at::empty({num_partial_rows * 2}, out.options());
  const float* qp = qf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* pa = part_acc.data_ptr<float>();
  float* pm = part_ml.data_ptr<float>();

  const auto run_items = [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* kv = static_cast<const scalar_t*>(kv_layer.const_data_ptr());
    run_dynamic(static_cast<int64_t>(items.size()), [&](int64_t i) {
      const WorkItem& it = items[i];
      attend<scalar_t>(it, g, qp, kv, table, first_pos[it.seq], op, pa, pm);
    });
  };
  if (kv_layer.scalar_type() == at::kFloat8_e4m3fn) {
    run_items(c10::Float8_e4m3fn{});
  } else if (kv_layer.scalar_type() == at::kFloat8_e5m2) {
    run_items(c10::Float8_e5m2{});
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, kv_layer.scalar_type(), "kvtier_paged_attention",
                                    [&] { run_items(scalar_t{}); });
  }
  if (!splits.empty())
    run_dynamic(static_cast<int64_t>(splits.size()),
                [&](int64_t i) { merge(splits[i].first, splits[i].second, g, pa, pm, op); });
  return out;
}

void write_kv(at::Tensor kv_layer, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_layer.device().is_cpu(), "write_kv: CPU tensors only");
  TORCH_CHECK(kv_layer.dim() == 5 && kv_layer.size(1) == 2 && kv_layer.stride(4) == 1,
              "kv_layer must be [num_pages, 2, page_size, kv_heads, head_dim] with a contiguous head_dim");
  const int64_t page_size = kv_layer.size(2), kv_heads = kv_layer.size(3), D = kv_layer.size(4);
  const int64_t T = slot_mapping.numel();
  TORCH_CHECK(k.sizes() == v.sizes() && k.dim() == 3 && k.size(0) == T && k.size(1) == kv_heads && k.size(2) == D,
              "k and v must be [T, kv_heads, head_dim] = [", T, ", ", kv_heads, ", ", D, "], got ", k.sizes());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "slot_mapping must be int64");
  const at::Tensor kc = k.to(kv_layer.scalar_type()).contiguous();
  const at::Tensor vc = v.to(kv_layer.scalar_type()).contiguous();
  const at::Tensor sm = slot_mapping.contiguous();
  const int64_t* slots = sm.data_ptr<int64_t>();
  const int64_t num_slots = kv_layer.size(0) * page_size;
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot_mapping[", t, "] = ", slots[t], " outside [0, ",
                num_slots, ")");
  const int64_t s_page = kv_layer.stride(0), s_kv = kv_layer.stride(1), s_tok = kv_layer.stride(2),
                s_head = kv_layer.stride(3);
  const int64_t elem = kv_layer.element_size();
  char* dst = static_cast<char*>(kv_layer.data_ptr());
  const char* ks = static_cast<const char*>(kc.data_ptr());
  const char* vs = static_cast<const char*>(vc.data_ptr());
  at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t base = (slots[t] / page_size) * s_page + (slots[t] % page_size) * s_tok;
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t src = (t * kv_heads + h) * D * elem;
        std::memcpy(dst + (base + h * s_head) * elem, ks + src, D * elem);
        std::memcpy(dst + (base + s_kv + h * s_head) * elem, vs + src, D * elem);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(kvtier_attn, m) {
  m.def(
      "paged_attention(Tensor q, Tensor kv_layer, Tensor block_tables, Tensor query_start, Tensor context_lens, "
      "float scale, int partition_size, Tensor? kv_scales=None) -> Tensor");
  m.def("write_kv(Tensor(a!) kv_layer, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(kvtier_attn, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("write_kv", &write_kv);
}
