// dt::Gpt: a GPT-2-style decoder (nanoGPT semantics and parameter names) running on a dt::Device.
//
// Token + position embeddings, pre-LayerNorm blocks with causal multi-head self-attention and a
// GELU (tanh) MLP of width 4C, a final LayerNorm, and an LM head tied to the token embedding.
// Parameters live in one flat buffer in nanoGPT's named_parameters() order, gradients in a second
// buffer of the same layout, so a whole-model all_reduce is one call. Linear weights are
// [out, in] as in PyTorch.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dt/device.hpp"
#include "dt/tensor.hpp"

namespace dt {

struct GemmWorkspace;  // src/model/layers.hpp
struct PaddedHead;     // src/model/layers.hpp

struct GptConfig {
  int vocab = 256;
  int block = 128;  ///< maximum sequence length (positions)
  int layers = 4;
  int heads = 4;
  int embd = 256;
  /// The head's products and the loss run over the vocabulary rounded up to a multiple of this
  /// (0 or 1: none), as llm.c pads 50257 to 50304: a GPU's fast matrix kernels want dimensions
  /// of 16-byte multiples. The parameters keep `vocab` rows; the padding columns' logits are
  /// -inf (probability 0, gradient 0).
  int pad_vocab = 0;
  /// Attention keeps one log-sum-exp per query row (B NH T floats a layer) instead of its
  /// probabilities (B NH T T), and the backward recomputes them (model.attention=flash), on a
  /// device with the flash_attention entries (ABI version 4); elsewhere it keeps the
  /// probabilities (model.attention=full).
  bool flash_attention = true;
};

/// The head's vocabulary: c.vocab rounded up to a multiple of c.pad_vocab (c.vocab when
/// pad_vocab is 0 or 1); InvalidArgument when pad_vocab is negative.
std::int64_t padded_vocab(const GptConfig& c);

/// The settings that make a checkpoint one model's, named as dt_train's options are
/// ("model.vocab", "model.seq-len", "model.layers", "model.heads", "model.embd"), with `c`'s
/// values: what a checkpoint records and a resume compares (the head count splits the same
/// weights another way, so the tensors' shapes alone cannot tell).
std::vector<std::pair<std::string, std::int64_t>> model_settings(const GptConfig& c);

/// One named parameter tensor inside the flat buffer.
struct ParamInfo {
  std::string name;  ///< "transformer.h.0.attn.c_attn.weight"
  Shape shape;
  std::size_t offset = 0;  ///< elements from the start of the flat buffer
  std::size_t numel = 0;
  bool decay = false;  ///< weight decay applies (matrices and embeddings, not biases or norms)
};

/// The parameter table of a configuration, in nanoGPT order.
std::vector<ParamInfo> gpt_params(const GptConfig& c);
/// Writes parameter `index` of gpt_params(c) (numel floats, host memory) as Gpt::init(seed) draws
/// it, so a rank holding only a shard can draw the whole tensor and keep its part.
void gpt_init_param(const GptConfig& c, std::uint64_t seed, std::size_t index, float* out);
/// FLOPs of one forward+backward per token at sequence length T (6N plus attention; N without
/// the position embedding).
double gpt_flops_per_token(const GptConfig& c, int T);

/// Sharded parameters and gradients (parallel.zero): a model cut into units (runs of whole
/// parameter tensors) asks for the base pointer of one unit at a time, in the unit's part of the
/// flat layout (parameter i at base + offset_i - offset of the unit's first parameter). Used by
/// dt::Gpt and the pipeline's StageEngine.
struct UnitHooks {
  /// Parameters of `unit` for its next use; `next` (-1: none) is the unit used after it.
  std::function<const float*(int unit, int next)> acquire;
  std::function<void(int unit)> release;  ///< the unit's parameters are no longer used
  /// A zeroed buffer for the unit's gradients of this backward; grads_done hands it back.
  std::function<float*(int unit)> grads;
  std::function<void(int unit)> grads_done;
};

/// Where a model keeps its parameters and gradients (the defaults: its own buffers, packed).
struct GptStorage {
  /// Host memory for the gradients instead of a device allocation (see Gpt's constructor).
  float* grad_storage = nullptr;
  /// The flat layout: the model's parameter table (gpt_params(), a stage's params()) with other
  /// offsets (padding between tensors), and the buffers' size in elements (0: the end of the
  /// last tensor). Empty: the packed table.
  std::vector<ParamInfo> layout;
  std::size_t numel = 0;
  bool own_params = true;  ///< false: parameters come from UnitHooks::acquire
  bool own_grads = true;   ///< false: gradients go to UnitHooks::grads
};

class Gpt {
 public:
  /// Units of the model for UnitHooks: 0 the embeddings (wte, wpe), 1..layers the blocks,
  /// layers + 1 the final LayerNorm.
  void set_unit_hooks(UnitHooks hooks);

