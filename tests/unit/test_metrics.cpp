// dt::metrics: registry, Prometheus text format (parsed back), histograms, record_comm, the
// atomic textfile, the HTTP endpoint and the Pushgateway push (against a socket server here).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <doctest/doctest.h>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "dt/error.hpp"
#include "dt/metrics.hpp"
#include "temp_dir.hpp"

namespace fs = std::filesystem;
using dt::metrics::Labels;
using dt::metrics::Registry;

namespace {

// ---- a strict parser of the text exposition format ----------------------------------------------

struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

struct Exposition {
  std::map<std::string, std::string> help, type;
  std::vector<Sample> samples;
  /// The value of the one sample `name` with exactly these labels; fails the test otherwise.
  double value(const std::string& name, const std::map<std::string, std::string>& labels = {}) {
    const Sample* hit = nullptr;
    for (const auto& s : samples)
      if (s.name == name && s.labels == labels) {
        REQUIRE_MESSAGE(hit == nullptr, "duplicate sample " << name);
        hit = &s;
      }
    REQUIRE_MESSAGE(hit != nullptr, "no sample " << name);
    return hit->value;
  }
};

bool is_name_char(char c, bool first) {
  return std::isalpha(static_cast<unsigned char>(c)) || c == '_' || c == ':' ||
         (!first && std::isdigit(static_cast<unsigned char>(c)));
}

// Throws std::runtime_error naming the line on anything the format does not allow.
Exposition parse(const std::string& text) {
  Exposition e;
  std::istringstream in(text);
  std::string line;
  int n = 0;
  std::string family;  // family of the last TYPE line
  auto fail = [&](const std::string& why) {
    throw std::runtime_error("line " + std::to_string(n) + ": " + why + ": " + line);
  };
  REQUIRE((text.empty() || text.back() == '\n'));
  while (std::getline(in, line)) {
    ++n;
    if (line.empty()) fail("empty line");
    if (line[0] == '#') {
      std::istringstream ls(line);
      std::string hash, kw, name;
      ls >> hash >> kw >> name;
      if (kw == "HELP") {
        if (e.help.count(name)) fail("second HELP");
        std::string rest;
        std::getline(ls, rest);
        e.help[name] = rest.empty() ? "" : rest.substr(1);
      } else if (kw == "TYPE") {
        std::string t;
        ls >> t;
        if (e.type.count(name)) fail("second TYPE");
        if (t != "counter" && t != "gauge" && t != "histogram" && t != "summary" && t != "untyped")
          fail("unknown type");
        e.type[name] = t;
        family = name;
      } else {
        fail("unknown comment keyword");
      }
      continue;
    }
    Sample s;
    std::size_t i = 0;
    while (i < line.size() && is_name_char(line[i], i == 0)) s.name += line[i++];
    if (s.name.empty()) fail("no metric name");
    if (i < line.size() && line[i] == '{') {
      ++i;
      while (i < line.size() && line[i] != '}') {
        std::string k, v;
        while (i < line.size() && is_name_char(line[i], k.empty()) && line[i] != ':')
          k += line[i++];
        if (k.empty() || i + 1 >= line.size() || line[i] != '=' || line[i + 1] != '"')
          fail("bad label");
        i += 2;
        while (i < line.size() && line[i] != '"') {
          if (line[i] == '\\') {
            if (++i >= line.size()) fail("dangling escape");
            if (line[i] == 'n')
              v += '\n';
            else if (line[i] == '\\' || line[i] == '"')
              v += line[i];
            else
              fail("bad escape");
            ++i;
          } else {
            v += line[i++];
          }
        }
        if (i >= line.size()) fail("unterminated label value");
        ++i;
        if (s.labels.count(k)) fail("label twice");
        s.labels[k] = v;
        if (i < line.size() && line[i] == ',') ++i;
      }
      if (i >= line.size()) fail("unterminated labels");
      ++i;
    }
    if (i >= line.size() || line[i] != ' ') fail("no space before the value");
    const std::string v = line.substr(i + 1);
    if (v == "+Inf")
      s.value = INFINITY;
    else if (v == "-Inf")
      s.value = -INFINITY;
    else if (v == "NaN")
      s.value = NAN;
    else {
      char* end = nullptr;
      s.value = std::strtod(v.c_str(), &end);
      if (v.empty() || *end != '\0') fail("bad value");
    }
    // Every sample belongs to the family of the TYPE line above it.
    const bool own =
        s.name == family || (e.type[family] == "histogram" &&
                             (s.name == family + "_bucket" || s.name == family + "_sum" ||
                              s.name == family + "_count"));
    if (!own) fail("sample outside its family '" + family + "'");
    e.samples.push_back(std::move(s));
  }
  return e;
}

// ---- tiny HTTP peers over raw sockets -----------------------------------------------------------

struct Reply {
  int status = 0;
  std::string body;
};

// A socket connected to `port` on the loopback address.
int connect_loopback(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  return fd;
}

// Sends `req` on `fd`, reads until the peer closes (or a read fails), closes fd.
std::string exchange(int fd, const std::string& req) {
  REQUIRE(::send(fd, req.data(), req.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(req.size()));
  std::string all;
  char buf[4096];
  for (ssize_t k; (k = ::read(fd, buf, sizeof buf)) > 0;)
    all.append(buf, static_cast<std::size_t>(k));
  ::close(fd);
  return all;
}

Reply http_get(int port, const std::string& path) {
  const std::string all =
      exchange(connect_loopback(port),
               "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
  Reply r;
  REQUIRE(all.rfind("HTTP/1.1 ", 0) == 0);
  r.status = std::stoi(all.substr(9, 3));
  const auto hdr_end = all.find("\r\n\r\n");
  REQUIRE(hdr_end != std::string::npos);
  r.body = all.substr(hdr_end + 4);
  return r;
}

// Accepts one connection on a loopback port, records the request, answers `status`.
struct OneShotServer {
  int fd = -1, port = 0, status;
  std::string method, path, body;
  std::thread t;
  // trickle: the reply announces 1000 bytes of body and sends one every 0.1 s, until the client
  // goes (a write fails) or the server is destroyed.
  bool trickle = false;
  std::atomic<bool> ending{false};
  explicit OneShotServer(int st, bool trickle_reply = false) : status(st), trickle(trickle_reply) {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    REQUIRE(::listen(fd, 4) == 0);
    socklen_t len = sizeof a;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    port = ntohs(a.sin_port);
    t = std::thread([this] { serve(); });
  }
  void serve() {
    const int c = ::accept(fd, nullptr, nullptr);
    if (c < 0) return;
    std::string req;
    char buf[4096];
    std::size_t need = std::string::npos;
    while (req.size() < need) {
      const ssize_t k = ::read(c, buf, sizeof buf);
      if (k <= 0) break;
      req.append(buf, static_cast<std::size_t>(k));
      const auto e = req.find("\r\n\r\n");
      if (e != std::string::npos && need == std::string::npos) {
        std::size_t cl = 0;
        const auto p = req.find("Content-Length: ");
        if (p != std::string::npos && p < e) cl = std::stoul(req.substr(p + 16));
        need = e + 4 + cl;
      }
    }
    std::istringstream first(req);
    first >> method >> path;
    const auto e = req.find("\r\n\r\n");
    if (e != std::string::npos) body = req.substr(e + 4);
    const std::string reply = "HTTP/1.1 " + std::to_string(status) +
                              " X\r\nContent-Length: " + (trickle ? "1000" : "0") +
                              "\r\nConnection: close\r\n\r\n";
    (void)!::write(c, reply.data(), reply.size());
    for (int i = 0; trickle && i < 1000 && !ending.load(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      if (::send(c, "x", 1, MSG_NOSIGNAL) != 1) break;
    }
    ::close(c);
  }
  ~OneShotServer() {
    ending = true;
    ::shutdown(fd, SHUT_RDWR);
    if (t.joinable()) t.join();
    ::close(fd);
  }
};

std::string slurp(const std::string& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

TEST_CASE("metrics: counters and gauges, one series per label set") {
  Registry r;
  auto& a = r.counter("x_total", "X things.", {{"kind", "a"}});
  auto& b = r.counter("x_total", "X things.", {{"kind", "b"}});
  CHECK(&a != &b);
  CHECK(&r.counter("x_total", "X things.", {{"kind", "a"}}) == &a);
  a.inc();
  a.inc(2.5);
  a.inc(-7);  // ignored: counters never go down
  CHECK(a.value() == 3.5);
  auto& g = r.gauge("y", "Y.", {{"b", "2"}, {"a", "1"}});
  CHECK(&r.gauge("y", "Y.", {{"a", "1"}, {"b", "2"}}) == &g);  // label order does not matter
  g.set(5);
  g.add(-1.5);
  CHECK(g.value() == 3.5);
  auto e = parse(r.render());
  CHECK(e.type["x_total"] == "counter");
  CHECK(e.type["y"] == "gauge");
  CHECK(e.help["x_total"] == "X things.");
  CHECK(e.value("x_total", {{"kind", "a"}}) == 3.5);
  CHECK(e.value("x_total", {{"kind", "b"}}) == 0);
  CHECK(e.value("y", {{"a", "1"}, {"b", "2"}}) == 3.5);
  CHECK(e.samples.size() == 3);
}

TEST_CASE("metrics: bad registrations are refused with the name") {
  Registry r(3);
  r.counter("c_total", "C.");
  CHECK_THROWS_WITH_AS(r.gauge("c_total", "C."), doctest::Contains("already a counter"),
                       dt::InvalidArgument);
  CHECK_THROWS_WITH_AS(r.counter("c_total", "other help"), doctest::Contains("c_total"),
                       dt::InvalidArgument);
  CHECK_THROWS_AS(r.counter("1bad", "B."), dt::InvalidArgument);
  CHECK_THROWS_AS(r.counter("bad-name", "B."), dt::InvalidArgument);
  CHECK_THROWS_AS(r.counter("ok", "B.", {{"bad-label", "v"}}), dt::InvalidArgument);
  CHECK_THROWS_AS(r.counter("ok2", "B.", {{"__reserved", "v"}}), dt::InvalidArgument);
  CHECK_THROWS_AS(r.counter("ok3", "B.", {{"a", "1"}, {"a", "2"}}), dt::InvalidArgument);
  CHECK_THROWS_AS(r.histogram("h", "H.", {1, 2}, {{"le", "x"}}), dt::InvalidArgument);
  CHECK_THROWS_AS(r.histogram("h2", "H.", {2, 1}), dt::InvalidArgument);
  CHECK_THROWS_AS(r.histogram("h3", "H.", {1, INFINITY}), dt::InvalidArgument);
  r.histogram("h4", "H.", {1, 2});
  CHECK_THROWS_WITH_AS(r.histogram("h4", "H.", {1, 3}), doctest::Contains("other buckets"),
                       dt::InvalidArgument);
  // Bounded cardinality: the fourth label value of a family is refused.
  for (int i = 0; i < 3; ++i) r.gauge("per_value", "P.", {{"v", std::to_string(i)}});
  CHECK_THROWS_WITH_AS(r.gauge("per_value", "P.", {{"v", "3"}}),
                       doctest::Contains("must not vary per step"), dt::InvalidArgument);
  // Asking again for an existing series is still fine.
  r.gauge("per_value", "P.", {{"v", "0"}});
  CHECK_NOTHROW(parse(r.render()));
}

TEST_CASE("metrics: escaping of label values and help text") {
  Registry r;
  const std::string nasty = "a\"b\\c\nd}{,=";
  r.gauge("esc", "line one\nback\\slash \"quoted\"", {{"path", nasty}}).set(1);
  const std::string text = r.render();
  CHECK(text.find("# HELP esc line one\\nback\\\\slash \"quoted\"\n") != std::string::npos);
  auto e = parse(text);
  CHECK(e.value("esc", {{"path", nasty}}) == 1);
  CHECK(dt::metrics::escape_label_value("x\"y") == "x\\\"y");
}

TEST_CASE("metrics: special and exact values") {
  Registry r;
  r.gauge("g_inf", "I.").set(INFINITY);
  r.gauge("g_ninf", "I.").set(-INFINITY);
  r.gauge("g_nan", "N.").set(NAN);
  r.gauge("g_tenth", "T.").set(0.1);
  r.gauge("g_big", "B.").set(123456789012345.0);
  const std::string text = r.render();
  CHECK(text.find("g_tenth 0.1\n") != std::string::npos);
  CHECK(text.find("g_big 123456789012345\n") != std::string::npos);
  auto e = parse(text);
  CHECK(std::isinf(e.value("g_inf")));
  CHECK(e.value("g_ninf") < 0);
  CHECK(std::isnan(e.value("g_nan")));
  CHECK(e.value("g_tenth") == 0.1);
}

TEST_CASE("metrics: histogram buckets are cumulative and le is inclusive") {
  Registry r;
  auto& h = r.histogram("lat_seconds", "Latency.", {0.1, 1, 10}, {{"op", "x"}});
  for (double v : {0.05, 0.1, 0.5, 1.0, 5.0, 50.0, 500.0}) h.observe(v);
  CHECK(h.count() == 7);
  CHECK(h.sum() == doctest::Approx(556.65));
  CHECK(h.bucket_counts() == std::vector<std::uint64_t>{2, 2, 1, 2});
  auto e = parse(r.render());
  CHECK(e.type["lat_seconds"] == "histogram");
  CHECK(e.value("lat_seconds_bucket", {{"op", "x"}, {"le", "0.1"}}) == 2);
  CHECK(e.value("lat_seconds_bucket", {{"op", "x"}, {"le", "1"}}) == 4);
  CHECK(e.value("lat_seconds_bucket", {{"op", "x"}, {"le", "10"}}) == 5);
  CHECK(e.value("lat_seconds_bucket", {{"op", "x"}, {"le", "+Inf"}}) == 7);
  CHECK(e.value("lat_seconds_count", {{"op", "x"}}) == 7);
  CHECK(e.value("lat_seconds_sum", {{"op", "x"}}) == doctest::Approx(556.65));
  const auto b = dt::metrics::exponential_buckets(0.001, 10, 4);
  REQUIRE(b.size() == 4);
  CHECK(b[3] == doctest::Approx(1.0));
  CHECK_THROWS_AS(dt::metrics::exponential_buckets(0, 2, 3), dt::InvalidArgument);
}

TEST_CASE("metrics: extra labels go in front of every series") {
  Registry r;
  r.counter("c_total", "C.", {{"op", "x"}}).inc(4);
  r.histogram("h", "H.", {1}).observe(0.5);
  auto e = parse(r.render({{"rank", "3"}}));
  CHECK(e.value("c_total", {{"rank", "3"}, {"op", "x"}}) == 4);
  CHECK(e.value("h_bucket", {{"rank", "3"}, {"le", "1"}}) == 1);
  CHECK(e.value("h_count", {{"rank", "3"}}) == 1);
}

TEST_CASE("metrics: concurrent updates are not lost") {
  Registry r;
  auto& c = r.counter("n_total", "N.");
  auto& g = r.gauge("g", "G.");
  auto& h = r.histogram("h", "H.", {0.5});
  constexpr int kThreads = 4, kIters = 20000;
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t)
    ts.emplace_back([&] {
      for (int i = 0; i < kIters; ++i) {
        c.inc();
        g.add(1);
        h.observe(i % 2 ? 1.0 : 0.25);
        if (i % 5000 == 0) parse(r.render());  // rendering while others write
      }
    });
  for (auto& t : ts) t.join();
  CHECK(c.value() == kThreads * kIters);
  CHECK(g.value() == kThreads * kIters);
  CHECK(h.count() == kThreads * kIters);
  CHECK(h.bucket_counts()[0] == kThreads * kIters / 2);
}

TEST_CASE("metrics: collectors run before each render") {
  Registry r;
  auto& g = r.gauge("sampled", "S.");
  int calls = 0;
  r.on_collect([&] { g.set(++calls); });
  CHECK(parse(r.render()).value("sampled") == 1);
  CHECK(parse(r.render()).value("sampled") == 2);
}

TEST_CASE("metrics: record_comm counts calls, bytes and seconds per op and backend") {
  auto& reg = dt::metrics::default_registry();
  auto val = [&](const char* name, const char* op, const char* be) {
    auto e = parse(reg.render());
    for (const auto& s : e.samples)
      if (s.name == name &&
          s.labels == std::map<std::string, std::string>{{"op", op}, {"backend", be}})
        return s.value;
    return 0.0;
  };
  const double c0 = val("dt_comm_calls_total", "all_reduce", "unit");
  const double b0 = val("dt_comm_bytes_total", "all_reduce", "unit");
  std::string op = "all_reduce";  // not a literal: the hook must compare contents
  dt::metrics::record_comm(op.c_str(), "unit", 1024, 0.5);
  dt::metrics::record_comm("all_reduce", "unit", 2048, 0.25);
  dt::metrics::record_comm("broadcast", "unit", 8, 0.125);
  dt::metrics::record_comm(nullptr, nullptr, 1, 0);
  CHECK(val("dt_comm_calls_total", "all_reduce", "unit") - c0 == 2);
  CHECK(val("dt_comm_bytes_total", "all_reduce", "unit") - b0 == 3072);
  CHECK(val("dt_comm_seconds_total", "all_reduce", "unit") >= 0.75);
  CHECK(val("dt_comm_calls_total", "broadcast", "unit") >= 1);
  CHECK(val("dt_comm_calls_total", "unknown", "unknown") >= 1);
  auto e = parse(reg.render());
  CHECK(e.type["dt_comm_calls_total"] == "counter");
  // From many threads at once.
  const double c1 = val("dt_comm_calls_total", "all_reduce", "unit");
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t)
    ts.emplace_back([] {
      for (int i = 0; i < 10000; ++i) dt::metrics::record_comm("all_reduce", "unit", 4, 1e-6);
    });
  for (auto& t : ts) t.join();
  CHECK(val("dt_comm_calls_total", "all_reduce", "unit") - c1 == 40000);
  // Label sets stay bounded: beyond 64 pairs, new ones are counted as other/other.
  for (int i = 0; i < 80; ++i)
    dt::metrics::record_comm(("op" + std::to_string(i)).c_str(), "many", 1, 0);
  e = parse(reg.render());
  std::size_t series = 0;
  for (const auto& s : e.samples) series += s.name == "dt_comm_calls_total";
  CHECK(series <= 65);
  CHECK(val("dt_comm_calls_total", "other", "other") >= 1);
}

TEST_CASE("metrics: an atomic write never writes through a link at its temporary name") {
  dt::test::TempDir dir("dt_metrics_links");
  const std::string victim = dir.write("victim", "mine\n");
  const std::string path = (dir.path / "dt.prom").string();
  // The next temporary name, from the message of a write whose rename fails (onto a folder).
  fs::create_directories(dir.path / "folder" / "x");
  std::string message;
  try {
    dt::metrics::write_file_atomically((dir.path / "folder").string(), "a");
  } catch (const dt::Error& e) {
    message = e.what();
  }
  const std::string marker = "folder.tmp." + std::to_string(::getpid()) + ".";
  const std::size_t at = message.find(marker);
  REQUIRE_MESSAGE(at != std::string::npos, message);
  const long next = std::stol(message.substr(at + marker.size())) + 1;
  // Links to the victim at the next names (as another writer of a shared folder could plant).
  for (long n = next; n < next + 5; ++n)
    fs::create_symlink(victim,
                       path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(n));
  dt::metrics::write_file_atomically(path, "a 1\n", true);
  CHECK(slurp(path) == "a 1\n");
  CHECK(slurp(victim) == "mine\n");
  CHECK_FALSE(fs::is_symlink(path));
}

TEST_CASE("metrics: textfile written atomically") {
  dt::test::TempDir dir("dt_metrics");
  const std::string path = (dir.path / "dt.prom").string();
  dt::metrics::write_file_atomically(path, "a 1\n");
  CHECK(slurp(path) == "a 1\n");
  dt::metrics::write_file_atomically(path, "a 2\n");
  CHECK(slurp(path) == "a 2\n");
  std::size_t files = 0;
  for (const auto& f : fs::directory_iterator(dir.path)) files += f.is_regular_file();
  CHECK(files == 1);  // no temporary file left behind
  CHECK_THROWS_WITH_AS(
      dt::metrics::write_file_atomically((dir.path / "no/such/x.prom").string(), "a"),
      doctest::Contains("no/such/x.prom"), dt::Error);

  // Two threads writing the same file at once (the watchdog's trace and the main thread's): each
  // write is whole, none fails, and the file ends as one of them wrote it.
  const std::string a(200000, 'a'), b(150000, 'b');
  std::string errors;
  std::mutex mu;
  auto writer = [&](const std::string& text) {
    for (int i = 0; i < 200; ++i) try {
        dt::metrics::write_file_atomically(path, text);
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lk(mu);
        errors += std::string(e.what()) + "; ";
      }
  };
  std::thread ta(writer, std::cref(a)), tb(writer, std::cref(b));
  ta.join();
  tb.join();
  CHECK_MESSAGE(errors.empty(), errors);
  const std::string got = slurp(path);
  CHECK((got == a || got == b));
  files = 0;
  for (const auto& f : fs::directory_iterator(dir.path)) files += f.is_regular_file();
  CHECK(files == 1);

  // Through an exporter, with the constant labels of the textfile.
  Registry r;
  r.gauge("dt_train_loss", "Loss.").set(2.5);
  dt::metrics::ExporterOptions o;
  o.textfile = path;
  o.textfile_labels = {{"rank", "1"}};
  dt::metrics::Exporter ex(r, o);
  CHECK(ex.port() == 0);
  CHECK(ex.publish_now());
  auto e = parse(slurp(path));
  CHECK(e.value("dt_train_loss", {{"rank", "1"}}) == 2.5);
  // A failing write warns once and is counted; the exporter goes on.
  std::vector<std::string> warnings;
  o.textfile = (dir.path / "gone" / "x.prom").string();
  dt::metrics::Exporter bad(r, o, [&](const std::string& w) { warnings.push_back(w); });
  CHECK_FALSE(bad.publish_now());
  CHECK_FALSE(bad.publish_now());
  REQUIRE(warnings.size() == 1);
  CHECK(warnings[0].find("gone/x.prom") != std::string::npos);
  CHECK(parse(r.render()).value("dt_metrics_export_failures_total", {{"kind", "textfile"}}) == 2);
}

TEST_CASE("metrics: HTTP /metrics on an ephemeral port") {
  Registry r;
  auto& c = r.counter("dt_requests_total", "R.", {{"k", "v"}});
  c.inc(7);
  dt::metrics::ExporterOptions o;
  o.host = "127.0.0.1";
  o.port = -1;
  int port = 0;
  {
    dt::metrics::Exporter ex(r, o);
    port = ex.port();
    REQUIRE(port > 0);
    Reply rep = http_get(port, "/metrics");
    CHECK(rep.status == 200);
    auto e = parse(rep.body);
    CHECK(e.value("dt_requests_total", {{"k", "v"}}) == 7);
    c.inc();
    CHECK(parse(http_get(port, "/metrics").body).value("dt_requests_total", {{"k", "v"}}) == 8);
    CHECK(http_get(port, "/other").status == 404);
    // A request with a body larger than any scrape's is refused (413), not read.
    CHECK(exchange(connect_loopback(port),
                   "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n")
              .rfind("HTTP/1.1 413", 0) == 0);
    // A chunked body (no length to refuse it by) is not read past 128 KiB: the connection ends
    // long before 4 MiB are sent, and the server still answers.
    {
      const int fd = connect_loopback(port);
      // A small send buffer, and sends that give up after 5 s: what the server does not read
      // stops the sender after a few hundred KiB (the socket buffers), and its close ends it.
      const int small = 16 << 10;
      ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &small, sizeof small);
      const timeval five{5, 0};
      ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &five, sizeof five);
      const std::string head =
          "POST /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
      REQUIRE(::send(fd, head.data(), head.size(), MSG_NOSIGNAL) ==
              static_cast<ssize_t>(head.size()));
      const std::string chunk = "4000\r\n" + std::string(0x4000, 'x') + "\r\n";
      std::size_t sent = 0;
      while (sent < (std::size_t{4} << 20)) {
        const ssize_t k = ::send(fd, chunk.data(), chunk.size(), MSG_NOSIGNAL);
        if (k <= 0) break;
        sent += static_cast<std::size_t>(k);
      }
      CHECK(sent < (std::size_t{4} << 20));
      ::close(fd);
    }
    CHECK(http_get(port, "/metrics").status == 200);
    // A Range header of a thousand ranges is ignored: the whole text once (200), not a multipart
    // body that repeats it a thousand times.
    {
      std::string ranges = "bytes=0-";
      for (int k = 1; k < 1000; ++k) ranges += ",0-";
      const std::string plain = http_get(port, "/metrics").body;
      const std::string all =
          exchange(connect_loopback(port), "GET /metrics HTTP/1.1\r\nHost: x\r\nRange: " + ranges +
                                               "\r\nConnection: close\r\n\r\n");
      CHECK(all.rfind("HTTP/1.1 200", 0) == 0);
      CHECK(all.size() < 2 * plain.size() + 1024);
    }
    // The same port again is refused with a message naming it.
    o.port = port;
    CHECK_THROWS_WITH_AS(dt::metrics::Exporter(r, o),
                         doctest::Contains(std::to_string(port).c_str()), dt::ConfigError);
  }
  // Stopped: nothing listens any more.
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  CHECK(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0);
  ::close(fd);
}

TEST_CASE("metrics: a connection is closed at its deadline, and scrapes are answered meanwhile") {
  // 40 clients trickle a request a byte every 0.2 s (more clients than the server's 32 threads,
  // and never a second without a byte): each is closed once its deadline has passed, not
  // before, while a scrape made meanwhile is answered. Without the deadline the clients would
  // hold every thread for as long as they keep sending, and the scrape would wait.
  using Clock = std::chrono::steady_clock;
  Registry r;
  r.counter("dt_requests_total", "R.").inc(3);
  dt::metrics::ExporterOptions o;
  o.host = "127.0.0.1";
  o.port = -1;
  o.request_deadline_s = 1.0;
  dt::metrics::Exporter ex(r, o);
  const int port = ex.port();
  REQUIRE(port > 0);
  constexpr int kClients = 40;
  std::vector<int> fds;
  std::vector<double> closed_after(kClients, -1);  // seconds from the first connect, -1: open
  const auto t0 = Clock::now();
  for (int i = 0; i < kClients; ++i) {
    fds.push_back(connect_loopback(port));
    const std::string start = "GET /metrics HTTP/1.1\r\nHost: x\r\n";
    REQUIRE(::send(fds.back(), start.data(), start.size(), MSG_NOSIGNAL) ==
            static_cast<ssize_t>(start.size()));
  }
  std::atomic<bool> trickling{true};
  std::atomic<int> still_open{kClients};
  std::thread trickler([&] {
    while (trickling.load()) {
      for (int i = 0; i < kClients; ++i) {
        if (closed_after[i] >= 0) continue;
        char c;
        const ssize_t k = ::recv(fds[i], &c, 1, MSG_DONTWAIT);
        const bool closed = k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK) ||
                            ::send(fds[i], "X", 1, MSG_NOSIGNAL) < 0;
        if (closed) {
          closed_after[i] = std::chrono::duration<double>(Clock::now() - t0).count();
          --still_open;
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      if (Clock::now() - t0 > std::chrono::seconds(20)) break;
    }
  });
  struct Joined {  // the trickler ends before the test does, also where a REQUIRE leaves it
    std::atomic<bool>& on;
    std::thread& t;
    ~Joined() {
      on = false;
      if (t.joinable()) t.join();
    }
  } joined{trickling, trickler};
  // A scrape while they trickle, its own reads bounded (10 s) so that a held server fails it.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const int s = connect_loopback(port);
  timeval tv{10, 0};
  ::setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  const std::string reply = exchange(s, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  CHECK(reply.rfind("HTTP/1.1 200", 0) == 0);
  CHECK(reply.find("Connection: close\r\n") != std::string::npos);  // one request a connection
  CHECK(reply.find("dt_requests_total 3") != std::string::npos);
  // Every trickling client is closed within the 20 s the trickler runs.
  while (still_open.load() > 0 && Clock::now() - t0 < std::chrono::seconds(20))
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  trickling = false;
  trickler.join();
  for (int i = 0; i < kClients; ++i) {
    INFO("client ", i, " closed after ", closed_after[i], " s");
    CHECK(closed_after[i] >= o.request_deadline_s);
    ::close(fds[i]);
  }
}

namespace {
// How many of the connections `fds` the server closes within `span` (each polled every 20 ms).
int closed_within(const std::vector<int>& fds, std::chrono::milliseconds span) {
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<char> closed(fds.size(), 0);
  int n = 0;
  while (std::chrono::steady_clock::now() - t0 < span) {
    for (std::size_t i = 0; i < fds.size(); ++i) {
      if (closed[i]) continue;
      char b;
      const ssize_t k = ::recv(fds[i], &b, 1, MSG_DONTWAIT);
      if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) {
        closed[i] = 1;
        ++n;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return n;
}
}  // namespace

TEST_CASE("metrics: a flood of idle connections is cut beyond those served and waiting") {
  // 480 connections that send nothing: 32 are served (each dropped after a second without a
  // byte), 256 wait, and the rest are closed at once. Without the bound every one waits for a
  // thread, holding its descriptor, and about 32 a second are dropped. Then, the flood gone, a
  // scrape is answered.
  Registry r;
  r.counter("dt_requests_total", "R.").inc(5);
  dt::metrics::ExporterOptions o;
  o.host = "127.0.0.1";
  o.port = -1;
  dt::metrics::Exporter ex(r, o);
  const int port = ex.port();
  REQUIRE(port > 0);
  constexpr int kClients = 480;
  std::vector<int> fds;
  for (int i = 0; i < kClients; ++i) fds.push_back(connect_loopback(port));
  const int n = closed_within(fds, std::chrono::milliseconds(700));
  INFO(n, " of ", kClients, " connections closed by the server within 0.7 s");
  CHECK(n >= kClients - 32 - 256 - 16);  // (a few served may be taken up and dropped later)
  CHECK(n <= kClients - 256);
  for (int fd : fds) ::close(fd);
  const int s = connect_loopback(port);
  timeval tv{10, 0};
  ::setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  const std::string reply = exchange(s, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  CHECK(reply.find("dt_requests_total 5") != std::string::npos);
}

// Where the process may open few descriptors, the connections held are fewer: with a limit of
// 512, 10 served and 21 waiting (a sixteenth of 512 in all), not 32 and 256, which a flood would
// take from the run's files and sockets.
TEST_CASE("metrics: the connections held follow the limit on open files") {
  rlimit was{};
  REQUIRE(::getrlimit(RLIMIT_NOFILE, &was) == 0);
  rlimit low = was;
  low.rlim_cur = 512;
  REQUIRE(::setrlimit(RLIMIT_NOFILE, &low) == 0);
  int n = 0;
  constexpr int kClients = 160;
  {
    Registry r;
    dt::metrics::ExporterOptions o;
    o.host = "127.0.0.1";
    o.port = -1;
    dt::metrics::Exporter ex(r, o);
    REQUIRE(ex.port() > 0);
    std::vector<int> fds;
    for (int i = 0; i < kClients; ++i) fds.push_back(connect_loopback(ex.port()));
    n = closed_within(fds, std::chrono::milliseconds(700));
    for (int fd : fds) ::close(fd);
  }
  REQUIRE(::setrlimit(RLIMIT_NOFILE, &was) == 0);
  INFO(n, " of ", kClients, " connections closed by the server within 0.7 s");
  CHECK(n >= kClients - 10 - 21 - 4);
}

TEST_CASE("metrics: stopping the server ends the connections under way") {
  // A client trickles its request (within its deadline, never a second without a byte) while the
  // exporter goes: once the exporter is gone, so is the connection. (Left to its deadline, it
  // would outlive the exporter, on a thread left running.)
  Registry r;
  dt::metrics::ExporterOptions o;
  o.host = "127.0.0.1";
  o.port = -1;
  o.request_deadline_s = 30;
  auto ex = std::make_unique<dt::metrics::Exporter>(r, o);
  const int fd = connect_loopback(ex->port());
  std::atomic<bool> trickling{true};
  std::thread trickler([&] {
    (void)!::send(fd, "GET /metrics HTTP/1.1\r\n", 23, MSG_NOSIGNAL);
    while (trickling.load()) {
      (void)!::send(fd, "X", 1, MSG_NOSIGNAL);
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  ex.reset();
  timeval tv{2, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  char c;
  const ssize_t k = ::recv(fd, &c, 1, 0);
  const int err = errno;
  trickling = false;
  trickler.join();
  ::close(fd);
  CHECK(k <= 0);
  CHECK_FALSE((k < 0 && (err == EAGAIN || err == EWOULDBLOCK)));  // not still waiting
}

TEST_CASE("metrics: push path encodes the grouping key") {
  CHECK(dt::metrics::push_path("1234", "0") == "/metrics/job/1234/instance/0");
  CHECK(dt::metrics::push_path("my job", "r:1") == "/metrics/job/my%20job/instance/r%3A1");
  CHECK(dt::metrics::push_path("a/b", "") == "/metrics/job@base64/YS9i/instance@base64/=");
}

TEST_CASE("metrics: push to a gateway; failures warn once and never throw") {
  Registry r;
  r.gauge("dt_train_loss", "Loss.").set(1.25);
  {
    OneShotServer gw(200);
    dt::metrics::ExporterOptions o;
    o.push_url = "http://127.0.0.1:" + std::to_string(gw.port) + "/";
    o.job = "42";
    o.instance = "3";
    dt::metrics::Exporter ex(r, o);
    CHECK(ex.publish_now());
    gw.t.join();
    CHECK(gw.method == "PUT");
    CHECK(gw.path == "/metrics/job/42/instance/3");
    CHECK(parse(gw.body).value("dt_train_loss") == 1.25);
  }
  // A push that fails: job j, instance 0, a timeout of 0.5 s.
  const auto failing_push_to = [](int port) {
    dt::metrics::ExporterOptions o;
    o.push_url = "http://127.0.0.1:" + std::to_string(port);
    o.job = "j";
    o.instance = "0";
    o.push_timeout_s = 0.5;
    return o;
  };
  {
    OneShotServer gw(500);  // a gateway that refuses
    std::vector<std::string> warnings;
    dt::metrics::Exporter ex(r, failing_push_to(gw.port),
                             [&](const std::string& w) { warnings.push_back(w); });
    CHECK_FALSE(ex.publish_now());
    gw.t.join();
    CHECK_FALSE(ex.publish_now());  // nobody listens now: connection refused
    REQUIRE(warnings.size() == 1);
    CHECK(warnings[0].find("HTTP 500") != std::string::npos);
    CHECK(warnings[0].find("/metrics/job/j/instance/0") != std::string::npos);
  }
  {
    // A gateway that answers a byte every 0.1 s passes each wait's timeout (0.5 s): the push as
    // a whole ends at its timeout, a failure, where it used to read the 1000 bytes for 100 s.
    OneShotServer gw(200, /*trickle_reply=*/true);
    std::vector<std::string> warnings;
    dt::metrics::Exporter ex(r, failing_push_to(gw.port),
                             [&](const std::string& w) { warnings.push_back(w); });
    const auto t0 = std::chrono::steady_clock::now();
    CHECK_FALSE(ex.publish_now());
    const double took =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CHECK(took < 10.0);
    REQUIRE(warnings.size() == 1);
    CHECK(warnings[0].find("no complete reply within 0.5 s (--metrics.push-timeout-s)") !=
          std::string::npos);
    CHECK(ex.push_waits());
  }
  dt::metrics::ExporterOptions o;
  o.push_url = "https://gw:9091";
  CHECK_THROWS_WITH_AS(dt::metrics::Exporter(r, o), doctest::Contains("metrics.push-url"),
                       dt::ConfigError);
}

TEST_CASE("metrics: publish() exports from the background thread") {
  dt::test::TempDir dir("dt_metrics_bg");
  const std::string path = (dir.path / "bg.prom").string();
  Registry r;
  r.gauge("v", "V.").set(9);
  dt::metrics::ExporterOptions o;
  o.textfile = path;
  dt::metrics::Exporter ex(r, o);
  ex.publish();
  for (int i = 0; i < 2000 && !fs::exists(path); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  REQUIRE(fs::exists(path));
  CHECK(parse(slurp(path)).value("v") == 9);
}
