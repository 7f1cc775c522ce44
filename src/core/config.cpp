#include "dt/config.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/program_options.hpp>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iostream>
#include <limits>
#include <map>
#include <sstream>
#include <thread>
#include <type_traits>

#include "dt/error.hpp"

namespace po = boost::program_options;

namespace dt {

struct Options::Impl {
  std::string program;
  std::string summary;
  std::string usage;  ///< "" for the default
  po::options_description desc{"Options", 100};
  // Range / choice validation: option name -> problem with the parsed value ("" when fine).
  std::vector<std::pair<std::string, std::function<std::string()>>> checks;
  std::vector<std::pair<std::string, std::string>> types;  // name -> expected kind
  std::vector<std::pair<std::string, std::function<std::string()>>> values;
  std::vector<std::string> node_local;
  std::deque<std::string> words;  // the text of each two-word setting, which Boost parses into
  std::string config_path;
  std::vector<std::string> given;  // options the last parse() set from the command line or file

  std::string expected(const std::string& name) const {
    for (const auto& [n, t] : types)
      if (n == name) return t;
    return "a valid value";
  }
};

Options::Options(std::string program, std::string summary) : impl_(std::make_unique<Impl>()) {
  impl_->program = std::move(program);
  impl_->summary = std::move(summary);
  impl_->desc.add_options()("help,h", "print this help and exit")(
      "config", po::value<std::string>(&impl_->config_path)->value_name("FILE"),
      "INI file with settings ([section] key = value); the command line overrides it");
}

Options::~Options() = default;

namespace {
// A control byte: below a space, or DEL.
bool control_byte(unsigned char c) { return c < 0x20 || c == 0x7f; }

// Whether a value must be written in quotes to read back the same from a config file: it holds a
// line break, a tab, a '"' first, a comment (" #") or spaces at either end, or starts as a comment.
bool needs_quotes(const std::string& v) {
  if (v.empty()) return false;
  for (unsigned char c : v)
    if (control_byte(c)) return true;  // a line break, a tab, any control byte
  if (v.front() == '"' || v.front() == '#' || v.front() == ';' || v.front() == ' ' ||
      v.back() == ' ')
    return true;
  return v.find(" #") != std::string::npos;
}
// `c` as \xHH.
void append_hex(std::string& out, unsigned char c) {
  char hex[8];
  std::snprintf(hex, sizeof hex, "\\x%02x", c);
  out += hex;
}

// "..." with \\, \", \n, \r and \t escaped, and other control bytes as \xHH.
std::string in_quotes(const std::string& v) {
  std::string q = "\"";
  for (char c : v) {
    switch (c) {
      case '\\':
        q += "\\\\";
        break;
      case '"':
        q += "\\\"";
        break;
      case '\n':
        q += "\\n";
        break;
      case '\r':
        q += "\\r";
        break;
      case '\t':
        q += "\\t";
        break;
      default:
        if (control_byte(static_cast<unsigned char>(c)))
          append_hex(q, static_cast<unsigned char>(c));
        else
          q += c;
    }
  }
  return q + "\"";
}

// The length of the well-formed UTF-8 sequence at s[i] (2 to 4 bytes: no overlong form, no
// surrogate, nothing above U+10FFFF), and its code point; 0 where there is none.
std::size_t utf8_sequence(const std::string& s, std::size_t i, std::uint32_t* cp) {
  const auto b = [&s](std::size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  std::size_t n = 0;
  std::uint32_t v = 0, least = 0;
  if (c >= 0xc2 && c <= 0xdf)
    n = 2, v = c & 0x1fu, least = 0x80;
  else if (c >= 0xe0 && c <= 0xef)
    n = 3, v = c & 0x0fu, least = 0x800;
  else if (c >= 0xf0 && c <= 0xf4)
    n = 4, v = c & 0x07u, least = 0x10000;
  if (n == 0 || i + n > s.size()) return 0;
  for (std::size_t k = 1; k < n; ++k) {
    if ((b(i + k) & 0xc0u) != 0x80u) return 0;
    v = (v << 6) | (b(i + k) & 0x3fu);
  }
  if (v < least || v > 0x10ffff || (v >= 0xd800 && v <= 0xdfff)) return 0;
  *cp = v;
  return n;
}
}  // namespace

std::string printable(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      if (c != '\t' && control_byte(c))
        append_hex(out, c);
      else
        out += static_cast<char>(c);
      ++i;
      continue;
    }
    std::uint32_t cp = 0;
    const std::size_t n = utf8_sequence(s, i, &cp);
    if (n == 0 || cp <= 0x9f) {  // not UTF-8, or a C1 control (U+0080..U+009F), byte by byte
      for (std::size_t k = 0; k < std::max<std::size_t>(n, 1); ++k)
        append_hex(out, static_cast<unsigned char>(s[i + k]));
      i += std::max<std::size_t>(n, 1);
    } else {
      out.append(s, i, n);
      i += n;
    }
  }
  return out;
}

