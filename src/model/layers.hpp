// Dense layer helpers shared by dt::Gpt and the graph engine (both call the same device kernels,
// so the two give the same bits for the same work).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "dt/device.hpp"

namespace dt {

// The precision of matrix products. f32: the device's fp32 gemm. bf16/f16: both operands rounded
// to the type (into the two 16-bit buffers here) and multiplied by gemm_ex with fp32
// accumulation and an fp32 result, as tensor cores do; activations, norms and gradients stay
// fp32. The buffers grow on demand (reserve() them up front where work is captured into a graph,
// which may not allocate).
struct GemmWorkspace {
  DType compute = DType::f32;
  Device::Buffer a, b;
  // The weights [w32, w32 + wn) in the compute type at w16 (null: none), which their owner keeps
  // equal to the weights' rounding (dt::Trainer: after every optimizer step): an operand inside
  // that range is read from there instead of cast for every product.
  const float* w32 = nullptr;
  const void* w16 = nullptr;
  std::size_t wn = 0;
  std::int64_t copy_reads = 0;  // operands matmul read from w16
  void reserve(const Device& d, std::size_t elements) {
    if (compute == DType::f32) return;
    if (a.bytes() < 2 * elements) a = Device::Buffer(d, 2 * elements);
    if (b.bytes() < 2 * elements) b = Device::Buffer(d, 2 * elements);
  }
  // The 16-bit copy of the n elements at p, or null where they are not all weights.
  const void* weights16(const float* p, std::int64_t n) const {
    if (w16 == nullptr || n < 0) return nullptr;
    const auto at = reinterpret_cast<std::uintptr_t>(p), lo = reinterpret_cast<std::uintptr_t>(w32);
    if (at < lo || (at - lo) / sizeof(float) + static_cast<std::size_t>(n) > wn) return nullptr;
    return static_cast<const std::uint16_t*>(w16) + (at - lo) / sizeof(float);
  }
};

// The n elements at p as an operand of ws's 16-bit compute type: their 16-bit weight copy, or
// rounded into `slot` (on the device's stream, so a slot may be reused by the next product).
inline const void* operand16(const Device& d, GemmWorkspace* ws, Device::Buffer& slot,
                             const float* p, std::int64_t n) {
  if (const void* w = ws->weights16(p, n)) {
    ++ws->copy_reads;
    return w;
  }
  d.call(&dt_hal_v2_t::cast, "cast", slot.get(), hal_dtype(ws->compute),
         static_cast<const void*>(p), DT_HAL_F32, n);
  return slot.get();
}

// C[M, N] = alpha * op(A) @ op(B) + beta * C on 16-bit operands A16 and B16 with fp32 C.
inline void gemm16(const Device& d, const GemmWorkspace* ws, int ta, int tb, std::int64_t M,
                   std::int64_t N, std::int64_t K, float alpha, const void* A16, std::int64_t lda,
                   const void* B16, std::int64_t ldb, float beta, float* C, std::int64_t ldc) {
  d.call(&dt_hal_v2_t::gemm_ex, "gemm_ex", ta, tb, M, N, K, alpha, A16, lda, B16, ldb, beta,
         static_cast<void*>(C), ldc, hal_dtype(ws->compute), DT_HAL_F32);
}

// C[M, N] = alpha * op(A) @ op(B) + beta * C, row-major with packed rows (lda, ldb: row lengths
// of A and B as stored), in ws's precision (null: fp32).
inline void matmul(const Device& d, GemmWorkspace* ws, int ta, int tb, std::int64_t M,
                   std::int64_t N, std::int64_t K, float alpha, const float* A, std::int64_t lda,
                   const float* B, std::int64_t ldb, float beta, float* C, std::int64_t ldc) {
  if (ws == nullptr || ws->compute == DType::f32) {
    d.call(&dt_hal_v1_t::gemm, "gemm", ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  const std::int64_t na = (ta ? K : M) * lda, nb = (tb ? N : K) * ldb;
  ws->reserve(d, static_cast<std::size_t>(std::max(na, nb)));
  const void* a16 = operand16(d, ws, ws->a, A, na);
  const void* b16 = operand16(d, ws, ws->b, B, nb);
  gemm16(d, ws, ta, tb, M, N, K, alpha, a16, lda, b16, ldb, beta, C, ldc);
}

// y[N, out] = x[N, in] @ W[out, in]^T + b (no bias when b is null). In a 16-bit precision, x16
// (when given) is x already rounded to it, and x is not read.
inline void linear_fwd(const Device& d, GemmWorkspace* ws, float* y, const float* x, const float* W,
                       const float* b, std::int64_t N, std::int64_t in, std::int64_t out,
                       const void* x16 = nullptr) {
  if (x16 != nullptr && ws != nullptr && ws->compute != DType::f32) {
    ws->reserve(d, static_cast<std::size_t>(std::max(N * in, out * in)));
    gemm16(d, ws, 0, 1, N, out, in, 1.0f, x16, in, operand16(d, ws, ws->b, W, out * in), in, 0.0f,
           y, out);
  } else {
    matmul(d, ws, 0, 1, N, out, in, 1.0f, x, in, W, in, 0.0f, y, out);
  }
  if (b) d.call(&dt_hal_v1_t::bias_add, "bias_add", y, b, N, out);
}
// dx[N, in] (= or +=, by beta; none when dx is null) dy @ W; dW += dy^T @ x; db += sum dy. In a
// 16-bit precision dy is rounded once for both products, and x16 (when given) is x already
// rounded (x is then not read).
inline void linear_bwd(const Device& d, GemmWorkspace* ws, float* dx, float beta, float* dW,
                       float* db, const float* dy, const float* x, const float* W, std::int64_t N,
                       std::int64_t in, std::int64_t out, const void* x16 = nullptr) {
  if (ws == nullptr || ws->compute == DType::f32) {
    if (dx) matmul(d, ws, 0, 0, N, in, out, 1.0f, dy, out, W, in, beta, dx, in);
    matmul(d, ws, 1, 0, out, in, N, 1.0f, dy, out, x, in, 1.0f, dW, in);
  } else {
    ws->reserve(d, static_cast<std::size_t>(std::max({N * out, N * in, out * in})));
    const void* dy16 = operand16(d, ws, ws->a, dy, N * out);
    if (dx)
      gemm16(d, ws, 0, 0, N, in, out, 1.0f, dy16, out, operand16(d, ws, ws->b, W, out * in), in,
             beta, dx, in);
    if (x16 == nullptr) x16 = operand16(d, ws, ws->b, x, N * in);
    gemm16(d, ws, 1, 0, out, in, N, 1.0f, dy16, out, x16, in, 1.0f, dW, in);
  }
  if (db) d.call(&dt_hal_v1_t::bias_grad, "bias_grad", db, dy, N, out);
}

// model.pad-vocab: the head's products over Vp > V columns, which a GPU's fast matrix kernels
// want (GPT-2's 50257 -> 50304). The embedding [V, C] is copied, or in a 16-bit compute type
// rounded, into the first V rows of a [Vp, C] buffer whose last rows stay zero; a bias gives the
// padding's logits -inf, so they get probability 0 and gradient 0; the weights' gradient is the
// product over the first V columns of the logits' gradient, added into the embedding's. Shared by
// dt::Gpt and the stage engine.
struct PaddedHead {
  std::int64_t V = 0, Vp = 0, C = 0;
  Device::Buffer w, bias;  // w: fp32, or the compute type after set_compute
  DType type = DType::f32;
  bool on() const noexcept { return Vp > V; }
  void init(const Device& d, std::int64_t v, std::int64_t vp, std::int64_t c) {
    V = v;
    Vp = vp;
    C = c;
    if (!on()) return;
    std::vector<float> b(static_cast<std::size_t>(Vp), 0.0f);
    std::fill(b.begin() + V, b.end(), -std::numeric_limits<float>::infinity());
    bias = Device::Buffer(d, b.size() * sizeof(float));
    d.call(&dt_hal_v1_t::copy, "copy", bias.get(), static_cast<const void*>(b.data()),
           b.size() * sizeof(float), DT_HAL_HOST_TO_DEVICE);
    set_compute(d, DType::f32);
  }
  void set_compute(const Device& d, DType t) {
    if (!on()) return;
    type = t;
    const std::size_t n = static_cast<std::size_t>(Vp * C) * (t == DType::f32 ? 4 : 2);
    w = Device::Buffer();
    w = Device::Buffer(d, n);
    d.call(&dt_hal_v1_t::fill_zero, "fill_zero", w.get(), n);
  }
  std::size_t bytes() const noexcept { return w.bytes() + bias.bytes(); }
  // logits[BT, Vp] = x[BT, C] @ w^T + bias, w from the embedding's current values; x16: x rounded
  // to ws's 16-bit type already (or null).
  void forward(const Device& d, GemmWorkspace* ws, float* logits, const float* x, const void* x16,
               const float* wte, std::int64_t BT) {
    if (type != DType::f32) {
      d.call(&dt_hal_v2_t::cast, "cast", w.get(), hal_dtype(type), static_cast<const void*>(wte),
             DT_HAL_F32, V * C);
      ws->reserve(d, static_cast<std::size_t>(BT * C));
      if (x16 == nullptr) x16 = operand16(d, ws, ws->a, x, BT * C);
      gemm16(d, ws, 0, 1, BT, Vp, C, 1.0f, x16, C, w.get(), C, 0.0f, logits, Vp);
    } else {
      d.call(&dt_hal_v1_t::copy, "copy", w.get(), static_cast<const void*>(wte),
             static_cast<std::size_t>(V * C) * sizeof(float), DT_HAL_DEVICE_TO_DEVICE);
      matmul(d, ws, 0, 1, BT, Vp, C, 1.0f, x, C, w.as<float>(), C, 0.0f, logits, Vp);
    }
    d.call(&dt_hal_v1_t::bias_add, "bias_add", logits, bias.as<const float>(), BT, Vp);
  }
  // dx[BT, C] (= or +=, by beta) dlogits @ w, with w as the forward left it; dwte[V, C] += the
  // first V columns of dlogits, transposed, @ x (the padding's gradient is 0).
  void backward(const Device& d, GemmWorkspace* ws, float* dx, float beta, float* dwte,
                const float* dlogits, const float* x, const void* x16, std::int64_t BT) {
    if (type != DType::f32) {
      ws->reserve(d, static_cast<std::size_t>(std::max(BT * Vp, BT * C)));
      const void* dl16 = operand16(d, ws, ws->a, dlogits, BT * Vp);
      gemm16(d, ws, 0, 0, BT, C, Vp, 1.0f, dl16, Vp, w.get(), C, beta, dx, C);
      if (x16 == nullptr) x16 = operand16(d, ws, ws->b, x, BT * C);
      gemm16(d, ws, 1, 0, V, C, BT, 1.0f, dl16, Vp, x16, C, 1.0f, dwte, C);
    } else {
      matmul(d, ws, 0, 0, BT, C, Vp, 1.0f, dlogits, Vp, w.as<float>(), C, beta, dx, C);
      matmul(d, ws, 1, 0, V, C, BT, 1.0f, dlogits, Vp, x, C, 1.0f, dwte, C);
    }
  }
};

// Whether attention on `d` keeps one log-sum-exp per row (model.attention=flash, `wanted`, on a
// device with ABI version 4's flash_attention entries).
inline bool flash_attention(const Device& d, bool wanted) {
  return wanted && d.table4().flash_attention_fwd != nullptr;
}
// Floats of attention's state between forward and backward, and of the backward's scratch: B NH T
// with flash, else B NH T T (the probabilities and their gradient).
inline std::size_t attention_state_floats(bool flash, std::size_t B, std::size_t NH,
                                          std::size_t T) {
  return B * NH * T * (flash ? 1 : T);
}
// Causal self-attention (the layout of the version-1 entries) with its matrix products in ws's
// precision (null: fp32). With `flash` (flash_attention() true), the state the backward needs is
// one log-sum-exp per query row (flash_attention_*); otherwise the probabilities, from the
// version-3 attention_*_ex or, on a device without them (an older plugin), from the version-1
// entries, all in fp32.
inline void attention_forward(const Device& d, const GemmWorkspace* ws, bool flash, float* out,
                              float* state, const float* qkv, std::int64_t B, std::int64_t T,
                              std::int64_t C, std::int64_t NH) {
  const DType t = ws != nullptr ? ws->compute : DType::f32;
  if (flash) {
    d.call(&dt_hal_v4_t::flash_attention_fwd, "flash_attention_fwd", out, state, qkv, B, T, C, NH,
           hal_dtype(t));
  } else if (t != DType::f32 && d.table3().attention_fwd_ex != nullptr) {
    d.call(&dt_hal_v3_t::attention_fwd_ex, "attention_fwd_ex", out, state, qkv, B, T, C, NH,
           hal_dtype(t));
  } else {
    d.call(&dt_hal_v1_t::attention_fwd, "attention_fwd", out, state, qkv, B, T, C, NH);
  }
}
// dqkv += the gradient of attention_forward (scratch: attention_state_floats, overwritten). out is
// the forward's output as the caller keeps it, in out_type (f32, or ws's 16-bit type); only flash
// reads it, in ws's type (an fp32 out is rounded into ws->a first, so that both engines give the
// same bits).
inline void attention_backward(const Device& d, GemmWorkspace* ws, bool flash, float* dqkv,
                               float* scratch, const float* dout, const float* qkv, const void* out,
                               DType out_type, const float* state, std::int64_t B, std::int64_t T,
                               std::int64_t C, std::int64_t NH) {
  const DType t = ws != nullptr ? ws->compute : DType::f32;
  if (flash) {
    if (t != DType::f32 && out_type == DType::f32) {
      ws->reserve(d, static_cast<std::size_t>(B * T * C));
      out = operand16(d, ws, ws->a, static_cast<const float*>(out), B * T * C);
      out_type = t;
    }
    d.call(&dt_hal_v4_t::flash_attention_bwd, "flash_attention_bwd", dqkv, scratch, dout, qkv, out,
           hal_dtype(out_type), state, B, T, C, NH, hal_dtype(t));
  } else if (t != DType::f32 && d.table3().attention_bwd_ex != nullptr) {
    d.call(&dt_hal_v3_t::attention_bwd_ex, "attention_bwd_ex", dqkv, scratch, dout, qkv, state, B,
           T, C, NH, hal_dtype(t));
  } else {
    d.call(&dt_hal_v1_t::attention_bwd, "attention_bwd", dqkv, scratch, dout, qkv, state, B, T, C,
           NH);
  }
}

}  // namespace dt
