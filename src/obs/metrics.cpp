#include "dt/metrics.hpp"

#include <fcntl.h>
#include <httplib.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <sstream>
#include <system_error>
#include <thread>

#include "dt/error.hpp"
#include "dt/qos.hpp"

namespace dt::metrics {

namespace {

void atomic_add(std::atomic<double>& a, double v) noexcept {
  double cur = a.load(std::memory_order_relaxed);
  while (!a.compare_exchange_weak(cur, cur + v, std::memory_order_relaxed)) {
  }
}

bool valid_name(const std::string& s, bool colon) {
  if (s.empty()) return false;
  for (std::size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    const bool alpha =
        (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (colon && c == ':');
    if (!(alpha || (i > 0 && c >= '0' && c <= '9'))) return false;
  }
  return true;
}

// Shortest text that reads back as the same double; Prometheus spellings for the specials.
std::string format_value(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char b[40];
  for (int prec = 15; prec <= 17; ++prec) {
    std::snprintf(b, sizeof b, "%.*g", prec, v);
    if (std::strtod(b, nullptr) == v) break;
  }
  return b;
}

std::string escape_help(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '\\')
      o += "\\\\";
    else if (c == '\n')
      o += "\\n";
    else
      o += c;
  }
  return o;
}

enum class Kind { counter, gauge, histogram };
const char* kind_name(Kind k) {
  return k == Kind::counter ? "counter" : k == Kind::gauge ? "gauge" : "histogram";
}

}  // namespace

void Counter::inc(double v) noexcept {
  if (v > 0) atomic_add(v_, v);
}

void Gauge::add(double v) noexcept { atomic_add(v_, v); }

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)) {
  for (std::size_t i = 0; i < bounds_.size(); ++i) {
    DT_CHECK(InvalidArgument, std::isfinite(bounds_[i]), "histogram bound ", i, " is ", bounds_[i],
             " (bounds must be finite; +Inf is implied)");
    DT_CHECK(InvalidArgument, i == 0 || bounds_[i] > bounds_[i - 1],
             "histogram bounds must increase strictly: ", bounds_[i - 1], " then ", bounds_[i]);
  }
  buckets_.reset(new std::atomic<std::uint64_t>[bounds_.size() + 1]);
  for (std::size_t i = 0; i <= bounds_.size(); ++i) buckets_[i].store(0);
}

void Histogram::observe(double v) noexcept {
  std::size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i]) ++i;  // le: v <= bound falls into bucket i
  buckets_[i].fetch_add(1, std::memory_order_relaxed);
  atomic_add(sum_, v);
}

std::vector<std::uint64_t> Histogram::bucket_counts() const {
  std::vector<std::uint64_t> out(bounds_.size() + 1);
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = buckets_[i].load(std::memory_order_relaxed);
  return out;
}

std::uint64_t Histogram::count() const noexcept {
  std::uint64_t n = 0;
  for (std::size_t i = 0; i <= bounds_.size(); ++i)
    n += buckets_[i].load(std::memory_order_relaxed);
  return n;
}

std::vector<double> exponential_buckets(double start, double factor, int count) {
  DT_CHECK(InvalidArgument, start > 0 && factor > 1 && count >= 1,
           "exponential_buckets needs start > 0, factor > 1, count >= 1; got ", start, ", ", factor,
           ", ", count);
  std::vector<double> b;
  for (int i = 0; i < count; ++i, start *= factor) b.push_back(start);
  return b;
}

std::string escape_label_value(const std::string& v) {
  std::string o;
  o.reserve(v.size());
  for (char c : v) {
    if (c == '\\')
      o += "\\\\";
    else if (c == '"')
      o += "\\\"";
    else if (c == '\n')
      o += "\\n";
    else
      o += c;
  }
  return o;
}

// ---- registry -----------------------------------------------------------------------------------

struct Registry::Impl {
  struct Series {
    Labels labels;
    std::unique_ptr<Counter> counter;
    std::unique_ptr<Gauge> gauge;
    std::unique_ptr<Histogram> histogram;
  };
  struct Family {
    std::string name, help;
    Kind kind;
    std::vector<double> bounds;
    std::deque<Series> series;
    std::map<Labels, Series*> index;
  };
  mutable std::mutex mu;
  std::deque<Family> families;
  std::map<std::string, Family*> by_name;
  std::vector<std::function<void()>> collectors;
  mutable std::mutex collect_mu;  // render() may run in several threads; collectors one at a time

