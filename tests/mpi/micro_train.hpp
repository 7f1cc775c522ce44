// The micro training configuration the MPI training tests share (configs/micro.ini's model and
// schedule, fixed seed), so that their single-rank references agree.
#pragma once

#include "dt/train.hpp"

namespace dt::test {

/// micro: seq-len 32, embd 32, `layers` blocks of `heads` heads; global batch 8, `steps` steps,
/// seed 42, lr 3e-3 with 2 warm-up steps, 10% validation, 8 evaluation windows.
inline TrainConfig micro_train(const char* data_path, int steps, int layers = 2, int heads = 2) {
  TrainConfig c;
  c.model.block = 32;
  c.model.layers = layers;
  c.model.heads = heads;
  c.model.embd = 32;
  c.data_path = data_path;
  c.steps = steps;
  c.batch = 8;
  c.seed = 42;
  c.optim.lr = 3e-3;
  c.optim.warmup = 2;
  c.val_fraction = 0.1;
  c.eval_windows = 8;
  return c;
}

}  // namespace dt::test
