// Fuzz target: the token-file reader and the samplers (src/data/data.cpp).
// Contract checked: any file either loads into a non-empty run of tokens, all below
// max_token_plus_one (which model.vocab must reach: the format's vocabulary or more), or throws
// dt::ConfigError naming it; splitting and sampling a loaded file either works with windows
// inside the file or throws dt::ConfigError.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "dt/data.hpp"
#include "dt/error.hpp"
#include "fuzz_util.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  dt_fuzz::Reader in(data, size);
  const std::uint8_t a = in.byte(), b = in.byte();
  const std::string body = in.rest();
  static const std::string path = dt_fuzz::scratch("tokens", ".bin");
  dt_fuzz::write_file(path, body.data(), body.size());
  static const char* kFormats[] = {"auto", "bytes", "llmc"};
  dt::TokenFile f;
  try {
    f = dt::load_tokens(path, kFormats[a % 3]);
  } catch (const dt::ConfigError&) {
    return 0;
  }
  if (f.tokens.empty() || f.max_token_plus_one > 65536) std::abort();
  if (f.format == "bytes" && f.max_token_plus_one > f.vocab) std::abort();
  int top = 0;
  for (std::size_t i = 0; i < f.tokens.size(); ++i) top = std::max<int>(top, f.tokens[i]);
  if (top + 1 != f.max_token_plus_one) std::abort();
  const int vocab = std::max(f.vocab, f.max_token_plus_one);  // model.vocab given to fit them
  const double frac = (b % 10) / 10.0;
  const int seq_len = 1 + (a >> 2) % 16;
  try {
    const dt::Split s = dt::split(f, frac);
    if (s.train.end > f.size() || s.val.end > f.size()) std::abort();
    dt::Sampler smp(f.data(s.train), s.train.size(), seq_len, b);
    std::vector<std::int32_t> x(static_cast<std::size_t>(seq_len) * 2),
        y(static_cast<std::size_t>(seq_len) * 2);
    smp.fill(b, 0, 2, x.data(), y.data());
    for (std::size_t i = 0; i < x.size(); ++i)
      if (x[i] < 0 || x[i] >= vocab || y[i] < 0 || y[i] >= vocab) std::abort();
    if (!s.val.empty()) {
      const auto starts = dt::eval_windows(s.val.size(), seq_len, 2, "validation split");
      for (auto st : starts)
        if (st + static_cast<std::size_t>(seq_len) + 1 > s.val.size()) std::abort();
    }
  } catch (const dt::ConfigError&) {
  }
  return 0;
}
