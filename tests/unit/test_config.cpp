// dt::Options: defaults, command line, INI files, validation and error messages.
#include <doctest/doctest.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "dt/config.hpp"
#include "dt/error.hpp"
#include "temp_dir.hpp"

namespace fs = std::filesystem;

namespace {

using TempDir = dt::test::TempDir;

// One app's worth of settings of every kind.
struct App {
  std::string name;
  bool verbose = false;
  bool fast = false;
  long iters = 0;
  long offset = 0;
  double lr = 0;
  double scale = 0;
  std::string mode;
  dt::Options opts{"app", "a test app"};

  App() {
    opts.add("name", &name, "default-name", "run name")
        .add("verbose", &verbose, false, "talk more")
        .add("fast", &fast, true, "take shortcuts")
        .add("check.iters", &iters, 5, "iterations", 1L, 100L)
        .add("check.offset", &offset, -3, "any integer")
        .add("train.lr", &lr, 0.5, "learning rate", 0.0, 1.0)
        .add("train.scale", &scale, 2.0, "unbounded number")
        .add("train.mode", &mode, "fast", "mode", {"fast", "slow", "exact"});
  }
  bool parse(std::vector<const char*> args) {
    args.insert(args.begin(), "app");
    return opts.parse(static_cast<int>(args.size()), args.data());
  }
};

// Parses and expects a ConfigError whose message contains every needle.
void expect_error(std::vector<const char*> args, const std::vector<std::string>& needles) {
  App app;
  std::string cmd;
  for (const char* a : args) cmd += std::string(a) + " ";
  CAPTURE(cmd);
  try {
    app.parse(args);
    FAIL_CHECK("no ConfigError");
  } catch (const dt::ConfigError& e) {
    const std::string msg = e.message();
    CAPTURE(msg);
    for (const auto& n : needles) {
      CAPTURE(n);
      CHECK(msg.find(n) != std::string::npos);
    }
  }
}

// Redirects std::cout or std::cerr into a string while alive.
struct Capture {
  std::ostream& os;
  std::ostringstream buf;
  std::streambuf* old;
  explicit Capture(std::ostream& s) : os(s), old(s.rdbuf(buf.rdbuf())) {}
  ~Capture() { os.rdbuf(old); }
  std::string str() const { return buf.str(); }
};

}  // namespace

TEST_CASE("Options: defaults when nothing is given") {
  App app;
  CHECK(app.parse({}));
  CHECK(app.name == "default-name");
  CHECK(app.verbose == false);
  CHECK(app.fast == true);
  CHECK(app.iters == 5);
  CHECK(app.offset == -3);
  CHECK(app.lr == 0.5);
  CHECK(app.scale == 2.0);
  CHECK(app.mode == "fast");
}

TEST_CASE("Options: command line overrides, both --k=v and --k v") {
  App app;
  CHECK(app.parse({"--name=run 7", "--check.iters", "42", "--check.offset=-12", "--train.lr=0.25",
                   "--train.scale", "-1e3", "--train.mode=exact"}));
  CHECK(app.name == "run 7");
  CHECK(app.iters == 42);
  CHECK(app.offset == -12);
  CHECK(app.lr == 0.25);
  CHECK(app.scale == -1000.0);
  CHECK(app.mode == "exact");
  CHECK(app.verbose == false);  // untouched ones keep their defaults
  CHECK(app.fast == true);
}

TEST_CASE("Options: range limits are inclusive") {
  {
    App app;
    CHECK(app.parse({"--check.iters=1", "--train.lr=0"}));
    CHECK(app.iters == 1);
    CHECK(app.lr == 0.0);
  }
  {
    App app;
    CHECK(app.parse({"--check.iters=100", "--train.lr=1"}));
    CHECK(app.iters == 100);
    CHECK(app.lr == 1.0);
  }
}

TEST_CASE("Options: bool forms") {
  {
    App app;
    CHECK(app.parse({"--verbose"}));
    CHECK(app.verbose == true);
  }
  {
    App app;
    CHECK(app.parse({"--fast=false"}));
    CHECK(app.fast == false);
  }
  {
    App app;
    CHECK(app.parse({"--verbose=true", "--fast=0"}));
    CHECK(app.verbose == true);
    CHECK(app.fast == false);
  }
  {
    App app;
    CHECK(app.parse({"--verbose=yes", "--fast=off"}));
    CHECK(app.verbose == true);
    CHECK(app.fast == false);
  }
  expect_error({"--verbose=maybe"}, {"verbose", "command line"});
}

