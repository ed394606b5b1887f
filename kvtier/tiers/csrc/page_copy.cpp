// Fused page copy + checksum: one pass over a run of pages that stores every 64-bit word
// to the destination and adds it into the page's checksum while it is in a register.
//
// The checksum is kvtier.checksum's wsum64/512 (the reference definition lives there):
//
//   S[b]      sum of the 64 little-endian words of 512-byte block b (tail zero padded)
//   checksum  sum over b of (2b + 1) * S[b]                                 mod 2**64
//
// Weights without a multiply per block: with R the running sum of S and Q the sum of R
// taken before each block is added (Q = sum over b of S[0] + ... + S[b-1]),
//
//   sum_b b * S[b] = (B - 1) * R - Q        so        checksum = 2 * ((B - 1) * R - Q) + R
//
// Both R and Q are kept per SIMD lane (sums mod 2**64 do not care which lane a word went
// through) and reduced once per page.
//
// Streaming (non-temporal) stores from stream_min_bytes up: they skip the
// read-for-ownership of every destination line (a plain store's third memory transfer)
// and leave the caches to the engine. Callers turn them on for copies of 1 MiB and more
// (kvtier/tiers/copy.py): 1.3-1.6x plain stores on a 2-core AMD EPYC, 0.93-1.05x on the
// CI-class machine of decision 0005.
//
// Ops run with the GIL released (torch.ops drops it around every call), so a transfer
// thread copying here never blocks the engine thread's Python.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "wsum64/512 reads little-endian words; this kernel assumes a little-endian host"
#endif

namespace {

constexpr int64_t kBlockBytes = 512;
constexpr int64_t kWordsPerBlock = kBlockBytes / 8;

struct Sums {
  uint64_t r = 0;  // running sum of block sums
  uint64_t q = 0;  // sum of r before each block
  uint64_t blocks = 0;

