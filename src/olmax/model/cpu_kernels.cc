// olmax's CPU kernels for the decode steps: the projections, y [R, P*16] = x [R, I] @ w, with the
// weight packed in panels of 16 output columns, w [P, I, 16] (``olmax.model.cpu_kernels.pack``),
// and the attention over the cache (``CacheAttention``, below). For a training forward that must
// give a token the decode steps' bits (RL's log-probs, ``layers.decode_arithmetic``): the same
// attention over whole sequences (``SequenceAttention``), RMSNorm and row sums, each in one fixed
// order of operations. And the training attention, forward and backward (``FlashForward``,
// ``FlashBackward``, at the end).
//
// A decode step multiplies a few rows by every weight of the model once, so it is a pass over
// the weights, which XLA CPU's products make below the machine's speed for a few rows (see
// ``cpu_kernels.py``). Here the panels are shared out between the calling thread and XLA's own
// intra-op pool, and each panel comes from memory once for all rows (a second block of rows
// reads it again from cache): per step of i two vector loads of the panel feed 2 x MR fused
// multiply-adds held in registers.
//
// Every output element is one fused multiply-add chain over i = 0 .. I-1 in order, whatever the
// number of rows, the row block it falls in, or the thread that runs it: the result for a row
// does not depend on the batch it is in (tests/test_cpu_kernels.py checks this bit for bit).
//
// Built on first use by cpu_kernels.py (AVX2 and FMA; without them, or without a compiler, the
// decode steps keep XLA's products and attention).

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kNR = 16;

// The software prefetch's distance, in cache lines of the weights (one line per step of i): 32
// KiB ahead, into L2. Batch 8 through the decode benchmark's matrices on a 2-core Zen 4, medians
// of 30 interleaved runs, two runs: 2.0 to 2.5 ms at 256 to 768 lines ahead into L2 against 3.0
// to 3.2 ms without a prefetch and 2.6 to 3.0 ms for the earlier two panels ahead into L1 (whose
// lines, 64 KiB ahead at 512 inputs, could be evicted from a 32 KiB L1 before their turn).
constexpr int64_t kAheadLines = 512;

inline void Store(float* y, __m256 a, __m256 b) {
  _mm256_storeu_ps(y, a);
  _mm256_storeu_ps(y + 8, b);
}

// Rows per block: six with AVX2's 16 vector registers (12 accumulators, two weight vectors and a
// broadcast); twelve where the build has AVX-512VL (``cpu_kernels.py`` turns it on where the CPU
// has it), whose EVEX encoding gives the same 256-bit instructions 32 registers. A batch of 8
// then reads each panel once, in one block of 16 independent chains, instead of twice in two
// blocks of 8 (a chain per FMA latency and pipe: no slack).
#if defined(__AVX512VL__)
constexpr int kMaxRows = 12;
#else
constexpr int kMaxRows = 6;
#endif

// MR rows (1 <= MR <= kMaxRows) against one panel [I, 16]. Named accumulators: with an array
// GCC kept them on the stack and stored every one on every step of i (a third of the speed).
// ``ahead`` (or null): where to prefetch into L2, one cache line per step of i, kAheadLines
// lines past the line being read, so that the weights stream in while the multiply-adds run.
#define OLMAX_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
template <int MR>
void Block(const float* x, int64_t ldx, const float* p, int64_t I, float* y, int64_t ldy, const float* ahead) {
  static_assert(MR >= 1 && MR <= kMaxRows, "row block size");
  const __m256 z = _mm256_setzero_ps();
#define OLMAX_DECLARE(r) \
  __m256 a##r##_0 = z, a##r##_1 = z; \
  const float* x##r = x + (MR > r ? r * ldx : 0);
  OLMAX_ROWS(OLMAX_DECLARE)
#undef OLMAX_DECLARE
  for (int64_t i = 0; i < I; ++i) {
    const __m256 w0 = _mm256_loadu_ps(p + i * kNR);
    const __m256 w1 = _mm256_loadu_ps(p + i * kNR + 8);
    if (ahead) _mm_prefetch(reinterpret_cast<const char*>(ahead + i * kNR), _MM_HINT_T1);
#define OLMAX_FMA(r)                                    \
    if (MR > r) {                                       \
      const __m256 b = _mm256_broadcast_ss(x##r + i);   \
      a##r##_0 = _mm256_fmadd_ps(b, w0, a##r##_0);      \
      a##r##_1 = _mm256_fmadd_ps(b, w1, a##r##_1);      \
    }
    OLMAX_ROWS(OLMAX_FMA)
#undef OLMAX_FMA
  }
#define OLMAX_STORE(r) if (MR > r) Store(y + r * ldy, a##r##_0, a##r##_1);
  OLMAX_ROWS(OLMAX_STORE)
#undef OLMAX_STORE
}

// One row against four panels at once: one panel alone would give two accumulators, and each
// waits on the previous multiply-add's latency; four panels keep eight chains in flight, each
// still in the order of i.
void OneRowFour(const float* x, const float* p, int64_t I, float* y) {
  const __m256 z = _mm256_setzero_ps();
  __m256 a0 = z, a1 = z, b0 = z, b1 = z, c0 = z, c1 = z, d0 = z, d1 = z;
  const float *pa = p, *pb = p + I * kNR, *pc = p + 2 * I * kNR, *pd = p + 3 * I * kNR;
  for (int64_t i = 0; i < I; ++i) {
    const __m256 s = _mm256_broadcast_ss(x + i);
    const int64_t o = i * kNR;
    a0 = _mm256_fmadd_ps(s, _mm256_loadu_ps(pa + o), a0);
    a1 = _mm256_fmadd_ps(s, _mm256_loadu_ps(pa + o + 8), a1);
    b0 = _mm256_fmadd_ps(s, _mm256_loadu_ps(pb + o), b0);
    b1 = _mm256_fmadd_ps(s, _mm256_loadu_ps(pb + o + 8), b1);
    c0 = _mm256_fmadd_ps(s, _mm256_loadu_ps(pc + o), c0);
    c1 = _mm256_fmadd_ps(s, _mm256_loadu_ps(pc + o + 8), c1);
    d0 = _mm256_fmadd_ps(s, _mm256_loadu_ps(pd + o), d0);
    d1 = _mm256_fmadd_ps(s, _mm256_loadu_ps(pd + o + 8), d1);
  }
  Store(y, a0, a1);
  Store(y + kNR, b0, b1);
  Store(y + 2 * kNR, c0, c1);
  Store(y + 3 * kNR, d0, d1);
}

void Rows(int mr, const float* x, int64_t ldx, const float* p, int64_t I, float* y, int64_t ldy,
          const float* ahead) {
  switch (mr) {  // never above kMaxRows (Panels)
#define OLMAX_CASE(r) \
    case r + 1: Block<(r + 1 < kMaxRows ? r + 1 : kMaxRows)>(x, ldx, p, I, y, ldy, ahead); break;
    OLMAX_ROWS(OLMAX_CASE)
#undef OLMAX_CASE
  }
}

// The work of one call, split into ``chunks`` pieces that the calling thread and XLA's intra-op
// pool take in turn from an atomic counter. Helpers that start late find no chunk left and touch
// nothing (they hold this state alive, not the buffers).
struct Shared {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t chunks = 0;
  std::function<void(int64_t)> run;
};

void Drain(Shared& s) {
  for (int64_t c; (c = s.next.fetch_add(1, std::memory_order_relaxed)) < s.chunks;) {
    s.run(c);
    s.done.fetch_add(1, std::memory_order_release);
  }
}

int64_t Threads(ffi::ThreadPool& pool) { return std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), 64)); }

void Parallel(ffi::ThreadPool& pool, int64_t chunks, std::function<void(int64_t)> run) {
  auto s = std::make_shared<Shared>();
  s->chunks = chunks;
  s->run = std::move(run);
  for (int64_t t = 1; t < Threads(pool) && t < chunks; ++t) pool.Schedule([s] { Drain(*s); });
  Drain(*s);
  // Chunks other threads claimed are being computed now: wait for them, never for a queue.
  while (s->done.load(std::memory_order_acquire) < chunks) _mm_pause();
}

struct Matmul {
  const float* x;
  const float* w;
  float* y;
  int64_t R, I, O, P;
};

