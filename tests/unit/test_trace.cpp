// dt::trace: Scope records nothing while off; while on, the file is Chrome trace-event JSON with
// one process per rank, named threads and properly nested complete events.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "dt/error.hpp"
#include "dt/trace.hpp"
#include "obs/open_scopes.hpp"
#include "temp_dir.hpp"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

json load(const std::string& path) {
  std::ifstream in(path);
  REQUIRE_MESSAGE(in.good(), path);
  return json::parse(in);
}

// Checks that the X events of each thread nest (an event that starts inside another ends inside
// it); returns the number of X events. Times in microseconds, 1 us of slack for JSON rounding.
std::size_t check_nesting(const json& doc) {
  std::map<long, std::vector<std::pair<double, double>>> by_tid;
  std::size_t n = 0;
  for (const auto& e : doc["traceEvents"]) {
    if (e["ph"] != "X") continue;
    REQUIRE(e["dur"].get<double>() >= 0);
    by_tid[e["tid"].get<long>()].push_back(
        {e["ts"].get<double>(), e["ts"].get<double>() + e["dur"].get<double>()});
    ++n;
  }
  for (auto& [tid, ev] : by_tid) {
    std::sort(ev.begin(), ev.end(), [](auto a, auto b) {
      return a.first != b.first ? a.first < b.first : a.second > b.second;
    });
    std::vector<double> open_ends;
    for (const auto& [b, e] : ev) {
      while (!open_ends.empty() && open_ends.back() <= b + 1.0) open_ends.pop_back();
      if (!open_ends.empty())
        CHECK_MESSAGE(e <= open_ends.back() + 1.0, "tid " << tid << " overlaps");
      open_ends.push_back(e);
    }
  }
  return n;
}

void work() {
  volatile double x = 0;
  for (int i = 0; i < 2000; ++i) x = x + i;
}

}  // namespace

TEST_CASE("trace: off costs nothing and records nothing") {
  dt::trace::stop();
  CHECK_FALSE(dt::trace::enabled());
  { const dt::trace::Scope s("never", "test"); }
  dt::test::TempDir dir("dt_trace_off");
  dt::trace::start(0, dir.path.string());
  CHECK(dt::trace::event_count() == 0);
  dt::trace::stop();
}

TEST_CASE("trace: nested scopes on several threads, one file per rank") {
  dt::test::TempDir dir("dt_trace");
  const std::string d = (dir.path / "sub" / "dir").string();  // created by start()
  dt::trace::start(5, d);
  CHECK(dt::trace::enabled());
  CHECK_THROWS_AS(dt::trace::start(5, d), dt::Error);
  {
    const dt::trace::Scope step("step", "train", "step", 7);
    for (int l = 0; l < 3; ++l) {
      const dt::trace::Scope layer("forward", "model", "layer", l);
      work();
    }
  }
  std::vector<std::thread> ts;
  for (int t = 0; t < 3; ++t)
    ts.emplace_back([t] {
      dt::trace::set_thread_name(t == 0 ? "worker \"zero\"" : "worker");
      for (int i = 0; i < 50; ++i) {
        const dt::trace::Scope a("outer", "test");
        const dt::trace::Scope b("inner", "test", "i", i);
        work();
      }
    });
  for (auto& t : ts) t.join();  // finished threads' events stay
  CHECK(dt::trace::event_count() == 4 + 3 * 100);
  const std::string path = dt::trace::write();
  CHECK(path == d + "/trace-rank5.json");
  json doc = load(path);
  REQUIRE(doc["traceEvents"].is_array());
  CHECK(doc["otherData"]["rank"] == 5);
  CHECK(doc["otherData"]["dropped"] == 0);
  CHECK(check_nesting(doc) == 304);
  std::map<std::string, int> names;
  std::set<long> tids;
  bool process_named = false, main_named = false, quoted = false;
  for (const auto& e : doc["traceEvents"]) {
    CHECK(e["pid"] == 5);
    if (e["ph"] == "M" && e["name"] == "process_name")
      process_named = e["args"]["name"] == "rank 5";
    if (e["ph"] == "M" && e["name"] == "thread_name") {
      main_named |= e["args"]["name"] == "main";
      quoted |= e["args"]["name"] == "worker \"zero\"";
    }
    if (e["ph"] != "X") continue;
    names[e["name"].get<std::string>()]++;
    tids.insert(e["tid"].get<long>());
    if (e["name"] == "step") CHECK(e["args"]["step"] == 7);
    if (e["name"] == "forward") CHECK(e["cat"] == "model");
  }
  CHECK(process_named);
  CHECK(main_named);
  CHECK(quoted);
  CHECK(names["forward"] == 3);
  CHECK(names["inner"] == 150);
  CHECK(tids.size() == 4);
  // The step encloses its layers.
  double step_ts = 0, step_end = 0;
  for (const auto& e : doc["traceEvents"])
    if (e["name"] == "step") {
      step_ts = e["ts"];
      step_end = step_ts + e["dur"].get<double>();
    }
  for (const auto& e : doc["traceEvents"])
    if (e["name"] == "forward") {
      CHECK(e["ts"].get<double>() >= step_ts - 1);
      CHECK(e["ts"].get<double>() + e["dur"].get<double>() <= step_end + 1);
    }

  // Writing again rewrites the file with everything so far; after stop() nothing is added.
  { const dt::trace::Scope more("late", "test"); }
  dt::trace::stop();
  { const dt::trace::Scope after("after_stop", "test"); }
  dt::trace::write();
  doc = load(path);
  std::size_t late = 0, after = 0;
  for (const auto& e : doc["traceEvents"]) {
    late += e["name"] == "late";
    after += e["name"] == "after_stop";
  }
  CHECK(late == 1);
  CHECK(after == 0);
  std::size_t files = 0;
  for (const auto& f : fs::directory_iterator(d)) files += f.is_regular_file();
  CHECK(files == 1);  // no temporary left

  // A new start() begins an empty timeline.
  dt::trace::start(5, d);
  CHECK(dt::trace::event_count() == 0);
  dt::trace::stop();
}