  /// Allocates parameters, gradients and activations for micro-batches of up to `max_batch`
  /// sequences of `c.block` tokens. `dev` must outlive the model. The parameters are not set:
  /// init() or a load (load_checkpoint, a copy into param_data()) sets them before a forward.
  /// `grad_storage`: host memory for num_params() floats to hold the gradients instead of a
  /// device allocation (a shared-memory arena, so the gradient all-reduce needs no copy); only
  /// for devices whose memory is host memory. It must outlive the model.
  Gpt(const Device& dev, GptConfig c, int max_batch, float* grad_storage = nullptr);
  Gpt(const Device& dev, GptConfig c, int max_batch, GptStorage storage);
  ~Gpt();
  /// Matrix products in `t`: f32, or bf16/f16 with both operands rounded to it and fp32
  /// accumulation and results (tensor cores on a GPU; activations, norms and gradients stay
  /// fp32). Allocates the 16-bit operand buffers for the largest product of a max_batch forward
  /// and backward, so a captured graph never needs more.
  void set_compute(DType t);
  /// `w16`: the first `n` parameters of param_data() in the compute type, which the caller keeps
  /// equal to their rounding; the matrix products read the weights from there instead of casting
  /// them for every product (null: cast them).
  void set_weights16(const void* w16, std::size_t n);
  /// Operands the matrix products have read from the weights' 16-bit copy (not cast).
  std::int64_t weight_copy_reads() const noexcept;
  /// Bytes of the activation and activation-gradient buffers (and the 16-bit GEMM operands).
  std::size_t activation_bytes() const noexcept;
  /// Floats of the two buffers a Gpt of `c` allocates for micro-batches of `max_batch`: the
  /// forward's activations (kept for the backward) and the backward's gradients of them. `flash`:
  /// whether attention keeps one log-sum-exp per row (flash_attention() of the device) instead of
  /// its probabilities. The plan's memory estimate of the fused model counts these.
  static std::pair<std::size_t, std::size_t> activation_floats(const GptConfig& c, int max_batch,
                                                               bool flash);

  const GptConfig& config() const noexcept { return cfg_; }
  const std::vector<ParamInfo>& params() const noexcept { return params_; }
  std::size_t num_params() const noexcept { return nparams_; }
  /// Null when the parameters come from UnitHooks.
  float* param_data() const noexcept { return param_buf_.as<float>(); }
  float* grad_data() const noexcept { return grad_; }
  const ParamInfo& param(const std::string& name) const;

  /// GPT-2 initialisation from `seed`: N(0, 0.02) for matrices and embeddings, residual
  /// projections (attn.c_proj, mlp.c_proj) N(0, 0.02 / sqrt(2 * layers)), biases 0, norms 1/0.
  /// Same seed, same weights on every rank and every run.
  void init(std::uint64_t seed);

