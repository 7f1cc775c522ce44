// Float64 references for causal attention with 16-bit products (plugin ABI version 3,
// attention_fwd_ex / attention_bwd_ex, and version 4, flash_attention_*), shared by the CPU
// device's unit test and the GPU test.
//
// Each reference is built from the operands the kernel must have used: qkv and dout rounded to the
// 16-bit type by the caller, and the kernel's own probabilities (att) and softmax gradient
// (scratch) rounded by the caller. What is then left is fp32 accumulation, and the tolerances are
// the first-order bound of a float sum of n terms, n u sum|terms|, doubled for second-order terms,
// plus u of a value accumulated onto. Layouts are those of the version-1 entries: qkv is B x T x 3C
// (q, k, v), att and scratch B x NH x T x T, out and dout B x T x C, heads of C / NH columns.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace dt_test {

struct AttnShape {
  std::int64_t B, T, C, NH;
};

constexpr double kAttnU = 0x1p-24;

// An ulp of a binary format with `prec` significand bits (the implicit one included) and smallest
// normal exponent `emin`, at magnitude |x| (at least the smallest normal's).
inline double format_ulp(double x, int prec, int emin) {
  int e = 0;
  std::frexp(std::max(std::fabs(x), std::ldexp(1.0, emin)), &e);
  return std::ldexp(1.0, e - prec);
}

// out = rounded att times rounded v. q16: rounded qkv; a16: rounded att.
inline void attn16_out_ref(const AttnShape& s, const std::vector<float>& q16,
                           const std::vector<float>& a16, std::vector<double>& ref,
                           std::vector<double>& tol) {
  const std::int64_t B = s.B, T = s.T, C = s.C, NH = s.NH, hs = C / NH, C3 = 3 * C;
  ref.assign(static_cast<std::size_t>(B * T * C), 0.0);
  tol.assign(ref.size(), 0.0);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < NH; ++h)
      for (std::int64_t t = 0; t < T; ++t)
        for (std::int64_t i = 0; i < hs; ++i) {
          double sum = 0, mag = 0;
          for (std::int64_t j = 0; j <= t; ++j) {
            const double term = double(a16[((b * NH + h) * T + t) * T + j]) *
                                q16[(b * T + j) * C3 + 2 * C + h * hs + i];
            sum += term;
            mag += std::fabs(term);
          }
          const std::int64_t o = (b * T + t) * C + h * hs + i;
          ref[o] = sum;
          tol[o] = 2 * (T + 3) * kAttnU * mag + kAttnU * std::fabs(sum);
        }
}

// The softmax gradient S' = scale att (S - rowsum(att S)), S = rounded dout times rounded v^T,
// from the fp32 att, exactly (ref), and the bound e32 on the fp32 value a kernel computes before
// rounding it. o16: rounded dout.
inline void attn16_sgrad_ref(const AttnShape& s, const std::vector<float>& q16,
                             const std::vector<float>& o16, const std::vector<float>& att,
                             std::vector<double>& ref, std::vector<double>& e32) {
  const std::int64_t B = s.B, T = s.T, C = s.C, NH = s.NH, hs = C / NH, C3 = 3 * C;
  const double scale = 1.0 / std::sqrt(double(hs)), u = kAttnU;
  ref.assign(static_cast<std::size_t>(B * NH * T * T), 0.0);
  e32.assign(ref.size(), 0.0);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < NH; ++h)
      for (std::int64_t t = 0; t < T; ++t) {
        std::vector<double> sv(static_cast<std::size_t>(t + 1), 0.0), smag(sv.size(), 0.0);
        double rho = 0, rmag = 0;
        for (std::int64_t j = 0; j <= t; ++j) {
          for (std::int64_t i = 0; i < hs; ++i) {
            const double term = double(o16[(b * T + t) * C + h * hs + i]) *
                                q16[(b * T + j) * C3 + 2 * C + h * hs + i];
            sv[j] += term;
            smag[j] += std::fabs(term);
          }
          const double p = att[((b * NH + h) * T + t) * T + j];
          rho += p * sv[j];
          rmag += p * (std::fabs(sv[j]) + (hs + 1) * u * smag[j]);
        }
        for (std::int64_t j = 0; j <= t; ++j) {
          const std::int64_t k = ((b * NH + h) * T + t) * T + j;
          const double p = att[k];
          ref[k] = scale * p * (sv[j] - rho);
          e32[k] = scale * p *
                   ((hs + 1) * u * smag[j] + (t + 3) * u * rmag +
                    3 * u * (std::fabs(sv[j]) + std::fabs(rho)));
        }
      }
}

