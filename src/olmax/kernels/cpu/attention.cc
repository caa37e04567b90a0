// olmax's CPU attention kernels over whole sequences (``olmax.kernels.cpu``): the training
// attention, forward and backward (``FlashForward``, ``FlashBackward``; ``flash_attention``), and
// the decode step's attention repeated over whole sequences (``SequenceAttention``;
// ``sequence_attention``), for a training forward that must give a token the decode steps' bits.

#include "common.h"

namespace {

using namespace olmax;  // the shared helpers (common.h)

// Training attention on the CPU (``olmax.kernels.cpu.flash_attention``): causal
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

// Causal self-attention of whole sequences with the decode step's arithmetic, for the training
// forward whose log-probs must equal the sampler's bit for bit (RL; ``olmax.kernels.cpu.
// sequence_attention``). q [B, T, H, E], keys and values [B, T, KV, E] (H = KV x G, head h = kv x
// G + g, as the decode step groups them) -> out like q. Query t sees positions t - W < p <= t (W =
// ``window``, 0: every p <= t), taken in the order the decode cache holds them: by position on a
// full layer (slot = position), by position mod W on a sliding one (its ring of min(W, length)
// slots; below W positions the two orders agree). Each query is then ``Query`` as in
// ``CacheAttention``: the same products, exponentials and sums in the same order. ``starts`` [B, T]
// (int32): the row position where query t's document begins (0 for one sequence per row; packed
// documents, RL's packed rows): the query sees only its document, whose positions count from its
// start, so a document gives the bits it gives alone in a row of its own (and its decode steps).
ffi::Error SequenceAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                             ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> starts, ffi::ResultBuffer<ffi::F32> out,
                             float scale, int64_t window) {
  const std::vector<int64_t> qd(q.dimensions().begin(), q.dimensions().end());
  const std::vector<int64_t> kd(k.dimensions().begin(), k.dimensions().end());
  const std::vector<int64_t> vd(v.dimensions().begin(), v.dimensions().end());
  const std::vector<int64_t> od(out->dimensions().begin(), out->dimensions().end());
  const std::vector<int64_t> sd(starts.dimensions().begin(), starts.dimensions().end());
  if (qd.size() != 4 || kd.size() != 4 || vd != kd || od != qd || kd[0] != qd[0] ||
      kd[1] != qd[1] || kd[3] != qd[3] || kd[2] == 0 || qd[2] % kd[2] != 0 || window < 0 || sd.size() != 2 ||
      sd[0] != qd[0] || sd[1] != qd[1]) {
    return ffi::Error::InvalidArgument(
        "olmax_sequence_attention: expected q [B, T, H, E], k and v [B, T, KV, E] with H a multiple of KV, out like q, "
        "starts [B, T], window >= 0");
  }
  const int64_t B = qd[0], T = qd[1], H = qd[2], E = qd[3], KV = kd[2], G = H / KV;
  if (B * T * H * E == 0) return ffi::Error::Success();
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  const int32_t* sp = starts.typed_data();
  float* op = out->typed_data();
  const MixFn mix = MixFor(E);
  constexpr int64_t kQueries = 16;  // per piece of work, of one row and kv head
  const int64_t blocks = (T + kQueries - 1) / kQueries;
  Parallel(pool, B * KV * blocks, [=](int64_t item) {
    const int64_t b = item / (KV * blocks), kv = item / blocks % KV, t0 = item % blocks * kQueries;
    const float* keys = kp + (b * T * KV + kv) * E;  // position p at keys + p * KV * E
    const float* values = vp + (b * T * KV + kv) * E;
    thread_local std::vector<int32_t> slots;
    thread_local std::vector<float> p;
    for (int64_t t = t0; t < std::min(T, t0 + kQueries); ++t) {
      // Positions in the query's document: d = t - s0 (a start out of [0, t] counts as 0).
      const int64_t s0 = std::clamp<int64_t>(sp[b * T + t], 0, t), d = t - s0;
      const int64_t lo = window ? std::max<int64_t>(0, d - window + 1) : 0;
      // The decode ring's order: from the first position whose slot is 0 (a multiple of W) to d,
      // then from lo to just before it.
      const int64_t wrap = window ? std::min(d + 1, (lo + window - 1) / window * window) : lo;
      slots.clear();
      for (int64_t s = wrap; s <= d; ++s) slots.push_back(static_cast<int32_t>(s0 + s));
      for (int64_t s = lo; s < wrap; ++s) slots.push_back(static_cast<int32_t>(s0 + s));
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

}  // namespace

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

XLA_FFI_DEFINE_HANDLER_SYMBOL(OlmaxSequenceAttention, SequenceAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window"));