TEST_CASE("trace: a directory that cannot be made is a ConfigError naming it") {
  dt::test::TempDir dir("dt_trace_bad");
  const std::string file = dir.write("plain", "x");
  CHECK_THROWS_WITH_AS(dt::trace::start(0, file + "/sub"), doctest::Contains("plain/sub"),
                       dt::ConfigError);
  CHECK_FALSE(dt::trace::enabled());
}

TEST_CASE("trace: each thread keeps a bounded number of events") {
  dt::test::TempDir dir("dt_trace_cap");
  dt::trace::start(0, dir.path.string());
  std::thread t([] {
    for (std::size_t i = 0; i < dt::trace::kMaxEventsPerThread + 10; ++i) {
      const dt::trace::Scope s("tiny", "test");
    }
  });
  t.join();
  CHECK(dt::trace::event_count() == dt::trace::kMaxEventsPerThread);
  CHECK(dt::trace::dropped_count() == 10);
  dt::trace::stop();
  dt::trace::start(0, dir.path.string());  // frees them
  dt::trace::stop();
}

namespace {
// This process's resident memory (VmRSS), in KiB.
long resident_kib() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  return -1;
}
}  // namespace

// Threads that record a few events each (a checkpoint save's thread, one a save) are kept until
// the next start(): each takes memory for the events it recorded, not a whole chunk's (288 KiB:
// 110 MiB for these 400 threads).
TEST_CASE("trace: a thread of a few events takes little memory") {
  dt::test::TempDir dir("dt_trace_small");
  dt::trace::start(0, dir.path.string());
  const long before = resident_kib();
  REQUIRE(before > 0);
  for (int k = 0; k < 400; ++k) {
    std::thread t([] { const dt::trace::Scope s("save", "test"); });
    t.join();
  }
  const long grown = resident_kib() - before;
  CHECK(dt::trace::event_count() == 400);
  CHECK_MESSAGE(grown < 16 * 1024, "resident memory grew by ", grown, " KiB");
  // Their events are all written, in full.
  const std::string path = dt::trace::write();
  std::ifstream in(path);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::size_t saves = 0;
  for (std::size_t at = 0; (at = text.find("\"name\":\"save\"", at)) != std::string::npos; ++at)
    ++saves;
  CHECK(saves == 400);
  dt::trace::stop();
  dt::trace::start(0, dir.path.string());  // frees them
  dt::trace::stop();
}

TEST_CASE("trace: a write with open_scopes shows the Scopes still open, on their threads") {
  dt::test::TempDir dir("dt_trace_open");
  dt::trace::start(0, dir.path.string());
  std::mutex mu;
  std::condition_variable cv;
  bool inside = false, leave = false;
  std::thread t([&] {
    dt::trace::set_thread_name("waiter");
    const dt::trace::Scope outer("step", "train", "step", 7);
    { const dt::trace::Scope done("forward", "model"); }  // closed before the write
    const dt::trace::Scope inner("all_reduce wait", "comm");
    std::unique_lock<std::mutex> lock(mu);
    inside = true;
    cv.notify_all();
    cv.wait(lock, [&] { return leave; });
  });
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return inside; });
  }
  // Without open_scopes only finished events; with it, the open ones too (ending now), nested.
  json plain = load(dt::trace::write());
  std::set<std::string> names;
  for (const auto& e : plain["traceEvents"])
    if (e["ph"] == "X") names.insert(e["name"].get<std::string>());
  CHECK(names == std::set<std::string>{"forward"});
  json doc = load(dt::trace::write(true));
  CHECK(check_nesting(doc) == 3);
  long waiter = -1;
  for (const auto& e : doc["traceEvents"])
    if (e["name"] == "thread_name" && e["args"]["name"] == "waiter") waiter = e["tid"].get<long>();
  std::map<std::string, json> open;
  for (const auto& e : doc["traceEvents"]) {
    if (e["ph"] != "X") continue;
    CHECK(e["tid"].get<long>() == waiter);
    if (e["name"] != "forward") open[e["name"].get<std::string>()] = e;
  }
  REQUIRE(open.size() == 2);
  CHECK(open["step"]["cat"] == "train (open)");
  CHECK(open["step"]["args"]["step"] == 7);
  CHECK(open["all_reduce wait"]["cat"] == "comm (open)");
  CHECK(open["step"]["ts"].get<double>() <= open["all_reduce wait"]["ts"].get<double>());
  {
    std::lock_guard<std::mutex> lock(mu);
    leave = true;
  }
  cv.notify_all();
  t.join();
  // Once closed, they are ordinary events, and none is left open.
  doc = load(dt::trace::write(true));
  std::map<std::string, std::string> cats;
  for (const auto& e : doc["traceEvents"])
    if (e["ph"] == "X") cats[e["name"].get<std::string>()] = e["cat"].get<std::string>();
  CHECK(cats == std::map<std::string, std::string>{
                    {"step", "train"}, {"forward", "model"}, {"all_reduce wait", "comm"}});
  dt::trace::stop();
}