  uint64_t finish() const { return 2 * ((blocks - 1) * r - q) + r; }
};

// Sums one zero-padded partial block (and copies its bytes when dst is set).
inline void tail_block(const uint8_t* src, uint8_t* dst, int64_t nbytes, Sums& s) {
  uint64_t words[kWordsPerBlock] = {0};
  std::memcpy(words, src, nbytes);
  if (dst != nullptr) std::memcpy(dst, src, nbytes);
  uint64_t block = 0;
  for (int64_t i = 0; i < kWordsPerBlock; ++i) block += words[i];
  s.q += s.r;
  s.r += block;
  s.blocks += 1;
}

// One page: full blocks in SIMD, the tail block in scalar code. kCopy selects copy+sum or
// sum only; kStream streaming stores (dst 64-byte aligned).
template <bool kCopy, bool kStream>
uint64_t page_sum(const uint8_t* __restrict src, uint8_t* __restrict dst, int64_t nbytes) {
  const int64_t full = nbytes / kBlockBytes;
  Sums s;
#if defined(__AVX512F__)
  __m512i r = _mm512_setzero_si512(), q = _mm512_setzero_si512();
  for (int64_t b = 0; b < full; ++b) {
    const __m512i* in = reinterpret_cast<const __m512i*>(src + b * kBlockBytes);
    __m512i w0 = _mm512_loadu_si512(in + 0), w1 = _mm512_loadu_si512(in + 1);
    __m512i w2 = _mm512_loadu_si512(in + 2), w3 = _mm512_loadu_si512(in + 3);
    __m512i w4 = _mm512_loadu_si512(in + 4), w5 = _mm512_loadu_si512(in + 5);
    __m512i w6 = _mm512_loadu_si512(in + 6), w7 = _mm512_loadu_si512(in + 7);
    if constexpr (kCopy) {
      __m512i* out = reinterpret_cast<__m512i*>(dst + b * kBlockBytes);
      if constexpr (kStream) {
        _mm512_stream_si512(out + 0, w0); _mm512_stream_si512(out + 1, w1);
        _mm512_stream_si512(out + 2, w2); _mm512_stream_si512(out + 3, w3);
        _mm512_stream_si512(out + 4, w4); _mm512_stream_si512(out + 5, w5);
        _mm512_stream_si512(out + 6, w6); _mm512_stream_si512(out + 7, w7);
      } else {
        _mm512_storeu_si512(out + 0, w0); _mm512_storeu_si512(out + 1, w1);
        _mm512_storeu_si512(out + 2, w2); _mm512_storeu_si512(out + 3, w3);
        _mm512_storeu_si512(out + 4, w4); _mm512_storeu_si512(out + 5, w5);
        _mm512_storeu_si512(out + 6, w6); _mm512_storeu_si512(out + 7, w7);
      }
    }
    __m512i block = _mm512_add_epi64(
        _mm512_add_epi64(_mm512_add_epi64(w0, w1), _mm512_add_epi64(w2, w3)),
        _mm512_add_epi64(_mm512_add_epi64(w4, w5), _mm512_add_epi64(w6, w7)));
    q = _mm512_add_epi64(q, r);
    r = _mm512_add_epi64(r, block);
  }
  s.r = static_cast<uint64_t>(_mm512_reduce_add_epi64(r));
  s.q = static_cast<uint64_t>(_mm512_reduce_add_epi64(q));
#elif defined(__AVX2__)
  __m256i r = _mm256_setzero_si256(), q = _mm256_setzero_si256();
  for (int64_t b = 0; b < full; ++b) {
    const __m256i* in = reinterpret_cast<const __m256i*>(src + b * kBlockBytes);
    __m256i block = _mm256_setzero_si256();
    for (int i = 0; i < 16; ++i) {
      __m256i w = _mm256_loadu_si256(in + i);
      if constexpr (kCopy) {
        __m256i* out = reinterpret_cast<__m256i*>(dst + b * kBlockBytes) + i;
        if constexpr (kStream) {
          _mm256_stream_si256(out, w);
        } else {
          _mm256_storeu_si256(out, w);
        }
      }
      block = _mm256_add_epi64(block, w);
    }
    q = _mm256_add_epi64(q, r);
    r = _mm256_add_epi64(r, block);
  }
  alignas(32) uint64_t rl[4], ql[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(rl), r);
  _mm256_store_si256(reinterpret_cast<__m256i*>(ql), q);
  s.r = rl[0] + rl[1] + rl[2] + rl[3];
  s.q = ql[0] + ql[1] + ql[2] + ql[3];
#else
  for (int64_t b = 0; b < full; ++b) {
    uint64_t words[kWordsPerBlock];
    std::memcpy(words, src + b * kBlockBytes, kBlockBytes);
    if constexpr (kCopy) std::memcpy(dst + b * kBlockBytes, words, kBlockBytes);
    uint64_t block = 0;
    for (int64_t i = 0; i < kWordsPerBlock; ++i) block += words[i];
    s.q += s.r;
    s.r += block;
  }
#endif
  s.blocks = static_cast<uint64_t>(full);
  const int64_t rest = nbytes - full * kBlockBytes;
  if (rest > 0 || full == 0) {
    tail_block(src + full * kBlockBytes, kCopy ? dst + full * kBlockBytes : nullptr, rest, s);
  }
  return s.finish();
}

// Bytes per page of a run tensor [n, ...]: checks the contract every op shares.
int64_t page_bytes_of(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got one on ", t.device());
  TORCH_CHECK(t.dim() >= 1, name, " must be a run of pages [n, ...], got a scalar");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous (one page = one block of memory)");
  const int64_t n = t.size(0);
  return n == 0 ? 0 : static_cast<int64_t>(t.nbytes()) / n;
}

at::Tensor checksum(const at::Tensor& pages) {
  const int64_t page_bytes = page_bytes_of(pages, "pages");
  const int64_t n = pages.size(0);
  at::Tensor out = at::empty({n}, at::TensorOptions().dtype(at::kLong));
  auto* sums = reinterpret_cast<uint64_t*>(out.data_ptr<int64_t>());
  const auto* base = static_cast<const uint8_t*>(pages.const_data_ptr());
  for (int64_t i = 0; i < n; ++i) sums[i] = page_sum<false, false>(base + i * page_bytes, nullptr, page_bytes);
  return out;
}

// Runs body(first_page, end_page) over [0, n) in chunks of about kChunkBytes, pulled from
// a shared counter by the calling thread and by up to num_threads - 1 helper tasks on
// torch's inter-op pool. No barrier: the caller never waits for a helper that has not
// started (it takes the remaining chunks itself), only for chunks a helper is already
// copying, so a helper descheduled by a busy core costs at most one chunk.
constexpr int64_t kChunkBytes = 256 << 10;

template <typename Body>
void run_shared(int64_t n, int64_t page_bytes, int64_t num_threads, const Body& body) {
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / std::max<int64_t>(1, page_bytes));
  const int64_t num_chunks = (n + chunk - 1) / chunk;
  const int64_t helpers = std::min<int64_t>(num_threads, num_chunks) - 1;
  if (helpers <= 0) {
    body(0, n);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto state = std::make_shared<State>();
  // Returns after the counter runs out; a late helper touches only `state`, never the pages.
  auto work = [state, chunk, num_chunks, n, &body]() {
    int64_t finished = 0;
    for (int64_t c; (c = state->next.fetch_add(1)) < num_chunks;) {
      body(c * chunk, std::min(n, (c + 1) * chunk));
      ++finished;
    }
    if (finished > 0 && state->done.fetch_add(finished) + finished == num_chunks) {
      std::lock_guard<std::mutex> lock(state->mu);
      state->cv.notify_all();
    }
  };
  for (int64_t h = 0; h < helpers; ++h) at::launch(work);
  work();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done.load() == num_chunks; });
}