  Series& get(const std::string& name, const std::string& help, Kind kind, Labels labels,
              const std::vector<double>* bounds, std::size_t max_series) {
    DT_CHECK(InvalidArgument, valid_name(name, true), "metric name '", name,
             "' is not valid (expected [a-zA-Z_:][a-zA-Z0-9_:]*)");
    for (const auto& [k, v] : labels) {
      DT_CHECK(InvalidArgument, valid_name(k, false) && k.rfind("__", 0) != 0, "metric ", name,
               ": label name '", k, "' is not valid (expected [a-zA-Z_][a-zA-Z0-9_]*, no __)");
      DT_CHECK(InvalidArgument, !(kind == Kind::histogram && k == "le"), "histogram ", name,
               ": the label name 'le' is reserved");
    }
    std::sort(labels.begin(), labels.end());
    for (std::size_t i = 1; i < labels.size(); ++i)
      DT_CHECK(InvalidArgument, labels[i].first != labels[i - 1].first, "metric ", name,
               ": label '", labels[i].first, "' given twice");
    std::lock_guard<std::mutex> lock(mu);
    Family* f;
    auto it = by_name.find(name);
    if (it == by_name.end()) {
      families.push_back(
          Family{name, help, kind, bounds ? *bounds : std::vector<double>{}, {}, {}});
      f = &families.back();
      by_name[name] = f;
    } else {
      f = it->second;
      DT_CHECK(InvalidArgument, f->kind == kind, "metric ", name, " is already a ",
               kind_name(f->kind), ", not a ", kind_name(kind));
      DT_CHECK(InvalidArgument, f->help == help, "metric ", name,
               " is already registered with another help text");
      DT_CHECK(InvalidArgument, !bounds || *bounds == f->bounds, "histogram ", name,
               " is already registered with other buckets");
    }
    auto s = f->index.find(labels);
    if (s != f->index.end()) return *s->second;
    DT_CHECK(InvalidArgument, f->series.size() < max_series, "metric ", name, " already has ",
             f->series.size(), " series: labels must not vary per step or per value");
    Series ns;
    ns.labels = labels;
    if (kind == Kind::counter) ns.counter = std::make_unique<Counter>();
    if (kind == Kind::gauge) ns.gauge = std::make_unique<Gauge>();
    if (kind == Kind::histogram) ns.histogram = std::make_unique<Histogram>(f->bounds);
    f->series.push_back(std::move(ns));
    f->index[labels] = &f->series.back();
    return f->series.back();
  }
};

Registry::Registry(std::size_t max_series_per_family)
    : impl_(std::make_unique<Impl>()), max_series_(max_series_per_family) {}
Registry::~Registry() = default;

Counter& Registry::counter(const std::string& name, const std::string& help, Labels labels) {
  return *impl_->get(name, help, Kind::counter, std::move(labels), nullptr, max_series_).counter;
}

Gauge& Registry::gauge(const std::string& name, const std::string& help, Labels labels) {
  return *impl_->get(name, help, Kind::gauge, std::move(labels), nullptr, max_series_).gauge;
}

Histogram& Registry::histogram(const std::string& name, const std::string& help,
                               std::vector<double> bounds, Labels labels) {
  // Checks the bounds before the family is created with them.
  { Histogram check(bounds); }
  return *impl_->get(name, help, Kind::histogram, std::move(labels), &bounds, max_series_)
              .histogram;
}

void Registry::on_collect(std::function<void()> fn) {
  std::lock_guard<std::mutex> lock(impl_->collect_mu);
  impl_->collectors.push_back(std::move(fn));
}

namespace {
void put_labels(std::string& out, const Labels& extra, const Labels& own,
                const char* le = nullptr) {
  if (extra.empty() && own.empty() && !le) return;
  out += '{';
  bool first = true;
  auto put = [&](const std::string& k, const std::string& v) {
    if (!first) out += ',';
    first = false;
    out += k;
    out += "=\"";
    out += escape_label_value(v);
    out += '"';
  };
  for (const auto& [k, v] : extra) put(k, v);
  for (const auto& [k, v] : own) put(k, v);
  if (le) put("le", le);
  out += '}';
}
}  // namespace

std::string Registry::render(const Labels& extra) const {
  {
    std::lock_guard<std::mutex> lock(impl_->collect_mu);
    for (const auto& fn : impl_->collectors) fn();
  }
  std::string out;
  std::lock_guard<std::mutex> lock(impl_->mu);
  for (const auto& f : impl_->families) {
    out += "# HELP " + f.name + " " + escape_help(f.help) + "\n";
    out += "# TYPE " + f.name + " " + kind_name(f.kind) + "\n";
    for (const auto& s : f.series) {
      if (f.kind != Kind::histogram) {
        out += f.name;
        put_labels(out, extra, s.labels);
        out += ' ';
        out += format_value(s.counter ? s.counter->value() : s.gauge->value());
        out += '\n';
        continue;
      }
      // Cumulative buckets from one read of the per-bucket counts, so that the +Inf bucket
      // and _count agree even while other threads observe.
      const auto counts = s.histogram->bucket_counts();
      std::uint64_t cum = 0;
      for (std::size_t i = 0; i < counts.size(); ++i) {
        cum += counts[i];
        const std::string le = i < f.bounds.size() ? format_value(f.bounds[i]) : "+Inf";
        out += f.name + "_bucket";
        put_labels(out, extra, s.labels, le.c_str());
        out += ' ' + std::to_string(cum) + '\n';
      }
      out += f.name + "_sum";
      put_labels(out, extra, s.labels);
      out += ' ' + format_value(s.histogram->sum()) + '\n';
      out += f.name + "_count";
      put_labels(out, extra, s.labels);
      out += ' ' + std::to_string(cum) + '\n';
    }
  }
  return out;
}

ResidentMemory resident_memory() {
  ResidentMemory m;
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return m;
  char line[256];
  while (std::fgets(line, sizeof line, f) != nullptr) {
    unsigned long long kib = 0;
    if (std::sscanf(line, "VmRSS: %llu kB", &kib) == 1) m.now = static_cast<double>(kib) * 1024.0;
    if (std::sscanf(line, "VmHWM: %llu kB", &kib) == 1) m.peak = static_cast<double>(kib) * 1024.0;
  }
  std::fclose(f);
  m.peak = std::max(m.peak, m.now);
  return m;
}

