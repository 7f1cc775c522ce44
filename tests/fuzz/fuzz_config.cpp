// Fuzz target: dt::Options (src/core/config.cpp), an INI config file or a command line.
// Contract checked: any input either parses into values inside every declared range and choice
// list, or throws dt::ConfigError; nothing else escapes and nothing crashes.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "dt/config.hpp"
#include "dt/error.hpp"
#include "fuzz_util.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  dt_fuzz::Reader in(data, size);
  const std::uint8_t mode = in.byte();
  const std::string text = in.rest();
  std::string name, p2p;
  bool flag = false;
  long steps = 0;
  int layers = 0;
  double lr = 0, free_num = 0;
  dt::Options o("fuzz", "fuzzing the option parser");
  o.add("train.name", &name, "run", "a string")
      .add("train.flag", &flag, false, "a bool")
      .add("train.steps", &steps, 10, "a long", 0L, 1000L)
      .add("model.layers", &layers, 2, "an int", 1, 64)
      .add("optim.lr", &lr, 1e-3, "a double", 0.0, 1.0)
      .add("optim.eps", &free_num, 1e-8, "a double without range")
      .add("comm.p2p", &p2p, "mpi", "a choice", {"mpi", "ucx"});
  std::vector<std::string> args = {"fuzz"};
  static const std::string path = dt_fuzz::scratch("config", ".ini");
  if (mode % 2 == 0) {
    dt_fuzz::write_file(path, text.data(), text.size());
    args.push_back("--config");
    args.push_back(path);
  } else {  // a command line: arguments separated by newlines
    std::string cur;
    for (char c : text) {
      if (c == '\n') {
        args.push_back(cur);
        cur.clear();
      } else {
        cur.push_back(c);
      }
    }
    if (!cur.empty()) args.push_back(cur);
    for (const auto& a : args)
      if (a == "--help" || a == "-h") return 0;  // prints the help text: not interesting
  }
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  try {
    if (!o.parse(static_cast<int>(argv.size()), argv.data())) return 0;
  } catch (const dt::ConfigError&) {
    return 0;
  }
  // Parsed: every value must respect its declaration.
  if (!(steps >= 0 && steps <= 1000) || !(layers >= 1 && layers <= 64) ||
      !(lr >= 0.0 && lr <= 1.0) || !(p2p == "mpi" || p2p == "ucx"))
    std::abort();
  (void)o.dump();
  return 0;
}
