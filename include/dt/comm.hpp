// dt::Comm: the collective and point-to-point interface every transport implements
// (MPI for host tensors today; NCCL and UCX implement the same header).
//
// Contracts shared by every implementation:
//  - All ranks of a communicator call the same collectives in the same order with the same
//    dtype, element counts and root. Mismatched local arguments (wrong dtype pairing, an output
//    that is not size() times the input, a root out of range) throw dt::InvalidArgument before
//    any traffic, so a bad call on one rank is reported on that rank.
//  - Failures inside the transport throw dt::CommError naming the operation, the rank and the
//    transport's own message.
//  - Blocking calls return when the local buffers may be reused. Non-blocking calls (i*) return a
//    Work; buffers must stay alive and untouched until Work::wait() or Work::test() reports done.
//  - Forms must match across ranks for one collective call: the blocking form without a timeout
//    uses MPI's blocking collective; the non-blocking form and the blocking form with a timeout
//    use MPI's non-blocking collective. MPI never matches one kind with the other, so either all
//    ranks pass a timeout (or use i*) for a given call, or none does. kPolledWait is a form of
//    its own: all ranks pass it for a given call, or none does (a large reduce_scatter then runs
//    MpiComm's point-to-point ring, polled, where a timeout takes MPI's non-blocking one).
//  - A receive delivers exactly buf.numel elements; a shorter or longer message is a CommError.
//  - ReduceOp::avg is sum followed by division by size(); integers divide truncating toward zero
//    after a sum in the element type (which wraps where ReduceOp::sum would), bf16/f16 sum and
//    divide in float and round once to the element type per step.
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "dt/tensor.hpp"

namespace dt {

enum class ReduceOp { sum, avg, max, min };
const char* reduce_op_name(ReduceOp op) noexcept;

using Millis = std::chrono::milliseconds;
/// wait() without a limit.
inline constexpr Millis kNoTimeout{-1};
/// A limit no wait reaches: wait(kPolledWait) polls the operation instead of blocking inside MPI,
/// whose blocking calls spin; for real-time threads (a QoS tier's communication thread), which
/// would keep every normal thread of their core from running. Between polls a real-time thread
/// sleeps; an ordinary thread yields its core (it stays runnable).
inline constexpr Millis kPolledWait{std::int64_t{1} << 40};
/// What is left of a limit that ends at `end`: 0 once it has passed.
inline Millis millis_until(std::chrono::steady_clock::time_point end) {
  return std::max(Millis(0),
                  std::chrono::duration_cast<Millis>(end - std::chrono::steady_clock::now()));
}

/// Completion state of a non-blocking operation; implemented by each transport.
class WorkImpl {
 public:
  virtual ~WorkImpl() = default;
  /// Advances the operation; returns true when complete. Throws the operation's error.
  virtual bool test() = 0;
  /// Blocks until complete or until `timeout` passed (kNoTimeout: forever). Returns completion.
  virtual bool wait_for(Millis timeout) = 0;
  /// "all_reduce(f32 x 1024, sum) on world" for messages.
  virtual std::string describe() const = 0;
  virtual int rank() const = 0;
  /// Withdraws an unfinished receive so that it never writes into its buffer again. True when
  /// that holds: the receive was withdrawn, or it finished (or failed) before or within `grace`;
  /// test() and wait() of a withdrawn receive then throw dt::CommError ("... cancelled"). False
  /// when it cannot be promised: sends and collectives (which MPI cannot withdraw; a transport
  /// that can withdraw a send, so that it reads its buffer no more, may return true), transports
  /// that cannot, and a transfer under way that did not end within `grace`; the buffer must then
  /// stay valid as for any unfinished Work. Does not wait for peers beyond `grace`.
  virtual bool cancel(Millis grace) {
    (void)grace;
    return false;
  }
};

/// Handle of a non-blocking operation (c10d Work semantics). Move-only.
class Work {
 public:
  Work() = default;
  explicit Work(std::unique_ptr<WorkImpl> impl) : impl_(std::move(impl)) {}
  Work(Work&&) noexcept = default;
  Work& operator=(Work&&) noexcept = default;
  /// Destroying an unfinished Work does not block and does not cancel the operation: the caller's
  /// buffers must stay valid until the peers have finished it, also after a timeout exception
  /// (an unfinished op usually means the job is failing and is about to be aborted).
  ~Work() = default;