TEST_CASE("Options: --help prints the help and returns false") {
  App app;
  bool r = true;
  std::string out;
  {
    Capture cap(std::cout);
    r = app.parse({"--help"});
    out = cap.str();
  }
  CHECK_FALSE(r);
  CHECK(out == app.opts.help());
  CHECK(out.find("usage: app") != std::string::npos);
  CHECK(out.find("a test app") != std::string::npos);
  for (const char* n : {"--config", "--name", "--verbose", "--check.iters", "--train.lr",
                        "--train.mode", "run name", "learning rate"})
    CHECK(out.find(n) != std::string::npos);
  CHECK(out.find("fast|slow|exact") != std::string::npos);  // the choices are listed

  App app2;
  {
    Capture cap(std::cout);
    CHECK_FALSE(app2.parse({"-h"}));
  }
  // A program with arguments of its own names them in its usage line.
  App app3;
  app3.opts.usage("app FILE [--option=value ...]");
  CHECK(app3.opts.help().rfind("usage: app FILE [--option=value ...]\n", 0) == 0);
}

TEST_CASE("Options: command-line errors name the option") {
  expect_error({"--bogus=1"}, {"bogus", "command line"});
  expect_error({"--check.iterz=3"}, {"check.iterz"});
  // No abbreviations: a prefix of one option is no option (an INI file refuses it too).
  expect_error({"--check.iter=3"}, {"check.iter", "command line"});
  expect_error({"--train.l=0.1"}, {"train.l", "command line"});
  expect_error({"--na=x"}, {"na", "command line"});
  expect_error({"--check.iters=abc"}, {"check.iters", "abc", "command line", "integer"});
  expect_error({"--check.iters=1.5"}, {"check.iters", "1.5", "integer"});
  expect_error({"--check.iters", "7x"}, {"check.iters", "7x"});
  expect_error({"--train.lr=fast"}, {"train.lr", "fast", "number"});
  expect_error({"--check.iters=0"}, {"check.iters", "0", "minimum", "command line"});
  expect_error({"--check.iters=101"}, {"check.iters", "101", "maximum", "command line"});
  expect_error({"--check.iters=-5"}, {"check.iters", "-5", "minimum"});
  expect_error({"--train.lr=1.5"}, {"train.lr", "1.5", "maximum"});
  expect_error({"--train.lr=-0.01"}, {"train.lr", "minimum"});
  expect_error({"--train.mode=medium"},
               {"train.mode", "'medium'", "fast|slow|exact", "command line"});
  expect_error({"--train.mode=Fast"}, {"train.mode", "Fast"});  // choices are case-sensitive
  expect_error({"--check.iters=3", "--check.iters=4"}, {"check.iters"});
  expect_error({"--check.iters"}, {"check.iters"});  // missing value
}

TEST_CASE("Options: an INI file given with --config overrides the defaults") {
  TempDir dir;
  const std::string ini = dir.write("run.ini",
                                    "# a comment\n"
                                    "name = from-ini\n"
                                    "verbose = true\n"
                                    "fast = false\n"
                                    "[check]\n"
                                    "iters = 77\n"
                                    "[train]\n"
                                    "lr = 0.125\n"
                                    "mode = slow\n");
  App app;
  CHECK(app.parse({"--config", ini.c_str()}));
  CHECK(app.name == "from-ini");
  CHECK(app.verbose == true);
  CHECK(app.fast == false);
  CHECK(app.iters == 77);
  CHECK(app.offset == -3);  // not in the file: default
  CHECK(app.lr == 0.125);
  CHECK(app.scale == 2.0);
  CHECK(app.mode == "slow");
}

