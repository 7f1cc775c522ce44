// dt_trace: join and summarise the per-rank timelines of dt_train --trace.dir.
//
//   dt_trace merge OUT.json IN.json...   one Chrome trace with a process per rank (open it in
//                                        https://ui.perfetto.dev or chrome://tracing)
//   dt_trace summary FILE.json [--top N] time per region (category, name) over all ranks
//
// merge keeps every event of every input unchanged, in input order, and writes OUT atomically
// (OUT.tmp.<pid>.<n>, then renamed). Inputs are checked completely before anything is written: a
// file that is missing, not JSON, not a trace, or holds a rank (pid) that another input also holds
// is named in the error, and OUT is not touched. So is an OUT that is one of the inputs, or an
// existing file that is not a merge (`dt_trace merge trace-rank*.json` forgets OUT).
//
// Exit codes: 0 success; 2 bad usage or input; 3 an internal error.
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "dt/config.hpp"
#include "dt/error.hpp"
#include "dt/metrics.hpp"
#include "dt/trace.hpp"

namespace {

using dt::ConfigError;
using nlohmann::json;

constexpr const char* kUsage =
    "usage: dt_trace merge OUT.json IN.json...\n"
    "       dt_trace summary FILE.json [--top N]\n"
    "Joins the per-rank timelines of dt_train --trace.dir (trace-rank<R>.json) into one Chrome\n"
    "trace with a process per rank, or prints the time spent per region.\n"
    "Exit codes: 0 ok, 2 bad usage or input, 3 an internal error.\n";

/// One input file, checked: its events and the ranks (pids) they belong to.
struct Trace {
  std::string path;
  json events;  // array
  std::set<std::int64_t> pids;
  std::string run;           // otherData.run: the id dt_train gives the files of one run ("": none)
  std::int64_t world = 0;    // otherData.world: the run's ranks (0: not said)
  std::int64_t dropped = 0;  // otherData.dropped: events past dt's per-thread limit, not kept
};

// "1 process", "2 processes".
std::string count(std::size_t n, const char* one, const char* many) {
  return std::to_string(n) + " " + (n == 1 ? one : many);
}

// The note of a timeline that lost events (dt_train keeps each thread's first events).
void note_dropped(const char* cmd, std::int64_t dropped) {
  if (dropped > 0)
    std::printf(
        "dt_trace %s: warning: the timeline lacks %s that came after the first %zu of "
        "their thread (dt_train's limit per thread): the later part of the run is "
        "missing there\n",
        cmd, count(static_cast<std::size_t>(dropped), "event", "events").c_str(),
        dt::trace::kMaxEventsPerThread);
}

Trace load(const std::string& path) {
  std::error_code ec;
  DT_CHECK(ConfigError, !std::filesystem::is_directory(path, ec), path,
           ": is a directory, not a trace file");
  std::ifstream in(path, std::ios::binary);
  DT_CHECK(ConfigError, in.good(), path, ": cannot be read: ", std::strerror(errno));
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  DT_CHECK(ConfigError, !text.empty(), path, ": is empty, not a trace");
  json doc;
  // Values nested deeper than kMaxDepth are refused as they are read: writing them out again
  // (merge) recurses once a level, and a hostile or broken file could exhaust the stack.
  constexpr int kMaxDepth = 256;
  try {
    doc = json::parse(text, [&](int depth, json::parse_event_t, json&) {
      DT_CHECK(ConfigError, depth <= kMaxDepth, path, ": values nested deeper than ", kMaxDepth,
               " levels (dt_train writes at most a few)");
      return true;
    });
  } catch (const json::exception& e) {  // a syntax error, a number out of range, ...
    DT_THROW(ConfigError, path, ": not JSON (", e.what(), ")");
  }
  Trace t;
  t.path = path;
  if (doc.is_array()) {
    t.events = std::move(doc);
  } else if (doc.is_object() && doc.contains("traceEvents") && doc["traceEvents"].is_array()) {
    t.events = std::move(doc["traceEvents"]);
    if (doc.contains("otherData") && doc["otherData"].is_object()) {
      const json& o = doc["otherData"];
      if (o.contains("run") && o["run"].is_string()) t.run = o["run"].get<std::string>();
      if (o.contains("world") && o["world"].is_number_integer())
        t.world = o["world"].get<std::int64_t>();
      if (o.contains("dropped") && o["dropped"].is_number_integer())
        t.dropped = o["dropped"].get<std::int64_t>();
    }
  } else {
    DT_THROW(ConfigError, path,
             ": not a Chrome trace (expected an object with a \"traceEvents\" array, or an array "
             "of events)");
  }
  for (std::size_t i = 0; i < t.events.size(); ++i) {
    const json& e = t.events[i];
    DT_CHECK(ConfigError, e.is_object() && e.contains("ph") && e["ph"].is_string(), path,
             ": event ", i, " is not a trace event (an object with a \"ph\" string)");
    const std::string ph = e["ph"];
    if (ph != "M")
      DT_CHECK(ConfigError, e.contains("ts") && e["ts"].is_number(), path, ": event ", i, " (ph ",
               ph, ") has no numeric \"ts\"");
    if (ph == "X")
      DT_CHECK(ConfigError, e.contains("dur") && e["dur"].is_number() && e["dur"] >= 0, path,
               ": event ", i, " (ph X) has no non-negative \"dur\"");
    if (e.contains("pid")) {
      DT_CHECK(ConfigError, e["pid"].is_number_integer(), path, ": event ", i,
               " has a pid that is not an integer");
      t.pids.insert(e["pid"].get<std::int64_t>());
    }
  }
  return t;
}

int cmd_merge(const std::vector<std::string>& args) {
  DT_CHECK(ConfigError, args.size() >= 2, "merge needs OUT.json and at least one IN.json");
  const std::string out = args[0];
  std::vector<Trace> traces;
  std::map<std::int64_t, std::string> owner;  // pid -> first file holding it
  for (std::size_t i = 1; i < args.size(); ++i) {
    traces.push_back(load(args[i]));
    for (std::int64_t pid : traces.back().pids) {
      auto [it, fresh] = owner.emplace(pid, args[i]);
      DT_CHECK(ConfigError, fresh, args[i], ": rank (pid) ", pid, " also appears in ", it->second,
               ": merging would mix two processes into one");
    }
  }
  // The files of one run only: a trace folder that held an earlier run's files (of more ranks,
  // or of ranks that did not start this time) would otherwise join two runs into one timeline.
  std::map<std::string, std::vector<std::string>> runs;  // run -> its files
  for (const Trace& t : traces)
    if (!t.run.empty()) runs[t.run].push_back(t.path);
  if (runs.size() > 1) {
    std::string which;
    for (const auto& [run, files] : runs) {
      which += (which.empty() ? "" : "; ") + std::string("run ") + run + ": ";
      for (std::size_t i = 0; i < files.size(); ++i) which += (i ? ", " : "") + files[i];
    }
    DT_THROW(ConfigError, "the inputs come from ", runs.size(), " different runs (", which,
             "): a folder holding an earlier run's files too? Name one run's files; nothing was "
             "written");
  }
  const std::string run = runs.empty() ? "" : runs.begin()->first;
  std::int64_t world = 0;  // the run's ranks, as its files say
  for (const Trace& t : traces) world = std::max(world, t.world);
  // OUT is replaced only when it is new or a merge of ours: `dt_trace merge trace-rank*.json`
  // (OUT forgotten) must not overwrite rank 0's trace with the others'.
  std::error_code ec;
  for (std::size_t i = 1; i < args.size(); ++i)
    DT_CHECK(ConfigError, !std::filesystem::equivalent(out, args[i], ec), "OUT ", out,
             " is also an input (", args[i], "); nothing was written");
  DT_CHECK(ConfigError, !std::filesystem::is_directory(out, ec), "OUT ", out,
           " is a folder: name the file to write the merged timeline to (e.g. ", out,
           "/trace.json); nothing was written");
  if (std::filesystem::exists(out, ec)) {
    std::ifstream in(out);
    const json prev = json::parse(in, nullptr, /*allow_exceptions=*/false);
    const bool ours = prev.is_object() && prev.contains("otherData") &&
                      prev["otherData"].is_object() && prev["otherData"].contains("merged_from");
    DT_CHECK(ConfigError, ours, "OUT ", out,
             " exists and is not a trace that dt_trace merge wrote (is OUT missing from the "
             "command line?); nothing was written: remove it or name another OUT");
  }
  json merged = json::object();
  merged["traceEvents"] = json::array();
  json& all = merged["traceEvents"];
  json sources = json::array();
  std::size_t n = 0;
  std::int64_t dropped = 0;
  for (auto& t : traces) {
    n += t.events.size();
    dropped += t.dropped;
    for (auto& e : t.events) all.push_back(std::move(e));
    sources.push_back(t.path);
  }
  merged["displayTimeUnit"] = "ms";
  merged["otherData"] = {{"merged_from", sources}, {"events", n}, {"dropped", dropped}};
  if (!run.empty()) merged["otherData"]["run"] = run;
  if (world > 0) merged["otherData"]["world"] = world;
  try {
    dt::metrics::write_file_atomically(out, merged.dump() + "\n");
  } catch (const dt::Error& e) {
    DT_THROW(ConfigError, e.message());
  }
  std::printf("dt_trace merge: %s of %s from %s -> %s\n", count(n, "event", "events").c_str(),
              count(owner.size(), "process", "processes").c_str(),
              count(traces.size(), "file", "files").c_str(), out.c_str());
  if (static_cast<std::int64_t>(owner.size()) < world)
    std::printf("dt_trace merge: note: the run had %s; the timeline holds %zu of them\n",
                count(static_cast<std::size_t>(world), "rank", "ranks").c_str(), owner.size());
  note_dropped("merge", dropped);
  return 0;
}

int cmd_summary(const std::vector<std::string>& args) {
  std::string file;
  long top = 20;
  for (std::size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--top") {
      DT_CHECK(ConfigError, i + 1 < args.size(), "option --top needs a number (--top N)");
      char* end = nullptr;
      top = std::strtol(args[++i].c_str(), &end, 10);
      DT_CHECK(ConfigError, *end == '\0' && top > 0, "option --top: '", args[i],
               "' is not a positive integer");
    } else if (args[i].rfind("--top=", 0) == 0) {
      char* end = nullptr;
      top = std::strtol(args[i].c_str() + 6, &end, 10);
      DT_CHECK(ConfigError, *end == '\0' && top > 0, "option --top: '", args[i].substr(6),
               "' is not a positive integer");
    } else {
      DT_CHECK(ConfigError, args[i].rfind("--", 0) != 0, "summary: unknown option '", args[i],
               "' (expected --top N)");
      DT_CHECK(ConfigError, file.empty(), "summary takes one FILE, got '", file, "' and '", args[i],
               "'");
      file = args[i];
    }
  }
  DT_CHECK(ConfigError, !file.empty(), "summary needs a FILE");
  const Trace t = load(file);
  struct Row {
    std::string cat, name;
    std::size_t calls = 0;
    double total = 0, max = 0;  // us
    std::set<std::int64_t> ranks;
  };
  std::map<std::pair<std::string, std::string>, Row> rows;
  double first = 0, last = 0;
  bool any = false;
  for (const auto& e : t.events) {
    if (e["ph"] != "X") continue;
    const std::string cat = e.contains("cat") && e["cat"].is_string() ? e["cat"] : "";
    const std::string name = e.contains("name") && e["name"].is_string() ? e["name"] : "";
    Row& r = rows[{cat, name}];
    r.cat = cat;
    r.name = name;
    const double ts = e["ts"], dur = e["dur"];
    ++r.calls;
    r.total += dur;
    r.max = std::max(r.max, dur);
    if (e.contains("pid") && e["pid"].is_number_integer())
      r.ranks.insert(e["pid"].get<std::int64_t>());
    first = any ? std::min(first, ts) : ts;
    last = any ? std::max(last, ts + dur) : ts + dur;
    any = true;
  }
  std::vector<Row> sorted;
  for (auto& [k, r] : rows) sorted.push_back(r);
  std::sort(sorted.begin(), sorted.end(),
            [](const Row& a, const Row& b) { return a.total > b.total; });
  std::printf("dt_trace summary: %s: %s, %s, %.3f s from first to last\n", file.c_str(),
              count(t.pids.size(), "process", "processes").c_str(),
              count(t.events.size(), "event", "events").c_str(), any ? (last - first) / 1e6 : 0.0);
  note_dropped("summary", t.dropped);
  std::printf("%12s %8s %10s %10s %6s  %-10s %s\n", "total ms", "calls", "mean ms", "max ms",
              "ranks", "category", "name");
  for (std::size_t i = 0; i < sorted.size() && static_cast<long>(i) < top; ++i) {
    const Row& r = sorted[i];
    std::printf("%12.3f %8zu %10.4f %10.4f %6zu  %-10s %s\n", r.total / 1e3, r.calls,
                r.total / 1e3 / static_cast<double>(r.calls), r.max / 1e3, r.ranks.size(),
                r.cat.c_str(), r.name.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  return dt::run_with_config_errors("dt_trace", [&] {
    DT_CHECK(ConfigError, argc >= 2, "a subcommand is required (merge, summary)\n", kUsage);
    const std::string sub = argv[1];
    if (sub == "--help" || sub == "-h" || sub == "help") {
      std::printf("%s", kUsage);
      return 0;
    }
    const std::vector<std::string> args(argv + 2, argv + argc);
    for (const auto& a : args)
      if (a == "--help" || a == "-h") {
        std::printf("%s", kUsage);
        return 0;
      }
    if (sub == "merge") return cmd_merge(args);
    if (sub == "summary") return cmd_summary(args);
    DT_THROW(ConfigError, "unknown subcommand '", sub, "' (expected merge or summary)");
  });
} catch (const std::exception& e) {
  std::fprintf(stderr, "dt_trace: internal error: %s\n", e.what());
  return 3;
}