Registry& default_registry() {
  static Registry* r = new Registry();  // never destroyed: exporter threads may outlive main
  return *r;
}

// ---- record_comm --------------------------------------------------------------------------------

namespace {
struct CommSeries {
  Counter* calls = nullptr;
  Counter* bytes = nullptr;
  Counter* seconds = nullptr;
};

CommSeries comm_series(const std::string& op, const std::string& backend) {
  static std::mutex mu;
  static std::map<std::pair<std::string, std::string>, CommSeries>* known =
      new std::map<std::pair<std::string, std::string>, CommSeries>();
  constexpr std::size_t kMaxPairs = 64;
  std::lock_guard<std::mutex> lock(mu);
  auto key = std::make_pair(op, backend);
  auto it = known->find(key);
  if (it != known->end()) return it->second;
  if (known->size() >= kMaxPairs) key = {"other", "other"};
  it = known->find(key);
  if (it != known->end()) return it->second;
  Registry& r = default_registry();
  const Labels l = {{"op", key.first}, {"backend", key.second}};
  CommSeries s;
  s.calls = &r.counter("dt_comm_calls_total", "Completed communication operations.", l);
  s.bytes = &r.counter("dt_comm_bytes_total",
                       "Bytes of the buffers of completed communication operations.", l);
  s.seconds = &r.counter("dt_comm_seconds_total",
                         "Seconds spent in completed communication operations.", l);
  (*known)[key] = s;
  return s;
}

struct CommCacheEntry {
  std::string op, backend;
  CommSeries s;
};
}  // namespace

void record_comm(const char* op, const char* backend, std::size_t bytes, double seconds) noexcept {
  try {
    thread_local std::vector<CommCacheEntry> cache;
    if (!op) op = "unknown";
    if (!backend) backend = "unknown";
    const CommCacheEntry* e = nullptr;
    for (const auto& c : cache)
      if (std::strcmp(c.op.c_str(), op) == 0 && std::strcmp(c.backend.c_str(), backend) == 0) {
        e = &c;
        break;
      }
    if (!e) {
      cache.push_back(CommCacheEntry{op, backend, comm_series(op, backend)});
      e = &cache.back();
    }
    e->s.calls->inc();
    e->s.bytes->inc(static_cast<double>(bytes));
    e->s.seconds->inc(seconds);
  } catch (...) {
    // Out of memory or a broken registry: the call is not counted, the job goes on.
  }
}

// ---- files --------------------------------------------------------------------------------------

std::string temporary_prefix(const std::string& path) { return path + ".tmp."; }

void write_file_atomically(const std::string& path, const std::string& text, bool durable) {
  static std::atomic<std::uint64_t> calls{0};
  // A new file of this process's own (O_EXCL): never one already there, nor a symbolic link's
  // target (in a folder others can write, a link planted at a guessed name would have its
  // target overwritten). A name taken is passed over for the next.
  std::string tmp;
  int fd = -1;
  for (int attempt = 0; fd < 0; ++attempt) {
    tmp = temporary_prefix(path) + std::to_string(::getpid()) + "." + std::to_string(++calls);
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    if (fd < 0 && (errno != EEXIST || attempt == 100))
      DT_THROW(Error, "cannot write ", path, " (its temporary file ", tmp,
               "): ", std::strerror(errno));
  }
  int err = 0;
  for (std::size_t done = 0; done < text.size() && err == 0;) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n > 0)
      done += static_cast<std::size_t>(n);
    else if (n == 0)
      err = EIO;  // (a write of nothing would be tried for ever)
    else if (errno != EINTR)
      err = errno;
  }
  if (err == 0 && durable && ::fsync(fd) != 0) err = errno;
  if (::close(fd) != 0 && err == 0 && errno != EINTR) err = errno;
  if (err != 0) {
    ::unlink(tmp.c_str());
    DT_THROW(Error, "cannot write ", path, " (its temporary file ", tmp, "): ", std::strerror(err));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    err = errno;
    ::unlink(tmp.c_str());
    DT_THROW(Error, "cannot rename ", tmp, " to ", path, ": ", std::strerror(err));
  }
}

// ---- exporters ----------------------------------------------------------------------------------

namespace {
std::string percent_encode(const std::string& s) {
  std::string o;
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      o += static_cast<char>(c);
    } else {
      char b[4];
      std::snprintf(b, sizeof b, "%%%02X", c);
      o += b;
    }
  }
  return o;
}

std::string base64url(const std::string& s) {
  static const char* k = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
  std::string o;
  std::size_t i = 0;
  for (; i + 2 < s.size(); i += 3) {
    const unsigned v = (static_cast<unsigned char>(s[i]) << 16) |
                       (static_cast<unsigned char>(s[i + 1]) << 8) |
                       static_cast<unsigned char>(s[i + 2]);
    o += k[(v >> 18) & 63];
    o += k[(v >> 12) & 63];
    o += k[(v >> 6) & 63];
    o += k[v & 63];
  }
  if (i + 1 == s.size()) {
    const unsigned v = static_cast<unsigned char>(s[i]) << 16;
    o += k[(v >> 18) & 63];
    o += k[(v >> 12) & 63];
    o += "==";
  } else if (i + 2 == s.size()) {
    const unsigned v =
        (static_cast<unsigned char>(s[i]) << 16) | (static_cast<unsigned char>(s[i + 1]) << 8);
    o += k[(v >> 18) & 63];
    o += k[(v >> 12) & 63];
    o += k[(v >> 6) & 63];
    o += '=';
  }
  return o;
}