TEST_CASE("Options: INI comments, and '#' inside a value") {
  TempDir dir;
  const std::string ini = dir.write("c.ini",
                                    "\xEF\xBB\xBF; a comment after a byte-order mark\r\n"
                                    "name = run#3/x#y   # the run's name\r\n"
                                    "  # an indented comment\n"
                                    "[ train ]\n"
                                    "mode=exact\t# a comment after a tab\n"
                                    "lr = 0.25 # scaled\n"
                                    "[check]\n"
                                    "iters =\t12\n");
  App app;
  CHECK(app.parse({"--config", ini.c_str()}));
  CHECK(app.name == "run#3/x#y");
  CHECK(app.mode == "exact");
  CHECK(app.lr == 0.25);
  CHECK(app.iters == 12);
}

TEST_CASE("Options: the command line beats the INI file, in either order") {
  TempDir dir;
  const std::string ini = dir.write("run.ini",
                                    "verbose = true\n"
                                    "[check]\niters = 77\noffset = 9\n"
                                    "[train]\nmode = slow\n");
  const std::string cfg = "--config=" + ini;
  {
    App app;
    CHECK(app.parse({cfg.c_str(), "--check.iters=8", "--verbose=false", "--train.mode=exact"}));
    CHECK(app.iters == 8);
    CHECK(app.verbose == false);
    CHECK(app.mode == "exact");
    CHECK(app.offset == 9);  // only in the file
  }
  {
    App app;
    CHECK(app.parse({"--check.iters=8", cfg.c_str()}));
    CHECK(app.iters == 8);
    CHECK(app.mode == "slow");
  }
  // A file value out of range is refused even where the command line overrides it (the file is
  // checked whole, as its values' types are: it would break the day the override is dropped).
  const std::string bad = "--config=" + dir.write("bad.ini", "[check]\niters = 1000\n");
  {
    App app;
    CHECK_THROWS_WITH_AS(app.parse({bad.c_str(), "--check.iters=10"}),
                         doctest::Contains("1000 is above the maximum 100 in config file"),
                         dt::ConfigError);
  }
}

TEST_CASE("Options: INI problems name the option and the file") {
  TempDir dir;
  auto check_file = [&](const std::string& file, const std::string& text,
                        std::vector<std::string> needles) {
    const std::string path = dir.write(file, text);
    const std::string arg = "--config=" + path;
    needles.push_back(path);
    expect_error({arg.c_str()}, needles);
  };
  check_file("unknown_key.ini", "[check]\nitersx = 3\n", {"check.itersx"});
  check_file("unknown_section.ini", "[nope]\niters = 3\n", {"nope.iters"});
  check_file("unknown_top.ini", "colour = red\n", {"colour"});
  check_file("bad_int.ini", "[check]\niters = lots\n",
             {"check.iters", "lots", "integer", "' line 2 (expected"});
  check_file("bad_double.ini", "[train]\nlr = x\n", {"train.lr", "number"});
  check_file("bad_bool.ini", "verbose = maybe\n", {"verbose", "maybe"});
  // A switch with no value is not turned on (it was: Boost takes the bare --verbose's true).
  check_file("empty_bool.ini", "# x\nverbose =\n",
             {"option 'verbose' has an empty value", "line 2", "expected true or false"});
  check_file("empty_quoted_bool.ini", "verbose = \"\"  # off?\n",
             {"option 'verbose' has an empty value", "line 1"});
  check_file("too_big.ini", "[check]\niters = 1000\n", {"check.iters", "1000", "maximum"});
  check_file("too_small.ini", "[train]\n\nlr = -2\n", {"train.lr", "minimum", "' line 3"});
  check_file("bad_choice.ini", "[train]\nmode = medium\n",
             {"train.mode", "medium", "fast|slow|exact"});
  check_file("twice.ini", "[check]\niters = 3\niters = 4\n",
             {"option 'check.iters' is set twice in config file", "(lines 2 and 3)"});
  check_file("binary.ini",
             std::string("\x7f"
                         "ELF\x02\x01\x01\0\0junk\n",
                         14),
             {"is not a text file (byte 0x7f in line 1)"});
  check_file("escape.ini", "[check]\niters = 3\x1b[2J\n",
             {"is not a text file (byte 0x1b in line 2)"});
  check_file("long_line.ini", "[check]\n" + std::string(5000, 'x') + "\n",
             {"'" + std::string(77, 'x') + "...' is not 'key = value'", "line 2"});
  check_file("line_no.ini", "# x\n\n[check]\nitersx = 3\n", {"'check.itersx'", "line 4"});
  check_file("no_equals.ini", "[check]\niters 3\n", {"'iters 3' is not 'key = value'", "line 2"});
  check_file("no_key.ini", "= 3\n", {"'= 3' is not 'key = value'", "line 1"});
  check_file("bad_section.ini", "[check\niters = 3\n", {"'[check' is not '[name]'", "line 1"});
  check_file("empty_section.ini", "[]\niters = 3\n", {"'[]' is not '[name]'"});
  check_file(
      "config_key.ini", "config = other.ini\n",
      {"'config' belongs on the command line, not in a config file (config file '", "' line 1)"});
  check_file("help_key.ini", "help = 1\n", {"'help' belongs on the command line"});

  // A value of the file that the command line overrides is still refused where it is no value
  // of its option (the file is read whole, not only where it decides).
  {
    const std::string path = dir.write("overridden.ini", "[check]\niters = 3x\n");
    const std::string arg = "--config=" + path;
    expect_error({arg.c_str(), "--check.iters=4"}, {"check.iters", "3x", path});
  }
  // So is one out of its range, or not one of its choices.
  {
    const std::string path = dir.write("overridden_range.ini", "[check]\niters = 500\n");
    const std::string arg = "--config=" + path;
    expect_error({arg.c_str(), "--check.iters=4"},
                 {"option --check.iters: 500 is above the maximum 100 in config file '", path,
                  "' line 2 (the command line overrides it)"});
  }
  {
    const std::string path = dir.write("overridden_choice.ini", "[train]\nmode = quick\n");
    const std::string arg = "--config=" + path;
    expect_error({arg.c_str(), "--train.mode=slow"},
                 {"option --train.mode: 'quick' is not one of fast|slow|exact in config file '",
                  path, "' line 2"});
  }

  // The same range problem on the command line does not blame the file.
  const std::string ok = dir.write("ok.ini", "[check]\niters = 3\n");
  const std::string arg = "--config=" + ok;
  App app;
  try {
    app.parse({arg.c_str(), "--train.lr=7"});
    FAIL_CHECK("no ConfigError");
  } catch (const dt::ConfigError& e) {
    CAPTURE(e.message());
    CHECK(e.message().find("train.lr") != std::string::npos);
    CHECK(e.message().find("command line") != std::string::npos);
    CHECK(e.message().find(ok) == std::string::npos);
  }
}