// dqkv = dqkv0 + (S' k, S'^T q, rounded att^T rounded dout), per head. s16: the rounded softmax
// gradient the kernel used.
inline void attn16_dqkv_ref(const AttnShape& s, const std::vector<float>& q16,
                            const std::vector<float>& o16, const std::vector<float>& a16,
                            const std::vector<float>& s16, const std::vector<float>& dqkv0,
                            std::vector<double>& ref, std::vector<double>& tol) {
  const std::int64_t B = s.B, T = s.T, C = s.C, NH = s.NH, hs = C / NH, C3 = 3 * C;
  ref.assign(dqkv0.size(), 0.0);
  tol.assign(dqkv0.size(), 0.0);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < NH; ++h)
      for (std::int64_t t = 0; t < T; ++t)
        for (std::int64_t i = 0; i < hs; ++i) {
          double sums[3] = {0, 0, 0}, mags[3] = {0, 0, 0};
          for (std::int64_t j = 0; j < T; ++j) {
            // dq_t: keys j <= t (row t of S'); dk_t and dv_t: queries j >= t (column t).
            const double terms[3] = {
                double(s16[((b * NH + h) * T + t) * T + j]) *
                    q16[(b * T + j) * C3 + C + h * hs + i],
                double(s16[((b * NH + h) * T + j) * T + t]) * q16[(b * T + j) * C3 + h * hs + i],
                double(a16[((b * NH + h) * T + j) * T + t]) * o16[(b * T + j) * C + h * hs + i]};
            for (int p = 0; p < 3; ++p) {
              sums[p] += terms[p];
              mags[p] += std::fabs(terms[p]);
            }
          }
          for (int p = 0; p < 3; ++p) {
            const std::int64_t k = (b * T + t) * C3 + p * C + h * hs + i;
            const double v = dqkv0[k] + sums[p];
            ref[k] = v;
            tol[k] =
                2 * ((T + 2) * kAttnU * mags[p] + kAttnU * (std::fabs(dqkv0[k]) + std::fabs(v)));
          }
        }
}