// Panels [p0, p1) for every row.
void Panels(const Matmul& k, int64_t p0, int64_t p1) {
  int64_t p = p0;
  if (k.R == 1) {
    for (; p + 4 <= p1; p += 4) OneRowFour(k.x, k.w + p * k.I * kNR, k.I, k.y + p * kNR);
  }
  // Row blocks of at most kMaxRows, as even as possible (8 rows with AVX2: 4 + 4, not 6 + 2).
  // The first block of each panel prefetches (while the prefetch stays inside the weights).
  const int64_t blocks = (k.R + kMaxRows - 1) / kMaxRows;
  const float* end = k.w + k.P * k.I * kNR;
  for (; p < p1; ++p) {
    const float* pw = k.w + p * k.I * kNR;
    float* yp = k.y + p * kNR;
    const float* ahead = pw + (kAheadLines + k.I) * kNR <= end ? pw + kAheadLines * kNR : nullptr;
    int64_t r = 0;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t mr = (k.R - r) / (blocks - b);
      Rows(static_cast<int>(mr), k.x + r * k.I, k.I, pw, k.I, yp + r * k.O, k.O, b == 0 ? ahead : nullptr);
      r += mr;
    }
  }
}

ffi::Error SkinnyMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                        ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[2] != kNR || wd[1] != xd[1] ||
      yd[0] != xd[0] || yd[1] != wd[0] * kNR) {
    return ffi::Error::InvalidArgument("olmax_skinny_matmul: expected x [R, I], w [P, I, 16], y [R, P*16]");
  }
  const Matmul k{x.typed_data(), w.typed_data(), y->typed_data(), xd[0], xd[1], wd[0] * kNR, wd[0]};
  if (k.R == 0 || k.P == 0) return ffi::Error::Success();
  // A few chunks per thread (of a multiple of 4 panels, for one row), so a thread that starts
  // late still gets a share.
  int64_t chunks = std::min<int64_t>((k.P + 3) / 4, 4 * Threads(pool));
  const int64_t per = 4 * (((k.P + chunks - 1) / chunks + 3) / 4);
  chunks = (k.P + per - 1) / per;
  // Many rows (a prefill, or RL's training forward with the decode arithmetic) go in chunks of
  // rows that stay in L2 (about 256 KiB of x), each against every panel: panel by panel over all
  // rows read the whole of x once per panel (13 GB through an LM head of 1,024 panels at 6,400
  // rows). The same chains either way: a row's result is the same in any chunk.
  const int64_t rows = std::max<int64_t>(kMaxRows, (65536 / std::max<int64_t>(k.I, 1)) / kMaxRows * kMaxRows);
  const int64_t row_chunks = (k.R + rows - 1) / rows;
  Parallel(pool, row_chunks * chunks, [k, per, chunks, rows](int64_t c) {
    Matmul part = k;
    const int64_t r0 = c / chunks * rows;
    part.R = std::min(rows, k.R - r0);
    part.x = k.x + r0 * k.I;
    part.y = k.y + r0 * k.O;
    const int64_t p0 = c % chunks * per;
    Panels(part, p0, std::min(k.P, p0 + per));
  });
  return ffi::Error::Success();
}

// w [I, O] -> [P, I, 16] (P = ceil(O / 16)), the last panel's missing columns zero: the layout the
// product reads (``cpu_kernels.pack``). XLA CPU's transpose of [I, P, 16] to [P, I, 16] moved
// 143 MB in 63 ms (the benchmark's model, once per RL step as the weights change), a plain copy
// 14 ms. Here each thread takes a few panels and copies them row by row: 64 bytes per row and
// panel, read from one cache line of w (when O is a multiple of 16) and written in order.
ffi::Error Pack(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> out) {
  const auto wd = w.dimensions();
  const auto od = out->dimensions();
  if (wd.size() != 2 || od.size() != 3 || od[2] != kNR || od[1] != wd[0] || od[0] != (wd[1] + kNR - 1) / kNR) {
    return ffi::Error::InvalidArgument("olmax_pack: expected w [I, O], out [ceil(O / 16), I, 16]");
  }
  const int64_t I = wd[0], O = wd[1], P = od[0];
  if (I == 0 || P == 0) return ffi::Error::Success();
  const float* src = w.typed_data();
  float* dst = out->typed_data();
  constexpr int64_t kPanels = 8;  // per piece of work: 512 bytes of each row of w
  Parallel(pool, (P + kPanels - 1) / kPanels, [=](int64_t c) {
    const int64_t p1 = std::min(P, (c + 1) * kPanels);
    for (int64_t i = 0; i < I; ++i) {
      for (int64_t p = c * kPanels; p < p1; ++p) {
        const int64_t n = std::min(kNR, O - p * kNR);
        float* d = dst + (p * I + i) * kNR;
        std::memcpy(d, src + i * O + p * kNR, n * sizeof(float));
        if (n < kNR) std::memset(d + n, 0, (kNR - n) * sizeof(float));
      }
    }
  });
  return ffi::Error::Success();
}

// The decode step's attention on the CPU: one query per row and head over the cache, in the
// cache's head-major layout. q [B, KV, G, E], keys and values [B, KV, S, E], ``seen`` [B, S]
// (non-zero where the row's query sees the slot: ``olmax.model.layers.position_mask``) ->
// out [B, KV, G, E]: softmax(q . k * scale) . v over the slots seen, as
// ``olmax.model.attention.cache_attention`` computes it (scores of unseen slots at the lowest
// float, probabilities exp(score - max) / their sum), in fp32. XLA CPU ran its two products at
// about 16 GB/s of cache (2.4 of 10.6 ms of a batch-8 decode step of the benchmark's model); each
// (row, kv head) is here one piece of work that reads its keys and values once, only the slots seen.
// Each output element is a sum over slots in slot order, whatever the batch: batch-invariant.
// The slots seen are listed first, so unseen ones cost no exponential, and for heads of 64 or 128
// the output stays in registers over the slots. The same arithmetic as scoring every slot and
// summing through memory (the same bits, compared when written); at 32 rows x 8 heads of 64 over
// 128 slots, 8 layers with the cache cold: 3.5 -> 2.4 ms with 20 slots seen, 5.3 -> 4.2 with 44,
// 7.1 -> 6.9 with all 128. Scoring four slots at once and software prefetches of the next
// (row, head) were each slower from memory (though faster on a cache in L3), and were dropped.
inline float Dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  for (; i < n; ++i) sum = std::fma(a[i], b[i], sum);
  return sum;
}

// out[0..E) = sum over the listed slots, in order, of w[slot] x values[slot] (the value of slot s
// at values + s * ld): one multiply-add chain per element. NE (the head size / 8, up to 16) holds
// the output in registers; 0 is the general case, through memory (the same arithmetic).
template <int NE>
void Mix(const float* values, int64_t ld, int64_t E, const int32_t* slots, int64_t n, const float* w, float* o) {
  if constexpr (NE > 0) {
    __m256 acc[NE];
    for (int e = 0; e < NE; ++e) acc[e] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      if (w[j] == 0.f) continue;  // a weight that underflows adds nothing
      const __m256 ws = _mm256_set1_ps(w[j]);
      const float* row = values + slots[j] * ld;
      for (int e = 0; e < NE; ++e) acc[e] = _mm256_fmadd_ps(ws, _mm256_loadu_ps(row + 8 * e), acc[e]);
    }
    for (int e = 0; e < NE; ++e) _mm256_storeu_ps(o + 8 * e, acc[e]);
  } else {
    for (int64_t e = 0; e < E; ++e) o[e] = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      if (w[j] == 0.f) continue;
      const float* row = values + slots[j] * ld;
      int64_t e = 0;
      const __m256 ws = _mm256_set1_ps(w[j]);
      for (; e + 8 <= E; e += 8) _mm256_storeu_ps(o + e, _mm256_fmadd_ps(ws, _mm256_loadu_ps(row + e), _mm256_loadu_ps(o + e)));
      for (; e < E; ++e) o[e] = std::fma(w[j], row[e], o[e]);
    }
  }
}

// One query's attention over the listed slots (key and value of slot s at keys / values + s * ld,
// E wide): scores q . k x scale, their maximum, exp(score - max) summed in slot order, the weights
// divided by the sum, and ``mix``. ``none``: the query sees nothing, and weighs every listed slot
// alike (every score the lowest float), as XLA's ``cache_attention`` does. ``p``: n floats of room.
using MixFn = void (*)(const float*, int64_t, int64_t, const int32_t*, int64_t, const float*, float*);
inline void Query(const float* qv, const float* keys, const float* values, int64_t ld, int64_t E,
                  const int32_t* slots, int64_t n, bool none, float scale, MixFn mix, float* p, float* o) {
  const float lowest = std::numeric_limits<float>::lowest();
  float top = lowest;
  for (int64_t j = 0; j < n; ++j) {
    p[j] = none ? lowest : Dot(qv, keys + slots[j] * ld, E) * scale;
    top = std::max(top, p[j]);
  }
  // Unseen slots would add exp(lowest - top) = 0 to the total, and weigh nothing: skipped.
  float total = 0.f;
  for (int64_t j = 0; j < n; ++j) total += (p[j] = std::exp(p[j] - top));
  for (int64_t j = 0; j < n; ++j) p[j] /= total;
  mix(values, ld, E, slots, n, p, o);
}