TEST_CASE("Options: a missing config file is a ConfigError naming the path") {
  TempDir dir;
  const std::string path = (dir.path / "does_not_exist.ini").string();
  const std::string arg = "--config=" + path;
  expect_error({arg.c_str()}, {path});
}

TEST_CASE("Options: errors are ConfigError, which is a dt::Error") {
  App app;
  CHECK_THROWS_AS(app.parse({"--bogus"}), dt::ConfigError);
  App app2;
  CHECK_THROWS_AS(app2.parse({"--check.iters=0"}), dt::Error);
}

TEST_CASE("Options: a stray bare word on the command line is an error, not silently dropped") {
  expect_error({"positional"}, {"'positional'", "command line"});
  expect_error({"--check.iters", "3", "4"}, {"'4'"});
  expect_error({"--name=x", "fast"}, {"'fast'"});
  // A bool's value may follow as the next word; that word is the value, not a stray.
  App app;
  CHECK(app.parse({"--fast", "false", "--check.iters", "3"}));
  CHECK(app.fast == false);
  CHECK(app.iters == 3);
}

TEST_CASE("Options: given tells a setting from a default") {
  TempDir dir;
  const std::string ini = dir.write("g.ini", "[train]\nlr = 0.5\n");
  App app;
  CHECK(app.parse({"--config", ini.c_str(), "--name=default-name"}));
  CHECK(app.opts.given("name"));      // the default's value, but given
  CHECK(app.opts.given("train.lr"));  // from the file
  CHECK_FALSE(app.opts.given("check.iters"));
  CHECK_FALSE(app.opts.given("config"));
  App none;
  CHECK(none.parse({}));
  CHECK_FALSE(none.opts.given("name"));
}