Options& Options::add(const std::string& name, std::string* target, std::string def,
                      std::string help, std::vector<std::string> choices) {
  if (!choices.empty()) {
    std::string list;
    for (const auto& c : choices) list += (list.empty() ? "" : "|") + c;
    help += " {" + list + "}";
    impl_->types.emplace_back(name, "one of " + list);
    impl_->checks.emplace_back(name, [target, choices, list]() -> std::string {
      for (const auto& c : choices)
        if (*target == c) return {};
      return "'" + *target + "' is not one of " + list;
    });
  } else {
    impl_->types.emplace_back(name, "a string");
  }
  // The default as --help shows it: in quotes with escapes where it needs them (a line break).
  const std::string shown = needs_quotes(def) ? in_quotes(def) : def;
  impl_->desc.add_options()(name.c_str(), po::value<std::string>(target)->default_value(def, shown),
                            help.c_str());
  impl_->values.emplace_back(name, [target] { return *target; });
  return *this;
}

Options& Options::add(const std::string& name, bool* target, bool def, std::string help) {
  impl_->types.emplace_back(name, "true or false");
  impl_->desc.add_options()(name.c_str(),
                            po::value<bool>(target)->default_value(def)->implicit_value(true),
                            help.c_str());
  impl_->values.emplace_back(name, [target] { return *target ? "true" : "false"; });
  return *this;
}

Options& Options::add(const std::string& name, bool* target, bool def, std::string help,
                      const std::pair<std::string, std::string>& words) {
  const auto& [yes, no] = words;
  const std::string list = yes + "|" + no;
  std::string* text = &impl_->words.emplace_back(def ? yes : no);
  *target = def;
  impl_->types.emplace_back(name, "one of " + list);
  // Checked and converted after parsing, with the other checks.
  impl_->checks.emplace_back(name, [target, text, yes = yes, no = no, list]() -> std::string {
    if (*text != yes && *text != no) return "'" + *text + "' is not one of " + list;
    *target = *text == yes;
    return {};
  });
  help += " {" + list + "}";
  impl_->desc.add_options()(
      name.c_str(), po::value<std::string>(text)->default_value(def ? yes : no), help.c_str());
  impl_->values.emplace_back(name, [target, yes = yes, no = no] { return *target ? yes : no; });
  return *this;
}

Options& Options::node_local() {
  DT_CHECK(InvalidArgument, !impl_->values.empty(), "Options::node_local: no option added yet");
  impl_->node_local.push_back(impl_->values.back().first);
  return *this;
}

std::vector<std::string> Options::node_local_options() const { return impl_->node_local; }