std::string grouping(const std::string& name, const std::string& value) {
  if (value.empty() || value.find('/') != std::string::npos)
    return "/" + name + "@base64/" + (value.empty() ? std::string("=") : base64url(value));
  return "/" + name + "/" + percent_encode(value);
}

constexpr const char* kContentType = "text/plain; version=0.0.4; charset=utf-8";

// Set while a connection is served to be closed at once, unread (ConnectionThreads::enqueue).
thread_local bool t_refused = false;

// The metrics server's connections, each on a thread of its own (made for it, ending with it), up
// to kMaxConnections at once; more wait for one to end, up to kMaxWaiting, and those beyond are
// closed at once (a flood of idle connections would otherwise hold a descriptor each until the
// process has none left). A client that holds its connection holds its own thread only, and only
// until the deadline (DeadlineServer), not the scrapes (httplib's pool of a few threads was held
// whole by as many such clients). shutdown() waits for the connections under way.
class ConnectionThreads final : public httplib::TaskQueue {
 public:
  // Where the process may open few descriptors (RLIMIT_NOFILE), fewer: the connections held take
  // at most a sixteenth of them, so that a flood leaves the run its files and sockets.
  static constexpr std::size_t kMaxConnections = 32, kMaxWaiting = 256;
  ConnectionThreads() {
    rlimit lim{};
    const std::size_t files = ::getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY
                                  ? static_cast<std::size_t>(lim.rlim_cur)
                                  : std::size_t{1} << 20;
    max_running_ = std::clamp<std::size_t>(files / 48, 1, kMaxConnections);
    max_waiting_ = std::clamp<std::size_t>(files / 24, 1, kMaxWaiting);
  }
  void enqueue(std::function<void()> fn) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (queue_.size() >= max_waiting_) {
      lock.unlock();
      t_refused = true;  // fn closes its socket (DeadlineServer::process_and_close_socket)
      fn();
      t_refused = false;
      return;
    }
    queue_.push_back(std::move(fn));
    if (running_ == max_running_) return;
    ++running_;
    try {
      std::thread([this] { run(); }).detach();
    } catch (const std::system_error&) {
      // No thread to be had (the process's limit on threads): a running one takes the
      // connection in its turn; with none running it is closed as a refused one is. Training
      // goes on either way (an exception here would end the process).
      if (--running_ > 0) return;
      std::function<void()> refused = std::move(queue_.back());
      queue_.pop_back();
      idle_.notify_all();
      lock.unlock();
      t_refused = true;
      refused();
      t_refused = false;
    }
  }
  void shutdown() override {
    std::unique_lock<std::mutex> lock(mu_);
    idle_.wait(lock, [this] { return running_ == 0; });
  }

 private:
  void run() {  // (named and given the io role by the handler: io_thread)
    for (;;) {
      std::function<void()> fn;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (queue_.empty()) {
          if (--running_ == 0) idle_.notify_all();
          return;
        }
        fn = std::move(queue_.front());
        queue_.pop_front();
      }
      fn();
    }
  }
  std::mutex mu_;
  std::condition_variable idle_;
  std::deque<std::function<void()>> queue_;
  std::size_t running_ = 0;
  std::size_t max_running_ = kMaxConnections, max_waiting_ = kMaxWaiting;
};

// A connection's socket as httplib's Stream, every wait bounded twice: by the idle limit (no byte
// for that long ends it) and by the connection's deadline (its whole request and answer); and
// what it reads bounded by kMaxRead (httplib refuses a Content-Length over the payload limit, but
// reads a chunked body, or one without a length, and header lines whole, however long).
class DeadlineStream final : public httplib::Stream {
 public:
  static constexpr std::size_t kMaxRead = 128 << 10;
  using Clock = std::chrono::steady_clock;
  // `server` is the listening socket, invalid once the server stops: the connection ends then.
  DeadlineStream(int sock, Clock::time_point deadline, std::chrono::milliseconds idle,
                 const std::atomic<socket_t>& server)
      : sock_(sock), deadline_(deadline), idle_(idle), server_(server) {}