TEST_CASE("Options: dump lists every option as parsed, in declaration order") {
  App app;
  CHECK(app.parse(
      {"--name=x", "--verbose", "--check.iters=9", "--train.lr=0.25", "--train.mode=slow"}));
  CHECK(app.opts.dump() ==
        "name = x\n"
        "verbose = true\n"
        "fast = true\n"
        "check.iters = 9\n"
        "check.offset = -3\n"
        "train.lr = 0.25\n"
        "train.scale = 2\n"
        "train.mode = slow\n");
}

// What dump writes reads back as the same settings (--print-config's output as a config file):
// values with a line break, a tab, spaces at either end, a comment in them, or a quote first are
// written in quotes with escapes.
TEST_CASE("Options: dump reads back as the same settings") {
  TempDir dir;
  for (const std::string& name :
       {std::string("plain"), std::string("\n"), std::string("  lead # not a comment ; x = y"),
        std::string("tab\there\r"), std::string("\"quoted\" and \\back\\"), std::string("#first"),
        std::string(";first"), std::string("trail "), std::string("run#3"),
        std::string("ctl\x01x\x7f"
                    "end")}) {
    App a;
    const std::string arg = "--name=" + name;
    REQUIRE(a.parse({arg.c_str(), "--check.iters=9"}));
    const std::string text = a.opts.dump();
    const std::string ini = dir.write("dump.ini", text);
    App b;
    REQUIRE(b.parse({"--config", ini.c_str()}));
    CHECK_MESSAGE(b.name == name, "dump: ", text);
    CHECK(b.iters == 9);
    CHECK(b.opts.dump() == text);
  }
  App a;
  REQUIRE(a.parse({"--name=\n"}));
  CHECK(a.opts.dump().rfind("name = \"\\n\"\n", 0) == 0);
  App ctl;
  REQUIRE(
      ctl.parse({"--name=a\x01"
                 "b"}));
  CHECK(ctl.opts.dump().rfind("name = \"a\\x01b\"\n", 0) == 0);
  auto check_file = [&](const std::string& text, std::vector<std::string> needles) {
    const std::string arg = "--config=" + dir.write("q.ini", text);
    expect_error({arg.c_str()}, needles);
  };
  check_file("name = \"open\n", {"no closing '\"'", "line 1"});
  check_file("name = \"a\\qb\"\n", {"unknown escape '\\q'"});
  check_file("name = \"a\" b\n", {"'b' after a quoted value"});
  App c;
  const std::string ini = dir.write("c.ini", "name = \"x # y\"  # a comment\n");
  REQUIRE(c.parse({"--config", ini.c_str()}));
  CHECK(c.name == "x # y");
  // unquote reads a dumped value back (checkpoints' config text is compared so).
  CHECK(dt::Options::unquote("\"a\\nb \\\"c\\\" \\\\\"") == "a\nb \"c\" \\");
  CHECK(dt::Options::unquote("plain #x") == "plain #x");
  CHECK(dt::Options::unquote("\"") == "\"");
  CHECK_THROWS_AS(dt::Options::unquote("\"a\\qb\""), dt::ConfigError);
  // An empty value (a string option's default, say) is written and read as such.
  App e;
  const std::string empty = dir.write("e.ini", "name =\n");
  REQUIRE(e.parse({"--config", empty.c_str()}));
  CHECK(e.name.empty());
  CHECK(e.opts.dump().rfind("name = \n", 0) == 0);
}

// Numbers keep every digit given: --print-config and the comparison of options between ranks
// read the dump, where six significant digits made 0.0012345678 and 0.0012345671 the same.
TEST_CASE("Options: dump writes numbers with the digits they need to read back") {
  TempDir dir;
  for (const char* v : {"0.0012345678", "0.1", "3e-08", "0.30000000000000004", "1e+300",
                        "9.8912345678e+14", "2.5"}) {
    App a;
    const std::string arg = std::string("--train.scale=") + v;
    REQUIRE(a.parse({arg.c_str()}));
    const std::string text = a.opts.dump();
    const std::size_t at = text.find("train.scale = ");
    REQUIRE(at != std::string::npos);
    const std::string written = text.substr(at + 14, text.find('\n', at) - at - 14);
    CHECK_MESSAGE(std::strtod(written.c_str(), nullptr) == std::strtod(v, nullptr), v,
                  " written as ", written);
    CHECK_MESSAGE(written.size() <= std::string(v).size() + 1, v, " written as ", written);
    App b;
    const std::string ini = dir.write("n.ini", text);
    REQUIRE(b.parse({"--config", ini.c_str()}));
    CHECK(b.scale == a.scale);
  }
  App c, d;
  REQUIRE(c.parse({"--train.lr=0.0012345678"}));
  REQUIRE(d.parse({"--train.lr=0.0012345671"}));
  CHECK(c.opts.dump() != d.opts.dump());
}

