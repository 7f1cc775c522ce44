#include "comm/staged_comm.hpp"

#include <cstddef>
#include <cstdint>

#include "comm/abandon.hpp"
#include "dt/error.hpp"

namespace dt {

namespace {

// A Work that is complete when it is made: the operation ran inside the i* call.
class DoneWork final : public WorkImpl {
 public:
  DoneWork(std::string what, int rank) : what_(std::move(what)), rank_(rank) {}
  bool test() override { return true; }
  bool wait_for(Millis) override { return true; }
  std::string describe() const override { return what_; }
  int rank() const override { return rank_; }

 private:
  std::string what_;
  int rank_;
};

// A point-to-point operation on a host copy it holds; a receive copies into the device buffer when
// it completes.
class StagedP2pWork final : public WorkImpl {
 public:
  StagedP2pWork(const Device& dev, std::shared_ptr<HostBufferPool> pool, std::size_t bytes,
                void* dst, int rank)
      : dev_(dev),
        pool_(std::move(pool)),
        host_(pool_->take(bytes)),
        bytes_(bytes),
        dst_(dst),
        rank_(rank) {}
  // A Work may be dropped unfinished (after a timeout): the transport may still use the host copy,
  // so it is left allocated rather than freed or reused under it.
  ~StagedP2pWork() override {
    if (done_)
      pool_->give(std::move(host_));
    else
      abandon(std::move(host_.data));
  }
  void start(Work inner, std::string what) {
    inner_ = std::move(inner);
    what_ = std::move(what);
  }
  unsigned char* host() { return host_.data.get(); }
  bool test() override { return finish(inner_.test()); }
  bool wait_for(Millis timeout) override {
    inner_.wait(timeout);
    return finish(true);
  }
  std::string describe() const override { return what_; }
  int rank() const override { return rank_; }