// Copies src[i] into dst[i] for every page of the run; returns the checksums of the
// copied bytes. stream_min_bytes: use streaming stores when the run is at least this
// large and dst allows them (0 never streams). num_threads: threads that share the run.
at::Tensor copy_checksum(const at::Tensor& src, at::Tensor& dst, int64_t stream_min_bytes, int64_t num_threads) {
  const int64_t page_bytes = page_bytes_of(src, "src");
  page_bytes_of(dst, "dst");
  TORCH_CHECK(src.size(0) == dst.size(0), "src has ", src.size(0), " pages, dst ", dst.size(0));
  TORCH_CHECK(src.nbytes() == dst.nbytes(), "src pages have ", page_bytes, " bytes, dst pages ",
              dst.size(0) ? dst.nbytes() / dst.size(0) : 0);
  const int64_t n = src.size(0);
  at::Tensor out = at::empty({n}, at::TensorOptions().dtype(at::kLong));
  if (n == 0) return out;
  const auto* s = static_cast<const uint8_t*>(src.const_data_ptr());
  auto* d = static_cast<uint8_t*>(dst.data_ptr());
  const auto total = static_cast<int64_t>(src.nbytes());
  TORCH_CHECK(s + total <= d || d + total <= s, "src and dst overlap");
  auto* sums = reinterpret_cast<uint64_t*>(out.data_ptr<int64_t>());
  const bool stream = stream_min_bytes > 0 && total >= stream_min_bytes &&
                      reinterpret_cast<uintptr_t>(d) % 64 == 0 && page_bytes % 64 == 0;
  run_shared(n, page_bytes, num_threads, [&](int64_t begin, int64_t end) {
    if (stream) {
      for (int64_t i = begin; i < end; ++i)
        sums[i] = page_sum<true, true>(s + i * page_bytes, d + i * page_bytes, page_bytes);
#if defined(__AVX512F__) || defined(__AVX2__)
      _mm_sfence();  // streaming stores are weakly ordered: drain them before the chunk counts as done
#endif
    } else {
      for (int64_t i = begin; i < end; ++i)
        sums[i] = page_sum<true, false>(s + i * page_bytes, d + i * page_bytes, page_bytes);
    }
  });
  return out;
}

// Page ids [begin, end) of an indexed copy (int64, 1-D, contiguous, each in [0, num_pages)).
const int64_t* page_ids_of(const at::Tensor& ids, int64_t begin, int64_t end, int64_t num_pages,
                           const char* name) {
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(),
              name, " must be a contiguous 1-D int64 CPU tensor");
  const int64_t* p = ids.const_data_ptr<int64_t>();
  for (int64_t i = begin; i < end; ++i) {
    TORCH_CHECK(p[i] >= 0 && p[i] < num_pages, name, "[", i, "] = ", p[i], " is out of range [0, ", num_pages, ")");
  }
  return p;
}

