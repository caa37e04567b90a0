// olmax's CPU kernel for the decode steps' projections: y [R, P*16] = x [R, I] @ w, with the
// weight packed in panels of 16 output columns, w [P, I, 16] (``olmax.model.cpu_kernels.pack``).
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
// decode steps keep XLA's products).

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kNR = 16;

// The software prefetch's distance, in cache lines of the weights (one line per step of i): 32
// KiB ahead, into L2. Batch 8 through the decode benchmark's matrices on a 2-core Zen 4, medians
// of 30 interleaved runs: 2.0 ms at 256 to 768 lines ahead into L2 against 3.0 ms without a
// prefetch and 2.6 ms for the earlier two panels ahead into L1 (whose lines, 64 KiB ahead at
// 512 inputs, could be evicted from a 32 KiB L1 before their turn).
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

// Shared by the calling thread and the pool's helpers; helpers that start late find no chunk
// left and touch nothing (they hold the state alive, not the buffers).
struct Work {
  const float* x;
  const float* w;
  float* y;
  int64_t R, I, O, P, per_chunk, chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// Panels [p0, p1) for every row.
void Panels(const Work& k, int64_t p0, int64_t p1) {
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

void Drain(Work& k) {
  for (int64_t c; (c = k.next.fetch_add(1, std::memory_order_relaxed)) < k.chunks;) {
    Panels(k, c * k.per_chunk, std::min(k.P, (c + 1) * k.per_chunk));
    k.done.fetch_add(1, std::memory_order_release);
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
  auto k = std::make_shared<Work>();
  k->x = x.typed_data();
  k->w = w.typed_data();
  k->y = y->typed_data();
  k->R = xd[0];
  k->I = xd[1];
  k->P = wd[0];
  k->O = wd[0] * kNR;
  if (k->R == 0 || k->P == 0) return ffi::Error::Success();
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), 64));
  // A few chunks per thread (of a multiple of 4 panels, for one row), so a thread that starts
  // late still gets a share.
  k->chunks = std::min<int64_t>((k->P + 3) / 4, 4 * threads);
  k->per_chunk = 4 * (((k->P + k->chunks - 1) / k->chunks + 3) / 4);
  k->chunks = (k->P + k->per_chunk - 1) / k->per_chunk;
  for (int64_t t = 1; t < threads && t < k->chunks; ++t) pool.Schedule([k] { Drain(*k); });
  Drain(*k);
  // Chunks other threads claimed are being computed now: wait for them, never for a queue.
  while (k->done.load(std::memory_order_acquire) < k->chunks) _mm_pause();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(OlmaxSkinnyMatmul, SkinnyMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
