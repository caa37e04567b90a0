// What olmax's CPU kernels share (``olmax.kernels.cpu``): the vector width of a panel, the row
// block, the work sharing over XLA's intra-op thread pool, and the fixed-order arithmetic that
// makes a row's result independent of the batch it is in: the dot product and lane sums, one
// query's attention over listed keys (the decode step's, ``decode.cc``, and its repetition over
// whole sequences, ``attention.cc``), and the vectorised exponential.
//
// Every kernel computes each output element in one fixed order of operations, whatever the number
// of rows, the block it falls in, or the thread that runs it (tests/test_cpu_kernels.py and the
// other kernel tests check this bit for bit). Built with AVX2 and FMA (and AVX-512VL where the CPU
// has it: 32 registers for the same 256-bit instructions), ``olmax/kernels/cpu/build.py``.

#ifndef OLMAX_KERNELS_CPU_COMMON_H_
#define OLMAX_KERNELS_CPU_COMMON_H_

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

namespace olmax {

// Output columns per panel of a packed weight, and per tile of a product: two vectors of eight.
constexpr int64_t kNR = 16;

inline void Store(float* y, __m256 a, __m256 b) {
  _mm256_storeu_ps(y, a);
  _mm256_storeu_ps(y + 8, b);
}

// Rows per block: six with AVX2's 16 vector registers (12 accumulators, two weight vectors and a
// broadcast); twelve where the build has AVX-512VL (``build.py`` turns it on where the CPU has
// it), whose EVEX encoding gives the same 256-bit instructions 32 registers. A batch of 8 then
// reads each panel once, in one block of 16 independent chains, instead of twice in two blocks of
// 8 (a chain per FMA latency and pipe: no slack).
#if defined(__AVX512VL__)
constexpr int kMaxRows = 12;
#else
constexpr int kMaxRows = 6;
#endif

// X(r) for every row of a block, up to the largest kMaxRows: the products' named accumulators
// (with an array GCC kept them on the stack and stored every one on every step of i, a third of
// the speed).
#define OLMAX_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

// The work of one call, split into ``chunks`` pieces that the calling thread and XLA's intra-op
// pool take in turn from an atomic counter. Helpers that start late find no chunk left and touch
// nothing (they hold this state alive, not the buffers).
struct Shared {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t chunks = 0;
  std::function<void(int64_t)> run;
};

inline void Drain(Shared& s) {
  for (int64_t c; (c = s.next.fetch_add(1, std::memory_order_relaxed)) < s.chunks;) {
    s.run(c);
    s.done.fetch_add(1, std::memory_order_release);
  }
}

inline int64_t Threads(ffi::ThreadPool& pool) {
  return std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), 64));
}

inline void Parallel(ffi::ThreadPool& pool, int64_t chunks, std::function<void(int64_t)> run) {
  auto s = std::make_shared<Shared>();
  s->chunks = chunks;
  s->run = std::move(run);
  for (int64_t t = 1; t < Threads(pool) && t < chunks; ++t) pool.Schedule([s] { Drain(*s); });
  Drain(*s);
  // Chunks other threads claimed are being computed now: wait for them, never for a queue.
  while (s->done.load(std::memory_order_acquire) < chunks) _mm_pause();
}

// a . b over n floats: eight lanes of multiply-adds over i in order, the lanes summed in a fixed
// tree, then the last n % 8 in order.
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

// The eight lanes of a summed in ``Dot``'s fixed tree.
inline float Lanes(__m256 a) {
  alignas(32) float l[8];
  _mm256_store_ps(l, a);
  return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
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

using MixFn = void (*)(const float*, int64_t, int64_t, const int32_t*, int64_t, const float*, float*);

// ``Mix`` for heads of E floats: in registers for heads of 64 and 128.
inline MixFn MixFor(int64_t E) { return E == 64 ? Mix<8> : E == 128 ? Mix<16> : Mix<0>; }

// One query's attention over the listed slots (key and value of slot s at keys / values + s * ld,
// E wide): scores q . k x scale, their maximum, exp(score - max) summed in slot order, the weights
// divided by the sum, and ``mix``. ``none``: the query sees nothing, and weighs every listed slot
// alike (every score the lowest float), as XLA's ``cache_attention`` does. ``p``: n floats of room.
// The decode step's arithmetic (``CacheAttention``) and its repetition over whole sequences
// (``SequenceAttention``): the same products, exponentials and sums in the same order.
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

}  // namespace olmax

#endif  // OLMAX_KERNELS_CPU_COMMON_H_