  bool is_readable() const override { return have_ < got_ || wait(POLLIN); }
  bool is_writable() const override { return wait(POLLOUT); }
  // recv and send never block (MSG_DONTWAIT): httplib's sockets block, with timeouts of their
  // own that a send of a whole answer to a slow reader would wait out past the deadline.
  ssize_t read(char* ptr, std::size_t size) override {
    if (have_ == got_) {  // the buffer is spent: one recv refills it (httplib reads byte-wise)
      if (total_ >= kMaxRead) return -1;  // more than any scrape sends: the connection ends
      ssize_t k;
      do {
        if (!wait(POLLIN)) return -1;
        k = ::recv(sock_, buf_, sizeof buf_, MSG_DONTWAIT);
      } while (k < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK));
      if (k <= 0) return k;
      have_ = 0;
      got_ = static_cast<std::size_t>(k);
      total_ += got_;
    }
    const std::size_t n = std::min(size, got_ - have_);
    std::memcpy(ptr, buf_ + have_, n);
    have_ += n;
    return static_cast<ssize_t>(n);
  }
  ssize_t write(const char* ptr, std::size_t size) override {  // a part (httplib sends the rest)
    ssize_t k;
    do {
      if (!wait(POLLOUT)) return -1;
      k = ::send(sock_, ptr, size, MSG_NOSIGNAL | MSG_DONTWAIT);
    } while (k < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK));
    return k;
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    address(::getpeername, ip, port);
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    address(::getsockname, ip, port);
  }
  socket_t socket() const override { return sock_; }

 private:
  // Waits for `events` until the idle limit or the deadline, whichever is first, or until the
  // server stops (looked at every 100 ms).
  bool wait(short events) const {
    const Clock::time_point idle_end = Clock::now() + idle_;
    for (;;) {
      if (server_.load() == INVALID_SOCKET) return false;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          std::min(deadline_, idle_end) - Clock::now());
      if (left.count() <= 0) return false;
      pollfd p{sock_, events, 0};
      const int rc =
          ::poll(&p, 1, static_cast<int>(std::min(left, std::chrono::milliseconds(100)).count()));
      if (rc < 0 && errno == EINTR) continue;
      if (rc == 0) continue;
      return rc > 0 && (p.revents & (events | POLLHUP | POLLERR)) != 0;
    }
  }
  void address(int (*get)(int, sockaddr*, socklen_t*), std::string& ip, int& port) const {
    sockaddr_storage a{};
    socklen_t len = sizeof a;
    char host[NI_MAXHOST] = "", serv[NI_MAXSERV] = "";
    if (get(sock_, reinterpret_cast<sockaddr*>(&a), &len) == 0 &&
        ::getnameinfo(reinterpret_cast<sockaddr*>(&a), len, host, sizeof host, serv, sizeof serv,
                      NI_NUMERICHOST | NI_NUMERICSERV) == 0) {
      ip = host;
      port = std::atoi(serv);
    }
  }
  int sock_;
  Clock::time_point deadline_;
  std::chrono::milliseconds idle_;
  const std::atomic<socket_t>& server_;
  char buf_[4096];
  std::size_t have_ = 0, got_ = 0, total_ = 0;
};

// httplib's server with one request per connection, read and answered within a deadline from the
// moment a thread takes the connection up: a client that trickles its request is cut off then,
// where httplib's own reads wait a read timeout per byte and so hold a thread for as long as the
// client keeps sending. (process_and_close_socket is httplib's point for serving a socket its own
// way; process_request parses, routes and answers.)
class DeadlineServer final : public httplib::Server {
 public:
  explicit DeadlineServer(std::chrono::milliseconds deadline) : deadline_(deadline) {}
  // httplib listens with a backlog of 5, so a burst of connections beyond it waits for TCP's
  // retry a second later. Listening again on the bound socket sets a deeper one.
  void deepen_backlog() { ::listen(svr_sock_, SOMAXCONN); }

 private:
  bool process_and_close_socket(socket_t sock) override {
    DeadlineStream strm(sock, DeadlineStream::Clock::now() + deadline_, kIdle, svr_sock_);
    bool closed = false;
    // A Range header is ignored: each of its ranges (thousands fit in a request's headers) would
    // repeat the whole reply in one multipart body built in memory, megabytes for a few bytes.
    const bool ok = !t_refused && svr_sock_ != INVALID_SOCKET &&
                    process_request(strm, /*close_connection=*/true, closed,
                                    [](httplib::Request& req) { req.ranges.clear(); });
    ::shutdown(sock, SHUT_RDWR);
    ::close(sock);
    return ok;
  }
  static constexpr std::chrono::milliseconds kIdle{1000};  // a second without a byte: dropped
  std::chrono::milliseconds deadline_;
};
}  // namespace

std::string push_path(const std::string& job, const std::string& instance) {
  return "/metrics" + grouping("job", job) + grouping("instance", instance);
}