 private:
  bool finish(bool done) {
    done_ = done_ || done;
    if (done && dst_ != nullptr) {
      dev_.call(&dt_hal_v1_t::copy, "copy", dst_, static_cast<const void*>(host()), bytes_,
                DT_HAL_HOST_TO_DEVICE);
      dst_ = nullptr;
    }
    return done;
  }
  const Device& dev_;
  std::shared_ptr<HostBufferPool> pool_;
  HostBufferPool::Buffer host_;
  std::size_t bytes_;
  void* dst_;
  int rank_;
  Work inner_;
  std::string what_;
  bool done_ = false;
};

TensorView host_view(unsigned char* p, std::size_t numel, DType t) {
  return TensorView{p, numel, t};
}

}  // namespace

namespace {
std::unique_ptr<Comm> checked(std::unique_ptr<Comm> c) {
  DT_CHECK(InvalidArgument, c != nullptr, "StagedComm needs a host communicator");
  return c;
}
}  // namespace

StagedP2p::StagedP2p(const Device& dev, std::unique_ptr<P2p> host)
    : dev_(dev), owned_(std::move(host)), host_(*owned_) {
  name_ = host_.name() + "/staged(" + dev_.name() + ")";
}

StagedP2p::StagedP2p(const Device& dev, P2p& host) : dev_(dev), host_(host) {
  name_ = host_.name() + "/staged(" + dev_.name() + ")";
}

HostBufferPool::Buffer HostBufferPool::take(std::size_t bytes) {
  std::lock_guard<std::mutex> lk(mu_);
  auto best = free_.end();
  for (auto it = free_.begin(); it != free_.end(); ++it)
    if (it->capacity >= bytes && (best == free_.end() || it->capacity < best->capacity)) best = it;
  if (best != free_.end()) {
    Buffer b = std::move(*best);
    free_.erase(best);
    return b;
  }
  ++allocations_;
  // At least one byte, so an empty message still has a buffer of its own.
  const std::size_t cap = bytes > 0 ? bytes : 1;
  return Buffer{std::unique_ptr<unsigned char[]>(new unsigned char[cap]), cap};
}

void HostBufferPool::give(Buffer b) {
  if (!b.data) return;
  std::lock_guard<std::mutex> lk(mu_);
  free_.push_back(std::move(b));
  if (free_.size() > kMaxFree) {
    auto smallest = free_.begin();
    for (auto it = free_.begin(); it != free_.end(); ++it)
      if (it->capacity < smallest->capacity) smallest = it;
    free_.erase(smallest);
  }
}

std::size_t HostBufferPool::allocations() const {
  std::lock_guard<std::mutex> lk(mu_);
  return allocations_;
}

Work StagedP2p::isend(ConstTensorView buf, int dst, int tag) {
  auto w = std::make_unique<StagedP2pWork>(dev_, pool_, buf.nbytes(), nullptr, rank());
  dev_.call(&dt_hal_v1_t::copy, "copy", static_cast<void*>(w->host()), buf.data, buf.nbytes(),
            DT_HAL_DEVICE_TO_HOST);
  w->start(host_.isend(ConstTensorView{w->host(), buf.numel, buf.dtype}, dst, tag),
           "send to " + std::to_string(dst) + " on " + name_);
  return Work(std::move(w));
}

Work StagedP2p::irecv(TensorView buf, int src, int tag) {
  auto w = std::make_unique<StagedP2pWork>(dev_, pool_, buf.nbytes(), buf.data, rank());
  w->start(host_.irecv(host_view(w->host(), buf.numel, buf.dtype), src, tag),
           "recv from " + std::to_string(src) + " on " + name_);
  return Work(std::move(w));
}

StagedComm::StagedComm(const Device& dev, std::unique_ptr<Comm> host)
    : dev_(dev), host_(checked(std::move(host))), p2p_(dev, *host_) {
  name_ = host_->name() + "/staged(" + dev_.name() + ")";
}

void StagedComm::down(void* host, const void* dev, std::size_t bytes) const {
  dev_.call(&dt_hal_v1_t::copy, "copy", host, dev, bytes, DT_HAL_DEVICE_TO_HOST);
}
void StagedComm::up(void* dev, const void* host, std::size_t bytes) const {
  dev_.call(&dt_hal_v1_t::copy, "copy", dev, host, bytes, DT_HAL_HOST_TO_DEVICE);
}
unsigned char* StagedComm::staging(std::size_t bytes) {
  if (buf_.capacity < bytes) {
    buf_.data.reset();  // (no copy: nothing in it is kept)
    buf_.data = std::make_unique<unsigned char[]>(bytes);
    buf_.capacity = bytes;
  }
  return buf_.data.get();
}

template <class F>
void StagedComm::on_host(F&& f) {
  try {
    f();
  } catch (...) {
    // A timeout leaves the operation pending in the host communicator, which may still write into
    // the staging buffer: it is given up, and the next operation stages in a fresh one.
    abandon(std::move(buf_.data));
    buf_.capacity = 0;
    throw;
  }
}

void StagedComm::all_reduce(TensorView buf, ReduceOp op, const CommOptions& opts) {
  std::lock_guard<std::mutex> lk(mu_);
  unsigned char* h = staging(buf.nbytes());
  down(h, buf.data, buf.nbytes());
  on_host([&] { host_->all_reduce(host_view(h, buf.numel, buf.dtype), op, opts); });
  up(buf.data, h, buf.nbytes());
}

void StagedComm::broadcast(TensorView buf, int root, const CommOptions& opts) {
  std::lock_guard<std::mutex> lk(mu_);
  unsigned char* h = staging(buf.nbytes());
  if (rank() == root) down(h, buf.data, buf.nbytes());
  on_host([&] { host_->broadcast(host_view(h, buf.numel, buf.dtype), root, opts); });
  if (rank() != root) up(buf.data, h, buf.nbytes());
}

void StagedComm::all_gather(ConstTensorView in, TensorView out, const CommOptions& opts) {
  std::lock_guard<std::mutex> lk(mu_);
  unsigned char* h = staging(in.nbytes() + out.nbytes());
  down(h, in.data, in.nbytes());
  unsigned char* ho = h + in.nbytes();
  on_host([&] {
    host_->all_gather(ConstTensorView{h, in.numel, in.dtype}, host_view(ho, out.numel, out.dtype),
                      opts);
  });
  up(out.data, ho, out.nbytes());
}

void StagedComm::reduce_scatter(ConstTensorView in, TensorView out, ReduceOp op,
                                const CommOptions& opts) {
  std::lock_guard<std::mutex> lk(mu_);
  unsigned char* h = staging(in.nbytes() + out.nbytes());
  down(h, in.data, in.nbytes());
  unsigned char* ho = h + in.nbytes();
  on_host([&] {
    host_->reduce_scatter(ConstTensorView{h, in.numel, in.dtype},
                          host_view(ho, out.numel, out.dtype), op, opts);
  });
  up(out.data, ho, out.nbytes());
}

void StagedComm::barrier(const CommOptions& opts) { host_->barrier(opts); }

// The i* collectives run the host operation to completion here. With a limit (one no call
// reaches), the host communicator polls its non-blocking form and sleeps between polls instead of
// spinning inside a blocking MPI call, which a progress thread must not do (dt::GradBuckets).
const CommOptions kPolled{kPolledWait};

Work StagedComm::iall_reduce(TensorView buf, ReduceOp op) {
  all_reduce(buf, op, kPolled);
  return Work(std::make_unique<DoneWork>("all_reduce on " + name_, rank()));
}
Work StagedComm::ibroadcast(TensorView buf, int root) {
  broadcast(buf, root, kPolled);
  return Work(std::make_unique<DoneWork>("broadcast on " + name_, rank()));
}
Work StagedComm::iall_gather(ConstTensorView in, TensorView out) {
  all_gather(in, out, kPolled);
  return Work(std::make_unique<DoneWork>("all_gather on " + name_, rank()));
}
Work StagedComm::ireduce_scatter(ConstTensorView in, TensorView out, ReduceOp op) {
  reduce_scatter(in, out, op, kPolled);
  return Work(std::make_unique<DoneWork>("reduce_scatter on " + name_, rank()));
}
Work StagedComm::isend(ConstTensorView buf, int dst, int tag) { return p2p_.isend(buf, dst, tag); }
Work StagedComm::irecv(TensorView buf, int src, int tag) { return p2p_.irecv(buf, src, tag); }
Work StagedComm::ibarrier() {
  barrier(kPolled);
  return Work(std::make_unique<DoneWork>("barrier on " + name_, rank()));
}

std::unique_ptr<Comm> StagedComm::split(int color, int key) {
  std::unique_ptr<Comm> h = host_->split(color, key);
  if (!h) return nullptr;
  return std::make_unique<StagedComm>(dev_, std::move(h));
}

}  // namespace dt