ffi::Error CacheAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                          ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> seen, ffi::ResultBuffer<ffi::F32> out,
                          float scale) {
  // Keys and values may come as a layer's whole stack, [1, B, KV, S, E]: read in place where
  // the step wrote the new token (a slice of it would be a second, fused copy of that write).
  auto dims = [](auto d, bool stack) {
    std::vector<int64_t> out(d.begin(), d.end());
    if (stack && out.size() == 5 && out[0] == 1) out.erase(out.begin());
    return out;
  };
  const auto qd = dims(q.dimensions(), false);
  const auto kd = dims(k.dimensions(), true);
  const auto vd = dims(v.dimensions(), true);
  const auto od = dims(out->dimensions(), false);
  const auto md = dims(seen.dimensions(), false);
  if (qd.size() != 4 || kd.size() != 4 || vd != kd || od != qd || kd[0] != qd[0] || kd[1] != qd[1] ||
      kd[3] != qd[3] || md.size() != 2 || md[0] != qd[0] || md[1] != kd[2]) {
    return ffi::Error::InvalidArgument(
        "olmax_cache_attention: expected q [B, KV, G, E], k and v [(1,) B, KV, S, E], seen [B, S], out like q");
  }
  const int64_t B = qd[0], KV = qd[1], G = qd[2], E = qd[3], S = kd[2];
  if (B * KV * G * E == 0) return ffi::Error::Success();
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  const int32_t* mp = seen.typed_data();
  float* op = out->typed_data();
  const auto mix = E == 64 ? Mix<8> : E == 128 ? Mix<16> : Mix<0>;
  Parallel(pool, B * KV, [=](int64_t item) {
    const float* keys = kp + item * S * E;
    const float* values = vp + item * S * E;
    const int32_t* m = mp + item / KV * S;
    // Kept per thread, not per item: the slots seen, in slot order, then their scores. A query
    // that sees nothing weighs every slot alike (every score the lowest float), as XLA's
    // ``cache_attention`` does; a decode step always sees at least its own token.
    thread_local std::vector<int32_t> slots;
    thread_local std::vector<float> p;
    slots.clear();
    for (int64_t s = 0; s < S; ++s)
      if (m[s]) slots.push_back(static_cast<int32_t>(s));
    const bool none = slots.empty();
    if (none)
      for (int64_t s = 0; s < S; ++s) slots.push_back(static_cast<int32_t>(s));
    const int64_t n = static_cast<int64_t>(slots.size());
    p.resize(n);
    for (int64_t g = 0; g < G; ++g)
      Query(qp + (item * G + g) * E, keys, values, E, E, slots.data(), n, none, scale, mix, p.data(),
            op + (item * G + g) * E);
  });
  return ffi::Error::Success();
}

// Causal self-attention of whole sequences with the decode step's arithmetic, for the training
// forward whose log-probs must equal the sampler's bit for bit (RL; ``cpu_kernels.
// sequence_attention``). q [B, T, H, E], keys and values [B, T, KV, E] (H = KV x G, head h = kv x
// G + g, as the decode step groups them) -> out like q. Query t sees positions t - W < p <= t (W =
// ``window``, 0: every p <= t), taken in the order the decode cache holds them: by position on a
// full layer (slot = position), by position mod W on a sliding one (its ring of min(W, length)
// slots; below W positions the two orders agree). Each query is then ``Query`` as in
// ``CacheAttention``: the same products, exponentials and sums in the same order.
ffi::Error SequenceAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                             ffi::Buffer<ffi::F32> v, ffi::ResultBuffer<ffi::F32> out, float scale, int64_t window) {
  const std::vector<int64_t> qd(q.dimensions().begin(), q.dimensions().end());
  const std::vector<int64_t> kd(k.dimensions().begin(), k.dimensions().end());
  const std::vector<int64_t> vd(v.dimensions().begin(), v.dimensions().end());
  const std::vector<int64_t> od(out->dimensions().begin(), out->dimensions().end());
  if (qd.size() != 4 || kd.size() != 4 || vd != kd || od != qd || kd[0] != qd[0] ||
      kd[1] != qd[1] || kd[3] != qd[3] || kd[2] == 0 || qd[2] % kd[2] != 0 || window < 0) {
    return ffi::Error::InvalidArgument(
        "olmax_sequence_attention: expected q [B, T, H, E], k and v [B, T, KV, E] with H a multiple of KV, out like q, "
        "window >= 0");
  }
  const int64_t B = qd[0], T = qd[1], H = qd[2], E = qd[3], KV = kd[2], G = H / KV;
  if (B * T * H * E == 0) return ffi::Error::Success();
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  float* op = out->typed_data();
  const auto mix = E == 64 ? Mix<8> : E == 128 ? Mix<16> : Mix<0>;
  constexpr int64_t kQueries = 16;  // per piece of work, of one row and kv head
  const int64_t blocks = (T + kQueries - 1) / kQueries;
  Parallel(pool, B * KV * blocks, [=](int64_t item) {
    const int64_t b = item / (KV * blocks), kv = item / blocks % KV, t0 = item % blocks * kQueries;
    const float* keys = kp + (b * T * KV + kv) * E;  // position p at keys + p * KV * E
    const float* values = vp + (b * T * KV + kv) * E;
    thread_local std::vector<int32_t> slots;
    thread_local std::vector<float> p;
    for (int64_t t = t0; t < std::min(T, t0 + kQueries); ++t) {
      const int64_t lo = window ? std::max<int64_t>(0, t - window + 1) : 0;
      // The decode ring's order: from the first position whose slot is 0 (a multiple of W) to t,
      // then from lo to just before it.
      const int64_t wrap = window ? std::min(t + 1, (lo + window - 1) / window * window) : lo;
      slots.clear();
      for (int64_t s = wrap; s <= t; ++s) slots.push_back(static_cast<int32_t>(s));
      for (int64_t s = lo; s < wrap; ++s) slots.push_back(static_cast<int32_t>(s));
      const int64_t n = static_cast<int64_t>(slots.size());
      p.resize(n);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t at = ((b * T + t) * H + kv * G + g) * E;
        Query(qp + at, keys, values, KV * E, E, slots.data(), n, false, scale, mix, p.data(), op + at);
      }
    }
  });
  return ffi::Error::Success();
}

// Sum of each row of x [R, D] -> [R], in eight lanes over i in order, then the lanes in a fixed
// tree (as ``Dot``): the same bits for a row in any batch (``layers.log_softmax`` under
// ``decode_arithmetic``).
ffi::Error RowSums(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 1 || yd[0] != xd[0]) {
    return ffi::Error::InvalidArgument("olmax_row_sums: expected x [R, D], y [R]");
  }
  const int64_t R = xd[0], D = xd[1];
  if (R == 0) return ffi::Error::Success();
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  const int64_t per = std::max<int64_t>(1, 65536 / std::max<int64_t>(D, 1));  // rows per piece of work
  Parallel(pool, (R + per - 1) / per, [=](int64_t c) {
    for (int64_t r = c * per; r < std::min(R, (c + 1) * per); ++r) {
      const float* a = xp + r * D;
      __m256 acc = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 8 <= D; i += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(a + i));
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, acc);
      float sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
      for (; i < D; ++i) sum += a[i];
      yp[r] = sum;
    }
  });
  return ffi::Error::Success();
}

// RMSNorm of each row of x [R, D] with weight w [D]: y = w x (1 / sqrt(sum(x^2) / D + eps)), the
// sum in eight lanes over i in order, then the lanes in a fixed tree (``Dot``): the same bits for a
// row in any batch and any program. With XLA's RMSNorm a decode step and the forward of the whole
// sequence differed in the last bits after the first layer (XLA CPU turns a multiply and the add
// after it into one multiply-add where the two share a fusion, which depends on the program), so
// the decode steps and RL's training forward compute it here (``layers.decode_arithmetic``).
ffi::Error RmsNorm(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                   ffi::ResultBuffer<ffi::F32> y, float eps) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 1 || yd.size() != 2 || wd[0] != xd[1] || yd[0] != xd[0] || yd[1] != xd[1]) {
    return ffi::Error::InvalidArgument("olmax_rms_norm: expected x [R, D], w [D], y [R, D]");
  }
  const int64_t R = xd[0], D = xd[1];
  if (R * D == 0) return ffi::Error::Success();
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  constexpr int64_t kRows = 32;  // per piece of work
  Parallel(pool, (R + kRows - 1) / kRows, [=](int64_t c) {
    for (int64_t r = c * kRows; r < std::min(R, (c + 1) * kRows); ++r) {
      const float* row = xp + r * D;
      const float mean = Dot(row, row, D) / static_cast<float>(D);
      const float inv = 1.0f / std::sqrt(mean + eps);
      float* out = yp + r * D;
      for (int64_t i = 0; i < D; ++i) out[i] = wp[i] * (row[i] * inv);
    }
  });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// Training attention on the CPU (``olmax.model.cpu_kernels.flash_attention``): causal