// Copies page src[src_pages[i]] into dst[dst_pages[i]] for every i in [begin, end), and
// writes the checksum of the copied bytes into sums[i]. The id and sum arrays are a whole
// transfer's, converted once; a caller that wants to stop between parts (cancellation,
// pacing) passes consecutive ranges, so a part costs one dispatch (~2 us) and no Python
// per page. The pools must not overlap (two tiers never share memory) and no destination
// may appear twice (helper threads copy pairs in no fixed order; the transfer engine
// refuses such a transfer).
void copy_checksum_pages(const at::Tensor& src, at::Tensor& dst, const at::Tensor& src_pages,
                         const at::Tensor& dst_pages, at::Tensor& sums, int64_t begin, int64_t end,
                         int64_t stream_min_bytes, int64_t num_threads) {
  TORCH_CHECK(src.dim() >= 1 && dst.dim() >= 1, "src and dst must be pools [num_pages, ...]");
  const int64_t src_n = src.size(0), dst_n = dst.size(0);
  const int64_t page_bytes = src_n == 0 ? 0 : page_bytes_of(src, "src");
  const int64_t dst_page_bytes = dst_n == 0 ? 0 : page_bytes_of(dst, "dst");
  const int64_t total = src_pages.numel();
  TORCH_CHECK(dst_pages.numel() == total && sums.numel() == total,
              "src_pages, dst_pages and sums differ in length: ", total, ", ", dst_pages.numel(), ", ",
              sums.numel());
  TORCH_CHECK(0 <= begin && begin <= end && end <= total, "range [", begin, ", ", end, ") is not within [0, ",
              total, ")");
  TORCH_CHECK(sums.device().is_cpu() && sums.scalar_type() == at::kLong && sums.is_contiguous(),
              "sums must be a contiguous int64 CPU tensor");
  const int64_t n = end - begin;
  if (n == 0) return;
  TORCH_CHECK(page_bytes == dst_page_bytes, "src pages have ", page_bytes, " bytes, dst pages ", dst_page_bytes);
  const int64_t* si = page_ids_of(src_pages, begin, end, src_n, "src_pages") + begin;
  const int64_t* di = page_ids_of(dst_pages, begin, end, dst_n, "dst_pages") + begin;
  const auto* s = static_cast<const uint8_t*>(src.const_data_ptr());
  auto* d = static_cast<uint8_t*>(dst.data_ptr());
  TORCH_CHECK(s + src_n * page_bytes <= d || d + dst_n * page_bytes <= s, "src and dst pools overlap");
  auto* out = reinterpret_cast<uint64_t*>(sums.data_ptr<int64_t>()) + begin;
  const bool stream = stream_min_bytes > 0 && n * page_bytes >= stream_min_bytes &&
                      reinterpret_cast<uintptr_t>(d) % 64 == 0 && page_bytes % 64 == 0;
  run_shared(n, page_bytes, num_threads, [&](int64_t lo, int64_t hi) {
    if (stream) {
      for (int64_t i = lo; i < hi; ++i)
        out[i] = page_sum<true, true>(s + si[i] * page_bytes, d + di[i] * page_bytes, page_bytes);
#if defined(__AVX512F__) || defined(__AVX2__)
      _mm_sfence();
#endif
    } else {
      for (int64_t i = lo; i < hi; ++i)
        out[i] = page_sum<true, false>(s + si[i] * page_bytes, d + di[i] * page_bytes, page_bytes);
    }
  });
}

}  // namespace

TORCH_LIBRARY(kvtier_page, m) {
  m.def("checksum(Tensor pages) -> Tensor");
  m.def("copy_checksum(Tensor src, Tensor(a!) dst, int stream_min_bytes, int num_threads) -> Tensor");
  m.def(
      "copy_checksum_pages(Tensor src, Tensor(a!) dst, Tensor src_pages, Tensor dst_pages, Tensor(b!) sums, "
      "int begin, int end, int stream_min_bytes, int num_threads) -> ()");
}

TORCH_LIBRARY_IMPL(kvtier_page, CPU, m) {
  m.impl("checksum", &checksum);
  m.impl("copy_checksum", &copy_checksum);
  m.impl("copy_checksum_pages", &copy_checksum_pages);
}
