// Move-only owner of an HDF5 identifier, and the HDF5 error text, shared by the checkpoint
// library and dt_ckpt.
#pragma once

#include <hdf5.h>

#include <string>
#include <utility>

namespace dt {

class H5 {
 public:
  H5() = default;
  /// Takes `id` (may be negative: then nothing is owned) and the function that closes it.
  H5(hid_t id, herr_t (*closer)(hid_t)) : id_(id), close_(closer) {}
  ~H5() {
    if (id_ >= 0 && close_) close_(id_);
  }
  H5(H5&& o) noexcept : id_(o.id_), close_(o.close_) { o.id_ = -1; }
  H5& operator=(H5&& o) noexcept {
    std::swap(id_, o.id_);
    std::swap(close_, o.close_);
    return *this;
  }
  H5(const H5&) = delete;
  H5& operator=(const H5&) = delete;
  /// Closes the identifier now and returns the close function's result (0 when nothing is owned).
  herr_t close() noexcept {
    const herr_t rc = id_ >= 0 && close_ ? close_(id_) : 0;
    id_ = -1;
    return rc;
  }
  hid_t get() const noexcept { return id_; }
  bool ok() const noexcept { return id_ >= 0; }
  operator hid_t() const noexcept { return id_; }

 private:
  hid_t id_ = -1;
  herr_t (*close_)(hid_t) = nullptr;
};

/// The most specific message on the HDF5 error stack, which is then cleared.
inline std::string h5_message() {
  std::string msg;
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_UPWARD,
      [](unsigned, const H5E_error2_t* e, void* out) -> herr_t {
        auto* m = static_cast<std::string*>(out);
        if (m->empty() && e->desc) *m = e->desc;
        return 0;
      },
      &msg);
  H5Eclear2(H5E_DEFAULT);
  return msg.empty() ? "HDF5 error" : msg;
}

}  // namespace dt