  /// Forward pass on B x T tokens (T <= block, B <= max_batch); `inputs` and `targets` are host
  /// arrays of B*T token ids. With targets, returns the SUM of the per-token losses; without
  /// (nullptr), only logits are computed and 0 is returned.
  double forward(const std::int32_t* inputs, const std::int32_t* targets, int B, int T);
  /// forward() in three parts, for capturing the device work into a graph: stage() copies the
  /// tokens (and targets, may be null) to the device's fixed token buffers; run_forward() is
  /// every kernel of the forward, with no host memory read or written; loss_sum() copies the
  /// per-token losses back and returns their sum (0 without targets).
  void stage(const std::int32_t* inputs, const std::int32_t* targets, int B, int T);
  void run_forward();
  double loss_sum() const;
  /// Backward of the last forward (which must have had targets). Adds into the gradient buffer
  /// d(loss_scale * sum of token losses)/d(params). The key third of attn.c_attn.bias gets an
  /// exact zero (the loss does not depend on it), not float rounding noise.
  ///
  /// `ready`, when set, is called as soon as the gradients of parameters [first, end) (indices
  /// into params()) are final for this backward, so their reduction can start while backward goes
  /// on: ln_f after the head, each block after its own backward (last block first), wte and wpe
  /// last (wte is tied to the head and gets its second part from the embedding).
  using GradReady = std::function<void(std::size_t first, std::size_t end)>;
  void backward(float loss_scale, const GradReady& ready = {});
  void zero_grad();
  /// Logits of the last forward, row (b, t), length vocab: a device pointer (host-visible on the
  /// CPU device); logits_row() copies the row to the host buffer `out` on any device.
  const float* logits(int b, int t) const;
  void logits_row(int b, int t, float* out) const;

  /// FLOPs of one forward+backward per token at sequence length T (6N plus attention).
  double flops_per_token(int T) const;

 private:
  struct Acts;
  const Device& dev_;
  GptConfig cfg_;
  int max_batch_;
  std::vector<ParamInfo> params_;
  std::size_t nparams_ = 0;
  GptStorage storage_;
  UnitHooks hooks_;
  std::vector<const float*> pp_;  // per parameter: where its values are now
  std::vector<float*> gp_;        // per parameter: where its gradient goes now
  std::pair<std::size_t, std::size_t> unit_params(int unit) const;
  void use_params(int unit, int next);
  void drop_params(int unit);
  void use_grads(int unit);
  Device::Buffer param_buf_, grad_buf_;
  float* grad_ = nullptr;  // grad_buf_ or the caller's storage
  Device::Buffer act_buf_, grad_act_buf_;
  Device::Buffer tokens_buf_;  // inputs then targets, int32
  std::unique_ptr<GemmWorkspace> ws_;
  // In a 16-bit compute type: where the inputs of the matrix products (ln1, atty, ln2, fch_gelu,
  // lnf) are computed in fp32 before they are rounded into their own slots, which from then on
  // hold the 16-bit values that the forward's and the backward's products read.
  Device::Buffer round_buf_;
  // model.pad-vocab: the head over head_->Vp >= vocab columns (padded when head_->on()).
  std::unique_ptr<PaddedHead> head_;
  int B_ = 0, T_ = 0;
  bool have_targets_ = false;
  bool flash_ = false;  // cfg_.flash_attention on a device that has it: att holds B NH T lse
  // pointers into act_buf_ / grad_act_buf_ (set in the constructor)
  struct Layer {
    float *ln1, *ln1_mean, *ln1_rstd, *qkv, *att, *atty, *res2, *ln2, *ln2_mean, *ln2_rstd, *fch,
        *fch_gelu, *res3;
  };
  std::vector<Layer> L_;
  float *encoded_ = nullptr, *lnf_ = nullptr, *lnf_mean_ = nullptr, *lnf_rstd_ = nullptr,
        *logits_ = nullptr, *probs_ = nullptr, *losses_ = nullptr;
  // backward scratch
  float *dres_ = nullptr, *dln_ = nullptr, *dqkv_ = nullptr, *datty_ = nullptr, *dfch_ = nullptr,
        *dfch_gelu_ = nullptr, *datt_ = nullptr, *dlogits_ = nullptr;
};

}  // namespace dt