namespace {
std::int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace

// Blocks SIGPIPE in the calling thread for its lifetime, and discards one raised meanwhile: a
// push writes to a socket that a stop() or the gateway may have shut down, and httplib sends
// without MSG_NOSIGNAL (its server ignores SIGPIPE for the whole process, a push alone does not).
class NoSigpipe {
 public:
  NoSigpipe() {
    sigset_t pipe;
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    sigset_t pending;
    sigpending(&pending);
    was_pending_ = sigismember(&pending, SIGPIPE) == 1;
    blocked_ = pthread_sigmask(SIG_BLOCK, &pipe, &old_) == 0;
  }
  ~NoSigpipe() {
    if (!blocked_) return;
    sigset_t pending;
    sigpending(&pending);
    if (!was_pending_ && sigismember(&pending, SIGPIPE) == 1) {
      sigset_t pipe;
      sigemptyset(&pipe);
      sigaddset(&pipe, SIGPIPE);
      const timespec now{0, 0};
      while (sigtimedwait(&pipe, nullptr, &now) == SIGPIPE) {
      }
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  NoSigpipe(const NoSigpipe&) = delete;
  NoSigpipe& operator=(const NoSigpipe&) = delete;

 private:
  sigset_t old_{};
  bool blocked_ = false, was_pending_ = false;
};

struct Exporter::Impl {
  Registry& reg;
  ExporterOptions o;
  std::function<void(const std::string&)> warn;
  Counter* textfile_failures = nullptr;
  Counter* push_failures = nullptr;
  Counter* pushes = nullptr;
  std::string push_base;    // scheme://host:port of push_url
  std::string push_prefix;  // path of push_url (without a trailing slash)

  // The HTTP server, apart from the rest: a client that never finishes its request holds one of
  // the server's threads, and the exit does not wait for it (see ~Exporter).
  struct Serving {
    explicit Serving(std::chrono::milliseconds deadline) : server(deadline) {}
    DeadlineServer server;
    std::thread thread;
    std::promise<void> done;           // set when the server's thread ends
    std::shared_mutex gate;            // handlers read the registry under it
    std::atomic<bool> closing{false};  // handlers answer 503, before the gate and under it
    Registry* reg = nullptr;
  };
  std::unique_ptr<Serving> serving;

  std::mutex mu;
  std::condition_variable cv;
  bool pending = false;
  std::thread worker;
  std::timed_mutex export_mu;         // one export at a time (worker and publish_now)
  std::mutex active_mu;               // guards `active`
  httplib::Client* active = nullptr;  // the push in flight, which publish_now may stop
  bool active_stopped = false;        // ... and has stopped: its failure is no failure
  std::atomic<int> superseding{0};    // publish_now calls under way: background exports skip
  std::atomic<bool> closing{false};   // the exporter is going: background exports skip
  std::atomic<bool> worker_done{false};
  std::atomic<bool> warned_textfile{false}, warned_push{false};
  std::atomic<bool> push_failed{false};     // a push has failed (Exporter::push_waits)
  std::atomic<std::int64_t> push_since{0};  // steady_ns() at the start of the push in flight, or 0

  Impl(Registry& r, ExporterOptions opts, std::function<void(const std::string&)> w)
      : reg(r), o(std::move(opts)), warn(std::move(w)) {}

  void warn_once(std::atomic<bool>& flag, const std::string& msg) {
    if (flag.exchange(true)) return;
    if (warn)
      warn(msg);
    else
      std::fprintf(stderr, "dt: warning: %s\n", msg.c_str());
  }

  // Stops the push in flight, if any: httplib shuts its socket down, and it fails at once (one
  // still connecting, or resolving the gateway's name, stops once it has connected).
  void stop_active() {
    std::lock_guard<std::mutex> lock(active_mu);
    if (!active) return;
    active_stopped = true;
    active->stop();
  }

  // One export. The background thread's waits for its turn, and does nothing while a
  // publish_now is under way (it exports newer values) or the exporter is going. publish_now's
  // (foreground) stops whatever push holds the turn, again every 10 ms until it has it, so it
  // waits for no gateway's answer, then exports with the full push timeout.
  bool export_once(bool foreground = false) {
    std::unique_lock<std::timed_mutex> lock(export_mu, std::defer_lock);
    if (!foreground) {
      lock.lock();
      if (superseding.load() > 0 || closing.load()) return true;
    } else {
      while (!lock.try_lock_for(std::chrono::milliseconds(10))) stop_active();
    }
    // publish_now's claim ends with its turn, before the lock is let go (declared after it): a
    // background export that waited for the turn meanwhile sees the claim and skips.
    struct Claim {
      std::atomic<int>* n;
      ~Claim() {
        if (n) --*n;
      }
    } claim{foreground ? &superseding : nullptr};
    const NoSigpipe no_sigpipe;  // a push whose socket was shut down must not kill the rank
    bool ok = true;
    if (!o.textfile.empty()) {
      try {
        write_file_atomically(o.textfile, reg.render(o.textfile_labels));
      } catch (const Error& e) {
        ok = false;
        textfile_failures->inc();
        warn_once(warned_textfile, "metrics textfile: " + e.message() +
                                       "; training continues (further failures are not reported)");
      }
    }
    if (!push_base.empty()) {
      const std::string path = push_prefix + push_path(o.job, o.instance);
      std::string why;
      const auto us = std::chrono::duration_cast<std::chrono::microseconds>(
          std::chrono::duration<double>(o.push_timeout_s));
      try {
        httplib::Client cli(push_base);
        cli.set_connection_timeout(us);
        cli.set_read_timeout(us);
        cli.set_write_timeout(us);
        if (!o.push_user.empty()) cli.set_basic_auth(o.push_user, o.push_password);
        struct InFlight {  // push_since and `active` while the push waits for the gateway
          Impl& m;
          InFlight(Impl& impl, httplib::Client& c) : m(impl) {
            m.push_since = steady_ns();
            std::lock_guard<std::mutex> lock(m.active_mu);
            m.active = &c;
            m.active_stopped = false;
          }
          bool stopped() {
            std::lock_guard<std::mutex> lock(m.active_mu);
            return m.active_stopped;
          }
          ~InFlight() {
            std::lock_guard<std::mutex> lock(m.active_mu);
            m.active = nullptr;
            m.push_since = 0;
          }
        } in_flight(*this, cli);
        // The timeouts above bound each wait; the push as a whole is bounded too, so that a
        // gateway answering a byte at a time cannot hold the exporter (and publish_now's caller,
        // a run's end) beyond the push timeout.
        struct Deadline {
          Impl& m;
          std::mutex mu;
          std::condition_variable cv;
          bool done = false, expired = false;
          std::thread timer;
          Deadline(Impl& impl, double s) : m(impl) {
            timer = std::thread([this, s] {
              std::unique_lock<std::mutex> lock(mu);
              if (cv.wait_for(lock, std::chrono::duration<double>(s), [this] { return done; }))
                return;
              expired = true;
              lock.unlock();
              m.stop_active();
            });
          }
          bool end() {  // whether the push ran out of time
            {
              std::lock_guard<std::mutex> lock(mu);
              done = true;
            }
            cv.notify_one();
            if (timer.joinable()) timer.join();
            return expired;
          }
          ~Deadline() { end(); }
        } deadline(*this, o.push_timeout_s);
        auto res = cli.Put(path, reg.render(), kContentType);
        const bool expired = deadline.end();
        if (!res && expired) {
          std::ostringstream t;
          t << o.push_timeout_s;
          why = "no complete reply within " + t.str() + " s (--metrics.push-timeout-s)";
        } else if (!res && in_flight.stopped()) {
          return ok;  // superseded by publish_now, or shut down
        } else if (!res) {
          why = "no reply (" + httplib::to_string(res.error()) + " error)";
        } else if (res->status / 100 != 2) {
          why = "HTTP " + std::to_string(res->status) + " " + res->body;
        }
      } catch (const std::exception& e) {
        why = e.what();
      }
      if (why.empty()) {
        pushes->inc();
      } else {
        ok = false;
        push_failed = true;
        push_failures->inc();
        while (!why.empty() && (why.back() == '\n' || why.back() == ' ')) why.pop_back();
        warn_once(warned_push, "metrics push to " + push_base + path + " failed: " + why +
                                   "; training continues (further failures are not reported)");
      }
    }
    return ok;
  }

  void run_worker() {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      cv.wait(lock, [this] { return pending || closing.load(); });
      if (closing.load()) return;
      pending = false;
      lock.unlock();
      export_once();
      lock.lock();
    }
  }
};

namespace {
// Makes the calling thread one of the exporter's (once per thread): named "dt-metrics" (top,
// /proc/PID/task/TID/comm) and of the io role of a QoS tier (SCHED_BATCH), so that serving and
// writing metrics never take compute's time.
void io_thread() noexcept {
  thread_local bool done = false;
  if (done) return;
  done = true;
  pthread_setname_np(pthread_self(), "dt-metrics");
  qos::apply_to_current_thread(qos::Role::io);
}
}  // namespace

Exporter::Exporter(Registry& registry, ExporterOptions opts,
                   std::function<void(const std::string&)> warn)
    : impl_(std::make_unique<Impl>(registry, std::move(opts), std::move(warn))) {
  Impl& m = *impl_;
  m.textfile_failures = &registry.counter("dt_metrics_export_failures_total",
                                          "Failed metric exports.", {{"kind", "textfile"}});
  m.push_failures = &registry.counter("dt_metrics_export_failures_total", "Failed metric exports.",
                                      {{"kind", "push"}});
  m.pushes = &registry.counter("dt_metrics_pushes_total", "Successful pushes to the Pushgateway.");
  if (!m.o.push_url.empty()) {
    const std::string& u = m.o.push_url;
    // Credentials in the URL (any scheme) would be printed in warnings and kept with the run's
    // settings (in checkpoints too): refused, without repeating them.
    const std::size_t scheme = u.find("://");
    const std::size_t host = scheme == std::string::npos ? 0 : scheme + 3;
    // Any '@' after the scheme: a password may hold a '/' (http://user:pa/ss@gw), and a base
    // URL's path has no use for one (the grouping's @base64 segments are added to it).
    const std::size_t at = u.rfind('@');
    DT_CHECK(ConfigError, at == std::string::npos || at < host,
             "option --metrics.push-url: ", u.substr(0, host), u.substr(at + 1),
             " is given with credentials (USER:PASSWORD@), which would be printed and kept with "
             "the run's settings: put USER:PASSWORD in a file of your own (chmod 600) and name it "
             "with --metrics.push-auth-file");
    const std::size_t slash = u.find('/', 7);
    DT_CHECK(ConfigError, u.rfind("http://", 0) == 0 && u.size() > 7,
             "option --metrics.push-url: '", u,
             "' is not an http:// URL (expected http://HOST:PORT, e.g. http://gateway:9091)");
    m.push_base = u.substr(0, slash);
    m.push_prefix = slash == std::string::npos ? "" : u.substr(slash);
    while (!m.push_prefix.empty() && m.push_prefix.back() == '/') m.push_prefix.pop_back();
  }
  if (m.o.port != 0) {
    DT_CHECK(ConfigError, m.o.request_deadline_s >= 0.001 && m.o.request_deadline_s <= 3600,
             "metrics request deadline: ", m.o.request_deadline_s,
             " s (expected 0.001 to 3600 seconds)");
    m.serving = std::make_unique<Impl::Serving>(std::chrono::milliseconds(
        static_cast<std::int64_t>(std::llround(m.o.request_deadline_s * 1000))));
    Impl::Serving* sv = m.serving.get();
    sv->reg = &registry;
    DeadlineServer& server = sv->server;
    // Connections on threads of their own (ConnectionThreads), one request each (DeadlineServer):
    // clients that connect and say nothing are dropped after a second, clients that trickle their
    // request after request_deadline_s; none holds the exit.
    server.new_task_queue = [] { return new ConnectionThreads; };
    server.set_payload_max_length(64 * 1024);  // GET has no body: a large one is refused (413)
    // SO_REUSEADDR only: httplib's default adds SO_REUSEPORT, with which a second rank on the
    // same port would silently share it instead of failing.
    server.set_socket_options([](socket_t sock) {
      int yes = 1;
      ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    });
    server.Get("/metrics", [sv](const httplib::Request&, httplib::Response& res) {
      io_thread();  // a connection's thread (ConnectionThreads)
      if (sv->closing.load()) {
        res.status = 503;
        return;
      }
      std::shared_lock<std::shared_mutex> open(sv->gate);
      if (sv->closing.load()) {
        res.status = 503;
        return;
      }
      res.set_content(sv->reg->render(), kContentType);
    });
    // A host that does not resolve is named as such (the bind's errno would say nothing of it).
    {
      addrinfo hints{};
      hints.ai_family = AF_UNSPEC;
      hints.ai_socktype = SOCK_STREAM;
      hints.ai_flags = AI_PASSIVE;
      addrinfo* found = nullptr;
      const int rc =
          ::getaddrinfo(m.o.host.empty() ? nullptr : m.o.host.c_str(), "0", &hints, &found);
      if (found) ::freeaddrinfo(found);
      DT_CHECK(ConfigError, rc == 0, "option --metrics.host: '", m.o.host,
               "' is not an address of this host (", ::gai_strerror(rc),
               "); expected a host name or address to listen on, e.g. 0.0.0.0 or 127.0.0.1");
    }
    errno = 0;
    if (m.o.port < 0) {
      port_ = server.bind_to_any_port(m.o.host);
    } else {
      port_ = server.bind_to_port(m.o.host, m.o.port) ? m.o.port : -1;
    }
    DT_CHECK(ConfigError, port_ > 0, "option --metrics.port: cannot listen on ", m.o.host, ":",
             m.o.port < 0 ? std::string("(any port)") : std::to_string(m.o.port), ": ",
             errno != 0 ? std::strerror(errno) : "the address cannot be bound here",
             " (port in use? --metrics.port=-1 picks a free one)");
    server.deepen_backlog();
    sv->thread = std::thread([sv] {
      io_thread();
      sv->server.listen_after_bind();
      sv->done.set_value();
    });
    // stop() only works once the server runs: wait for it (microseconds; bounded).
    for (int i = 0; i < 5000 && !server.is_running(); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  m.worker = std::thread([&m] {
    io_thread();
    m.run_worker();
    m.worker_done = true;
  });
}

Exporter::~Exporter() {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lock(m.mu);  // the worker's wait reads it under mu
    m.closing = true;
  }
  m.cv.notify_all();
  // A push in flight is stopped (its values were published since, or never will be), again
  // until the worker has ended: one that was connecting stops once it has connected.
  while (m.worker.joinable() && !m.worker_done.load()) {
    m.stop_active();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (m.worker.joinable()) m.worker.join();
  if (m.serving && m.serving->thread.joinable()) {
    Impl::Serving& sv = *m.serving;
    sv.closing = true;  // new requests get 503 without queueing for the gate
    std::future<void> ended = sv.done.get_future();
    sv.server.stop();
    // A scrape that passed the check before `closing` was set ends first; later ones see it.
    { const std::unique_lock<std::shared_mutex> shut(sv.gate); }
    // The server's thread ends once its connections have, which see the stop within 0.1 s
    // (DeadlineStream). Should one not end within a second (a handler held up), the thread is
    // left to the process's end, with the server it uses (deliberately not freed); its handlers
    // no longer read the registry.
    if (ended.wait_for(std::chrono::seconds(1)) == std::future_status::ready) {
      sv.thread.join();
    } else {
      sv.thread.detach();
      static std::vector<Impl::Serving*> left;  // reachable, as the thread still uses it
      left.push_back(m.serving.release());
    }
  }
}

void Exporter::publish() {
  if (impl_->o.textfile.empty() && impl_->push_base.empty()) return;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->pending = true;
  }
  impl_->cv.notify_one();
}

bool Exporter::publish_now() {
  // The push in flight in the background sends older values than this one: it is stopped rather
  // than waited for, so this call waits for one push (a gateway that never answers held the
  // caller for that push's wait and then this one's).
  Impl& m = *impl_;
  ++m.superseding;  // let go by export_once with its turn
  {
    std::lock_guard<std::mutex> lock(m.mu);
    m.pending = false;  // what a background export would send, this one sends newer
  }
  return m.export_once(/*foreground=*/true);
}

bool Exporter::push_waits() const noexcept {
  // A gateway answers within milliseconds: a push waiting longer than 0.1 s waits for one that
  // may never answer.
  const std::int64_t since = impl_->push_since.load();
  return impl_->push_failed.load() || (since > 0 && steady_ns() - since > 100'000'000);
}

double Exporter::push_timeout_s() const noexcept { return impl_->o.push_timeout_s; }

}  // namespace dt::metrics
