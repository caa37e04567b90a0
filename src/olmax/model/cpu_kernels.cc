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

inline void Store(float* y, __m256 a, __m256 b) {
  _mm256_storeu_ps(y, a);
  _mm256_storeu_ps(y + 8, b);
}

// MR rows (1 <= MR <= 6) against one panel [I, 16]. Named accumulators: with an array GCC kept
// them on the stack and stored every one on every step of i (a third of the speed). ``ahead``
// (or null): a panel to prefetch, one cache line per step of i, so that it is in cache when its
// turn comes (8 rows, one thread, weights from memory: 9% to 14% faster by medians of 25
// interleaved runs, 2 panels ahead against none).
template <int MR>
void Block(const float* x, int64_t ldx, const float* p, int64_t I, float* y, int64_t ldy, const float* ahead) {
  const __m256 z = _mm256_setzero_ps();
  __m256 a00 = z, a01 = z, a10 = z, a11 = z, a20 = z, a21 = z, a30 = z, a31 = z, a40 = z, a41 = z,
         a50 = z, a51 = z;
  const float* x0 = x;
  const float* x1 = x + (MR > 1 ? ldx : 0);
  const float* x2 = x + (MR > 2 ? 2 * ldx : 0);
  const float* x3 = x + (MR > 3 ? 3 * ldx : 0);
  const float* x4 = x + (MR > 4 ? 4 * ldx : 0);
  const float* x5 = x + (MR > 5 ? 5 * ldx : 0);
  for (int64_t i = 0; i < I; ++i) {
    const __m256 w0 = _mm256_loadu_ps(p + i * kNR);
    const __m256 w1 = _mm256_loadu_ps(p + i * kNR + 8);
    if (ahead) _mm_prefetch(reinterpret_cast<const char*>(ahead + i * kNR), _MM_HINT_T0);
    __m256 b = _mm256_broadcast_ss(x0 + i);
    a00 = _mm256_fmadd_ps(b, w0, a00);
    a01 = _mm256_fmadd_ps(b, w1, a01);
    if (MR > 1) {
      b = _mm256_broadcast_ss(x1 + i);
      a10 = _mm256_fmadd_ps(b, w0, a10);
      a11 = _mm256_fmadd_ps(b, w1, a11);
    }
    if (MR > 2) {
      b = _mm256_broadcast_ss(x2 + i);
      a20 = _mm256_fmadd_ps(b, w0, a20);
      a21 = _mm256_fmadd_ps(b, w1, a21);
    }
    if (MR > 3) {
      b = _mm256_broadcast_ss(x3 + i);
      a30 = _mm256_fmadd_ps(b, w0, a30);
      a31 = _mm256_fmadd_ps(b, w1, a31);
    }
    if (MR > 4) {
      b = _mm256_broadcast_ss(x4 + i);
      a40 = _mm256_fmadd_ps(b, w0, a40);
      a41 = _mm256_fmadd_ps(b, w1, a41);
    }
    if (MR > 5) {
      b = _mm256_broadcast_ss(x5 + i);
      a50 = _mm256_fmadd_ps(b, w0, a50);
      a51 = _mm256_fmadd_ps(b, w1, a51);
    }
  }
  Store(y, a00, a01);
  if (MR > 1) Store(y + ldy, a10, a11);
  if (MR > 2) Store(y + 2 * ldy, a20, a21);
  if (MR > 3) Store(y + 3 * ldy, a30, a31);
  if (MR > 4) Store(y + 4 * ldy, a40, a41);
  if (MR > 5) Store(y + 5 * ldy, a50, a51);
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
  switch (mr) {
    case 1: Block<1>(x, ldx, p, I, y, ldy, ahead); break;
    case 2: Block<2>(x, ldx, p, I, y, ldy, ahead); break;
    case 3: Block<3>(x, ldx, p, I, y, ldy, ahead); break;
    case 4: Block<4>(x, ldx, p, I, y, ldy, ahead); break;
    case 5: Block<5>(x, ldx, p, I, y, ldy, ahead); break;
    default: Block<6>(x, ldx, p, I, y, ldy, ahead); break;
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
  // Row blocks of at most 6, as even as possible (8 rows: 4 + 4, not 6 + 2). The first block
  // of each panel prefetches the panel two ahead (within this range).
  const int64_t blocks = (k.R + 5) / 6;
  for (; p < p1; ++p) {
    const float* pw = k.w + p * k.I * kNR;
    float* yp = k.y + p * kNR;
    int64_t r = 0;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t mr = (k.R - r) / (blocks - b);
      const float* ahead = (b == 0 && p + 2 < p1) ? pw + 2 * k.I * kNR : nullptr;
      Rows(static_cast<int>(mr), k.x + r * k.I, k.I, pw, k.I, yp + r * k.O, k.O, ahead);
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