// self-attention of whole sequences, forward and backward, fp32, computed per block of queries
// over only the keys the block sees (its window or the causal prefix), as the ``blocked`` XLA
// kernel computes it, but with the scores, the softmax and both products of a block in one
// piece of work, in cache, and the exponentials vectorised. q [B, T, H, E], k and v [B, T, KV, E]
// (H = KV x G, head h = kv x G + g), ``seg`` [B, T] (compared only when ``segments``), read in
// place: no head-major copies. E must be a multiple of 16.
//
// The products go through ``Tile``: MR rows of x against 16 columns of a panel whose rows are
// ``ldp`` floats apart, each output element one multiply-add chain over i in order. Every piece
// of work is computed by one thread in one fixed order, so the results do not depend on the
// number of threads or on which thread takes which piece: the same bits on every run, and, as a
// sequence is never split across pieces, the same bits for a row in any batch.

template <int MR, bool ACC, bool TRANS>
void Tile(const float* x, int64_t ldx, const float* p, int64_t ldp, int64_t I, float* y, int64_t ldy) {
  static_assert(MR >= 1 && MR <= kMaxRows, "row block size");
  const __m256 z = _mm256_setzero_ps();
  // Element (r, i) of x: x[r * ldx + i], or with TRANS x[i * ldx + r] (x^T's rows).
  const int64_t step = TRANS ? ldx : 1;
#define OLMAX_DECLARE(r) \
  __m256 a##r##_0 = z, a##r##_1 = z; \
  const float* x##r = x + (MR > r ? (TRANS ? r : r * ldx) : 0); \
  if (ACC && MR > r) { a##r##_0 = _mm256_loadu_ps(y + r * ldy); a##r##_1 = _mm256_loadu_ps(y + r * ldy + 8); }
  OLMAX_ROWS(OLMAX_DECLARE)
#undef OLMAX_DECLARE
  for (int64_t i = 0; i < I; ++i) {
    const __m256 w0 = _mm256_loadu_ps(p + i * ldp);
    const __m256 w1 = _mm256_loadu_ps(p + i * ldp + 8);
#define OLMAX_FMA(r)                                           \
    if (MR > r) {                                              \
      const __m256 b = _mm256_broadcast_ss(x##r + i * step);   \
      a##r##_0 = _mm256_fmadd_ps(b, w0, a##r##_0);             \
      a##r##_1 = _mm256_fmadd_ps(b, w1, a##r##_1);             \
    }
    OLMAX_ROWS(OLMAX_FMA)
#undef OLMAX_FMA
  }
#define OLMAX_STORE(r) if (MR > r) Store(y + r * ldy, a##r##_0, a##r##_1);
  OLMAX_ROWS(OLMAX_STORE)
#undef OLMAX_STORE
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t);

template <bool ACC, bool TRANS>
TileFn TileFor(int mr) {
  switch (mr) {
#define OLMAX_CASE(r) \
    case r + 1: return Tile<(r + 1 < kMaxRows ? r + 1 : kMaxRows), ACC, TRANS>;
    OLMAX_ROWS(OLMAX_CASE)
#undef OLMAX_CASE
  }
  return nullptr;
}

// Rows [0, R) in blocks of at most kMaxRows, as even as possible: fn(first row, rows).
template <typename F>
void ForRowBlocks(int64_t R, F fn) {
  const int64_t blocks = (R + kMaxRows - 1) / kMaxRows;
  int64_t r = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t mr = (R - r) / (blocks - b);
    fn(r, mr);
    r += mr;
  }
}

// One block of mr rows: y [mr, c0:c1) (=, or += with ``acc``) x [mr, I] @ p [I, c0:c1), c0 and c1
// multiples of 16; rows of x, p and y ldx, ldp and ldy floats apart (with ``trans``, x is stored
// as its transpose, [I, mr], rows ldx apart). The block against each panel of 16 columns in
// turn (its rows of x stay in L1).
void Tiles(const float* x, int64_t ldx, int64_t mr, const float* p, int64_t ldp, int64_t I, int64_t c0, int64_t c1,
           float* y, int64_t ldy, bool acc, bool trans) {
  const int r = static_cast<int>(mr);
  const TileFn tile = trans ? (acc ? TileFor<true, true>(r) : TileFor<false, true>(r))
                            : (acc ? TileFor<true, false>(r) : TileFor<false, false>(r));
  for (int64_t c = c0; c < c1; c += kNR) tile(x, ldx, p + c, ldp, I, y + c, ldy);
}

// exp(x) in eight lanes (Cephes' single-precision method: x = n ln2 + r, |r| <= ln2 / 2, a
// degree-5 polynomial for exp(r), then 2^n; within 2 ulp of the exact value over the range
// where exp is normal). Below -87.34 (exp is subnormal or zero there, and -inf) the result is
// exactly 0, as XLA CPU reads subnormals; NaN stays NaN.
inline __m256 Exp(__m256 x) {
  const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3365478515625f), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_set1_ps(88.3762626647949f), x);  // NaN passes (the second operand)
  x = _mm256_max_ps(_mm256_set1_ps(-87.3365478515625f), x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n));
  return _mm256_andnot_ps(under, y);
}

inline float Lanes(__m256 a) {
  alignas(32) float l[8];
  _mm256_store_ps(l, a);
  return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

// The shape of a call and the keys each query sees.
struct Flash {
  int64_t B, T, H, KV, G, E, window, block;
  bool segments;
  float scale;
  const int32_t* seg;
  // Query block [q0, q1) reads keys [k0, q1): from the first key its first query's window holds.
  int64_t K0(int64_t q0) const { return window ? std::max<int64_t>(0, q0 - window + 1) : 0; }
  // Query t sees keys [lo, t] (and, with segments, only those of its own segment).
  int64_t Lo(int64_t t) const { return window ? std::max<int64_t>(0, t - window + 1) : 0; }
  bool Hidden(int64_t b, int64_t t, int64_t key) const { return segments && seg[b * T + key] != seg[b * T + t]; }
  // The keys (from k0, as offsets) that queries [t, t + rows) see between them: [j0, j1).
  std::pair<int64_t, int64_t> Seen(int64_t t, int64_t rows, int64_t k0) const { return {Lo(t) - k0, t + rows - k0}; }
};

// The keys [k0, k0 + n) of (row b, kv head) transposed into panels: out[e * ld + j] = key j's
// element e, the columns from n to ld (a multiple of 16) zero.
// Eight keys at a time as 8 x 8 blocks transposed in registers (E is a multiple of 8), the
// last n % 8 one element at a time.
void Transposed(const float* src, int64_t row, int64_t n, int64_t E, float* out, int64_t ld) {
  for (int64_t e = 0; e < E; ++e) std::memset(out + e * ld + n, 0, (ld - n) * sizeof(float));
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const float* s = src + j * row;
    for (int64_t e = 0; e < E; e += 8) {
      __m256 r0 = _mm256_loadu_ps(s + e), r1 = _mm256_loadu_ps(s + row + e);
      __m256 r2 = _mm256_loadu_ps(s + 2 * row + e), r3 = _mm256_loadu_ps(s + 3 * row + e);
      __m256 r4 = _mm256_loadu_ps(s + 4 * row + e), r5 = _mm256_loadu_ps(s + 5 * row + e);
      __m256 r6 = _mm256_loadu_ps(s + 6 * row + e), r7 = _mm256_loadu_ps(s + 7 * row + e);
      const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
      const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
      const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
      const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
      const __m256 u0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
      const __m256 u1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
      const __m256 u2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
      const __m256 u3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
      const __m256 u4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
      const __m256 u5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
      const __m256 u6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
      const __m256 u7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
      float* o = out + e * ld + j;
      _mm256_storeu_ps(o, _mm256_permute2f128_ps(u0, u4, 0x20));
      _mm256_storeu_ps(o + ld, _mm256_permute2f128_ps(u1, u5, 0x20));
      _mm256_storeu_ps(o + 2 * ld, _mm256_permute2f128_ps(u2, u6, 0x20));
      _mm256_storeu_ps(o + 3 * ld, _mm256_permute2f128_ps(u3, u7, 0x20));
      _mm256_storeu_ps(o + 4 * ld, _mm256_permute2f128_ps(u0, u4, 0x31));
      _mm256_storeu_ps(o + 5 * ld, _mm256_permute2f128_ps(u1, u5, 0x31));
      _mm256_storeu_ps(o + 6 * ld, _mm256_permute2f128_ps(u2, u6, 0x31));
      _mm256_storeu_ps(o + 7 * ld, _mm256_permute2f128_ps(u3, u7, 0x31));
    }
  }
  for (; j < n; ++j) {
    const float* s = src + j * row;
    for (int64_t e = 0; e < E; ++e) out[e * ld + j] = s[e];
  }
}