namespace {
// Numbers as a user would write them: 0.1, 1e-08, 1048576; a floating value with as many digits
// as it needs to read back as itself (0.0012345678, not 0.00123457), so that --print-config and
// the comparison of options between ranks keep every digit given.
template <class T>
std::string short_text(T v) {
  if constexpr (std::is_floating_point_v<T>) {
    char buf[40];
    for (int digits = 6; digits <= 17; ++digits) {
      std::snprintf(buf, sizeof buf, "%.*g", digits, static_cast<double>(v));
      if (std::strtod(buf, nullptr) == static_cast<double>(v)) break;
    }
    return buf;
  } else {
    std::ostringstream os;
    os << v;
    return os.str();
  }
}

template <class T>
void add_number(po::options_description& desc,
                std::vector<std::pair<std::string, std::function<std::string()>>>& checks,
                const std::string& name, T* target, T def, const std::string& help,
                std::optional<T> min, std::optional<T> max) {
  std::ostringstream h;
  h << help;
  if (min || max) {
    h << " [" << (min ? short_text(*min) : "") << ".." << (max ? short_text(*max) : "") << "]";
    checks.emplace_back(name, [target, min, max]() -> std::string {
      std::ostringstream os;
      if constexpr (std::is_floating_point_v<T>)
        if (std::isnan(*target)) return "nan is not a number in the allowed range";
      if (min && *target < *min) os << *target << " is below the minimum " << *min;
      if (max && *target > *max) os << *target << " is above the maximum " << *max;
      return os.str();
    });
  }
  desc.add_options()(name.c_str(), po::value<T>(target)->default_value(def, short_text(def)),
                     h.str().c_str());
}
}  // namespace

Options& Options::add(const std::string& name, long* target, long def, std::string help,
                      std::optional<long> min, std::optional<long> max) {
  impl_->types.emplace_back(name, "an integer");
  add_number(impl_->desc, impl_->checks, name, target, def, help, min, max);
  impl_->values.emplace_back(name, [target] { return std::to_string(*target); });
  return *this;
}

Options& Options::add(const std::string& name, int* target, int def, std::string help,
                      std::optional<int> min, std::optional<int> max) {
  impl_->types.emplace_back(name, "an integer");
  add_number(impl_->desc, impl_->checks, name, target, def, help, min, max);
  impl_->values.emplace_back(name, [target] { return std::to_string(*target); });
  return *this;
}

Options& Options::add(const std::string& name, double* target, double def, std::string help,
                      std::optional<double> min, std::optional<double> max) {
  impl_->types.emplace_back(name, "a number");
  add_number(impl_->desc, impl_->checks, name, target, def, help, min, max);
  impl_->values.emplace_back(name, [target] { return short_text(*target); });
  return *this;
}

std::string Options::help() const {
  std::ostringstream os;
  os << "usage: "
     << (impl_->usage.empty() ? impl_->program + " [--config FILE] [--section.key=value ...]"
                              : impl_->usage)
     << "\n"
     << impl_->summary << "\n\n"
     << impl_->desc;
  return os.str();
}

Options& Options::usage(const std::string& line) {
  impl_->usage = line;
  return *this;
}

std::string Options::unquote(const std::string& value) {
  if (value.size() < 2 || value.front() != '"' || value.back() != '"') return value;
  std::string out;
  for (std::size_t i = 1; i + 1 < value.size(); ++i) {
    if (value[i] != '\\') {
      out += value[i];
      continue;
    }
    static const char from[] = "\\\"nrt", to[] = "\\\"\n\r\t";
    const char e = i + 2 < value.size() ? value[++i] : '\0';
    if (e == 'x' && i + 3 < value.size() &&
        std::isxdigit(static_cast<unsigned char>(value[i + 1])) &&
        std::isxdigit(static_cast<unsigned char>(value[i + 2]))) {
      out += static_cast<char>(std::stoi(value.substr(i + 1, 2), nullptr, 16));
      i += 2;
      continue;
    }
    const char* k = e ? std::strchr(from, e) : nullptr;
    DT_CHECK(ConfigError, k != nullptr, "unknown escape '\\", std::string(e ? 1 : 0, e),
             "' in the quoted value ", value, " (\\\\, \\\", \\n, \\r, \\t, \\xHH)");
    out += to[k - from];
  }
  return out;
}

std::string Options::dump() const {
  std::ostringstream os;
  for (const auto& [n, v] : impl_->values) {
    const std::string text = v();
    os << n << " = " << (needs_quotes(text) ? in_quotes(text) : text) << "\n";
  }
  return os.str();
}

