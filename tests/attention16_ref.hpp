// Float64 references for causal attention with 16-bit products (plugin ABI version 3,
// attention_fwd_ex / attention_bwd_ex), shared by the CPU device's unit test and the GPU test.
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

}  // namespace dt_test