// Float64 reference of flash attention (plugin ABI version 4, flash_attention_fwd / _bwd) on the
// operands a kernel takes: q, k, v (qkv rounded to the products' type by the caller, q16) and
// dout rounded (o16), with D = rowsum(dout * out) from the fp32 dout and the output as passed
// (ow, widened). The bounds are first order: every fp32 sum of n terms within (n + 2) u
// sum|terms|; the log-sum-exp within (hs + 8) u (|lse| + max|score| + 1); each probability within
// that (relative) plus its score's error, 8 u for the exponential and, in a 16-bit type, its
// rounding uh; D within its own sum's error or that of rowsum(P dP), the same value by another
// route (a device may take either); the softmax gradient within what its inputs' errors give plus
// its rounding; out and the gradients within the sum of their terms' errors plus fp32
// accumulation, all doubled for second-order terms.
struct FlashRef {
  std::vector<double> out, out_tol, lse, lse_tol, dqkv, dqkv_tol;
};
inline FlashRef flash_ref(const AttnShape& s, const std::vector<float>& q16,
                          const std::vector<float>& dout, const std::vector<float>& o16,
                          const std::vector<float>& ow, const std::vector<float>& dqkv0,
                          double uh) {
  const std::int64_t B = s.B, T = s.T, C = s.C, NH = s.NH, hs = C / NH, C3 = 3 * C;
  const double scale = 1.0 / std::sqrt(double(hs)), u = kAttnU;
  FlashRef r;
  r.out.assign(static_cast<std::size_t>(B * T * C), 0.0);
  r.out_tol = r.out;
  r.lse.assign(static_cast<std::size_t>(B * NH * T), 0.0);
  r.lse_tol = r.lse;
  r.dqkv.assign(dqkv0.begin(), dqkv0.end());
  std::vector<double> mag(r.dqkv.size(), 0.0), err(r.dqkv.size(), 0.0);
  auto Q = [&](std::int64_t b, std::int64_t t, int part, std::int64_t i) {
    return double(q16[static_cast<std::size_t>((b * T + t) * C3 + part * C + i)]);
  };
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < NH; ++h) {
      const std::int64_t c0 = h * hs;
      for (std::int64_t t = 0; t < T; ++t) {
        const std::size_t n = static_cast<std::size_t>(t + 1);
        std::vector<double> sc(n), scm(n), P(n), eP(n), dP(n), edP(n), dPm(n);
        double m = -INFINITY, smax = 0;
        for (std::int64_t j = 0; j <= t; ++j) {
          double v = 0, a = 0;
          for (std::int64_t i = 0; i < hs; ++i) {
            v += Q(b, t, 0, c0 + i) * Q(b, j, 1, c0 + i);
            a += std::fabs(Q(b, t, 0, c0 + i) * Q(b, j, 1, c0 + i));
          }
          sc[j] = scale * v;
          scm[j] = scale * a;
          m = std::max(m, sc[j]);
          smax = std::max(smax, std::fabs(sc[j]));
        }
        double sum = 0;
        for (std::int64_t j = 0; j <= t; ++j) sum += std::exp(sc[j] - m);
        const double lse = m + std::log(sum);
        const std::size_t li = static_cast<std::size_t>((b * NH + h) * T + t);
        r.lse[li] = lse;
        r.lse_tol[li] = (hs + 8) * u * (std::fabs(lse) + smax + 1);
        for (std::int64_t j = 0; j <= t; ++j) {
          P[j] = std::exp(sc[j] - lse);
          eP[j] = (hs + 2) * u * scm[j] + 2 * r.lse_tol[li] + 8 * u;  // relative, unrounded
          double v = 0, a = 0;
          for (std::int64_t i = 0; i < hs; ++i) {
            const double term = double(o16[static_cast<std::size_t>((b * T + t) * C + c0 + i)]) *
                                Q(b, j, 2, c0 + i);
            v += term;
            a += std::fabs(term);
          }
          dP[j] = v;
          dPm[j] = a;
          edP[j] = (hs + 2) * u * a;
        }
        double D = 0, eD = 0, pdp = 0;
        for (std::int64_t i = 0; i < hs; ++i) {
          const std::size_t o = static_cast<std::size_t>((b * T + t) * C + c0 + i);
          D += double(dout[o]) * ow[o];
          eD += std::fabs(double(dout[o]) * ow[o]);
        }
        for (std::int64_t j = 0; j <= t; ++j) pdp += P[j] * (dPm[j] + std::fabs(dP[j]));
        eD = (hs + 2) * u * eD + (T + hs + 4) * (uh + u) * pdp;
        for (std::int64_t i = 0; i < hs; ++i) {
          double o = 0, om = 0, oe = 0;
          for (std::int64_t j = 0; j <= t; ++j) {
            const double term = P[j] * Q(b, j, 2, c0 + i);
            o += term;
            om += std::fabs(term);
            oe += (eP[j] + uh) * std::fabs(term);
          }
          const std::size_t k = static_cast<std::size_t>((b * T + t) * C + c0 + i);
          r.out[k] = o;
          r.out_tol[k] = 2 * (oe + (T + 4) * u * om + u * std::fabs(o));
        }
        for (std::int64_t j = 0; j <= t; ++j) {
          const double dS = scale * P[j] * (dP[j] - D);
          const double edS = scale * (eP[j] * P[j] * std::fabs(dP[j] - D) + P[j] * (edP[j] + eD)) +
                             (uh + 4 * u) * std::fabs(dS);
          const double ePr = (eP[j] + uh) * P[j];  // P as the product dv takes it
          for (std::int64_t i = 0; i < hs; ++i) {
            const std::size_t iq = static_cast<std::size_t>((b * T + t) * C3 + c0 + i);
            const std::size_t ik = static_cast<std::size_t>((b * T + j) * C3 + C + c0 + i);
            const std::size_t iv = ik + static_cast<std::size_t>(C);
            const double kj = Q(b, j, 1, c0 + i), qt = Q(b, t, 0, c0 + i);
            const double dot = o16[static_cast<std::size_t>((b * T + t) * C + c0 + i)];
            r.dqkv[iq] += dS * kj;
            mag[iq] += std::fabs(dS * kj);
            err[iq] += edS * std::fabs(kj);
            r.dqkv[ik] += dS * qt;
            mag[ik] += std::fabs(dS * qt);
            err[ik] += edS * std::fabs(qt);
            r.dqkv[iv] += P[j] * dot;
            mag[iv] += std::fabs(P[j] * dot);
            err[iv] += ePr * std::fabs(dot);
          }
        }
      }
    }
  r.dqkv_tol.resize(r.dqkv.size());
  for (std::size_t k = 0; k < r.dqkv.size(); ++k)
    r.dqkv_tol[k] = 2 * (err[k] + (T + 2) * u * mag[k] + u * std::fabs(r.dqkv[k]));
  return r;
}

}  // namespace dt_test
