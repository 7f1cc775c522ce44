#include "dt/comm.hpp"

#include <cstdio>

#include "dt/error.hpp"

namespace dt {

const char* reduce_op_name(ReduceOp op) noexcept {
  switch (op) {
    case ReduceOp::sum:
      return "sum";
    case ReduceOp::avg:
      return "avg";
    case ReduceOp::max:
      return "max";
    case ReduceOp::min:
      return "min";
  }
  return "?";
}

bool Work::test() {
  DT_CHECK(InvalidArgument, impl_ != nullptr, "test() on an empty Work");
  return impl_->test();
}

void Work::wait(Millis timeout) {
  DT_CHECK(InvalidArgument, impl_ != nullptr, "wait() on an empty Work");
  if (!impl_->wait_for(timeout))
    DT_THROW(CommError, impl_->describe(), " on rank ", impl_->rank(), " timed out after ",
             timeout.count(), " ms");
}

bool Work::cancel(Millis grace) { return impl_ == nullptr || impl_->cancel(grace); }

void Comm::all_reduce(TensorView buf, ReduceOp op, const CommOptions& opts) {
  iall_reduce(buf, op).wait(opts.timeout);
}
void Comm::broadcast(TensorView buf, int root, const CommOptions& opts) {
  ibroadcast(buf, root).wait(opts.timeout);
}
void Comm::all_gather(ConstTensorView in, TensorView out, const CommOptions& opts) {
  iall_gather(in, out).wait(opts.timeout);
}
void Comm::reduce_scatter(ConstTensorView in, TensorView out, ReduceOp op,
                          const CommOptions& opts) {
  ireduce_scatter(in, out, op).wait(opts.timeout);
}
void P2p::send(ConstTensorView buf, int dst, int tag, const CommOptions& opts) {
  isend(buf, dst, tag).wait(opts.timeout);
}
void P2p::recv(TensorView buf, int src, int tag, const CommOptions& opts) {
  irecv(buf, src, tag).wait(opts.timeout);
}
void Comm::barrier(const CommOptions& opts) { ibarrier().wait(opts.timeout); }

std::string broadcast_text(Comm& comm, std::string text, int root) {
  std::int64_t len = static_cast<std::int64_t>(text.size());
  comm.broadcast(view_of(&len, 1), root);
  text.resize(static_cast<std::size_t>(len));
  if (len > 0) comm.broadcast(TensorView{text.data(), text.size(), DType::u8}, root);
  return text;
}

std::pair<int, std::string> first_problem(Comm& comm, const std::string& problem) {
  int who = problem.empty() ? comm.size() : comm.rank();
  comm.all_reduce(view_of(&who, 1), ReduceOp::min);
  if (who == comm.size()) return {who, ""};
  return {who, broadcast_text(comm, problem, who)};
}

std::pair<int, std::string> first_failure(Comm& comm, const std::function<void()>& body,
                                          std::string* own) {
  std::string failed;
  try {
    body();
  } catch (const std::exception& e) {
    failed = message_of(e);
  }
  if (own) *own = failed;
  return first_problem(comm, failed);
}

bool agree_on_errors(Comm& comm, const char* program, const std::function<void()>& body,
                     bool help_hint) {
  std::string failed;
  const auto [first_bad, first] = first_failure(comm, body, &failed);
  if (first_bad == comm.size()) return true;
  const std::string p = program;
  const std::string rank = "rank " + std::to_string(comm.rank()) + ": ";
  std::string text;
  if (comm.rank() == first_bad) {
    text = p + ": error: " + (comm.size() > 1 ? rank : "") + failed + "\n";
    if (help_hint) text += p + ": run '" + p + " --help' for the list of options\n";
  } else if (!failed.empty() && failed != first) {
    text = p + ": error: " + rank + failed + "\n";
  }
  // One write, so that lines of ranks sharing a terminal do not run into each other.
  if (!text.empty()) std::fputs(text.c_str(), stderr);
  return false;
}

}  // namespace dt
