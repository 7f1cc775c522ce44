#include "shm_segment.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "mpi_comm.hpp"

namespace dt {

namespace {
std::atomic<unsigned> g_segments{0};
}  // namespace

bool realtime_thread() noexcept {
  thread_local const bool rt = [] {
    // A QoS tier's threads run SCHED_FIFO | SCHED_RESET_ON_FORK (src/qos/qos.cpp), which
    // sched_getscheduler reports with the flag.
    const int p = sched_getscheduler(0) & ~SCHED_RESET_ON_FORK;
    return p == SCHED_FIFO || p == SCHED_RR;
  }();
  return rt;
}

ShmSegment ShmSegment::create(const MpiComm& local, std::size_t bytes, const char* prefix,
                              std::string* err) {
  ShmSegment s;
  std::string e;
  const int me = local.rank();
  char name[64] = {0};
  int fd = -1;
  if (me == 0) {
    // "/PREFIX-jJOB-PID-N" under Slurm (the job's epilog removes what a killed job left in
    // /dev/shm), "/PREFIX-PID-N" elsewhere. A name already taken (the file of a killed process
    // whose pid came back, or of another PID namespace sharing /dev/shm) moves on to the next N.
    std::string job;
    if (const char* j = std::getenv("SLURM_JOB_ID"))
      for (const char* c = j; *c && job.size() < 20; ++c)
        if (*c >= '0' && *c <= '9') job += *c;
    if (!job.empty()) job = "j" + job + "-";
    for (int attempt = 0; attempt < 64; ++attempt) {
      std::snprintf(name, sizeof name, "/%s-%s%ld-%u", prefix, job.c_str(),
                    static_cast<long>(getpid()), g_segments.fetch_add(1));
      fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd >= 0 || errno != EEXIST) break;
    }
    if (fd < 0) {
      e = std::string("shm_open(") + name + ") failed: " + std::strerror(errno);
    } else {
      int rc = ftruncate(fd, static_cast<off_t>(bytes));
      if (rc == 0) {
        // Interrupted by a signal (a drain during start-up, on tmpfs): tried again, a few times
        // (a signal as frequent as the call itself would otherwise keep it going for ever).
        int tries = 0;
        do rc = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
        while (rc == EINTR && ++tries < 20);
      } else {
        rc = errno;
      }
      if (rc != 0) {
        e = "cannot reserve " + std::to_string(bytes) + " bytes in /dev/shm (" + name +
            "): " + std::strerror(rc);
        close(fd);
        fd = -1;
        shm_unlink(name);
      }
    }
    if (!e.empty()) name[0] = '\0';
  }
  // The name, or an empty one when rank 0 failed.
  const int sent = MPI_Bcast(name, sizeof name, MPI_CHAR, 0, local.handle());
  if (sent != MPI_SUCCESS && me == 0 && name[0] != '\0') shm_unlink(name);
  DT_MPI(sent, me, local.name());
  if (me != 0) {
    if (name[0] == '\0') {
      e = "local rank 0 could not create the segment";
    } else {
      fd = shm_open(name, O_RDWR, 0600);
      if (fd < 0) e = std::string("shm_open(") + name + ") failed: " + std::strerror(errno);
    }
  }
  if (fd >= 0 && e.empty()) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      e = "mmap of " + std::to_string(bytes) +
          " bytes of shared memory failed: " + std::strerror(errno);
    } else {
      s.p_ = p;
      s.bytes_ = bytes;
    }
  }
  if (fd >= 0) close(fd);
  // Everyone has mapped (or failed): the name is no longer needed.
  const int rc = MPI_Barrier(local.handle());
  if (me == 0 && name[0] != '\0') shm_unlink(name);
  DT_MPI(rc, me, local.name());
  if (err) *err = e;
  return s;
}

ShmSegment::~ShmSegment() {
  if (p_) munmap(p_, bytes_);
}

ShmSegment::ShmSegment(ShmSegment&& o) noexcept
    : p_(std::exchange(o.p_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}

ShmSegment& ShmSegment::operator=(ShmSegment&& o) noexcept {
  if (this != &o) {
    if (p_) munmap(p_, bytes_);
    p_ = std::exchange(o.p_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

}  // namespace dt
