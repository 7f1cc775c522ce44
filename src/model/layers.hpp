// Dense layer helpers shared by dt::Gpt and the graph engine (both call the same device kernels,
// so the two give the same bits for the same work).
#pragma once

#include <cstdint>

#include "dt/device.hpp"

namespace dt {
// y[N, out] = x[N, in] @ W[out, in]^T + b (no bias when b is null)
inline void linear_fwd(const Device& d, float* y, const float* x, const float* W, const float* b,
                       std::int64_t N, std::int64_t in, std::int64_t out) {
  d.call(&dt_hal_v1_t::gemm, "gemm", 0, 1, N, out, in, 1.0f, x, in, W, in, 0.0f, y, out);
  if (b) d.call(&dt_hal_v1_t::bias_add, "bias_add", y, b, N, out);
}
// dx[N, in] (= or +=, by beta) dy @ W; dW += dy^T @ x; db += sum dy
inline void linear_bwd(const Device& d, float* dx, float beta, float* dW, float* db,
                       const float* dy, const float* x, const float* W, std::int64_t N,
                       std::int64_t in, std::int64_t out) {
  if (dx) d.call(&dt_hal_v1_t::gemm, "gemm", 0, 0, N, in, out, 1.0f, dy, out, W, in, beta, dx, in);
  d.call(&dt_hal_v1_t::gemm, "gemm", 1, 0, out, in, N, 1.0f, dy, out, x, in, 1.0f, dW, in);
  if (db) d.call(&dt_hal_v1_t::bias_grad, "bias_grad", db, dy, N, out);
}

}  // namespace dt
