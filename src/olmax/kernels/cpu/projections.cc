// olmax's CPU kernels for the elementwise work around the products (``olmax.kernels.cpu``):
// SwiGLU forward and backward (``swiglu``), the attention's q, k and v from its projection with
// the q/k RMSNorm and RoPE, forward and backward (``qkv``), and, for a training forward that must
// give a token the decode steps' bits, RMSNorm and row sums in one fixed order (``rms_norm``,
// ``row_sums``).

#include "common.h"

namespace {

using namespace olmax;  // the shared helpers (common.h)

// Sum of each row of x [R, D] -> [R], in eight lanes over i in order, then the lanes in a fixed
// tree (as ``Dot``): the same bits for a row in any batch (``olmax.model.dispatch.log_softmax``
// while reproducing the decode steps' bits).
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
// the decode steps and RL's training forward compute it here (``olmax.model.dispatch.rms_norm``).
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

// SwiGLU on the CPU (``olmax.kernels.cpu.swiglu``): y = silu(g) u of each row of gu = [g | u]
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

// The attention's inputs from its projection on the CPU (``olmax.kernels.cpu.qkv``): each row n
// of x = [q | k | v] [N, (H + 2 KV) E] gives q and k RMSNormed over their whole width (H E and KV
// E), times their weights, then rotated per head (RoPE, rotate-half layout, with row n mod T of the
// tables cos/sin [T, E]: one table for every sequence, or one row per row), and v as it is; the
// backward gives dx = [dq | dk | dv] in one buffer and the weights' gradients as sums over chunks
// of ``chunk`` rows (summed by XLA after). Per row one pass over the data, where XLA made five to
// seven (the split, the norm's sum, the normalised copy kept for the backward, RoPE, the
// concatenation of the gradients). Every row is computed alone in one order, and each chunk's sums
// over its rows in order: the same bits for a row in any batch, and for the weights' gradient at
// any thread count.

// Elements of a buffer, signed as the shapes' arithmetic (``element_count`` is a size_t).
template <typename Buffer>
int64_t Count(const Buffer& b) {
  return static_cast<int64_t>(b.element_count());
}

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
      !QkvCheck(a, cd[0], cd[1]) || Count(wq) != a.H * a.E || Count(wk) != a.KV * a.E ||
      Count(*q) != a.N * a.H * a.E || Count(*k) != a.N * a.KV * a.E ||
      Count(*v) != a.N * a.KV * a.E || Count(*r) != 2 * a.N) {
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
      !QkvCheck(a, cd[0], cd[1]) || chunk < 1 || a.N % chunk != 0 || Count(wq) != a.H * a.E ||
      Count(wk) != a.KV * a.E || Count(r) != 2 * a.N || Count(dq) != a.N * a.H * a.E ||
      Count(dk) != a.N * a.KV * a.E || Count(dv) != a.N * a.KV * a.E ||
      Count(*dx) != a.N * a.D || Count(*dwq) != a.N / chunk * a.H * a.E ||
      Count(*dwk) != a.N / chunk * a.KV * a.E) {
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