namespace {
// Boost.Program_options' error::what() loops forever when a value it substitutes into its message
// (an option name, a token from the user) contains one of its placeholders, e.g.
// "%original_token%". Every '%' in the substituted values becomes '?' before what() is called.
struct PlaceholderScrub : po::error_with_option_name {
  static void scrub(po::error_with_option_name& e) {
    for (auto& kv : e.*(&PlaceholderScrub::m_substitutions))
      std::replace(kv.second.begin(), kv.second.end(), '%', '?');
  }
};
void scrub_placeholders(po::error_with_option_name& e) { PlaceholderScrub::scrub(e); }

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r");
  if (b == std::string::npos) return std::string();
  return s.substr(b, s.find_last_not_of(" \t\r") - b + 1);
}

// The settings of an INI file as options of `desc`. A line is "[section]", "key = value" (the
// option section.key; key alone before any section), blank, or a comment: '#' or ';' first on
// the line, or " #" (a '#' after a space or tab) to the end of the line. A '#' inside a value
// ("run#3", "http://host/#x") is part of it, where Boost's own reader cut the value short.
// Throws ConfigError naming the file and the line for anything else, an unknown option, and the
// options of the command line only ("config", "help").
po::parsed_options read_ini(std::istream& in, const po::options_description& desc,
                            const std::string& path, std::map<std::string, int>& seen) {
  po::parsed_options out(&desc);
  std::string line, prefix;
  seen.clear();  // option -> the line that set it
  // A line as messages show it: at most 80 characters.
  auto shown = [](const std::string& l) { return l.size() <= 80 ? l : l.substr(0, 77) + "..."; };
  for (int no = 1; std::getline(in, line); ++no) {
    if (no == 1 && line.rfind("\xEF\xBB\xBF", 0) == 0) line.erase(0, 3);  // a UTF-8 BOM
    // Text only: a binary file (a program given as --config, say) is named, not echoed.
    for (unsigned char ch : line)
      if (control_byte(ch) && ch != '\t' && ch != '\r') {
        char hex[8];
        std::snprintf(hex, sizeof hex, "0x%02x", ch);
        DT_THROW(ConfigError, "config file '", path, "' is not a text file (byte ", hex,
                 " in line ", no, ")");
      }
    // A value in quotes (as Options::dump writes one that needs them) is read to its closing
    // quote, escapes and all; only blanks and a comment may follow.
    std::string quoted_value;
    bool has_quoted = false;
    if (const auto eq = line.find('='); eq != std::string::npos) {
      const auto q = line.find_first_not_of(" \t", eq + 1);
      const auto first = line.find_first_not_of(" \t");
      if (q != std::string::npos && line[q] == '"' && line[first] != '#' && line[first] != ';' &&
          line[first] != '[') {
        const std::string at = " in config file '" + path + "' line " + std::to_string(no);
        std::size_t i = q + 1;  // to the closing quote, past escaped characters
        while (i < line.size() && line[i] != '"') i += line[i] == '\\' ? 2 : 1;
        DT_CHECK(ConfigError, i < line.size(), "a quoted value has no closing '\"'", at);
        try {
          quoted_value = Options::unquote(line.substr(q, i + 1 - q));
        } catch (const ConfigError& e) {
          DT_THROW(ConfigError, e.message(), at);
        }
        const std::string after = trim(line.substr(i + 1));
        DT_CHECK(ConfigError, after.empty() || after[0] == '#' || after[0] == ';', "'", after,
                 "' after a quoted value", at);
        line = line.substr(0, eq + 1) + " \"\"";
        has_quoted = true;
      }
    }
    for (std::size_t i = 1; i < line.size(); ++i)
      if (line[i] == '#' && (line[i - 1] == ' ' || line[i - 1] == '\t')) {
        line.erase(i);
        break;
      }
    line = trim(line);
    if (line.empty() || line[0] == '#' || line[0] == ';') continue;
    const std::string at = " in config file '" + path + "' line " + std::to_string(no);
    if (line[0] == '[') {
      DT_CHECK(ConfigError, line.back() == ']' && line.size() > 2, "section header '", shown(line),
               "' is not '[name]'", at);
      prefix = trim(line.substr(1, line.size() - 2)) + ".";
      continue;
    }
    const auto eq = line.find('=');
    DT_CHECK(ConfigError, eq != std::string::npos && eq > 0, "'", shown(line),
             "' is not 'key = value'", at);
    const std::string key = trim(line.substr(0, eq));
    const std::string name = prefix + key;
    DT_CHECK(ConfigError, desc.find_nothrow(name, false) != nullptr, "unrecognised option '",
             shown(name), "'", at);
    DT_CHECK(ConfigError, name != "config" && name != "help", "option '", name,
             "' belongs on the command line, not in a config file (config file '", path, "' line ",
             no, ")");
    const auto [was, fresh] = seen.emplace(name, no);
    DT_CHECK(ConfigError, fresh, "option '", name, "' is set twice in config file '", path,
             "' (lines ", was->second, " and ", no, ")");
    const std::string value = has_quoted ? quoted_value : trim(line.substr(eq + 1));
    // A switch (true or false, bare on the command line: --ckpt.async) given no value in a file
    // ("async =", often meant as "the default") would be turned on: refused.
    DT_CHECK(ConfigError, !value.empty() || desc.find(name, false).semantic()->min_tokens() != 0,
             "option '", name, "' has an empty value", at, ": expected true or false");
    po::option o(name, {value});
    o.original_tokens = {name, o.value[0]};
    out.options.push_back(std::move(o));
  }
  return out;
}
}  // namespace