  /// Non-blocking progress; true when done. Rethrows the stored error on every call after failure.
  bool test();
  /// Blocks until done. On failure rethrows the stored dt::CommError. If `timeout` passes first,
  /// throws dt::CommError naming the operation and the timeout; the operation stays pending and
  /// wait() may be called again.
  void wait(Millis timeout = kNoTimeout);
  /// WorkImpl::cancel; true for an empty Work.
  bool cancel(Millis grace = Millis(1000));
  bool valid() const noexcept { return impl_ != nullptr; }

 private:
  std::unique_ptr<WorkImpl> impl_;
};

/// Per-call options.
struct CommOptions {
  /// Applies to blocking calls: kNoTimeout waits forever; otherwise a blocking call that does not
  /// finish within this time throws dt::CommError (the call turns into its non-blocking form).
  Millis timeout = kNoTimeout;
};

/// Point-to-point transport: what pipeline stages need (MPI, UCX). Tags select messages between
/// one pair of ranks; messages with the same (source, tag) arrive in the order they were sent.
class P2p {
 public:
  virtual ~P2p() = default;

  virtual int rank() const noexcept = 0;
  virtual int size() const noexcept = 0;
  /// Name for messages: "world", "world/split(1)", "ucx".
  virtual const std::string& name() const noexcept = 0;

  /// `buf` must stay valid and untouched until the Work completes.
  virtual Work isend(ConstTensorView buf, int dst, int tag) = 0;
  /// Receives exactly buf.numel elements; a shorter or longer message fails with dt::CommError.
  virtual Work irecv(TensorView buf, int src, int tag) = 0;

  // blocking (defaults: the non-blocking form plus wait(opts.timeout))
  virtual void send(ConstTensorView buf, int dst, int tag, const CommOptions& opts = {});
  virtual void recv(TensorView buf, int src, int tag, const CommOptions& opts = {});
};

/// Collectives plus point-to-point over one group of ranks.
class Comm : public P2p {
 public:
  // --- non-blocking ---------------------------------------------------------------------------
  /// In place: every rank ends with op over all ranks' `buf`.
  virtual Work iall_reduce(TensorView buf, ReduceOp op) = 0;
  /// `buf` of `root` is copied into every rank's `buf`.
  virtual Work ibroadcast(TensorView buf, int root) = 0;
  /// out[r * in.numel ... (r + 1) * in.numel) = in of rank r. Needs out.numel == size() * in.numel.
  virtual Work iall_gather(ConstTensorView in, TensorView out) = 0;
  /// Rank r gets block r of op over all ranks' `in`. Needs in.numel == size() * out.numel.
  virtual Work ireduce_scatter(ConstTensorView in, TensorView out, ReduceOp op) = 0;
  virtual Work ibarrier() = 0;

  // --- blocking (defaults: the non-blocking form plus wait(opts.timeout)) -----------------------
  virtual void all_reduce(TensorView buf, ReduceOp op, const CommOptions& opts = {});
  virtual void broadcast(TensorView buf, int root, const CommOptions& opts = {});
  virtual void all_gather(ConstTensorView in, TensorView out, const CommOptions& opts = {});
  virtual void reduce_scatter(ConstTensorView in, TensorView out, ReduceOp op,
                              const CommOptions& opts = {});
  virtual void barrier(const CommOptions& opts = {});

  /// Collective over this communicator: ranks with the same `color` form a new communicator,
  /// ordered by (key, old rank). A negative color joins none and gets nullptr.
  virtual std::unique_ptr<Comm> split(int color, int key) = 0;
};

/// Collective over `comm`: rank `root`'s `text`, on every rank.
std::string broadcast_text(Comm& comm, std::string text, int root);

/// Collective over `comm`: the lowest rank whose `problem` is not empty and its problem, on every
/// rank ({comm.size(), ""} when no rank has one). For a check that may fail on some ranks only
/// (a node's memory, a file of its own): every rank learns the same verdict and message.
std::pair<int, std::string> first_problem(Comm& comm, const std::string& problem);

/// Collective over `comm`: runs `body`, and returns first_problem of what it threw on each rank
/// (the message; "" where it returned). `own`, where given, gets this rank's.
std::pair<int, std::string> first_failure(Comm& comm, const std::function<void()>& body,
                                          std::string* own = nullptr);

/// Collective over `comm`: runs `body` on every rank and agrees on whether any rank's threw. The
/// first such rank prints "PROGRAM: error: rank R: MESSAGE" (without "rank R: " in a job of one
/// rank), with a line naming `PROGRAM --help` where `help_hint`; another rank prints its own error
/// only where it differs from the first. True where no rank's threw: every rank gets the same
/// answer, so that all go on or all stop, and none waits in a collective for one that stopped.
bool agree_on_errors(Comm& comm, const char* program, const std::function<void()>& body,
                     bool help_hint = true);

}  // namespace dt