TEST_CASE("trace: a snapshot of open Scopes taken while their owner changes them is never torn") {
  // The owner pushes two Scopes and pops them, flat out; every field of both comes from the same
  // iteration n (the outer one's name and category from n's parity). A snapshot read between two
  // iterations' stores would mix them.
  dt::trace::OpenScopes scopes;
  std::atomic<bool> stop{false}, started{false};
  std::thread owner([&] {
    started = true;
    for (std::int64_t n = 0; !stop.load(std::memory_order_relaxed); ++n) {
      const bool odd = (n & 1) != 0;
      scopes.push(odd ? "c" : "a", odd ? "z" : "x", odd ? "odd" : "even", n, n);
      scopes.push("b", "y", "n", n, n);
      scopes.pop();
      scopes.pop();
    }
  });
  while (!started.load()) std::this_thread::yield();
  // 100000 reads and 1000 of them inside both Scopes (within 20 s).
  long torn = 0, two = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  for (long i = 0; (i < 100000 || two < 1000) && std::chrono::steady_clock::now() < until; ++i) {
    const auto open = scopes.snapshot();
    bool ok = open.size() <= 2;
    if (!open.empty()) {
      const auto& o = open[0];
      const bool odd = (o.arg & 1) != 0;
      ok = ok && std::string(o.name) == (odd ? "c" : "a") &&
           std::string(o.category) == (odd ? "z" : "x") &&
           std::string(o.arg_name) == (odd ? "odd" : "even") && o.t0 == o.arg;
    }
    if (open.size() == 2) {
      const auto& in = open[1];
      ok = ok && std::string(in.name) == "b" && std::string(in.category) == "y" &&
           std::string(in.arg_name) == "n" && in.arg == open[0].arg && in.t0 == in.arg;
      ++two;
    }
    if (!ok) ++torn;
  }
  stop = true;
  owner.join();
  CHECK(torn == 0);
  CHECK(two >= 1000);  // the reads met the owner inside both Scopes
}

TEST_CASE("trace: open Scopes read while their thread opens and closes them stay consistent") {
  dt::test::TempDir dir("dt_trace_open_race");
  dt::trace::start(0, dir.path.string());
  std::atomic<bool> stop{false};
  // The thread opens and closes Scopes as fast as it goes; the outer one's name, category and
  // argument change together (a with even arguments, c with odd), so a slot read torn between two
  // Scopes shows as a mismatch. Tracing starts afresh before each write (the thread's Scopes
  // then go on the new buffer), so each write holds a millisecond's events: a thread running
  // flat out filled its million events, and writing them 200 times took minutes under
  // AddressSanitizer.
  std::thread t([&] {
    for (std::int64_t n = 0; !stop.load(); ++n) {
      const bool odd = (n & 1) != 0;
      const dt::trace::Scope a(odd ? "c" : "a", odd ? "z" : "x", "n", n);
      const dt::trace::Scope b("b", "y", "depth", 2);
    }
  });
  // Until 40 open Scopes were read (at most 400 writes): each whole, never ending before it began.
  int seen = 0;
  for (int i = 0; i < 400 && seen < 40; ++i) {
    dt::trace::stop();
    dt::trace::start(0, dir.path.string());
    std::this_thread::sleep_for(std::chrono::microseconds(100));
    json doc = load(dt::trace::write(true));
    for (const auto& e : doc["traceEvents"]) {
      if (e["ph"] != "X") continue;
      const std::string cat = e["cat"], name = e["name"];
      if (cat.find(" (open)") == std::string::npos) continue;
      ++seen;
      // A slot is read whole: name, category and argument of one Scope.
      if (name == "b") {
        CHECK((cat == "y (open)" && e["args"]["depth"] == 2));
      } else {
        const std::int64_t n = e["args"]["n"];
        CHECK(((name == "a" && cat == "x (open)" && n % 2 == 0) ||
               (name == "c" && cat == "z (open)" && n % 2 == 1)));
      }
      CHECK(e["dur"].get<double>() >= 0);
    }
  }
  CHECK(seen >= 40);
  stop = true;
  t.join();
  dt::trace::stop();
  dt::trace::start(0, dir.path.string());  // frees the events
  dt::trace::stop();
}