bool Options::parse(int argc, const char* const* argv) {
  po::variables_map vm;
  std::string source = "command line";
  std::string file_source;                     // "config file 'PATH'" once --config was given
  std::vector<std::string> from_command_line;  // options the command line set explicitly
  std::map<std::string, int> file_lines;       // option -> its line in the config file
  // Where a value of `name` came from, for a message: the file with its line, or `source`.
  auto at_line = [&](const std::string& name, const std::string& from) {
    const auto it = file_lines.find(name);
    return it == file_lines.end() || from != file_source
               ? from
               : from + " line " + std::to_string(it->second);
  };
  try {
    // No guessing from prefixes: "--train.step=5" is no abbreviation of --train.steps (it would
    // change meaning the day another option shares the prefix, and a file refuses it anyway).
    namespace style = po::command_line_style;
    const po::parsed_options cmdline = po::command_line_parser(argc, argv)
                                           .options(impl_->desc)
                                           .style(style::default_style & ~style::allow_guessing)
                                           .run();
    // A bare word is no option of ours (po would silently drop it): "--n 3 4", "fast".
    for (const auto& o : cmdline.options)
      if (o.position_key >= 0 || o.string_key.empty())
        DT_THROW(ConfigError, "unexpected argument '",
                 o.original_tokens.empty() ? std::string() : o.original_tokens.front(),
                 "' in command line (settings are given as --name=value)");
    po::store(cmdline, vm);
    for (const auto& [name, value] : vm)
      if (!value.defaulted()) from_command_line.push_back(name);
    if (vm.count("help")) {
      std::cout << help();
      return false;
    }
    if (vm.count("config")) {
      const std::string path = vm["config"].as<std::string>();
      source = "config file '" + path + "'";
      file_source = source;
      std::ifstream in(path);
      DT_CHECK(ConfigError, in.good(), "config file '", path, "' cannot be read (",
               std::strerror(errno), ")");
      struct stat st {};  // (a pipe such as <(...) is fine; a directory opens and reads nothing)
      DT_CHECK(ConfigError, !(::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)),
               "config file '", path, "' is a directory");
      const po::parsed_options from_file = read_ini(in, impl_->desc, path, file_lines);
      DT_CHECK(ConfigError, !in.bad(), "config file '", path, "' could not be read to the end");
      // Every value of the file is converted and checked (range, choices), also those the
      // command line overrides (kept by `vm` alone, which takes the first value): a broken file
      // does not wait for the day an override is dropped. The file's values go into the
      // variables for the checks; notify(vm) below gives them their final values.
      {
        po::variables_map whole;
        po::store(from_file, whole);
        po::notify(whole);
        for (const auto& [name, check] : impl_->checks) {
          if (!file_lines.count(name) ||
              std::find(from_command_line.begin(), from_command_line.end(), name) ==
                  from_command_line.end())
            continue;  // the others are checked below, with their final values
          const std::string problem = check();
          DT_CHECK(ConfigError, problem.empty(), "option --", name, ": ", problem, " in ",
                   at_line(name, file_source), " (the command line overrides it)");
        }
      }
      po::store(from_file, vm);
    }
    po::notify(vm);
  } catch (po::invalid_option_value& e) {
    scrub_placeholders(e);
    std::string opt = e.get_option_name();
    std::string key = opt.rfind("--", 0) == 0 ? opt.substr(2) : opt;
    DT_THROW(ConfigError, e.what(), " in ", at_line(key, source), " (expected ",
             impl_->expected(key), ")");
  } catch (po::error& e) {
    std::string key;
    if (auto* named = dynamic_cast<po::error_with_option_name*>(&e)) {
      scrub_placeholders(*named);
      key = named->get_option_name();
      if (key.rfind("--", 0) == 0) key = key.substr(2);
    }
    DT_THROW(ConfigError, e.what(), " in ", at_line(key, source));
  }
  // Range and choice problems name where the bad value came from, like the errors above.
  for (const auto& [name, check] : impl_->checks) {
    const std::string problem = check();
    if (problem.empty()) continue;
    std::string where = "the default value";
    if (std::find(from_command_line.begin(), from_command_line.end(), name) !=
        from_command_line.end())
      where = "command line";
    else if (vm.count(name) && !vm[name].defaulted() && !file_source.empty())
      where = at_line(name, file_source);
    DT_THROW(ConfigError, "option --", name, ": ", problem, " in ", where);
  }
  impl_->given.clear();
  for (const auto& [name, value] : vm)
    if (!value.defaulted() && name != "config") impl_->given.push_back(name);
  return true;
}