// The probabilities of one query's row of scores s [n] (keys k0 .. k0 + n - 1), in place: scaled,
// those it does not see zero, the others exp(score - max) / total. Returns the log-sum-exp.
float Softmax(const Flash& f, int64_t b, int64_t t, int64_t k0, float* s, int64_t n) {
  const int64_t lo = f.Lo(t) - k0, hi = t - k0 + 1;  // seen: [lo, hi)
  const float lowest = -std::numeric_limits<float>::infinity();
  if (f.segments)
    for (int64_t j = lo; j < hi; ++j)
      if (f.Hidden(b, t, k0 + j)) s[j] = lowest;
  const __m256 scale = _mm256_set1_ps(f.scale);
  __m256 most = _mm256_set1_ps(lowest);
  int64_t j = lo;
  for (; j + 8 <= hi; j += 8) {
    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s + j), scale);
    _mm256_storeu_ps(s + j, x);
    most = _mm256_max_ps(most, x);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, most);
  float top = lowest;
  for (float x : lanes) top = std::max(top, x);
  for (; j < hi; ++j) top = std::max(top, s[j] *= f.scale);
  const __m256 shift = _mm256_set1_ps(top);
  __m256 acc = _mm256_setzero_ps();
  j = lo;
  for (; j + 8 <= hi; j += 8) {
    const __m256 e = Exp(_mm256_sub_ps(_mm256_loadu_ps(s + j), shift));
    _mm256_storeu_ps(s + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  float total = Lanes(acc);
  if (j < hi) {
    alignas(32) float tail[8] = {0};
    for (int64_t i = j; i < hi; ++i) tail[i - j] = s[i] - top;
    for (int64_t i = hi - j; i < 8; ++i) tail[i] = lowest;
    _mm256_store_ps(tail, Exp(_mm256_load_ps(tail)));
    for (int64_t i = j; i < hi; ++i) total += (s[i] = tail[i - j]);
  }
  const float inv = 1.f / total;
  for (int64_t i = 0; i < lo; ++i) s[i] = 0.f;
  for (int64_t i = lo; i < hi; ++i) s[i] *= inv;
  for (int64_t i = hi; i < n; ++i) s[i] = 0.f;
  return top + std::log(total);
}


// One query's row of the backward, in place: s [n] (its raw scores q . k) becomes the
// probabilities exp(score x scale - lse), zero for the keys it does not see; dp [n] (dout . v)
// becomes ds = p (dp - rowsum) x scale.
void Recompute(const Flash& f, int64_t b, int64_t t, int64_t k0, float lse, float rowsum, float* s, float* dp,
               int64_t n) {
  const int64_t lo = f.Lo(t) - k0, hi = t - k0 + 1;
  const __m256 scale = _mm256_set1_ps(f.scale), l = _mm256_set1_ps(lse), sum = _mm256_set1_ps(rowsum);
  int64_t j = lo;
  for (; j + 8 <= hi; j += 8) {
    const __m256 p = Exp(_mm256_fmsub_ps(_mm256_loadu_ps(s + j), scale, l));
    _mm256_storeu_ps(s + j, p);
    _mm256_storeu_ps(dp + j, _mm256_mul_ps(_mm256_mul_ps(p, _mm256_sub_ps(_mm256_loadu_ps(dp + j), sum)), scale));
  }
  if (j < hi) {
    alignas(32) float ts[8] = {0}, td[8] = {0};
    for (int64_t i = j; i < hi; ++i) ts[i - j] = s[i], td[i - j] = dp[i];
    const __m256 p = Exp(_mm256_fmsub_ps(_mm256_load_ps(ts), scale, l));
    _mm256_store_ps(ts, p);
    _mm256_store_ps(td, _mm256_mul_ps(_mm256_mul_ps(p, _mm256_sub_ps(_mm256_load_ps(td), sum)), scale));
    for (int64_t i = j; i < hi; ++i) s[i] = ts[i - j], dp[i] = td[i - j];
  }
  for (int64_t i = 0; i < lo; ++i) s[i] = dp[i] = 0.f;
  for (int64_t i = hi; i < n; ++i) s[i] = dp[i] = 0.f;
  if (f.segments)
    for (int64_t i = lo; i < hi; ++i)
      if (f.Hidden(b, t, k0 + i)) s[i] = dp[i] = 0.f;
}

struct FlashScratch {
  std::vector<float> kt, vt, s, dp, qc, vc;
};

FlashScratch& Scratch() {
  thread_local FlashScratch scratch;
  return scratch;
}

int64_t Up16(int64_t n) { return (n + kNR - 1) / kNR * kNR; }

// A row stride for scratch rows at least n wide: an odd number of 16-float panels (64-byte cache
// lines), so the rows of a panel fall in every set of the L1 cache. At a power-of-two stride
// (2 KiB: 512 keys, or 8 heads of 64 read in place) they fell in two sets and evicted each other.
int64_t Stride(int64_t n) {
  const int64_t n16 = Up16(n);
  return (n16 / kNR) % 2 ? n16 : n16 + kNR;
}

// Rows [0, n) of E floats, ``row`` apart, copied ``ld`` apart.
void CopyRows(const float* src, int64_t row, int64_t n, int64_t E, float* out, int64_t ld) {
  for (int64_t j = 0; j < n; ++j) std::memcpy(out + j * ld, src + j * row, E * sizeof(float));
}

ffi::Error FlashForward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                        ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> seg, ffi::ResultBuffer<ffi::F32> out,
                        ffi::ResultBuffer<ffi::F32> lse, float scale, int64_t window, int64_t block,
                        int64_t segments) {
  const std::vector<int64_t> qd(q.dimensions().begin(), q.dimensions().end());
  const std::vector<int64_t> kd(k.dimensions().begin(), k.dimensions().end());
  const std::vector<int64_t> vd(v.dimensions().begin(), v.dimensions().end());
  const std::vector<int64_t> sd(seg.dimensions().begin(), seg.dimensions().end());
  const std::vector<int64_t> od(out->dimensions().begin(), out->dimensions().end());
  const std::vector<int64_t> ld(lse->dimensions().begin(), lse->dimensions().end());
  if (qd.size() != 4 || kd.size() != 4 || vd != kd || od != qd || kd[0] != qd[0] || kd[1] != qd[1] ||
      kd[3] != qd[3] || kd[2] == 0 || qd[2] % kd[2] != 0 || qd[3] % kNR != 0 || sd.size() != 2 ||
      sd[0] != qd[0] || sd[1] != qd[1] || ld.size() != 3 || ld[0] != qd[0] || ld[1] != qd[2] || ld[2] != qd[1] ||
      window < 0 || block < 1) {
    return ffi::Error::InvalidArgument(
        "olmax_flash_forward: expected q [B, T, H, E] (E a multiple of 16), k and v [B, T, KV, E] with H a multiple "
        "of KV, seg [B, T], out like q, lse [B, H, T], window >= 0, block >= 1");
  }
  const Flash f{qd[0], qd[1], qd[2], kd[2], qd[2] / kd[2], qd[3], window, block, segments != 0, scale, seg.typed_data()};
  if (f.B * f.T * f.H == 0) return ffi::Error::Success();
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  float* op = out->typed_data();
  float* lp = lse->typed_data();
  const int64_t blocks = (f.T + block - 1) / block;
  Parallel(pool, f.B * f.KV * blocks, [=](int64_t item) {
    const int64_t b = item / (f.KV * blocks), kv = item / blocks % f.KV, q0 = item % blocks * f.block;
    const int64_t q1 = std::min(f.T, q0 + f.block), m = q1 - q0, k0 = f.K0(q0), n = q1 - k0;
    const int64_t krow = f.KV * f.E, qrow = f.H * f.E;
    const float* keys = kp + ((b * f.T + k0) * f.KV + kv) * f.E;
    const float* values = vp + ((b * f.T + k0) * f.KV + kv) * f.E;
    const int64_t ld = Stride(n), le = Stride(f.E);
    FlashScratch& w = Scratch();
    w.kt.resize(f.E * ld);
    w.s.resize(m * ld);
    w.vc.resize(n * le);
    w.qc.resize(m * le);
    Transposed(keys, krow, n, f.E, w.kt.data(), ld);
    CopyRows(values, krow, n, f.E, w.vc.data(), le);
    for (int64_t g = 0; g < f.G; ++g) {
      const int64_t h = kv * f.G + g;
      float* o = op + ((b * f.T + q0) * f.H + h) * f.E;
      CopyRows(qp + ((b * f.T + q0) * f.H + h) * f.E, qrow, m, f.E, w.qc.data(), le);
      ForRowBlocks(m, [&](int64_t r, int64_t mr) {
        const auto [j0, j1] = f.Seen(q0 + r, mr, k0);
        float* s = w.s.data() + r * ld;
        Tiles(w.qc.data() + r * le, le, mr, w.kt.data(), ld, f.E, j0 / kNR * kNR, Up16(j1), s, ld, false, false);
        for (int64_t i = 0; i < mr; ++i) lp[(b * f.H + h) * f.T + q0 + r + i] = Softmax(f, b, q0 + r + i, k0, s + i * ld, n);
        Tiles(s + j0, ld, mr, w.vc.data() + j0 * le, le, j1 - j0, 0, f.E, o + r * qrow, qrow, false, false);
      });
    }
  });
  return ffi::Error::Success();
}

