#include "pmix_info.hpp"

#include <pmix.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace dt {

namespace {

// Reads an integer-valued key of `proc`; false if absent or not an integer.
bool get_int(const pmix_proc_t* proc, const char* key, long* out) {
  pmix_value_t* v = nullptr;
  if (PMIx_Get(proc, key, nullptr, 0, &v) != PMIX_SUCCESS || !v) return false;
  bool ok = true;
  switch (v->type) {
    case PMIX_UINT16:
      *out = v->data.uint16;
      break;
    case PMIX_UINT32:
      *out = static_cast<long>(v->data.uint32);
      break;
    case PMIX_UINT64:
      *out = static_cast<long>(v->data.uint64);
      break;
    case PMIX_INT:
      *out = v->data.integer;
      break;
    case PMIX_INT32:
      *out = v->data.int32;
      break;
    case PMIX_UINT:
      *out = static_cast<long>(v->data.uint);
      break;
    case PMIX_PROC_RANK:
      *out = static_cast<long>(v->data.rank);
      break;
    default:
      ok = false;
  }
  PMIX_VALUE_RELEASE(v);
  return ok;
}

}  // namespace

PmixClient::PmixClient() {
  if (!std::getenv("PMIX_NAMESPACE")) return;
  pmix_proc_t me;
  PMIX_PROC_CONSTRUCT(&me);
  if (PMIx_Init(&me, nullptr, 0) != PMIX_SUCCESS) return;
  active_ = true;
  std::snprintf(nspace_, sizeof nspace_, "%s", me.nspace);
  rank_ = me.rank;
}

PmixClient::~PmixClient() {
  if (active_) PMIx_Finalize(nullptr, 0);
}

std::optional<Placement> PmixClient::placement() const {
  if (!active_) return std::nullopt;
  pmix_proc_t me, job;
  PMIX_PROC_CONSTRUCT(&me);
  PMIX_PROC_CONSTRUCT(&job);
  PMIX_LOAD_PROCID(&me, nspace_, rank_);
  PMIX_LOAD_PROCID(&job, nspace_, PMIX_RANK_WILDCARD);
  long node = 0, nodes = 0, lrank = 0, lsize = 0;
  if (!get_int(&me, PMIX_NODEID, &node) || !get_int(&job, PMIX_NUM_NODES, &nodes) ||
      !get_int(&me, PMIX_LOCAL_RANK, &lrank) || !get_int(&job, PMIX_LOCAL_SIZE, &lsize))
    return std::nullopt;
  Placement p;
  p.node_id = static_cast<int>(node);
  p.num_nodes = static_cast<int>(nodes);
  p.local_rank = static_cast<int>(lrank);
  p.local_size = static_cast<int>(lsize);
  p.source = "pmix";
  return p;
}

}  // namespace dt
