// Loading a shared library from a search path, as the dynamic linker searches one: the device
// plugins (libdt_hal_NAME.so) and the NCCL communicator (libdt_nccl.so) are found this way, so
// that dt's programs themselves never link a vendor's libraries.
#pragma once

#include <functional>
#include <string>

namespace dt::detail {

/// A dlopen handle and the file it came from; closed on destruction.
struct SharedLibrary {
  void* handle = nullptr;
  std::string path;
  SharedLibrary() = default;
  SharedLibrary(const SharedLibrary&) = delete;
  SharedLibrary& operator=(const SharedLibrary&) = delete;
  ~SharedLibrary();
};

/// Loads into `out` the first copy of `file` in the colon-separated `search_path` that dlopen
/// (RTLD_NOW | RTLD_LOCAL) accepts. A copy that cannot be loaded (built for another machine,
/// missing a library of its own, cut short) is skipped with a warning on stderr naming it and why,
/// so a stale one does not hide a good one. A 64-bit ELF copy whose segments end past the end of
/// the file is refused before dlopen, which would raise SIGBUS mapping it. `what` names the asker
/// in messages ("device 'cuda'"). Throws dt::ConfigError naming the file and the path when no
/// copy exists, and every copy's reason when none loads.
/// `accept` (if given) judges a copy that loaded: it returns why the copy cannot serve (another
/// version, say), and such a copy is skipped too, or "" to take it.
void load_from_path(const std::string& file, const std::string& search_path,
                    const std::string& what, SharedLibrary& out,
                    const std::function<std::string(const SharedLibrary&)>& accept = {});

/// The symbol `name` of a loaded library, or nullptr.
void* find_symbol(const SharedLibrary& lib, const char* name);

}  // namespace dt::detail