TEST_CASE("Options: help shows a default that needs them in quotes, as a config file takes it") {
  std::string prompt, plain;
  dt::Options o{"app", "a test app"};
  o.add("sample.prompt", &prompt, "\n", "text to start from").add("name", &plain, "x", "a name");
  const std::string h = o.help();
  CHECK(h.find("--sample.prompt arg (=\"\\n\")") != std::string::npos);
  CHECK(h.find("--name arg (=x)") != std::string::npos);
}

TEST_CASE("Options: a setting of two words held as a bool") {
  TempDir dir;
  auto parse = [](std::vector<const char*> args, bool def, bool& flash) {
    dt::Options o{"app", "a test app"};
    o.add("model.attention", &flash, def, "attention", {"flash", "full"});
    args.insert(args.begin(), "app");
    CHECK(o.parse(static_cast<int>(args.size()), args.data()));
    return o.dump();
  };
  bool flash = false;
  CHECK(parse({}, true, flash) == "model.attention = flash\n");
  CHECK(flash);
  CHECK(parse({}, false, flash) == "model.attention = full\n");
  CHECK(!flash);
  CHECK(parse({"--model.attention=full"}, true, flash) == "model.attention = full\n");
  CHECK(!flash);
  CHECK(parse({"--model.attention", "flash"}, false, flash) == "model.attention = flash\n");
  CHECK(flash);
  const std::string ini = dir.write("run.ini", "[model]\nattention = full\n");
  CHECK(parse({"--config", ini.c_str()}, true, flash) == "model.attention = full\n");
  CHECK(!flash);
  // Neither word: refused, naming the option, the words and where the value came from; the
  // target keeps its default until a value is accepted.
  for (const auto& [arg, where] : std::vector<std::pair<std::string, std::string>>{
           {"--model.attention=true", "command line"},
           {"--model.attention=ful", "command line"},
           {"--model.attention=Flash", "command line"}}) {
    CAPTURE(arg);
    dt::Options o{"app", "a test app"};
    bool f = false;
    o.add("model.attention", &f, true, "attention", {"flash", "full"});
    const char* argv[] = {"app", arg.c_str()};
    try {
      o.parse(2, argv);
      FAIL_CHECK("no ConfigError");
    } catch (const dt::ConfigError& e) {
      const std::string msg = e.message();
      CAPTURE(msg);
      CHECK(msg.find("--model.attention") != std::string::npos);
      CHECK(msg.find("flash|full") != std::string::npos);
      CHECK(msg.find(where) != std::string::npos);
    }
  }
  {
    dt::Options o{"app", "a test app"};
    bool f = false;
    o.add("model.attention", &f, true, "attention", {"flash", "full"});
    CHECK(o.help().find("{flash|full}") != std::string::npos);
  }
}

TEST_CASE("Options: node_local marks the option added last") {
  std::string a, b, c;
  dt::Options o{"app", "a test app"};
  o.add("data.path", &a, "", "data").node_local().add("train.mode", &b, "x", "mode");
  o.add("trace.dir", &c, "", "traces").node_local();
  CHECK(o.node_local_options() == std::vector<std::string>{"data.path", "trace.dir"});
  dt::Options none{"app", "a test app"};
  CHECK(none.node_local_options().empty());
  CHECK_THROWS_AS(none.node_local(), dt::InvalidArgument);
}

namespace {
// The message of parse_size's ConfigError for `text` ("" when it returns).
std::string size_error(const char* text, const char* option = "x") {
  try {
    dt::parse_size(option, text);
  } catch (const dt::ConfigError& e) {
    return e.what();
  }
  return "";
}
bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}
}  // namespace

