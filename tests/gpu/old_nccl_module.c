/* A libdt_nccl.so built for another version of dt (0.0.0): dt must refuse it by its version
 * before calling anything else in it. */
#include <stddef.h>

__attribute__((visibility("default"))) const char* dt_nccl_module_version(void) { return "0.0.0"; }

__attribute__((visibility("default"))) void* dt_nccl_module_create(void* bootstrap, int device,
                                                                  void* stream, const char* name) {
  (void)bootstrap;
  (void)device;
  (void)stream;
  (void)name;
  return NULL;
}