bool Options::given(const std::string& name) const {
  return std::find(impl_->given.begin(), impl_->given.end(), name) != impl_->given.end();
}

int run_with_config_errors(const char* program, const std::function<int()>& body, bool quiet) {
  try {
    return body();
  } catch (const ConfigError& e) {
    if (quiet) {
      // The reporting rank must print first: mpiexec ends the whole job at the first non-zero
      // exit, and a quiet rank that left at once could take the report down with it.
      std::this_thread::sleep_for(std::chrono::seconds(2));
      return 2;
    }
    const std::string p = program;
    const std::string text = p + ": error: " + e.message() + "\n" + p + ": run '" + p +
                             " --help' for the list of options\n";
    // One string in one insertion: std::cerr is unbuffered, so it reaches stderr in one write
    // and lines of ranks sharing the terminal do not run into each other.
    std::cerr << text << std::flush;
    return 2;
  }
}

namespace {

// The first of `names` that is set to a number from 0 to INT_MAX; -1 when none is.
int first_number_of(std::initializer_list<const char*> names) {
  for (const char* name : names) {
    const char* v = std::getenv(name);
    if (!v || !*v) continue;
    char* end = nullptr;
    const long r = std::strtol(v, &end, 10);
    if (*end == '\0' && r >= 0 && r <= std::numeric_limits<int>::max()) return static_cast<int>(r);
  }
  return -1;
}

}  // namespace

int launcher_rank() {
  return first_number_of({"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"});
}

int launcher_local_rank() {
  return first_number_of({"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"});
}