TEST_CASE("parse_size: sizes with units and fractions, 0, and refused text") {
  CHECK(dt::parse_size("mem.limit", "8G") == 8ull << 30);
  CHECK(dt::parse_size("mem.limit", "512M") == 512ull << 20);
  CHECK(dt::parse_size("mem.limit", "0") == 0);
  CHECK(dt::parse_size("mem.limit", "123456") == 123456);
  CHECK(dt::parse_size("mem.limit", "1.5T") == 3ull << 39);
  CHECK(dt::parse_size("mem.limit", "4K") == 4096);
  CHECK(dt::parse_size("mem.limit", "8GB") == 8ull << 30);
  CHECK(dt::parse_size("mem.limit", "2gib") == 2ull << 30);
  CHECK(dt::parse_size("mem.limit", "0.3K") == 307);  // a fraction of a unit, rounded down
  CHECK(dt::parse_size("mem.limit", ".5M") == 512ull << 10);
  CHECK(dt::parse_size("mem.limit", "8.0") == 8);  // a fraction of 0 bytes is whole
  CHECK(dt::parse_size("mem.limit", "8.00B") == 8);
  CHECK(dt::parse_size("x", "18446744073709551615") == 18446744073709551615ull);
  CHECK(dt::parse_size("x", "16777215T") == 16777215ull << 40);
  for (const char* big : {"18446744073709551616", "16777216T", "99999999999999999999999"}) {
    CAPTURE(big);
    CHECK(contains(size_error(big), "is too large"));
  }
  for (const char* bad :
       {"8X", "lots", "", "-1G", "G", ".", "0x10", " 8G", "inf", "nan", "8 G", "1e3", "8KK"}) {
    CAPTURE(bad);
    const std::string m = size_error(bad, "mem.limit");
    CHECK(contains(m, "option --mem.limit: '"));
    CHECK(contains(m, "is not a size"));
  }
  // A fraction of a byte: refused, not rounded down (4.9 passed a multiple-of-4 check as 4).
  for (const char* part : {"1.5", "0.5", "4.9B", ".1"}) {
    CAPTURE(part);
    CHECK(contains(size_error(part, "min-bytes"),
                   "option --min-bytes: " + std::string(part) + " is not a whole number of bytes"));
  }
}

TEST_CASE("run_with_config_errors maps ConfigError to exit code 2") {
  CHECK(dt::run_with_config_errors("app", [] { return 0; }) == 0);
  CHECK(dt::run_with_config_errors("app", [] { return 5; }) == 5);
  std::string err;
  int rc = 0;
  {
    Capture cap(std::cerr);
    rc = dt::run_with_config_errors("app", [] {
      App a;
      a.parse({"--check.iters=0"});
      return 0;
    });
    err = cap.str();
  }
  CHECK(rc == 2);
  CHECK(err.find("app: error: option --check.iters") != std::string::npos);
  CHECK(err.find("--help") != std::string::npos);
  // Other errors pass through.
  CHECK_THROWS_AS(dt::run_with_config_errors("app", []() -> int { throw std::runtime_error("x"); }),
                  std::runtime_error);
}

TEST_CASE("printable: control bytes, C1 controls and bytes outside UTF-8 as \\xHH, text as it is") {
  CHECK(dt::printable("plain text\twith a tab") == "plain text\twith a tab");
  CHECK(dt::printable("a\x1b[2Jb\r\n\x7f") == "a\\x1b[2Jb\\x0d\\x0a\\x7f");
  CHECK(dt::printable("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80") ==
        "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80");  // é, €, an emoji: UTF-8 text
  CHECK(dt::printable("x\xc2\x9b"
                      "31m") == "x\\xc2\\x9b31m");                     // U+009B, CSI in C1
  CHECK(dt::printable("\xff\xfe") == "\\xff\\xfe");                    // never UTF-8
  CHECK(dt::printable("\xe2\x82") == "\\xe2\\x82");                    // cut short
  CHECK(dt::printable("\xc0\xaf") == "\\xc0\\xaf");                    // overlong '/'
  CHECK(dt::printable("\xed\xa0\x80") == "\\xed\\xa0\\x80");           // a surrogate
  CHECK(dt::printable("\xf4\x90\x80\x80") == "\\xf4\\x90\\x80\\x80");  // above U+10FFFF
  CHECK(dt::printable("\x9b") == "\\x9b");                             // a lone C1 byte (8-bit CSI)
}
