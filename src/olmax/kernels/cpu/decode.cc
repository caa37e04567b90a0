// olmax's CPU kernels for the decode steps (``olmax.kernels.cpu``): the projections, y [R, P*16]
// = x [R, I] @ w, with the weight packed in panels of 16 output columns, w [P, I, 16] (``Pack``,
// ``olmax.kernels.cpu.pack``), and the attention over the KV cache (``CacheAttention``).
//
// A decode step multiplies a few rows by every weight of the model once, so it is a pass over
// the weights, which XLA CPU's products make below the machine's speed for a few rows (see
// ``olmax/kernels/cpu/__init__.py``). Here the panels are shared out between the calling thread
// and XLA's own intra-op pool, and each panel comes from memory once for all rows (a second block
// of rows reads it again from cache): per step of i two vector loads of the panel feed 2 x MR
// fused multiply-adds held in registers.
//
// Every output element is one fused multiply-add chain over i = 0 .. I-1 in order, whatever the
// number of rows, the row block it falls in, or the thread that runs it: the result for a row
// does not depend on the batch it is in (tests/test_cpu_kernels.py checks this bit for bit).

#include "common.h"

namespace {

using namespace olmax;  // the shared helpers (common.h)

// The software prefetch's distance, in cache lines of the weights (one line per step of i): 32
// KiB ahead, into L2. Batch 8 through the decode benchmark's matrices on a 2-core Zen 4, medians
// of 30 interleaved runs, two runs: 2.0 to 2.5 ms at 256 to 768 lines ahead into L2 against 3.0
// to 3.2 ms without a prefetch and 2.6 to 3.0 ms for the earlier two panels ahead into L1 (whose
// lines, 64 KiB ahead at 512 inputs, could be evicted from a 32 KiB L1 before their turn).
constexpr int64_t kAheadLines = 512;

// MR rows (1 <= MR <= kMaxRows) against one panel [I, 16]. Named accumulators: with an array
// GCC kept them on the stack and stored every one on every step of i (a third of the speed).
// ``ahead`` (or null): where to prefetch into L2, one cache line per step of i, kAheadLines
// lines past the line being read, so that the weights stream in while the multiply-adds run.
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
// product reads (``olmax.kernels.cpu.pack``). XLA CPU's transpose of [I, P, 16] to [P, I, 16] moved
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
  const MixFn mix = MixFor(E);
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

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(OlmaxSkinnyMatmul, SkinnyMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(OlmaxPack, Pack,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
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