bool quiet_option_errors(int argc, const char* const* argv) {
  const int rank = launcher_rank();
  if (rank <= 0) return false;
  // An MPMD launch of Open MPI (mpirun -n 2 A : -n 2 B) gives each program its own command line:
  // the first rank of each speaks for it (OMPI_MCA_orte_app_num: the program's index;
  // OMPI_APP_CTX_NUM_PROCS: the rank counts of all, in order).
  const char* apps = std::getenv("OMPI_NUM_APP_CTX");
  const char* app = std::getenv("OMPI_MCA_orte_app_num");
  const char* counts = std::getenv("OMPI_APP_CTX_NUM_PROCS");
  if (apps && app && counts && std::atoi(apps) > 1) {
    std::istringstream in(counts);
    int first = 0, n = 0;
    for (int k = 0; k < std::atoi(app) && in >> n; ++k) first += n;
    if (rank == first) return false;
  }
  if (config_file_given(argc, argv)) return launcher_local_rank() > 0;
  return true;
}

bool config_file_given(int argc, const char* const* argv) {
  for (int i = 1; i < argc; ++i)
    if (std::strncmp(argv[i], "--config", 8) == 0) return true;
  return false;
}

std::uint64_t parse_size(const std::string& option, const std::string& text) {
  // DIGITS[.DIGITS][K|M|G|T][B|iB], the suffix in any case.
  std::size_t i = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) ++i;
  const std::size_t whole = i;
  if (i < text.size() && text[i] == '.')
    for (++i; i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]));) ++i;
  const std::size_t number = i;
  std::string suffix = text.substr(number);
  for (auto& c : suffix) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  int shift = suffix.empty() || suffix == "B" ? 0 : -1;
  for (const auto& [s, v] : {std::pair<const char*, int>{"K", 10}, {"M", 20}, {"G", 30}, {"T", 40}})
    if (suffix == s || suffix == std::string(s) + "B" || suffix == std::string(s) + "IB") shift = v;
  const bool digits = whole > 0 || number > whole + 1;  // "8", "8.5", ".5"; not "." or ""
  DT_CHECK(ConfigError, digits && shift >= 0, "option --", option, ": '", text,
           "' is not a size (bytes, with an optional K, M, G or T suffix: 8, 64K, 1.5G)");
  // The whole part exactly, the fraction of a unit rounded down.
  std::uint64_t n = 0;
  bool fits = true;
  for (std::size_t k = 0; k < whole; ++k) {
    const auto d = static_cast<std::uint64_t>(text[k] - '0');
    fits = fits && n <= (std::numeric_limits<std::uint64_t>::max() - d) / 10;
    n = n * 10 + d;
  }
  fits = fits && n <= (std::numeric_limits<std::uint64_t>::max() >> shift);
  DT_CHECK(ConfigError, fits, "option --", option, ": ", text, " is too large");
  const long double fraction =
      number > whole + 1 ? std::strtold(text.substr(whole, number - whole).c_str(), nullptr) : 0;
  DT_CHECK(ConfigError, shift > 0 || fraction == 0, "option --", option, ": ", text,
           " is not a whole number of bytes (a fraction takes a unit: 1.5K, 0.5M)");
  const auto extra = static_cast<std::uint64_t>(std::ldexp(fraction, shift));
  DT_CHECK(ConfigError, (n << shift) <= std::numeric_limits<std::uint64_t>::max() - extra,
           "option --", option, ": ", text, " is too large");
  return (n << shift) + extra;
}

void ensure_writable_dir(const std::string& option, const std::string& dir) {
  DT_CHECK(ConfigError, !dir.empty(), "option ", option, ": an empty folder name");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  DT_CHECK(ConfigError, !ec, "option ", option, ": cannot create '", dir, "': ", ec.message());
  const int err = file_creation_error(dir);
  DT_CHECK(ConfigError, err == 0, "option ", option, ": '", dir,
           "' is not a writable directory: ", std::strerror(err));
}

int file_creation_error(const std::string& dir) {
  static std::atomic<unsigned> calls{0};
  for (int attempt = 0; attempt < 100; ++attempt) {  // a name left by a crash: the next
    const std::string probe =
        dir + "/.dt-write-check." + std::to_string(::getpid()) + "." + std::to_string(calls++);
    const int fd =
        ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd >= 0) {
      ::close(fd);
      ::unlink(probe.c_str());
      return 0;
    }
    if (errno != EEXIST) return errno;
  }
  return EEXIST;
}

}  // namespace dt