// The gradients, per (row, kv head), in one piece of work (dk and dv of the head sum over every
// block of queries and every query head of the group, in order). Per block of queries: its
// probabilities again from the saved log-sum-exp, dp = dout v^T, ds = p (dp - rowsum(dout out))
// x scale, then dq = ds k, dk += ds^T q and dv += p^T dout over the keys the block sees.
ffi::Error FlashBackward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                         ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> seg, ffi::Buffer<ffi::F32> out,
                         ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> dout, ffi::ResultBuffer<ffi::F32> dq,
                         ffi::ResultBuffer<ffi::F32> dk, ffi::ResultBuffer<ffi::F32> dv, float scale,
                         int64_t window, int64_t block, int64_t segments) {
  const std::vector<int64_t> qd(q.dimensions().begin(), q.dimensions().end());
  const std::vector<int64_t> kd(k.dimensions().begin(), k.dimensions().end());
  const std::vector<int64_t> vd(v.dimensions().begin(), v.dimensions().end());
  const std::vector<int64_t> sd(seg.dimensions().begin(), seg.dimensions().end());
  const std::vector<int64_t> od(out.dimensions().begin(), out.dimensions().end());
  const std::vector<int64_t> gd(dout.dimensions().begin(), dout.dimensions().end());
  const std::vector<int64_t> ld(lse.dimensions().begin(), lse.dimensions().end());
  const std::vector<int64_t> dqd(dq->dimensions().begin(), dq->dimensions().end());
  const std::vector<int64_t> dkd(dk->dimensions().begin(), dk->dimensions().end());
  const std::vector<int64_t> dvd(dv->dimensions().begin(), dv->dimensions().end());
  if (qd.size() != 4 || kd.size() != 4 || vd != kd || od != qd || gd != qd || dqd != qd || dkd != kd || dvd != kd ||
      kd[0] != qd[0] || kd[1] != qd[1] || kd[3] != qd[3] || kd[2] == 0 || qd[2] % kd[2] != 0 || qd[3] % kNR != 0 ||
      sd.size() != 2 || sd[0] != qd[0] || sd[1] != qd[1] || ld.size() != 3 || ld[0] != qd[0] || ld[1] != qd[2] ||
      ld[2] != qd[1] || window < 0 || block < 1) {
    return ffi::Error::InvalidArgument(
        "olmax_flash_backward: expected q, out, dout and dq [B, T, H, E] (E a multiple of 16), k, v, dk and dv "
        "[B, T, KV, E] with H a multiple of KV, seg [B, T], lse [B, H, T], window >= 0, block >= 1");
  }
  const Flash f{qd[0], qd[1], qd[2], kd[2], qd[2] / kd[2], qd[3], window, block, segments != 0, scale, seg.typed_data()};
  if (f.B * f.T * f.H == 0) return ffi::Error::Success();
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  const float* op = out.typed_data();
  const float* lp = lse.typed_data();
  const float* gp = dout.typed_data();
  float* dqp = dq->typed_data();
  float* dkp = dk->typed_data();
  float* dvp = dv->typed_data();
  const int64_t blocks = (f.T + block - 1) / block;
  Parallel(pool, f.B * f.KV, [=](int64_t item) {
    const int64_t b = item / f.KV, kv = item % f.KV, krow = f.KV * f.E, qrow = f.H * f.E;
    for (int64_t t = 0; t < f.T; ++t) {
      std::memset(dkp + ((b * f.T + t) * f.KV + kv) * f.E, 0, f.E * sizeof(float));
      std::memset(dvp + ((b * f.T + t) * f.KV + kv) * f.E, 0, f.E * sizeof(float));
    }
    FlashScratch& w = Scratch();
    for (int64_t i = 0; i < blocks; ++i) {
      const int64_t q0 = i * f.block, q1 = std::min(f.T, q0 + f.block), m = q1 - q0;
      const int64_t k0 = f.K0(q0), n = q1 - k0, n16 = Up16(n);
      const int64_t kat = ((b * f.T + k0) * f.KV + kv) * f.E;
      w.kt.resize(f.E * n16);
      w.vt.resize(f.E * n16);
      w.s.resize(m * n16);
      w.dp.resize(m * n16);
      Transposed(kp + kat, krow, n, f.E, w.kt.data(), n16);
      Transposed(vp + kat, krow, n, f.E, w.vt.data(), n16);
      for (int64_t g = 0; g < f.G; ++g) {
        const int64_t h = kv * f.G + g, qat = ((b * f.T + q0) * f.H + h) * f.E;
        ForRowBlocks(m, [&](int64_t r, int64_t mr) {
          const auto [j0, j1] = f.Seen(q0 + r, mr, k0);
          float* s = w.s.data() + r * n16;
          float* dp = w.dp.data() + r * n16;
          Tiles(qp + qat + r * qrow, qrow, mr, w.kt.data(), n16, f.E, j0 / kNR * kNR, Up16(j1), s, n16, false, false);
          Tiles(gp + qat + r * qrow, qrow, mr, w.vt.data(), n16, f.E, j0 / kNR * kNR, Up16(j1), dp, n16, false, false);
          for (int64_t i = 0; i < mr; ++i) {
            const int64_t t = q0 + r + i, at = qat + (r + i) * qrow;
            Recompute(f, b, t, k0, lp[(b * f.H + h) * f.T + t], Dot(gp + at, op + at, f.E), s + i * n16, dp + i * n16, n);
          }
          Tiles(dp + j0, n16, mr, kp + kat + j0 * krow, krow, j1 - j0, 0, f.E, dqp + qat + r * qrow, qrow, false, false);
        });
        // dk and dv, a block of keys at a time, over only the queries of this block that see them.
        ForRowBlocks(n, [&](int64_t j, int64_t mr) {
          const int64_t i0 = std::max<int64_t>(0, k0 + j - q0);
          const int64_t i1 = f.window ? std::min(m, k0 + j + mr - 1 + f.window - q0) : m;
          if (i0 >= i1) return;
          Tiles(w.dp.data() + i0 * n16 + j, n16, mr, qp + qat + i0 * qrow, qrow, i1 - i0, 0, f.E, dkp + kat + j * krow,
                krow, true, true);
          Tiles(w.s.data() + i0 * n16 + j, n16, mr, gp + qat + i0 * qrow, qrow, i1 - i0, 0, f.E, dvp + kat + j * krow,
                krow, true, true);
        });
      }
    }
  });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// SwiGLU on the CPU (``olmax.model.cpu_kernels.swiglu``): y = silu(g) u of each row of gu = [g | u]
// [R, 2F] (F wide each), and its gradient dgu = [dy u s (1 + g (1 - s)) | dy g s] with s =
// sigmoid(g) = 1 / (1 + exp(-g)), each in one pass over the rows (XLA made three passes of the
// forward and kept sigmoid(g) and g s in memory for the backward). Every element is computed by
// the same eight-lane arithmetic (the last F % 8 of a row through a padded copy), so its bits
// depend on its inputs alone: not on the row, the batch or the thread.

inline __m256 Sigmoid(__m256 g) {
  const __m256 one = _mm256_set1_ps(1.f);
  return _mm256_div_ps(one, _mm256_add_ps(one, Exp(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

inline __m256 SwigluLanes(__m256 g, __m256 u) { return _mm256_mul_ps(_mm256_mul_ps(g, Sigmoid(g)), u); }

inline void SwigluGradLanes(__m256 g, __m256 u, __m256 dy, __m256* dg, __m256* du) {
  const __m256 one = _mm256_set1_ps(1.f), s = Sigmoid(g), gs = _mm256_mul_ps(g, s);
  *dg = _mm256_mul_ps(_mm256_mul_ps(dy, u), _mm256_mul_ps(s, _mm256_add_ps(one, _mm256_mul_ps(g, _mm256_sub_ps(one, s)))));
  *du = _mm256_mul_ps(dy, gs);
}

bool SwigluShape(const ffi::Buffer<ffi::F32>& gu, int64_t* R, int64_t* F) {
  const auto d = gu.dimensions();
  if (d.size() != 2 || d[1] % 2 != 0) return false;
  *R = d[0];
  *F = d[1] / 2;
  return true;
}

constexpr int64_t kSwigluFloats = 32768;  // elements of y per piece of work

ffi::Error SwigluForward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> gu, ffi::ResultBuffer<ffi::F32> y) {
  int64_t R, F;
  const auto yd = y->dimensions();
  if (!SwigluShape(gu, &R, &F) || yd.size() != 2 || yd[0] != R || yd[1] != F) {
    return ffi::Error::InvalidArgument("olmax_swiglu_forward: expected gu [R, 2F], y [R, F]");
  }
  if (R * F == 0) return ffi::Error::Success();
  const float* in = gu.typed_data();
  float* out = y->typed_data();
  const int64_t per = std::max<int64_t>(1, kSwigluFloats / F);
  Parallel(pool, (R + per - 1) / per, [=](int64_t c) {
    for (int64_t r = c * per; r < std::min(R, (c + 1) * per); ++r) {
      const float* g = in + r * 2 * F;
      const float* u = g + F;
      float* o = out + r * F;
      int64_t i = 0;
      for (; i + 8 <= F; i += 8) _mm256_storeu_ps(o + i, SwigluLanes(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
      if (i < F) {
        alignas(32) float tg[8] = {0}, tu[8] = {0};
        for (int64_t j = i; j < F; ++j) tg[j - i] = g[j], tu[j - i] = u[j];
        _mm256_store_ps(tg, SwigluLanes(_mm256_load_ps(tg), _mm256_load_ps(tu)));
        for (int64_t j = i; j < F; ++j) o[j] = tg[j - i];
      }
    }
  });
  return ffi::Error::Success();
}

ffi::Error SwigluBackward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> gu, ffi::Buffer<ffi::F32> dy,
                          ffi::ResultBuffer<ffi::F32> dgu) {
  int64_t R, F;
  const auto yd = dy.dimensions();
  const auto gd = dgu->dimensions();
  if (!SwigluShape(gu, &R, &F) || yd.size() != 2 || yd[0] != R || yd[1] != F || gd.size() != 2 || gd[0] != R ||
      gd[1] != 2 * F) {
    return ffi::Error::InvalidArgument("olmax_swiglu_backward: expected gu [R, 2F], dy [R, F], dgu [R, 2F]");
  }
  if (R * F == 0) return ffi::Error::Success();
  const float* in = gu.typed_data();
  const float* dyp = dy.typed_data();
  float* out = dgu->typed_data();
  const int64_t per = std::max<int64_t>(1, kSwigluFloats / F);
  Parallel(pool, (R + per - 1) / per, [=](int64_t c) {
    for (int64_t r = c * per; r < std::min(R, (c + 1) * per); ++r) {
      const float* g = in + r * 2 * F;
      const float* u = g + F;
      const float* d = dyp + r * F;
      float* dg = out + r * 2 * F;
      float* du = dg + F;
      int64_t i = 0;
      __m256 a, b;
      for (; i + 8 <= F; i += 8) {
        SwigluGradLanes(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i), _mm256_loadu_ps(d + i), &a, &b);
        _mm256_storeu_ps(dg + i, a);
        _mm256_storeu_ps(du + i, b);
      }
      if (i < F) {
        alignas(32) float tg[8] = {0}, tu[8] = {0}, td[8] = {0};
        for (int64_t j = i; j < F; ++j) tg[j - i] = g[j], tu[j - i] = u[j], td[j - i] = d[j];
        SwigluGradLanes(_mm256_load_ps(tg), _mm256_load_ps(tu), _mm256_load_ps(td), &a, &b);
        _mm256_store_ps(tg, a);
        _mm256_store_ps(tu, b);
        for (int64_t j = i; j < F; ++j) dg[j] = tg[j - i], du[j] = tu[j - i];
      }
    }
  });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// The attention's inputs from its projection on the CPU (``olmax.model.cpu_kernels.qkv``): each
// row n of x = [q | k | v] [N, (H + 2 KV) E] gives q and k RMSNormed over their whole width (H E
// and KV E), times their weights, then rotated per head (RoPE, rotate-half layout, with row n mod
// T of the tables cos/sin [T, E]: one table for every sequence, or one row per row), and v as it is; the backward gives dx = [dq | dk | dv] in one buffer
// and the weights' gradients as sums over chunks of ``chunk`` rows (summed by XLA after). Per
// row one pass over the data, where XLA made five to seven (the split, the norm's sum, the
// normalised copy kept for the backward, RoPE, the concatenation of the gradients). Every row is
// computed alone in one order, and each chunk's sums over its rows in order: the same bits for a
// row in any batch, and for the weights' gradient at any thread count.

struct QkvShape {
  int64_t N, T, H, KV, E, D;
  float eps;
};

bool QkvCheck(const QkvShape& a, int64_t cos_t, int64_t cos_e) {
  return a.H > 0 && a.KV > 0 && a.E > 0 && a.E % kNR == 0 && a.T > 0 && a.N % a.T == 0 && cos_t == a.T &&
         cos_e == a.E && a.D == (a.H + 2 * a.KV) * a.E;
}

// RMSNorm over ``width`` (heads of E) of x, times w, then RoPE per head: out; returns 1 / rms.
float NormRope(const float* x, int64_t width, const float* w, const float* c, const float* s, int64_t E, float eps,
               float* out) {
  const float r = 1.f / std::sqrt(Dot(x, x, width) / static_cast<float>(width) + eps);
  const __m256 rv = _mm256_set1_ps(r);
  const int64_t half = E / 2;
  for (int64_t h0 = 0; h0 < width; h0 += E) {
    for (int64_t e = 0; e < half; e += 8) {
      const int64_t a = h0 + e, b = a + half;
      const __m256 y1 = _mm256_mul_ps(_mm256_loadu_ps(w + a), _mm256_mul_ps(_mm256_loadu_ps(x + a), rv));
      const __m256 y2 = _mm256_mul_ps(_mm256_loadu_ps(w + b), _mm256_mul_ps(_mm256_loadu_ps(x + b), rv));
      const __m256 c1 = _mm256_loadu_ps(c + e), c2 = _mm256_loadu_ps(c + e + half);
      const __m256 s1 = _mm256_loadu_ps(s + e), s2 = _mm256_loadu_ps(s + e + half);
      _mm256_storeu_ps(out + a, _mm256_sub_ps(_mm256_mul_ps(y1, c1), _mm256_mul_ps(y2, s1)));
      _mm256_storeu_ps(out + b, _mm256_add_ps(_mm256_mul_ps(y2, c2), _mm256_mul_ps(y1, s2)));
    }
  }
  return r;
}

// NormRope's backward for one row: dx from dout, and dw += dy x r (dy: dout through RoPE's
// transpose); g [width] is scratch.
void NormRopeGrad(const float* x, int64_t width, const float* w, const float* c, const float* s, int64_t E, float r,
                  const float* dout, float* dx, float* dw, float* g) {
  const __m256 rv = _mm256_set1_ps(r);
  const int64_t half = E / 2;
  __m256 acc = _mm256_setzero_ps();
  for (int64_t h0 = 0; h0 < width; h0 += E) {
    for (int64_t e = 0; e < half; e += 8) {
      const int64_t a = h0 + e, b = a + half;
      const __m256 d1 = _mm256_loadu_ps(dout + a), d2 = _mm256_loadu_ps(dout + b);
      const __m256 c1 = _mm256_loadu_ps(c + e), c2 = _mm256_loadu_ps(c + e + half);
      const __m256 s1 = _mm256_loadu_ps(s + e), s2 = _mm256_loadu_ps(s + e + half);
      const __m256 dy1 = _mm256_add_ps(_mm256_mul_ps(d1, c1), _mm256_mul_ps(d2, s2));
      const __m256 dy2 = _mm256_sub_ps(_mm256_mul_ps(d2, c2), _mm256_mul_ps(d1, s1));
      const __m256 n1 = _mm256_mul_ps(_mm256_loadu_ps(x + a), rv), n2 = _mm256_mul_ps(_mm256_loadu_ps(x + b), rv);
      _mm256_storeu_ps(dw + a, _mm256_fmadd_ps(dy1, n1, _mm256_loadu_ps(dw + a)));
      _mm256_storeu_ps(dw + b, _mm256_fmadd_ps(dy2, n2, _mm256_loadu_ps(dw + b)));
      const __m256 g1 = _mm256_mul_ps(dy1, _mm256_loadu_ps(w + a)), g2 = _mm256_mul_ps(dy2, _mm256_loadu_ps(w + b));
      _mm256_storeu_ps(g + a, g1);
      _mm256_storeu_ps(g + b, g2);
      acc = _mm256_fmadd_ps(g1, n1, acc);
      acc = _mm256_fmadd_ps(g2, n2, acc);
    }
  }
  // d/dx of w (x r): r (g - n mean(g n)), n = x r
  const __m256 mean = _mm256_set1_ps(Lanes(acc) / static_cast<float>(width));
  for (int64_t i = 0; i < width; i += 8) {
    const __m256 n = _mm256_mul_ps(_mm256_loadu_ps(x + i), rv);
    _mm256_storeu_ps(dx + i, _mm256_mul_ps(rv, _mm256_fnmadd_ps(n, mean, _mm256_loadu_ps(g + i))));
  }
}

ffi::Error QkvForward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> wq, ffi::Buffer<ffi::F32> wk,
                      ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin, ffi::ResultBuffer<ffi::F32> q,
                      ffi::ResultBuffer<ffi::F32> k, ffi::ResultBuffer<ffi::F32> v, ffi::ResultBuffer<ffi::F32> r,
                      int64_t heads, int64_t kv_heads, float eps) {
  const auto xd = x.dimensions();
  const auto cd = cos.dimensions();
  const auto sd = sin.dimensions();
  const int64_t E = xd.size() == 2 && heads + 2 * kv_heads > 0 ? xd[1] / (heads + 2 * kv_heads) : 0;
  const QkvShape a{xd.size() == 2 ? xd[0] : 0, cd.size() == 2 ? cd[0] : 0, heads, kv_heads, E,
                   xd.size() == 2 ? xd[1] : -1, eps};
  if (xd.size() != 2 || cd.size() != 2 || sd.size() != 2 || sd[0] != cd[0] || sd[1] != cd[1] ||
      !QkvCheck(a, cd[0], cd[1]) || wq.element_count() != a.H * a.E || wk.element_count() != a.KV * a.E ||
      q->element_count() != a.N * a.H * a.E || k->element_count() != a.N * a.KV * a.E ||
      v->element_count() != a.N * a.KV * a.E || r->element_count() != 2 * a.N) {
    return ffi::Error::InvalidArgument(
        "olmax_qkv_forward: expected x [N, (H + 2 KV) E] (E a multiple of 16, N a multiple of T), wq [H E], wk "
        "[KV E], cos and sin [T, E], q [N, H E], k and v [N, KV E], r [N, 2]");
  }
  if (a.N == 0) return ffi::Error::Success();
  const float *xp = x.typed_data(), *wqp = wq.typed_data(), *wkp = wk.typed_data();
  const float *cp = cos.typed_data(), *sp = sin.typed_data();
  float *qp = q->typed_data(), *kp = k->typed_data(), *vp = v->typed_data(), *rp = r->typed_data();
  constexpr int64_t kRows = 16;  // per piece of work
  Parallel(pool, (a.N + kRows - 1) / kRows, [=](int64_t chunk) {
    for (int64_t n = chunk * kRows; n < std::min(a.N, (chunk + 1) * kRows); ++n) {
      const float* row = xp + n * a.D;
      const int64_t t = n % a.T;
      rp[2 * n] = NormRope(row, a.H * a.E, wqp, cp + t * a.E, sp + t * a.E, a.E, a.eps, qp + n * a.H * a.E);
      rp[2 * n + 1] = NormRope(row + a.H * a.E, a.KV * a.E, wkp, cp + t * a.E, sp + t * a.E, a.E, a.eps,
                               kp + n * a.KV * a.E);
      std::memcpy(vp + n * a.KV * a.E, row + (a.H + a.KV) * a.E, a.KV * a.E * sizeof(float));
    }
  });
  return ffi::Error::Success();
}

ffi::Error QkvBackward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> wq,
                       ffi::Buffer<ffi::F32> wk, ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin,
                       ffi::Buffer<ffi::F32> r, ffi::Buffer<ffi::F32> dq, ffi::Buffer<ffi::F32> dk,
                       ffi::Buffer<ffi::F32> dv, ffi::ResultBuffer<ffi::F32> dx, ffi::ResultBuffer<ffi::F32> dwq,
                       ffi::ResultBuffer<ffi::F32> dwk, int64_t heads, int64_t kv_heads, int64_t chunk, float eps) {
  const auto xd = x.dimensions();
  const auto cd = cos.dimensions();
  const auto sd = sin.dimensions();
  const int64_t E = xd.size() == 2 && heads + 2 * kv_heads > 0 ? xd[1] / (heads + 2 * kv_heads) : 0;
  const QkvShape a{xd.size() == 2 ? xd[0] : 0, cd.size() == 2 ? cd[0] : 0, heads, kv_heads, E,
                   xd.size() == 2 ? xd[1] : -1, eps};
  if (xd.size() != 2 || cd.size() != 2 || sd.size() != 2 || sd[0] != cd[0] || sd[1] != cd[1] ||
      !QkvCheck(a, cd[0], cd[1]) || chunk < 1 || a.N % chunk != 0 || wq.element_count() != a.H * a.E ||
      wk.element_count() != a.KV * a.E || r.element_count() != 2 * a.N || dq.element_count() != a.N * a.H * a.E ||
      dk.element_count() != a.N * a.KV * a.E || dv.element_count() != a.N * a.KV * a.E ||
      dx->element_count() != a.N * a.D || dwq->element_count() != a.N / chunk * a.H * a.E ||
      dwk->element_count() != a.N / chunk * a.KV * a.E) {
    return ffi::Error::InvalidArgument(
        "olmax_qkv_backward: expected x and dx [N, (H + 2 KV) E] (E a multiple of 16, N a multiple of T and of "
        "chunk), wq [H E], wk [KV E], cos and sin [T, E], r [N, 2], dq [N, H E], dk and dv [N, KV E], dwq "
        "[N / chunk, H E], dwk [N / chunk, KV E]");
  }
  if (a.N == 0) return ffi::Error::Success();
  const float *xp = x.typed_data(), *wqp = wq.typed_data(), *wkp = wk.typed_data();
  const float *cp = cos.typed_data(), *sp = sin.typed_data(), *rp = r.typed_data();
  const float *dqp = dq.typed_data(), *dkp = dk.typed_data(), *dvp = dv.typed_data();
  float *dxp = dx->typed_data(), *dwqp = dwq->typed_data(), *dwkp = dwk->typed_data();
  const int64_t Q = a.H * a.E, K = a.KV * a.E;
  Parallel(pool, a.N / chunk, [=](int64_t c) {
    thread_local std::vector<float> g;
    g.resize(std::max(Q, K));
    float* wq_sum = dwqp + c * Q;
    float* wk_sum = dwkp + c * K;
    std::memset(wq_sum, 0, Q * sizeof(float));
    std::memset(wk_sum, 0, K * sizeof(float));
    for (int64_t n = c * chunk; n < (c + 1) * chunk; ++n) {
      const float* row = xp + n * a.D;
      float* out = dxp + n * a.D;
      const int64_t t = n % a.T;
      NormRopeGrad(row, Q, wqp, cp + t * a.E, sp + t * a.E, a.E, rp[2 * n], dqp + n * Q, out, wq_sum, g.data());
      NormRopeGrad(row + Q, K, wkp, cp + t * a.E, sp + t * a.E, a.E, rp[2 * n + 1], dkp + n * K, out + Q, wk_sum,
                   g.data());
      std::memcpy(out + Q + K, dvp + n * K, K * sizeof(float));
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(OlmaxSkinnyMatmul, SkinnyMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(OlmaxCacheAttention, CacheAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OlmaxSequenceAttention, SequenceAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OlmaxPack, Pack,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(OlmaxRowSums, RowSums,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(OlmaxRmsNorm, RmsNorm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OlmaxFlashForward, FlashForward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window")
                                  .Attr<int64_t>("block")
                                  .Attr<int64_t>("segments"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OlmaxFlashBackward, FlashBackward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window")
                                  .Attr<int64_t>("block")
                                  .Attr<int64_t>("segments"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OlmaxSwigluForward, SwigluForward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(OlmaxSwigluBackward, SwigluBackward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(OlmaxQkvForward, QkvForward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("heads")
                                  .Attr<int64_t>("kv_heads")
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OlmaxQkvBackward, QkvBackward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("heads")
                                  .Attr<int64_t>("kv_heads")
                                  .Attr<int64_t>("chunk")
                                  .Attr<float>("eps"));
